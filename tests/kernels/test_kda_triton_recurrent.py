"""Triton fused recurrent KDA against the torch reference and fla's `naive_recurrent_kda`.

Runs on the CPU under `TRITON_INTERPRET=1` (set in conftest.py when there is no GPU) and compiled on CUDA.
Tolerance rule (rel_err = max-norm relative error, tests/helpers.py): fp32 inputs <= 1e-5 against the fp32
reference; bf16 inputs <= 2e-2 against the fp32 reference evaluated on the same bf16 values. Output
buffers are poisoned with NaN before each call, so an unwritten element fails.
"""

import os

# TRITON_INTERPRET is set by conftest.py when there is no GPU (before triton is first imported).

import pytest
import torch

from helpers import rel_err
from k3_kernels.kda import reference as ref

triton = pytest.importorskip("triton")
from k3_kernels.kda.triton_recurrent import fused_recurrent_kda  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make(B=2, T=3, H=2, K=16, V=16, dtype=torch.float32, seed=0, N=None):
    """Raw inputs (z, beta logits) and the derived fp32 g / beta the reference takes."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    z = torch.randn(B, T, H, K, generator=gen)
    A_log = torch.randn(H + 3, generator=gen) * 0.5  # padded like the release: only the first H are used
    dt_bias = torch.randn(H * K, generator=gen) * 0.5
    b_logit = torch.randn(B, T, H, generator=gen)
    h0 = torch.randn(N or B, H, K, V, generator=gen) * 0.5
    q, k, v = (x.to(DEVICE, dtype) for x in (q, k, v))
    z, A_log, dt_bias, b_logit, h0 = (x.to(DEVICE) for x in (z, A_log, dt_bias, b_logit, h0))
    g = ref.kda_gate(z, A_log, dt_bias, -5.0)
    beta = torch.sigmoid(b_logit)
    return dict(q=q, k=k, v=v, z=z, A_log=A_log, dt_bias=dt_bias, b_logit=b_logit, g=g, beta=beta, h0=h0)


def nan_like(x, dtype=None):
    return torch.full_like(x, float("nan"), dtype=dtype or x.dtype)


def reference(d, h0=None, cu_seqlens=None, l2=True):
    return ref.fused_recurrent_kda(
        d["q"].float(), d["k"].float(), d["v"].float(), d["g"], d["beta"], initial_state=h0,
        output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=l2,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 2, 5])
@pytest.mark.parametrize("B,H,K,V", [(1, 2, 16, 16), (3, 3, 32, 16), (3, 2, 16, 32)])
def test_matches_reference(dtype, T, B, H, K, V):
    d = make(B, T, H, K, V, dtype, seed=100 * T + 10 * B + K)
    out = nan_like(d["v"])
    o, S = fused_recurrent_kda(
        d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["h0"], output_final_state=True,
        use_qk_l2norm_in_kernel=True, out=out,
    )
    o_r, S_r = reference(d, d["h0"])
    assert o is out and o.dtype == dtype and S.dtype == torch.float32 and S.shape == (B, H, K, V)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, o_r) <= TOL[dtype] and rel_err(S, S_r) <= TOL[dtype]


@pytest.mark.parametrize("T", [1, 5])
def test_matches_fla_naive(T):
    naive = pytest.importorskip("fla.ops.kda.naive")
    d = make(3, T, 2, 32, 32, seed=T)
    k = ref.l2norm(d["k"])  # naive has no in-kernel norm
    o, S = fused_recurrent_kda(
        d["q"], k, d["v"], d["g"], d["beta"], scale=0.3, initial_state=d["h0"], output_final_state=True
    )
    o_n, S_n = naive.naive_recurrent_kda(
        d["q"], k, d["v"], d["g"], d["beta"], scale=0.3, initial_state=d["h0"], output_final_state=True
    )
    assert rel_err(o, o_n) <= 1e-5 and rel_err(S, S_n) <= 1e-5


def test_gate_and_beta_in_kernel_match_precomputed():
    d = make(3, 5, 3, 16, 32, seed=7)
    o_in, S_in = fused_recurrent_kda(
        d["q"], d["k"], d["v"], d["z"], d["b_logit"], initial_state=d["h0"], output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=d["A_log"], dt_bias=d["dt_bias"],
        lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, out=nan_like(d["v"]),
    )
    o_pre, S_pre = fused_recurrent_kda(
        d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["h0"], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o_r, S_r = reference(d, d["h0"])
    assert rel_err(o_in, o_r) <= 1e-5 and rel_err(S_in, S_r) <= 1e-5
    assert rel_err(o_in, o_pre) <= 1e-5 and rel_err(S_in, S_pre) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_slots_in_place(dtype):
    """Sequence b reads and writes pool row idx[b]; unused rows are untouched; slot -1 is a padding row."""
    B, T, H, K, V, S_rows = 3, 2, 2, 16, 16, 6
    d = make(B, T, H, K, V, dtype, seed=11, N=S_rows)
    pool = d["h0"].clone()  # [S, H, K, V]
    before = pool.clone()
    idx = torch.tensor([4, 0, 2], device=DEVICE)
    o, S = fused_recurrent_kda(
        d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=pool, inplace_final_state=True,
        ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, out=nan_like(d["v"]),
    )
    o_r, S_r = reference(d, before[idx])
    assert S is pool
    assert rel_err(o, o_r) <= TOL[dtype] and rel_err(pool[idx], S_r) <= TOL[dtype]
    untouched = [1, 3, 5]
    assert torch.equal(pool[untouched], before[untouched])

    # A padding row (-1): zero output, no state read or written; the other rows as before.
    pool2 = before.clone()
    idx2 = torch.tensor([5, -1, 1], device=DEVICE)
    o2, _ = fused_recurrent_kda(
        d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=pool2, inplace_final_state=True,
        ssm_state_indices=idx2, use_qk_l2norm_in_kernel=True, out=nan_like(d["v"]),
    )
    real = [0, 2]
    o2_r, S2_r = reference({n: (x[real] if x.dim() >= 3 and x.shape[0] == B else x) for n, x in d.items()},
                           before[[5, 1]])
    assert torch.equal(o2[1], torch.zeros_like(o2[1]))
    assert rel_err(o2[real], o2_r) <= TOL[dtype] and rel_err(pool2[[5, 1]], S2_r) <= TOL[dtype]
    assert torch.equal(pool2[[0, 2, 3, 4]], before[[0, 2, 3, 4]])


def test_slots_not_in_place_returns_new_state():
    d = make(3, 2, 2, 16, 16, seed=12, N=5)
    pool = d["h0"].clone()
    idx = torch.tensor([3, 1, 4], device=DEVICE)
    o, S = fused_recurrent_kda(
        d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=pool, output_final_state=True,
        ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
    )
    o_r, S_r = reference(d, d["h0"][idx])
    assert torch.equal(pool, d["h0"]) and S.shape == (3, 2, 16, 16)
    assert rel_err(o, o_r) <= 1e-5 and rel_err(S, S_r) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen(dtype):
    lens = [2, 0, 5, 1]  # an empty sequence keeps its state
    cu = torch.tensor([0, 2, 2, 7, 8], device=DEVICE)
    d = make(1, sum(lens), 2, 16, 32, dtype, seed=13, N=len(lens))
    o, S = fused_recurrent_kda(
        d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["h0"], output_final_state=True,
        cu_seqlens=cu, use_qk_l2norm_in_kernel=True, out=nan_like(d["v"]),
    )
    o_r, S_r = reference(d, d["h0"], cu_seqlens=cu)
    assert S.shape == (4, 2, 16, 32)
    assert rel_err(o, o_r) <= TOL[dtype] and rel_err(S, S_r) <= TOL[dtype]
    assert torch.equal(S[1], d["h0"][1])

    # The same packed batch against a slot pool, updated in place.
    pool = torch.zeros(6, 2, 16, 32, device=DEVICE)
    idx = torch.tensor([5, 0, 3, 2], device=DEVICE)
    pool[idx] = d["h0"]
    o2, _ = fused_recurrent_kda(
        d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=pool, inplace_final_state=True,
        cu_seqlens=cu, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
    )
    assert rel_err(o2, o_r) <= TOL[dtype] and rel_err(pool[idx], S_r) <= TOL[dtype]
    assert torch.equal(pool[[1, 4]], torch.zeros_like(pool[[1, 4]]))


def test_intermediate_states():
    B, T = 3, 5
    d = make(B, T, 2, 16, 16, seed=14)
    o, S, hs = fused_recurrent_kda(
        d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["h0"], output_final_state=True,
        use_qk_l2norm_in_kernel=True, output_intermediate_states=True,
    )
    assert hs.shape == (B, T, 2, 16, 16) and hs.dtype == torch.float32
    for t in range(T):  # the state after token t is the final state of the first t + 1 tokens
        _, S_t = reference({n: (x[:, : t + 1] if x.dim() >= 3 else x) for n, x in d.items()}, d["h0"])
        assert rel_err(hs[:, t], S_t) <= 1e-5
    assert torch.equal(hs[:, -1], S)


def test_awkward_sizes_and_split_v():
    """K, V not powers of two (masked lanes) and several V-blocks per head; no initial state."""
    d = make(3, 2, 2, 24, 40, seed=15)
    o, S = fused_recurrent_kda(
        d["q"], d["k"], d["v"], d["g"], d["beta"], output_final_state=True, use_qk_l2norm_in_kernel=True,
        out=nan_like(d["v"]), block_v=16,
    )
    o_r, S_r = reference(d, None)
    assert rel_err(o, o_r) <= 1e-5 and rel_err(S, S_r) <= 1e-5
    o2, S2 = fused_recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], use_qk_l2norm_in_kernel=True)
    assert S2 is None and rel_err(o2, o_r) <= 1e-5


def test_bad_inputs_raise():
    d = make(2, 1, 2, 16, 16, seed=16)
    q, k, v, g, beta, h0 = d["q"], d["k"], d["v"], d["g"], d["beta"], d["h0"]
    with pytest.raises(ValueError, match="beta"):
        fused_recurrent_kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=h0[:1])
    with pytest.raises(ValueError, match="inplace_final_state"):
        fused_recurrent_kda(q, k, v, g, beta, inplace_final_state=True)
    with pytest.raises(ValueError, match="fp32"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=h0.bfloat16(), inplace_final_state=True)
    with pytest.raises(ValueError, match="A_log"):
        fused_recurrent_kda(q, k, v, g, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="ssm_state_indices"):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, ssm_state_indices=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="cu_seqlens"):
        fused_recurrent_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 1]))


def test_requires_grad_raises():
    """Forward-only kernel: a silent graph cut would train nothing, so it refuses instead."""
    d = make(1, 1, 2, 16, 16, seed=17)
    q = d["q"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="no backward"):
        fused_recurrent_kda(q, d["k"], d["v"], d["g"], d["beta"])
    with torch.no_grad():
        fused_recurrent_kda(q, d["k"], d["v"], d["g"], d["beta"])


def test_varlen_intermediate_states_and_padding_row_new_state():
    """Packed sequences: per-token states at packed positions; a padding slot gives a zero final-state row."""
    cu = torch.tensor([0, 3, 5], device=DEVICE)
    d = make(1, 5, 2, 16, 16, seed=18, N=3)
    idx = torch.tensor([2, -1], device=DEVICE)
    o, S, hs = fused_recurrent_kda(
        d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["h0"], output_final_state=True,
        cu_seqlens=cu, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, output_intermediate_states=True,
        out=nan_like(d["v"]),
    )
    seg = {n: (x[:, :3] if x.dim() >= 3 and x.shape[0] == 1 else x) for n, x in d.items()}
    o_r, S_r = reference(seg, d["h0"][2:3])
    assert hs.shape == (1, 5, 2, 16, 16)
    assert rel_err(o[:, :3], o_r) <= 1e-5 and rel_err(S[0], S_r[0]) <= 1e-5 and torch.equal(hs[0, 2], S[0])
    assert torch.equal(o[:, 3:], torch.zeros_like(o[:, 3:])) and torch.equal(S[1], torch.zeros_like(S[1]))
    assert torch.equal(hs[:, 3:], torch.zeros_like(hs[:, 3:]))


def test_zero_length():
    d = make(2, 0, 2, 16, 16, seed=19)
    o, S = fused_recurrent_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["h0"], output_final_state=True)
    assert o.shape == (2, 0, 2, 16) and torch.equal(S, d["h0"])
