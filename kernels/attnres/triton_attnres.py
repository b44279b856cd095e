"""Fused Block Attention Residuals (AttnRes) in Triton: the per-token softmax mix over depth candidates.

Same maths as `reference.attn_res` (beside this file), written so each candidate row is read from memory once
(an online softmax over the candidates, a whole row in registers) and nothing of size `[N, T, d]` is made in fp32:

    logit_i = r_i * p_i,   r_i = rsqrt(mean(v_i^2) + eps),   p_i = <v_i, norm_weight * query_weight>
    alpha = softmax_i(logit),   out = sum_i alpha_i v_i

The key RMSNorm is folded into the logit (`<v_i r_i, w> = r_i <v_i, w>`), so one pass gives both statistics.
Backward (one read of every candidate row, `out` and `dout`; `sum_j alpha_j dalpha_j = <dout, out>`):

    dalpha_i = <dout, v_i>,   dlogit_i = alpha_i (dalpha_i - sum_j alpha_j dalpha_j)
    dv_i = alpha_i dout + dlogit_i (r_i w - p_i r_i^3 v_i / d)
    dw = sum_{t, i} dlogit_i r_i v_i   (partial sums per program of 16 tokens, summed by torch)

Triton is imported here, so import this module only where Triton is available (see `k3_kernels.dispatch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["attn_res_triton"]


@triton.jit
def _attnres_fwd(
    V, W, O, OF, ALPHA, T, D, eps, N: tl.constexpr, SAVE_F32: tl.constexpr, BLOCK_D: tl.constexpr
):
    # One token row per program, the whole row of one candidate at a time in registers: an online softmax over
    # the candidates reads every candidate exactly once. The next candidate's row is loaded before this one's
    # reductions: those end in barriers the compiler does not move loads across, so without the prefetch every
    # candidate paid a full memory latency in turn (32 % of bandwidth at N = 9 on the H200).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < D
    w = tl.load(W + offs, mask=dmask, other=0.0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    m = float("-inf")
    den = 0.0
    v_next = tl.load(V + row * D + offs, mask=dmask, other=0.0)
    for i in tl.static_range(N):
        v = v_next.to(tl.float32)
        if i + 1 < N:
            v_next = tl.load(V + ((i + 1) * T + row) * D + offs, mask=dmask, other=0.0)
        r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
        logit = r * tl.sum(v * w, axis=0)
        tl.store(ALPHA + i * T + row, logit)  # logits now, turned into alpha below
        m_new = tl.maximum(m, logit)
        scale = tl.exp(m - m_new)
        e = tl.exp(logit - m_new)
        acc = acc * scale + e * v
        den = den * scale + e
        m = m_new
    out = acc / den
    tl.store(O + row * D + offs, out.to(O.dtype.element_ty), mask=dmask)
    if SAVE_F32:
        # Backward needs <dout, out> to cancel against <dout, v_i>: a bf16-rounded out would swamp the difference.
        tl.store(OF + row * D + offs, out, mask=dmask)
    for i in tl.static_range(N):
        logit = tl.load(ALPHA + i * T + row)
        tl.store(ALPHA + i * T + row, tl.exp(logit - m) / den)


@triton.jit
def _attnres_bwd(
    V, W, O, DO, ALPHA, DV, DW, T, D, eps, N: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    # `sum_j alpha_j dalpha_j = <dout, out>`, so each candidate's gradient needs only its own row: one read of
    # every candidate, `dout` and the fp32 `out`. Each program takes ROWS tokens and keeps a partial dw in registers.
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < D
    w = tl.load(W + offs, mask=dmask, other=0.0)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(ROWS):
        row = pid.to(tl.int64) * ROWS + j
        if row < T:
            do = tl.load(DO + row * D + offs, mask=dmask, other=0.0).to(tl.float32)
            o = tl.load(O + row * D + offs, mask=dmask, other=0.0).to(tl.float32)
            do_o = tl.sum(do * o, axis=0)
            v_next = tl.load(V + row * D + offs, mask=dmask, other=0.0)  # prefetched as in the forward
            for i in tl.static_range(N):
                v = v_next.to(tl.float32)
                if i + 1 < N:
                    v_next = tl.load(V + ((i + 1) * T + row) * D + offs, mask=dmask, other=0.0)
                alpha = tl.load(ALPHA + i * T + row)
                r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
                p = tl.sum(v * w, axis=0)
                dlogit = alpha * (tl.sum(do * v, axis=0) - do_o)
                dv = alpha * do + (dlogit * r) * w - (dlogit * p * r * r * r / D) * v
                tl.store(DV + (i * T + row) * D + offs, dv.to(DV.dtype.element_ty), mask=dmask)
                dw += (dlogit * r) * v
    tl.store(DW + pid.to(tl.int64) * D + offs, dw, mask=dmask)


def _launch_cfg(D: int):
    BLOCK_D = max(16, triton.next_power_of_2(D))
    if BLOCK_D > 16384:
        raise ValueError(f"attn_res_triton keeps a whole row in registers: hidden size {D} > 16384 is not supported")
    # ~32 fp32 values of a row per thread.
    num_warps = max(1, min(16, BLOCK_D // (32 * 32)))
    return BLOCK_D, num_warps


_BWD_ROWS = 16  # tokens per backward program: partial dw buffers are T/16 rows of d floats


class _AttnResFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v, query_weight, norm_weight, eps):
        N, D = v.shape[0], v.shape[-1]
        lead = v.shape[1:-1]
        v3 = v.reshape(N, -1, D).contiguous()  # [N, T, D], T = all leading token dims
        T = v3.shape[1]
        w = (norm_weight.reshape(D).float() * query_weight.reshape(D).float()).contiguous()
        out = torch.empty((T, D), device=v.device, dtype=v.dtype)
        alpha = torch.empty((N, T), device=v.device, dtype=torch.float32)
        grad = any(ctx.needs_input_grad[:3])
        out_f32 = out if v.dtype == torch.float32 or not grad else torch.empty(out.shape, device=v.device)
        BLOCK_D, num_warps = _launch_cfg(D)
        if T > 0:
            _attnres_fwd[(T,)](
                v3, w, out, out_f32, alpha, T, D, eps, N=N, SAVE_F32=out_f32 is not out, BLOCK_D=BLOCK_D,
                num_warps=num_warps,
            )
        ctx.save_for_backward(v3, w, out_f32, alpha, query_weight, norm_weight)
        ctx.lead, ctx.eps = lead, eps
        return out.view(*lead, D)

    @staticmethod
    def backward(ctx, dout):
        v3, w, out, alpha, query_weight, norm_weight = ctx.saved_tensors
        N, T, D = v3.shape
        do = dout.reshape(T, D).contiguous()
        dv = torch.empty_like(v3)
        n_prog = triton.cdiv(T, _BWD_ROWS)
        dw_part = torch.empty((max(n_prog, 1), D), device=v3.device, dtype=torch.float32)
        BLOCK_D, num_warps = _launch_cfg(D)
        if T > 0:
            _attnres_bwd[(n_prog,)](
                v3, w, out, do, alpha, dv, dw_part, T, D, ctx.eps, N=N, ROWS=_BWD_ROWS, BLOCK_D=BLOCK_D,
                num_warps=num_warps,
            )
        else:
            dw_part.zero_()
        dw = dw_part.sum(0)  # [D]
        dq = (dw * norm_weight.reshape(D).float()).reshape(query_weight.shape).to(query_weight.dtype)
        dn = (dw * query_weight.reshape(D).float()).reshape(norm_weight.shape).to(norm_weight.dtype)
        return dv.view(N, *ctx.lead, D), dq, dn, None


def attn_res_triton(candidates, query_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5):
    """Drop-in for `reference.attn_res` on CUDA (or under `TRITON_INTERPRET=1`): list or stacked `[N, ..., d]`."""
    v = candidates if isinstance(candidates, torch.Tensor) else torch.stack(list(candidates), dim=0)
    if v.dim() < 2:
        raise ValueError(f"stacked candidates must be [N, ..., d], got {tuple(v.shape)}")
    d = v.shape[-1]
    if query_weight.numel() != d or norm_weight.numel() != d:
        raise ValueError(
            f"query_weight {tuple(query_weight.shape)} and norm_weight {tuple(norm_weight.shape)} must have {d} elements"
        )
    if v.shape[0] > 16:
        raise ValueError(f"attn_res_triton supports at most 16 depth candidates, got {v.shape[0]}")
    return _AttnResFunction.apply(v, query_weight, norm_weight, float(eps))
