"""The static cache (`max_cache_len`): the growing cache's numbers from device-side positions, its refusals, and
on CUDA the decode steps replayed from a CUDA graph (`cuda_graph.DecodeGraph`, what generate uses for it)."""

import pytest
import torch

from helpers import rel_err
from transformers_k3 import KimiK3Cache, KimiK3ForCausalLM
from transformers_k3.cuda_graph import DecodeGraph
from transformers_k3.tiny import tiny_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the paged kernel under the interpreter, no graph
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _tiny_lm(attn="k3_mla_paged", **kw):
    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=4).text_config
    return KimiK3ForCausalLM._from_config(config, attn_implementation=attn, dtype=torch.float32, **kw).eval().to(DEV)


def _inputs(steps=4):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 500, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: decode steps must keep ignoring these keys
    mask[2, :1] = 0
    return ids.to(DEV), mask.to(DEV), torch.randint(0, 500, (3, steps), generator=g).to(DEV)


def _prefill_then_steps(model, cache, ids, mask, steps, step_mask=True):
    """Last prefill logits, then one decode step per column of `steps` (with generate's growing mask, or none)."""
    out = [model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1:]]
    for i in range(steps.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        kw = {"attention_mask": mask} if step_mask else {}
        out.append(model(input_ids=steps[:, i : i + 1], cache=cache, use_cache=True, **kw).logits)
    return torch.cat(out, dim=1)


@torch.no_grad()
@pytest.mark.parametrize("attn", ["sdpa", "k3_mla_paged"])
def test_static_cache_matches_growing_cache(attn):
    model = _tiny_lm(attn)
    ids, mask, steps = _inputs()
    want = _prefill_then_steps(model, KimiK3Cache(model.config), ids, mask, steps)
    static = KimiK3Cache(model.config, max_cache_len=16)
    assert static.is_compileable and static.max_cache_len == 16
    assert rel_err(_prefill_then_steps(model, static, ids, mask, steps), want) <= 1e-5
    assert static.get_seq_length() == 13
    assert all(lengths.tolist() == [13] * 3 for lengths in static.device_lengths.values())
    valid = static.key_valid.cpu()
    assert not valid[0, :3].any() and valid[0, 3:13].all() and not valid[2, 0] and valid[1, :13].all()
    if attn == "k3_mla_paged":
        # The static decode step proper (what the graph captures): no host mask, the cache's padding flags.
        again = KimiK3Cache(model.config, max_cache_len=16)
        got = _prefill_then_steps(model, again, ids, mask, steps, step_mask=False)
        assert rel_err(got, want) <= 1e-5


@torch.no_grad()
def test_generate_static_equals_default():
    """`cache_implementation="static"`: the CUDA-graph decode steps on a GPU, eager ones on the CPU."""
    kw = {"experts_implementation": "k3_triton"} if DEV == "cuda" else {}
    model = _tiny_lm(**kw)
    ids, mask, _ = _inputs()
    gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True,
               return_dict_in_generate=True)
    want = model.generate(ids, **gen)
    got = model.generate(ids, cache_implementation="static", **gen)
    assert torch.equal(got.sequences, want.sequences)
    assert rel_err(torch.stack(got.scores), torch.stack(want.scores)) <= 1e-4


@cuda_only
@torch.no_grad()
def test_decode_graph_replays_the_eager_step():
    model = _tiny_lm(experts_implementation="k3_triton")
    ids, mask, steps = _inputs(steps=6)
    eager_cache = KimiK3Cache(model.config, max_cache_len=15)
    want = _prefill_then_steps(model, eager_cache, ids, mask, steps, step_mask=False)
    cache = KimiK3Cache(model.config, max_cache_len=15)
    out = [model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1:]]
    graph = DecodeGraph(model, cache)
    for i in range(steps.shape[1]):  # eager, capture, then replays
        out.append(graph(steps[:, i : i + 1]).clone())
    assert graph.graph is not None and cache.get_seq_length() == eager_cache.get_seq_length() == 15
    assert rel_err(torch.cat(out, dim=1), want) <= 1e-5
    with pytest.raises(ValueError, match="max_cache_len=15"):  # full: a replay would write past the last page
        graph(steps[:, :1])


@cuda_only
def test_static_generate_needs_the_paged_attention():
    model = _tiny_lm("sdpa")
    ids, mask, _ = _inputs()
    with pytest.raises(ValueError, match="k3_mla_paged"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation="static")


@torch.no_grad()
def test_static_cache_refusals():
    model = _tiny_lm()
    cfg = model.config
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_cache_len"):
            KimiK3Cache(cfg, max_cache_len=bad)
    with pytest.raises(ValueError, match="rollback_tokens"):
        KimiK3Cache(cfg, rollback_tokens=4, max_cache_len=8)
    assert not KimiK3Cache(cfg).is_compileable
    with pytest.raises(ValueError, match="DecodeGraph needs a static"):
        DecodeGraph(model, KimiK3Cache(cfg))
    ids, mask, _ = _inputs()
    cache = KimiK3Cache(cfg, max_cache_len=8)
    with pytest.raises(ValueError, match="max_cache_len=8"):  # 9 prompt tokens
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    cache = KimiK3Cache(cfg, max_cache_len=12)
    model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="static"):
        cache.reorder_cache(torch.tensor([2, 1, 0]))
    with pytest.raises(NotImplementedError, match="static"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False,
                       cache_implementation="static")
    with pytest.raises(ValueError, match="assisted"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, prompt_lookup_num_tokens=2,
                       cache_implementation="static")


@torch.no_grad()
def test_static_step_runs_eagerly_where_no_graph_serves():
    """The step generate gets from `get_compiled_call` takes the plain forward for a prompt (inputs_embeds or
    more than one token) on any device, and for every step off the GPU."""
    model = _tiny_lm()
    ids, mask, steps = _inputs(steps=1)
    step = model.get_compiled_call(None)
    cache = KimiK3Cache(model.config, max_cache_len=12)
    out = step(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask, cache=cache, use_cache=True)
    assert cache.decode_graph is None and out.logits.shape[:2] == (3, 9)
    if DEV == "cpu":
        out = step(input_ids=steps, cache=cache, use_cache=True)
        assert cache.decode_graph is None and out.logits.shape[:2] == (3, 1) and cache.get_seq_length() == 10
