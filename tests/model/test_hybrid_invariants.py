"""The hybrid invariants on a tiny released-layout checkpoint, in fp32 (tolerance: max-abs error relative to max |ref|)."""

import pytest
import torch

from transformers import GenerationConfig
from transformers_k3 import KimiK3Cache
from transformers_k3.modeling_kimi_k3 import CACHE_KWARG
from helpers import rel_err

# Cached, chunked and absorbed paths sum in other orders than the full forward: fp32 rounding, well under 1e-4.
TOL = 5e-5


def ids(batch, length, seed=0, vocab=500):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


@torch.no_grad()
def test_cached_token_by_token_equals_full(lm):
    x = ids(2, 21)
    full = lm(input_ids=x, use_cache=False).logits
    cache = KimiK3Cache(lm.config)
    steps = [lm(input_ids=x[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(x.shape[1])]
    assert rel_err(torch.cat(steps, 1), full) < TOL


@torch.no_grad()
@pytest.mark.parametrize("split", [1, 5, 8, 13], ids=lambda s: f"prefix{s}")
def test_multi_token_cached_equals_full(lm, split):
    x = ids(2, 20, seed=1)
    full = lm(input_ids=x, use_cache=False).logits
    cache = KimiK3Cache(lm.config)
    a = lm(input_ids=x[:, :split], cache=cache, use_cache=True).logits
    b = lm(input_ids=x[:, split:], cache=cache, use_cache=True).logits
    assert rel_err(torch.cat([a, b], 1), full) < TOL
    assert cache.get_seq_length() == 20


@torch.no_grad()
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_expanded_cached_prefill_equals_full(lm, monkeypatch, attn):
    """Long cached chunks attend over the expanded K/V (prefix included), short ones over the absorbed latent;
    any mix of the two, with left padding, equals the cache-free forward. The threshold is lowered so the tiny
    model crosses it."""
    from transformers_k3 import modeling_kimi_k3

    monkeypatch.setattr(modeling_kimi_k3, "EXPANDED_PREFILL_MIN_TOKENS", 6)
    lm.set_attn_implementation(attn)
    try:
        x = ids(2, 24, seed=13)
        mask = torch.ones_like(x)
        mask[0, :4] = 0  # row 0 is left padded
        full = lm(input_ids=x, attention_mask=mask, use_cache=False).logits
        cache = KimiK3Cache(lm.config)
        outs, start = [], 0
        for size in (8, 3, 9, 1, 3):  # expanded (empty cache), absorbed, expanded over a prefix, decode, absorbed
            outs.append(lm(input_ids=x[:, start : start + size], attention_mask=mask[:, : start + size],
                           cache=cache, use_cache=True).logits)
            start += size
        got = torch.cat(outs, 1)
        assert rel_err(got[0, 4:], full[0, 4:]) < TOL and rel_err(got[1], full[1]) < TOL
    finally:
        lm.set_attn_implementation("sdpa")


@torch.no_grad()
def test_fresh_unpadded_prompt_attends_with_is_causal(lm, monkeypatch):
    """A fresh prompt without padding reaches the attention function as `is_causal=True` with no mask (what lets
    SDPA pick its flash / cuDNN kernels); padding or a cached prefix still pass the boolean mask. Same logits."""
    from transformers_k3 import modeling_kimi_k3

    calls, real = [], modeling_kimi_k3.eager_attention_forward
    monkeypatch.setattr(modeling_kimi_k3, "eager_attention_forward",
                        lambda *a, **kw: calls.append((a[4] is None, kw["is_causal"])) or real(*a, **kw))
    lm.set_attn_implementation("eager")
    try:
        x = ids(2, 12, seed=14)
        plain = lm(input_ids=x, use_cache=False).logits
        assert calls and all(c == (True, True) for c in calls)
        calls.clear()
        masked = lm(input_ids=x, attention_mask=torch.ones_like(x).index_fill(1, torch.tensor([0]), 0),
                    use_cache=False).logits
        assert calls and all(c == (False, False) for c in calls)
        assert rel_err(masked[:, 1:], plain[:, 1:]) > 1e-4  # the padded key really was hidden
        lm.set_attn_implementation("sdpa")
        sdpa_out = lm(input_ids=x, use_cache=False).logits
        assert rel_err(sdpa_out, plain) < TOL
    finally:
        lm.set_attn_implementation("sdpa")


@torch.no_grad()
def test_left_padded_equals_unpadded(lm):
    pad = lm.config.pad_token_id
    short, long = ids(1, 6, seed=2), ids(1, 11, seed=3)
    batch = torch.cat([torch.cat([torch.full((1, 5), pad), short], 1), long], 0)
    mask = torch.ones_like(batch)
    mask[0, :5] = 0
    out = lm(input_ids=batch, attention_mask=mask, use_cache=False).logits
    assert rel_err(out[0, 5:], lm(input_ids=short, use_cache=False).logits[0]) < TOL
    assert rel_err(out[1], lm(input_ids=long, use_cache=False).logits[0]) < TOL


@torch.no_grad()
def test_packed_equals_separate(lm):
    a, b, c = ids(1, 7, seed=4), ids(1, 1, seed=5), ids(1, 12, seed=6)
    packed = torch.cat([a, b, c], 1)
    position_ids = torch.cat([torch.arange(7), torch.arange(1), torch.arange(12)])[None]
    out = lm(input_ids=packed, position_ids=position_ids, use_cache=False).logits
    sep = torch.cat([lm(input_ids=s, use_cache=False).logits for s in (a, b, c)], 1)
    assert rel_err(out, sep) < TOL
    cu = torch.tensor([0, 7, 8, 20])
    out_cu = lm(input_ids=packed, cu_seq_lens_q=cu, use_cache=False).logits
    assert rel_err(out_cu, sep) < TOL
    # two packed rows at once: no leakage across rows either
    rows = torch.cat([packed, packed.flip(1)], 0)
    pos = torch.cat([position_ids, torch.cat([torch.arange(12), torch.arange(1), torch.arange(7)])[None]], 0)
    out2 = lm(input_ids=rows, position_ids=pos, use_cache=False).logits
    sep2 = torch.cat([lm(input_ids=s.flip(1), use_cache=False).logits for s in (c, b, a)], 1)
    assert rel_err(out2[0], sep[0]) < TOL and rel_err(out2[1], sep2[0]) < TOL


@torch.no_grad()
def test_packed_with_cache_raises(lm):
    x = ids(1, 8)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    with pytest.raises(ValueError, match="packed"):
        lm(input_ids=x, position_ids=pos, cache=KimiK3Cache(lm.config), use_cache=True)


@torch.no_grad()
def test_greedy_generate_matches_full_forward_argmax(lm):
    x = ids(2, 9, seed=7)
    out = lm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False)
    seq = x
    for _ in range(6):
        nxt = lm(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)


@torch.no_grad()
def test_generate_without_attention_mask_and_prefill_chunks(lm):
    x = ids(1, 17, seed=8)
    ref = lm.generate(x, max_new_tokens=5, do_sample=False)
    chunked = lm.generate(x, max_new_tokens=5, do_sample=False, prefill_chunk_size=5)
    assert torch.equal(ref, chunked)


@torch.no_grad()
def test_multi_turn_continue_from_returned_cache(lm):
    x = ids(1, 8, seed=9)
    first = lm.generate(x, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = first[CACHE_KWARG]
    turn2 = torch.cat([first.sequences, ids(1, 5, seed=10)], 1)
    cont = lm.generate(turn2, max_new_tokens=4, do_sample=False, **{CACHE_KWARG: cache})
    fresh = lm.generate(turn2, max_new_tokens=4, do_sample=False)
    assert torch.equal(cont, fresh)


@torch.no_grad()
def test_beam_search_and_sampling_run_and_respect_cache(lm):
    x = ids(2, 6, seed=11)
    beams = lm.generate(x, max_new_tokens=5, num_beams=3, do_sample=False, num_return_sequences=2)
    assert beams.shape == (4, 11)
    # Beam search with one beam is greedy: the reorder path must not corrupt states.
    assert torch.equal(lm.generate(x, max_new_tokens=5, num_beams=1), lm.generate(x, max_new_tokens=5))
    torch.manual_seed(0)
    s1 = lm.generate(x, max_new_tokens=5, do_sample=True, top_k=20)
    torch.manual_seed(0)
    s2 = lm.generate(x, max_new_tokens=5, do_sample=True, top_k=20)
    assert torch.equal(s1, s2)


@torch.no_grad()
def test_beam_scores_match_a_cache_free_beam_search(lm):
    """Beam search reorders pages and states; its best beam must equal an exhaustive cache-free search here."""
    x = ids(1, 5, seed=12)
    out = lm.generate(x, max_new_tokens=2, num_beams=4, do_sample=False, length_penalty=0.0,
                      return_dict_in_generate=True, output_scores=True)
    logp = lm(input_ids=x, use_cache=False).logits[0, -1].log_softmax(-1)
    top1 = logp.topk(4)
    best, best_seq = -1e9, None
    for lp, t in zip(top1.values, top1.indices):
        seq = torch.cat([x, t.view(1, 1)], 1)
        lp2 = lm(input_ids=seq, use_cache=False).logits[0, -1].log_softmax(-1)
        v, i = lp2.max(-1)
        if lp + v > best:
            best, best_seq = lp + v, torch.cat([seq, i.view(1, 1)], 1)
    assert torch.equal(out.sequences[0], best_seq[0])


def test_generate_rejects_unsupported_modes(lm, tiny_model):
    x = ids(1, 5)
    for impl in ("offloaded", "quantized", "sliding_window"):  # "static" is served (tests/cache/test_static_cache.py)
        with pytest.raises(ValueError, match="cache_implementation"):
            lm.generate(x, max_new_tokens=2, cache_implementation=impl)
    # A user cache built without rollback cannot serve assisted decoding.
    with pytest.raises(ValueError, match="rollback_tokens"):
        lm.generate(x, max_new_tokens=2, prompt_lookup_num_tokens=2, **{CACHE_KWARG: KimiK3Cache(lm.config)})
    # transformers' continuous batching pages attention KV only; every entry point goes through this one.
    for model in (lm, tiny_model):
        with pytest.raises(NotImplementedError, match="continuous batching.*KDA"):
            model.generate_batch([[1, 2, 3], [4, 5]], GenerationConfig(max_new_tokens=2), progress_bar=False)


@torch.no_grad()
def test_conditional_generation_text_equals_causal_lm(tiny_model):
    x = ids(2, 9)
    a = tiny_model(input_ids=x, use_cache=False).logits
    b = tiny_model.language_model(input_ids=x, use_cache=False).logits
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="placeholder"):
        tiny_model(input_ids=torch.full((1, 3), tiny_model.config.media_placeholder_token_id))


def test_gradient_checkpointing_same_grads(lm):
    x = ids(2, 10)
    lm.train()
    try:
        grads = []
        for gc in (False, True):
            lm.zero_grad()
            if gc:
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            loss = lm(input_ids=x, labels=x, use_cache=False).loss
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None})
        lm.gradient_checkpointing_disable()
        assert grads[0].keys() == grads[1].keys()
        for n in grads[0]:
            assert rel_err(grads[1][n], grads[0][n]) < 1e-4, n
    finally:
        lm.gradient_checkpointing_disable()
        lm.zero_grad()
        lm.eval()


@torch.no_grad()
def test_offloaded_model_generates_the_same_tokens(tiny_dir, tiny_model, tmp_path):
    """accelerate's offload (`device_map` entries "cpu" / "disk"): weights stay on the meta device until their
    module's hook loads them, and the fused ops read some submodules' weights without calling them (AttnRes, the
    KDA short convs and output norm, MLA's kv_b_proj); those reads run the hooks, so generate gives the tokens of
    the model in memory."""
    from transformers_k3 import KimiK3ForConditionalGeneration

    x = ids(2, 9)
    want = tiny_model.generate(x, max_new_tokens=4, do_sample=False)
    model = KimiK3ForConditionalGeneration.from_pretrained(
        tiny_dir, dtype=torch.float32, device_map="auto", max_memory={"cpu": "1MB"}, offload_folder=str(tmp_path))
    assert {"cpu", "disk"} <= set(map(str, model.hf_device_map.values()))
    assert torch.equal(model.generate(x, max_new_tokens=4, do_sample=False), want)
