"""Pure-PyTorch reference for KDA's gated output norm: `sigmoid(gate) * RMSNorm(o)` per head."""

from __future__ import annotations

import torch

__all__ = ["gated_rms_norm"]


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o `[..., K]` (the KDA output), gate `[..., K]` (the `g_proj` pre-activation), weight `[K]` (fp32).

    The norm runs in fp32 with the fp32 weight and is rounded to gate's dtype; the sigmoid gate multiplies it in
    that dtype. Returns `[..., K]` in gate's dtype.
    """
    if o.shape != gate.shape or weight.shape != (o.shape[-1],):
        raise ValueError(f"o {tuple(o.shape)} and gate {tuple(gate.shape)} must match, weight must be "
                         f"[{o.shape[-1]}], got {tuple(weight.shape)}")
    x = o.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return torch.sigmoid(gate) * (weight.float() * x).to(gate.dtype)
