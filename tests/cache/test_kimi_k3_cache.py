"""The hybrid cache: latent-only growth, paging, batch operations, honest refusals."""

import math

import pytest
import torch

from transformers_k3 import KimiK3Cache


@torch.no_grad()
def test_cache_grows_by_latent_bytes_per_token(lm):
    cfg = lm.config
    cache = KimiK3Cache(cfg)
    B = 2
    x = torch.randint(0, 500, (B, 3))
    lm(input_ids=x, cache=cache, use_cache=True)
    kda_bytes = cache.nbytes()["kda"]
    n_mla = cfg.layer_types.count("full_attention")
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    elem = lm.dtype.itemsize if hasattr(lm.dtype, "itemsize") else 4
    for step in range(3, 3 + 2 * cfg.mla_page_size):
        pages = math.ceil(cache.get_seq_length() / cfg.mla_page_size)
        assert cache.nbytes()["mla"] == n_mla * B * pages * cfg.mla_page_size * latent * elem
        assert cache.nbytes()["kda"] == kda_bytes  # fixed size whatever the length
        lm(input_ids=x[:, :1], cache=cache, use_cache=True)
    # the KDA state is fp32 [B, H, K, V] per layer plus three conv states [B, H*K, W-1]
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    n_kda = cfg.layer_types.count("linear_attention")
    assert kda_bytes == n_kda * B * 4 * (H * K * K + 3 * H * K * (cfg.linear_conv_kernel_size - 1))


@torch.no_grad()
def test_reorder_then_continue_matches_reordered_rows(lm):
    x = torch.randint(0, 500, (3, 11))
    cache = KimiK3Cache(lm.config)
    lm(input_ids=x[:, :10], cache=cache, use_cache=True)
    order = torch.tensor([2, 2, 0])
    cache.reorder_cache(order)
    step = lm(input_ids=x[order, 10:], cache=cache, use_cache=True).logits
    ref = lm(input_ids=x[order], use_cache=False).logits[:, -1:]
    assert ((step - ref).abs().max() / ref.abs().max()) < 5e-5
    # rows 0 and 1 came from one row but own their pages now: appending to one leaves the other intact
    assert len(set(cache.block_table.flatten().tolist())) == cache.block_table.numel()


@torch.no_grad()
def test_block_table_per_device_copies(lm):
    """MLA layers on other GPUs (device_map) read the page table on their own device: one copy per table, made
    again once the table grows or is reordered (the meta device stands in for a second GPU here; the real thing
    is tests/cache/test_multi_gpu.py)."""
    cache = KimiK3Cache(lm.config)
    assert cache.block_table_on(torch.device("meta")) is None
    x = torch.randint(0, 500, (2, 3))
    lm(input_ids=x, cache=cache, use_cache=True)
    table, other = cache.block_table, torch.device("meta")
    assert cache.block_table_on(table.device) is table
    copy = cache.block_table_on(other)
    assert copy.device == other and copy.shape == table.shape and cache.block_table_on(other) is copy
    lm(input_ids=torch.randint(0, 500, (2, lm.config.mla_page_size)), cache=cache, use_cache=True)  # new pages
    grown = cache.block_table_on(other)
    assert grown is not copy and grown.shape == cache.block_table.shape != copy.shape
    cache.reorder_cache(torch.tensor([1, 0]))
    assert cache.block_table_on(other) is not grown


@torch.no_grad()
def test_batch_repeat_and_select(lm):
    x = torch.randint(0, 500, (2, 7))
    cache = KimiK3Cache(lm.config)
    lm(input_ids=x[:, :6], cache=cache, use_cache=True)
    cache.batch_repeat_interleave(2)
    cache.batch_select_indices(torch.tensor([1, 2]))  # rows: x[0], x[1]
    out = lm(input_ids=x[:, 6:], cache=cache, use_cache=True).logits
    ref = lm(input_ids=x, use_cache=False).logits[:, -1:]
    assert ((out - ref).abs().max() / ref.abs().max()) < 5e-5


@torch.no_grad()
def test_prompt_cache_reuse_by_deepcopy(lm):
    """transformers' prompt-reuse recipe: fill a cache with a shared prefix once, then generate each continuation
    from a deep copy of it; the copies are independent and give the tokens of a fresh generate. The cache goes to
    generate under the keyword this transformers speaks (`past_key_values` before 5.2x, `cache` since)."""
    import copy

    from transformers_k3.modeling_kimi_k3 import CACHE_KWARG

    prefix = torch.randint(0, 500, (1, 10))
    shared = KimiK3Cache(lm.config)
    lm(input_ids=prefix, cache=shared, use_cache=True)
    before = shared.nbytes(), shared.get_seq_length()
    for n in (3, 1 + lm.config.mla_page_size):  # the second crosses a page boundary
        ids = torch.cat([prefix, torch.randint(0, 500, (1, n))], 1)
        want = lm.generate(ids, max_new_tokens=4, do_sample=False)
        got = lm.generate(ids, max_new_tokens=4, do_sample=False, **{CACHE_KWARG: copy.deepcopy(shared)})
        assert torch.equal(got, want)
    assert (shared.nbytes(), shared.get_seq_length()) == before  # the shared prefix cache is untouched


@torch.no_grad()
def test_crop_raises_and_reset_clears(lm):
    cache = KimiK3Cache(lm.config)
    lm(input_ids=torch.randint(0, 500, (1, 5)), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 5 and cache.has_previous_state()
    assert not cache.is_croppable
    cache.crop(0)  # transformers' "remove nothing"
    with pytest.raises(NotImplementedError, match="rollback_tokens"):
        cache.crop(-2)
    with pytest.raises(NotImplementedError, match="latent"):
        cache.update(torch.zeros(1), torch.zeros(1), 3)
    snap = cache.snapshot_kda()
    cache.reset()
    assert cache.get_seq_length() == 0 and not cache.has_previous_state()
    cache.restore_kda(snap)
    assert cache.has_previous_state(0)


def test_cache_refuses_wrong_batch(lm):
    cache = KimiK3Cache(lm.config)
    lm(input_ids=torch.randint(0, 500, (2, 4)), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="batch size"):
        lm(input_ids=torch.randint(0, 500, (3, 1)), cache=cache, use_cache=True)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@torch.no_grad()
@pytest.mark.parametrize("prefix", [3, 20], ids=["window_covers_the_prefill", "window_inside_a_long_prefill"])
def test_crop_rolls_back_kda_and_mla(lm, prefix):
    """A rejected draft is rolled back: KDA states replayed from the saved window, MLA shortened; the continuation
    then equals the cache-free forward (fp32, 5e-5). Two crops in a row, crop(0), and too far back."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 500, (2, prefix + 6), generator=g)
    full = lm(input_ids=x, use_cache=False).logits
    cache = KimiK3Cache(lm.config, rollback_tokens=8)
    assert cache.is_croppable
    first = lm(input_ids=x[:, :prefix], cache=cache, use_cache=True).logits
    lm(input_ids=torch.randint(0, 500, (2, 5), generator=g), cache=cache, use_cache=True)  # the draft
    cache.crop(0)
    cache.crop(-2)
    cache.crop(-3)  # the second crop goes further back inside the same window
    assert cache.get_seq_length() == prefix
    rest = lm(input_ids=x[:, prefix:], cache=cache, use_cache=True).logits
    assert _rel(torch.cat([first, rest], 1), full) < 5e-5
    # the last forward kept 6 tokens: rolling back 7 is refused, with the numbers
    with pytest.raises(ValueError, match="keeps the last 6"):
        cache.crop(-7)


@torch.no_grad()
def test_assisted_and_prompt_lookup_generation_equal_greedy(lm, monkeypatch, tmp_path):
    """Generate's assisted modes verify drafts and crop the rejected ones; greedy output must not change."""
    from transformers_k3 import KimiK3ForConditionalGeneration
    from transformers_k3.tiny import write_tiny_checkpoint

    removed = []
    real_crop = KimiK3Cache.crop
    monkeypatch.setattr(KimiK3Cache, "crop", lambda self, n: removed.append(n) or real_crop(self, n))
    pattern = torch.randint(0, 500, (1, 5), generator=torch.Generator().manual_seed(4))
    prompt = pattern.repeat(1, 3)  # repeats give prompt lookup drafts to propose
    greedy = lm.generate(prompt, max_new_tokens=12, do_sample=False)
    lookup = lm.generate(prompt, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(lookup, greedy)
    other = tmp_path / "assistant"
    write_tiny_checkpoint(other, seed=1, dtype=torch.float32)  # a different random model: most of its drafts are rejected
    assistant = KimiK3ForConditionalGeneration.from_pretrained(other, dtype=torch.float32).language_model.eval()
    assisted = lm.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=assistant)
    assert torch.equal(assisted, greedy)
    assert any(n < 0 for n in removed)  # drafts really were rolled back
