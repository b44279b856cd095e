"""Tests for the pure-PyTorch KDA reference kernels.

Tolerance rule: relative error ``||a - b|| / ||b||`` (Frobenius norm over the whole
tensor). fp32 vs fp32 reference: 1e-5. bf16 inputs: 2e-2. Gradients (fp32): 1e-4.
"""

import inspect

import pytest
import torch

from k3_kernels.kda import chunk_kda, fused_recurrent_kda, kda_gate, l2norm

TS = [1, 15, 16, 17, 63, 64, 65, 100]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(B=2, T=16, H=2, K=16, V=16, dtype=torch.float32, seed=0, with_h0=False, N=None):
    g_ = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g_)
    k = l2norm(torch.randn(B, T, H, K, generator=g_))  # keep the delta rule well conditioned
    v = torch.randn(B, T, H, V, generator=g_)
    z = torch.randn(B, T, H, K, generator=g_)
    A_log = torch.randn(H + 3, generator=g_) * 0.5  # padded: only first H used
    dt_bias = torch.randn(H * K, generator=g_) * 0.5
    g = kda_gate(z, A_log, dt_bias)
    beta = torch.rand(B, T, H, generator=g_).sigmoid()
    h0 = torch.randn(N or B, H, K, V, generator=g_) * 0.5 if with_h0 else None
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    return q, k, v, g, beta, h0


def test_gate_vs_fla():
    gate_mod = pytest.importorskip("fla.ops.kda.gate")
    gen = torch.Generator().manual_seed(1)
    B, T, H, K = 2, 7, 3, 16
    z = torch.randn(B, T, H, K, generator=gen)
    A_log = torch.randn(H + 5, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    g = kda_gate(z, A_log, dt_bias, lower_bound=-5.0)
    ref = gate_mod.naive_kda_lowerbound_gate(z, A_log[:H], dt_bias, lower_bound=-5.0)
    assert g.dtype == torch.float32 and g.shape == (B, T, H, K)
    assert rel(g, ref) < 1e-6
    assert (g <= 0).all() and (g >= -5).all()
    # bf16 z: maths in fp32
    gb = kda_gate(z.bfloat16(), A_log, dt_bias)
    assert gb.dtype == torch.float32
    assert rel(gb, gate_mod.naive_kda_lowerbound_gate(z.bfloat16(), A_log[:H], dt_bias)) < 1e-6


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_vs_fla_naive_and_recurrent(T, with_h0):
    naive = pytest.importorskip("fla.ops.kda.naive")
    q, k, v, g, beta, h0 = make_inputs(T=T, with_h0=with_h0, seed=T)
    o_c, S_c = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_r, S_r = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_n, S_n = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o_c.shape == (2, T, 2, 16) and S_c.shape == (2, 2, 16, 16) and S_c.dtype == torch.float32
    assert rel(o_r, o_n) < 1e-5 and rel(S_r, S_n) < 1e-5
    assert rel(o_c, o_n) < 1e-5 and rel(S_c, S_n) < 1e-5
    assert rel(o_c, o_r) < 1e-5 and rel(S_c, S_r) < 1e-5


@pytest.mark.parametrize("T", [17, 65])
def test_chunk_vs_fla_naive_k32(T):
    naive = pytest.importorskip("fla.ops.kda.naive")
    q, k, v, g, beta, h0 = make_inputs(T=T, K=32, V=16, with_h0=True, seed=3)
    o_c, S_c = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_n, S_n = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert S_c.shape == (2, 2, 32, 16)
    assert rel(o_c, o_n) < 1e-5 and rel(S_c, S_n) < 1e-5


def _transformers_chunk():
    mod = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    # The decorated function may dispatch to fla / hub kernels; unwrap to the torch implementation.
    fn = mod.chunk_kimi_delta_attention
    if isinstance(fn, torch.nn.Module):
        # transformers >= 5.25 with the `kernels` library: a hub-kernel wrapper module whose forward closes over
        # the torch function.
        cells = [c.cell_contents for c in (type(fn).forward.__closure__ or ())]
        found = [c for c in cells if inspect.isfunction(c)
                 and "modeling_kimi_linear" in (inspect.getsourcefile(inspect.unwrap(c)) or "")]
        if not found:
            pytest.skip("transformers' kimi_linear torch chunk function is not reachable through its kernel wrapper")
        fn = found[0]
    fn = inspect.unwrap(fn)
    assert "modeling_kimi_linear" in inspect.getsourcefile(fn)
    return fn


@pytest.mark.parametrize("T", [1, 17, 64, 100])
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_vs_transformers(T, with_h0):
    fn = _transformers_chunk()
    q, k, v, g, beta, h0 = make_inputs(T=T, with_h0=with_h0, seed=10 + T)
    o_c, S_c = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_t, S_t = fn(q, k, v, g, beta, chunk_size=64, initial_state=h0, output_final_state=True)
    assert rel(o_c, o_t) < 1e-5 and rel(S_c, S_t) < 1e-5


def test_transformers_l2norm_in_kernel():
    fn = _transformers_chunk()
    q, k, v, g, beta, _ = make_inputs(T=33, seed=5)
    k = k * 3.0
    o_c, S_c = chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_t, S_t = fn(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel(o_c, o_t) < 1e-5 and rel(S_c, S_t) < 1e-5


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_l2norm_in_kernel_equals_outside(fn):
    q, k, v, g, beta, h0 = make_inputs(T=40, with_h0=True, seed=7)
    q, k = q * 2.5, k * 4.0 + 0.3
    o1, S1 = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o2, S2 = fn(l2norm(q), l2norm(k), v, g, beta, initial_state=h0, output_final_state=True)
    assert rel(o1, o2) < 1e-6 and rel(S1, S2) < 1e-6


def test_chunk_sizes_agree():
    q, k, v, g, beta, h0 = make_inputs(T=50, with_h0=True, seed=8)
    o_r, S_r = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for cs in (1, 7, 16, 32):
        o_c, S_c = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=cs)
        assert rel(o_c, o_r) < 1e-5 and rel(S_c, S_r) < 1e-5


def test_custom_scale():
    q, k, v, g, beta, _ = make_inputs(T=20, seed=9)
    o_c = chunk_kda(q, k, v, g, beta, scale=0.37)[0]
    o_r = fused_recurrent_kda(q, k, v, g, beta, scale=0.37)[0]
    assert rel(o_c, o_r) < 1e-5
    assert chunk_kda(q, k, v, g, beta)[1] is None


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
@pytest.mark.parametrize("with_h0", [False, True])
def test_varlen(fn, with_h0):
    cu = [0, 1, 17, 80, 100]
    N = len(cu) - 1
    q, k, v, g, beta, h0 = make_inputs(B=1, T=100, with_h0=with_h0, N=N, seed=11)
    o, S = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True,
              cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    assert o.shape == (1, 100, 2, 16) and S.shape == (N, 2, 16, 16)
    for i in range(N):
        a, b = cu[i], cu[i + 1]
        h = h0[i : i + 1] if with_h0 else None
        o_i, S_i = fused_recurrent_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                       initial_state=h, output_final_state=True)
        assert rel(o[:, a:b], o_i) < 1e-5
        assert rel(S[i : i + 1], S_i) < 1e-5


def test_varlen_requires_b1():
    q, k, v, g, beta, _ = make_inputs(B=2, T=10)
    with pytest.raises(ValueError, match="B = 1"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 10]))


def test_bf16_chunk_vs_recurrent():
    q, k, v, g, beta, h0 = make_inputs(T=100, dtype=torch.bfloat16, with_h0=True, seed=12)
    o_c, S_c = chunk_kda(q, k, v, g, beta, initial_state=h0.bfloat16(), output_final_state=True)
    o_r, S_r = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0.bfloat16(), output_final_state=True)
    assert o_c.dtype == torch.bfloat16 and S_c.dtype == torch.float32
    assert rel(o_c.float(), o_r.float()) < 2e-2 and rel(S_c, S_r) < 2e-2


def test_backward_matches_recurrent():
    q, k, v, g, beta, h0 = make_inputs(T=37, with_h0=True, seed=13)
    g_ = torch.Generator().manual_seed(14)
    do = torch.randn(2, 37, 2, 16, generator=g_)
    dS = torch.randn(2, 2, 16, 16, generator=g_)

    def grads(fn):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
        o, S = fn(*xs[:5], initial_state=xs[5], output_final_state=True)
        ((o * do).sum() + (S * dS).sum()).backward()
        return [x.grad for x in xs]

    for name, a, b in zip("q k v g beta h0".split(), grads(chunk_kda), grads(fused_recurrent_kda)):
        assert rel(a, b) < 1e-4, name


def test_long_sequence():
    q, k, v, g, beta, h0 = make_inputs(B=1, T=1000, H=2, K=32, V=32, with_h0=True, seed=15)
    o_c, S_c = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_r, S_r = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel(o_c, o_r) < 1e-5 and rel(S_c, S_r) < 1e-5


def test_decode_continuation():
    """Prefill with chunk_kda then decode tokens with fused_recurrent_kda == one full pass."""
    q, k, v, g, beta, _ = make_inputs(T=70, seed=16)
    o_full, S_full = fused_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    o_p, S = chunk_kda(q[:, :67], k[:, :67], v[:, :67], g[:, :67], beta[:, :67], output_final_state=True)
    outs = [o_p]
    for t in range(67, 70):
        o_t, S = fused_recurrent_kda(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                     beta[:, t:t + 1], initial_state=S, output_final_state=True)
        outs.append(o_t)
    assert rel(torch.cat(outs, 1), o_full) < 1e-5 and rel(S, S_full) < 1e-5


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_bad_shapes(fn):
    q, k, v, g, beta, h0 = make_inputs(T=8, with_h0=True)
    with pytest.raises(ValueError, match="beta"):
        fn(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="k must"):
        fn(q, k[:, :4], v, g, beta)
    with pytest.raises(ValueError, match="v must"):
        fn(q, k, v[:, :, :1], g, beta)
    with pytest.raises(ValueError, match="g must"):
        fn(q, k, v, g[..., :3], beta)
    with pytest.raises(ValueError, match="initial_state"):
        fn(q, k, v, g, beta, initial_state=h0[:1])
    with pytest.raises(ValueError, match="q must"):
        fn(q[0], k, v, g, beta)


def test_gate_bad_shapes():
    z = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(z, torch.zeros(2), torch.zeros(12))
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(z, torch.zeros(3), torch.zeros(11))
