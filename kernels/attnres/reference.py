"""Block Attention Residuals reference: softmax mix over depth candidates.

For candidates ``V_i [..., d]`` (i = 0..N-1):

* ``k_i = V_i * rsqrt(mean(V_i**2, -1) + eps)``  (RMSNorm without weight)
* ``s_i = sum_d k_i[d] * norm_weight[d] * query_weight[d]``  (no 1/sqrt(d) scale)
* ``alpha = softmax_i(s)``, ``out = sum_i alpha_i * V_i`` (unnormalised ``V_i``)

Everything is computed in fp32 (fp64 inputs stay fp64, so ``torch.autograd.gradcheck`` works) and the result is
returned in the candidates' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["attn_res"]


def attn_res(
    candidates: Sequence[torch.Tensor] | torch.Tensor,
    query_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``candidates``: list of ``[..., d]`` tensors or a stacked ``[N, ..., d]`` tensor -> ``[..., d]``."""
    if isinstance(candidates, torch.Tensor):
        if candidates.dim() < 2:
            raise ValueError(f"stacked candidates must be [N, ..., d], got {tuple(candidates.shape)}")
        v = candidates
    else:
        candidates = list(candidates)
        if len(candidates) == 0:
            raise ValueError("candidates must contain at least one tensor")
        shape = candidates[0].shape
        for i, c in enumerate(candidates):
            if c.shape != shape:
                raise ValueError(f"candidate {i} has shape {tuple(c.shape)}, expected {tuple(shape)}")
        v = torch.stack(candidates, dim=0)
    d = v.shape[-1]
    if query_weight.numel() != d or norm_weight.numel() != d:
        raise ValueError(
            f"query_weight {tuple(query_weight.shape)} and norm_weight {tuple(norm_weight.shape)} must have {d} elements"
        )
    out_dtype = v.dtype
    compute = torch.promote_types(out_dtype, torch.float32)
    vf = v.to(compute)
    keys = vf * torch.rsqrt(vf.pow(2).mean(dim=-1, keepdim=True) + eps)
    w = norm_weight.reshape(d).to(compute) * query_weight.reshape(d).to(compute)
    logits = (keys * w).sum(dim=-1)  # [N, ...]
    alpha = torch.softmax(logits, dim=0)
    out = (alpha.unsqueeze(-1) * vf).sum(dim=0)
    return out.to(out_dtype)
