"""KDA's gated output norm in one Triton launch: `sigmoid(gate) * RMSNorm(o) * weight` per head row.

The torch path runs about ten launches per KDA layer and step (casts, pow, mean, rsqrt, two multiplies, the
sigmoid, the gate product); decode is bound by launches. Here each program normalises BLOCK_R rows of K channels
in fp32 (fp32 weight) and writes the gated product in gate's dtype, rounded once (the reference rounds the norm,
then the product: outputs differ by at most a bf16 unit in the last place or two). Inference only (no
backward). Reference beside this file: `reference.gated_rms_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gated_rms_norm_triton"]


@triton.jit
def _gated_norm_kernel(O, G, Wt, OUT, R, K, eps, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.arange(0, BLOCK_K)
    m = (rows[:, None] < R) & (k[None, :] < K)
    off = rows.to(tl.int64)[:, None] * K + k[None, :]
    o = tl.load(O + off, mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + off, mask=m, other=0.0).to(tl.float32)
    w = tl.load(Wt + k, mask=k < K, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(o * o, axis=1) / K + eps)
    y = tl.sigmoid(g) * (o * rstd[:, None] * w[None, :])
    tl.store(OUT + off, y.to(OUT.dtype.element_ty), mask=m)


def gated_rms_norm_triton(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `reference.gated_rms_norm`: o, gate `[..., K]`, weight `[K]` -> `[..., K]` in gate's dtype."""
    if o.shape != gate.shape or weight.shape != (o.shape[-1],):
        raise ValueError(f"o {tuple(o.shape)} and gate {tuple(gate.shape)} must match, weight must be "
                         f"[{o.shape[-1]}], got {tuple(weight.shape)}")
    K = o.shape[-1]
    o2, g2 = o.reshape(-1, K).contiguous(), gate.reshape(-1, K).contiguous()  # [R, K]
    R = o2.shape[0]
    out = torch.empty(o.shape, device=o.device, dtype=gate.dtype)
    block_k = triton.next_power_of_2(K)
    block_r = max(1, 4096 // block_k)  # ~4K elements a program
    if R:
        _gated_norm_kernel[(triton.cdiv(R, block_r),)](o2, g2, weight.contiguous(), out, R, K, float(eps),
                                                        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
                                                        enable_fp_fusion=True)
    return out
