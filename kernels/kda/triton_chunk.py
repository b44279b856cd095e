"""Chunked KDA forward in Triton for prefill / training, exploiting K3's bounded gate.

Same contract as :func:`k3_kernels.kda.reference.chunk_kda` (fla layout [B, T, H, K], fp32 state
[N, H, K, V], varlen ``cu_seqlens``), plus fla's in-kernel gate / beta-sigmoid / q,k L2 norm flags.

Why chunk 16 without log-space secondary chunking: K3's gate is ``g = lower_bound * sigmoid(...)`` with
``lower_bound >= -5``, so the cumulative log decay ``G`` inside a 16-token tile lies in (-80, 0]. Then
``exp(G)`` >= e^-80 ~ 1.8e-35 and ``exp(-G)`` <= e^80 ~ 5.5e34 are both normal numbers in fp32 *and* bf16
(same exponent range), so the decay-weighted products ``k_i . k_j exp(G_i - G_j)`` are plain dense dots
``(k * exp(G)) @ (k * exp(-G))^T`` and no pairwise [C, C, K] decay tensor is needed.

Algorithm (one program per (sequence, head, V-block), sequential over 16-token chunks, state in fp32
registers), derived from the reference's UT transform:

    Akk = strict_lower((k e^G) (k e^-G)^T),  Aqk = causal_lower((s q e^G) (k e^-G)^T)
    X   = (I + diag(beta) Akk)^-1                 # forward substitution on the 16x16 tile
    u   = X diag(beta) v - X diag(beta) (k e^G) S  # = u0 - w S
    o   = (s q e^G) S + Aqk u
    S  <- S * e^{G_last} + (k e^{G_last - G})^T u

``chunk_kda_fwd(..., split=True)`` moves the S-independent part (cumsum, Akk, X, w, u0) into a kernel that
is parallel over (chunk, head) and leaves only the four state products in the sequential loop.

Precision: fp32 inputs use exact fp32 dots; bf16 inputs use bf16 dots for the intra-chunk products and
tf32 for every product against the fp32 state (bf16 there cost ~1e-2 relative error in the final state).

Backward: there is no Triton backward yet. :func:`chunk_kda` is a ``torch.autograd.Function`` whose
backward recomputes the forward with the fp32 torch reference under autograd (exact gradients for q, k, v,
g or (z, A_log, dt_bias), beta and initial_state; memory/time of the reference).

Triton is imported lazily by whoever imports this module (``k3_kernels.kda`` does not import it).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import reference as _ref

__all__ = ["chunk_kda", "chunk_kda_fwd"]

# Tile length. The safety argument above needs BT * |lower_bound| <= ~80, i.e. BT = 16 with g >= -5.
_BT = 16
_MAX_STEP_DECAY = 5.0


@triton.jit
def _mm(a, b, DOT_BF16: tl.constexpr):
    # DOT_BF16 = 0: exact fp32 ("ieee") for fp32 inputs; 1: bf16 operands, fp32 accumulate (bf16 inputs);
    # 2: the same numerics emulated (operands rounded to bf16, fp32 dot) because the Triton CPU interpreter
    # multiplies bf16 tiles as raw uint16 bits; 3: tf32 (used for the dots against the fp32 state).
    if DOT_BF16 == 1:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif DOT_BF16 == 2:
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
    elif DOT_BF16 == 3:
        return tl.dot(a, b, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _kda_chunk_fwd_kernel(
    q, k, v, g, beta, o, h0, ht, cu_seqlens, A_log, dt_bias, w_buf, u_buf,
    scale, lower_bound, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
    USE_GATE: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, USE_L2NORM: tl.constexpr,
    DOT_BF16: tl.constexpr, STATE_DOT: tl.constexpr, PRE_WU: tl.constexpr,
):
    # PRE_WU: w and u0 were computed by _kda_chunk_prep_kernel (parallel over chunks) and are loaded;
    # otherwise they are computed here, inside the sequential loop (fused, no extra HBM traffic).
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    L = eos - bos

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    causal = o_t[:, None] >= o_t[None, :]
    strict = o_t[:, None] > o_t[None, :]
    eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)

    # state S [K, BV], fp32 in registers for the whole sequence
    p_state = ((i_n * H + i_h) * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :]
    if USE_H0:
        S = tl.load(h0 + p_state).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    if USE_GATE:
        a_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)

    for i_c in range(0, tl.cdiv(L, BT)):
        pos = i_c * BT + o_t  # position inside the sequence
        m_t = pos < L
        rows = bos + pos  # [BT] flat token index
        p_qk = (rows[:, None] * H + i_h) * K + o_k[None, :]
        m_qk = m_t[:, None]
        # Tokens past the end load as k = q = v = 0, beta = 0, g = 0: no effect on state or decay.
        b_q = tl.load(q + p_qk, mask=m_qk, other=0.0).to(tl.float32)
        b_k = tl.load(k + p_qk, mask=m_qk, other=0.0).to(tl.float32)
        b_g = tl.load(g + p_qk, mask=m_qk, other=0.0).to(tl.float32)
        if USE_GATE:
            b_g = tl.where(m_qk, lower_bound * tl.sigmoid(a_h * (b_g + bias[None, :])), 0.0)
        b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
        if USE_BETA_SIGMOID:
            b_beta = tl.where(m_t, tl.sigmoid(b_beta), 0.0)
        if USE_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)[:, None]
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
        p_v = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_qk, other=0.0).to(tl.float32)

        gc = tl.cumsum(b_g, axis=0)  # [BT, K] in (-80, 0] thanks to the bounded gate
        g_last = tl.sum(tl.where(o_t[:, None] == BT - 1, gc, 0.0), axis=0)  # [K]
        kg = b_k * tl.exp(gc)
        kn = b_k * tl.exp(-gc)
        qg = b_q * scale * tl.exp(gc)
        kd = b_k * tl.exp(g_last[None, :] - gc)

        Aqk = tl.where(causal, _mm(qg, tl.trans(kn), DOT_BF16), 0.0)
        if PRE_WU:
            w = tl.load(w_buf + p_qk, mask=m_qk, other=0.0).to(tl.float32)
            u0 = tl.load(u_buf + p_v, mask=m_qk, other=0.0).to(tl.float32)
        else:
            Akk = tl.where(strict, _mm(kg, tl.trans(kn), DOT_BF16), 0.0)

            # X = (I - M)^-1 with M = -diag(beta) Akk strictly lower: row i of X is e_i + sum_{j<i} M_ij X_j
            # (forward substitution). The cheaper nilpotent product (I + M)(I + M^2)(I + M^4)(I + M^8) was
            # tried and rejected: with correlated keys and beta ~ 1 the powers of M grow like binomials and
            # cancel, losing ~3e-4 relative in fp32 (test_correlated_keys_beta_one).
            M = -b_beta[:, None] * Akk
            X = eye
            for i in tl.static_range(1, BT):
                m_i = tl.sum(tl.where(o_t[:, None] == i, M, 0.0), axis=0)  # [BT] row i of M
                x_i = tl.sum(m_i[:, None] * X, axis=0) + tl.where(o_t == i, 1.0, 0.0)
                X = tl.where(o_t[:, None] == i, x_i[None, :], X)

            w = tl.dot(X, b_beta[:, None] * kg, input_precision="ieee")  # [BT, K]
            u0 = tl.dot(X, b_beta[:, None] * b_v, input_precision="ieee")  # [BT, BV]
        # Dots against the state (and its update) in tf32 for bf16 inputs: bf16-rounding S / u costs ~1e-2
        # relative error in o and S at T = 300, tf32 ~8x less; these tiles are small, the loop latency-bound.
        u = u0 - _mm(w, S, STATE_DOT)
        b_o = _mm(qg, S, STATE_DOT) + _mm(Aqk, u, STATE_DOT)
        tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_qk)
        S = S * tl.exp(g_last)[:, None] + _mm(tl.trans(kd), u, STATE_DOT)

    if STORE_FINAL:
        tl.store(ht + p_state, S)


@triton.jit
def _kda_chunk_prep_kernel(
    q, k, v, g, beta, cu_seqlens, chunk_indices, A_log, dt_bias, w_buf, u_buf, lower_bound,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    USE_GATE: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, USE_L2NORM: tl.constexpr, DOT_BF16: tl.constexpr,
):
    """Per (chunk, head), fully parallel: w = X diag(beta) k e^G [BT, K] and u0 = X diag(beta) v [BT, V]."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c)
    i_t = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    L = eos - bos
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    strict = o_t[:, None] > o_t[None, :]
    pos = i_t * BT + o_t
    m_t = pos < L
    rows = bos + pos
    p_qk = (rows[:, None] * H + i_h) * K + o_k[None, :]
    m_qk = m_t[:, None]
    b_k = tl.load(k + p_qk, mask=m_qk, other=0.0).to(tl.float32)
    b_g = tl.load(g + p_qk, mask=m_qk, other=0.0).to(tl.float32)
    if USE_GATE:
        a_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
        b_g = tl.where(m_qk, lower_bound * tl.sigmoid(a_h * (b_g + bias[None, :])), 0.0)
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    if USE_BETA_SIGMOID:
        b_beta = tl.where(m_t, tl.sigmoid(b_beta), 0.0)
    if USE_L2NORM:
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
    p_v = (rows[:, None] * H + i_h) * V + o_v[None, :]
    b_v = tl.load(v + p_v, mask=m_qk, other=0.0).to(tl.float32)
    gc = tl.cumsum(b_g, axis=0)
    kg = b_k * tl.exp(gc)
    kn = b_k * tl.exp(-gc)
    M = -b_beta[:, None] * tl.where(strict, _mm(kg, tl.trans(kn), DOT_BF16), 0.0)
    X = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    for i in tl.static_range(1, BT):  # forward substitution, as in the fused kernel
        m_i = tl.sum(tl.where(o_t[:, None] == i, M, 0.0), axis=0)
        x_i = tl.sum(m_i[:, None] * X, axis=0) + tl.where(o_t == i, 1.0, 0.0)
        X = tl.where(o_t[:, None] == i, x_i[None, :], X)
    w = tl.dot(X, b_beta[:, None] * kg, input_precision="ieee")
    u0 = tl.dot(X, b_beta[:, None] * b_v, input_precision="ieee")
    tl.store(w_buf + p_qk, w.to(w_buf.dtype.element_ty), mask=m_qk)
    tl.store(u_buf + p_v, u0.to(u_buf.dtype.element_ty), mask=m_qk)


def _is_pow2(n: int) -> bool:
    return n >= 16 and (n & (n - 1)) == 0


def chunk_kda_fwd(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=-5.0,
    use_beta_sigmoid_in_kernel=False, out=None, block_v=None, num_warps=4, split=False,
):
    """Forward only (no autograd). ``out`` (optional, [B, T, H, V], v.dtype) receives the output.

    ``split=True``: w, u0 are first computed for all chunks in parallel (``_kda_chunk_prep_kernel``; w in
    q.dtype, u0 in fp32 because bf16 u0 cost ~6e-3 relative error in the final state; ~1.5 KB per token-head
    of extra traffic at K = V = 128), then the sequential kernel only does the state products;
    ``split=False`` (default) computes them inside the sequential loop. Which is faster on an H200 is
    measured by benchmarks/kda_chunk.py (not yet run).
    """
    B, T, H, K, V, N = _ref._validate(q, k, v, g, beta, initial_state, cu_seqlens)
    if not (_is_pow2(K) and _is_pow2(V)):
        raise ValueError(f"K and V must be powers of two >= 16 for the Triton kernel, got K={K}, V={V}")
    if use_gate_in_kernel:
        if A_log is None or dt_bias is None:
            raise ValueError("use_gate_in_kernel=True needs A_log and dt_bias")
        if A_log.dim() != 1 or A_log.shape[0] < H:
            raise ValueError(f"A_log must be a vector of length >= H = {H}, got {tuple(A_log.shape)}")
        if dt_bias.numel() != H * K:
            raise ValueError(f"dt_bias must be [H*K] = [{H * K}], got {tuple(dt_bias.shape)}")
        if not (-_MAX_STEP_DECAY <= lower_bound <= 0):
            raise ValueError(
                f"lower_bound must be in [-{_MAX_STEP_DECAY}, 0] (bounded-gate chunk kernel), got {lower_bound}"
            )
    elif T > 0:
        # The 16-token tile is exp-safe only when each step's log decay is >= -5 (see module docstring).
        g_min = float(g.min())
        if not g_min >= -_MAX_STEP_DECAY - 1e-4:
            raise ValueError(
                f"g must satisfy -{_MAX_STEP_DECAY} <= g <= 0 (K3 bounded gate) for the Triton chunk kernel, "
                f"got min(g) = {g_min}; use the torch reference for unbounded gates"
            )
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if out is None:
        out = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    elif tuple(out.shape) != (B, T, H, V) or out.dtype != v.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [B, T, H, V] = {[B, T, H, V]} tensor of dtype {v.dtype}")
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    BV = block_v or min(V, 32)
    if V % BV or not _is_pow2(BV):
        raise ValueError(f"block_v must be a power of two >= 16 dividing V = {V}, got {BV}")
    dummy = q  # placeholder pointer for unused arguments
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous() if cu_seqlens is not None else None
    dot_mode = 0 if q.dtype != torch.bfloat16 else 2 if os.environ.get("TRITON_INTERPRET") == "1" else 1
    gate_args = (A_log.contiguous(), dt_bias.contiguous()) if use_gate_in_kernel else (dummy, dummy)
    w_buf = u_buf = dummy
    if split and T > 0:
        if cu is not None:
            cs = [int(c) for c in cu_seqlens.tolist()]
        else:
            cs = [i * T for i in range(B + 1)]
        # chunk_indices [NT_total, 2] = (sequence, chunk within the sequence)
        idx = [(n, c) for n in range(N) for c in range(triton.cdiv(cs[n + 1] - cs[n], _BT))]
        chunk_indices = torch.tensor(idx, dtype=torch.int32).reshape(-1, 2).to(q.device)
        cu_all = torch.tensor(cs, dtype=torch.int32, device=q.device)
        w_buf = torch.empty(B, T, H, K, dtype=q.dtype, device=q.device)
        u_buf = torch.empty(B, T, H, V, dtype=torch.float32, device=q.device)
        if len(idx):
            _kda_chunk_prep_kernel[(len(idx), H)](
                q, k, v, g, beta, cu_all, chunk_indices, *gate_args, w_buf, u_buf, float(lower_bound),
                H=H, K=K, V=V, BT=_BT, USE_GATE=bool(use_gate_in_kernel),
                USE_BETA_SIGMOID=bool(use_beta_sigmoid_in_kernel), USE_L2NORM=bool(use_qk_l2norm_in_kernel),
                DOT_BF16=dot_mode, num_warps=num_warps,
            )
    grid = (N, H, V // BV)
    _kda_chunk_fwd_kernel[grid](
        q, k, v, g, beta, out,
        h0 if h0 is not None else dummy, ht if ht is not None else dummy,
        cu if cu is not None else dummy,
        *gate_args, w_buf, u_buf,
        float(scale), float(lower_bound), T,
        H=H, K=K, V=V, BT=_BT, BV=BV,
        IS_VARLEN=cu is not None, USE_H0=h0 is not None, STORE_FINAL=output_final_state,
        USE_GATE=bool(use_gate_in_kernel), USE_BETA_SIGMOID=bool(use_beta_sigmoid_in_kernel),
        USE_L2NORM=bool(use_qk_l2norm_in_kernel),
        DOT_BF16=dot_mode, STATE_DOT=3 if q.dtype == torch.bfloat16 else 0, PRE_WU=w_buf is not dummy,
        num_warps=num_warps,
    )
    return out, ht


def _reference_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, flags):
    """fp32 torch reference with the same flags; differentiable (used for backward)."""
    use_l2, use_gate, use_bsig, lower_bound = flags
    if use_gate:
        g = _ref.kda_gate(g, A_log, dt_bias, lower_bound=lower_bound)
    if use_bsig:
        beta = torch.sigmoid(beta.float())
    # chunk 16: the [B, H, C, C, K] pairwise-decay tensors the reference keeps for autograd are 16x smaller
    # than at chunk 64 (at T = 8K, H = 96, K = 128 about 30 GB saved instead of ~130 GB).
    return _ref.chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_l2, chunk_size=16,
    )


class _ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, flags):
        use_l2, use_gate, use_bsig, lower_bound = flags
        o, ht = chunk_kda_fwd(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_l2, use_gate_in_kernel=use_gate,
            A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_bsig,
        )
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state)
        ctx.cu_seqlens, ctx.scale, ctx.flags = cu_seqlens, scale, flags
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[:8]
        with torch.enable_grad():
            inputs = [
                None if t is None else t.detach().requires_grad_(bool(n) and t.is_floating_point())
                for t, n in zip(saved, needs)
            ]
            o, ht = _reference_forward(*inputs, ctx.cu_seqlens, ctx.scale, ctx.flags)
            wrt = [t for t in inputs if t is not None and t.requires_grad]
            outs, grads = [o], [do]
            if dht is not None:
                outs.append(ht)
                grads.append(dht)
            got = torch.autograd.grad(outs, wrt, grads, allow_unused=True) if wrt else []
        it = iter(got)
        result = [next(it) if (t is not None and t.requires_grad) else None for t in inputs]
        result = [r if r is None or s is None else r.to(s.dtype) for r, s in zip(result, saved)]
        return (*result, None, None, None)


def chunk_kda(
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
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0,
    use_beta_sigmoid_in_kernel: bool = False,
):
    """Chunked KDA forward (Triton) with autograd.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: fp32 log decay [B, T, H, K] with -5 <= g <= 0, or the raw gate
    input z when ``use_gate_in_kernel`` (then ``g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias))``,
    A_log [>= H], dt_bias [H*K]); beta: [B, T, H] (raw logits when ``use_beta_sigmoid_in_kernel``).
    initial_state: [N, H, K, V]. Returns (o [B, T, H, V] in v.dtype, final_state fp32 [N, H, K, V] or None).

    Backward: recomputes the forward with the fp32 torch reference under autograd (no Triton backward yet).
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    flags = (bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel), bool(use_beta_sigmoid_in_kernel),
             float(lower_bound))
    o, ht = _ChunkKDAFunction.apply(q, k, v, g, beta, A_log if use_gate_in_kernel else None,
                                    dt_bias if use_gate_in_kernel else None, initial_state, cu_seqlens,
                                    float(scale), flags)
    return o, (ht if output_final_state else None)
