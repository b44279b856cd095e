"""KimiK3PrefixStore: a later prompt that extends an earlier call's sequence prefills only its new tokens and gives
the same tokens as a fresh generate (greedy, fp32: exact equality)."""

import pytest
import torch

from transformers_k3 import KimiK3PrefixStore


def _prefill_lengths(model):
    """The token count of every forward (the first is the prefill), recorded at the embedding."""
    lengths = []
    embed = model.get_input_embeddings()
    return lengths, embed.register_forward_hook(lambda module, args, out: lengths.append(args[0].shape[1]))


def test_second_turn_prefills_only_its_new_tokens(tiny_model):
    g = torch.Generator().manual_seed(0)
    store = KimiK3PrefixStore()
    turn1 = torch.randint(0, 500, (1, 30), generator=g)
    first = store.generate(tiny_model, turn1, max_new_tokens=8, do_sample=False)
    assert torch.equal(first, tiny_model.generate(turn1, max_new_tokens=8, do_sample=False))
    assert len(store) == 1
    turn2 = torch.cat([first, torch.randint(0, 500, (1, 7), generator=g)], dim=1)  # the conversation goes on
    expected = tiny_model.generate(turn2, max_new_tokens=8, do_sample=False)
    lengths, hook = _prefill_lengths(tiny_model)
    try:
        second = store.generate(tiny_model, turn2, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    finally:
        hook.remove()
    assert torch.equal(second.sequences, expected)
    # The stored cache held turn 1's prompt and its generated tokens but the last: 1 + 7 tokens are new.
    assert lengths[0] == turn2.shape[1] - (first.shape[1] - 1) == 8
    assert len(store) == 2


def test_unrelated_prompt_and_eviction(tiny_model):
    g = torch.Generator().manual_seed(1)
    store = KimiK3PrefixStore(max_entries=1)
    a, b = (torch.randint(0, 500, (1, 12), generator=g) for _ in range(2))
    store.generate(tiny_model, a, max_new_tokens=3, do_sample=False)
    lengths, hook = _prefill_lengths(tiny_model)
    try:
        out = store.generate(tiny_model, b, max_new_tokens=3, do_sample=False)
    finally:
        hook.remove()
    assert lengths[0] == 12  # no stored prefix: the whole prompt
    assert torch.equal(out, tiny_model.generate(b, max_new_tokens=3, do_sample=False))
    assert len(store) == 1 and store.lookup(a[0].tolist() + [1])[0] is None  # a's entry was evicted


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_ids=torch.zeros(2, 4, dtype=torch.long)), "one row"),
    (dict(input_ids=torch.zeros(1, 4, dtype=torch.long), cache_implementation="static"), "supplies the cache"),
    (dict(input_ids=torch.zeros(1, 4, dtype=torch.long), num_beams=2), "one sequence"),
])
def test_refuses_what_it_cannot_serve(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        KimiK3PrefixStore().generate(tiny_model, **kwargs)
