"""Routed experts of the K3 latent MoE in Triton: grouped matmuls with SiTU-GLU fused, bf16 or MXFP4 weights (W4A16).

The (token, slot) assignments are sorted by expert and each expert's run is padded to a multiple of BLOCK_M
(`_align`), so one program always multiplies BLOCK_M rows by one expert's weight tile. Two kernels:

1. `_gate_up_situ`: `h = SiTU-GLU(x W_gate^T, x W_up^T)` for a `[BLOCK_M, BLOCK_N]` tile of the intermediate width,
   both products accumulated side by side so `x` is loaded once; written as `[padded rows, I]` in x.dtype.
2. `_down`: `y = (h W_down^T) * routing weight`, reduced over a token's slots one of two ways (`reduce`):
   "atomic" adds it with a relaxed fp32 atomic into `out[token]` (a token's 16 slots meet there; fp32 keeps the sum
   as accurate as the reference; the order of the adds, so the last bits, vary run to run); "sorted" stores it at its
   assignment id (row `token * top_k + slot` of a `[N * top_k, D]` fp32 buffer: no atomics, deterministic) and
   torch sums the k rows of each token afterwards (one more pass over `N * top_k * D * 4` bytes).

Tiles and launch options are tunable (`config=`, see `moe_experts_triton` and `_DEFAULT_CONFIGS`) so a GPU sweep
(`benchmarks/moe.py --sweep`) can pick them; the defaults per regime (decode vs prefill) and weight format live in
one dict.

MXFP4 weights stay packed in memory (uint8 E2M1 pairs plus one E8M0 byte per 32 inputs, the release layout) and
are unpacked in registers right before `tl.dot`: the kernel moves ~4.25 bits a weight instead of 16, which is
what decode (bandwidth-bound on expert weights) needs. At decode every weight is unpacked once per expert, so
the unpack must cost only a few instructions a weight or it, not the memory, sets the time: the product is
`tl.dot_scaled(x, bf16; W, e2m1 + e8m0)` (`_fp4_dot`), whose Hopper lowering unpacks with a byte-permute lookup
and bf16x2 multiplies (about 7 SASS instructions a weight in the loop, against 11 for shift-and-mask decoding in
Triton code, compiled for sm_90 with triton 3.6). The unpack is exact (power-of-two scales, E2M1 values are
bf16-representable): `tests/kernels/test_moe_triton.py` checks it value for value against the reference.
Reference beside this file: `reference.moe_experts` / `moe_experts_mxfp4`.

Inference only (no backward): training uses transformers' `grouped_mm` on the dequantised bf16 experts.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..dispatch import _warn_once

__all__ = ["moe_experts_triton"]

# Triton's CPU interpreter computes bf16 `tl.dot` wrongly (numpy has no bf16), so under TRITON_INTERPRET the
# products run in fp32 on the same bf16-rounded values; compiled kernels use bf16 tensor cores.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_DOT_F32 = _INTERPRET


@triton.jit
def _mm_in(t, DOT_F32: tl.constexpr):
    if DOT_F32:
        return t.to(tl.bfloat16).to(tl.float32)
    return t.to(tl.bfloat16)


@triton.jit
def _fp4_dot(x, W, S, e, n, k0, N_ROWS, K, acc, BLOCK_K: tl.constexpr):
    """`acc + x @ W_e[n, k0:k0 + BLOCK_K]^T` for MXFP4 weights: x `[BLOCK_M, BLOCK_K]` bf16, acc fp32.

    The bytes `[BLOCK_N, BLOCK_K / 2]` (even input in the low nibble, as `tl.dot_scaled` packs e2m1 along K) and
    the E8M0 bytes `[BLOCK_N, BLOCK_K / 32]` go to `tl.dot_scaled` as they are: on Hopper Triton unpacks e2m1
    with a byte-permute lookup and scales with bf16x2 multiplies (~1.5x fewer instructions a weight than decoding
    it with shifts in Triton code; at decode the unpack, not memory, would set the time), on Blackwell it is the
    native MX tensor-core product. Exact: E2M1 times a power of two is a bf16 value. `fast_math` skips the NaN
    handling of scale byte 255, which no quantiser emits. BLOCK_K divides K (no column mask); rows past N_ROWS
    are clamped (their outputs are never stored).
    """
    rows = tl.minimum(n, N_ROWS - 1).to(tl.int64)
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    wb = tl.load(W + e * N_ROWS * (K // 2) + rows[:, None] * (K // 2) + kb[None, :])  # [BLOCK_N, BLOCK_K / 2]
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    sc = tl.load(S + e * N_ROWS * (K // 32) + rows[:, None] * (K // 32) + ks[None, :])  # [BLOCK_N, BLOCK_K / 32]
    return tl.dot_scaled(x.to(tl.bfloat16), None, "bf16", tl.trans(wb), sc, "e2m1", acc=acc, fast_math=True)


@triton.jit
def _load_w(W, e, n, k0, N_ROWS, K, BLOCK_K: tl.constexpr):
    """Dense weight tile `[BLOCK_N, BLOCK_K]` of expert e, rows n, inputs k0.. (zeros outside).

    Dense and MXFP4 tiles have their own helpers: one helper with `if FP4: return ...` and a dense `return` after
    it does not compile with triton 3.6 (it type-checks both returns, uint8 and bf16; 3.9's interpreter ran it).
    """
    kw = k0 + tl.arange(0, BLOCK_K)
    return tl.load(
        W + e * N_ROWS * K + n[:, None] * K + kw[None, :], mask=(n[:, None] < N_ROWS) & (kw[None, :] < K), other=0.0
    )


@triton.jit
def _w_tile(W, e, n0, k0, N_ROWS, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_DESC: tl.constexpr,
            DOT_F32: tl.constexpr):
    """Dense weight tile of expert e, rows n0.., inputs k0.., transposed for the product: `[BLOCK_K, BLOCK_N]`.

    W_DESC: W is a tensor descriptor over the `[E * N_ROWS, K]` weights, read by the Hopper TMA unit (one bulk copy
    a tile, no per-thread addresses; zeros past the edges). Rows past N_ROWS come from the next expert's weights
    (or the up half's): their outputs are never stored."""
    if W_DESC:
        w = W.load([(e * N_ROWS + n0).to(tl.int32), k0])
    else:
        w = _load_w(W, e, n0 + tl.arange(0, BLOCK_N), k0, N_ROWS, K, BLOCK_K)
    return tl.trans(_mm_in(w, DOT_F32))


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0  # saturates cleanly to +-1 for large |x|


@triton.jit
def _program_tile(
    BLOCK_EXPERT, RUN_END, RUN_LEN, tiles, n_blocks, BLOCK_M: tl.constexpr, EXPERT_MAJOR: tl.constexpr,
    ROW_TILES: tl.constexpr,
):
    """(first row tile, column block, row tiles covered) of this program in the 1D grid of `tiles * n_blocks`.

    "tile" order (EXPERT_MAJOR False): the row tile is the fastest axis, so the programs running at once hold one
    column block of many experts. "expert": expert e owns the programs [first * n_blocks, (first + count) *
    n_blocks), [first, first + count) being its row tiles, cut in groups of ROW_TILES consecutive tiles, walked as all
    its column blocks, each over all its groups: a weight tile is read by its groups back to back (L2 serves all but
    the first), and the expert's rows of x (gate_up) or h (down), a few hundred KB, stay in L2 across its column
    blocks, where the "tile" order re-reads all of x / h from HBM once per column block. A program multiplies each
    weight tile it loads by its group's row tiles, so the weights cross from L2 to the SMs once per group rather
    than once per row tile. With groups the expert's last `(count - groups) * n_blocks` programs have no work
    (covered 0). `pid // n_blocks` is always one of the program's expert's tiles, which finds the expert; spare
    tiles (expert -1) are a run of one.
    """
    pid = tl.program_id(0)
    # One return: triton 3.6 does not compile an early return inside a constexpr branch here.
    if EXPERT_MAJOR:
        t = pid // n_blocks
        e = tl.load(BLOCK_EXPERT + t)
        ec = tl.maximum(e, 0).to(tl.int64)
        run = tl.load(RUN_LEN + ec)  # padded rows of the expert's run
        first = tl.where(e >= 0, (tl.load(RUN_END + ec) - run) // BLOCK_M, t)
        count = tl.where(e >= 0, run // BLOCK_M, 1)
        groups = tl.cdiv(count, ROW_TILES)
        local = pid - first * n_blocks
        group, pid_n = local % groups, local // groups
        pid_m = first + group * ROW_TILES
        covered = tl.where(local < groups * n_blocks, tl.minimum(count - group * ROW_TILES, ROW_TILES), 0)
    else:
        pid_m, pid_n, covered = pid % tiles, pid // tiles, 1
    return pid_m, pid_n, covered


@triton.jit
def _row_tile(SORTED, pid_m, r, covered, num_assign, top_k, BLOCK_M: tl.constexpr):
    """Row tile r of the program's group: its BLOCK_M padded rows, their assignment ids, which are real (none past
    the `covered` tiles, which belong to the next expert), and their tokens."""
    rows = (pid_m + r) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows < (pid_m + covered) * BLOCK_M  # all or none of the tile's rows
    assign = tl.load(SORTED + rows, mask=live, other=num_assign)
    valid = assign < num_assign
    return rows, live, assign, valid, (assign // top_k).to(tl.int64)


@triton.jit
def _x_rows(X, token, valid, kx, D):
    """A row tile's x rows (gathered by token), inputs kx: `[BLOCK_M, BLOCK_K]`, zeros for pad rows."""
    return tl.load(X + token[:, None] * D + kx[None, :], mask=valid[:, None] & (kx[None, :] < D), other=0.0)


@triton.jit
def _gate_up_dots(X, token, valid, kx, D, wg_t, wu_t, acc_g, acc_u, DOT_F32: tl.constexpr):
    """One K step of one row tile: its x rows `[BLOCK_M, BLOCK_K]` times the loaded gate and up tiles."""
    x = _mm_in(_x_rows(X, token, valid, kx, D), DOT_F32)
    return tl.dot(x, wg_t, acc_g), tl.dot(x, wu_t, acc_u)


@triton.jit
def _situ_store(H, rows, live, acc_g, acc_u, n, I, beta, linear_beta):
    h = beta * _tanh(acc_g / beta) * tl.sigmoid(acc_g) * (linear_beta * _tanh(acc_u / linear_beta))
    rows64 = rows.to(tl.int64)
    tl.store(H + rows64[:, None] * I + n[None, :], h.to(H.dtype.element_ty), mask=live[:, None] & (n[None, :] < I))


@triton.jit
def _h_rows(Hs, pid_m, r, live, k0, I, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, H_DESC: tl.constexpr):
    """Row tile r's h rows, inputs k0..: `[BLOCK_M, BLOCK_K]`. H_DESC: Hs is a TMA descriptor over `[padded rows,
    I]` (a tile past the group's, unmasked there, is read but never stored)."""
    if H_DESC:
        h = Hs.load([((pid_m + r) * BLOCK_M).to(tl.int32), k0])
    else:
        rows = ((pid_m + r) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        kh = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(Hs + rows[:, None] * I + kh[None, :], mask=live[:, None] & (kh[None, :] < I), other=0.0)
    return h


@triton.jit
def _down_dot(Hs, pid_m, r, live, k0, I, w_t, acc, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              H_DESC: tl.constexpr, DOT_F32: tl.constexpr):
    """One K step of row tile r: its h rows times the loaded down tile."""
    h = _h_rows(Hs, pid_m, r, live, k0, I, BLOCK_M, BLOCK_K, H_DESC)
    return tl.dot(_mm_in(h, DOT_F32), w_t, acc)


@triton.jit
def _down_store(OUT, TOPW, assign, valid, token, n, D, acc, REDUCE_SORTED: tl.constexpr):
    wt = tl.load(TOPW + assign, mask=valid, other=0.0).to(tl.float32)
    mask = valid[:, None] & (n[None, :] < D)
    if REDUCE_SORTED:
        # Each assignment id occurs once in SORTED, so every (row, channel) of OUT is written by exactly one program.
        tl.store(OUT + assign.to(tl.int64)[:, None] * D + n[None, :], acc * wt[:, None], mask=mask)
    else:
        # relaxed: the order of the adds does not matter and the kernel's end orders them for the reader; the default
        # acq_rel puts a GPU-wide fence and an L1 invalidation around every element's atomic (sm_90a SASS)
        tl.atomic_add(OUT + token[:, None] * D + n[None, :], acc * wt[:, None], mask=mask, sem="relaxed")


@triton.jit
def _gate_up_situ(
    X, W, S, H, SORTED, BLOCK_EXPERT, RUN_END, RUN_LEN, tiles, num_assign, top_k, D, I, beta, linear_beta,
    FP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    EXPERT_MAJOR: tl.constexpr, ROW_TILES: tl.constexpr, W_DESC: tl.constexpr,
):
    """ROW_TILES (1-4, > 1 for dense weights only) row tiles share each loaded weight tile; one accumulator pair
    each (Triton has no arrays of tensors, hence the unrolled tiles). W_DESC: dense weights through a TMA
    descriptor (`_w_tile`)."""
    pid_m, pid_n, covered = _program_tile(
        BLOCK_EXPERT, RUN_END, RUN_LEN, tiles, tl.cdiv(I, BLOCK_N), BLOCK_M, EXPERT_MAJOR, ROW_TILES
    )
    e = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    if (e < 0) | (covered == 0):  # a tile past the real ones (`_align` bounds the grid without a host sync)
        return
    rows0, live0, assign0, valid0, token0 = _row_tile(SORTED, pid_m, 0, covered, num_assign, top_k, BLOCK_M)
    if ROW_TILES > 1:
        rows1, live1, assign1, valid1, token1 = _row_tile(SORTED, pid_m, 1, covered, num_assign, top_k, BLOCK_M)
        acc_g1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ROW_TILES > 2:
        rows2, live2, assign2, valid2, token2 = _row_tile(SORTED, pid_m, 2, covered, num_assign, top_k, BLOCK_M)
        acc_g2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ROW_TILES > 3:
        rows3, live3, assign3, valid3, token3 = _row_tile(SORTED, pid_m, 3, covered, num_assign, top_k, BLOCK_M)
        acc_g3 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u3 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc_g0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        kx = k0 + tl.arange(0, BLOCK_K)
        if FP4:
            x = _x_rows(X, token0, valid0, kx, D)
            acc_g0 = _fp4_dot(x, W, S, e, n, k0, 2 * I, D, acc_g0, BLOCK_K)  # gate rows [0, I)
            acc_u0 = _fp4_dot(x, W, S, e, n + I, k0, 2 * I, D, acc_u0, BLOCK_K)  # up rows [I, 2I)
        else:
            wg_t = _w_tile(W, e, pid_n * BLOCK_N, k0, 2 * I, D, BLOCK_N, BLOCK_K, W_DESC, DOT_F32)  # gate [0, I)
            wu_t = _w_tile(W, e, pid_n * BLOCK_N + I, k0, 2 * I, D, BLOCK_N, BLOCK_K, W_DESC, DOT_F32)  # up [I, 2I)
            acc_g0, acc_u0 = _gate_up_dots(X, token0, valid0, kx, D, wg_t, wu_t, acc_g0, acc_u0, DOT_F32)
            if ROW_TILES > 1:
                acc_g1, acc_u1 = _gate_up_dots(X, token1, valid1, kx, D, wg_t, wu_t, acc_g1, acc_u1, DOT_F32)
            if ROW_TILES > 2:
                acc_g2, acc_u2 = _gate_up_dots(X, token2, valid2, kx, D, wg_t, wu_t, acc_g2, acc_u2, DOT_F32)
            if ROW_TILES > 3:
                acc_g3, acc_u3 = _gate_up_dots(X, token3, valid3, kx, D, wg_t, wu_t, acc_g3, acc_u3, DOT_F32)
    _situ_store(H, rows0, live0, acc_g0, acc_u0, n, I, beta, linear_beta)
    if ROW_TILES > 1:
        _situ_store(H, rows1, live1, acc_g1, acc_u1, n, I, beta, linear_beta)
    if ROW_TILES > 2:
        _situ_store(H, rows2, live2, acc_g2, acc_u2, n, I, beta, linear_beta)
    if ROW_TILES > 3:
        _situ_store(H, rows3, live3, acc_g3, acc_u3, n, I, beta, linear_beta)


@triton.jit
def _down(
    Hs, W, S, OUT, SORTED, BLOCK_EXPERT, RUN_END, RUN_LEN, TOPW, tiles, num_assign, top_k, D, I,
    FP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    REDUCE_SORTED: tl.constexpr, EXPERT_MAJOR: tl.constexpr, ROW_TILES: tl.constexpr, W_DESC: tl.constexpr,
):
    """OUT: `[N, D]` fp32 accumulated atomically, or with REDUCE_SORTED `[N * top_k, D]` fp32 written once a row.
    ROW_TILES as in `_gate_up_situ`; W_DESC: the weights and Hs both through TMA descriptors."""
    pid_m, pid_n, covered = _program_tile(
        BLOCK_EXPERT, RUN_END, RUN_LEN, tiles, tl.cdiv(D, BLOCK_N), BLOCK_M, EXPERT_MAJOR, ROW_TILES
    )
    e = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    if (e < 0) | (covered == 0):  # a tile past the real ones (`_align` bounds the grid without a host sync)
        return
    _, live0, assign0, valid0, token0 = _row_tile(SORTED, pid_m, 0, covered, num_assign, top_k, BLOCK_M)
    if ROW_TILES > 1:
        _, live1, assign1, valid1, token1 = _row_tile(SORTED, pid_m, 1, covered, num_assign, top_k, BLOCK_M)
        acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ROW_TILES > 2:
        _, live2, assign2, valid2, token2 = _row_tile(SORTED, pid_m, 2, covered, num_assign, top_k, BLOCK_M)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ROW_TILES > 3:
        _, live3, assign3, valid3, token3 = _row_tile(SORTED, pid_m, 3, covered, num_assign, top_k, BLOCK_M)
        acc3 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output (latent) channels
    acc0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if FP4:
            h = _h_rows(Hs, pid_m, 0, live0, k0, I, BLOCK_M, BLOCK_K, False)
            acc0 = _fp4_dot(h, W, S, e, n, k0, D, I, acc0, BLOCK_K)
        else:
            w_t = _w_tile(W, e, pid_n * BLOCK_N, k0, D, I, BLOCK_N, BLOCK_K, W_DESC, DOT_F32)
            acc0 = _down_dot(Hs, pid_m, 0, live0, k0, I, w_t, acc0, BLOCK_M, BLOCK_K, W_DESC, DOT_F32)
            if ROW_TILES > 1:
                acc1 = _down_dot(Hs, pid_m, 1, live1, k0, I, w_t, acc1, BLOCK_M, BLOCK_K, W_DESC, DOT_F32)
            if ROW_TILES > 2:
                acc2 = _down_dot(Hs, pid_m, 2, live2, k0, I, w_t, acc2, BLOCK_M, BLOCK_K, W_DESC, DOT_F32)
            if ROW_TILES > 3:
                acc3 = _down_dot(Hs, pid_m, 3, live3, k0, I, w_t, acc3, BLOCK_M, BLOCK_K, W_DESC, DOT_F32)
    _down_store(OUT, TOPW, assign0, valid0, token0, n, D, acc0, REDUCE_SORTED)
    if ROW_TILES > 1:
        _down_store(OUT, TOPW, assign1, valid1, token1, n, D, acc1, REDUCE_SORTED)
    if ROW_TILES > 2:
        _down_store(OUT, TOPW, assign2, valid2, token2, n, D, acc2, REDUCE_SORTED)
    if ROW_TILES > 3:
        _down_store(OUT, TOPW, assign3, valid3, token3, n, D, acc3, REDUCE_SORTED)


# Up to this many assignments (256 tokens of top-16) `_align` is one Triton program instead of ~20 torch ops: at decode
# those ops cost more than the expert products at one token (BENCHMARKS.md, twenty-fourth session).
_ALIGN_KERNEL_MAX = 4096


@triton.jit
def _align_kernel(FLAT, SORTED, BLOCK_EXPERT, RUN_END, RUN_LEN, A, E, TILES,
                  BLOCK_M: tl.constexpr, A_P: tl.constexpr, E_P: tl.constexpr):
    """`_align` in one program: counts (histogram), padded runs (cumsum), a stable sort of (expert, assignment)
    keys; assignment p of the sorted order goes to its expert's run start plus its rank in the expert, and the
    first assignment of each row tile names the tile's expert (every real tile starts with a real assignment)."""
    i = tl.arange(0, A_P)
    ok = i < A
    e = tl.load(FLAT + i, mask=ok, other=0).to(tl.int32)
    counts = tl.histogram(e, E_P, mask=ok)  # [E_P]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    eo = tl.arange(0, E_P)
    tl.store(RUN_END + eo, end.to(tl.int64), mask=eo < E)
    tl.store(RUN_LEN + eo, padded.to(tl.int64), mask=eo < E)
    for s0 in range(0, TILES * BLOCK_M, A_P):  # pads everywhere first; spare tiles: expert -1
        s = s0 + i
        tl.store(SORTED + s, A, mask=s < TILES * BLOCK_M)
        tl.store(BLOCK_EXPERT + s, -1, mask=s < TILES)
    tl.debug_barrier()  # the fills land before the assignments overwrite theirs (one program: a CTA barrier)
    keys = tl.sort(tl.where(ok, e * A_P + i, E_P * A_P + i))  # expert-major, assignment id within: stable
    es = tl.minimum(keys // A_P, E_P - 1)
    rank = i - tl.gather(tl.cumsum(counts, 0) - counts, es, 0)
    dest = tl.gather(end - padded, es, 0) + rank
    tl.store(SORTED + dest, (keys % A_P).to(tl.int32), mask=ok)
    tl.store(BLOCK_EXPERT + dest // BLOCK_M, es, mask=ok & (rank % BLOCK_M == 0))


def _align(top_idx: torch.Tensor, num_experts: int, block_m: int):
    """Assignments sorted by expert, each expert's run padded to block_m; pad entries hold `num_assign`.

    Without a host sync (decode calls this once per MoE layer and step, and a sync there serialises the CPU's
    launches with the GPU's work): the grid is the bound `cdiv(A, block_m) + min(E, A)` on the row tiles (each
    touched expert adds at most one partial tile), and the tiles past the real ones get expert -1, which the
    kernels skip. Returns (sorted_ids [tiles * block_m] int32, block_expert [tiles] int32, tiles, run_end [E],
    run_len [E]): expert e's padded run is rows [run_end[e] - run_len[e], run_end[e]) (int64; `_program_tile`).
    """
    flat = top_idx.reshape(-1)
    A = flat.numel()
    tiles = triton.cdiv(A, block_m) + min(num_experts, A)
    e_p = max(16, triton.next_power_of_2(num_experts))
    if 0 < A <= _ALIGN_KERNEL_MAX and e_p <= 4096 and (flat.is_cuda or _INTERPRET):
        a_p = max(16, triton.next_power_of_2(A))
        sorted_ids = torch.empty(tiles * block_m, dtype=torch.int32, device=flat.device)
        block_expert = torch.empty(tiles, dtype=torch.int32, device=flat.device)
        end = torch.empty(num_experts, dtype=torch.long, device=flat.device)
        padded = torch.empty_like(end)
        _align_kernel[(1,)](flat, sorted_ids, block_expert, end, padded, A, num_experts, tiles,
                            BLOCK_M=block_m, A_P=a_p, E_P=e_p, num_warps=4, enable_fp_fusion=True)
        return sorted_ids, block_expert, tiles, end, padded
    return _align_torch(flat, num_experts, block_m, tiles)


def _align_torch(flat: torch.Tensor, num_experts: int, block_m: int, tiles: int):
    """`_align` in torch ops (any size; the reference the kernel is tested against)."""
    A = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    end = torch.cumsum(padded, 0)  # padded run of expert e: [end[e] - padded[e], end[e])
    e_sorted = flat[order]
    rank = torch.arange(A, device=flat.device) - (torch.cumsum(counts, 0) - counts)[e_sorted]
    sorted_ids = torch.full((tiles * block_m,), A, dtype=torch.int32, device=flat.device)
    sorted_ids[(end - padded)[e_sorted] + rank] = order.to(torch.int32)
    tile_start = torch.arange(tiles, device=flat.device) * block_m
    block_expert = torch.searchsorted(end, tile_start, right=True)  # the run holding the tile; E past the last
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert, tiles, end, padded


# Launch defaults per (regime, weight format: "mxfp4" or "dense" bf16 / fp16), the one place to drop a GPU sweep's
# winner in (`benchmarks/moe.py --sweep`). Decode (at most `_DECODE_MAX_ROWS` rows an expert on average) is bound by
# the expert-weight bytes (bf16) or by the in-register unpack (MXFP4), which each row tile repeats, so small row
# tiles; prefill reuses each weight tile over many rows. Values: the sweep's best on the H200 at K3 shapes
# (BENCHMARKS.md, fifth and seventh sessions; triton 3.6). Decode, 64 tokens: MXFP4 6.92 ms (64x64 tiles in "tile"
# order; wider K tiles or 8 warps only add unpack latency, "expert" order is 4 % slower), bf16 9.23 ms (128x128 over
# 8 warps, "expert" order, 4 % faster than "tile"). Prefill, 8192 tokens: bf16 29.6 ms, 293 TFLOP/s (64x128x64 tiles
# over 8 warps, "expert" order: 1.16x "tile", which re-read x and h once per column block), MXFP4 45.4 ms (128-row
# tiles, 64-wide gate_up and 128-wide down tiles over 4 warps, "expert" order: 1.10x the best "tile" config).
# BLOCK_N is clamped to the output width's next power of two (tiny models); the MXFP4 BLOCK_K default falls back to
# 32 where 64 does not divide the K width.
def _tiles(block_m, bn, bk, warps, stages, order, down_bn=None):
    kern = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, "row_tiles": 1, "tma": False}
    down = dict(kern, BLOCK_N=down_bn or bn)
    return {"block_m": block_m, "reduce": "atomic", "order": order, "gluon": False, "gate_up": kern, "down": down}


_DEFAULT_CONFIGS = {
    ("decode", "mxfp4"): dict(_tiles(16, 64, 64, 4, 3, "tile"), gluon=True),
    ("decode", "dense"): _tiles(16, 128, 128, 8, 4, "expert"),
    ("prefill", "mxfp4"): dict(_tiles(128, 64, 64, 4, 4, "expert", down_bn=128), gluon=True),
    ("prefill", "dense"): _tiles(64, 128, 64, 8, 4, "expert"),
}
# Where the regimes meet, in average rows an expert (N * top_k / E), measured at 128-1024 tokens of K3's 896
# experts (seventh session, ms with each regime's config): bf16 decode / prefill 13.6 / 14.6 at 9.1 rows, 16.0 / 14.7
# at 18.3; MXFP4 11.2 / 23.2 at 9.1 rows, 17.5 / 23.3 at 18.3 (its prefill tiles multiply 128 rows per unpacked
# weight; its decode tiles unpack every weight once per 16 rows, so they lose further up).
_DECODE_MAX_ROWS = {"dense": 12, "mxfp4": 24}
# MXFP4 experts run on the Gluon kernels (`gluon_moe`) by default on Hopper from this many assignments (2 tokens of
# top-16), at decode and prefill sizes alike (the Triton prefill tiles were 1.3-1.9x slower at 2K-8K tokens on the
# H100, twenty-fifth session; they stay for other GPUs and `config={"gluon": False}`). H100, K3 shapes, ms, Gluon
# vs Triton, in a CUDA graph / eager (twenty-fourth session, with the one-program `_align`): 1 token 0.186 vs 0.219
# / 0.432 vs 0.235; 2 tokens 0.290 vs 0.392 / 0.459 vs 0.408; 4 tokens 0.472 vs 0.720 / 0.443 vs 0.737; 8 tokens
# 0.843 vs 1.383. At one token an eager call is bound by the host, and the Gluon path costs it about 0.1 ms more a
# call (twenty-fifth session, back to back: 0.35 against 0.22 ms a call, for 0.14 against 0.22 ms of kernels), so
# one token stays on the Triton tiles, except while a CUDA graph is captured: a replay pays no host cost (0.175
# against 0.218 ms a replay).
_GLUON_MIN_ASSIGNMENTS = 32
# ... and up to this many assignments an expert on average: past it the Triton prefill tiles, which unpack each weight
# once for 128 rows where the Gluon kernels do for 64, catch up (H100, MXFP4, ms, Gluon vs Triton tiles, twenty-fifth
# session: 292 an expert (16K tokens) 62.4 vs 69.8; 585 (32K tokens) 120.2 vs 119.3).
_GLUON_MAX_ROWS = 512
# bf16 experts run on the warp-specialised Gluon kernels (`gluon_moe_ws`: one unpack or weight copy a K step shared
# by three 64-token tiles of an expert) by default on Hopper from this many assignments an expert on average (two
# full tiles; K3 at about 7K tokens). H100, 448 experts, 146 rows an expert (K3's load at 8K tokens), best of 3:
# 13.78 ms against 15.32 for the Triton tiles (1.11x; every round faster); at 37 rows an expert (one tile) 10.90
# against 10.36, so below the bound the tiles stay (thirty-seventh session). On MXFP4 experts they are not faster
# than `gluon_moe` (8K tokens: 30.41 against 29.71 ms), so there only `config={"ws": True}` takes them.
_WS_MIN_ROWS = 128
# ... at this launch: every operand by TMA (x gathered once into slot order), 4 token stages and 6 weight stages,
# each ring as far ahead as its depth. H100, 448 experts, best of 4 interleaved rounds, ms against the cp.async launch
# (the kernels' own default; thirty-ninth session): 4096 tokens (146 rows an expert, K3's load at 8K) 12.82-12.90
# against 13.55-13.61 (1.05x); 8192 tokens 20.46-21.00 against 24.92-25.08 (1.19x); 2048 tokens 11.34 against
# 11.73. Ring depths 4-5 / 4-6 are within each other's spread; 3 token or 3 weight stages and fewer are slower.
_WS_DENSE_LAUNCH = {"stages": 4, "w_stages": 6}
_CONFIG_KEYS = ("block_m", "reduce", "order", "gluon", "ws", "gate_up", "down")
_KERNEL_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "row_tiles", "tma")
_REDUCES = ("atomic", "sorted")
_ORDERS = ("expert", "tile")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_pow2_tile(v) -> bool:
    return _is_int(v) and v >= 16 and v & (v - 1) == 0


def _launch_row_tiles(row_tiles: int, assignments: int, num_experts: int, block_m: int) -> int:
    """The row tiles a program covers: `row_tiles` (the config's maximum) capped at the row tiles an expert holds on
    average, so a group rarely has empty tiles to multiply (they cost their products: 25 % at 2K tokens with
    groups of 3, eighteenth session). Host integers only: no sync."""
    return max(1, min(row_tiles, -(-assignments // (num_experts * block_m))))


def _is_decode(assignments: int, num_experts: int, fp4: bool) -> bool:
    return assignments <= _DECODE_MAX_ROWS["mxfp4" if fp4 else "dense"] * num_experts


def _resolve_config(config, block_m, *, decode: bool, fp4: bool, D: int, I: int) -> dict:
    """The regime's defaults overridden by `config` (and `block_m=`), validated: a full config dict.

    Per-kernel widths: `gate_up` reads K = D (latent) and writes N = I; `down` reads K = I and writes N = D.
    """
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict or None, got {type(config).__name__}")
    for key in config:
        if key not in _CONFIG_KEYS:
            raise ValueError(f"config: unknown key {key!r} (known: {', '.join(_CONFIG_KEYS)})")
    if block_m is not None and "block_m" in config and config["block_m"] != block_m:
        raise ValueError(f"block_m given twice: block_m={block_m} and config['block_m']={config['block_m']}")
    base = _DEFAULT_CONFIGS[("decode" if decode else "prefill", "mxfp4" if fp4 else "dense")]
    out = {"block_m": config.get("block_m", block_m if block_m is not None else base["block_m"]),
           "reduce": config.get("reduce", base["reduce"]), "order": config.get("order", base["order"])}
    if not _is_pow2_tile(out["block_m"]):
        raise ValueError(f"block_m must be a power of two >= 16 (tl.dot's smallest M), got {out['block_m']!r}")
    if out["reduce"] not in _REDUCES:
        raise ValueError(f"config['reduce'] must be one of {_REDUCES}, got {out['reduce']!r}")
    if out["order"] not in _ORDERS:
        raise ValueError(f"config['order'] must be one of {_ORDERS}, got {out['order']!r}")
    out["gluon"] = config.get("gluon", base["gluon"])
    if not isinstance(out["gluon"], bool):
        raise ValueError(f"config['gluon'] must be True or False, got {out['gluon']!r}")
    if "gluon" in config and out["gluon"] and not fp4:
        raise ValueError("config['gluon'] = True: the Gluon kernels serve MXFP4 experts only, got bf16 / fp16 weights")
    out["ws"] = config.get("ws")
    if out["ws"] is not None and not isinstance(out["ws"], bool):
        raise ValueError(f"config['ws'] must be True, False or None (by the load), got {out['ws']!r}")
    for kern, k_name, K, N in (("gate_up", "D", D, I), ("down", "I", I, D)):  # K read, N written
        sub = config.get(kern, {})
        if not isinstance(sub, dict):
            raise ValueError(f"config[{kern!r}] must be a dict, got {type(sub).__name__}")
        for key in sub:
            if key not in _KERNEL_KEYS:
                raise ValueError(f"config[{kern!r}]: unknown key {key!r} (known: {', '.join(_KERNEL_KEYS)})")
        kc = dict(base[kern])
        # Defaults only: narrow outputs (tiny models) get a narrower tile; an explicit BLOCK_N is taken as given.
        kc["BLOCK_N"] = min(kc["BLOCK_N"], max(16, triton.next_power_of_2(N)))
        if fp4 and K % kc["BLOCK_K"]:
            kc["BLOCK_K"] = 32  # the K width is a multiple of 32 (checked by the caller)
        kc.update(sub)
        for key in ("BLOCK_N", "BLOCK_K"):
            if not _is_pow2_tile(kc[key]):
                raise ValueError(f"config[{kern!r}][{key!r}] must be a power of two >= 16, got {kc[key]!r}")
        if fp4 and (kc["BLOCK_K"] % 32 or K % kc["BLOCK_K"]):
            # `_fp4_dot` has no column mask and reads one E8M0 byte per 32 inputs.
            raise ValueError(f"config[{kern!r}]['BLOCK_K'] = {kc['BLOCK_K']} must be a multiple of 32 dividing the "
                             f"MXFP4 K width {k_name}={K}")
        nw = kc["num_warps"]
        if not _is_int(nw) or nw not in (1, 2, 4, 8):
            raise ValueError(f"config[{kern!r}]['num_warps'] must be 1, 2, 4 or 8, got {nw!r}")
        if not _is_int(kc["num_stages"]) or kc["num_stages"] < 1:
            raise ValueError(f"config[{kern!r}]['num_stages'] must be an int >= 1, got {kc['num_stages']!r}")
        rt = kc["row_tiles"]
        if not _is_int(rt) or not 1 <= rt <= 4:
            raise ValueError(f"config[{kern!r}]['row_tiles'] must be an int in 1..4, got {rt!r}")
        if rt > 1 and (fp4 or out["order"] != "expert"):
            # tl.dot_scaled unpacks its weight tile inside each product, so MXFP4 gains nothing from sharing it;
            # the "tile" order has no expert runs to group.
            raise ValueError(f"config[{kern!r}]['row_tiles'] = {rt} needs bf16 / fp16 weights and order 'expert'")
        if not isinstance(kc["tma"], bool):
            raise ValueError(f"config[{kern!r}]['tma'] must be True or False, got {kc['tma']!r}")
        if kc["tma"] and (fp4 or K % 8):
            # A TMA row must be a multiple of 16 bytes; the packed MXFP4 path keeps its pointer loads.
            raise ValueError(f"config[{kern!r}]['tma'] needs bf16 / fp16 weights and {k_name}={K} a multiple of 8")
        out[kern] = kc
    return out


def _gluon_unavailable(device: torch.device) -> str | None:
    """Why the Gluon MXFP4 kernels cannot run on `device`, or None if they can."""
    try:
        from .gluon_moe import gluon_available
    except ImportError as exc:  # triton without Gluon (older than 3.5)
        return f"this triton has no Gluon ({exc})"
    if not gluon_available(device):
        return f"the Gluon kernels need a compute capability 9.x CUDA device (wgmma), got {device}"
    return None


def _ws_unavailable(device: torch.device, fp4: bool, dtypes, D: int, I: int) -> str | None:
    """Why the warp-specialised Gluon experts (`gluon_moe_ws`) cannot run here, or None if they can."""
    why = _gluon_unavailable(device)
    if why is not None:
        return why
    from .gluon_moe_ws import unsupported

    return unsupported(fp4, dtypes, D, I)


def _descriptor(t: torch.Tensor, block: list[int]):
    """Host-side TMA descriptor of a 2D row-major tensor (Hopper's bulk tensor copies; the CPU interpreter emulates
    them). TMA needs a 16-byte-aligned base and row stride, so an explicit request that cannot have them raises."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if t.is_cuda and torch.cuda.get_device_capability(t.device)[0] < 9:
        raise ValueError(f"config 'tma': TMA needs compute capability 9.0 or newer, {torch.cuda.get_device_name(t.device)} "
                         "has " + ".".join(map(str, torch.cuda.get_device_capability(t.device))))
    if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
        raise ValueError(f"config 'tma': a {tuple(t.shape)} operand is not 16-byte aligned (base or row stride)")
    return TensorDescriptor.from_tensor(t, block_shape=block)


def moe_experts_triton(
    x, top_idx, top_w, *, gate_up=None, down=None, w13_packed=None, w13_scale=None, w2_packed=None, w2_scale=None,
    beta: float = 4.0, linear_beta: float = 25.0, block_m: int | None = None, config: dict | None = None,
):
    """x `[N, D]` -> `[N, D]`. Give bf16/fp16 `gate_up [E, 2I, D]` + `down [E, D, I]`, or the MXFP4 quartet.

    `config` (all keys optional, the rest from `_DEFAULT_CONFIGS` of the regime, decode when N * k <=
    `_DECODE_MAX_ROWS` * E, and the weight format):
    `block_m` (rows per tile, a power of two >= 16; same as the `block_m=` argument, giving both differently
    raises), `reduce` ("atomic" or "sorted", see the module doc), `order` ("expert" or "tile": the programs' launch
    order, see `_program_tile`), and per kernel `gate_up` / `down` dicts with
    `BLOCK_N`, `BLOCK_K` (powers of two >= 16; with MXFP4 a multiple of 32 dividing the K width: D for gate_up,
    I for down), `num_warps` (1, 2, 4, 8), `num_stages` (>= 1), `row_tiles` (1-4: a program multiplies each weight
    tile it loads by up to that many row tiles of its expert, see `_program_tile`; bf16 / fp16 weights, "expert"
    order) and `tma` (bool: the dense weights, and down's h, through Hopper TMA descriptors; compute capability
    >= 9.0, the K width a multiple of 8). `row_tiles` is a maximum: a launch covers at most the row tiles an expert
    holds on average (`_launch_row_tiles`). `gluon` (bool): MXFP4 experts run on the Gluon kernels of `gluon_moe`
    (tiles and block_m then do not apply). By default on Hopper from `_GLUON_MIN_ASSIGNMENTS` assignments (from one
    while a CUDA graph is captured) up to `_GLUON_MAX_ROWS` an expert on average (decode and prefill sizes),
    elsewhere the Triton kernels (warning once where Gluon cannot run); an explicit True always uses them and raises
    where they cannot run (not Hopper, bf16 weights). `ws` (bool or None): the warp-specialised Gluon kernels of
    `gluon_moe_ws`; None (the default) takes them for bf16 experts on Hopper from `_WS_MIN_ROWS` assignments an
    expert on average when no other key is given, True always (bf16 or MXFP4; raises where they cannot run), False
    never. Unknown keys raise ValueError.
    """
    fp4 = w13_packed is not None
    if fp4 == (gate_up is not None):
        raise ValueError("pass either gate_up/down (dense) or w13_packed/w13_scale/w2_packed/w2_scale (MXFP4)")
    if fp4:
        E, two_i, D = w13_packed.shape[0], w13_packed.shape[1], 2 * w13_packed.shape[2]
        W1, S1, W2, S2 = w13_packed, w13_scale, w2_packed, w2_scale
        for name, t in (("w13_packed", W1), ("w13_scale", S1), ("w2_packed", W2), ("w2_scale", S2)):
            if t.dtype != torch.uint8:
                raise ValueError(f"{name} must be uint8, got {t.dtype}")
        if D % 32 or w2_packed.shape[-1] % 16:
            raise ValueError(
                f"MXFP4 experts need the latent and expert widths divisible by 32, got {D} and {2 * w2_packed.shape[-1]}"
            )
    else:
        E, two_i, D = gate_up.shape
        W1, S1, W2, S2 = gate_up.contiguous(), gate_up, down.contiguous(), down  # S* unused for dense
    I = two_i // 2
    if x.dim() != 2 or x.shape[1] != D:
        raise ValueError(f"hidden_states must be [N, {D}], got {tuple(x.shape)}")
    if top_idx.shape != top_w.shape or top_idx.shape[0] != x.shape[0]:
        raise ValueError(f"top_k_index {tuple(top_idx.shape)} / top_k_weights {tuple(top_w.shape)} must be [N, k]")
    N, k = top_idx.shape
    # Decode: a handful of tokens per expert, so small row tiles; prefill: bigger tiles reuse the weights.
    decode = _is_decode(N * k, E, fp4)
    cfg = _resolve_config(config, block_m, decode=decode, fp4=fp4, D=D, I=I)
    if N == 0:
        return torch.zeros((0, D), device=x.device, dtype=x.dtype)
    # by the load unless the call tunes the Triton tiles (any other key)
    auto_ws = (cfg["ws"] is None and not fp4 and N * k >= _WS_MIN_ROWS * E and block_m is None
               and set(config or {}) <= {"ws", "gluon"})
    if cfg["ws"] or auto_ws:
        why = _ws_unavailable(x.device, fp4, (W1.dtype, W2.dtype), D, I)
        if why is None:
            from .gluon_moe_ws import moe_experts_gluon_ws

            weights = ({"w13_packed": W1, "w13_scale": S1, "w2_packed": W2, "w2_scale": S2} if fp4
                       else {"gate_up": W1, "down": W2, **_WS_DENSE_LAUNCH})
            return moe_experts_gluon_ws(x, top_idx, top_w, **weights, beta=beta, linear_beta=linear_beta)
        if cfg["ws"]:
            raise RuntimeError(f"config['ws'] = True: {why}")
        if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9:
            _warn_once("moe-ws", f"transformers-k3: experts at prefill sizes use the Triton tiles ({why})")
    explicit = "gluon" in (config or {})
    least = 1 if x.is_cuda and torch.cuda.is_current_stream_capturing() else _GLUON_MIN_ASSIGNMENTS
    if cfg["gluon"] and fp4 and (explicit or least <= N * k <= _GLUON_MAX_ROWS * E):
        why = _gluon_unavailable(x.device)
        if why is None:
            from .gluon_moe import moe_experts_gluon

            return moe_experts_gluon(x, top_idx, top_w, W1, S1, W2, S2, beta=beta, linear_beta=linear_beta)
        if explicit:
            raise RuntimeError(f"config['gluon'] = True: {why}")
        _warn_once("moe-gluon", f"transformers-k3: MXFP4 experts use the Triton kernels ({why})")
    bm, c1, c2 = cfg["block_m"], cfg["gate_up"], cfg["down"]
    sorted_ids, block_expert, tiles, run_end, run_len = _align(top_idx, E, bm)
    hbuf = torch.empty((tiles * bm, I), device=x.device, dtype=torch.bfloat16)
    reduce_sorted, expert_major = cfg["reduce"] == "sorted", cfg["order"] == "expert"
    # sorted: every [N * k, D] row is written once by `_down` (empty is fine); atomic: the adds need zeros.
    out = (torch.empty if reduce_sorted else torch.zeros)((N * k if reduce_sorted else N, D), device=x.device,
                                                          dtype=torch.float32)
    x = x.contiguous()
    w1, w2, hs = W1, W2, hbuf
    if c1["tma"]:
        w1 = _descriptor(W1.view(E * two_i, D), [c1["BLOCK_N"], c1["BLOCK_K"]])
    if c2["tma"]:
        w2 = _descriptor(W2.view(E * D, I), [c2["BLOCK_N"], c2["BLOCK_K"]])
        hs = _descriptor(hbuf, [bm, c2["BLOCK_K"]])
    _gate_up_situ[(tiles * triton.cdiv(I, c1["BLOCK_N"]),)](
        x, w1, S1, hbuf, sorted_ids, block_expert, run_end, run_len, tiles, N * k, k, D, I, beta, linear_beta,
        FP4=fp4, BLOCK_M=bm, BLOCK_N=c1["BLOCK_N"], BLOCK_K=c1["BLOCK_K"], DOT_F32=_DOT_F32, EXPERT_MAJOR=expert_major,
        ROW_TILES=_launch_row_tiles(c1["row_tiles"], N * k, E, bm), W_DESC=c1["tma"], num_warps=c1["num_warps"], num_stages=c1["num_stages"],
        enable_fp_fusion=True,
    )
    _down[(tiles * triton.cdiv(D, c2["BLOCK_N"]),)](
        hs, w2, S2, out, sorted_ids, block_expert, run_end, run_len, top_w.reshape(-1).float().contiguous(), tiles,
        N * k, k, D, I,
        FP4=fp4, BLOCK_M=bm, BLOCK_N=c2["BLOCK_N"], BLOCK_K=c2["BLOCK_K"], DOT_F32=_DOT_F32,
        REDUCE_SORTED=reduce_sorted, EXPERT_MAJOR=expert_major, ROW_TILES=_launch_row_tiles(c2["row_tiles"], N * k, E, bm),
        W_DESC=c2["tma"], num_warps=c2["num_warps"], num_stages=c2["num_stages"], enable_fp_fusion=True,
    )
    if reduce_sorted:
        out = out.view(N, k, D).sum(1)  # assignment id = token * k + slot: a token's k rows are adjacent
    return out.to(x.dtype)
