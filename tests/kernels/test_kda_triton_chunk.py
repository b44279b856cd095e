"""Triton chunked KDA forward (bounded gate; 64-token chunks of 16-token sub-tiles by default, 16-token
chunks with ``chunk_size=16``) against the torch reference and fla's naive recurrent.

Runs on the CPU under `TRITON_INTERPRET=1` (set in conftest.py when there is no GPU) and compiled on CUDA.
Tolerance rule (rel_err = max|a - b| / max|b|): fp32 inputs <= 1e-4 against the fp32 reference; bf16 inputs
<= 2e-2 against the fp32 reference evaluated on the same bf16 values, with the defaults too (bf16 operands in
the state products, bf16 kd / Aqk buffers); 3e-2 in the two older tests written for the low-precision
options (measured 1.4-1.5e-2 there); fp32 gradients <= 1e-4.
Tests without a ``chunk_size`` go through ``chunk_kda`` / the default (64).
"""

import os

# TRITON_INTERPRET is set by conftest.py when there is no GPU (before triton is first imported).

import pytest
import torch

from helpers import rel_err
from k3_kernels.kda import reference as R

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from k3_kernels.kda.triton_chunk import _cumsum_mma, chunk_kda, chunk_kda_fwd  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TS = [1, 15, 16, 17, 63, 64, 65, 100]


def make_inputs(B=2, T=16, H=2, K=16, V=16, dtype=torch.float32, seed=0, with_h0=False, N=None, gate_shift=0.0):
    # gate_shift < 0 moves dt_bias down: weak decay (g ~ -5 e^{shift} per step), so tokens far apart still
    # interact; with the default gate (mean g ~ -2.5) a chunk's sub-tiles barely see each other.
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = R.l2norm(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    z = torch.randn(B, T, H, K, generator=gen) * 2.0
    A_log = torch.randn(H + 3, generator=gen) * 0.5  # padded: only first H used
    dt_bias = torch.randn(H * K, generator=gen) * 0.5 + gate_shift
    beta_raw = torch.randn(B, T, H, generator=gen)
    h0 = torch.randn(N or B, H, K, V, generator=gen) * 0.5 if with_h0 else None
    d = dict(q=q, k=k, v=v, z=z, A_log=A_log, dt_bias=dt_bias, beta_raw=beta_raw, h0=h0)
    d = {n: (None if t is None else t.to(DEVICE)) for n, t in d.items()}
    for n in ("q", "k", "v"):
        d[n] = d[n].to(dtype)
    d["g"] = R.kda_gate(d["z"], d["A_log"], d["dt_bias"])  # fp32, in [-5, 0]
    d["beta"] = torch.sigmoid(d["beta_raw"]).to(dtype)
    return d


@pytest.mark.parametrize("T", TS + [1000])  # 1000: 16 chunks of 64 (the interpreter takes ~13 s a case)
@pytest.mark.parametrize("with_h0", [False, True])
def test_forward_vs_reference_and_fla_naive(T, with_h0):
    x = make_inputs(T=T, with_h0=with_h0, seed=T)
    o, S = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True)
    o_r, S_r = R.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True)
    assert o.shape == (2, T, 2, 16) and o.dtype == torch.float32
    assert S.shape == (2, 2, 16, 16) and S.dtype == torch.float32
    assert rel_err(o, o_r) <= 1e-4 and rel_err(S, S_r) <= 1e-4
    naive = pytest.importorskip("fla.ops.kda.naive")
    o_n, S_n = naive.naive_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                         output_final_state=True)
    assert rel_err(o, o_n) <= 1e-4 and rel_err(S, S_n) <= 1e-4


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("K,V", [(32, 16), (16, 64)])
def test_forward_other_head_dims(K, V, chunk_size):
    x = make_inputs(T=40, K=K, V=V, with_h0=True, seed=3)
    # block_v=16 with V=64 exercises several V-blocks per head
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                         block_v=16, chunk_size=chunk_size)
    o_r, S_r = R.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True)
    assert S.shape == (2, 2, K, V)
    assert rel_err(o, o_r) <= 1e-4 and rel_err(S, S_r) <= 1e-4


@pytest.mark.parametrize("output", ["stored", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk64_u0_in_state_kernel(output, dtype):
    """V-blocks of 64 and wider: the state kernel forms u0 = X diag(beta) v itself (no fp32 u0 buffer); narrower
    ones load the buffer the w / u0 kernel writes. Both against the reference, and against each other, with
    the varlen boundaries at and off the 64-token chunk edges and a non-zero initial state."""
    from k3_kernels.kda.triton_chunk import _u_in_state

    assert _u_in_state(64) and _u_in_state(128) and not _u_in_state(32)
    cu = torch.tensor([0, 5, 64, 65, 130], dtype=torch.int32, device=DEVICE)
    x = make_inputs(B=1, T=130, V=64, dtype=dtype, seed=61, with_h0=True, N=4)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    kw = dict(initial_state=x["h0"], output_final_state=True, cu_seqlens=cu, output=output)
    o_in, S_in = chunk_kda_fwd(*args, block_v=64, **kw)  # u0 formed in the state kernel
    o_buf, S_buf = chunk_kda_fwd(*args, block_v=32, **kw)  # u0 through the fp32 buffer
    f = {n: x[n].float() for n in ("q", "k", "v", "beta")}
    o_r, S_r = R.chunk_kda(f["q"], f["k"], f["v"], x["g"], f["beta"], initial_state=x["h0"], output_final_state=True,
                           cu_seqlens=cu)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for o, S in ((o_in, S_in), (o_buf, S_buf)):
        assert rel_err(o, o_r) <= tol and rel_err(S, S_r) <= tol
    # the same products on the same operands, only the column blocking differs
    assert rel_err(o_in, o_buf) <= 1e-5 and rel_err(S_in, S_buf) <= 1e-5


def test_default_output_per_chunk_size(monkeypatch):
    """output=None (chunk_kda_fwd's and chunk_kda's default): the fused loop at 64-token chunks, the faster there
    since the thirty-fourth session (BENCHMARKS.md), and the stored states with the parallel output kernel at 16;
    chunk_kda takes forward_options' output when its own argument is left at None."""
    import k3_kernels.kda.triton_chunk as TC

    calls = []
    for name in ("_stored_fwd", "_chunk64_fwd"):
        monkeypatch.setattr(TC, name, lambda *a, _n=name, _f=getattr(TC, name), **k: calls.append(_n) or _f(*a, **k))
    x = make_inputs(T=70, with_h0=True, seed=12)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o_r, S_r = R.chunk_kda(*args, initial_state=x["h0"], output_final_state=True)
    for kw, path in ((dict(), "_chunk64_fwd"), (dict(chunk_size=16), "_stored_fwd")):
        calls.clear()
        o, S = chunk_kda_fwd(*args, initial_state=x["h0"], output_final_state=True, **kw)
        assert calls == [path]
        assert rel_err(o, o_r) <= 1e-4 and rel_err(S, S_r) <= 1e-4
    calls.clear()
    o, S = chunk_kda(*args, initial_state=x["h0"], output_final_state=True, forward_options=dict(output="stored"))
    assert calls == ["_stored_fwd"] and rel_err(o, o_r) <= 1e-4


@triton.jit
def _cumsum_tile(X, OUT, BS: tl.constexpr, INTERP: tl.constexpr):
    o = tl.arange(0, BS)
    p = o[:, None] * BS + o[None, :]
    tl.store(OUT + p, _cumsum_mma(tl.load(X + p), BS, INTERP))


@pytest.mark.parametrize("seed", [0, 1])
def test_cumsum_mma_precision(seed):
    """The 64-token prep's in-sub-tile cumsum on the tensor cores (tf32 head + remainder, ``_cumsum_mma``) against
    fp64: within 2^-17 of each column's sum of |g| (K3's log2 decays, up to 5 log2(e) a step). The head alone, a
    single tf32 product, misses that bound by far (checked on the same values), so the test sees a lost remainder."""
    gen = torch.Generator().manual_seed(seed)
    x = -torch.rand(16, 16, generator=gen, dtype=torch.float64) * 5 * 1.4426950408889634
    x32 = x.float().to(DEVICE)
    out = torch.empty_like(x32)
    _cumsum_tile[(1,)](x32, out, BS=16, INTERP=os.environ.get("TRITON_INTERPRET") == "1", num_warps=1)
    ref = torch.cumsum(x32.double().cpu(), dim=0)
    bound = 2.0 ** -17 * x.abs().sum(0)
    assert ((out.double().cpu() - ref).abs() <= bound).all()
    head = (x32.cpu().view(torch.int32) & -8192).view(torch.float32).double()
    assert ((torch.cumsum(head, dim=0) - ref).abs() > bound).any()


def test_extreme_gate_bound():
    """Every step at the -5 bound: the 16-token tile spans exactly -80, the worst case for exp(+-G)."""
    x = make_inputs(T=50, with_h0=True, seed=4)
    g = torch.full_like(x["g"], -5.0)
    g[..., 0] = 0.0  # mix with no-decay channels
    o, S = chunk_kda(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["h0"], output_final_state=True)
    o_r, S_r = R.fused_recurrent_kda(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["h0"],
                                     output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, o_r) <= 1e-4 and rel_err(S, S_r) <= 1e-4


def test_correlated_keys_beta_one():
    """Repeated keys, beta -> 1, no decay: the UT system is as ill-conditioned as the delta rule gets."""
    x = make_inputs(T=48, with_h0=True, seed=5)
    k = x["k"][:, :1].expand_as(x["k"]).contiguous() + 0.01 * x["k"]
    k = R.l2norm(k)
    beta = torch.ones_like(x["beta"]) * 0.999
    g = torch.zeros_like(x["g"])
    o, S = chunk_kda(x["q"], k, x["v"], g, beta, initial_state=x["h0"], output_final_state=True)
    o_r, S_r = R.fused_recurrent_kda(x["q"], k, x["v"], g, beta, initial_state=x["h0"], output_final_state=True)
    assert rel_err(o, o_r) <= 1e-4 and rel_err(S, S_r) <= 1e-4


@pytest.mark.parametrize("with_h0", [False, True])
def test_varlen(with_h0):
    cu = [0, 1, 17, 17, 80, 100]  # boundaries off chunk multiples, one empty sequence
    N = len(cu) - 1
    x = make_inputs(B=1, T=100, with_h0=with_h0, N=N, seed=11)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    o, S = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                     cu_seqlens=cu_t)
    assert o.shape == (1, 100, 2, 16) and S.shape == (N, 2, 16, 16)
    for i in range(N):
        a, b = cu[i], cu[i + 1]
        h = x["h0"][i : i + 1] if with_h0 else None
        o_i, S_i = R.fused_recurrent_kda(x["q"][:, a:b], x["k"][:, a:b], x["v"][:, a:b], x["g"][:, a:b],
                                         x["beta"][:, a:b], initial_state=h, output_final_state=True)
        if b > a:
            assert rel_err(o[:, a:b], o_i) <= 1e-4
        if with_h0 or b > a:
            assert rel_err(S[i : i + 1], S_i) <= 1e-4
        else:
            assert (S[i] == 0).all()


@pytest.mark.parametrize("T", [17, 65])
def test_bf16_inputs(T):
    x = make_inputs(T=T, with_h0=True, dtype=torch.bfloat16, seed=21)
    o, S = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    f = {n: x[n].float() for n in ("q", "k", "v", "g", "beta")}
    o_r, S_r = R.chunk_kda(f["q"], f["k"], f["v"], f["g"], f["beta"], initial_state=x["h0"], output_final_state=True)
    assert rel_err(o, o_r) <= 2e-2 and rel_err(S, S_r) <= 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_kernel_gate_beta_l2norm(dtype):
    x = make_inputs(T=45, with_h0=True, dtype=dtype, seed=31)
    q, k = x["q"] * 2.5, (x["k"].float() * 4.0 + 0.3).to(dtype)
    o1, S1 = chunk_kda(q, k, x["v"], x["z"], x["beta_raw"], initial_state=x["h0"], output_final_state=True,
                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=x["A_log"],
                       dt_bias=x["dt_bias"], lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)
    o2, S2 = chunk_kda(R.l2norm(q).to(dtype), R.l2norm(k).to(dtype), x["v"], x["g"],
                       torch.sigmoid(x["beta_raw"]), initial_state=x["h0"], output_final_state=True)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel_err(o1, o2) <= tol and rel_err(S1, S2) <= tol
    o_r, S_r = R.chunk_kda(q.float(), k.float(), x["v"].float(), x["g"], torch.sigmoid(x["beta_raw"]),
                           initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_err(o1, o_r) <= tol and rel_err(S1, S_r) <= tol


def test_nan_poisoned_output_fully_overwritten():
    cu = torch.tensor([0, 5, 21, 70], dtype=torch.int32, device=DEVICE)
    x = make_inputs(B=1, T=70, V=32, seed=41)
    out = torch.full((1, 70, 2, 32), float("nan"), device=DEVICE)
    o, _ = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, out=out, block_v=16)
    assert o is out and torch.isfinite(out).all()
    o_r, _ = R.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu)
    assert rel_err(out, o_r) <= 1e-4


def test_custom_scale_and_no_final_state():
    x = make_inputs(T=20, seed=9)
    o, S = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.37)
    assert S is None
    assert rel_err(o, R.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.37)[0]) <= 1e-4


def _grads(fn, tensors, o_w, s_w):
    o, S = fn(*tensors)
    loss = (o.float() * o_w).sum() + (S * s_w).sum()
    return torch.autograd.grad(loss, tensors)


def _assert_forward_and_grads_match(ours, ref, names, ts, o_w, s_w):
    """o, the final state and every gradient of ours within 1e-4 of ref."""
    o1, S1 = ours(*ts)
    o2, S2 = ref(*ts)
    assert rel_err(o1, o2) <= 1e-4 and rel_err(S1, S2) <= 1e-4
    for n, a, b in zip(names, _grads(ours, ts, o_w, s_w), _grads(ref, ts, o_w, s_w)):
        assert a is not None and rel_err(a, b) <= 1e-4, n


def test_gradients_precomputed_gate():
    x = make_inputs(T=33, with_h0=True, seed=51)
    names = ("q", "k", "v", "g", "beta", "h0")
    ts = [x[n].clone().requires_grad_() for n in names]
    gen = torch.Generator().manual_seed(0)
    o_w = torch.randn(2, 33, 2, 16, generator=gen).to(DEVICE)
    s_w = torch.randn(2, 2, 16, 16, generator=gen).to(DEVICE)

    def ours(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    def ref(q, k, v, g, beta, h0):
        return R.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    for n, a, b in zip(names, _grads(ours, ts, o_w, s_w), _grads(ref, ts, o_w, s_w)):
        assert a is not None and rel_err(a, b) <= 1e-4, n


def test_gradients_in_kernel_gate_varlen():
    cu = torch.tensor([0, 7, 30], dtype=torch.int32, device=DEVICE)
    x = make_inputs(B=1, T=30, with_h0=True, N=2, seed=61)
    names = ("q", "k", "v", "z", "beta_raw", "A_log", "dt_bias", "h0")
    ts = [x[n].clone().requires_grad_() for n in names]
    gen = torch.Generator().manual_seed(1)
    o_w = torch.randn(1, 30, 2, 16, generator=gen).to(DEVICE)
    s_w = torch.randn(2, 2, 16, 16, generator=gen).to(DEVICE)

    def ours(q, k, v, z, b, A_log, dt_bias, h0):
        return chunk_kda(q, k, v, z, b, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                         use_beta_sigmoid_in_kernel=True)

    def ref(q, k, v, z, b, A_log, dt_bias, h0):
        g = R.kda_gate(z, A_log, dt_bias)
        return R.fused_recurrent_kda(q, k, v, g, torch.sigmoid(b), initial_state=h0, output_final_state=True,
                                     cu_seqlens=cu, use_qk_l2norm_in_kernel=True)

    _assert_forward_and_grads_match(ours, ref, names, ts, o_w, s_w)


def test_bad_inputs_raise():
    x = make_inputs(T=10, seed=71)
    with pytest.raises(ValueError, match="g must satisfy"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"] * 3.0, x["beta"])
    with pytest.raises(ValueError, match="A_log"):
        chunk_kda(x["q"], x["k"], x["v"], x["z"], x["beta"], use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="lower_bound"):
        chunk_kda(x["q"], x["k"], x["v"], x["z"], x["beta"], use_gate_in_kernel=True, A_log=x["A_log"],
                  dt_bias=x["dt_bias"], lower_bound=-8.0)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"][..., :1])
    y = make_inputs(T=10, K=24, seed=72)
    with pytest.raises(ValueError, match="powers of two"):
        chunk_kda(y["q"], y["k"], y["v"], y["g"], y["beta"])


@pytest.mark.parametrize("T", [1, 17, 64, 100])
@pytest.mark.parametrize("split", [False, True])
def test_chunk16_path_vs_reference(T, split):
    """chunk_size=16, output="fused"; split=True: w, u0 from the parallel prep kernel, state loop separate."""
    x = make_inputs(T=T, V=32, with_h0=True, seed=80 + T)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["z"], x["beta_raw"], initial_state=x["h0"],
                         output_final_state=True, use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
                         use_beta_sigmoid_in_kernel=True, split=split, block_v=16, chunk_size=16,
                         output="fused")
    o_r, S_r = R.chunk_kda(x["q"], x["k"], x["v"], x["g"], torch.sigmoid(x["beta_raw"]), initial_state=x["h0"],
                           output_final_state=True)
    assert rel_err(o, o_r) <= 1e-4 and rel_err(S, S_r) <= 1e-4


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_path_varlen_l2norm(dtype, chunk_size):
    cu = [0, 1, 17, 17, 80, 100]
    N = len(cu) - 1
    x = make_inputs(B=1, T=100, with_h0=True, N=N, dtype=dtype, seed=90)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    out = torch.full((1, 100, 2, 16), float("nan"), dtype=dtype, device=DEVICE)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                         cu_seqlens=cu_t, use_qk_l2norm_in_kernel=True, split=True, out=out, chunk_size=chunk_size,
                         output="fused")
    assert torch.isfinite(out).all()
    f = {n: x[n].float() for n in ("q", "k", "v", "g", "beta")}
    o_r, S_r = R.chunk_kda(f["q"], f["k"], f["v"], f["g"], f["beta"], initial_state=x["h0"], output_final_state=True,
                           cu_seqlens=cu_t, use_qk_l2norm_in_kernel=True)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel_err(o, o_r) <= tol and rel_err(S, S_r) <= tol


def test_empty_sequence_passes_state_through():
    x = make_inputs(T=1, with_h0=True, seed=95)
    e = {n: x[n][:, :0] for n in ("q", "k", "v", "g", "beta")}
    o, S = chunk_kda(e["q"], e["k"], e["v"], e["g"], e["beta"], initial_state=x["h0"], output_final_state=True)
    assert o.shape == (2, 0, 2, 16) and torch.equal(S, x["h0"])
    _, S0 = chunk_kda(e["q"], e["k"], e["v"], e["g"], e["beta"], output_final_state=True)
    assert (S0 == 0).all()


# --------------------------------------------------------------------------- #
# 64-token chunks from four 16-token sub-tiles (chunk_size=64, the default)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("T", [1, 15, 16, 17, 63, 64, 65, 100, 200])
def test_chunk64_sizes_vs_reference(T):
    """Every sub-tile / chunk boundary case, B = 2, two V-blocks, non-zero initial state, NaN-poisoned out."""
    x = make_inputs(T=T, K=32, V=32, with_h0=True, seed=100 + T, gate_shift=-5.0)
    out = torch.full((2, T, 2, 32), float("nan"), device=DEVICE)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                         out=out, block_v=16, chunk_size=64)
    assert o is out and torch.isfinite(o).all() and torch.isfinite(S).all()
    o_r, S_r = R.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True)
    assert rel_err(o, o_r) <= 1e-4 and rel_err(S, S_r) <= 1e-4


@pytest.mark.parametrize("output", ["stored", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,block,cu,seed", [
    (32, 32, [0, 64, 65, 65, 128, 200, 263], 120),  # boundaries at and inside chunks, a 1-token and an empty one
    (64, 16, [0, 30, 64, 150], 170),  # K and V walked in 4 and 2 channel slices by the prep kernel
])
def test_chunk64_varlen_chunk_edges(dtype, K, block, cu, seed, output, monkeypatch):
    """Varlen boundaries at chunk edges and inside chunks, partial last chunks; in-kernel gate, beta sigmoid and
    L2 norm; per-sequence initial states; NaN-poisoned out; the prep kernel's channel slices set to `block`."""
    import k3_kernels.kda.triton_chunk as TC

    monkeypatch.setattr(TC, "_PREP64_BLOCK", block)
    N, T = len(cu) - 1, cu[-1]
    x = make_inputs(B=1, T=T, K=K, V=32, with_h0=True, N=N, dtype=dtype, seed=seed, gate_shift=-5.0)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    out = torch.full((1, T, 2, 32), float("nan"), dtype=dtype, device=DEVICE)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["z"], x["beta_raw"], initial_state=x["h0"],
                         output_final_state=True, cu_seqlens=cu_t, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
                         use_beta_sigmoid_in_kernel=True, out=out, chunk_size=64, prep_num_warps=2,
                         output=output)
    assert torch.isfinite(out).all() and S.shape == (N, 2, K, 32)
    o_r, S_r = R.chunk_kda(x["q"].float(), x["k"].float(), x["v"].float(), x["g"], torch.sigmoid(x["beta_raw"]),
                           initial_state=x["h0"], output_final_state=True, cu_seqlens=cu_t,
                           use_qk_l2norm_in_kernel=True)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel_err(o, o_r) <= tol and rel_err(S, S_r) <= tol
    for n in range(N):
        if cu[n + 1] == cu[n]:
            assert torch.equal(S[n], x["h0"][n])  # an empty sequence passes its state through


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk64_saturated_in_kernel_gate(dtype):
    """The in-kernel gate saturated at lower_bound = -5 in most channels (z = +40: sigmoid rounds to 1), ~0 in
    the others: the cumulative decay reaches -320 inside a 64-chunk, e^G underflows to 0; results must stay
    finite and match the fp32 reference and fla's naive recurrence."""
    T = 200
    x = make_inputs(T=T, K=32, V=32, with_h0=True, dtype=dtype, seed=130)
    z = torch.full_like(x["z"], 40.0)
    z[..., :4] = -40.0
    A_log = torch.zeros_like(x["A_log"])
    dt_bias = torch.zeros_like(x["dt_bias"])
    g = R.kda_gate(z, A_log, dt_bias, lower_bound=-5.0)
    assert g[..., 4:].min() == -5.0 and g[..., 4:].max() == -5.0
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], z, x["beta"], initial_state=x["h0"], output_final_state=True,
                         use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    f = {n: x[n].float() for n in ("q", "k", "v", "beta")}
    o_r, S_r = R.fused_recurrent_kda(f["q"], f["k"], f["v"], g, f["beta"], initial_state=x["h0"],
                                     output_final_state=True)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel_err(o, o_r) <= tol and rel_err(S, S_r) <= tol
    naive = pytest.importorskip("fla.ops.kda.naive")
    o_n, S_n = naive.naive_recurrent_kda(f["q"], f["k"], f["v"], g, f["beta"], initial_state=x["h0"],
                                         output_final_state=True)
    assert rel_err(o, o_n) <= tol and rel_err(S, S_n) <= tol


@pytest.mark.parametrize("state_dot,lowp", [("bf16", False), ("tf32", True)])
def test_chunk64_low_precision_options(state_dot, lowp):
    """state_dot="bf16": state and u rounded to bf16 in their products; lowp_buffers: kd, Aqk stored in bf16.
    Tolerance 3e-2 for both (measured ~1.4e-2 / ~1.5e-2 at K = 32..64)."""
    x = make_inputs(T=130, K=32, V=32, with_h0=True, dtype=torch.bfloat16, seed=140, gate_shift=-5.0)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                         chunk_size=64, state_dot=state_dot, lowp_buffers=lowp)
    f = {n: x[n].float() for n in ("q", "k", "v", "g", "beta")}
    o_r, S_r = R.chunk_kda(f["q"], f["k"], f["v"], f["g"], f["beta"], initial_state=x["h0"], output_final_state=True)
    assert rel_err(o, o_r) <= 3e-2 and rel_err(S, S_r) <= 3e-2

def test_chunk64_bad_options_raise():
    x = make_inputs(T=10, seed=150)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=32)
    with pytest.raises(ValueError, match="state_dot"):
        chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], state_dot="fp8")
    with pytest.raises(ValueError, match="prep_num_warps"):
        chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], prep_num_warps=4)
    # one pipeline stage with bf16 state products: wrong states on the H200 (triton 3.6), refused on every backend
    b = {n: x[n].bfloat16() for n in ("q", "k", "v")}
    for kw in (dict(chunk_size=64), dict(chunk_size=16, output="stored")):
        with pytest.raises(ValueError, match="num_stages=1"):
            chunk_kda_fwd(b["q"], b["k"], b["v"], x["g"], x["beta"], num_stages=1, **kw)
    # fp32 inputs, tf32 state products and the 16-token fused kernel (no such state kernel) still accept it
    chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], num_stages=1)
    chunk_kda_fwd(b["q"], b["k"], b["v"], x["g"], x["beta"], num_stages=1, state_dot="tf32")
    chunk_kda_fwd(b["q"], b["k"], b["v"], x["g"], x["beta"], num_stages=1, chunk_size=16, output="fused")


def test_chunk64_correlated_keys_bf16():
    """Ill-conditioned UT system (repeated keys, beta -> 1, no decay) across sub-tiles and chunks, bf16 inputs:
    the tf32 products of the block forward substitution must keep the 2e-2 rule."""
    x = make_inputs(T=130, K=32, V=32, with_h0=True, seed=5)
    k = R.l2norm(x["k"][:, :1].expand_as(x["k"]) + 0.01 * x["k"]).bfloat16()
    q, v = x["q"].bfloat16(), x["v"].bfloat16()
    beta = torch.full_like(x["beta"], 0.999).bfloat16()
    g = torch.zeros_like(x["g"])
    o, S = chunk_kda_fwd(q, k, v, g, beta, initial_state=x["h0"], output_final_state=True, chunk_size=64)
    o_r, S_r = R.fused_recurrent_kda(q.float(), k.float(), v.float(), g, beta.float(), initial_state=x["h0"],
                                     output_final_state=True)
    assert rel_err(o, o_r) <= 2e-2 and rel_err(S, S_r) <= 2e-2


# --------------------------------------------------------------------------- #
# output="stored": the state kernel stores h (state at each chunk start) and u = u0 - w S; a parallel kernel
# computes o = qg h + Aqk u. Tolerance: the rule above against the reference; against the fused path of the
# same chunk size <= 1e-4 (fp32) / 1e-2 (bf16: the paths differ only in which intermediates are stored in
# bf16, measured ~2e-3).
# --------------------------------------------------------------------------- #
def _stored_and_fused(x, dtype, chunk_size, **kw):
    B, T, H, V = x["v"].shape
    outs = []
    for output in ("stored", "fused"):
        out = torch.full((B, T, H, V), float("nan"), dtype=dtype, device=DEVICE)
        o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                             output_final_state=True, out=out, chunk_size=chunk_size, output=output, **kw)
        assert o is out and torch.isfinite(o).all() and torch.isfinite(S).all()
        outs.append((o, S))
    return outs


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_stored_vs_reference_and_fused(T, dtype, chunk_size):
    """B = 2, two V-blocks in the state and the output kernels, non-zero initial state, NaN-poisoned out. tf32
    state products and fp32 buffers in both paths (the 16-token fused path has no other), so that the two
    differ only in what "stored" keeps; the bf16 defaults are held to the reference in the tests above."""
    x = make_inputs(T=T, K=16, V=32, with_h0=True, dtype=dtype, seed=200 + T, gate_shift=-5.0)
    (o, S), (o_f, S_f) = _stored_and_fused(x, dtype, chunk_size, block_v=16, out_block_v=16, state_dot="tf32",
                                           lowp_buffers=False, h_dtype=torch.float32)
    assert o.dtype == dtype and S.dtype == torch.float32 and S.shape == (2, 2, 16, 32)
    f = {n: x[n].float() for n in ("q", "k", "v", "g", "beta")}
    o_r, S_r = R.chunk_kda(f["q"], f["k"], f["v"], f["g"], f["beta"], initial_state=x["h0"], output_final_state=True)
    tol, tol_f = (1e-4, 1e-4) if dtype == torch.float32 else (2e-2, 1e-2)
    assert rel_err(o, o_r) <= tol and rel_err(S, S_r) <= tol
    assert rel_err(o, o_f) <= tol_f and rel_err(S, S_f) <= tol_f


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_stored_varlen_chunk_edges(dtype, chunk_size):
    """Boundaries on 16- and 64-token edges (16, 64, 128) and off them (1, 17, 130), an empty sequence;
    in-kernel gate, beta sigmoid and L2 norm; per-sequence initial states; K = V = 32, default tiles."""
    cu = [0, 1, 16, 17, 64, 64, 128, 130, 200]
    N, T = len(cu) - 1, cu[-1]
    x = make_inputs(B=1, T=T, K=32, V=32, with_h0=True, N=N, dtype=dtype, seed=210, gate_shift=-5.0)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    out = torch.full((1, T, 2, 32), float("nan"), dtype=dtype, device=DEVICE)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["z"], x["beta_raw"], initial_state=x["h0"],
                         output_final_state=True, cu_seqlens=cu_t, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
                         use_beta_sigmoid_in_kernel=True, out=out, chunk_size=chunk_size, output="stored",
                         out_num_stages=1, out_num_warps=2)
    assert o is out and torch.isfinite(out).all() and S.shape == (N, 2, 32, 32)
    o_r, S_r = R.chunk_kda(x["q"].float(), x["k"].float(), x["v"].float(), x["g"], torch.sigmoid(x["beta_raw"]),
                           initial_state=x["h0"], output_final_state=True, cu_seqlens=cu_t,
                           use_qk_l2norm_in_kernel=True)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel_err(o, o_r) <= tol and rel_err(S, S_r) <= tol
    assert torch.equal(S[4], x["h0"][4])  # the empty sequence passes its state through


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_stored_low_precision_buffers(chunk_size):
    """h_dtype=bf16 (stored states rounded) plus lowp_buffers (kd, Aqk, v_new in bf16): 3e-2 rule, as the
    other low-precision options; the final state never goes through h, only the output does."""
    x = make_inputs(T=130, K=32, V=32, with_h0=True, dtype=torch.bfloat16, seed=220, gate_shift=-5.0)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                         chunk_size=chunk_size, output="stored", h_dtype=torch.bfloat16, lowp_buffers=True)
    f = {n: x[n].float() for n in ("q", "k", "v", "g", "beta")}
    o_r, S_r = R.chunk_kda(f["q"], f["k"], f["v"], f["g"], f["beta"], initial_state=x["h0"], output_final_state=True)
    assert rel_err(o, o_r) <= 3e-2 and rel_err(S, S_r) <= 3e-2


def test_stored_correlated_keys_fp32():
    """Ill-conditioned UT system (repeated keys, beta -> 1, no decay): u = u0 - w S cancels heavily; the
    fp32 v_new buffer must keep the 1e-4 rule."""
    x = make_inputs(T=100, K=32, V=32, with_h0=True, seed=5)
    k = R.l2norm(x["k"][:, :1].expand_as(x["k"]) + 0.01 * x["k"])
    beta = torch.full_like(x["beta"], 0.999)
    g = torch.zeros_like(x["g"])
    o_r, S_r = R.fused_recurrent_kda(x["q"], k, x["v"], g, beta, initial_state=x["h0"], output_final_state=True)
    for chunk_size in (16, 64):
        o, S = chunk_kda_fwd(x["q"], k, x["v"], g, beta, initial_state=x["h0"], output_final_state=True,
                             chunk_size=chunk_size, output="stored")
        assert rel_err(o, o_r) <= 1e-4 and rel_err(S, S_r) <= 1e-4, chunk_size


def test_stored_empty_input_passes_state_through():
    x = make_inputs(T=1, with_h0=True, seed=230)
    e = {n: x[n][:, :0] for n in ("q", "k", "v", "g", "beta")}
    for chunk_size in (16, 64):
        o, S = chunk_kda_fwd(e["q"], e["k"], e["v"], e["g"], e["beta"], initial_state=x["h0"],
                             output_final_state=True, chunk_size=chunk_size, output="stored")
        assert o.shape == (2, 0, 2, 16) and torch.equal(S, x["h0"])


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_kda_stored_forward_and_gradients(chunk_size):
    """chunk_kda(output="stored") through autograd: forward and all gradients against the reference (the
    backward recomputes from the inputs, so it is the same whatever forward ran)."""
    x = make_inputs(T=33, with_h0=True, seed=240, gate_shift=-5.0)
    names = ("q", "k", "v", "g", "beta", "h0")
    ts = [x[n].clone().requires_grad_() for n in names]
    gen = torch.Generator().manual_seed(2)
    o_w = torch.randn(2, 33, 2, 16, generator=gen).to(DEVICE)
    s_w = torch.randn(2, 2, 16, 16, generator=gen).to(DEVICE)

    def ours(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, output="stored",
                         forward_options=dict(chunk_size=chunk_size, block_v=16))

    def ref(q, k, v, g, beta, h0):
        return R.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    _assert_forward_and_grads_match(ours, ref, names, ts, o_w, s_w)


def test_stored_bad_options_raise():
    x = make_inputs(T=10, V=32, seed=250)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="output"):
        chunk_kda_fwd(*args, output="parallel")
    with pytest.raises(ValueError, match="h_dtype"):
        chunk_kda_fwd(*args, output="stored", h_dtype=torch.float16)
    with pytest.raises(ValueError, match="out_block_v"):
        chunk_kda_fwd(*args, output="stored", out_block_v=24)
    with pytest.raises(ValueError, match="out_block_v"):
        chunk_kda_fwd(*args, output="stored", out_block_v=64)  # does not divide V = 32
    with pytest.raises(ValueError, match="output"):
        chunk_kda(*args, output="stored", forward_options=dict(output="fused"))
