"""Triton fused recurrent KDA (decode / short multi-token verify), fla-compatible `[B, T, H, K]` layout.

Same contract as :func:`k3_kernels.kda.reference.fused_recurrent_kda` (the oracle), plus what a serving
engine needs: the gate and beta sigmoid fused in the kernel, fp32 state updated in place, and state slots
(`ssm_state_indices`) so a paged cache / continuous batching can address its own state rows.

One program owns one `[K, BV]` tile of one (sequence, head) state, kept in fp32 registers for all the
sequence's tokens: the state is read once and written once per call, whatever T is. Per token the output is
computed from the decayed state *before* the rank-1 update,

    o = q^T (D S + k u^T) = (q^T D S) + (q . k) u,      u = beta (v - k^T D S),

so both reductions over K read the same tile and are independent (no second pass over the updated state).

Importing this module needs Triton; `k3_kernels.dispatch` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import _validate_shapes

__all__ = ["fused_recurrent_kda"]


@triton.jit(do_not_specialize=["T"])
def _fused_recurrent_kda_fwd_kernel(
    q, k, v, g, beta, A_log, dt_bias,
    o, h0, ht, hs,
    cu_seqlens, state_idx,
    scale, lower_bound, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    INPLACE_FINAL_STATE: tl.constexpr,
    STORE_INTERMEDIATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_STATE_INDICES: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr,
    BETA_SIGMOID: tl.constexpr,
    QK_L2NORM: tl.constexpr,
):
    # 1-D grid flattened as (V-blocks fastest, then sequence * head): the NV programs of one head are
    # neighbours and share q, k, g in L2, and the grid has no 65535 limit on B * H.
    NV = tl.cdiv(V, BV)
    pid = tl.program_id(0).to(tl.int64)
    i_v = pid % NV
    i_nh = pid // NV
    i_n = i_nh // H
    i_h = i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        bos = i_n * T
        T_n = T

    # State slot of this sequence; a negative slot marks a padding row (CUDA-graph batches padded to a
    # fixed size): its state is neither read nor written and its output is zero.
    if HAS_STATE_INDICES:
        slot = tl.load(state_idx + i_n).to(tl.int64)
    else:
        slot = i_n
    valid = slot >= 0
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    slot = tl.maximum(slot, 0)
    offs_h = o_k[:, None] * V + o_v[None, :]  # [BK, BV] inside one [K, V] state

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        p_h0 = h0 + (slot * H + i_h) * K * V + offs_h
        b_h = tl.load(p_h0, mask=mask_h, other=0.0, eviction_policy="evict_first").to(tl.float32)
        # a padding row reads row 0 (harmless) and starts from zero: the masks stay per-lane (vectorisable)
        b_h = tl.where(valid, b_h, 0.0)

    if GATE_IN_KERNEL:
        b_A = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        b_bias = tl.load(dt_bias + i_h * K + o_k, mask=mask_k, other=0.0).to(tl.float32)

    p_q = q + (bos * H + i_h) * K + o_k
    p_k = k + (bos * H + i_h) * K + o_k
    p_g = g + (bos * H + i_h) * K + o_k
    p_v = v + (bos * H + i_h) * V + o_v
    p_o = o + (bos * H + i_h) * V + o_v
    p_beta = beta + bos * H + i_h
    for t in range(0, T_n):
        b_q = tl.load(p_q, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(p_v, mask=mask_v, other=0.0).to(tl.float32)
        b_g = tl.load(p_g, mask=mask_k, other=0.0).to(tl.float32)
        b_beta = tl.load(p_beta).to(tl.float32)
        if QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        b_q = b_q * scale
        if GATE_IN_KERNEL:
            # K3 lower-bounded gate; masked lanes have k = q = 0 and a zero state row, so their decay is moot.
            b_g = lower_bound * tl.sigmoid(b_A * (b_g + b_bias))
        if BETA_SIGMOID:
            b_beta = tl.sigmoid(b_beta)

        b_h = b_h * tl.exp(b_g)[:, None]
        b_kh = tl.sum(b_h * b_k[:, None], axis=0)  # [BV]  k^T D S
        b_qh = tl.sum(b_h * b_q[:, None], axis=0)  # [BV]  q^T D S
        b_u = b_beta * (b_v - b_kh)
        b_h = b_h + b_k[:, None] * b_u[None, :]
        b_o = b_qh + tl.sum(b_q * b_k, axis=0) * b_u
        b_o = tl.where(valid, b_o, 0.0)
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=mask_v)
        if STORE_INTERMEDIATE:
            p_hs = hs + ((bos + t) * H + i_h) * K * V + offs_h
            tl.store(p_hs, tl.where(valid, b_h, 0.0), mask=mask_h)

        p_q += H * K
        p_k += H * K
        p_g += H * K
        p_v += H * V
        p_o += H * V
        p_beta += H

    if STORE_FINAL_STATE:
        if INPLACE_FINAL_STATE:
            if valid:
                p_ht = h0 + (slot * H + i_h) * K * V + offs_h
                tl.store(p_ht, b_h, mask=mask_h, eviction_policy="evict_first")
        else:
            p_ht = ht + (i_n * H + i_h) * K * V + offs_h
            tl.store(p_ht, tl.where(valid, b_h, 0.0), mask=mask_h, eviction_policy="evict_first")


def _default_config(K: int, V: int, n_states: int) -> tuple[int, int]:
    """(BV, num_warps) for `n_states` (sequence, head) states.

    Few states: a [K, 32] fp32 tile over 4 warps (32 state registers a thread at K = 128) gives more programs to
    spread over the SMs. Many states (a batch of decodes): [K, 64] over 2 warps, 128 registers a thread and
    half the programs; measured on the H200 at B = 64, H = 96 (BENCHMARKS.md): 3.91 TB/s against 3.67 TB/s.
    """
    BK = triton.next_power_of_2(K)
    if n_states >= 1024:
        return min(triton.next_power_of_2(V), max(16, 8192 // BK)), 2
    return min(triton.next_power_of_2(V), max(16, 4096 // BK)), 4


def _check_float(name: str, x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    inplace_final_state: bool = False,
    ssm_state_indices: torch.Tensor | None = None,
    output_intermediate_states: bool = False,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
):
    """Token-by-token KDA in one Triton kernel.

    q, k: [B, T, H, K]; v: [B, T, H, V] (bf16 / fp16 / fp32). g: fp32 log-decay [B, T, H, K], or with
    `use_gate_in_kernel=True` the raw gate logits z, and then `A_log` [>= H], `dt_bias` [H*K] and
    `lower_bound` give ``g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias))``. beta: [B, T, H],
    post-sigmoid unless `use_beta_sigmoid_in_kernel`. `cu_seqlens` [N+1] (B = 1) packs N sequences
    (values are not checked here: no host sync, so the call can be captured in a CUDA graph).

    State: `initial_state` is fp32 [N, H, K, V], or [S, H, K, V] addressed through `ssm_state_indices` [N]
    (sequence n reads row `ssm_state_indices[n]`; a negative index is a padding row: zero output, state
    untouched). With `inplace_final_state=True` the final states are written back into those rows and
    `initial_state` itself is returned as the final state; otherwise `output_final_state=True` returns a
    new fp32 [N, H, K, V]. `output_intermediate_states=True` also returns the fp32 state after every
    token, [B, T, H, K, V] (what a speculative verifier rolls back to), as a third element.

    Returns (o [B, T, H, V] in v.dtype, final_state or None[, intermediate_states]).
    `block_v` / `num_warps` override the launch configuration (benchmark sweeps).
    """
    if torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state, A_log, dt_bias)
    ):
        raise RuntimeError(
            "the Triton fused_recurrent_kda is forward-only (no backward): call it under torch.no_grad() or "
            "use the torch reference (kda_backend='torch') for training"
        )
    B, T, H, K, V = _validate_shapes(q, k, v, g, beta)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_float(name, x)
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size B = 1, got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be an integer tensor [N+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        N = cu_seqlens.numel() - 1
    else:
        N = B
    if ssm_state_indices is not None:
        if initial_state is None:
            raise ValueError("ssm_state_indices needs initial_state (the slot pool it indexes)")
        if ssm_state_indices.shape != (N,) or ssm_state_indices.is_floating_point():
            raise ValueError(
                f"ssm_state_indices must be an integer tensor [N] = [{N}], got "
                f"{ssm_state_indices.dtype} {tuple(ssm_state_indices.shape)}"
            )
    if initial_state is not None:
        rows = initial_state.shape[0] if ssm_state_indices is not None else N
        if initial_state.dim() != 4 or tuple(initial_state.shape) != (rows, H, K, V):
            want = ["S", H, K, V] if ssm_state_indices is not None else [N, H, K, V]
            raise ValueError(f"initial_state must be {want}, got {tuple(initial_state.shape)}")
    if inplace_final_state:
        if initial_state is None:
            raise ValueError("inplace_final_state=True needs initial_state (the tensor to update)")
        if initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
            raise ValueError(
                f"inplace_final_state=True needs a contiguous fp32 initial_state, got {initial_state.dtype}, "
                f"contiguous={initial_state.is_contiguous()}"
            )
    elif initial_state is not None:
        initial_state = initial_state.float().contiguous()
    if use_gate_in_kernel:
        if A_log is None or dt_bias is None or lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log, dt_bias and lower_bound")
        if A_log.dim() != 1 or A_log.shape[0] < H:
            raise ValueError(f"A_log must be a vector of length >= H = {H}, got {tuple(A_log.shape)}")
        if dt_bias.numel() != H * K:
            raise ValueError(f"dt_bias must be [H*K] = [{H * K}], got {tuple(dt_bias.shape)}")
        A_log, dt_bias = A_log.contiguous(), dt_bias.reshape(H * K).contiguous()
    if scale is None:
        scale = K**-0.5

    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if out is None:
        out = torch.empty_like(v)
    elif out.shape != v.shape or out.dtype != v.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {v.dtype} tensor of shape {tuple(v.shape)}")
    store_final = inplace_final_state or output_final_state
    if inplace_final_state:
        final = initial_state
        ht = initial_state
    elif output_final_state:
        final = ht = q.new_empty(N, H, K, V, dtype=torch.float32)
    else:
        final = ht = None
    hs = q.new_empty(B, T, H, K, V, dtype=torch.float32) if output_intermediate_states else None

    BK = triton.next_power_of_2(K)
    BV, warps = _default_config(K, V, N * H)
    BV = block_v or BV
    warps = num_warps or warps
    if BV & (BV - 1):
        raise ValueError(f"block_v must be a power of two, got {BV}")
    dummy = out  # pointer for the arguments a constexpr flag switches off
    grid = (triton.cdiv(V, BV) * N * H,)
    if grid[0] > 0:
        _fused_recurrent_kda_fwd_kernel[grid](
            q, k, v, g, beta,
            A_log if use_gate_in_kernel else dummy,
            dt_bias if use_gate_in_kernel else dummy,
            out,
            initial_state if initial_state is not None else dummy,
            ht if (ht is not None and not inplace_final_state) else dummy,
            hs if hs is not None else dummy,
            cu_seqlens if cu_seqlens is not None else dummy,
            ssm_state_indices if ssm_state_indices is not None else dummy,
            float(scale), float(lower_bound) if lower_bound is not None else 0.0, T,
            H=H, K=K, V=V, BK=BK, BV=BV,
            USE_INITIAL_STATE=initial_state is not None,
            STORE_FINAL_STATE=store_final,
            INPLACE_FINAL_STATE=inplace_final_state,
            STORE_INTERMEDIATE=output_intermediate_states,
            IS_VARLEN=cu_seqlens is not None,
            HAS_STATE_INDICES=ssm_state_indices is not None,
            GATE_IN_KERNEL=use_gate_in_kernel,
            BETA_SIGMOID=use_beta_sigmoid_in_kernel,
            QK_L2NORM=use_qk_l2norm_in_kernel,
            num_warps=warps, enable_fp_fusion=True,
        )
    if output_intermediate_states:
        return out, final, hs
    return out, final


# Read by the model: this op can update a cache's fp32 state in place (`inplace_final_state=True`).
fused_recurrent_kda.supports_inplace_state = True
