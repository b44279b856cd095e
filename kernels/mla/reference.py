"""Multi-head latent attention over the latent cache, with `kv_b_proj` absorbed (pure PyTorch).

Per token the cache holds `c` (the normed `kv_lora_rank` latent) and `k_pe` (the shared NoPE "rope" dims).
With `W = kv_b_proj.weight.view(H, dn + dv, r)` split into `W_k [H, dn, r]` and `W_v [H, dv, r]`:
    q.k = (q_nope W_k) . c + q_pe . k_pe       (the query moves into latent space)
    out = (softmax(.) c) W_v^T                 (values stay latent until after the mix)
which equals attention over the expanded `k = [c W_k^T | k_pe]`, `v = c W_v^T` without ever building them.
"""

from __future__ import annotations

import torch


def mla_absorbed_attention(q_nope, q_pe, c, k_pe, kv_b_weight, v_head_dim, scale, mask=None):
    """q_nope [B, Tq, H, dn], q_pe [B, Tq, H, dr], c [B, L, r], k_pe [B, L, dr],
    kv_b_weight [H * (dn + dv), r], mask bool [B, 1, Tq, L] (True = attend) -> out [B, Tq, H, dv]."""
    B, Tq, H, dn = q_nope.shape
    r = c.shape[-1]
    if kv_b_weight.shape != (H * (dn + v_head_dim), r):
        raise ValueError(f"kv_b_weight must be [{H * (dn + v_head_dim)}, {r}], got {list(kv_b_weight.shape)}")
    w = kv_b_weight.view(H, dn + v_head_dim, r)
    w_k, w_v = w[:, :dn], w[:, dn:]  # [H, dn, r], [H, dv, r]
    q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_k)  # [B, Tq, H, r]
    scores = torch.einsum("bthr,blr->bhtl", q_lat.float(), c.float())
    if q_pe.shape[-1]:
        scores = scores + torch.einsum("bthd,bld->bhtl", q_pe.float(), k_pe.float())
    scores = scores * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)  # [B, H, Tq, L]
    o_lat = torch.einsum("bhtl,blr->bthr", probs, c.float())  # [B, Tq, H, r]
    return torch.einsum("bthr,hdr->bthd", o_lat.to(w_v.dtype), w_v)  # [B, Tq, H, dv]
