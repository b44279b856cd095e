"""Pure-PyTorch reference kernels for Kimi Delta Attention (KDA).

Names, argument order and shapes follow ``fla.ops.kda`` ([B, T, H, K] layout).
All arithmetic is done in fp32; the recurrent state is always fp32 and outputs
are cast back to ``v.dtype``.

Recurrence (per head, state ``S`` of shape [K, V])::

    S   <- S * exp(g_t)[:, None]                  # per key-channel decay
    S   <- S + k_t (beta_t (v_t - k_t^T S))^T     # delta rule
    o_t  = (scale * q_t)^T S
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["kda_gate", "l2norm", "fused_recurrent_kda", "chunk_kda"]


# --------------------------------------------------------------------------- #
# Gate and normalisation
# --------------------------------------------------------------------------- #
def kda_gate(
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """K3 lower-bounded gate: ``g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias))``.

    z: [B, T, H, K] (any dtype); A_log: [>= H] (only the first H used);
    dt_bias: [H * K]. Returns fp32 log-decay g of shape [B, T, H, K].
    """
    if z.dim() != 4:
        raise ValueError(f"z must be [B, T, H, K], got {tuple(z.shape)}")
    B, T, H, K = z.shape
    if A_log.dim() != 1 or A_log.shape[0] < H:
        raise ValueError(f"A_log must be a vector of length >= H = {H}, got {tuple(A_log.shape)}")
    if dt_bias.numel() != H * K:
        raise ValueError(f"dt_bias must be [H*K] = [{H * K}], got {tuple(dt_bias.shape)}")
    A = A_log[:H].float().exp().view(H, 1)
    x = z.float() + dt_bias.float().reshape(H, K)
    return lower_bound * torch.sigmoid(A * x)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla-style L2 norm over the last dim, in fp32: ``x / sqrt(sum(x^2) + eps)``."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# --------------------------------------------------------------------------- #
# Validation / varlen helpers
# --------------------------------------------------------------------------- #
def _shape_str(*dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _validate_shapes(q, k, v, g, beta):
    """Shapes of the per-token inputs (no host sync); returns B, T, H, K, V."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got {tuple(q.shape)}")
    B, T, H, K = q.shape
    if tuple(k.shape) != (B, T, H, K):
        raise ValueError(f"k must be [B, T, H, K] = {_shape_str(B, T, H, K)}, got {tuple(k.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = {_shape_str(B, T, H, 'V')}, got {tuple(v.shape)}")
    V = v.shape[-1]
    if tuple(g.shape) != (B, T, H, K):
        raise ValueError(f"g must be [B, T, H, K] = {_shape_str(B, T, H, K)}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {_shape_str(B, T, H)}, got {tuple(beta.shape)}")
    return B, T, H, K, V


def _validate(q, k, v, g, beta, initial_state, cu_seqlens):
    B, T, H, K, V = _validate_shapes(q, k, v, g, beta)
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size B = 1, got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be a 1-D tensor [N+1], got {tuple(cu_seqlens.shape)}")
        cs = [int(c) for c in cu_seqlens.tolist()]
        if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs[:-1], cs[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T = {T}, got {cs}")
        N = len(cs) - 1
    else:
        N = B
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = {_shape_str(N, H, K, V)}, got {tuple(initial_state.shape)}"
        )
    return B, T, H, K, V, N


def _run(core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel):
    B, T, H, K, V, N = _validate(q, k, v, g, beta, initial_state, cu_seqlens)
    out_dtype = v.dtype
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    h0 = None if initial_state is None else initial_state.float()

    if cu_seqlens is None:
        S0 = h0 if h0 is not None else q.new_zeros(B, H, K, V)
        o, S = core(q, k, v, g, beta, scale, S0)
    else:
        cs = [int(c) for c in cu_seqlens.tolist()]
        outs, states = [], []
        for i in range(N):
            a, b = cs[i], cs[i + 1]
            S0 = h0[i : i + 1] if h0 is not None else q.new_zeros(1, H, K, V)
            o_i, S_i = core(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale, S0)
            outs.append(o_i)
            states.append(S_i)
        o = torch.cat(outs, dim=1)
        S = torch.cat(states, dim=0)
    return o.to(out_dtype), (S if output_final_state else None)


# --------------------------------------------------------------------------- #
# Recurrent (token loop) form
# --------------------------------------------------------------------------- #
def _recurrent_core(q, k, v, g, beta, scale, S):
    """fp32 inputs [B, T, H, *]; S [B, H, K, V]. Returns (o [B, T, H, V], S)."""
    T = q.shape[1]
    outs = []
    for t in range(T):
        q_t, k_t, v_t = q[:, t] * scale, k[:, t], v[:, t]  # [B, H, K|V]
        S = S * g[:, t].exp().unsqueeze(-1)
        pred = torch.einsum("bhk,bhkv->bhv", k_t, S)
        u = beta[:, t].unsqueeze(-1) * (v_t - pred)
        S = S + k_t.unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))
    if T == 0:
        o = v.new_zeros(v.shape)
    else:
        o = torch.stack(outs, dim=1)
    return o, S


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
):
    """Token-by-token KDA (decode path).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H] (already sigmoided);
    g is the fp32 log-decay. initial_state: [N, H, K, V]. Returns
    (o [B, T, H, V] in v.dtype, final_state fp32 [N, H, K, V] or None).
    """
    return _run(
        _recurrent_core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
        use_qk_l2norm_in_kernel,
    )


# --------------------------------------------------------------------------- #
# Chunked (WY / UT transform) form
# --------------------------------------------------------------------------- #
def _make_chunk_core(chunk_size: int):
    C = chunk_size

    def core(q, k, v, g, beta, scale, S):
        B, T, H, K = q.shape
        V = v.shape[-1]
        if T == 0:
            return v.new_zeros(B, 0, H, V), S
        pad = (C - T % C) % C
        # [B, T, H, D] -> [B, H, T, D]; padded tokens have k = 0, beta = 0, g = 0,
        # so they neither change the state nor decay it.
        q, k, v, g = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta.transpose(1, 2), (0, pad))
        NT = (T + pad) // C
        q = q * scale
        q, k, v, g = (x.reshape(B, H, NT, C, x.shape[-1]) for x in (q, k, v, g))
        beta = beta.reshape(B, H, NT, C)
        gc = g.cumsum(dim=-2)  # within-chunk cumulative log-decay

        idx = torch.arange(C, device=q.device)
        causal = idx[:, None] >= idx[None, :]  # j <= i
        strict = idx[:, None] > idx[None, :]  # j < i
        eye = torch.eye(C, dtype=q.dtype, device=q.device)

        outs = []
        for n in range(NT):
            q_n, k_n, v_n, gc_n, b_n = q[:, :, n], k[:, :, n], v[:, :, n], gc[:, :, n], beta[:, :, n]
            # decay[i, j, d] = exp(gc_i[d] - gc_j[d]) for j <= i, else 0 (masked before exp: stable)
            diff = gc_n.unsqueeze(-2) - gc_n.unsqueeze(-3)  # [B, H, C(i), C(j), K]
            decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()
            kd = k_n.unsqueeze(-3) * decay  # [B, H, i, j, K]: k_j * exp(gc_i - gc_j)
            Akk = (k_n.unsqueeze(-2) * kd).sum(-1).masked_fill(~strict, 0.0)  # k_i . k_j decayed, j < i
            Aqk = (q_n.unsqueeze(-2) * kd).sum(-1).masked_fill(~causal, 0.0)  # q_i . k_j decayed, j <= i
            # UT transform: (I + diag(beta) Akk) u = beta * (v - (k * exp(gc)) @ S)
            L = eye + b_n.unsqueeze(-1) * Akk
            rhs = b_n.unsqueeze(-1) * (v_n - (k_n * gc_n.exp()) @ S)
            u = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)  # [B, H, C, V]
            outs.append((q_n * gc_n.exp()) @ S + Aqk @ u)
            g_last = gc_n[:, :, -1]  # [B, H, K]
            S = S * g_last.exp().unsqueeze(-1) + (k_n * (g_last.unsqueeze(-2) - gc_n).exp()).transpose(-1, -2) @ u

        o = torch.stack(outs, dim=2).reshape(B, H, NT * C, V)[:, :, :T].transpose(1, 2)
        return o, S

    return core


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
    chunk_size: int = 64,
):
    """Chunked KDA (prefill path), same contract as :func:`fused_recurrent_kda`.

    Vectorised over batch, heads and within each chunk; loops over chunks only.
    T need not be a multiple of ``chunk_size`` (padded internally).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _run(
        _make_chunk_core(chunk_size), q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
        use_qk_l2norm_in_kernel,
    )
