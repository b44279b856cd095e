"""Chunked KDA backward in Triton (bounded gate; 64-token chunks by default, 16-token tiles as an option), the
counterpart of ``triton_chunk``.

The core maths below works on post-activation inputs: q, k (L2-normalised), v, g = per-step fp32 log decay with
-5 <= g <= 0, beta in (0, 1), scale, optional h0. The forward's in-kernel preprocessing (L2 norm of q and k,
gate ``g = lb * sigmoid(exp(A_log) * (z + dt_bias))``, beta sigmoid) is redone inside every kernel from the raw
inputs, and the per-chunk kernel takes the gradients back through it in its epilogue::

    dx = r (dq - q <dq, q>)                  (q = x r, r = 1 / sqrt(|x|^2 + 1e-6); the same for k)
    dz = dg lb s (1 - s) a = d dt_bias,  dA_log = sum dz (z + dt_bias)     (s = sigmoid(a (z + dt_bias)), a = e^A_log)
    dbeta_logit = dbeta beta (1 - beta)

so no [T, H, K] fp32 intermediate of the preprocessing is made or differentiated by torch (it was ~25 % of a
training step at T = 8K, H = 96: ~10 ms of elementwise kernels). dt_bias and A_log get per-(chunk, head)
partial sums that torch adds up.

Forward per 16-token chunk, state S = S_in [K, V] before the chunk (G = within-chunk cumsum of g, in
(-80, 0] thanks to the bounded gate, so e^G and e^-G are normal fp32 numbers; Gl = G of the last row)::

    kg = k e^G,  kn = k e^-G,  qg = s q e^G,  kd = k e^(Gl - G)                     # [C, K]
    A  = strict_lower(kg kn^T),  M = I + diag(beta) A,  X = M^-1                     # [C, C]
    B1 = diag(beta) kg,  B2 = diag(beta) v,  w = X B1,  u0 = X B2,  u = u0 - w S
    Aqk = causal_lower(qg kn^T),  o = qg S + Aqk u
    S_out = diag(e^Gl) S + kd^T u

Backward, given do [C, V] and dS_out [K, V] (the adjoint of the state after the chunk)::

    du    = Aqk^T do + kd dS_out                                 (u feeds o and S_out)
    dS_in = diag(e^Gl) dS_out + qg^T do - w^T du                 (carried backwards over chunks)
    dqg   = do S^T + dAqk kn,   dAqk = causal(do u^T)
    dkn   = dAqk^T qg + dA^T kg
    dw    = -du S^T,  dkd = u dS_out^T
    dX    = dw B1^T + du B2^T,  dB1 = X^T dw,  dB2 = X^T du
    dM    = -X^T dX X^T          (from dX = -X dM X),  dA = strict(diag(beta) dM)
    dkg   = diag(beta) dB1 + dA kn
    dv    = diag(beta) dB2,   dbeta = rowsum(dB1 * kg) + rowsum(dB2 * v) + rowsum(dM * A)
    dq    = s e^G dqg,   dk = e^G dkg + e^-G dkn + e^(Gl - G) dkd
    dG    = qg dqg + kg dkg - kn dkn - kd dkd   (elementwise; each factor's derivative in G)
    dGl   = e^Gl * rowsum_V(S * dS_out) + colsum_C(kd dkd)    -> added to dG of the last row
    dg    = reverse cumsum of dG inside the chunk            (G_t = sum_{s <= t} g_s)

Tokens past a sequence's end load as q = k = v = g = beta = 0 (their G equals the last real G, so Gl is the
same as at the last real token; their X rows are set to identity rows, their u, w, du rows vanish).

16-token tiles (``chunk_size=16``), four kernels:

1. ``_bwd_prep_kernel`` (parallel over (chunk, head)): X, w = X B1, Aqk, and the post-activation kd, qg, beta
   and e^Gl stored (fp32; 16 + 3 K + 17 floats per token-head), so the two sequential kernels load their
   tiles instead of redoing the preprocessing, cumsum and exps on their critical path.
2. ``_bwd_state_kernel`` (sequential over chunks, parallel over (sequence, head, V-block)): recomputes S_in
   of every chunk and stores it in ``h`` [NT, H, K, V] (``state_dtype``, fp32 default), and the u it computes
   for the carry anyway (fp32 [B, T, H, V]).
3. ``_bwd_dstate_kernel`` (reverse sequential, same grid): carries dS (fp32, starting at dht or 0), stores
   dS_out of every chunk in ``dh``, dh0 = dS at the start, and du (fp32 [B, T, H, V], also on its chain).
4. ``_bwd_chunk_kernel`` (parallel over (chunk, head)): loads u and du instead of redoing four of its eleven
   [16, K] x [K, BV] products, loops over V-blocks, accumulating the sums over V
   (dqg, dAqk, dw, dX, dkd, dGl, dbeta) in [C, K] / [C, C] registers, so no V-partials and no atomics are
   needed (deterministic), then goes down through X to dq, dk, dg, dbeta and through the preprocessing to the
   raw inputs; dv is written per V-block.

64-token chunks (``chunk_size=64``, the default; same maths with C = 64, X and the products through it taken as
whole [64, 64] tiles, ``Xb = X diag(beta)``, so dXb = du v^T + dw kg^T, dv = Xb^T du, dkg = Xb^T dw,
dX = dXb diag(beta), dbeta gains colsum(dXb * X)):

1. the forward's own 64-token kernels recompute w, u0, qg, kd, Aqk, G_last, h (bf16 for bf16 inputs) and u,
   keeping X and the normalised strict Akk as well (``triton_chunk._recompute_for_backward``); or all of these
   come from a forward that kept them (``kept``);
2. ``_bwd64_dstate_kernel``: the reverse carry above over 64-token chunks (dh, du);
3. ``_bwd64_inter_kernel``, parallel over (chunk, head, K-block + 1), a chunk's K-blocks side by side: the sums
   over V and the inter-chunk gradients in fp32 scratch, Xb's gradient as per-program partials (deterministic, no
   atomics);
4. ``_bwd64_ut_kernel``, parallel over (chunk, head): the UT inverse's backward (dA to fp32 scratch, dbeta);
5. ``_bwd64_intra_kernel``, parallel over (K slice, chunk, head): the intra-chunk products dAqk -> dq, dk and
   dA -> dk as batches of four [16, 64] x [64, BC] dots, one per 16-row sub-tile, each around a reference inside
   its sub-tile (G spans (-320, 0] over a 64-chunk, so e^{G_i - G_j} must be split), then dg (the whole chunk's
   rows are in the program, so the reverse cumsum is local) and the gate's backward;
6. ``_bwd64_l2_kernel`` (with the in-kernel L2 norm): the norms' backward, from the intra kernel's per-slice row
   sums.

Measured on the H200 at T = 8K, H = 96, K = V = 128 (BENCHMARKS.md, tenth session): 14.6 ms forward + backward
against 17.0 for the 16-token path, within 7e-3 of autograd through the fp32 reference at T = 300 (as the
16-token path). Its bounds: the intra kernel (4.0 ms), the inter kernel (3.6 ms) and the forward recompute.

Precision: every tile is loaded into fp32 (so the Triton interpreter's bf16-dot problem does not arise);
products are exact fp32 ("ieee") for fp32 inputs and tf32 for bf16 inputs, except the small products with X
(always "ieee"). The carried dS is fp32. The stored per-chunk h and dh are bf16 for bf16 inputs (as the
forward's h and fla's; 19.1 -> 17.1 ms forward + backward at T = 8K on the H200, gradients within ~3-5e-3 of
the fp32 reference at T = 65) and fp32 for fp32 inputs; ``state_dtype`` overrides. Memory: h and dh are
NT * H * K * V each (NT = number of chunks): ~1.6 GB each in bf16 at T = 32K, H = 96, K = V = 128 with
64-token chunks, 6.4 GB with 16-token ones; u and du 1.6 GB each there in fp32 (the 16-token path), 0.8 GB each
in the 64-token path, which keeps them in bf16 for bf16 inputs. The 64-token path's fp32 scratch of
the parallel kernels (dq, dk, dG partials 1.2 GB, Xb's partials 1.0 GB, one per inter program of a (chunk, head),
dAqk and dA 0.2 GB each) is about 2.6 GB at T = 8K there, 4x that at 32K.

Registers of the 16-token path (compiled ahead of time for sm_90a with triton 3.6, ptxas -v, K = V = 128,
tf32): the sequential kernels at block_v = 32 and 4 warps spill <= 80 bytes; the per-chunk kernel at
chunk_block_v = 16 and 8 warps spills nothing, with 4 warps ~0.5-1 KB, yet 32 / 4 warps / 1 stage is the
fastest measured (fewer, larger V steps and more programs resident per SM outweigh the spill traffic). The
64-token intra kernel at its default (BC 32, 4 warps) uses 255 registers and spills ~0.5 KB; BC 16 spills
20 bytes and was slower (BENCHMARKS.md, tenth session). The fp32-input ("ieee") variants spill more; they serve
fp32 training and the tests, not the bf16 fast path. Timings on an H200: benchmarks/kda_chunk_bwd.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import reference as _ref
from .triton_chunk import (_beta_of, _bias_cols, _chunk_of, _exp, _ks_sub, _mm64, _recompute_for_backward, _rows_of,
                           _seq_of, _sigmoid, _state64_launch, _state_tile, check_gate_args)

__all__ = ["chunk_kda_bwd"]

_BT = 16
_MAX_STEP_DECAY = 5.0


@triton.jit
def _mm(a, b, TF32: tl.constexpr):
    if TF32:
        return tl.dot(a, b, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _gate_params(A_log, dt_bias, i_h, K: tl.constexpr, USE_GATE: tl.constexpr):
    """exp(A_log[h]) and dt_bias[h] [K] of the in-kernel gate (placeholders without it)."""
    a_h = 0.0
    bias = tl.zeros([K], dtype=tl.float32)
    if USE_GATE:
        a_h = _exp(tl.load(A_log + i_h).to(tl.float32))
        bias = tl.load(dt_bias + i_h * K + tl.arange(0, K)).to(tl.float32)
    return a_h, bias


@triton.jit
def _load_chunk_qkg(q, k, g, beta, rows, m_t, i_h, scale, a_h, bias, lower_bound,
                    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                    USE_GATE: tl.constexpr, USE_BSIG: tl.constexpr, USE_L2: tl.constexpr):
    """Loads one chunk's q, k, g, beta (fp32, zero past the end), applies the in-kernel preprocessing the forward
    applied (L2 norm of q and k, gate from z, beta sigmoid) and builds the decayed tiles. Also returns the
    inverse norms rq, rk [BT] (ones without the L2 norm) for the norm's backward."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    p_qk = (rows[:, None] * H + i_h) * K + o_k[None, :]
    m_qk = m_t[:, None]
    b_q = tl.load(q + p_qk, mask=m_qk, other=0.0).to(tl.float32)
    b_k = tl.load(k + p_qk, mask=m_qk, other=0.0).to(tl.float32)
    rq = tl.full([BT], 1.0, dtype=tl.float32)
    rk = tl.full([BT], 1.0, dtype=tl.float32)
    if USE_L2:
        # the same formula as the forward kernel and reference.l2norm: x / sqrt(sum x^2 + 1e-6)
        rq = 1.0 / tl.sqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)
        rk = 1.0 / tl.sqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)
        b_q = b_q * rq[:, None]
        b_k = b_k * rk[:, None]
    b_g = tl.load(g + p_qk, mask=m_qk, other=0.0).to(tl.float32)
    if USE_GATE:
        b_g = tl.where(m_qk, lower_bound * _sigmoid(a_h * (b_g + bias[None, :])), 0.0)
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    if USE_BSIG:
        b_beta = tl.where(m_t, _sigmoid(b_beta), 0.0)
    gc = tl.cumsum(b_g, axis=0)  # [BT, K] in (-80, 0]
    g_last = tl.sum(tl.where(o_t[:, None] == BT - 1, gc, 0.0), axis=0)  # [K]
    kg = b_k * _exp(gc)
    kn = b_k * _exp(-gc)
    qg = b_q * scale * _exp(gc)
    kd = b_k * _exp(g_last[None, :] - gc)
    return b_q, b_k, b_beta, gc, g_last, kg, kn, qg, kd, rq, rk


@triton.jit
def _bwd_prep_kernel(
    q, k, g, beta, cu_seqlens, chunk_indices, X_buf, w_buf, Aqk_buf, kd_buf, qg_buf, gl_buf, b_buf, scale,
    A_log, dt_bias, lower_bound,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, TF32: tl.constexpr,
    USE_GATE: tl.constexpr, USE_BSIG: tl.constexpr, USE_L2: tl.constexpr,
):
    """Per (chunk, head), fully parallel: the S-independent tiles the other kernels reuse (X, w, Aqk, and the
    post-activation kd, qg, e^Gl, beta, so the two sequential kernels do no preprocessing, cumsum or exp on
    their critical path)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, L, i_t = _chunk_of(cu_seqlens, chunk_indices, i_c, 0, 0, True)
    rows, m_t = _rows_of(bos, L, i_t * BT, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    a_h, bias = _gate_params(A_log, dt_bias, i_h, K, USE_GATE)
    b_q, b_k, b_beta, gc, g_last, kg, kn, qg, kd, rq, rk = _load_chunk_qkg(
        q, k, g, beta, rows, m_t, i_h, scale, a_h, bias, lower_bound, H, K, BT, USE_GATE, USE_BSIG, USE_L2)
    strict = o_t[:, None] > o_t[None, :]
    causal = o_t[:, None] >= o_t[None, :]
    A = tl.where(strict, _mm(kg, tl.trans(kn), TF32), 0.0)
    Aqk = tl.where(causal, _mm(qg, tl.trans(kn), TF32), 0.0)
    # X = (I + diag(beta) A)^-1 by forward substitution (as in the forward kernel): row i of X is
    # e_i - sum_{j<i} beta_i A_ij X_j.
    Mn = -b_beta[:, None] * A
    X = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    for i in tl.static_range(1, BT):
        m_i = tl.sum(tl.where(o_t[:, None] == i, Mn, 0.0), axis=0)
        x_i = tl.sum(m_i[:, None] * X, axis=0) + tl.where(o_t == i, 1.0, 0.0)
        X = tl.where(o_t[:, None] == i, x_i[None, :], X)
    w = tl.dot(X, b_beta[:, None] * kg, input_precision="ieee")  # [BT, K]
    p_cc = (rows[:, None] * H + i_h) * BT + o_t[None, :]
    p_qk = (rows[:, None] * H + i_h) * K + o_k[None, :]
    tl.store(X_buf + p_cc, X, mask=m_t[:, None])
    tl.store(Aqk_buf + p_cc, Aqk, mask=m_t[:, None])
    tl.store(w_buf + p_qk, w, mask=m_t[:, None])
    tl.store(kd_buf + p_qk, kd, mask=m_t[:, None])
    tl.store(qg_buf + p_qk, qg, mask=m_t[:, None])
    tl.store(b_buf + rows * H + i_h, b_beta, mask=m_t)
    tl.store(gl_buf + (i_c.to(tl.int64) * H + i_h) * K + o_k, _exp(g_last))


@triton.jit
def _load_X(X_buf, rows, m_t, i_h, H: tl.constexpr, BT: tl.constexpr):
    o_t = tl.arange(0, BT)
    p_cc = (rows[:, None] * H + i_h) * BT + o_t[None, :]
    X = tl.load(X_buf + p_cc, mask=m_t[:, None], other=0.0)
    # rows past the end: identity rows (beta = 0 there), so X stays the exact inverse of M
    return tl.where(m_t[:, None], X, tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0))


@triton.jit
def _bwd_state_kernel(
    v, h0, h, u_buf, cu_seqlens, chunk_offsets, X_buf, w_buf, kd_buf, gl_buf, b_buf,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, TF32: tl.constexpr,
):
    """Recomputes S_in of every chunk of one (sequence, head, V-block) and stores it in h, and u = X B2 - w S_in
    (the per-chunk kernel's input; it is on this kernel's chain anyway)."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    bos, L, c0 = _seq_of(cu_seqlens, chunk_offsets, i_n, 0, 0, True)
    o_k, o_v, p_state, S = _state_tile(h0, i_n, i_h, i_v, USE_H0, H, K, V, BV)
    for i_c in range(0, tl.cdiv(L, BT)):
        rows, m_t = _rows_of(bos, L, i_c * BT, BT)
        p_h = (((c0 + i_c) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        tl.store(h + p_h, S.to(h.dtype.element_ty))
        X = _load_X(X_buf, rows, m_t, i_h, H, BT)
        p_qk = (rows[:, None] * H + i_h) * K + o_k[None, :]
        w = tl.load(w_buf + p_qk, mask=m_t[:, None], other=0.0)
        kd = tl.load(kd_buf + p_qk, mask=m_t[:, None], other=0.0)
        e_gl = tl.load(gl_buf + ((c0 + i_c) * H + i_h) * K + o_k)
        b_beta = tl.load(b_buf + rows * H + i_h, mask=m_t, other=0.0)
        p_v = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_t[:, None], other=0.0).to(tl.float32)
        u = tl.dot(X, b_beta[:, None] * b_v, input_precision="ieee") - _mm(w, S, TF32)  # [BT, BV]
        tl.store(u_buf + p_v, u, mask=m_t[:, None])
        S = S * e_gl[:, None] + _mm(tl.trans(kd), u, TF32)


@triton.jit
def _bwd_dstate_kernel(
    do, dht, dh, dh0, du_buf, cu_seqlens, chunk_offsets, w_buf, Aqk_buf, kd_buf, qg_buf, gl_buf,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, TF32: tl.constexpr,
):
    """Carries dS backwards over the chunks of one (sequence, head, V-block); stores dS_out per chunk and
    du = Aqk^T do + kd dS_out (computed here for the carry anyway; the per-chunk kernel loads it)."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    bos, L, c0 = _seq_of(cu_seqlens, chunk_offsets, i_n, 0, 0, True)
    NT = tl.cdiv(L, BT)
    o_t = tl.arange(0, BT)
    o_k, o_v, p_state, dS = _state_tile(dht, i_n, i_h, i_v, USE_DHT, H, K, V, BV)
    for i_r in range(0, NT):
        i_c = NT - 1 - i_r
        rows, m_t = _rows_of(bos, L, i_c * BT, BT)
        p_h = (((c0 + i_c) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        tl.store(dh + p_h, dS.to(dh.dtype.element_ty))
        p_cc = (rows[:, None] * H + i_h) * BT + o_t[None, :]
        Aqk = tl.load(Aqk_buf + p_cc, mask=m_t[:, None], other=0.0)
        p_qk = (rows[:, None] * H + i_h) * K + o_k[None, :]
        w = tl.load(w_buf + p_qk, mask=m_t[:, None], other=0.0)
        kd = tl.load(kd_buf + p_qk, mask=m_t[:, None], other=0.0)
        qg = tl.load(qg_buf + p_qk, mask=m_t[:, None], other=0.0)
        e_gl = tl.load(gl_buf + ((c0 + i_c) * H + i_h) * K + o_k)
        p_v = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_do = tl.load(do + p_v, mask=m_t[:, None], other=0.0).to(tl.float32)
        du = _mm(tl.trans(Aqk), b_do, TF32) + _mm(kd, dS, TF32)  # [BT, BV]
        tl.store(du_buf + p_v, du, mask=m_t[:, None])
        dS = dS * e_gl[:, None] + _mm(tl.trans(qg), b_do, TF32) - _mm(tl.trans(w), du, TF32)
    if STORE_DH0:
        tl.store(dh0 + p_state, dS)


@triton.jit
def _bwd_chunk_kernel(
    q, k, v, g, beta, do, h, dh, u_buf, du_buf, cu_seqlens, chunk_indices, X_buf, b_buf,
    dq, dk, dv, dg, dbeta, ddt_part, dA_part, scale, A_log, dt_bias, lower_bound,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    TF32: tl.constexpr, USE_GATE: tl.constexpr, USE_BSIG: tl.constexpr, USE_L2: tl.constexpr,
):
    """All local gradients of one (chunk, head), from S_in = h[c] and dS_out = dh[c], taken back through the
    in-kernel preprocessing to the raw inputs (dt_bias / A_log as per-(chunk, head) partial sums)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    bos, L, i_t = _chunk_of(cu_seqlens, chunk_indices, i_c, 0, 0, True)
    rows, m_t = _rows_of(bos, L, i_t * BT, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    strict = o_t[:, None] > o_t[None, :]
    causal = o_t[:, None] >= o_t[None, :]
    # u and du come from the sequential kernels (they compute them on their chains anyway), so only X and beta
    # are needed inside the V loop; the [BT, K] tiles are rebuilt after it (fewer live registers across the loop)
    X = _load_X(X_buf, rows, m_t, i_h, H, BT)
    p_qk = (rows[:, None] * H + i_h) * K + o_k[None, :]
    b_beta = tl.load(b_buf + rows * H + i_h, mask=m_t, other=0.0)

    # sums over V, accumulated block by block
    dqg = tl.zeros([BT, K], dtype=tl.float32)
    dw = tl.zeros([BT, K], dtype=tl.float32)
    dkd = tl.zeros([BT, K], dtype=tl.float32)
    dAqk = tl.zeros([BT, BT], dtype=tl.float32)
    dX = tl.zeros([BT, BT], dtype=tl.float32)
    dGl = tl.zeros([K], dtype=tl.float32)
    db = tl.zeros([BT], dtype=tl.float32)
    i_ch = i_c.to(tl.int64)
    for i_v in range(0, V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        p_h = ((i_ch * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
        S = tl.load(h + p_h).to(tl.float32)  # [K, BV]
        dS = tl.load(dh + p_h).to(tl.float32)  # [K, BV]
        p_v = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_do = tl.load(do + p_v, mask=m_t[:, None], other=0.0).to(tl.float32)
        bv = b_beta[:, None] * b_v  # B2 block [BT, BV]
        u = tl.load(u_buf + p_v, mask=m_t[:, None], other=0.0)  # X B2 - w S_in
        du = tl.load(du_buf + p_v, mask=m_t[:, None], other=0.0)  # Aqk^T do + kd dS_out
        dqg += _mm(b_do, tl.trans(S), TF32)
        dAqk += _mm(b_do, tl.trans(u), TF32)
        dw -= _mm(du, tl.trans(S), TF32)
        dX += _mm(du, tl.trans(bv), TF32)
        dkd += _mm(u, tl.trans(dS), TF32)
        dGl += tl.sum(S * dS, axis=1)
        dB2 = tl.dot(tl.trans(X), du, input_precision="ieee")  # [BT, BV]
        tl.store(dv + p_v, (b_beta[:, None] * dB2).to(dv.dtype.element_ty), mask=m_t[:, None])
        db += tl.sum(dB2 * b_v, axis=1)

    a_h, bias = _gate_params(A_log, dt_bias, i_h, K, USE_GATE)
    b_q, b_k, b_beta, gc, g_last, kg, kn, qg, kd, rq, rk = _load_chunk_qkg(
        q, k, g, beta, rows, m_t, i_h, scale, a_h, bias, lower_bound, H, K, BT, USE_GATE, USE_BSIG, USE_L2)
    # each gradient is finished as soon as its inputs are, so fewer [BT, K] tiles are live at once
    dAqk = tl.where(causal, dAqk, 0.0)
    dqg += _mm(dAqk, kn, TF32)
    dkn = _mm(tl.trans(dAqk), qg, TF32)
    b_dq = scale * _exp(gc) * dqg  # w.r.t. the normalised q
    if USE_L2:
        # q = x r with r = 1 / |x|: dx = r (dq - q <dq, q>)
        b_dq = (b_dq - b_q * tl.sum(b_dq * b_q, axis=1)[:, None]) * rq[:, None]
    tl.store(dq + p_qk, b_dq.to(dq.dtype.element_ty), mask=m_t[:, None])
    # dG: each factor's derivative in G (qg, kg ~ e^G; kn ~ e^-G; kd ~ e^(Gl - G))
    dG = qg * dqg - kd * dkd
    b_dk = _exp(g_last[None, :] - gc) * dkd
    dGl = dGl * _exp(g_last) + tl.sum(kd * dkd, axis=0)
    B1 = b_beta[:, None] * kg
    dX += _mm(dw, tl.trans(B1), TF32)
    dB1 = tl.dot(tl.trans(X), dw, input_precision="ieee")
    dkg = b_beta[:, None] * dB1
    db += tl.sum(dB1 * kg, axis=1)
    # dM = -X^T dX X^T; only its strictly lower part reaches A (M = I + diag(beta) strict(A))
    dM = -tl.dot(tl.dot(tl.trans(X), dX, input_precision="ieee"), tl.trans(X), input_precision="ieee")
    A = tl.where(strict, _mm(kg, tl.trans(kn), TF32), 0.0)
    db += tl.sum(tl.where(strict, dM * A, 0.0), axis=1)
    dA = tl.where(strict, b_beta[:, None] * dM, 0.0)
    dkg += _mm(dA, kn, TF32)
    dkn += _mm(tl.trans(dA), kg, TF32)
    b_dk += _exp(gc) * dkg + _exp(-gc) * dkn
    dG += kg * dkg - kn * dkn
    dG += tl.where(o_t[:, None] == BT - 1, dGl[None, :], 0.0)
    # dg_t = sum_{s >= t} dG_s (reverse cumsum) since G_t = sum_{s <= t} g_s
    b_dg = tl.sum(dG, axis=0)[None, :] - tl.cumsum(dG, axis=0) + dG
    if USE_L2:
        b_dk = (b_dk - b_k * tl.sum(b_dk * b_k, axis=1)[:, None]) * rk[:, None]
    tl.store(dk + p_qk, b_dk.to(dk.dtype.element_ty), mask=m_t[:, None])
    if USE_GATE:
        # g = lb * sigmoid(a x), x = z + dt_bias, a = exp(A_log): dz = dg lb s (1 - s) a = d dt_bias,
        # dA_log = sum dz x (da / dA_log = a)
        x = tl.load(g + p_qk, mask=m_t[:, None], other=0.0).to(tl.float32) + bias[None, :]
        sg = _sigmoid(a_h * x)
        b_dg = tl.where(m_t[:, None], b_dg * (lower_bound * a_h) * sg * (1.0 - sg), 0.0)
        tl.store(ddt_part + (i_ch * H + i_h) * K + o_k, tl.sum(b_dg, axis=0))
        tl.store(dA_part + i_ch * H + i_h, tl.sum(tl.sum(b_dg * x, axis=1), axis=0))
    tl.store(dg + p_qk, b_dg.to(dg.dtype.element_ty), mask=m_t[:, None])
    if USE_BSIG:
        db = db * b_beta * (1.0 - b_beta)
    tl.store(dbeta + rows * H + i_h, db.to(dbeta.dtype.element_ty), mask=m_t)


# --------------------------------------------------------------------------------------------------------------- #
# 64-token chunks
# --------------------------------------------------------------------------------------------------------------- #
@triton.jit
def _bwd64_dstate_kernel(
    do, dht, dh, dh0, du_buf, cu_seqlens, chunk_offsets, w_buf, Aqk_buf, kd_buf, qg_buf, gl_buf, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DOT: tl.constexpr,
):
    """Per (sequence, head, V-block), backwards over the 64-token chunks: stores dS_out of every chunk in dh and
    du = Aqk^T do + kd dS_out (bf16 for bf16 inputs, see ``_chunk_kda_bwd64``), and carries
    dS_in = e^{G_last} dS_out + qg^T do - w^T du (fp32 registers).
    Loads the forward recompute's buffers (G_last raw, so it is exponentiated here); the products take the
    forward state kernel's operand mode (bf16 for bf16 inputs, as fla)."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    bos, L, c0 = _seq_of(cu_seqlens, chunk_offsets, i_n, T, NT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    # As the forward's state kernel, the loop carries the transpose, dS^T [BV, K], and forms every product
    # transposed: du^T = do^T Aqk + dS^T kd^T, dS^T <- dS^T e^{G_last} + do^T qg - du^T w. The left operands
    # (dS^T, du^T, do^T) are in registers and the right ones are the chunk's tiles as loaded (kd^T a transposed
    # view), so nothing on the dependent chain goes through shared memory.
    o_k, o_v, p_state_t, dSt = _state_tile(dht, i_n, i_h, i_v, USE_DHT, H, K, V, BV, TRANS=True)
    n_t = tl.cdiv(L, BT)
    for i_r in range(0, n_t):
        i_c = n_t - 1 - i_r
        pos = i_c * BT + o_t
        m2 = (pos < L)[:, None]
        mT = (pos < L)[None, :]
        rows = bos + pos
        p_h = (((c0 + i_c) * H + i_h) * K + o_k[None, :]) * V + o_v[:, None]
        tl.store(dh + p_h, dSt.to(dh.dtype.element_ty))
        b_A = tl.load(Aqk_buf + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=m2, other=0.0)  # [i, j]
        b_A = tl.where(o_t[:, None] >= o_t[None, :], b_A, 0.0)  # causal
        p_k = (rows[:, None] * H + i_h) * K + o_k[None, :]
        b_w = tl.load(w_buf + p_k, mask=m2, other=0.0)  # [BT, K]
        b_qg = tl.load(qg_buf + p_k, mask=m2, other=0.0)
        b_kd = tl.load(kd_buf + p_k, mask=m2, other=0.0)
        e_gl = _exp(tl.load(gl_buf + ((c0 + i_c) * H + i_h) * K + o_k))
        p_vt = (rows[None, :] * H + i_h) * V + o_v[:, None]  # [BV, BT]
        b_dot = tl.load(do + p_vt, mask=mT, other=0.0)  # do^T
        dut = _mm64(b_dot, b_A, DOT) + _mm64(dSt, tl.trans(b_kd), DOT)  # du^T [BV, BT]
        tl.store(du_buf + p_vt, dut, mask=mT)
        dSt = dSt * e_gl[None, :] + _mm64(b_dot, b_qg, DOT) - _mm64(dut, b_w, DOT)
    if STORE_DH0:
        tl.store(dh0 + p_state_t, dSt)


@triton.jit
def _chunk64_rows(cu_seqlens, chunk_indices, i_c, i_h, T, NT, H: tl.constexpr, BT: tl.constexpr,
                  IS_VARLEN: tl.constexpr):
    """Rows (flat token index, in-sequence mask) of global 64-chunk i_c, the [BT, BT] offsets and the chunk-head
    index."""
    bos, L, i_t = _chunk_of(cu_seqlens, chunk_indices, i_c, T, NT, IS_VARLEN)
    rows, m_t = _rows_of(bos, L, i_t * BT, BT)
    o_t = tl.arange(0, BT)
    return rows, m_t, o_t, o_t[:, None] * BT + o_t[None, :], (i_c * H + i_h).to(tl.int64)


@triton.jit
def _load_X64(X_buf, cid, o_t, p_cc, BT: tl.constexpr):
    # the chunk's UT inverse X, block lower triangular: the blocks above the 16-row diagonal ones were never written
    return tl.load(X_buf + cid * (BT * BT) + p_cc, mask=(o_t[:, None] // 16) >= (o_t[None, :] // 16), other=0.0)


@triton.jit
def _bwd64_inter_kernel(
    q, k, v, g, beta, do, h, dh, u_buf, du_buf, X_buf, r_buf, cu_seqlens, chunk_indices, A_log, dt_bias,
    dv, dAqk_buf, dXb_part, dq_part, dk_part, dG_part, dGl_buf, lower_bound, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NK: tl.constexpr, IS_VARLEN: tl.constexpr, USE_GATE: tl.constexpr, USE_BSIG: tl.constexpr,
    DOT: tl.constexpr, XDOT: tl.constexpr,
):
    """Per (64-chunk, head, program p): the sums over V of the chunk's gradient, from S_in = h[c], dS_out = dh[c],
    u, du and do. Programs p < NK take the K-block p: dqg = do S^T, dw = -du S^T, dkd = u dS_out^T and
    dGl, then, with w = Xb kg: dkg = Xb^T dw and Xb's partial gradient dw kg^T, and store the inter-chunk parts
    of the gradients with respect to qt = s q / |q|, kh = k / |k| and G (fp32 scratch). Program NK takes what
    does not depend on K: dAqk = do u^T, Xb's partial gradient du v^T, and dv = Xb^T du. Xb = X diag(beta) is
    loaded where it is used (after the V loop for p < NK), so it does not hold registers across the loop."""
    # program-major grid: the NK + 1 programs of a (chunk, head) run side by side, so do, u and du, which each of
    # them reads, come from HBM once (chunk-major they were 12,288 launches apart at T = 8K, H = 96, and each read
    # them from HBM: 3469 -> 3213 us on the H200 at BK 64). Program and chunk share grid axis 0, which has no
    # 65,535 limit.
    i_p = tl.program_id(0) % (NK + 1)
    i_c = tl.program_id(0) // (NK + 1)
    i_h = tl.program_id(1)
    n_chunks = tl.num_programs(0) // (NK + 1)
    rows, m_t, o_t, p_cc, cid = _chunk64_rows(cu_seqlens, chunk_indices, i_c, i_h, T, NT, H, BT, IS_VARLEN)
    m2 = m_t[:, None]
    p_part = dXb_part + (i_p * n_chunks * H + cid) * (BT * BT) + p_cc
    if i_p == NK:
        Xb = _load_X64(X_buf, cid, o_t, p_cc, BT) * _beta_of(beta, rows, m_t, i_h, H, USE_BSIG)[None, :]
        dA = tl.zeros([BT, BT], dtype=tl.float32)
        dXv = tl.zeros([BT, BT], dtype=tl.float32)
        for vv in range(0, V, BV):
            p_v = (rows[:, None] * H + i_h) * V + vv + tl.arange(0, BV)[None, :]
            b_do = tl.load(do + p_v, mask=m2, other=0.0)
            b_u = tl.load(u_buf + p_v, mask=m2, other=0.0)
            b_du = tl.load(du_buf + p_v, mask=m2, other=0.0)
            b_v = tl.load(v + p_v, mask=m2, other=0.0)
            dA += _mm64(b_do, tl.trans(b_u), DOT)
            dXv += _mm64(b_du, tl.trans(b_v), DOT)
            tl.store(dv + p_v, _mm64(tl.trans(Xb), b_du, XDOT).to(dv.dtype.element_ty), mask=m2)
        tl.store(dAqk_buf + (rows[:, None] * H + i_h) * BT + o_t[None, :],
                 tl.where(o_t[:, None] >= o_t[None, :], dA, 0.0), mask=m2)
        tl.store(p_part, dXv)
    else:
        o_k = i_p * BK + tl.arange(0, BK)
        h_base = cid * K * V
        dqg = tl.zeros([BT, BK], dtype=tl.float32)
        dw = tl.zeros([BT, BK], dtype=tl.float32)
        dkd = tl.zeros([BT, BK], dtype=tl.float32)
        dgl = tl.zeros([BK], dtype=tl.float32)
        for vv in range(0, V, BV):
            o_v = vv + tl.arange(0, BV)
            p_h = h_base + o_k[:, None] * V + o_v[None, :]
            b_S = tl.load(h + p_h)  # [BK, BV]
            b_dS = tl.load(dh + p_h)
            p_v = (rows[:, None] * H + i_h) * V + o_v[None, :]
            b_do = tl.load(do + p_v, mask=m2, other=0.0)
            b_u = tl.load(u_buf + p_v, mask=m2, other=0.0)
            b_du = tl.load(du_buf + p_v, mask=m2, other=0.0)
            dqg += _mm64(b_do, tl.trans(b_S), DOT)
            dw -= _mm64(b_du, tl.trans(b_S), DOT)
            dkd += _mm64(b_u, tl.trans(b_dS), DOT)
            dgl += tl.sum(b_S.to(tl.float32) * b_dS.to(tl.float32), axis=1)
        # the chunk's factors for this K-block: G over the whole chunk lies in (-320, 0], so only e^G and
        # e^{G_last - G} (both <= 1) are formed
        a_h = 0.0
        if USE_GATE:
            a_h = _exp(tl.load(A_log + i_h).to(tl.float32))
        bias = _bias_cols(dt_bias, i_h, o_k, K, USE_GATE)
        b_q, b_k, G, gl = _ks_sub(q, k, g, rows, m_t, i_h, o_k, a_h, bias, lower_bound,
                                  tl.zeros([BK], dtype=tl.float32), H, K, BT, USE_GATE)
        qt = b_q * tl.load(r_buf + (rows * H + i_h) * 2, mask=m_t, other=0.0)[:, None]
        kh = b_k * tl.load(r_buf + (rows * H + i_h) * 2 + 1, mask=m_t, other=0.0)[:, None]
        eG = _exp(G)
        ed = _exp(gl[None, :] - G)
        kg = kh * eG
        qg = qt * eG
        kd = kh * ed
        Xb = _load_X64(X_buf, cid, o_t, p_cc, BT) * _beta_of(beta, rows, m_t, i_h, H, USE_BSIG)[None, :]
        dkg = _mm64(tl.trans(Xb), dw, XDOT)
        tl.store(p_part, _mm64(dw, tl.trans(kg), XDOT))
        p = (rows[:, None] * H + i_h) * K + o_k[None, :]
        tl.store(dq_part + p, eG * dqg, mask=m2)
        tl.store(dk_part + p, eG * dkg + ed * dkd, mask=m2)
        tl.store(dG_part + p, qg * dqg + kg * dkg - kd * dkd, mask=m2)
        tl.store(dGl_buf + cid * K + o_k, _exp(gl) * dgl + tl.sum(kd * dkd, axis=0))


@triton.jit
def _bwd64_ut_kernel(
    beta, X_buf, Akk_buf, dXb_part, dA_buf, dbeta, cu_seqlens, chunk_indices, T, NT,
    H: tl.constexpr, BT: tl.constexpr, NK: tl.constexpr, IS_VARLEN: tl.constexpr, USE_BSIG: tl.constexpr,
    XDOT: tl.constexpr,
):
    """Per (64-chunk, head): down through the UT inverse, dXb (the inter kernel's NK + 1 partials) -> dX -> dM ->
    dA = strict(diag(beta) dM) and dbeta. dA goes to chunk-major fp32 scratch [chunks, H, 64, 64], read by
    blocks of 16 rows and of 16 columns by the intra kernel."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    n_chunks = tl.num_programs(0)
    rows, m_t, o_t, p_cc, cid = _chunk64_rows(cu_seqlens, chunk_indices, i_c, i_h, T, NT, H, BT, IS_VARLEN)
    X = _load_X64(X_buf, cid, o_t, p_cc, BT)
    strict = o_t[:, None] > o_t[None, :]
    b_beta = _beta_of(beta, rows, m_t, i_h, H, USE_BSIG)
    Akk = tl.load(Akk_buf + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=m_t[:, None], other=0.0)
    dXb = tl.zeros([BT, BT], dtype=tl.float32)
    for i_p in tl.static_range(NK + 1):
        dXb += tl.load(dXb_part + (i_p * n_chunks * H + cid) * (BT * BT) + p_cc)
    # Xb = X diag(beta); X = M^-1 with M = I + diag(beta) strict(Akk): dM = -X^T dX X^T
    db = tl.sum(dXb * X, axis=0)
    dM = -_mm64(_mm64(tl.trans(X), dXb * b_beta[None, :], XDOT), tl.trans(X), XDOT)
    db += tl.sum(tl.where(strict, dM * Akk, 0.0), axis=1)
    tl.store(dA_buf + cid * (BT * BT) + p_cc, tl.where(strict, b_beta[:, None] * dM, 0.0))
    if USE_BSIG:
        db = db * b_beta * (1.0 - b_beta)
    tl.store(dbeta + rows * H + i_h, db.to(dbeta.dtype.element_ty), mask=m_t)


@triton.jit
def _bwd64_intra_kernel(
    q, k, g, r_buf, dAqk_buf, dA_buf, dq_part, dk_part, dG_part, dGl_buf, cu_seqlens, chunk_indices, A_log,
    dt_bias, dq, dk, dg, ddt_part, dA_part, row_part, lower_bound, scale, T, NT,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_GATE: tl.constexpr, USE_L2: tl.constexpr, XDOT: tl.constexpr,
):
    """Per (K slice of BC channels, 64-chunk, head): the intra-chunk products dAqk -> (dqt, dkh) and dA -> dkh,
    batched over the four 16-row sub-tiles I; adds the inter-chunk parts, takes dG to dg (reverse cumsum over the
    chunk, G_last's gradient, the in-kernel gate) and stores dqt, dkh with their per-slice row sums for the L2 norms'
    backward (``_bwd64_l2_kernel``), or dq, dk directly without the in-kernel norm.

    G spans (-320, 0] over a 64-chunk, so e^{G_i - G_j} is split around a reference on the sub-tile's side:
    - rows i of sub-tile I against columns j of sub-tiles <= I: around r_I = G at the end of sub-tile I - 1
      (0 for I = 0): e^{G_i - r_I} (exponent in [-80, 0]) and e^{r_I - G_j} (exponent in [0, 80] on sub-tile I,
      <= 0 before it);
    - columns j of sub-tile I against rows i of sub-tiles >= I: around e_I = G at the end of sub-tile I:
      e^{G_i - e_I} (exponent in [0, 75] on sub-tile I, <= 0 after it; an underflow there is below fp32 anyway)
      and e^{e_I - G_j} <= 1.
    So each product is a batch of four [16, 64] x [64, BC] dots: the sub-tiles' rows of dAqk / dA against the
    chunk's right factors, and their columns (loaded transposed) against the left ones; the causal / strict zeros
    of dAqk / dA and the -inf exponents outside the sub-tiles in range do the masking."""
    i_k = tl.program_id(0) % (K // BC)  # the slices of a chunk side by side on grid axis 0 (no 65,535 limit)
    i_c = tl.program_id(0) // (K // BC)
    i_h = tl.program_id(1)
    rows, m_t, o_t, _, cid = _chunk64_rows(cu_seqlens, chunk_indices, i_c, i_h, T, NT, H, BT, IS_VARLEN)
    m2 = m_t[:, None]
    o_c = i_k * BC + tl.arange(0, BC)
    a_h = 0.0
    if USE_GATE:
        a_h = _exp(tl.load(A_log + i_h).to(tl.float32))
    bias = _bias_cols(dt_bias, i_h, o_c, K, USE_GATE)
    b_q, b_k, G, _ = _ks_sub(q, k, g, rows, m_t, i_h, o_c, a_h, bias, lower_bound,
                             tl.zeros([BC], dtype=tl.float32), H, K, BT, USE_GATE)
    qt = b_q * tl.load(r_buf + (rows * H + i_h) * 2, mask=m_t, other=0.0)[:, None]  # s q / |q|
    kh = b_k * tl.load(r_buf + (rows * H + i_h) * 2 + 1, mask=m_t, other=0.0)[:, None]  # k / |k|
    # sub-tile views: [4, 16, .] = (sub-tile I, row in it)
    o4 = tl.arange(0, 4)
    o16 = tl.arange(0, 16)
    G3 = tl.reshape(G, (4, 16, BC))
    e3 = tl.sum(tl.where(o16[None, :, None] == 15, G3, 0.0), axis=1)  # [4, BC]: G at the end of each sub-tile
    r3 = tl.sum(tl.where(o4[:, None, None] == o4[None, :, None] + 1, e3[None, :, :], 0.0), axis=1)  # e_{I-1}
    blk = (o_t // 16)[None, :, None]  # sub-tile of chunk row j / i
    I3 = o4[:, None, None]
    R3 = kh[None, :, :] * _exp(tl.where(blk <= I3, r3[:, None, :] - G[None, :, :], float("-inf")))  # [4, 64, BC]
    Fc3 = _exp(tl.where(blk >= I3, G[None, :, :] - e3[:, None, :], float("-inf")))
    # the sub-tiles' rows of dAqk, dA ([4, 16, 64]) and their columns, transposed (entry (I, a, i) = d.[i, 16 I + a])
    c3 = (16 * o4[:, None, None] + o16[None, :, None])  # [4, 16, 1]: chunk position of (I, a)
    rows3 = tl.reshape(rows, (4, 16))
    m3 = tl.reshape(m_t, (4, 16))
    dAqk_r = tl.load(dAqk_buf + (rows3[:, :, None] * H + i_h) * BT + o_t[None, None, :], mask=m3[:, :, None], other=0.0)
    dAqk_c = tl.load(dAqk_buf + (rows[None, None, :] * H + i_h) * BT + c3, mask=m_t[None, None, :], other=0.0)
    dA_base = dA_buf + cid * (BT * BT)
    dA_r = tl.load(dA_base + c3 * BT + o_t[None, None, :])
    dA_c = tl.load(dA_base + o_t[None, None, :] * BT + c3)
    F3 = _exp(G3 - r3[:, None, :])
    dqi = tl.reshape(F3 * _mm64(dAqk_r, R3, XDOT), (BT, BC))
    dkr = tl.reshape(F3 * _mm64(dA_r, R3, XDOT), (BT, BC))
    dkc3 = _mm64(dAqk_c, qt[None, :, :] * Fc3, XDOT) + _mm64(dA_c, kh[None, :, :] * Fc3, XDOT)
    dkc = tl.reshape(_exp(e3[:, None, :] - G3) * dkc3, (BT, BC))
    p = (rows[:, None] * H + i_h) * K + o_c[None, :]
    dqt = tl.load(dq_part + p, mask=m2, other=0.0) + dqi
    dkh = tl.load(dk_part + p, mask=m2, other=0.0) + dkr + dkc
    dG = tl.load(dG_part + p, mask=m2, other=0.0) + qt * dqi + kh * (dkr - dkc)
    # dg_t = sum_{s >= t} dG_s + dG_last (G_t = sum_{s <= t} g_s; G_last sums every g of the chunk)
    b_dg = tl.sum(dG, axis=0)[None, :] - tl.cumsum(dG, axis=0) + dG + tl.load(dGl_buf + cid * K + o_c)[None, :]
    if USE_GATE:
        x = tl.load(g + p, mask=m2, other=0.0).to(tl.float32) + bias[None, :]
        sg = _sigmoid(a_h * x)
        b_dg = tl.where(m2, b_dg * (lower_bound * a_h) * sg * (1.0 - sg), 0.0)
        tl.store(ddt_part + cid * K + o_c, tl.sum(b_dg, axis=0))
        tl.store(dA_part + cid * (K // BC) + i_k, tl.sum(tl.sum(b_dg * x, axis=0), axis=0))
    tl.store(dg + p, b_dg.to(dg.dtype.element_ty), mask=m2)
    if USE_L2:
        tl.store(dq_part + p, dqt, mask=m2)
        tl.store(dk_part + p, dkh, mask=m2)
        p_row = ((rows * H + i_h) * (K // BC) + i_k) * 2
        tl.store(row_part + p_row, tl.sum(dqt * qt, axis=1), mask=m_t)
        tl.store(row_part + p_row + 1, tl.sum(dkh * kh, axis=1), mask=m_t)
    else:
        tl.store(dq + p, (scale * dqt).to(dq.dtype.element_ty), mask=m2)
        tl.store(dk + p, dkh.to(dk.dtype.element_ty), mask=m2)


@triton.jit
def _bwd64_l2_kernel(
    q, k, r_buf, dq_part, dk_part, row_part, dq, dk, cu_seqlens, chunk_indices, scale, T, NT,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Per (K slice, 64-chunk, head): back through the L2 norms, x_hat = x r with r = 1 / |x|:
    dx = r (dx_hat - x_hat <dx_hat, x_hat>), the row sums <dx_hat, x_hat> added up over the intra kernel's slices;
    qt = s q_hat."""
    i_k = tl.program_id(0) % (K // BC)  # the slices of a chunk side by side on grid axis 0 (no 65,535 limit)
    i_c = tl.program_id(0) // (K // BC)
    i_h = tl.program_id(1)
    rows, m_t, _, _, _ = _chunk64_rows(cu_seqlens, chunk_indices, i_c, i_h, T, NT, H, BT, IS_VARLEN)
    m2 = m_t[:, None]
    p_row = (rows * H + i_h) * (K // BC) * 2
    row_q = tl.zeros([BT], dtype=tl.float32)
    row_k = tl.zeros([BT], dtype=tl.float32)
    for j in tl.static_range(K // BC):
        row_q += tl.load(row_part + p_row + 2 * j, mask=m_t, other=0.0)
        row_k += tl.load(row_part + p_row + 2 * j + 1, mask=m_t, other=0.0)
    rq = tl.load(r_buf + (rows * H + i_h) * 2, mask=m_t, other=0.0) / scale  # 1 / |q|
    rk = tl.load(r_buf + (rows * H + i_h) * 2 + 1, mask=m_t, other=0.0)
    p = (rows[:, None] * H + i_h) * K + i_k * BC + tl.arange(0, BC)[None, :]
    b_q = tl.load(q + p, mask=m2, other=0.0).to(tl.float32)
    b_k = tl.load(k + p, mask=m2, other=0.0).to(tl.float32)
    b_dq = rq[:, None] * (scale * tl.load(dq_part + p, mask=m2, other=0.0) - b_q * rq[:, None] * row_q[:, None])
    b_dk = rk[:, None] * (tl.load(dk_part + p, mask=m2, other=0.0) - b_k * rk[:, None] * row_k[:, None])
    tl.store(dq + p, b_dq.to(dq.dtype.element_ty), mask=m2)
    tl.store(dk + p, b_dk.to(dk.dtype.element_ty), mask=m2)


def _is_pow2(n: int) -> bool:
    return n >= 16 and (n & (n - 1)) == 0


def chunk_kda_bwd(
    q, k, v, g, beta, do, scale=None, initial_state=None, dht=None, cu_seqlens=None,
    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=-5.0,
    use_beta_sigmoid_in_kernel=False,
    state_dtype=None, block_v=None, num_warps=None, chunk_block_v=None, chunk_num_warps=4,
    chunk_num_stages=1, check_gate=True, chunk_size=64, kept=None,
):
    """Gradients of the chunked KDA, through the same in-kernel preprocessing flags as the forward.

    q, k: [B, T, H, K]; v, do: [B, T, H, V]; g: fp32 log decay [B, T, H, K] with -5 <= g <= 0, or the raw gate
    input z when ``use_gate_in_kernel`` (``g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias))``);
    beta: [B, T, H] in (0, 1), or logits when ``use_beta_sigmoid_in_kernel``; ``use_qk_l2norm_in_kernel``:
    q and k are L2-normalised inside. initial_state, dht: [N, H, K, V] or None. ``state_dtype``: storage of
    the recomputed per-chunk states and state grads (fp32 or bf16; default bf16 for bf16 inputs, else fp32).
    ``chunk_size``: 64 (default, the fastest measured: 14.6 against 17.0 ms forward + backward at T = 8K, H = 96
    on the H200) or 16 (the 16-token path of the module docstring). With 64, ``block_v`` / ``num_warps`` (default
    min(V, 128) / 8 (4 below 128) for bf16 inputs, 32 / 4 for fp32) apply to its sequential kernel and the parallel
    kernels take ``_INTER64`` / ``_INTRA64`` / ``_UT64_WARPS``. With 16: ``block_v`` / ``num_warps``: V tile and
    warps of the two sequential kernels and the prep kernel (default 32 / 2); ``chunk_block_v`` /
    ``chunk_num_warps``: those of the per-chunk gradient kernel (default 32 / 4), ``chunk_num_stages`` its
    V-loop pipelining depth (default 1; None: Triton's default). The 16-token defaults are the fastest of a
    sweep on the H200 at K = V = 128, T = 8K (BENCHMARKS.md, fifth session: 22.2 ms forward + backward, against
    33.7 with the earlier 32 / 4 and 16 / 8 / Triton-default stages). ``check_gate``: verify -5 <= g <= 0 for a
    precomputed g (one reduction and a host sync; ``_ChunkKDAFunction`` skips it, its forward has checked).
    ``kept``: the buffers of ``chunk_kda_fwd(..., keep_for_backward=True)`` on these inputs (64-token chunks), used
    instead of recomputing them (the same gradients).

    Returns (dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias): the gradients with respect to the inputs as
    given (dg is dz with the in-kernel gate, dbeta the logits' gradient with the in-kernel sigmoid), each in
    its input's dtype (computed in fp32, rounded once at the store); dh0 fp32, None without initial_state;
    dA_log fp32 [H] and ddt_bias fp32 [H * K] with the in-kernel gate, else None.
    """
    B, T, H, K, V, N = _ref._validate(q, k, v, g, beta, initial_state, cu_seqlens)
    if use_gate_in_kernel:
        check_gate_args(A_log, dt_bias, lower_bound, H, K)
    if not (_is_pow2(K) and _is_pow2(V)):
        raise ValueError(f"K and V must be powers of two >= 16 for the Triton kernel, got K={K}, V={V}")
    if tuple(do.shape) != (B, T, H, V):
        raise ValueError(f"do must be [B, T, H, V] = {[B, T, H, V]}, got {tuple(do.shape)}")
    if dht is not None and tuple(dht.shape) != (N, H, K, V):
        raise ValueError(f"dht must be [N, H, K, V] = {[N, H, K, V]}, got {tuple(dht.shape)}")
    if state_dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"state_dtype must be None, torch.float32 or torch.bfloat16, got {state_dtype}")
    if chunk_size not in (16, 64):
        raise ValueError(f"chunk_size must be 16 or 64, got {chunk_size}")
    if kept is not None and chunk_size != 64:
        raise ValueError("kept (the forward's buffers) serves the 64-token backward only")
    if not g.is_floating_point():
        raise ValueError(f"g must be a floating-point log decay, got {g.dtype}")
    if check_gate and g.numel() and not use_gate_in_kernel:
        # the 16-token tile is exp-safe only when each step's log decay is in [-5, 0] (see triton_chunk.py)
        g_min, g_max = (float(t) for t in torch.aminmax(g.float()))
        if not (g_min >= -_MAX_STEP_DECAY - 1e-4 and g_max <= 1e-4):
            raise ValueError(f"g must satisfy -{_MAX_STEP_DECAY} <= g <= 0 (K3 bounded gate), "
                             f"got min {g_min}, max {g_max}")
    if scale is None:
        scale = K ** -0.5
    BV = block_v or min(V, 32)
    if V % BV or not _is_pow2(BV):
        raise ValueError(f"block_v must be a power of two >= 16 dividing V = {V}, got {BV}")
    CBV = chunk_block_v or min(V, 32)
    if V % CBV or not _is_pow2(CBV):
        raise ValueError(f"chunk_block_v must be a power of two >= 16 dividing V = {V}, got {CBV}")
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    # torch.empty: every row is written by _bwd_chunk_kernel (dh0 by _bwd_dstate_kernel); an unwritten row
    # would show up as garbage in the tests' comparisons
    dq, dk, dg, dv = (torch.empty(x.shape, dtype=x.dtype, device=dev) for x in (q, k, g, v))
    dbeta = torch.empty(beta.shape, dtype=beta.dtype, device=dev)
    dh0 = torch.empty(N, H, K, V, **f32) if initial_state is not None else None
    gate = bool(use_gate_in_kernel)
    if T == 0:
        if dh0 is not None:
            dh0 = dht.float().clone() if dht is not None else torch.zeros_like(dh0)
        zero = (torch.zeros(H, **f32), torch.zeros(H * K, **f32)) if gate else (None, None)
        return dq, dk, dv, dg, dbeta, dh0, *zero

    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    if chunk_size == 64:
        return _chunk_kda_bwd64(
            q, k, v, g, beta, do, float(scale), initial_state, dht, cu_seqlens, (B, T, H, K, V, N),
            (A_log, dt_bias, float(lower_bound)) if gate else None,
            (gate, bool(use_beta_sigmoid_in_kernel), bool(use_qk_l2norm_in_kernel)),
            state_dtype or (torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32),
            block_v, num_warps, (dq, dk, dv, dg, dbeta, dh0), kept,
        )
    # per-chunk states stored in bf16 for bf16 inputs, as the forward's h (the carried states stay fp32)
    state_dtype = state_dtype or (torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32)
    num_warps = num_warps or 2
    # [B, T] rows are the same memory as one packed sequence of B*T rows with boundaries at multiples of T
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=dev, dtype=torch.int32).contiguous()
    else:
        cu = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * T
    nts = (cu[1:] - cu[:-1] + _BT - 1) // _BT  # chunks per sequence [N]
    chunk_offsets = torch.zeros(N + 1, dtype=torch.int32, device=dev)
    chunk_offsets[1:] = torch.cumsum(nts, 0)
    NT = int(chunk_offsets[-1])  # host sync: grid size
    seq_of_chunk = torch.repeat_interleave(torch.arange(N, device=dev, dtype=torch.int32), nts)  # [NT]
    chunk_indices = torch.stack(
        [seq_of_chunk, torch.arange(NT, device=dev, dtype=torch.int32) - chunk_offsets[:-1][seq_of_chunk.long()]],
        dim=1,
    ).to(torch.int32).contiguous()  # [NT, 2] = (sequence, chunk within the sequence)

    tf32 = q.dtype == torch.bfloat16 or v.dtype == torch.bfloat16
    X_buf = torch.empty(B, T, H, _BT, **f32)
    Aqk_buf = torch.empty(B, T, H, _BT, **f32)
    w_buf = torch.empty(B, T, H, K, **f32)
    kd_buf = torch.empty(B, T, H, K, **f32)
    qg_buf = torch.empty(B, T, H, K, **f32)
    b_buf = torch.empty(B, T, H, **f32)
    gl_buf = torch.empty(NT, H, K, **f32)  # e^Gl of every chunk
    h = torch.empty(NT, H, K, V, dtype=state_dtype, device=dev)
    dh = torch.empty(NT, H, K, V, dtype=state_dtype, device=dev)
    # u and du of every token (fp32, written by the sequential kernels for the per-chunk kernel)
    u_buf = torch.empty(B, T, H, V, **f32)
    du_buf = torch.empty(B, T, H, V, **f32)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    dht_c = dht.float().contiguous() if dht is not None else None
    dummy = dq
    gate_args = (A_log.contiguous(), dt_bias.contiguous(), float(lower_bound)) if gate else (dummy, dummy, 0.0)
    common = dict(H=H, K=K, BT=_BT, TF32=tf32)
    flags = dict(USE_GATE=gate, USE_BSIG=bool(use_beta_sigmoid_in_kernel), USE_L2=bool(use_qk_l2norm_in_kernel))
    # per-(chunk, head) partial sums of the gate parameters' gradients, summed below (deterministic)
    ddt_part = torch.empty(NT, H, K, **f32) if gate else dummy
    dA_part = torch.empty(NT, H, **f32) if gate else dummy
    # the chunk kernel keeps ~7 [16, K] fp32 tiles live plus two [K, CBV] state tiles; at K = 128 the default
    # (CBV 32, 4 warps, 1 stage) spills ~0.5-0.9 KB (ptxas, sm_90a, triton 3.6) and is still the fastest measured
    chunk_warps = chunk_num_warps or 4
    _bwd_prep_kernel[(NT, H)](q, k, g, beta, cu, chunk_indices, X_buf, w_buf, Aqk_buf, kd_buf, qg_buf, gl_buf, b_buf,
                              float(scale), *gate_args, **common, **flags, num_warps=num_warps, enable_fp_fusion=True)
    grid = (N, H, V // BV)
    _bwd_state_kernel[grid](
        v, h0 if h0 is not None else dummy, h, u_buf, cu, chunk_offsets, X_buf, w_buf, kd_buf, gl_buf, b_buf,
        V=V, BV=BV, USE_H0=h0 is not None, **common, num_warps=num_warps, enable_fp_fusion=True,
    )
    _bwd_dstate_kernel[grid](
        do, dht_c if dht_c is not None else dummy, dh, dh0 if dh0 is not None else dummy, du_buf, cu, chunk_offsets,
        w_buf, Aqk_buf, kd_buf, qg_buf, gl_buf,
        V=V, BV=BV, USE_DHT=dht_c is not None, STORE_DH0=dh0 is not None, **common, num_warps=num_warps,
        enable_fp_fusion=True,
    )
    _bwd_chunk_kernel[(NT, H)](
        q, k, v, g, beta, do, h, dh, u_buf, du_buf, cu, chunk_indices, X_buf, b_buf, dq, dk, dv, dg, dbeta,
        ddt_part, dA_part, float(scale), *gate_args, V=V, BV=CBV, **common, **flags, num_warps=chunk_warps,
        **({} if chunk_num_stages is None else {"num_stages": chunk_num_stages}), enable_fp_fusion=True,
    )
    dA_log, ddt_bias = (dA_part.sum(0), ddt_part.sum(0).reshape(H * K)) if gate else (None, None)
    return dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias


# Launch settings of the 64-token backward's parallel kernels (module-level so a benchmark can sweep them):
# (BK, BV, num_warps, bf16 products with X for bf16 inputs) of _bwd64_inter_kernel, (BC, num_warps) of
# _bwd64_intra_kernel, whose products stay tf32 (bf16 ones put dt_bias's gradient past the 2e-2 rule), and the
# warps of _bwd64_ut_kernel. The inter kernel at BK 32 (four K-block programs and the V one) compiles to no spill,
# where BK 64 spilled 940 bytes a thread (sm_90a, triton 3.6): 6.1 GB of local-memory traffic at T = 8K, H = 96
# by ncu's count, most of what made it 57 % DRAM-busy. At BK 32 it takes 2626 us against 3213 there (H200, same
# call; the UT kernel, which sums the NK + 1 partials of dXb, 412 against 320 us; BENCHMARKS.md, thirty-first
# session). The intra kernel stays one batch of four [16, 64] x [64, BC] dots at (BC 32, 4 warps): 3.45 ms at T = 8K
# on the H100, bound by L1 / shared-memory traffic (ncu: L1/TEX 71 % busy, 12.5 % occupancy). Its other launches and
# 2-D forms with fewer spills and far less shared memory (a loop over the sub-tiles; the four blocks as block-masked
# whole-chunk wgmma dots; [64, 16] x [16, BC] column-block dots) took 5.1-22 ms in the same calls (BENCHMARKS.md,
# thirty-second session; branch `wip/kda-intra-2d`).
_INTER64 = (32, 32, 4, True)
_INTRA64 = (32, 4)
_UT64_WARPS = 4


def _chunk_kda_bwd64(q, k, v, g, beta, do, scale, h0, dht, cu_seqlens, dims, gate_args, flags, state_dtype,
                     block_v, num_warps, outs, kept=None):
    """The 64-token backward: the forward's 64-token prep and state kernels recompute w, u0, qg, kd, Aqk, X, Akk,
    h and u (``triton_chunk._recompute_for_backward``, or ``kept`` by the forward), then
    ``_bwd64_dstate_kernel`` (sequential),
    ``_bwd64_inter_kernel``, ``_bwd64_ut_kernel``, ``_bwd64_intra_kernel`` and ``_bwd64_l2_kernel`` (parallel over
    chunks)."""
    B, T, H, K, V, N = dims
    use_gate, use_bsig, use_l2 = flags
    dq, dk, dv, dg, dbeta, dh0 = outs
    dev = q.device
    f32 = dict(dtype=torch.float32, device=dev)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    bf16 = q.dtype == torch.bfloat16
    dot_mode = 0 if not bf16 else 2 if interp else 1
    A_log, dt_bias, lower_bound = gate_args if use_gate else (q, q, 0.0)
    gate_ptrs = (A_log.contiguous(), dt_bias.contiguous()) if use_gate else (q, q)
    h0f = h0.float().contiguous() if h0 is not None else None
    # the forward's own buffers and numerics (its defaults: bf16 state products, low-precision buffers), kept by
    # the forward or recomputed here
    fb = kept if kept is not None else _recompute_for_backward(q, k, v, g, beta, h0f, cu_seqlens, gate_ptrs, scale,
                                                               lower_bound, dims, dot_mode, state_dtype, flags)
    n_chunks, NT, is_varlen = fb["n_chunks"], max(fb["NT"], 1), cu_seqlens is not None
    st_dot, x_dot = fb["st_dot"], fb["wu_dot"]
    # the state-gradient carry: as the forward's state kernel (one 8-warp program for V = 128) for bf16 products;
    # fp32 inputs keep 32-wide V-blocks, whose fp32 tiles fit two pipeline stages
    BV, warps = _state64_launch(V) if st_dot != 0 else (min(V, 32), 4)
    BV, num_warps = block_v or BV, num_warps or warps
    dh = torch.empty_like(fb["h"])
    bk, bv, nw, x_bf16 = _INTER64
    # du is read only by the inter kernel, whose products with it (dw, Xb's gradient, dv) take bf16 operands for
    # bf16 inputs: stored in bf16 it gives the same bits and half the bytes (403 MB less at T = 8K, H = 96)
    du = torch.empty(B, T, H, V, dtype=torch.bfloat16 if bf16 and x_bf16 else torch.float32, device=dev)
    dht_c = dht.float().contiguous() if dht is not None else None
    _bwd64_dstate_kernel[(N, H, V // BV)](
        do, dht_c if dht_c is not None else q, dh, dh0 if dh0 is not None else q, du, fb["cu"], fb["chunk_offsets"],
        fb["w"], fb["Aqk"], fb["kd"], fb["qg"], fb["gl"], T, NT,
        H=H, K=K, V=V, BT=64, BV=BV, IS_VARLEN=is_varlen, USE_DHT=dht_c is not None, STORE_DH0=dh0 is not None,
        DOT=st_dot, num_warps=num_warps, num_stages=2, enable_fp_fusion=True,
    )
    if not n_chunks:
        zero = (torch.zeros(H, **f32), torch.zeros(H * K, **f32)) if use_gate else (None, None)
        return dq, dk, dv, dg, dbeta, dh0, *zero
    BK = min(K, bk)
    NK = K // BK
    dAqk = torch.empty(B, T, H, 64, **f32)
    dXb_part = torch.empty(NK + 1, n_chunks, H, 64, 64, **f32)
    dq_part, dk_part, dG_part = (torch.empty(B, T, H, K, **f32) for _ in range(3))
    dGl = torch.empty(n_chunks, H, K, **f32)
    _bwd64_inter_kernel[((NK + 1) * n_chunks, H)](
        q, k, v, g, beta, do, fb["h"], dh, fb["u"], du, fb["X"], fb["r"], fb["cu"], fb["chunk_indices"], *gate_ptrs,
        dv, dAqk, dXb_part, dq_part, dk_part, dG_part, dGl, lower_bound, T, NT,
        H=H, K=K, V=V, BT=64, BK=BK, BV=min(V, bv), NK=NK, DOT=dot_mode, XDOT=dot_mode if x_bf16 else x_dot,
        IS_VARLEN=is_varlen, USE_GATE=use_gate, USE_BSIG=use_bsig, num_warps=nw, enable_fp_fusion=True,
    )
    # the UT inverse's backward: dA (chunk-major, fp32) for the intra kernel, and dbeta
    dA = torch.empty(n_chunks, H, 64, 64, **f32)
    _bwd64_ut_kernel[(n_chunks, H)](
        beta, fb["X"], fb["Akk"], dXb_part, dA, dbeta, fb["cu"], fb["chunk_indices"], T, NT,
        H=H, BT=64, NK=NK, IS_VARLEN=is_varlen, USE_BSIG=use_bsig, XDOT=x_dot, num_warps=_UT64_WARPS,
        enable_fp_fusion=True,
    )
    bc, nw = _INTRA64
    BC = min(K, bc)
    NKS = K // BC
    ddt_part = torch.empty(n_chunks, H, K, **f32) if use_gate else q
    dA_part = torch.empty(n_chunks, H, NKS, **f32) if use_gate else q
    row_part = torch.empty(B, T, H, NKS, 2, **f32) if use_l2 else q
    grid = (NKS * n_chunks, H)  # the slices of a chunk run side by side (its dAqk, dA and rows stay in L2)
    _bwd64_intra_kernel[grid](
        q, k, g, fb["r"], dAqk, dA, dq_part, dk_part, dG_part, dGl, fb["cu"], fb["chunk_indices"], *gate_ptrs,
        dq, dk, dg, ddt_part, dA_part, row_part, lower_bound, scale, T, NT,
        H=H, K=K, BT=64, BC=BC, IS_VARLEN=is_varlen, USE_GATE=use_gate, USE_L2=use_l2, XDOT=x_dot, num_warps=nw,
        enable_fp_fusion=True,
    )
    if use_l2:
        _bwd64_l2_kernel[grid](q, k, fb["r"], dq_part, dk_part, row_part, dq, dk, fb["cu"], fb["chunk_indices"],
                               scale, T, NT, H=H, K=K, BT=64, BC=BC, IS_VARLEN=is_varlen, num_warps=4,
                               enable_fp_fusion=True)
    dA_log, ddt_bias = (dA_part.sum((0, 2)), ddt_part.sum(0).reshape(H * K)) if use_gate else (None, None)
    return dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias
