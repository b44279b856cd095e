"""The K3 short convolution for decode in Triton: one launch per conv for a few cached tokens, state in and out.

The torch path (`reference.causal_conv1d`) spends about eight launches on a decode step (dtype casts, the
concatenation with the state, conv1d, SiLU, the state slice): at decode each of K3's 69 KDA layers runs three of
these convs, and the step is bound by launches, not by the ~100 KB a conv reads. This kernel reads the fp32 state
`[B, D, W-1]` and the new tokens `[B, T, D]` once, writes `y` in x's dtype and the new fp32 state (a new tensor:
the caller's state stays valid, which speculative rollback needs). fp32 arithmetic throughout, as the reference.
Prefill stays on torch (cuDNN's conv1d over long sequences); no backward (training runs the torch path).
Reference beside this file: `reference.causal_conv1d`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import check_conv_args

__all__ = ["causal_conv1d_step"]


@triton.jit
def _conv_step_kernel(X, Wt, S, Y, S_OUT, T, D, s_xb, s_xt, s_yb, s_yt,
                      WIDTH: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    x_row = X + b * s_xb + d
    s_row = S + (b * D + d) * (WIDTH - 1)  # this sequence's state, [D, W-1] fp32
    # The window of output t covers inputs t - (W-1) .. t: index i >= 0 is token i, i < 0 is state slot i + W - 1.
    for t in range(0, T):
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for w in tl.static_range(WIDTH):
            i = d * 0 + (t + w - (WIDTH - 1))  # [BLOCK_D], all equal: a vector mask
            xv = tl.load(x_row + i * s_xt, mask=dm & (i >= 0), other=0.0).to(tl.float32)
            sv = tl.load(s_row + (i + WIDTH - 1), mask=dm & (i < 0), other=0.0)
            acc += tl.load(Wt + d * WIDTH + w, mask=dm, other=0.0) * (xv + sv)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(Y + b * s_yb + t * s_yt + d, acc.to(Y.dtype.element_ty), mask=dm)
    for j in tl.static_range(WIDTH - 1):  # the new state: the last W-1 inputs of [state, tokens]
        i = d * 0 + (T + j - (WIDTH - 1))
        xv = tl.load(x_row + i * s_xt, mask=dm & (i >= 0), other=0.0).to(tl.float32)
        sv = tl.load(s_row + (i + WIDTH - 1), mask=dm & (i < 0), other=0.0)
        tl.store(S_OUT + (b * D + d) * (WIDTH - 1) + j, xv + sv, mask=dm)


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None = None,
                       activation: str | None = "silu", block_d: int = 256):
    """`reference.causal_conv1d(x, weight, initial_state, output_final_state=True, activation=...)` for a few
    tokens: x `[B, T, D]`, weight `[D, W]` or `[D, 1, W]`, initial_state `[B, D, W-1]` (zeros if None).
    Returns (y `[B, T, D]` in x.dtype, final state `[B, D, W-1]` fp32)."""
    (B, T, D), weight = check_conv_args(x, weight, activation)
    W = weight.shape[-1]
    if W < 2:
        raise ValueError(f"causal_conv1d_step needs a kernel width >= 2 (a state), got {W}")
    if initial_state is None:
        initial_state = torch.zeros(B, D, W - 1, device=x.device, dtype=torch.float32)
    elif tuple(initial_state.shape) != (B, D, W - 1):
        raise ValueError(f"initial_state must be [B, D, W-1] = [{B}, {D}, {W - 1}], got {tuple(initial_state.shape)}")
    state = initial_state.float().contiguous()
    w = weight.float().contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(B, T, D, device=x.device, dtype=x.dtype)
    new_state = torch.empty_like(state)
    if B:
        _conv_step_kernel[(B, triton.cdiv(D, block_d))](
            x, w, state, y, new_state, T, D, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
            WIDTH=W, SILU=activation is not None, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=True,
        )
    return y, new_state
