"""Torch reference for the routed experts of the K3 latent MoE (SPEC 5), bf16/fp32 or MXFP4-packed weights.

`out[t] = sum_j w[t, j] * E_{idx[t, j]}(x[t])` with `E_e(x) = down_e SiTU-GLU(gate_e x, up_e x)`. Weights in the
model's 3-D layout: `gate_up [E, 2I, D]` (gate rows first, then up), `down [E, D, I]`. Packed experts use the
release's layout: `w13_packed [E, 2I, D/2]` + `w13_scale [E, 2I, D/32]`, `w2_packed [E, D, I/2]` +
`w2_scale [E, D, I/32]` (see `k3_kernels.mxfp4`). One expert at a time, in fp32: the oracle for the Triton kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..mxfp4.reference import dequantize_mxfp4
from ..situ.reference import situ_glu

__all__ = ["moe_experts", "moe_experts_mxfp4"]


def _check_routing(x, top_idx, top_w, num_experts):
    if x.dim() != 2:
        raise ValueError(f"hidden_states must be [N, D], got {tuple(x.shape)}")
    if top_idx.shape != top_w.shape or top_idx.dim() != 2 or top_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"top_k_index {tuple(top_idx.shape)} and top_k_weights {tuple(top_w.shape)} must both be [N={x.shape[0]}, k]"
        )
    if top_idx.numel() and (int(top_idx.min()) < 0 or int(top_idx.max()) >= num_experts):
        raise ValueError(f"top_k_index holds expert ids outside [0, {num_experts})")


def _moe(x, top_idx, top_w, num_experts, expert_weights, beta, linear_beta):
    """The routed sum in fp32; `expert_weights(e)` gives expert e's `(gate_up [2I, D], down [D, I])` in fp32."""
    _check_routing(x, top_idx, top_w, num_experts)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(top_idx).tolist():
        token, slot = torch.where(top_idx == e)
        gate_up, down = expert_weights(e)
        gate, up = F.linear(x[token].float(), gate_up).chunk(2, dim=-1)
        h = F.linear(situ_glu(gate, up, beta, linear_beta), down)
        out.index_add_(0, token, h * top_w[token, slot, None].float())
    return out.to(x.dtype)


def moe_experts(x, top_idx, top_w, gate_up, down, beta: float = 4.0, linear_beta: float = 25.0):
    """x `[N, D]`, top_idx/top_w `[N, k]`, gate_up `[E, 2I, D]`, down `[E, D, I]` -> `[N, D]` in x.dtype."""
    return _moe(x, top_idx, top_w, gate_up.shape[0], lambda e: (gate_up[e].float(), down[e].float()), beta, linear_beta)


def moe_experts_mxfp4(x, top_idx, top_w, w13_packed, w13_scale, w2_packed, w2_scale, beta=4.0, linear_beta=25.0):
    """Same as `moe_experts` on MXFP4 weights, each touched expert dequantised (exactly: power-of-two scales) when
    it is used, so the fp32 copy is one expert's, not all 896 of them."""
    def weights(e):
        return (dequantize_mxfp4(w13_packed[e], w13_scale[e], torch.float32),
                dequantize_mxfp4(w2_packed[e], w2_scale[e], torch.float32))

    return _moe(x, top_idx, top_w, w13_packed.shape[0], weights, beta, linear_beta)
