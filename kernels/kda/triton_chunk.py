"""Chunked KDA forward in Triton for prefill / training, exploiting K3's bounded gate.

Same contract as :func:`k3_kernels.kda.reference.chunk_kda` (fla layout [B, T, H, K], fp32 state
[N, H, K, V], varlen ``cu_seqlens``), plus fla's in-kernel gate / beta-sigmoid / q,k L2 norm flags.

Why 16-token tiles without log-space secondary chunking: K3's gate is ``g = lower_bound * sigmoid(...)`` with
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

Precision: fp32 inputs use exact fp32 dots; bf16 inputs use bf16 dots for the intra-chunk products. The
products against the fp32 state take tf32 operands in the 16-token path and, by default, bf16 operands in the
64-token path (``state_dot``; as fla does; ~4e-3 relative in the final state, ~1e-2 in the worst tests).

64-token chunks (``chunk_size=64``, the default: 2.62 ms at T = 8K on the H200 against 6.37 for 16-token
``split``): the state loop above is latency-bound on 16-token steps
(512 sequential steps of tiny dots at T = 8K). With C = 64 the loop has 4x fewer steps and its dots are
[64, K] x [K, BV]. Inside a 64-chunk the cumulative decay G lies in (-320, 0], so exp(-G) would overflow;
the chunk is therefore built from four 16-token sub-tiles t = 0..3 with e_t = G at the end of sub-tile t
and the reference r_t = e_{t-1} (r_0 = 0). For a in sub-tile i and b in sub-tile j <= i:

    G_a - G_b = (G_a - r_i) + (r_i - G_b),    G_a - r_i in [-80, 0]  (16 steps >= -5 each)
    j = i:  r_i - G_b in [0, 80]         -> e^{+-80} are normal fp32 / bf16 numbers, no overflow
    j < i:  r_i - G_b = (r_i - e_j) + (e_j - G_b), both <= 0 (e_j - G_b >= -80)

so every factor is either <= 1 (a decay: underflow to 0 is harmless, the true product is even smaller) or
<= e^80, and ``Akk_ij = (k_i e^{G_i - r_i}) (k_j e^{r_i - G_j})^T`` (strict lower on i = j), likewise
``Aqk_ij`` with s q_i, are plain 16x16 dots: no [C, C, K] tensor. The remaining factors are G <= 0
(``k e^G``, ``s q e^G``) and G_last - G <= 0 (``kd``): safe. The UT system (I + diag(beta) Akk) y = diag(beta)
rhs is block lower triangular; its inverse X is built by blocks, X_ii = (I + diag(beta_i) Akk_ii)^-1 by the
16x16 forward substitution and X_ij = -X_ii sum_{j <= m < i} diag(beta_i) Akk_im X_mj, then applied to
rhs = k e^G (giving w) and rhs = v (giving u0). All of this is independent of the state and runs parallel over
(chunk, head) in two kernels: ``_kda_chunk64_prep_kernel`` (the sub-tile blocks: Aqk, and X diag(beta) to an
fp32 [64, 64] scratch) and ``_kda_chunk64_wu_kernel`` (whole-chunk [64, K] tiles: w (and u0, see below) as
a single [64, 64] x [64, BK] product, qg = s q e^G (q.dtype), kd = k e^{G_last - G}, G_last).
``_kda_chunk64_state_kernel`` (sequential over chunks per (sequence, head, V-block)) then does
u0 = X diag(beta) v from the scratch (independent of S, so it overlaps the loop's dependent products, and no
fp32 u0 buffer goes through HBM; V-blocks narrower than 64 load u0 from the w / u0 kernel instead),
u = u0 - w S, o = qg S + Aqk u, S <- e^{G_last} S + kd^T u. Chunks never cross a sequence boundary
(per-sequence chunk indices, the last chunk of a sequence partial and masked). Precision of the buffers and
dots: see ``_chunk64_fwd``.

The fused loop above (``output="fused"``) is the 64-token default since the thirty-fourth session: on one 8-warp
program per (sequence, head) for V = 128 (``_state64_launch``) it takes no longer than the loop of "stored" below,
which has to write h and v_new, so the output kernel's time is saved whole (H100, T = 8K, same run: forward 1.85
against 2.24 ms; 7.40 against 8.97 at 32K; outputs bit-identical).

Stored states + parallel output (``output="stored"``, the 16-token default; fla's chunk_kda layout; it keeps
every chunk's state while the call runs: 6.4 GB in bf16 at 128K, H = 96, in 64-token chunks;
``benchmarks/kda_chunk.py --stored``): the fused loop above
carries four dependent products per chunk. With "stored" the sequential kernel (the 64-token state kernel,
also run with BT = 16) only does u = u0 - w S (written to v_new, fp32) and S <- e^{G_last} S + kd^T u, and
stores the state at the START of every chunk into h [chunks, H, K, V] (``h_dtype``: bf16 for bf16 inputs);
``_kda_chunk_output_kernel`` then computes o = qg h + Aqk u parallel over (chunk, head, V-block). The 16-token
prep kernel writes qg, kd, Aqk and G_last for it (``STORE_QKA``), as the 64-token prep already does. Cost: h
written and read once (chunks * H * K * V * 2 bytes in bf16, 4x more at chunk 16 than at 64).

Backward: :func:`chunk_kda` is a ``torch.autograd.Function``. Its backward is the Triton backward of
``triton_chunk_bwd.py`` (derivation in its docstring) under the forward's flags: its kernels redo the elementwise
preprocessing (gate, beta sigmoid, q/k L2 norm) and take its backward in their epilogue, so the gradients come
back for q, k, v, g or (z, A_log, dt_bias), beta, initial_state with no torch elementwise work.
``_ChunkKDAFunction.backward_impl = "reference"`` (or env ``K3_KDA_CHUNK_BACKWARD=reference`` at import)
selects the old path instead: recompute the forward with the fp32 torch reference under autograd.

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
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp(x):
    # e^x as exp2(x log2 e): tl.math.exp2 lowers to one ex2.approx.ftz, tl.exp (and tl.sigmoid) to the non-ftz ex2
    # with range fixups around it. The results differ only where e^x is an fp32 subnormal (|x| > 87), which these
    # kernels only ever multiply into negligible terms. In the 64-token prep kernel's loop this and G kept in log2
    # units (``_ks_left``) take 2271 -> 1784 SASS instructions a 16-channel slice (triton 3.6, sm_90a).
    return tl.math.exp2(x * _LOG2E)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + _exp(-x))


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
    causal = o_t[:, None] >= o_t[None, :]
    strict = o_t[:, None] > o_t[None, :]
    eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)

    # state S [K, BV], fp32 in registers for the whole sequence
    o_k, o_v, p_state, S = _state_tile(h0, i_n, i_h, i_v, USE_H0, H, K, V, BV)
    if USE_GATE:
        a_h = _exp(tl.load(A_log + i_h).to(tl.float32))
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
            b_g = tl.where(m_qk, lower_bound * _sigmoid(a_h * (b_g + bias[None, :])), 0.0)
        b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
        if USE_BETA_SIGMOID:
            b_beta = tl.where(m_t, _sigmoid(b_beta), 0.0)
        if USE_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)[:, None]
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
        p_v = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_qk, other=0.0).to(tl.float32)

        gc = tl.cumsum(b_g, axis=0)  # [BT, K] in (-80, 0] thanks to the bounded gate
        g_last = tl.sum(tl.where(o_t[:, None] == BT - 1, gc, 0.0), axis=0)  # [K]
        kg = b_k * _exp(gc)
        kn = b_k * _exp(-gc)
        qg = b_q * scale * _exp(gc)
        kd = b_k * _exp(g_last[None, :] - gc)

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
        S = S * _exp(g_last)[:, None] + _mm(tl.trans(kd), u, STATE_DOT)

    if STORE_FINAL:
        tl.store(ht + p_state, S)


@triton.jit
def _kda_chunk_prep_kernel(
    q, k, v, g, beta, cu_seqlens, chunk_indices, A_log, dt_bias, w_buf, u_buf, lower_bound,
    qg_buf, kd_buf, A_buf, gl_buf, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    USE_GATE: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, USE_L2NORM: tl.constexpr, DOT_BF16: tl.constexpr,
    STORE_QKA: tl.constexpr = False,
):
    """Per (chunk, head), fully parallel: w = X diag(beta) k e^G [BT, K] and u0 = X diag(beta) v [BT, V].

    STORE_QKA (``output="stored"``): also qg = s q e^G [BT, K], kd = k e^{G_last - G} [BT, K], the causal
    Aqk [BT, BT] (row-major per token: A_buf [B, T, H, BT]) and G_last [K] at gl_buf[global chunk, head], so
    the state kernel and the parallel output kernel need no q, k, g (the layout of the 64-token prep).
    """
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
        a_h = _exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
        b_g = tl.where(m_qk, lower_bound * _sigmoid(a_h * (b_g + bias[None, :])), 0.0)
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    if USE_BETA_SIGMOID:
        b_beta = tl.where(m_t, _sigmoid(b_beta), 0.0)
    if USE_L2NORM:
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
    p_v = (rows[:, None] * H + i_h) * V + o_v[None, :]
    b_v = tl.load(v + p_v, mask=m_qk, other=0.0).to(tl.float32)
    gc = tl.cumsum(b_g, axis=0)
    kg = b_k * _exp(gc)
    kn = b_k * _exp(-gc)
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
    if STORE_QKA:
        # the S-independent rest of the fused kernel's loop body (same formulas, same dot modes)
        b_q = tl.load(q + p_qk, mask=m_qk, other=0.0).to(tl.float32)
        if USE_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)[:, None]
        qg = b_q * scale * _exp(gc)
        Aqk = tl.where(o_t[:, None] >= o_t[None, :], _mm(qg, tl.trans(kn), DOT_BF16), 0.0)
        g_last = tl.sum(tl.where(o_t[:, None] == BT - 1, gc, 0.0), axis=0)  # [K]
        kd = b_k * _exp(g_last[None, :] - gc)
        tl.store(qg_buf + p_qk, qg.to(qg_buf.dtype.element_ty), mask=m_qk)
        tl.store(kd_buf + p_qk, kd.to(kd_buf.dtype.element_ty), mask=m_qk)
        p_a = (rows[:, None] * H + i_h) * BT + o_t[None, :]
        tl.store(A_buf + p_a, Aqk.to(A_buf.dtype.element_ty), mask=m_qk)
        tl.store(gl_buf + (i_c * H + i_h).to(tl.int64) * K + o_k, g_last)


# --------------------------------------------------------------------------- #
# 64-token chunks built from four bounded 16-token sub-tiles (chunk_size=64)
# --------------------------------------------------------------------------- #
_BT64 = 64  # chunk of the 64-token path
_BS = 16  # sub-tile: 16 steps of log decay >= -5 each span at most 80, so e^{+-80} stays a normal fp32/bf16


@triton.jit
def _tf32_round(x):
    # Round-to-nearest (ties away) to tf32's 10-bit mantissa, as cvt.rna.tf32.f32 does: lets the CPU
    # interpreter (which computes every dot in fp32) reproduce the numerics of a tf32 dot (a GPU path that
    # truncates instead would have at most twice this rounding error).
    xi = x.to(tl.int32, bitcast=True)
    xi = (xi + 0x1000) & -8192  # -8192 = 0xFFFFE000: keep sign, exponent, 10 mantissa bits
    return xi.to(tl.float32, bitcast=True)


@triton.jit
def _mm64(a, b, MODE: tl.constexpr):
    # MODE 0..3 as in _mm; 4: tf32 emulated for the CPU interpreter (operands rounded to tf32, fp32 dot).
    if MODE == 4:
        return tl.dot(_tf32_round(a.to(tl.float32)), _tf32_round(b.to(tl.float32)), input_precision="ieee")
    elif MODE == 3:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    elif MODE == 0:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return _mm(a, b, MODE)


@triton.jit
def _inv_unit_lower(M, BS: tl.constexpr):
    # X = (I - M)^-1 for strictly lower M [BS, BS] by forward substitution (row i = e_i + sum_{j<i} M_ij X_j);
    # see the fused 16-token kernel for why not the nilpotent product.
    o_s = tl.arange(0, BS)
    X = tl.where(o_s[:, None] == o_s[None, :], 1.0, 0.0)
    for i in tl.static_range(1, BS):
        m_i = tl.sum(tl.where(o_s[:, None] == i, M, 0.0), axis=0)
        x_i = tl.sum(m_i[:, None] * X, axis=0) + tl.where(o_s == i, 1.0, 0.0)
        X = tl.where(o_s[:, None] == i, x_i[None, :], X)
    return X


@triton.jit
def _store_rows(ptr, rows, m_t, i_h, x, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, COL0, W: tl.constexpr):
    # x [BS, W] -> ptr[(rows * H + i_h) * D + COL0 + (0..W)], rows past the sequence end skipped
    o_w = tl.arange(0, W)
    p = (rows[:, None] * H + i_h) * D + COL0 + o_w[None, :]
    tl.store(ptr + p, x.to(ptr.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _store_block_row(ptr, rows, m_t, i_h, x0, x1, x2, x3, H: tl.constexpr, BS: tl.constexpr):
    # the four [BS, BS] blocks of one block row of a 64-chunk's [64, 64] matrix, stored by rows ([.., H, 4 BS])
    _store_rows(ptr, rows, m_t, i_h, x0, H, 4 * BS, BS, 0, BS)
    _store_rows(ptr, rows, m_t, i_h, x1, H, 4 * BS, BS, BS, BS)
    _store_rows(ptr, rows, m_t, i_h, x2, H, 4 * BS, BS, 2 * BS, BS)
    _store_rows(ptr, rows, m_t, i_h, x3, H, 4 * BS, BS, 3 * BS, BS)


@triton.jit
def _load_qkg(q, k, g, rows, m_t, i_h, o_c, H: tl.constexpr, K: tl.constexpr):
    # channels o_c of q, k and g at the given rows (fp32; zero past the sequence) and the rows' [BS, 1] mask
    p = (rows[:, None] * H + i_h) * K + o_c[None, :]
    m2 = m_t[:, None]
    return (tl.load(q + p, mask=m2, other=0.0).to(tl.float32), tl.load(k + p, mask=m2, other=0.0).to(tl.float32),
            tl.load(g + p, mask=m2, other=0.0).to(tl.float32), m2)


@triton.jit
def _ks_sub(q, k, g, rows, m_t, i_h, o_c, a_h, bias, lower_bound, carry,
            H: tl.constexpr, K: tl.constexpr, BS: tl.constexpr, USE_GATE: tl.constexpr, LIBM: tl.constexpr = False):
    """Channels o_c [BK] of the BS rows of a whole chunk: raw q, k (fp32, not normalised), G = carry + cumsum(g) and
    G at the last row. LIBM: the gate's sigmoid on `tl.sigmoid` (see `_kda_chunk64_wu_kernel`)."""
    b_q, b_k, b_g, m2 = _load_qkg(q, k, g, rows, m_t, i_h, o_c, H, K)
    if USE_GATE:
        z = a_h * (b_g + bias[None, :])
        b_g = tl.where(m2, lower_bound * (tl.sigmoid(z) if LIBM else _sigmoid(z)), 0.0)
    G = tl.cumsum(b_g, axis=0) + carry[None, :]
    return b_q, b_k, G, tl.sum(tl.where(tl.arange(0, BS)[:, None] == BS - 1, G, 0.0), axis=0)


@triton.jit
def _bias_cols(dt_bias, i_h, o_c, K: tl.constexpr, USE_GATE: tl.constexpr):
    if USE_GATE:
        return tl.load(dt_bias + i_h * K + o_c).to(tl.float32)
    return tl.zeros(o_c.shape, dtype=tl.float32)


@triton.jit
def _rcp_approx(x, INTERP: tl.constexpr):
    # 1 / x as one rcp.approx.ftz.f32: Triton's division compiles to a range-checked sequence of five instructions.
    # The CPU interpreter (INTERP) has no inline PTX, so it divides.
    if INTERP:
        r = 1.0 / x
    else:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    return r


@triton.jit
def _tf32_trunc(x):
    # x with the 13 low mantissa bits cleared, exact in tf32 (one LOP3 on the GPU; `_tf32_round`, which the
    # interpreter's tf32 emulation uses, rounds instead and costs an add more)
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _cumsum_mma(x, BS: tl.constexpr, INTERP: tl.constexpr):
    """cumsum of x [BS, BC] over its rows as the product tril(ones) x on the tensor cores, with x split into a tf32
    head and its fp32 remainder, so each term loses at most 2^-20 of itself (fp32 adds lose 2^-24 of the running
    sum). One warp's scan across lanes costs four shuffle rounds a register; the two products cost 8 HMMA. The
    CPU interpreter's fp32 dots get the remainder truncated to tf32 as well (the worse of truncation and rounding,
    either of which a tf32 product may apply to an fp32 operand)."""
    o = tl.arange(0, BS)
    tri = tl.where(o[:, None] >= o[None, :], 1.0, 0.0)
    hi = _tf32_trunc(x)
    lo = x - hi
    if INTERP:
        return tl.dot(tri, hi, input_precision="ieee") + tl.dot(tri, _tf32_trunc(lo), input_precision="ieee")
    return tl.dot(tri, hi, input_precision="tf32") + tl.dot(tri, lo, input_precision="tf32")


@triton.jit
def _ks_left(q, k, g, rows, m_t, i_h, o_c, a_h, bias, lower_bound, ref,
             H: tl.constexpr, K: tl.constexpr, BS: tl.constexpr, USE_GATE: tl.constexpr, INTERP: tl.constexpr):
    """A sub-tile whose chunk decay starts at `ref` (e of the sub-tile before, 0 for the first): left factors
    k e^{G - ref}, q e^{G - ref} (exponents in [-80, 0]), its own right factor k e^{ref - G} (in [0, 80]),
    kt = k e^{e - G} for the later sub-tiles, e = G at its last row, and the squared norms of q and k.
    G, ref and e are in log2 units here (exp2 needs no multiply; one exponent serves both factors).
    G - ref is the sub-tile's own cumsum, formed on the tensor cores (``_cumsum_mma``), and the gate's sigmoid
    takes one scalar scale and ``_rcp_approx``: together they took the loop over K from 1770 to 1370 SASS
    instructions a 16-channel slice (triton 3.6, sm_90a) and the kernel from 681 to 620 us at T = 8K on the H200
    (BENCHMARKS.md, thirtieth session)."""
    bq, bk, b_g, m2 = _load_qkg(q, k, g, rows, m_t, i_h, o_c, H, K)
    if USE_GATE:
        # lb sigmoid(a (z + b)) in log2 units: lb log2(e) / (1 + 2^{-a log2(e) (z + b)})
        y = (b_g + bias[None, :]) * (-_LOG2E * a_h)
        b_g = tl.where(m2, (lower_bound * _LOG2E) * _rcp_approx(1.0 + tl.math.exp2(y), INTERP), 0.0)
    else:
        b_g = b_g * _LOG2E
    t = _cumsum_mma(b_g, BS, INTERP)  # G - ref
    tot = tl.sum(tl.where(tl.arange(0, BS)[:, None] == BS - 1, t, 0.0), axis=0)  # e - ref
    left = tl.math.exp2(t)
    right = bk * tl.math.exp2(-t)
    # kt = k e^{e - G} = right e^{e - ref}: a per-channel factor instead of a third exponential per element
    # (2.62 -> 2.55 ms forward at T = 8K on the H200, fourteenth session)
    return (bk * left, bq * left, right, right * tl.math.exp2(tot)[None, :], ref + tot,
            tl.sum(bq * bq, axis=1), tl.sum(bk * bk, axis=1))


@triton.jit
def _acc2(A, Q, lk, lq, right, DOT_BF16: tl.constexpr):
    # one block of Akk and of Aqk: the same right factor against the k and the q rows
    return A + _mm(lk, tl.trans(right), DOT_BF16), Q + _mm(lq, tl.trans(right), DOT_BF16)


@triton.jit
def _rows_of(bos, L, t0, BS: tl.constexpr):
    pos = t0 + tl.arange(0, BS)
    return bos + pos, pos < L


@triton.jit
def _beta_of(beta, rows, m_t, i_h, H: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr):
    b = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    if USE_BETA_SIGMOID:
        b = tl.where(m_t, _sigmoid(b), 0.0)
    return b


@triton.jit
def _inv_norm(ss, USE_L2NORM: tl.constexpr):
    if USE_L2NORM:
        return 1.0 / tl.sqrt(ss + 1e-6)
    return tl.full(ss.shape, 1.0, tl.float32)


@triton.jit
def _chunk_of(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN: tl.constexpr):
    # (first token of the sequence, its length, chunk index within it) of global chunk i_c
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_c)
        i_t = tl.load(chunk_indices + 2 * i_c + 1)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:  # B sequences of length T, NT chunks each
        i_t = i_c % NT
        bos = (i_c // NT).to(tl.int64) * T
        eos = bos + T
    return bos, eos - bos, i_t


@triton.jit
def _seq_of(cu_seqlens, chunk_offsets, i_n, T, NT, IS_VARLEN: tl.constexpr):
    # (first token, length, first global chunk) of sequence i_n, for the kernels sequential over its chunks
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:  # B sequences of length T, NT chunks each
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c0 = i_n.to(tl.int64) * NT
    return bos, eos - bos, c0


@triton.jit
def _state_tile(ptr, i_n, i_h, i_v, LOAD: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BV: tl.constexpr, TRANS: tl.constexpr = False):
    """The [K, BV] tile (sequence i_n, head i_h, V-block i_v) of an [N, H, K, V] state tensor that the sequential
    kernels carry, or with TRANS its transpose [BV, K]: its channel offsets, its element offsets, and its start
    value, fp32, loaded from ptr (LOAD) or 0."""
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    if TRANS:
        p = ((i_n * H + i_h) * K + o_k[None, :]).to(tl.int64) * V + o_v[:, None]
    else:
        p = ((i_n * H + i_h) * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :]
    if LOAD:
        S = tl.load(ptr + p).to(tl.float32)
    else:
        S = tl.zeros(p.shape, dtype=tl.float32)
    return o_k, o_v, p, S


@triton.jit
def _kda_chunk64_prep_kernel(
    q, k, g, beta, cu_seqlens, chunk_indices, A_log, dt_bias, x_buf, r_buf, A_buf, xu_buf, akk_buf,
    lower_bound, scale, T, NT,
    H: tl.constexpr, K: tl.constexpr, BS: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_GATE: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, USE_L2NORM: tl.constexpr,
    DOT_BF16: tl.constexpr, WU_DOT: tl.constexpr, BK: tl.constexpr, STORE_BWD: tl.constexpr = False,
    INTERP: tl.constexpr = False,
):
    """First of the two 64-token prep kernels, per (chunk, head), fully parallel: Aqk and the UT inverse.

    Writes Aqk [64 rows, 64 cols] (causal, upper blocks zero), X diag(beta) [64, 64] (X = (I + diag(beta)
    strict(Akk))^-1 of the whole chunk, the L2 norms folded in; the blocks above the 16-row diagonal ones are
    left unwritten) to x_buf and the row scales s / |q|, 1 / |k| to r_buf. It walks K in slices of BK channels
    (the gate is per channel, so a slice's cumulative decay needs only that slice) with the sub-tile references
    of the module docstring, keeping the ten lower 16 x 16 blocks of Akk and of Aqk and the squared norms.
    Then the norms scale the blocks (``<x_a / |x_a|, y_b / |y_b|>``), Aqk is stored, the diagonal blocks of X
    come from the 16 x 16 forward substitution and X_ij = -X_ii sum_{j <= m < i} diag(beta_i) A_im X_mj.

    Everything [64, K]-shaped (w, qg, kd, u0) is left to ``_kda_chunk64_wu_kernel``, whose products are single
    [64, 64] x [64, BK] dots (u0 = Xb v too at block_v < 64). One kernel doing both ran at 4 warps: 2.92 ms at
    T = 8K, H = 96 on the H200, against 1.02 + 0.87 ms for the two; moving Aqk to the second kernel as well (two
    masked [64, 64] products a slice) cost it more than it saved here (BENCHMARKS.md, eighth session).
    """
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, L, i_t = _chunk_of(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)
    t0 = i_t * (4 * BS)
    o_s = tl.arange(0, BS)
    strict = o_s[:, None] > o_s[None, :]
    rows0, m0 = _rows_of(bos, L, t0, BS)
    rows1, m1 = _rows_of(bos, L, t0 + BS, BS)
    rows2, m2 = _rows_of(bos, L, t0 + 2 * BS, BS)
    rows3, m3 = _rows_of(bos, L, t0 + 3 * BS, BS)
    if USE_GATE:
        a_h = _exp(tl.load(A_log + i_h).to(tl.float32))
    else:
        a_h = 0.0
    causal = o_s[:, None] >= o_s[None, :]

    # ---- the raw lower blocks A_ij (k k) and Q_ij (q k), j <= i, and the squared norms
    z = tl.zeros([BS, BS], dtype=tl.float32)
    A00, A10, A11, A20, A21, A22, A30, A31, A32, A33 = z, z, z, z, z, z, z, z, z, z
    Q00, Q10, Q11, Q20, Q21, Q22, Q30, Q31, Q32, Q33 = z, z, z, z, z, z, z, z, z, z
    zs = tl.zeros([BS], dtype=tl.float32)
    sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3 = zs, zs, zs, zs, zs, zs, zs, zs
    for kk in range(0, K, BK):
        o_c = kk + tl.arange(0, BK)
        bias = _bias_cols(dt_bias, i_h, o_c, K, USE_GATE)
        zc = tl.zeros([BK], dtype=tl.float32)
        # sub-tile i against its own rows (R) and earlier sub-tiles j (kt_j, rescaled to the reference e_{i-1})
        lk, lq, R, kt0, e0, s_q, s_k = _ks_left(q, k, g, rows0, m0, i_h, o_c, a_h, bias, lower_bound, zc,
                                                H, K, BS, USE_GATE, INTERP)
        sq0 += s_q
        sk0 += s_k
        A00, Q00 = _acc2(A00, Q00, lk, lq, R, DOT_BF16)
        lk, lq, R, kt1, e1, s_q, s_k = _ks_left(q, k, g, rows1, m1, i_h, o_c, a_h, bias, lower_bound, e0,
                                                H, K, BS, USE_GATE, INTERP)
        sq1 += s_q
        sk1 += s_k
        A10, Q10 = _acc2(A10, Q10, lk, lq, kt0, DOT_BF16)
        A11, Q11 = _acc2(A11, Q11, lk, lq, R, DOT_BF16)
        lk, lq, R, kt2, e2, s_q, s_k = _ks_left(q, k, g, rows2, m2, i_h, o_c, a_h, bias, lower_bound, e1,
                                                H, K, BS, USE_GATE, INTERP)
        sq2 += s_q
        sk2 += s_k
        A20, Q20 = _acc2(A20, Q20, lk, lq, kt0 * tl.math.exp2(e1 - e0)[None, :], DOT_BF16)
        A21, Q21 = _acc2(A21, Q21, lk, lq, kt1, DOT_BF16)
        A22, Q22 = _acc2(A22, Q22, lk, lq, R, DOT_BF16)
        lk, lq, R, kt3, e3, s_q, s_k = _ks_left(q, k, g, rows3, m3, i_h, o_c, a_h, bias, lower_bound, e2,
                                                H, K, BS, USE_GATE, INTERP)
        sq3 += s_q
        sk3 += s_k
        A30, Q30 = _acc2(A30, Q30, lk, lq, kt0 * tl.math.exp2(e2 - e0)[None, :], DOT_BF16)
        A31, Q31 = _acc2(A31, Q31, lk, lq, kt1 * tl.math.exp2(e2 - e1)[None, :], DOT_BF16)
        A32, Q32 = _acc2(A32, Q32, lk, lq, kt2, DOT_BF16)
        A33, Q33 = _acc2(A33, Q33, lk, lq, R, DOT_BF16)

    # ---- normalise, store Aqk, build X by blocks
    rq0, rq1, rq2, rq3 = (_inv_norm(sq0, USE_L2NORM) * scale, _inv_norm(sq1, USE_L2NORM) * scale,
                          _inv_norm(sq2, USE_L2NORM) * scale, _inv_norm(sq3, USE_L2NORM) * scale)
    rk0, rk1, rk2, rk3 = (_inv_norm(sk0, USE_L2NORM), _inv_norm(sk1, USE_L2NORM), _inv_norm(sk2, USE_L2NORM),
                          _inv_norm(sk3, USE_L2NORM))
    _store_block_row(A_buf, rows0, m0, i_h, tl.where(causal, Q00 * rq0[:, None] * rk0[None, :], 0.0), z, z, z, H, BS)
    _store_block_row(A_buf, rows1, m1, i_h, Q10 * rq1[:, None] * rk0[None, :],
                     tl.where(causal, Q11 * rq1[:, None] * rk1[None, :], 0.0), z, z, H, BS)
    _store_block_row(A_buf, rows2, m2, i_h, Q20 * rq2[:, None] * rk0[None, :], Q21 * rq2[:, None] * rk1[None, :],
                     tl.where(causal, Q22 * rq2[:, None] * rk2[None, :], 0.0), z, H, BS)
    _store_block_row(A_buf, rows3, m3, i_h, Q30 * rq3[:, None] * rk0[None, :], Q31 * rq3[:, None] * rk1[None, :],
                     Q32 * rq3[:, None] * rk2[None, :], tl.where(causal, Q33 * rq3[:, None] * rk3[None, :], 0.0), H, BS)
    b0 = _beta_of(beta, rows0, m0, i_h, H, USE_BETA_SIGMOID)
    b1 = _beta_of(beta, rows1, m1, i_h, H, USE_BETA_SIGMOID)
    b2 = _beta_of(beta, rows2, m2, i_h, H, USE_BETA_SIGMOID)
    b3 = _beta_of(beta, rows3, m3, i_h, H, USE_BETA_SIGMOID)
    # M_ij = diag(beta_i) A_ij with the normalisation folded in (the rows' own scale, then the columns')
    M10 = (b1 * rk1)[:, None] * A10 * rk0[None, :]
    M20 = (b2 * rk2)[:, None] * A20 * rk0[None, :]
    M21 = (b2 * rk2)[:, None] * A21 * rk1[None, :]
    M30 = (b3 * rk3)[:, None] * A30 * rk0[None, :]
    M31 = (b3 * rk3)[:, None] * A31 * rk1[None, :]
    M32 = (b3 * rk3)[:, None] * A32 * rk2[None, :]
    X00 = _inv_unit_lower(tl.where(strict, -(b0 * rk0)[:, None] * A00 * rk0[None, :], 0.0), BS)
    X11 = _inv_unit_lower(tl.where(strict, -(b1 * rk1)[:, None] * A11 * rk1[None, :], 0.0), BS)
    X22 = _inv_unit_lower(tl.where(strict, -(b2 * rk2)[:, None] * A22 * rk2[None, :], 0.0), BS)
    X33 = _inv_unit_lower(tl.where(strict, -(b3 * rk3)[:, None] * A33 * rk3[None, :], 0.0), BS)
    X10 = -_mm64(X11, _mm64(M10, X00, WU_DOT), WU_DOT)
    X21 = -_mm64(X22, _mm64(M21, X11, WU_DOT), WU_DOT)
    X20 = -_mm64(X22, _mm64(M20, X00, WU_DOT) + _mm64(M21, X10, WU_DOT), WU_DOT)
    X32 = -_mm64(X33, _mm64(M32, X22, WU_DOT), WU_DOT)
    X31 = -_mm64(X33, _mm64(M31, X11, WU_DOT) + _mm64(M32, X21, WU_DOT), WU_DOT)
    X30 = -_mm64(X33, _mm64(M30, X00, WU_DOT) + _mm64(M31, X10, WU_DOT) + _mm64(M32, X20, WU_DOT), WU_DOT)

    # ---- X diag(beta) by 16 x 16 blocks into the chunk's [64, 64] tile; the row scales
    xb = x_buf + (i_c * H + i_h).to(tl.int64) * (16 * BS * BS) + o_s[:, None] * (4 * BS) + o_s[None, :]
    RB = BS * 4 * BS  # one block row
    tl.store(xb, X00 * b0[None, :])
    tl.store(xb + RB, X10 * b0[None, :])
    tl.store(xb + RB + BS, X11 * b1[None, :])
    tl.store(xb + 2 * RB, X20 * b0[None, :])
    tl.store(xb + 2 * RB + BS, X21 * b1[None, :])
    tl.store(xb + 2 * RB + 2 * BS, X22 * b2[None, :])
    tl.store(xb + 3 * RB, X30 * b0[None, :])
    tl.store(xb + 3 * RB + BS, X31 * b1[None, :])
    tl.store(xb + 3 * RB + 2 * BS, X32 * b2[None, :])
    tl.store(xb + 3 * RB + 3 * BS, X33 * b3[None, :])
    if STORE_BWD:
        # for the 64-token backward: X itself (its blocks above the diagonal ones unwritten, as in x_buf) and
        # the normalised strict Akk by rows, [.., H, 64] like Aqk
        xu = xu_buf + (i_c * H + i_h).to(tl.int64) * (16 * BS * BS) + o_s[:, None] * (4 * BS) + o_s[None, :]
        tl.store(xu, X00)
        tl.store(xu + RB, X10)
        tl.store(xu + RB + BS, X11)
        tl.store(xu + 2 * RB, X20)
        tl.store(xu + 2 * RB + BS, X21)
        tl.store(xu + 2 * RB + 2 * BS, X22)
        tl.store(xu + 3 * RB, X30)
        tl.store(xu + 3 * RB + BS, X31)
        tl.store(xu + 3 * RB + 2 * BS, X32)
        tl.store(xu + 3 * RB + 3 * BS, X33)
        _store_block_row(akk_buf, rows0, m0, i_h, tl.where(strict, A00 * rk0[:, None] * rk0[None, :], 0.0), z, z, z,
                         H, BS)
        _store_block_row(akk_buf, rows1, m1, i_h, A10 * rk1[:, None] * rk0[None, :],
                         tl.where(strict, A11 * rk1[:, None] * rk1[None, :], 0.0), z, z, H, BS)
        _store_block_row(akk_buf, rows2, m2, i_h, A20 * rk2[:, None] * rk0[None, :], A21 * rk2[:, None] * rk1[None, :],
                         tl.where(strict, A22 * rk2[:, None] * rk2[None, :], 0.0), z, H, BS)
        _store_block_row(akk_buf, rows3, m3, i_h, A30 * rk3[:, None] * rk0[None, :], A31 * rk3[:, None] * rk1[None, :],
                         A32 * rk3[:, None] * rk2[None, :], tl.where(strict, A33 * rk3[:, None] * rk3[None, :], 0.0),
                         H, BS)
    tl.store(r_buf + (rows0 * H + i_h) * 2, rq0, mask=m0)
    tl.store(r_buf + (rows1 * H + i_h) * 2, rq1, mask=m1)
    tl.store(r_buf + (rows2 * H + i_h) * 2, rq2, mask=m2)
    tl.store(r_buf + (rows3 * H + i_h) * 2, rq3, mask=m3)
    tl.store(r_buf + (rows0 * H + i_h) * 2 + 1, rk0, mask=m0)
    tl.store(r_buf + (rows1 * H + i_h) * 2 + 1, rk1, mask=m1)
    tl.store(r_buf + (rows2 * H + i_h) * 2 + 1, rk2, mask=m2)
    tl.store(r_buf + (rows3 * H + i_h) * 2 + 1, rk3, mask=m3)


@triton.jit
def _kda_chunk64_wu_kernel(
    q, k, v, g, cu_seqlens, chunk_indices, A_log, dt_bias, x_buf, r_buf,
    w_buf, u_buf, qg_buf, kd_buf, gl_buf, lower_bound, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_GATE: tl.constexpr, WU_DOT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, STORE_U: tl.constexpr,
):
    """Second 64-token prep kernel, per (chunk, head), fully parallel, on whole-chunk [64, BK] tiles: with
    Xb = X diag(beta) and the row scales from ``_kda_chunk64_prep_kernel``, w = Xb (k / |k|) e^G is a single
    [64, 64] x [64, BK] product; qg = s q / |q| e^G, kd = k / |k| e^{G_last - G} and G_last come from the same
    tiles. G spans (-320, 0] over the chunk: only e^G and e^{G_last - G} (both <= 1) are formed.
    u0 = Xb v (fp32 [B, T, H, V]) is stored only with STORE_U: by default the state kernel forms it (``U_XB``).
    """
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, L, i_t = _chunk_of(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)
    rows, m_t = _rows_of(bos, L, i_t * BT, BT)
    m2 = m_t[:, None]
    o_t = tl.arange(0, BT)
    # blocks above the 16-row diagonal blocks are zero and were never written
    xb = tl.load(x_buf + (i_c * H + i_h).to(tl.int64) * (BT * BT) + o_t[:, None] * BT + o_t[None, :],
                 mask=(o_t[:, None] // 16) >= (o_t[None, :] // 16), other=0.0)
    rq = tl.load(r_buf + (rows * H + i_h) * 2, mask=m_t, other=0.0)
    rk = tl.load(r_buf + (rows * H + i_h) * 2 + 1, mask=m_t, other=0.0)
    # This kernel keeps the library exponentials (`tl.exp`, `tl.sigmoid`): with the ex2.approx helpers of the other
    # kernels it ran 8-9 % slower (H100: 967 against 888 us at T = 8K, same run; the twenty-first session saw +7-8 %
    # on both GPUs), where the prep kernel gains from them.
    if USE_GATE:
        a_h = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    else:
        a_h = 0.0
    for kk in range(0, K, BK):
        o_c = kk + tl.arange(0, BK)
        bias = _bias_cols(dt_bias, i_h, o_c, K, USE_GATE)
        p = (rows[:, None] * H + i_h) * K + o_c[None, :]
        # the whole chunk as one tile: G [BT, BK] from the chunk start, gl = G_last
        b_q, b_k, G, gl = _ks_sub(q, k, g, rows, m_t, i_h, o_c, a_h, bias, lower_bound,
                                  tl.zeros([BK], dtype=tl.float32), H, K, BT, USE_GATE, LIBM=True)
        b_q = b_q * rq[:, None]
        b_k = b_k * rk[:, None]
        eG = tl.exp(G)
        tl.store(qg_buf + p, (b_q * eG).to(qg_buf.dtype.element_ty), mask=m2)
        tl.store(kd_buf + p, (b_k * tl.exp(gl[None, :] - G)).to(kd_buf.dtype.element_ty), mask=m2)
        tl.store(gl_buf + (i_c * H + i_h).to(tl.int64) * K + o_c, gl)
        tl.store(w_buf + p, _mm64(xb, b_k * eG, WU_DOT).to(w_buf.dtype.element_ty), mask=m2)
    if STORE_U:
        for vv in range(0, V, BV):
            o_c = vv + tl.arange(0, BV)
            p_v = (rows[:, None] * H + i_h) * V + o_c[None, :]
            b_v = tl.load(v + p_v, mask=m2, other=0.0)
            tl.store(u_buf + p_v, _mm64(xb, b_v, WU_DOT).to(u_buf.dtype.element_ty), mask=m2)


@triton.jit
def _kda_chunk64_state_kernel(
    w_buf, u_buf, qg_buf, kd_buf, A_buf, gl_buf, o, h0, ht, cu_seqlens, chunk_offsets, T, NT, h_buf, vn_buf,
    x_buf, v,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr, STATE_DOT: tl.constexpr,
    STORED: tl.constexpr = False, U_XB: tl.constexpr = False, U_DOT: tl.constexpr = 0,
):
    """Per (sequence, head, V-block), sequential over 64-token chunks: only the products with the state.

    u = u0 - w S;  o = qg S + Aqk u;  S <- e^{G_last} S + kd^T u   (dots [64, K] x [K, BV], [K, 64] x [64, BV]).
    The loads of a chunk do not depend on S, so the compiler's software pipelining (num_stages) can prefetch.
    Nothing here depends on BT = 64: the 16-token ``output="stored"`` path runs it with BT = 16.

    STORED (``output="stored"``): o is not computed here; instead the state at the START of each chunk goes
    to h_buf [global chunk, H, K, V] and u (fla's "v_new") to vn_buf [B, T, H, V], and
    ``_kda_chunk_output_kernel`` computes o = qg h + Aqk u for all chunks in parallel. The loop then carries
    only two dependent dots per chunk (w S, kd^T u) instead of four.

    U_XB (64-token chunks, see ``_u_in_state``): u0 = Xb v is formed here from the prep's Xb scratch
    [chunks, H, 64, 64] and v, with the w / u0 kernel's product mode U_DOT, instead of being loaded from the fp32
    u0 buffer that kernel would write: 0.8 GB less HBM traffic at T = 8K, H = 96, V = 128; the product does not
    depend on S.
    """
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    bos, L, c0 = _seq_of(cu_seqlens, chunk_offsets, i_n, T, NT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    causal = o_t[:, None] >= o_t[None, :]
    # The loop carries S^T [BV, K] and forms every product transposed (u^T = u0^T - S^T w^T,
    # S^T <- S^T e^{G_last} + u^T kd, o^T = S^T qg^T + u^T Aqk^T): the left operands (S^T, u^T) come from registers
    # and the right ones are the pipelined tiles themselves (transposed views), so no dependent operand makes a
    # round trip through shared memory and the kernel holds little more than its pipeline buffers there (sm_90a,
    # 2 stages: 106 KB at BV = 64, two programs an SM, against 128 KB carrying S, which needs S and u as right
    # operands in shared memory; 116 KB at BV = 128 with 8 warps, the default). Same products, same results.
    o_k, o_v, p_state_t, St = _state_tile(h0, i_n, i_h, i_v, USE_H0, H, K, V, BV, TRANS=True)
    for i_t in range(0, tl.cdiv(L, BT)):
        pos = i_t * BT + o_t
        m_t = pos < L
        rows = bos + pos
        p_k = (rows[:, None] * H + i_h) * K + o_k[None, :]
        p_vt = (rows[None, :] * H + i_h) * V + o_v[:, None]  # [BV, BT]: the chunk's v-shaped tiles, transposed
        m2 = m_t[:, None]
        b_w = tl.load(w_buf + p_k, mask=m2, other=0.0)
        b_kd = tl.load(kd_buf + p_k, mask=m2, other=0.0)
        if U_XB:
            # blocks above the 16-row diagonal blocks of Xb are zero and were never written
            b_xb = tl.load(x_buf + ((c0 + i_t) * H + i_h) * (BT * BT) + o_t[:, None] * BT + o_t[None, :],
                           mask=(o_t[:, None] // 16) >= (o_t[None, :] // 16), other=0.0)
            b_ut = _mm64(tl.load(v + p_vt, mask=m_t[None, :], other=0.0), tl.trans(b_xb), U_DOT)  # u0^T [BV, BT]
        else:
            b_ut = tl.load(u_buf + p_vt, mask=m_t[None, :], other=0.0)
        b_gl = tl.load(gl_buf + ((c0 + i_t) * H + i_h) * K + o_k)
        if STORED:
            # state entering chunk c0 + i_t, [K, BV] slice of h_buf[c0 + i_t, i_h]
            p_h = (((c0 + i_t) * H + i_h) * K + o_k[None, :]) * V + o_v[:, None]
            tl.store(h_buf + p_h, St.to(h_buf.dtype.element_ty))
            b_ut = b_ut - _mm64(St, tl.trans(b_w), STATE_DOT)  # [BV, BT]
            tl.store(vn_buf + p_vt, b_ut.to(vn_buf.dtype.element_ty), mask=m_t[None, :])
        else:
            b_qg = tl.load(qg_buf + p_k, mask=m2, other=0.0)
            b_A = tl.load(A_buf + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=m2, other=0.0)
            b_A = tl.where(causal, b_A, 0.0)
            b_ut = b_ut - _mm64(St, tl.trans(b_w), STATE_DOT)  # [BV, BT]
            b_ot = _mm64(St, tl.trans(b_qg), STATE_DOT) + _mm64(b_ut, tl.trans(b_A), STATE_DOT)
            tl.store(o + p_vt, b_ot.to(o.dtype.element_ty), mask=m_t[None, :])
        St = St * _exp(b_gl)[None, :] + _mm64(b_ut, b_kd, STATE_DOT)
    if STORE_FINAL:
        tl.store(ht + p_state_t, St)


@triton.jit
def _kda_chunk_output_kernel(
    qg_buf, A_buf, u_buf, h_buf, o, cu_seqlens, chunk_indices, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, QH_DOT: tl.constexpr, AU_DOT: tl.constexpr,
):
    """``output="stored"``: per (chunk, head, V-block), fully parallel: o = qg h_chunk + Aqk u.

    h_chunk = h_buf[global chunk, head] is the state at the start of the chunk (written by the state kernel
    with STORED), u = u0 - w h_chunk its "v_new". Same product modes as the fused loop (tf32 against the fp32
    state for bf16 inputs); qg h is summed over K in BK slices so that num_stages can pipeline the loads.
    """
    i_c = tl.program_id(0)  # global chunk index (sequence-major)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    bos, L, i_t = _chunk_of(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = i_t * BT + o_t < L
    rows = bos + i_t * BT + o_t  # [BT] flat token index
    m2 = m_t[:, None]
    h_base = (i_c.to(tl.int64) * H + i_h) * K * V
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_qg = tl.load(qg_buf + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m2, other=0.0)
        b_h = tl.load(h_buf + h_base + o_k[:, None] * V + o_v[None, :])
        acc += _mm64(b_qg, b_h, QH_DOT)
    b_A = tl.load(A_buf + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=m2, other=0.0)
    b_A = tl.where(o_t[:, None] >= o_t[None, :], b_A, 0.0)
    b_u = tl.load(u_buf + (rows[:, None] * H + i_h) * V + o_v[None, :], mask=m2, other=0.0)
    acc += _mm64(b_A, b_u, AU_DOT)
    tl.store(o + (rows[:, None] * H + i_h) * V + o_v[None, :], acc.to(o.dtype.element_ty), mask=m2)


def _is_pow2(n: int) -> bool:
    return n >= 16 and (n & (n - 1)) == 0


def check_gate_args(A_log, dt_bias, lower_bound, H, K):
    """The in-kernel gate's parameters, as the chunk kernels (forward and backward) need them."""
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


def chunk_kda_fwd(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=-5.0,
    use_beta_sigmoid_in_kernel=False, out=None, block_v=None, num_warps=None, split=True, chunk_size=64,
    num_stages=None, prep_num_warps=None, state_dot="bf16", lowp_buffers=True, output=None, h_dtype=None,
    out_block_v=None, out_num_warps=None, out_num_stages=None, keep_for_backward=False,
):
    """Forward only (no autograd). ``out`` (optional, [B, T, H, V], v.dtype) receives the output.

    ``keep_for_backward``: also return what the 64-token backward would otherwise recompute, ``(o, ht, kept)``,
    for ``triton_chunk_bwd.chunk_kda_bwd(kept=...)``; only with the default launches. The kept buffers come from
    the "stored" kernels, whose o equals the fused loop's up to summation order (bit-identical in the H100 runs).

    ``output``: None (the default) is "fused" at 64-token chunks and "stored" at 16.
    ``output="stored"`` (fla's chunk_kda layout, both chunk sizes): prep as below, then the sequential
    kernel only computes u = u0 - w S ("v_new", fp32 [B, T, H, V]; q.dtype with ``lowp_buffers``) and stores
    the state at the start of every chunk into h [chunks, H, K, V] (``h_dtype``: default bf16 for bf16 inputs,
    as fla, fp32 otherwise), then a fully parallel kernel over (chunk, head, V-block) computes
    o = qg h + Aqk u (see ``_stored_fwd``). h costs chunks * H * K * V * 2 bytes (bf16) while the call runs:
    6.4 GB at T = 128K, H = 96, K = V = 128 (at block_v >= 64 the 64-token path keeps no u0 buffer: its state
    kernel forms u0 from the prep's X diag(beta) scratch and v).
    ``output="fused"``: the sequential kernel computes o itself and no h is kept. At 64-token chunks, with its
    default launch (block_v 128, 8 warps), it is the faster of the two: H100, T = 8K, same run, 1.85 against 2.24
    ms for "stored", 7.40 against 8.97 at 32K, 7.61 against 9.27 on an 8-sequence varlen batch of 32K, outputs
    bit-identical (BENCHMARKS.md, thirty-fourth session; at block_v 32, its default before, 2.54 ms).
    Tuning: ``block_v`` / ``num_warps`` / ``num_stages`` for the state kernel (block_v / num_warps default
    min(V, 128) / 8 (4 below 128) at chunk 64, min(V, 64) / 4 stored and min(V, 32) / 4 fused at chunk 16),
    ``prep_num_warps`` for the first prep kernel, ``out_block_v`` / ``out_num_warps`` / ``out_num_stages`` for the
    output kernel (defaults min(V, 128) / 4 / 2).

    ``chunk_size=64`` (the default): the 64-token path, parallel prep over (chunk, head) in two kernels
    (``_kda_chunk64_prep_kernel``: Aqk and the UT inverse; ``_kda_chunk64_wu_kernel``: w, qg, kd, and u0 at
    block_v < 64), then ``_kda_chunk64_state_kernel`` sequential over chunks (forming u0 = X diag(beta) v itself
    at block_v >= 64); ``split`` is ignored. ``num_warps`` / ``num_stages`` tune the sequential kernel (default
    num_stages 2, 1 when shared memory is short), ``prep_num_warps`` the first prep kernel (1, the default, or 2).
    ``state_dot`` (bf16 inputs only): "bf16" (default, as fla's chunk_kda) or "tf32" operands for the products
    against the state, which itself stays fp32 (registers, initial and final state); fp32 inputs always use
    exact fp32 dots. ``lowp_buffers=True`` (default; bf16 inputs) also stores the kd and Aqk intermediates in
    q.dtype (~0.75 KB less HBM traffic per token-head at K = 128, written once and read at least once).
    Measured on the H200 at T = 8K, H = 96, K = V = 128: 2.62 ms with the defaults of then (output="stored"), fla's
    chunk_kda 2.62 ms
    in the same run (BENCHMARKS.md, eleventh session); in the eighth session 2.65 ms, and 3.06 ms with
    output="fused" (the fifth session's single-kernel prep: 4.10 ms; 4.73 with lowp_buffers=False, 6.06 with
    state_dot="tf32" as well, 6.37 for the 16-token path). At T = 300 the fp32-reference distances are o 5.5e-3,
    S 3.6e-3 in both outputs; fla's chunk_kda, with bf16 state products too, measured 4.0e-3 / 5.3e-3 in the same
    kind of check.

    ``chunk_size=16`` with ``split=True``: the 16-token kernel (tf32 state products, fp32 buffers).
    ``split=True``: w, u0 are first computed for all chunks in parallel (``_kda_chunk_prep_kernel``; w in
    q.dtype, u0 in fp32 because bf16 u0 cost ~6e-3 relative error in the final state; ~1.5 KB per token-head
    of extra traffic at K = V = 128), then the sequential kernel only does the state products; ``split=False``
    computes them inside the sequential loop.
    """
    if chunk_size not in (16, 64):
        raise ValueError(f"chunk_size must be 16 or 64, got {chunk_size}")
    if chunk_size == 64 and prep_num_warps not in (None, 1, 2):
        # The first 64-token prep kernel multiplies 16 x 16 tiles, which at most two warps can share. The wrong
        # H200 result once blamed on 4 warps here came from the single-stage state kernel (refused below;
        # BENCHMARKS.md, ninth session), but 4 warps with 16-channel slices has not been checked on a GPU since,
        # and was slower: only the measured values are accepted.
        raise ValueError(f"prep_num_warps must be 1 or 2 for chunk_size=64, got {prep_num_warps}")
    if state_dot not in (None, "tf32", "bf16"):
        raise ValueError(f"state_dot must be None, 'tf32' or 'bf16', got {state_dot!r}")
    if output is None:
        output = "fused" if chunk_size == 64 else "stored"
    if output not in ("fused", "stored"):
        raise ValueError(f"output must be None, 'fused' or 'stored', got {output!r}")
    if num_stages == 1 and q.dtype == torch.bfloat16 and state_dot == "bf16" and (chunk_size == 64
                                                                                  or output == "stored"):
        raise ValueError(_SINGLE_STAGE_BF16)
    if h_dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"h_dtype must be None, torch.float32 or torch.bfloat16, got {h_dtype!r}")
    B, T, H, K, V, N = _ref._validate(q, k, v, g, beta, initial_state, cu_seqlens)
    if not (_is_pow2(K) and _is_pow2(V)):
        raise ValueError(f"K and V must be powers of two >= 16 for the Triton kernel, got K={K}, V={V}")
    if use_gate_in_kernel:
        check_gate_args(A_log, dt_bias, lower_bound, H, K)
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
    tuning = (block_v, num_warps, num_stages, prep_num_warps, state_dot, lowp_buffers, out_block_v, out_num_warps,
              out_num_stages)
    if chunk_size == 64:
        BV, warps = _state64_launch(V)
    else:
        BV, warps = min(V, 64 if output == "stored" else 32), 4
    BV, num_warps = block_v or BV, num_warps or warps
    if V % BV or not _is_pow2(BV):
        raise ValueError(f"block_v must be a power of two >= 16 dividing V = {V}, got {BV}")
    dummy = q  # placeholder pointer for unused arguments
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous() if cu_seqlens is not None else None
    dot_mode = 0 if q.dtype != torch.bfloat16 else 2 if os.environ.get("TRITON_INTERPRET") == "1" else 1
    gate_args = (A_log.contiguous(), dt_bias.contiguous()) if use_gate_in_kernel else (dummy, dummy)
    flags = (bool(use_gate_in_kernel), bool(use_beta_sigmoid_in_kernel), bool(use_qk_l2norm_in_kernel))
    h_dtype = h_dtype or (torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32)
    if keep_for_backward:
        if chunk_size != 64 or tuning != (None, None, None, None, "bf16", True, None, None, None):
            raise ValueError("keep_for_backward needs the default 64-token launches (chunk_size=64, no tuning "
                             "arguments): the backward's buffers come from those kernels")
        kept = _recompute_for_backward(q, k, v, g, beta, h0, cu_seqlens, gate_args, float(scale), float(lower_bound),
                                       (B, T, H, K, V, N), dot_mode, h_dtype, flags, out=out, ht=ht)
        return out, ht, kept
    if output == "stored":
        OBV = out_block_v or min(V, 128)
        if V % OBV or not _is_pow2(OBV):
            raise ValueError(f"out_block_v must be a power of two >= 16 dividing V = {V}, got {OBV}")
        _stored_fwd(q, k, v, g, beta, out, h0, ht, cu_seqlens, gate_args, float(scale), float(lower_bound),
                    (B, T, H, K, V, N), chunk_size, BV, OBV, dot_mode, num_warps, num_stages, prep_num_warps,
                    out_num_warps or 4, out_num_stages, state_dot, bool(lowp_buffers), h_dtype, flags)
        return out, ht
    if chunk_size == 64:
        _chunk64_fwd(q, k, v, g, beta, out, h0, ht, cu_seqlens, gate_args, float(scale), float(lower_bound),
                     (B, T, H, K, V, N), BV, dot_mode, num_warps, num_stages, prep_num_warps, state_dot,
                     bool(lowp_buffers), flags)
        return out, ht
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
                dummy, dummy, dummy, dummy, 1.0, H=H, K=K, V=V, BT=_BT, USE_GATE=bool(use_gate_in_kernel),
                USE_BETA_SIGMOID=bool(use_beta_sigmoid_in_kernel), USE_L2NORM=bool(use_qk_l2norm_in_kernel),
                DOT_BF16=dot_mode, num_warps=num_warps, enable_fp_fusion=True,
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
        num_warps=num_warps, enable_fp_fusion=True,
    )
    return out, ht


# Launch settings of the two 64-token prep kernels; module-level so a benchmark can sweep them. Measured on the
# H200 at T = 8K, H = 96, K = V = 128 (BENCHMARKS.md, eighth session).
_PREP64_BLOCK = 16  # channels per slice of the inverse kernel's K sweep
_PREP64_WARPS = 1
# (BK, BV, num_warps, maxnreg) of the w / u0 kernel: 4 warps capped at 128 registers (no spill; up to 16 warps an
# SM instead of 8 at 255 registers, and its products become warp-group MMAs) measured 2.62 against 2.73 ms for the
# whole forward at T = 8K, H = 96 on the H200; 96 or 112 registers, 8 warps, or 64-channel slices were slower
# (BENCHMARKS.md, eleventh session)
_WU64 = (32, 64, 4, 128)


def _state64_launch(V: int):
    """Default (block_v, num_warps) of the 64-token state kernel, both outputs: the whole V = 128 in one
    8-warp program (two warp groups sharing each chunk's tiles) rather than two 4-warp programs. Its loads and
    shared memory then serve both halves of V once, and the 96 programs of B = 1, H = 96 fit one to an SM.
    H100, T = 8K, H = 96, K = V = 128, same run, forward ms: 2.297 against 2.334 at block_v 64 / 4 warps
    (2.428 before the kernel carried S^T); at T = 32K 9.060 against 9.243 (BENCHMARKS.md, twenty-eighth session).
    With ``output="fused"``: 1.847 ms against 2.269 at block_v 64 / 4 warps and 2.431 at block_v 128 / 4 warps
    (thirty-fourth session)."""
    BV = min(V, 128)
    return BV, 8 if BV >= 128 else 4


def _u_in_state(BV: int) -> bool:
    """Whether the 64-token state kernel forms u0 = Xb v itself (``U_XB``) instead of loading the fp32 u0 buffer
    the w / u0 kernel would write: at V-blocks of 64 and wider. At block_v = 32 the stored path compiled to wrong
    states with triton 3.6 (H100, bf16 state products; right under the interpreter), so narrower blocks keep the
    buffer, as before U_XB."""
    return BV >= 64


def _launch_prep64(n_chunks, args, H, K, V, is_varlen, flags, dot_mode, wu_dot, prep_num_warps, bwd_bufs=None):
    """The two 64-token prep kernels: Aqk and the UT inverse (into an fp32 [chunks, H, 64, 64] scratch), then
    w, qg, kd and G_last, and u0 when ``u_buf`` is a buffer (None: the state kernel forms u0, ``U_XB``).
    ``bwd_bufs`` = (X [chunks, H, 64, 64], Akk [B, T, H, 64]), both fp32: also store X and the normalised strict
    Akk for the backward. Returns the scratch X diag(beta) and the row scales."""
    use_gate, use_bsig, use_l2 = flags
    (q, k, v, g, beta, cu_all, chunk_indices, A_log, dt_bias,
     w_buf, u_buf, qg_buf, kd_buf, A_buf, gl_buf, scale, lower_bound, T, NT) = args
    x_buf = torch.empty(n_chunks, H, _BT64, _BT64, dtype=torch.float32, device=q.device)
    r_buf = torch.empty(*q.shape[:3], 2, dtype=torch.float32, device=q.device)  # s / |q|, 1 / |k|
    xu_buf, akk_buf = bwd_bufs or (x_buf, x_buf)
    _kda_chunk64_prep_kernel[(n_chunks, H)](
        q, k, g, beta, cu_all, chunk_indices, A_log, dt_bias, x_buf, r_buf, A_buf, xu_buf, akk_buf,
        lower_bound, scale, T, NT,
        H=H, K=K, BS=_BS, IS_VARLEN=is_varlen, USE_GATE=use_gate, USE_BETA_SIGMOID=use_bsig, USE_L2NORM=use_l2,
        DOT_BF16=dot_mode, WU_DOT=wu_dot, BK=min(K, _PREP64_BLOCK), STORE_BWD=bwd_bufs is not None,
        INTERP=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=prep_num_warps or _PREP64_WARPS, enable_fp_fusion=True,
    )
    bk, bv, nw, maxnreg = _WU64
    _kda_chunk64_wu_kernel[(n_chunks, H)](
        q, k, v, g, cu_all, chunk_indices, A_log, dt_bias, x_buf, r_buf,
        w_buf, q if u_buf is None else u_buf, qg_buf, kd_buf, gl_buf, lower_bound, T, NT,
        H=H, K=K, V=V, BT=_BT64, IS_VARLEN=is_varlen, USE_GATE=use_gate, WU_DOT=wu_dot,
        BK=min(K, bk), BV=min(V, bv), STORE_U=u_buf is not None, num_warps=nw, maxnreg=maxnreg, enable_fp_fusion=True,
    )
    return x_buf, r_buf


def _chunk64_fwd(q, k, v, g, beta, out, h0, ht, cu_seqlens, gate_args, scale, lower_bound, dims, BV, dot_mode,
                 num_warps, num_stages, prep_num_warps, state_dot, lowp_buffers, flags):
    """Launch the 64-token path: prep (parallel over chunk x head) then the state loop (sequence x head x V)."""
    B, T, H, K, V, N = dims
    dev = q.device
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    # Chunks never cross a sequence boundary; a sequence's last chunk may be partial (masked).
    if cu_seqlens is not None:
        # chunk_indices [NT_total, 2] = (sequence, 64-chunk within it), sequence-major;
        # chunk_offsets[n] = first global chunk of sequence n. (Host sync: cu_seqlens is read on the host.)
        cs = [int(c) for c in cu_seqlens.tolist()]
        nts = [triton.cdiv(cs[n + 1] - cs[n], _BT64) for n in range(N)]
        idx = [(n, c) for n in range(N) for c in range(nts[n])]
        offs = [0]
        for nt in nts:
            offs.append(offs[-1] + nt)
        n_chunks, NT = len(idx), 0
        cu_all = cu_seqlens.to(device=dev, dtype=torch.int32).contiguous()
        chunk_offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
        chunk_indices = torch.tensor(idx, dtype=torch.int32).reshape(-1, 2).to(dev)
    else:
        # B sequences of T tokens: the kernels derive (sequence, chunk) from the program id (no host sync,
        # nothing allocated from host data: CUDA-graph capturable)
        NT = triton.cdiv(T, _BT64)
        n_chunks = B * NT
        cu_all = chunk_offsets = chunk_indices = q  # unused placeholders
    # Buffer dtypes, measured under the interpreter with bf16 inputs (tf32 emulated), T = 64 / 200, K = V = 32,
    # rel err vs the fp32 reference: all in bf16 gave o 1.5e-2 / S 3.8e-3; kd in fp32 brings S to 7e-4 (the
    # state accumulates kd^T u every chunk), Aqk in fp32 brings o to 8.5e-3 (= the 16-token kernel's error);
    # w, qg in bf16 changed neither in the digits shown. u0 fp32 (bf16 u0 cost ~6e-3 in S, 16-token split path),
    # and at block_v >= 64 not stored at all: the state kernel forms it in fp32 from the fp32 Xb scratch. fp32 inputs:
    # everything fp32. G_last fp32 per (chunk, head). lowp_buffers=True: kd and Aqk in q.dtype too (the "all in
    # bf16" numbers above; fla measured o 5.3e-3 / S 4.0e-3 in the same check).
    lp = q.dtype if lowp_buffers else torch.float32
    w_buf = torch.empty(B, T, H, K, dtype=q.dtype, device=dev)
    qg_buf = torch.empty(B, T, H, K, dtype=q.dtype, device=dev)
    kd_buf = torch.empty(B, T, H, K, dtype=lp, device=dev)
    A_buf = torch.empty(B, T, H, _BT64, dtype=lp, device=dev)
    gl_buf = torch.empty(max(n_chunks, 1), H, K, dtype=torch.float32, device=dev)
    bf16 = q.dtype == torch.bfloat16
    # products inside the prep (the UT inverse's blocks, X times w's and u0's right-hand sides): exact fp32 for fp32
    # inputs, tf32 for bf16 inputs
    wu_dot = (4 if interp else 3) if bf16 else 0
    if not bf16:
        st_dot = 0
    elif state_dot == "bf16":
        st_dot = dot_mode
    else:
        st_dot = 4 if interp else 3
    is_varlen = cu_seqlens is not None
    # u0: formed by the state kernel (U_XB; q stands in for the buffer) or an fp32 buffer, see _u_in_state.
    # Without chunks q also stands in for Xb: the state kernel then only carries h0 to ht.
    u_xb = _u_in_state(BV)
    u_buf = None if u_xb else torch.empty(B, T, H, V, dtype=torch.float32, device=dev)
    x_buf = q
    if n_chunks:
        x_buf, _ = _launch_prep64(n_chunks, (q, k, v, g, beta, cu_all, chunk_indices, *gate_args,
                                             w_buf, u_buf, qg_buf, kd_buf, A_buf, gl_buf, scale, lower_bound, T, NT),
                                  H, K, V, is_varlen, flags, dot_mode, wu_dot, prep_num_warps)

    def launch(stages):
        _kda_chunk64_state_kernel[(N, H, V // BV)](
            w_buf, q if u_xb else u_buf, qg_buf, kd_buf, A_buf, gl_buf, out,
            h0 if h0 is not None else q, ht if ht is not None else q, cu_all, chunk_offsets, T, NT, q, q, x_buf, v,
            H=H, K=K, V=V, BT=_BT64, BV=BV, IS_VARLEN=is_varlen, USE_H0=h0 is not None,
            STORE_FINAL=ht is not None, STATE_DOT=st_dot, U_XB=u_xb, U_DOT=wu_dot,
            num_warps=num_warps, num_stages=stages, enable_fp_fusion=True,
        )

    # default: pipelined chunk loads (2 stages), 1 if that does not fit
    _launch_pipelined(launch, num_stages, st_dot not in (1, 2))


# The state kernel compiled with one pipeline stage, 4 warps and bf16 state products gave wrong states on the
# H200 with triton 3.6 (K = 64: a state update off by ~100 %, and an illegal memory access at block_v = 16;
# right with 2 stages, 2 or 8 warps, or tf32 products; BENCHMARKS.md, ninth session). Where that cannot be
# ruled out, one stage is refused rather than run.
_SINGLE_STAGE_BF16 = ("num_stages=1 is refused for the KDA state kernel with bf16 state products (wrong results on the "
                      "H200 with triton 3.6): use num_stages >= 2, state_dot='tf32', or a smaller block_v")


def _launch_pipelined(launch, num_stages, single_stage_ok=True):
    # num_stages given: use it; else 2 (double-buffered chunk loads), or 1 when that does not fit in shared memory
    # for the shape rather than failing (unless one stage is unsafe for the launch)
    if num_stages is not None:
        launch(num_stages)
        return
    try:
        launch(2)
        return
    except triton.runtime.errors.OutOfResources:
        pass
    if not single_stage_ok:
        raise ValueError(_SINGLE_STAGE_BF16)
    launch(1)


_DENSE_LAYOUTS: dict = {}  # (B, T, chunk, device) -> chunk layout tensors of a batch without cu_seqlens


def _stored_fwd(q, k, v, g, beta, out, h0, ht, cu_seqlens, gate_args, scale, lower_bound, dims, chunk_size, BV,
                OBV, dot_mode, num_warps, num_stages, prep_num_warps, out_num_warps, out_num_stages, state_dot,
                lowp_buffers, h_dtype, flags, for_backward=False, with_output=False):
    """``output="stored"``: prep (parallel) -> state kernel storing h and u (sequential) -> output (parallel).

    ``for_backward`` (64-token chunks; ``triton_chunk_bwd``'s recompute): the prep also keeps X, the normalised
    Akk and the row scales, and every buffer is returned in a dict with the chunk layout; no output kernel unless
    ``with_output`` (a forward that keeps its buffers for the backward, see ``_ChunkKDAFunction``).

    Buffers as in ``_chunk64_fwd`` (w, qg in q.dtype; kd, Aqk fp32 unless ``lowp_buffers``; u0 fp32, none at
    64-token chunks and block_v >= 64, where the state kernel forms it), plus
    h [chunks, H, K, V] in ``h_dtype`` (chunk_kda_fwd's default: bf16 for bf16 inputs, which rounds the state
    every token's qg h reads exactly as the fused path's bf16 state products do; fp32 otherwise) and
    v_new [B, T, H, V] fp32 (u = u0 - w S is a difference of nearly equal terms when keys repeat, and the fused
    path multiplies it by Aqk from fp32 registers; q.dtype with ``lowp_buffers``).
    HBM cost of h: chunks * H * K * V * 2 B in bf16, written once and read once (at T = 8K, H = 96,
    K = V = 128: 0.4 GB at chunk 64, 1.6 GB at chunk 16, which is why fla stores it at chunk 64 only).
    """
    B, T, H, K, V, N = dims
    use_gate, use_bsig, use_l2 = flags
    dev = q.device
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    BT = chunk_size
    # chunk layout, sequence-major; chunks never cross a sequence boundary, a sequence's last one may be
    # partial. The 16-token prep always reads (sequence, chunk) from chunk_indices; the 64-token prep and the
    # state / output kernels derive them from the program id when there is no cu_seqlens (NT chunks each).
    is_varlen = cu_seqlens is not None
    NT = 0 if is_varlen else triton.cdiv(T, BT)
    key = (B, T, BT, str(dev))
    if is_varlen or key not in _DENSE_LAYOUTS:
        if is_varlen:
            cs = [int(c) for c in cu_seqlens.tolist()]  # host sync
        else:
            cs = [i * T for i in range(B + 1)]
        nts = [triton.cdiv(cs[n + 1] - cs[n], BT) for n in range(N)]
        idx = [(n, c) for n in range(N) for c in range(nts[n])]
        offs = [0]
        for nt in nts:
            offs.append(offs[-1] + nt)
        layout = (len(idx), torch.tensor(cs, dtype=torch.int32, device=dev),
                  torch.tensor(offs, dtype=torch.int32, device=dev),
                  torch.tensor(idx, dtype=torch.int32).reshape(-1, 2).to(dev))  # chunk_indices [n_chunks, 2]
        if not is_varlen:
            # dense batches: built once per shape, so repeated calls copy nothing from the host (the 16-token
            # prep reads chunk_indices even without cu_seqlens)
            if len(_DENSE_LAYOUTS) > 64:
                _DENSE_LAYOUTS.clear()
            _DENSE_LAYOUTS[key] = layout
    else:
        layout = _DENSE_LAYOUTS[key]
    n_chunks, cu_all, chunk_offsets, chunk_indices = layout
    lp = q.dtype if lowp_buffers else torch.float32
    w_buf = torch.empty(B, T, H, K, dtype=q.dtype, device=dev)
    qg_buf = torch.empty(B, T, H, K, dtype=q.dtype, device=dev)
    kd_buf = torch.empty(B, T, H, K, dtype=lp, device=dev)
    A_buf = torch.empty(B, T, H, BT, dtype=lp, device=dev)
    # u0: formed by the 64-token state kernel (U_XB, see _u_in_state), else an fp32 buffer the prep kernels write
    u_xb = BT == 64 and _u_in_state(BV)
    u_buf = None if u_xb else torch.empty(B, T, H, V, dtype=torch.float32, device=dev)
    gl_buf = torch.empty(max(n_chunks, 1), H, K, dtype=torch.float32, device=dev)
    h_buf = torch.empty(max(n_chunks, 1), H, K, V, dtype=h_dtype, device=dev)
    vn_buf = torch.empty(B, T, H, V, dtype=lp, device=dev)
    bf16 = q.dtype == torch.bfloat16
    tf32 = 4 if interp else 3
    if not bf16:
        st_dot = 0
    elif state_dot == "bf16":
        st_dot = dot_mode
    else:
        st_dot = tf32
    x_buf = r_buf = bwd_bufs = None
    if for_backward:
        bwd_bufs = (torch.empty(max(n_chunks, 1), H, BT, BT, dtype=torch.float32, device=dev),  # X
                    torch.empty(B, T, H, BT, dtype=torch.float32, device=dev))  # normalised strict Akk
    if n_chunks and BT == 64:
        x_buf, r_buf = _launch_prep64(n_chunks, (q, k, v, g, beta, cu_all, chunk_indices, *gate_args,
                                                 w_buf, u_buf, qg_buf, kd_buf, A_buf, gl_buf, scale, lower_bound, T,
                                                 NT),
                                      H, K, V, is_varlen, flags, dot_mode, tf32 if bf16 else 0, prep_num_warps,
                                      bwd_bufs)
    elif n_chunks:
        _kda_chunk_prep_kernel[(n_chunks, H)](
            q, k, v, g, beta, cu_all, chunk_indices, *gate_args, w_buf, u_buf, lower_bound,
            qg_buf, kd_buf, A_buf, gl_buf, scale, H=H, K=K, V=V, BT=BT, USE_GATE=use_gate,
            USE_BETA_SIGMOID=use_bsig, USE_L2NORM=use_l2, DOT_BF16=dot_mode, STORE_QKA=True,
            num_warps=prep_num_warps or num_warps, enable_fp_fusion=True,
        )

    def launch_state(stages):
        _kda_chunk64_state_kernel[(N, H, V // BV)](
            w_buf, q if u_xb else u_buf, qg_buf, kd_buf, A_buf, gl_buf, out,
            h0 if h0 is not None else q, ht if ht is not None else q, cu_all, chunk_offsets, T, NT, h_buf, vn_buf,
            x_buf if x_buf is not None else q, v,
            H=H, K=K, V=V, BT=BT, BV=BV, IS_VARLEN=is_varlen, USE_H0=h0 is not None,
            STORE_FINAL=ht is not None, STATE_DOT=st_dot, STORED=True, U_XB=u_xb, U_DOT=tf32 if bf16 else 0,
            num_warps=num_warps, num_stages=stages, enable_fp_fusion=True,
        )

    _launch_pipelined(launch_state, num_stages, st_dot not in (1, 2))
    kept = None
    if for_backward:
        kept = dict(n_chunks=n_chunks, NT=NT, cu=cu_all, chunk_offsets=chunk_offsets, chunk_indices=chunk_indices,
                    w=w_buf, qg=qg_buf, kd=kd_buf, Aqk=A_buf, gl=gl_buf, h=h_buf, u=vn_buf, xb=x_buf, r=r_buf,
                    X=bwd_bufs[0], Akk=bwd_bufs[1], st_dot=st_dot, wu_dot=tf32 if bf16 else 0)
        if not with_output:
            return kept
    if not n_chunks:
        return kept
    # qg h: bf16 operands when both are bf16 already (exact products, bf16 MMA rate); else the state mode
    qh_dot = dot_mode if (bf16 and h_dtype == torch.bfloat16 and st_dot != 0) else st_dot

    def launch_out(stages):
        _kda_chunk_output_kernel[(n_chunks, H, V // OBV)](
            qg_buf, A_buf, vn_buf, h_buf, out, cu_all, chunk_indices, T, max(NT, 1),
            H=H, K=K, V=V, BT=BT, BK=min(K, 64), BV=OBV, IS_VARLEN=is_varlen, QH_DOT=qh_dot, AU_DOT=st_dot,
            num_warps=out_num_warps, num_stages=stages, enable_fp_fusion=True,
        )

    _launch_pipelined(launch_out, out_num_stages)
    return kept


def _recompute_for_backward(q, k, v, g, beta, h0, cu_seqlens, gate_ptrs, scale, lower_bound, dims, dot_mode,
                            state_dtype, flags, out=None, ht=None):
    """The 64-token forward with what the backward needs kept (``_stored_fwd(for_backward=True)``), with
    ``chunk_kda_fwd``'s default launches and numerics: run by ``triton_chunk_bwd`` (the recompute), or by the
    forward itself when it keeps its buffers (then with ``out`` / ``ht`` to fill, the same o as the plain forward).
    ``h0`` fp32 or None; ``gate_ptrs`` (A_log, dt_bias) or placeholders."""
    V = dims[4]
    BV, num_warps = _state64_launch(V)
    return _stored_fwd(q, k, v, g, beta, q if out is None else out, h0, ht, cu_seqlens, gate_ptrs, scale,
                       lower_bound, dims, 64, BV, min(V, 128), dot_mode, num_warps, None, None, 4, None, "bf16",
                       True, state_dtype, flags, for_backward=True, with_output=out is not None)


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
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, flags, fwd_options):
        # fwd_options: extra keyword arguments of chunk_kda_fwd (output, chunk_size, tuning). The backward
        # recomputes what it needs from the saved inputs, so none of the forward's intermediates is kept, unless
        # keep_buffers (below) trades their memory for that recompute.
        use_l2, use_gate, use_bsig, lower_bound = flags
        keep = _ChunkKDAFunction._keeps(ctx, fwd_options)
        out = chunk_kda_fwd(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_l2, use_gate_in_kernel=use_gate,
            A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_bsig,
            keep_for_backward=keep, **fwd_options,
        )
        o, ht = out[:2]
        # The kept buffers are saved tensors like the inputs, so gradient checkpointing drops them with the rest
        # of the layer's and the recomputed forward keeps them again; the dict's other entries ride on ctx.
        kept = out[2] if keep else {}
        ctx.kept_names = [n for n, t in kept.items() if isinstance(t, torch.Tensor)]
        ctx.kept_rest = {n: t for n, t in kept.items() if n not in ctx.kept_names}
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, *(kept[n] for n in ctx.kept_names))
        ctx.cu_seqlens, ctx.scale, ctx.flags = cu_seqlens, scale, flags
        return o, ht

    # Whether the forward keeps the buffers its Triton backward needs (w, u, qg, kd, Aqk, X, Akk, h: about 1.9 GB
    # per call at T = 8K, H = 96, K = V = 128 in bf16, held from the forward to the backward) instead of the
    # backward recomputing them (the forward's prep, w / u0 and state kernels again: forward + backward 14.4 ->
    # 12.0 ms at T = 8K on the H200, fourteenth session). Off by default: it is memory for time. They are saved
    # tensors, so under gradient checkpointing they are dropped and recomputed with the rest of the layer.
    keep_buffers = os.environ.get("K3_KDA_KEEP_BUFFERS", "0") == "1"

    @staticmethod
    def _keeps(ctx, fwd_options) -> bool:
        return (bool(_ChunkKDAFunction.keep_buffers) and any(ctx.needs_input_grad[:8])
                and fwd_options.get("output") in (None, "fused", "stored") and set(fwd_options) <= {"output"}
                and _ChunkKDAFunction.backward_impl == "triton"
                and _ChunkKDAFunction.bwd_options in ({}, {"chunk_size": 64}))  # else the backward would not use them

    # "triton": Triton backward (triton_chunk_bwd.py), preprocessing included;
    # "reference": recompute with the fp32 torch reference under autograd (slow, kept for comparison).
    backward_impl = os.environ.get("K3_KDA_CHUNK_BACKWARD", "triton")
    # extra keyword arguments of triton_chunk_bwd.chunk_kda_bwd (state_dtype, block_v, num_warps, ...)
    bwd_options: dict = {}

    @staticmethod
    def backward(ctx, do, dht):
        impl = _ChunkKDAFunction.backward_impl
        if impl == "triton":
            return _ChunkKDAFunction._backward_triton(ctx, do, dht)
        if impl != "reference":
            raise ValueError(f"_ChunkKDAFunction.backward_impl must be 'triton' or 'reference', got {impl!r}")
        saved = ctx.saved_tensors[:8]
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
        return (*result, None, None, None, None)

    @staticmethod
    def _backward_triton(ctx, do, dht):
        from .triton_chunk_bwd import chunk_kda_bwd

        saved = ctx.saved_tensors
        q, k, v, g, beta, A_log, dt_bias, h0 = saved[:8]
        use_l2, use_gate, use_bsig, lower_bound = ctx.flags
        # the same flags as the forward: the kernels redo the elementwise preprocessing and take its backward
        # in their epilogue, so the gradients come back with respect to the raw inputs
        kept = {**ctx.kept_rest, **dict(zip(ctx.kept_names, saved[8:]))} if ctx.kept_names else None
        dq, dk, dv, dg, db, dh0, dA, ddt = chunk_kda_bwd(
            q, k, v, g, beta, do, scale=ctx.scale, initial_state=h0, dht=dht, cu_seqlens=ctx.cu_seqlens,
            use_qk_l2norm_in_kernel=use_l2, use_gate_in_kernel=use_gate, A_log=A_log, dt_bias=dt_bias,
            lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_bsig, check_gate=False, kept=kept,
            **_ChunkKDAFunction.bwd_options,
        )
        if use_gate:
            dA_full = torch.zeros(A_log.shape, dtype=torch.float32, device=A_log.device)
            dA_full[: dA.shape[0]] = dA  # A_log may be longer than H: only the first H entries are used
            dA, ddt = dA_full.to(A_log.dtype), ddt.reshape(dt_bias.shape).to(dt_bias.dtype)
        result = [dq, dk, dv, dg, db, dA, ddt, dh0]
        saved = (q, k, v, g, beta, A_log, dt_bias, h0)
        result = [None if (r is None or not need) else r.to(s.dtype)
                  for r, s, need in zip(result, saved, ctx.needs_input_grad[:8])]
        return (*result, None, None, None, None)


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
    output: str | None = None,
    forward_options: dict | None = None,
):
    """Chunked KDA forward (Triton) with autograd.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: fp32 log decay [B, T, H, K] with -5 <= g <= 0, or the raw gate
    input z when ``use_gate_in_kernel`` (then ``g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias))``,
    A_log [>= H], dt_bias [H*K]); beta: [B, T, H] (raw logits when ``use_beta_sigmoid_in_kernel``).
    initial_state: [N, H, K, V]. Returns (o [B, T, H, V] in v.dtype, final_state fp32 [N, H, K, V] or None).

    Forward: :func:`chunk_kda_fwd` with its defaults (64-token chunks, bf16 state products). Backward: the
    Triton core backward of ``triton_chunk_bwd`` (64-token chunks by default; through the in-kernel gate / beta /
    L2-norm preprocessing as well; ``_ChunkKDAFunction.bwd_options`` passes it options); the fp32 reference
    recompute is kept selectable (see the module docstring). ``output`` (None for chunk_kda_fwd's default, "fused"
    or "stored") and
    ``forward_options`` (other keyword arguments of :func:`chunk_kda_fwd`, e.g. ``chunk_size``, ``block_v``) only
    change the forward kernels; the backward is the same.
    """
    fwd_options = dict(forward_options or {})
    if output is not None and fwd_options.get("output", output) != output:
        raise ValueError("output given both as an argument and in forward_options")
    fwd_options.setdefault("output", output)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    flags = (bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel), bool(use_beta_sigmoid_in_kernel),
             float(lower_bound))
    o, ht = _ChunkKDAFunction.apply(q, k, v, g, beta, A_log if use_gate_in_kernel else None,
                                    dt_bias if use_gate_in_kernel else None, initial_state, cu_seqlens,
                                    float(scale), flags, fwd_options)
    return o, (ht if output_final_state else None)
