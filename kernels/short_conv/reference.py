"""Pure-PyTorch reference for the depthwise causal short convolution (prefill and decode)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "check_conv_args"]


def _conv_core(x, w, state, activation):
    """x [B, T, D] fp32, w [D, W] fp32, state [B, D, W-1] fp32 -> (y [B, T, D], new_state)."""
    D, W = w.shape
    T = x.shape[1]
    full = torch.cat([state, x.transpose(1, 2)], dim=-1)  # [B, D, W-1+T]
    y = F.conv1d(full, w.unsqueeze(1), groups=D) if T > 0 else x.new_zeros(x.shape[0], D, 0)
    y = y.transpose(1, 2)  # [B, T, D]
    if activation in ("silu", "swish"):
        y = F.silu(y)
    new_state = full[..., full.shape[-1] - (W - 1) :] if W > 1 else full[..., :0]
    return y, new_state


def check_conv_args(x: torch.Tensor, weight: torch.Tensor, activation):
    """Validate x `[B, T, D]`, weight `[D, W]` or `[D, 1, W]` and the activation; returns ((B, T, D), weight `[D, W]`)."""
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got {tuple(x.shape)}")
    B, T, D = x.shape
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight must be [D, W] or [D, 1, W] with D = {D}, got {tuple(weight.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    return (B, T, D), weight


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
):
    """Depthwise causal conv1d: ``y[t, d] = act(sum_w weight[d, w] * x[t - (W-1) + w, d])``.

    x: [B, T, D]; weight: [D, W] or [D, 1, W]; initial_state: [N, D, W-1] holding the
    last W-1 inputs of the previous chunk (zeros if None; N = B, or the number of
    segments with cu_seqlens). Returns (y [B, T, D] in x.dtype, final_state fp32
    [N, D, W-1] or None). With cu_seqlens (B must be 1) segments do not leak.
    """
    (B, T, D), weight = check_conv_args(x, weight, activation)
    W = weight.shape[-1]
    w = weight.float()
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size B = 1, got B = {B}")
        cs = [int(c) for c in cu_seqlens.tolist()]
        if len(cs) < 2 or cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs[:-1], cs[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T = {T}, got {cs}")
        N = len(cs) - 1
    else:
        N = B
    if initial_state is not None and tuple(initial_state.shape) != (N, D, W - 1):
        raise ValueError(f"initial_state must be [N, D, W-1] = [{N}, {D}, {W - 1}], got {tuple(initial_state.shape)}")

    xf = x.float()
    h0 = initial_state.float() if initial_state is not None else xf.new_zeros(N, D, W - 1)
    if cu_seqlens is None:
        y, S = _conv_core(xf, w, h0, activation)
    else:
        ys, states = [], []
        for i in range(N):
            y_i, S_i = _conv_core(xf[:, cs[i] : cs[i + 1]], w, h0[i : i + 1], activation)
            ys.append(y_i)
            states.append(S_i)
        y, S = torch.cat(ys, dim=1), torch.cat(states, dim=0)
    return y.to(x.dtype), (S.contiguous() if output_final_state else None)
