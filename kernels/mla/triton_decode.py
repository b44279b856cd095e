"""Absorbed-MLA decode in Triton, attending directly over the paged latent cache (flash-decoding split-K).

Per sequence the cache holds rows `[c (r) | k_pe (dr)]` in pages of `page_size` tokens; `block_table[b, j]` is
the page of the sequence's logical block j. With `kv_b_proj` absorbed (see `reference.py`), every head attends
over the same latent rows (MQA-like), so one program takes a block of query rows (query token x head, flattened
to `Tq * H` rows) and loads each latent tile once for all of them: decode then reads ~`(r + dr) * 2` bytes a
token, which is what makes it bandwidth-bound. `L` is split across programs (grid axis 2) so a single long
sequence still fills the GPU; a second kernel merges the splits by their log-sum-exp.

This module imports Triton at the top: import it lazily (the model does, only when `k3_mla_paged` is asked for).
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # the model imports this module only when `k3_mla_paged` is asked for
    raise ImportError(
        "attn_implementation='k3_mla_paged' needs Triton (`pip install triton`) and a CUDA GPU"
    ) from e

from ..dispatch import _warn_once
from .reference import check_paged_inputs


# Ints that change as a decode run grows (the split length, the block-table and mask row strides) are not
# specialised: Triton otherwise compiles a new variant the first time one of them becomes divisible by 16, a
# compile stall in the middle of generation (seen as 80-260 ms decode steps on the H200).
@triton.jit(do_not_specialize=["SPLIT_LEN", "s_bt_b", "s_mb", "s_mt", "s_mn"])
def _mla_paged_split_kernel(
    Q, QPE, POOL, BT, LENS, MASK, O, PART_O, PART_LSE,
    H, TQ, M_ROWS, SPLIT_LEN,
    s_qb, s_qt, s_qh, s_pb, s_pt, s_ph,
    s_pool_p, s_pool_s, s_bt_b, s_mb, s_mt, s_mn,
    s_ob, s_ot, s_oh,
    qk_scale_log2,
    R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_PE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HAS_MASK: tl.constexpr, ONE_SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    mb = tl.program_id(0)  # head blocks of one (sequence, split) are adjacent, so they share tiles in L2
    b = tl.program_id(1)
    sp = tl.program_id(2)
    n_splits = tl.num_programs(2)
    L = tl.load(LENS + b).to(tl.int32)

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # row = t * H + h
    row_ok = rows < M_ROWS
    t = rows // H
    h = rows % H
    limit = L - TQ + t + 1  # causal: query t of the last TQ tokens sees positions < limit
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    b64 = b.to(tl.int64)

    q = tl.load(Q + b64 * s_qb + t[:, None] * s_qt + h[:, None] * s_qh + offs_r[None, :],
                mask=row_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
    if DR > 0:
        offs_pe = tl.arange(0, BLOCK_PE)
        pe_ok = offs_pe < DR
        qpe = tl.load(QPE + b64 * s_pb + t[:, None] * s_pt + h[:, None] * s_ph + offs_pe[None, :],
                      mask=row_ok[:, None] & pe_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_PE]
        if DOT_F32:
            qpe = qpe.to(tl.float32)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)

    start = sp * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, L)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        page = tl.load(BT + b64 * s_bt_b + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        base = POOL + page * s_pool_p + (n % PAGE).to(tl.int64) * s_pool_s  # [BLOCK_N] row starts
        c = tl.load(base[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        p_dtype = c.dtype
        if DOT_F32:
            c = c.to(tl.float32)
        s = tl.dot(q, tl.trans(c), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N] fp32
        if DR > 0:
            kpe = tl.load(base[:, None] + R + offs_pe[None, :], mask=n_ok[:, None] & pe_ok[None, :], other=0.0)
            if DOT_F32:
                kpe = kpe.to(tl.float32)
            s += tl.dot(qpe, tl.trans(kpe), input_precision=DOT_PREC)
        s = s * qk_scale_log2
        visible = n_ok[None, :] & (n[None, :] < limit[:, None])
        if HAS_MASK:
            mk = tl.load(MASK + b64 * s_mb + t[:, None] * s_mt + n[None, :] * s_mn,
                         mask=row_ok[:, None] & n_ok[None, :], other=0)
            visible = visible & (mk != 0)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(p_dtype).to(c.dtype), c, input_precision=DOT_PREC)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no visible key: output 0 (the merge gives such a split weight 0)
    out = acc / l_safe[:, None]
    if ONE_SPLIT:
        tl.store(O + b64 * s_ob + t[:, None] * s_ot + h[:, None] * s_oh + offs_r[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & r_ok[None, :])
    else:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # log2 domain
        part = (b64 * n_splits + sp) * M_ROWS + rows  # PART_* are [B, n_splits, M_ROWS(, R)]
        tl.store(PART_LSE + part, lse, mask=row_ok)
        tl.store(PART_O + part[:, None] * R + offs_r[None, :], out, mask=row_ok[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["N_SPLITS"])
def _mla_merge_kernel(
    PART_O, PART_LSE, O, H, M_ROWS, N_SPLITS, s_ob, s_ot, s_oh,
    R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, LSE_S: tl.constexpr,
):
    """out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse), for BLOCK_M rows and BLOCK_R columns.

    Why two passes and BLOCK_S splits a step: a running (online) merge waits for each split's load before the
    next is issued, so a program's time is N_SPLITS memory latencies; at B = 1 (64 splits, 6 programs) that
    was most of the decode step. Here the largest lse comes first (one small load), then the weighted sums
    load BLOCK_S splits' partials at once, and programs also cover R in BLOCK_R slices."""
    b = tl.program_id(0)
    mb = tl.program_id(1)
    rb = tl.program_id(2)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M_ROWS
    t = rows // H
    h = rows % H
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    base = b.to(tl.int64) * N_SPLITS  # PART_* are [B, N_SPLITS, M_ROWS(, R)]

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s0 in range(0, N_SPLITS, LSE_S):
        sp = s0 + tl.arange(0, LSE_S)
        lse = tl.load(PART_LSE + (base + sp)[:, None] * M_ROWS + rows[None, :],
                      mask=(sp < N_SPLITS)[:, None] & row_ok[None, :], other=float("-inf"))  # [LSE_S, BLOCK_M]
        m = tl.maximum(m, tl.max(lse, 0))
    m = tl.where(m == float("-inf"), 0.0, m)  # rows no split saw: every weight is 0, out = 0

    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s0 in range(0, N_SPLITS, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        ok = (sp < N_SPLITS)[:, None] & row_ok[None, :]
        part = (base + sp)[:, None] * M_ROWS + rows[None, :]  # [BLOCK_S, BLOCK_M]
        w = tl.exp2(tl.load(PART_LSE + part, mask=ok, other=float("-inf")) - m[None, :])
        o = tl.load(PART_O + part[:, :, None] * R + offs_r[None, None, :],
                    mask=ok[:, :, None] & r_ok[None, None, :], other=0.0)  # [BLOCK_S, BLOCK_M, BLOCK_R]
        acc += tl.sum(w[:, :, None] * o, 0)
        l_i += tl.sum(w, 0)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + b.to(tl.int64) * s_ob + t[:, None] * s_ot + h[:, None] * s_oh + offs_r[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & r_ok[None, :])


def _gluon_unavailable(device: torch.device, r: int, dr: int, dtype: torch.dtype) -> str | None:
    """Why the Gluon split kernel cannot run here, or None if it can."""
    try:
        from .gluon_decode import gluon_mla_available
    except ImportError as exc:  # triton without Gluon (older than 3.5)
        return f"this triton has no Gluon ({exc})"
    if not gluon_mla_available(device, r, dr, dtype):
        return (f"the Gluon kernel needs a compute capability 9.x CUDA device, r = 512, dr = 64 and a bf16 / fp16 "
                f"cache; got {device}, r = {r}, dr = {dr}, {dtype}")
    return None


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: a few splits, so the merge path is exercised too


@functools.lru_cache(maxsize=256)
def _split_count(programs: int, n_sms: int, max_splits: int) -> int:
    """Splits a sequence's keys go into: as many as fill one wave of programs, or, past one wave, the fewest whose
    waves come within 10 % of spreading the work over every SM.

    A split program fills an SM (the Gluon kernel's shared memory, the Triton kernel's registers), so the time
    goes as ceil(programs * s / n_sms) / s for s splits. Rounding the wave up instead of down (160 programs on 132
    SMs: two waves) was 1.66x slower at B = 16, L = 32K on the H100 (BENCHMARKS.md, twenty-fourth session). More
    splits than needed only add fp32 partials (splits * Tq * H * r * 8 bytes) to write and merge."""
    if programs <= n_sms:
        s = n_sms // programs
    else:
        s = next(s for s in range(1, n_sms + 1) if math.ceil(programs * s / n_sms) / s <= 1.1 * programs / n_sms)
    return max(1, min(s, max_splits))


def _merge(part_o, part_lse, out, H, m_rows, n_splits, r, interp):
    """Launch `_mla_merge_kernel` over (B, 8-row blocks, 64-column slices): 96 programs at B = 1, H = 96, r = 512.
    The interpreter takes smaller slices and split steps, so the tests cross their boundaries at small shapes."""
    block_r = 16 if interp else 64
    n_pow2 = triton.next_power_of_2(n_splits)
    block_s = min(4 if interp else 16, n_pow2)  # [16, 8, 64] fp32: 64 registers a thread
    grid = (out.shape[0], triton.cdiv(m_rows, 8), triton.cdiv(r, block_r))
    _mla_merge_kernel[grid](
        part_o, part_lse, out, H, m_rows, n_splits, out.stride(0), out.stride(1), out.stride(2),
        R=r, BLOCK_R=block_r, BLOCK_M=8, BLOCK_S=block_s, LSE_S=min(4 if interp else 64, n_pow2), num_warps=4,
        enable_fp_fusion=True,
    )


def mla_paged_decode(
    q_lat, q_pe, pool, block_table, lengths, scale, *, mask=None, out=None, max_len=None,
    num_splits=None, block_m=None, block_n=None, num_warps=None, num_stages=None, gluon=None,
):
    """Attention of absorbed MLA queries over a paged latent cache.

    q_lat [B, Tq, H, r] (q_nope W_uk), q_pe [B, Tq, H, dr] (or None when dr = 0), pool [P, page, r + dr],
    block_table [B, n_blocks] int page ids, lengths [B] int (cached tokens per sequence, the Tq queries
    included: query i sees positions < lengths[b] - Tq + i + 1), optional bool mask [B, Tq, >= max length]
    (True = attend; ANDed with the causal rule), out: optional [B, Tq, H, r] to write into.
    Returns o_lat [B, Tq, H, r] in q_lat's dtype (softmax(scores) @ c; the caller applies W_uv). Query rows
    with no visible key get 0. `max_len` (default `n_blocks * page`) bounds the split sizes without a sync.
    `gluon`: True runs the split kernel of `gluon_decode` (Hopper, r = 512, dr = 64, 16-bit cache; block_m 64,
    block_n 32 or 64 (default 64), num_stages = its ring buffers, 2 (default) or 3 with block_n 32; num_warps
    does not apply) and raises where it cannot run; False the Triton kernel; None (default) the Gluon one where
    it can run and no Triton launch parameter is given, else the Triton one (warning once when only the device
    is missing).
    """
    B, Tq, H, r, dr = check_paged_inputs(q_lat, q_pe, pool, block_table, lengths, mask)
    page = pool.shape[1]
    dtype = q_lat.dtype
    q = q_lat.to(pool.dtype)
    qpe = q_pe.to(pool.dtype) if dr else q  # a placeholder pointer when dr = 0
    if out is None:
        out = torch.empty(B, Tq, H, r, device=q_lat.device, dtype=dtype)
    elif out.shape != (B, Tq, H, r) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be a [B, Tq, H, r] = {[B, Tq, H, r]} {dtype} tensor with unit last stride")
    if pool.stride(-1) != 1 or q.stride(-1) != 1 or qpe.stride(-1) != 1:
        raise ValueError("pool, q_lat and q_pe must have a unit stride on their last dim")
    lengths = lengths.to(device=q.device, dtype=torch.int32)
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()

    m_rows = Tq * H
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if gluon is None:
        gluon = (r, dr) == (512, 64) and pool.dtype in (torch.bfloat16, torch.float16) and all(
            v is None for v in (block_m, block_n, num_warps, num_stages))
        why = _gluon_unavailable(q.device, r, dr, pool.dtype) if gluon else None
        if why is not None:
            _warn_once("mla-gluon", f"transformers-k3: MLA decode uses the Triton split kernel ({why})")
            gluon = False
    elif gluon:
        why = _gluon_unavailable(q.device, r, dr, pool.dtype)
        if why is not None:
            raise RuntimeError(f"mla_paged_decode(gluon=True): {why}")
        if block_m not in (None, 64) or block_n not in (None, 32, 64) or num_warps is not None:
            raise ValueError("mla_paged_decode(gluon=True): block_m must be 64, block_n 32 or 64, num_warps unset")
        if num_stages not in (None, 2, 3) or (num_stages == 3 and block_n != 32):
            # two 64-token buffers and the queries fill the 227 KB of shared memory
            raise ValueError(f"mla_paged_decode(gluon=True): num_stages (ring buffers) must be 2, or 3 with "
                             f"block_n=32; got {num_stages} with block_n={block_n}")
    if gluon:
        block_m, block_n, num_stages = 64, block_n or 64, num_stages or 2
    block_r = max(16, triton.next_power_of_2(r))
    block_pe = max(16, triton.next_power_of_2(dr)) if dr else 16
    if block_m is None:
        block_m = min(64 if block_r <= 512 else 32, max(16, triton.next_power_of_2(m_rows)))
    if block_n is None:
        block_n = 16 if interp else (32 if block_r >= 512 else 64)
    if num_warps is None:
        num_warps = 8 if block_m * block_r >= 64 * 512 else 4
    if num_stages is None:
        num_stages = 1 if interp else 2
    for name, v in (("block_m", block_m), ("block_n", block_n)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {v}")
    n_mblocks = triton.cdiv(m_rows, block_m)
    max_len = int(max_len) if max_len is not None else block_table.shape[1] * page
    max_len = max(max_len, 1)
    if mask is not None and mask.shape[2] < max_len:
        raise ValueError(f"mask covers {mask.shape[2]} keys but max_len is {max_len}: pass a wider mask or max_len")
    if num_splits is None:
        # Splits shorter than 256 tokens cost more in the merge than they gain (B = 1, L = 8K on the H100: 32
        # splits 0.024 ms, 66 splits 0.025, 16 splits 0.034).
        num_splits = _split_count(B * n_mblocks, _num_sms(q.device), triton.cdiv(max_len, 256 if not interp else 16))
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_len, split_len)
    one = num_splits == 1
    if one:
        part_o = part_lse = out  # unused
    else:
        part_o = torch.empty(B, num_splits, m_rows, r, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(B, num_splits, m_rows, device=q.device, dtype=torch.float32)
    if mask is not None:
        mk = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        s_m = (mk.stride(0), mk.stride(1), mk.stride(2))
    else:
        mk, s_m = lengths, (0, 0, 0)
    dot_prec = "ieee" if pool.dtype == torch.float32 else None  # fp32 caches: no silent tf32
    # The CPU interpreter's tl.dot is wrong on bf16/fp16 operands (triton 3.9, probed): there the operands are
    # upcast after the same roundings (p to the cache dtype), so the bf16 logic is still what the tests check.
    args = (q, qpe, pool, block_table, lengths, mk, out, part_o, part_lse,
            H, Tq, m_rows, split_len,
            q.stride(0), q.stride(1), q.stride(2), qpe.stride(0), qpe.stride(1), qpe.stride(2),
            pool.stride(0), pool.stride(1), block_table.stride(0), *s_m,
            out.stride(0), out.stride(1), out.stride(2),
            scale * math.log2(math.e))
    if gluon:
        from .gluon_decode import mla_split_gluon

        mla_split_gluon((n_mblocks, B, num_splits), args, block_n=block_n, stages=num_stages, page=page,
                        has_mask=mask is not None, one_split=one, dtype=pool.dtype)
    else:
        _mla_paged_split_kernel[(n_mblocks, B, num_splits)](
            *args,
            R=r, DR=dr, BLOCK_R=block_r, BLOCK_PE=block_pe, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page,
            HAS_MASK=mask is not None, ONE_SPLIT=one, DOT_PREC=dot_prec,
            DOT_F32=interp and pool.dtype != torch.float32,
            num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True,
        )
    if not one:
        _merge(part_o, part_lse, out, H, m_rows, num_splits, r, interp)
    return out


def mla_paged_attention(module, q_nope, q_pe, latent, cache, attention_mask=None, key_valid=None):
    """The cached branch of `KimiK3Attention` under `attn_implementation="k3_mla_paged"`.

    Appends `latent [B, T, r + dr]` to the layer's pages, absorbs `kv_b_proj` into the query and output and
    runs `mla_paged_decode` over the pool. `attention_mask` is the model's bool `[B, 1, T, L]` mask, `key_valid`
    `[B, T]` which new tokens are real (kept by static caches). Returns `[B, T, H, dv]`. A cache without
    `append_latent` still builds (and here drops) the gathered latent copy in `update_latent`: correct, but that
    copy costs what the kernel saves.
    """
    check_paged_backend(q_nope.device)
    layer = module.layer_idx
    if hasattr(cache, "append_latent"):  # a cache that writes without gathering the whole history
        cache.append_latent(layer, latent, key_valid)
    else:
        cache.update_latent(layer, latent)
    B, T, H, dn = q_nope.shape
    r = module.kv_rank
    w = module._kv_b_weight().view(H, dn + module.v_dim, r)
    w_k, w_v = w[:, :dn], w[:, dn:]  # [H, dn, r], [H, dv, r]
    q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_k.to(q_nope.dtype))  # [B, T, H, r]
    pool = cache.pools[layer]
    if getattr(cache, "is_static", False) and T == 1:
        # A static cache's decode step reads only device buffers at their full size (no host-side length):
        # what a captured CUDA graph needs. Splits past a sequence's length do no work.
        lengths, table, max_len = cache.device_lengths[layer], cache.block_table_on(pool.device), cache.static_len
        mask = cache.key_valid_on(pool.device)[:, None, :]  # [B, 1, static_len]
    else:
        L = cache.lengths[layer]
        n_blocks = math.ceil(L / cache.page_size)
        lengths, max_len = torch.full((B,), L, dtype=torch.int32, device=q_nope.device), L
        table = cache.block_table_on(pool.device)[:, :n_blocks]
        mask = None if attention_mask is None else attention_mask[:, 0]  # [B, T, L]
    o_lat = mla_paged_decode(q_lat.to(pool.dtype), q_pe, pool, table, lengths, module.scaling, mask=mask,
                             max_len=max_len)
    return torch.einsum("bthr,hdr->bthd", o_lat.to(w_v.dtype), w_v)  # [B, T, H, dv]


def check_paged_backend(device: torch.device) -> None:
    """`k3_mla_paged` runs compiled on CUDA, or on the CPU only under the Triton interpreter (tests)."""
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return
    raise RuntimeError(
        f"attn_implementation='k3_mla_paged' needs CUDA tensors (got {device.type}) and Triton; "
        "use attn_implementation='sdpa' or 'eager' on this device."
    )


__all__ = ["mla_paged_decode", "mla_paged_attention", "check_paged_backend"]
