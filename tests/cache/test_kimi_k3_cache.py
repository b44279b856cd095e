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
def test_crop_raises_and_reset_clears(lm):
    cache = KimiK3Cache(lm.config)
    lm(input_ids=torch.randint(0, 500, (1, 5)), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 5 and cache.has_previous_state()
    assert not cache.is_croppable
    with pytest.raises(NotImplementedError, match="KDA"):
        cache.crop(3)
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
