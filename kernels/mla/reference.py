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


def check_paged_inputs(q_lat, q_pe, pool, block_table, lengths, mask=None):
    """Validate the paged-decode arguments; return `(B, Tq, H, r, dr)`."""
    if q_lat.dim() != 4:
        raise ValueError(f"q_lat must be [B, Tq, H, r], got {list(q_lat.shape)}")
    B, Tq, H, r = q_lat.shape
    if pool.dim() != 3:
        raise ValueError(f"pool must be [num_pages, page_size, r + dr], got {list(pool.shape)}")
    page = pool.shape[1]
    if page < 1 or page & (page - 1):
        raise ValueError(f"pool page_size must be a power of two, got {page}")
    dr = pool.shape[2] - r
    if dr < 0:
        raise ValueError(f"pool has {pool.shape[2]} channels, fewer than q_lat's r = {r}")
    if dr and (q_pe is None or tuple(q_pe.shape) != (B, Tq, H, dr)):
        raise ValueError(f"q_pe must be [B, Tq, H, dr] = {[B, Tq, H, dr]}, got {None if q_pe is None else list(q_pe.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype.is_floating_point:
        raise ValueError(f"block_table must be an integer [B={B}, n_blocks] tensor, got {block_table.dtype} {list(block_table.shape)}")
    if lengths.shape != (B,) or lengths.dtype.is_floating_point:
        raise ValueError(f"lengths must be an integer [B={B}] tensor, got {lengths.dtype} {list(lengths.shape)}")
    if mask is not None and (mask.dim() != 3 or mask.shape[:2] != (B, Tq)):
        raise ValueError(f"mask must be [B, Tq, L] = [{B}, {Tq}, L], got {list(mask.shape)}")
    for name, x in (("q_pe", q_pe), ("pool", pool), ("block_table", block_table), ("lengths", lengths), ("mask", mask)):
        if x is not None and x.device != q_lat.device:
            raise ValueError(f"{name} is on {x.device} but q_lat is on {q_lat.device}")
    return B, Tq, H, r, dr


def mla_paged_decode_reference(q_lat, q_pe, pool, block_table, lengths, scale, mask=None):
    """The truth for `triton_decode.mla_paged_decode`, one sequence at a time, in fp32.

    q_lat [B, Tq, H, r] (q_nope W_uk), q_pe [B, Tq, H, dr], pool [P, page, r + dr], block_table [B, n_blocks],
    lengths [B]; query i of sequence b sees cached positions < lengths[b] - Tq + i + 1 (and `mask [B, Tq, L]`
    where given). Returns o_lat [B, Tq, H, r] in q_lat's dtype; a query with no visible key gets 0.
    """
    B, Tq, H, r, dr = check_paged_inputs(q_lat, q_pe, pool, block_table, lengths, mask)
    page = pool.shape[1]
    out = torch.zeros(B, Tq, H, r, dtype=torch.float32, device=q_lat.device)
    for b in range(B):
        L = int(lengths[b])
        if L == 0:
            continue
        pos = torch.arange(L, device=pool.device)
        rows = pool[block_table[b, pos // page], pos % page].float()  # [L, r + dr]
        c, k_pe = rows[:, :r], rows[:, r:]
        scores = torch.einsum("thr,lr->thl", q_lat[b].float(), c)
        if dr:
            scores = scores + torch.einsum("thd,ld->thl", q_pe[b].float(), k_pe)
        scores = scores * scale
        visible = pos[None, :] < (L - Tq + torch.arange(Tq, device=pool.device) + 1)[:, None]  # [Tq, L]
        if mask is not None:
            visible = visible & mask[b, :, :L].bool()
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)  # fully masked rows -> 0
        out[b] = torch.einsum("thl,lr->thr", probs, c)
    return out.to(q_lat.dtype)
