"""SiTU-GLU reference: a bounded SwiGLU.

``situ_glu(g, u) = [b1 * tanh(g / b1) * sigmoid(g)] * [b2 * tanh(u / b2)]`` with ``b1 = beta``, ``b2 = linear_beta``.
Near zero it equals SwiGLU ``silu(g) * u``; ``|out| <= b1 * b2`` for any input. Computed in fp32 (fp64 stays fp64),
returned in ``gate.dtype``.
"""

from __future__ import annotations

import torch

__all__ = ["situ_glu"]


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    compute = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(compute)
    u = up.to(compute)
    act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    lin = linear_beta * torch.tanh(u / linear_beta)
    return (act * lin).to(gate.dtype)
