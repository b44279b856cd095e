"""Routed experts of the K3 latent MoE in Triton: grouped matmuls with SiTU-GLU fused, bf16 or MXFP4 weights (W4A16).

The (token, slot) assignments are sorted by expert and each expert's run is padded to a multiple of BLOCK_M
(`_align`), so one program always multiplies BLOCK_M rows by one expert's weight tile. Two kernels:

1. `_gate_up_situ`: `h = SiTU-GLU(x W_gate^T, x W_up^T)` for a `[BLOCK_M, BLOCK_N]` tile of the intermediate width,
   both products accumulated side by side so `x` is loaded once; written as `[padded rows, I]` in x.dtype.
2. `_down`: `y = (h W_down^T) * routing weight`, added with an fp32 atomic into `out[token]` (a token's 16 slots
   meet there; fp32 keeps the sum as accurate as the reference).

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

__all__ = ["moe_experts_triton"]

# Triton's CPU interpreter computes bf16 `tl.dot` wrongly (numpy has no bf16), so under TRITON_INTERPRET the
# products run in fp32 on the same bf16-rounded values; compiled kernels use bf16 tensor cores.
_DOT_F32 = os.environ.get("TRITON_INTERPRET", "0") == "1"


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
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0  # saturates cleanly to +-1 for large |x|


@triton.jit
def _row_tile(SORTED, BLOCK_EXPERT, pid_m, num_assign, top_k, BLOCK_M: tl.constexpr):
    """This program's expert, its BLOCK_M padded rows, their assignment ids, which are real, and their tokens."""
    e = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(SORTED + rows)
    valid = assign < num_assign
    return e, rows, assign, valid, (assign // top_k).to(tl.int64)


@triton.jit
def _gate_up_situ(
    X, W, S, H, SORTED, BLOCK_EXPERT, num_assign, top_k, D, I, beta, linear_beta,
    FP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e, rows, assign, valid, token = _row_tile(SORTED, BLOCK_EXPERT, pid_m, num_assign, top_k, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        kx = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + token[:, None] * D + kx[None, :], mask=valid[:, None] & (kx[None, :] < D), other=0.0)
        if FP4:
            acc_g = _fp4_dot(x, W, S, e, n, k0, 2 * I, D, acc_g, BLOCK_K)  # gate rows [0, I)
            acc_u = _fp4_dot(x, W, S, e, n + I, k0, 2 * I, D, acc_u, BLOCK_K)  # up rows [I, 2I)
        else:
            x = _mm_in(x, DOT_F32)
            wg = _load_w(W, e, n, k0, 2 * I, D, BLOCK_K)  # gate rows [0, I)
            wu = _load_w(W, e, n + I, k0, 2 * I, D, BLOCK_K)  # up rows [I, 2I)
            acc_g = tl.dot(x, tl.trans(_mm_in(wg, DOT_F32)), acc_g)
            acc_u = tl.dot(x, tl.trans(_mm_in(wu, DOT_F32)), acc_u)
    h = beta * _tanh(acc_g / beta) * tl.sigmoid(acc_g) * (linear_beta * _tanh(acc_u / linear_beta))
    rows64 = rows.to(tl.int64)
    tl.store(H + rows64[:, None] * I + n[None, :], h.to(H.dtype.element_ty), mask=n[None, :] < I)


@triton.jit
def _down(
    Hs, W, S, OUT, SORTED, BLOCK_EXPERT, TOPW, num_assign, top_k, D, I,
    FP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e, rows, assign, valid, token = _row_tile(SORTED, BLOCK_EXPERT, pid_m, num_assign, top_k, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output (latent) channels
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kh = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(Hs + rows64[:, None] * I + kh[None, :], mask=kh[None, :] < I, other=0.0)
        if FP4:
            acc = _fp4_dot(h, W, S, e, n, k0, D, I, acc, BLOCK_K)
        else:
            w = _load_w(W, e, n, k0, D, I, BLOCK_K)
            acc = tl.dot(_mm_in(h, DOT_F32), tl.trans(_mm_in(w, DOT_F32)), acc)
    wt = tl.load(TOPW + assign, mask=valid, other=0.0).to(tl.float32)
    tl.atomic_add(OUT + token[:, None] * D + n[None, :], acc * wt[:, None], mask=valid[:, None] & (n[None, :] < D))


def _align(top_idx: torch.Tensor, num_experts: int, block_m: int):
    """Assignments sorted by expert, each expert's run padded to block_m; pad entries hold `num_assign`."""
    flat = top_idx.reshape(-1)
    A = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts
    pstart = torch.cumsum(padded, 0) - padded
    e_sorted = flat[order]
    rank = torch.arange(A, device=flat.device) - start[e_sorted]
    total = int(padded.sum())  # one host sync: the grid size
    sorted_ids = torch.full((total,), A, dtype=torch.int32, device=flat.device)
    sorted_ids[pstart[e_sorted] + rank] = order.to(torch.int32)
    block_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device, dtype=torch.int32), padded // block_m
    )
    return sorted_ids, block_expert, total


def moe_experts_triton(
    x, top_idx, top_w, *, gate_up=None, down=None, w13_packed=None, w13_scale=None, w2_packed=None, w2_scale=None,
    beta: float = 4.0, linear_beta: float = 25.0, block_m: int | None = None,
):
    """x `[N, D]` -> `[N, D]`. Give bf16/fp16 `gate_up [E, 2I, D]` + `down [E, D, I]`, or the MXFP4 quartet."""
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
    out = torch.zeros((N, D), device=x.device, dtype=torch.float32)
    if N == 0:
        return out.to(x.dtype)
    if block_m is None:
        # Decode: a handful of tokens per expert, so small row tiles; prefill: bigger tiles reuse the weights.
        block_m = 16 if N * k <= 4 * E else 64
    sorted_ids, block_expert, total = _align(top_idx, E, block_m)
    hbuf = torch.empty((total, I), device=x.device, dtype=torch.bfloat16)
    bn1, bk1 = min(64, triton.next_power_of_2(I)), 64
    bn2, bk2 = min(64, triton.next_power_of_2(D)), 64
    if fp4:  # `_fp4_dot` has no column mask: its K tile must divide K (a multiple of 32)
        bk1, bk2 = (64 if D % 64 == 0 else 32), (64 if I % 64 == 0 else 32)
    x = x.contiguous()
    _gate_up_situ[(total // block_m, triton.cdiv(I, bn1))](
        x, W1, S1, hbuf, sorted_ids, block_expert, N * k, k, D, I, beta, linear_beta,
        FP4=fp4, BLOCK_M=block_m, BLOCK_N=bn1, BLOCK_K=bk1, DOT_F32=_DOT_F32,
    )
    _down[(total // block_m, triton.cdiv(D, bn2))](
        hbuf, W2, S2, out, sorted_ids, block_expert, top_w.reshape(-1).float().contiguous(), N * k, k, D, I,
        FP4=fp4, BLOCK_M=block_m, BLOCK_N=bn2, BLOCK_K=bk2, DOT_F32=_DOT_F32,
    )
    return out.to(x.dtype)
