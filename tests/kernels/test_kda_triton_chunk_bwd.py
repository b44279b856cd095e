"""Triton chunked KDA backward (triton_chunk_bwd.py) against torch autograd through the torch reference.

Runs on the CPU under `TRITON_INTERPRET=1` (set in conftest.py when there is no GPU) and compiled on CUDA.
Tolerance rule (rel_err = max|a - b| / max|b|, per gradient): fp32 inputs <= 1e-4 against autograd through
the torch reference (which computes in fp32) and through fla's token loop ``naive_recurrent_kda`` (fp32); bf16
inputs (or bf16 state storage) <= 2e-2 against the reference evaluated on the same bf16 values; the
ill-conditioned case <= 1e-4 against fp64 autograd of a token-loop recurrence; the finite-difference check of a
directional derivative of that fp64 recurrence (independent of autograd and of the reference) <= 1e-4
relative.
"""

# TRITON_INTERPRET is set by conftest.py when there is no GPU (before triton is first imported).

import os
import sys

import pytest
import torch

from helpers import rel_err
from k3_kernels.kda import reference as R

triton = pytest.importorskip("triton")
from k3_kernels.kda import triton_chunk as TC  # noqa: E402
from k3_kernels.kda.triton_chunk_bwd import chunk_kda_bwd  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CORE = ("q", "k", "v", "g", "beta", "h0")
BWD_CHUNK = 16  # set by the fixture below


@pytest.fixture(autouse=True, params=[16, 64], ids=["bwd16", "bwd64"])
def bwd_chunk(request, monkeypatch):
    """Every test runs on both backward paths: 16-token tiles, and 64-token chunks built from four sub-tiles
    (chunk_kda_bwd's chunk_size; through chunk_kda, _ChunkKDAFunction.bwd_options)."""
    monkeypatch.setattr(sys.modules[__name__], "BWD_CHUNK", request.param)
    monkeypatch.setattr(TC._ChunkKDAFunction, "bwd_options", {"chunk_size": request.param})
    return request.param


def make_core(B=2, T=16, H=2, K=16, V=32, seed=0, N=None, with_h0=True):
    """Post-activation fp32 inputs: unit keys, -5 <= g <= 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    N = N or B
    d = dict(
        q=torch.randn(B, T, H, K, generator=gen),
        k=R.l2norm(torch.randn(B, T, H, K, generator=gen)),
        v=torch.randn(B, T, H, V, generator=gen),
        g=-5.0 * torch.rand(B, T, H, K, generator=gen),
        beta=torch.rand(B, T, H, generator=gen),
        h0=torch.randn(N, H, K, V, generator=gen) * 0.5 if with_h0 else None,
        do=torch.randn(B, T, H, V, generator=gen),
        dht=torch.randn(N, H, K, V, generator=gen),
    )
    return {n: None if t is None else t.to(DEVICE) for n, t in d.items()}


def ref_grads(x, cu_seqlens=None, scale=None):
    """Autograd through the (fp32) torch reference: grads of <o, do> + <S_T, dht>."""
    names = [n for n in CORE if x[n] is not None]
    ts = {n: x[n].clone().requires_grad_() for n in names}
    o, S = R.chunk_kda(ts["q"], ts["k"], ts["v"], ts["g"], ts["beta"], scale=scale, initial_state=ts.get("h0"),
                       output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=16)
    got = torch.autograd.grad([o, S], [ts[n] for n in names], [x["do"], x["dht"]])
    return dict(zip(names, got))


def ours(x, dtype=torch.float32, cu_seqlens=None, scale=None, **kw):
    c = {n: None if x[n] is None else x[n].to(dtype) for n in ("q", "k", "v", "do")}
    dq, dk, dv, dg, db, dh0, dA, ddt = chunk_kda_bwd(
        c["q"], c["k"], c["v"], x["g"].float(), x["beta"].to(dtype), c["do"], scale=scale,
        initial_state=None if x["h0"] is None else x["h0"].float(), dht=x["dht"].float(), cu_seqlens=cu_seqlens,
        chunk_size=BWD_CHUNK, **kw,
    )
    assert dA is None and ddt is None  # no in-kernel gate
    # each gradient in its input's dtype; compared in fp32
    for grad, want in ((dq, dtype), (dk, dtype), (dv, dtype), (db, dtype), (dg, torch.float32)):
        assert grad.dtype == want
    return dict(q=dq.float(), k=dk.float(), v=dv.float(), g=dg, beta=db.float(), h0=dh0)


def assert_close(got, want, tol):
    for n, b in want.items():
        a = got[n]
        assert a is not None and a.dtype == torch.float32 and a.shape == b.shape, n
        assert torch.isfinite(a).all(), n
        assert rel_err(a, b) <= tol, (n, rel_err(a, b))


@pytest.mark.parametrize("T", [1, 15, 16, 17, 33, 63, 64, 65, 100, 1000])
def test_core_vs_autograd_reference(T):
    # V = 32 with block_v = chunk_block_v = 16: two V-blocks, so the sums over V in the chunk kernel count
    x = make_core(T=T, seed=T)
    assert_close(ours(x, block_v=16), ref_grads(x), 1e-4)


@pytest.mark.parametrize("block_v,chunk_block_v", [(64, 16), (16, 64)])
def test_core_tilings(block_v, chunk_block_v):
    x = make_core(B=1, T=35, V=64, seed=3)
    assert_close(ours(x, block_v=block_v, chunk_block_v=chunk_block_v), ref_grads(x), 1e-4)


def test_core_no_initial_state_other_dims_and_scale():
    x = make_core(T=40, K=32, V=16, with_h0=False, seed=2)
    got = ours(x, scale=0.37)
    assert got["h0"] is None
    assert_close(got, ref_grads(x, scale=0.37), 1e-4)


@pytest.mark.parametrize("with_h0", [False, True])
def test_core_varlen_no_leakage(with_h0):
    cu = [0, 1, 17, 17, 50, 83]  # boundaries off chunk multiples, one empty sequence
    x = make_core(B=1, T=83, N=len(cu) - 1, with_h0=with_h0, seed=7)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    got = ours(x, cu_seqlens=cu_t)
    assert_close(got, ref_grads(x, cu_seqlens=cu_t), 1e-4)
    if with_h0:
        # the empty sequence passes its state through: dh0 = dht exactly
        assert torch.equal(got["h0"][2], x["dht"][2].float())
    # no leakage: a do that is zero outside sequence 3 and dht zero except sequence 3 give zero grads outside it
    y = dict(x)
    y["do"] = torch.zeros_like(x["do"])
    y["do"][:, 17:50] = x["do"][:, 17:50]
    y["dht"] = torch.zeros_like(x["dht"])
    y["dht"][3] = x["dht"][3]
    g2 = ours(y, cu_seqlens=cu_t)
    for n in ("q", "k", "v", "g", "beta"):
        outside = torch.cat([g2[n][:, :17], g2[n][:, 50:]], dim=1)
        assert (outside == 0).all(), n


def test_core_bf16_inputs_and_bf16_state_storage():
    x = make_core(T=33, seed=11)
    xb = {n: None if t is None else (t.to(torch.bfloat16).float() if n in ("q", "k", "v", "do", "beta") else t)
          for n, t in x.items()}
    want = ref_grads(xb)
    assert_close(ours(x, dtype=torch.bfloat16), want, 2e-2)
    assert_close(ours(xb, state_dtype=torch.bfloat16), want, 2e-2)


def test_core_extreme_gate_bound():
    """Every step at the -5 bound: e^{+-G} span e^{+-80} inside a tile, gradients must stay finite and right."""
    x = make_core(T=48, seed=13)
    x["g"] = torch.full_like(x["g"], -5.0)
    x["g"][..., 0] = 0.0
    assert_close(ours(x), ref_grads(x), 1e-4)


def _recurrent_fp64(q, k, v, g, beta, h0, scale):
    """The KDA recurrence token by token in fp64 (the torch reference upcasts only to fp32)."""
    S, outs = h0, []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None]  # [B, H, K, V]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))
    return torch.stack(outs, dim=1), S


def test_finite_difference_directional_derivative():
    """Independent of autograd: <grad, d> vs a central difference of an fp64 recurrence's loss."""
    x = make_core(T=21, K=16, V=16, seed=17)
    got = ours(x)
    gen = torch.Generator().manual_seed(99)
    d = {n: torch.randn(x[n].shape, generator=gen, dtype=torch.float64).to(DEVICE) for n in CORE}
    do, dht = x["do"].double(), x["dht"].double()

    def loss(eps):
        y = {n: x[n].double() + eps * d[n] for n in CORE}
        o, S = _recurrent_fp64(y["q"], y["k"], y["v"], y["g"], y["beta"], y["h0"], 16 ** -0.5)
        return float((o * do).sum() + (S * dht).sum())

    eps = 1e-5
    fd = (loss(eps) - loss(-eps)) / (2 * eps)
    ana = float(sum((got[n].double() * d[n]).sum() for n in CORE))
    assert abs(ana - fd) <= 1e-4 * abs(fd), (ana, fd)


def test_core_vs_fla_naive_autograd():
    """External oracle: autograd through fla's token loop ``naive_recurrent_kda`` (fp32), across a 64-token chunk
    boundary, with an initial state and a final-state gradient."""
    naive = pytest.importorskip("fla.ops.kda.naive")
    x = make_core(T=70, seed=23)
    ts = {n: x[n].clone().requires_grad_() for n in CORE}
    o, S = naive.naive_recurrent_kda(ts["q"], ts["k"], ts["v"], ts["g"], ts["beta"], initial_state=ts["h0"],
                                     output_final_state=True)
    want = torch.autograd.grad([o, S], [ts[n] for n in CORE], [x["do"], x["dht"]])
    assert_close(ours(x), dict(zip(CORE, want)), 1e-4)


def test_correlated_keys_beta_one_vs_fp64_autograd():
    """Repeated keys, beta -> 1, no decay (the worst-conditioned UT system): against fp64 autograd of the
    token loop, so the oracle's own rounding does not enter."""
    x = make_core(T=48, V=16, seed=5)
    x["k"] = R.l2norm(x["k"][:, :1].expand_as(x["k"]) + 0.01 * x["k"])
    x["beta"] = torch.full_like(x["beta"], 0.999)
    x["g"] = torch.zeros_like(x["g"])
    ts = {n: x[n].double().requires_grad_() for n in CORE}
    o, S = _recurrent_fp64(ts["q"], ts["k"], ts["v"], ts["g"], ts["beta"], ts["h0"], 16 ** -0.5)
    want = torch.autograd.grad([o, S], [ts[n] for n in CORE], [x["do"].double(), x["dht"].double()])
    assert_close(ours(x), dict(zip(CORE, want)), 1e-4)


def test_core_bad_inputs_raise():
    x = make_core(T=8, seed=19)
    f = {n: x[n].float() for n in CORE}
    args = (f["q"], f["k"], f["v"], f["g"], f["beta"])
    with pytest.raises(ValueError, match="do must be"):
        chunk_kda_bwd(*args, x["do"].float()[..., :16])
    with pytest.raises(ValueError, match="dht must be"):
        chunk_kda_bwd(*args, x["do"].float(), initial_state=f["h0"], dht=f["h0"][:1])
    with pytest.raises(ValueError, match="state_dtype"):
        chunk_kda_bwd(*args, x["do"].float(), state_dtype=torch.float16)
    with pytest.raises(ValueError, match="block_v"):
        chunk_kda_bwd(*args, x["do"].float(), block_v=24)
    with pytest.raises(ValueError, match="chunk_block_v"):
        chunk_kda_bwd(*args, x["do"].float(), chunk_block_v=64)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_bwd(*args, x["do"].float(), chunk_size=32)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda_bwd(*args[:4], f["beta"][..., :1], x["do"].float())
    with pytest.raises(ValueError, match="g must satisfy"):
        chunk_kda_bwd(f["q"], f["k"], f["v"], f["g"] * 3.0, f["beta"], x["do"].float())
    with pytest.raises(ValueError, match="g must satisfy"):
        chunk_kda_bwd(f["q"], f["k"], f["v"], -f["g"], f["beta"], x["do"].float())
    y = make_core(T=8, K=24, seed=20)
    with pytest.raises(ValueError, match="powers of two"):
        chunk_kda_bwd(*(y[n].float() for n in ("q", "k", "v", "g", "beta", "do")))


def test_core_k3_head_dims():
    """K = V = 128 as in K3 (fp32: default block_v = 32 in the state-gradient carry, four V-blocks), one chunk and a
    partial one."""
    x = make_core(B=1, T=20, H=1, K=128, V=128, seed=29)
    assert_close(ours(x), ref_grads(x), 1e-4)


def test_core_k3_head_dims_bf16():
    """bf16 at K = V = 128: the default launches of the forward recompute's state kernel and of the state-gradient
    carry, one 128-wide V-block each, both carrying the transposed state; a full 64-chunk, a partial one and a
    non-zero initial state."""
    x = make_core(B=1, T=100, H=1, K=128, V=128, seed=30)
    xb = {n: None if t is None else (t.bfloat16().float() if n in ("q", "k", "v", "do", "beta") else t)
          for n, t in x.items()}
    assert_close(ours(x, dtype=torch.bfloat16), ref_grads(xb), 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_core_varlen_64_chunk_edges(dtype, bwd_chunk):
    """Sequences that end on and inside 64-chunks and 16-token sub-tiles, a 1-token one, the in-kernel gate
    saturated at the bound in half the channels (so G reaches -320 inside a 64-chunk), K = 32 in two channel
    slices of the 64-token kernels, two V-blocks."""
    cu = [0, 64, 65, 129, 176, 240, 304]
    x = make_core(B=1, T=cu[-1], K=32, N=len(cu) - 1, seed=71)
    x["g"][..., ::2] = -5.0
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    if dtype == torch.float32:
        want, tol = ref_grads(x, cu_seqlens=cu_t), 1e-4
    else:
        xb = {n: None if t is None else (t.to(dtype).float() if n in ("q", "k", "v", "do", "beta") else t)
              for n, t in x.items()}
        want, tol = ref_grads(xb, cu_seqlens=cu_t), 2e-2
    assert_close(ours(x, dtype=dtype, cu_seqlens=cu_t, block_v=16), want, tol)


def test_core_empty_sequence():
    x = make_core(T=1, seed=23)
    e = {n: x[n][:, :0].float() for n in ("q", "k", "v", "g", "beta", "do")}
    dq, dk, dv, dg, db, dh0, _, _ = chunk_kda_bwd(e["q"], e["k"], e["v"], e["g"], e["beta"], e["do"],
                                                  initial_state=x["h0"].float(), dht=x["dht"].float())
    assert dq.shape == (2, 0, 2, 16) and torch.equal(dh0, x["dht"].float())


# --------------------------------------------------------------------------------------------------------- #
# Through chunk_kda (autograd.Function): preprocessing chained by autograd, both flag sets used by the model
# --------------------------------------------------------------------------------------------------------- #
def make_raw(B=1, T=33, H=2, K=16, V=16, N=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    d = dict(
        q=torch.randn(B, T, H, K, generator=gen) * 2.0,
        k=torch.randn(B, T, H, K, generator=gen) * 3.0 + 0.3,
        v=torch.randn(B, T, H, V, generator=gen),
        z=torch.randn(B, T, H, K, generator=gen) * 2.0,
        beta_raw=torch.randn(B, T, H, generator=gen),
        A_log=torch.randn(H + 3, generator=gen) * 0.5,  # padded: only the first H used
        dt_bias=torch.randn(H * K, generator=gen) * 0.5,
        h0=torch.randn(N or B, H, K, V, generator=gen) * 0.5,
    )
    d = {n: t.to(DEVICE) for n, t in d.items()}
    for n in ("q", "k", "v"):
        d[n] = d[n].to(dtype)
    return d


def _loss_grads(fn, ts, o_w, s_w):
    o, S = fn(*ts)
    return torch.autograd.grad((o.float() * o_w).sum() + (S * s_w).sum(), ts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_kda_all_in_kernel_flags_varlen(dtype):
    cu = torch.tensor([0, 7, 40], dtype=torch.int32, device=DEVICE)
    x = make_raw(T=40, N=2, dtype=dtype, seed=31)
    names = ("q", "k", "v", "z", "beta_raw", "A_log", "dt_bias", "h0")
    ts = [x[n].clone().requires_grad_() for n in names]
    gen = torch.Generator().manual_seed(1)
    o_w = torch.randn(1, 40, 2, 16, generator=gen).to(DEVICE)
    s_w = torch.randn(2, 2, 16, 16, generator=gen).to(DEVICE)

    def triton_fn(q, k, v, z, b, A_log, dt_bias, h0):
        return TC.chunk_kda(q, k, v, z, b, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                            lower_bound=-5.0, use_beta_sigmoid_in_kernel=True)

    def ref_fn(q, k, v, z, b, A_log, dt_bias, h0):
        g = R.kda_gate(z, A_log, dt_bias)
        return R.chunk_kda(q.float(), k.float(), v.float(), g, torch.sigmoid(b.float()),
                           initial_state=h0, output_final_state=True, cu_seqlens=cu,
                           use_qk_l2norm_in_kernel=True, chunk_size=16)

    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for n, a, b in zip(names, _loss_grads(triton_fn, ts, o_w, s_w), _loss_grads(ref_fn, ts, o_w, s_w)):
        assert a is not None and a.dtype == x[n].dtype and torch.isfinite(a).all(), n
        assert rel_err(a, b) <= tol, (n, rel_err(a, b))


@pytest.mark.parametrize("l2", [False, True], ids=["no-flags", "l2norm-only"])
def test_chunk_kda_precomputed_gate_matches_reference_backward_impl(monkeypatch, l2):
    """Precomputed gate and beta (the model's call: L2 norm in kernel only, or no flag at all): the Triton
    backward agrees with the old reference-recompute one."""
    x = make_core(B=2, T=45, V=16, seed=41)
    if l2:
        x["q"], x["k"] = x["q"] * 3.0, x["k"] * 2.0 + 0.1  # not unit rows, so the norm's backward matters
    names = ("q", "k", "v", "g", "beta", "h0")
    ts = [x[n].clone().requires_grad_() for n in names]
    gen = torch.Generator().manual_seed(2)
    o_w = torch.randn(2, 45, 2, 16, generator=gen).to(DEVICE)
    s_w = torch.randn(2, 2, 16, 16, generator=gen).to(DEVICE)

    def fn(q, k, v, g, beta, h0):
        return TC.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                            use_qk_l2norm_in_kernel=l2)

    if os.environ.get("K3_KDA_CHUNK_BACKWARD") is None:
        assert TC._ChunkKDAFunction.backward_impl == "triton"  # the default
    monkeypatch.setattr(TC._ChunkKDAFunction, "backward_impl", "triton")
    got = _loss_grads(fn, ts, o_w, s_w)
    monkeypatch.setattr(TC._ChunkKDAFunction, "backward_impl", "reference")
    want = _loss_grads(fn, ts, o_w, s_w)
    for n, a, b in zip(names, got, want):
        assert rel_err(a, b) <= 1e-4, (n, rel_err(a, b))
    monkeypatch.setattr(TC._ChunkKDAFunction, "backward_impl", "nope")
    with pytest.raises(ValueError, match="backward_impl"):
        _loss_grads(fn, ts, o_w, s_w)


@pytest.mark.parametrize("l2,gate,bsig", [(True, False, False), (False, True, False), (False, False, True)],
                         ids=["l2norm", "gate", "beta-sigmoid"])
def test_chunk_kda_each_in_kernel_flag_alone(l2, gate, bsig):
    """Each in-kernel preprocessing step's backward on its own (the kernels' constexpr branches one at a
    time), T = 37 over three chunks, against autograd through the fp32 reference."""
    x = make_raw(T=37, seed=61)
    core = make_core(B=1, T=37, H=2, K=16, V=16, seed=62)  # post-activation inputs for the other steps
    raw = dict(q=x["q"] if l2 else core["q"], k=x["k"] if l2 else core["k"], v=x["v"],
               g=x["z"] if gate else core["g"], beta=x["beta_raw"] if bsig else core["beta"])
    if gate:
        raw.update(A_log=x["A_log"], dt_bias=x["dt_bias"])  # they take part only with the in-kernel gate
    names = list(raw)
    ts = [raw[n].clone().requires_grad_() for n in names]
    gen = torch.Generator().manual_seed(3)
    o_w = torch.randn(1, 37, 2, 16, generator=gen).to(DEVICE)
    s_w = torch.randn(1, 2, 16, 16, generator=gen).to(DEVICE)

    def triton_fn(q, k, v, g, b, A_log=None, dt_bias=None):
        return TC.chunk_kda(q, k, v, g, b, output_final_state=True, use_qk_l2norm_in_kernel=l2,
                            use_gate_in_kernel=gate, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=bsig)

    def ref_fn(q, k, v, g, b, A_log=None, dt_bias=None):
        gg = R.kda_gate(g, A_log, dt_bias) if gate else g
        bb = torch.sigmoid(b) if bsig else b
        return R.chunk_kda(q, k, v, gg, bb, output_final_state=True, use_qk_l2norm_in_kernel=l2, chunk_size=16)

    for n, a, b in zip(names, _loss_grads(triton_fn, ts, o_w, s_w), _loss_grads(ref_fn, ts, o_w, s_w)):
        assert a is not None and torch.isfinite(a).all(), n
        assert rel_err(a, b) <= 1e-4, (n, rel_err(a, b))


def test_chunk_kda_partial_requires_grad():
    """Only v and z need grads (frozen q, k, gate params, beta): None elsewhere, right values for those two."""
    x = make_raw(T=20, seed=51)
    v, z = x["v"].clone().requires_grad_(), x["z"].clone().requires_grad_()
    o, _ = TC.chunk_kda(x["q"], x["k"], v, z, x["beta_raw"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                        A_log=x["A_log"], dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True)
    dv, dz = torch.autograd.grad(o.sum(), (v, z))
    v2, z2 = x["v"].clone().requires_grad_(), x["z"].clone().requires_grad_()
    g = R.kda_gate(z2, x["A_log"], x["dt_bias"])
    o2, _ = R.chunk_kda(x["q"], x["k"], v2, g, torch.sigmoid(x["beta_raw"]),
                        use_qk_l2norm_in_kernel=True, chunk_size=16)
    dv2, dz2 = torch.autograd.grad(o2.sum(), (v2, z2))
    assert rel_err(dv, dv2) <= 1e-4 and rel_err(dz, dz2) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_kda_kept_buffers_same_bits(dtype, bwd_chunk, monkeypatch):
    """`_ChunkKDAFunction.keep_buffers`: the forward keeps what the 64-token backward would recompute; o, the final
    state and every gradient are bit for bit those of the recompute, and the backward recomputes nothing. The kept
    buffers come from the "stored" kernels, so the bits are compared against ``output="stored"``; the default
    fused loop sums o in another order (within 1e-6 for fp32 inputs; bf16 rounds its products alike)."""
    import k3_kernels.kda.triton_chunk_bwd as TB

    cu = torch.tensor([0, 29, 70], dtype=torch.int32, device=DEVICE)
    x = make_raw(T=70, N=2, dtype=dtype, seed=5)
    names = ("q", "k", "v", "z", "beta_raw", "A_log", "dt_bias", "h0")
    gen = torch.Generator().manual_seed(6)
    o_w = torch.randn(1, 70, 2, 16, generator=gen).to(DEVICE)
    s_w = torch.randn(2, 2, 16, 16, generator=gen).to(DEVICE)
    recomputes = []
    recompute = TB._recompute_for_backward
    monkeypatch.setattr(TB, "_recompute_for_backward", lambda *a, **k: recomputes.append(1) or recompute(*a, **k))

    def run(keep, output="stored"):
        monkeypatch.setattr(TC._ChunkKDAFunction, "keep_buffers", keep)
        ts = [x[n].clone().requires_grad_() for n in names]
        q, k, v, z, b, A_log, dt_bias, h0 = ts
        o, S = TC.chunk_kda(q, k, v, z, b, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                            lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, output=output)
        return (o, S, *torch.autograd.grad((o.float() * o_w).sum() + (S * s_w).sum(), ts))

    fused = run(False, output=None)
    recomputes.clear()
    plain = run(False)
    assert len(recomputes) == (1 if bwd_chunk == 64 else 0)
    kept = run(True)
    assert len(recomputes) == (1 if bwd_chunk == 64 else 0)  # kept: none more (bwd16 keeps nothing)
    for name, a, b in zip(("o", "S") + names, kept, plain):
        assert torch.equal(a, b), name
    for name, a, b in zip(("o", "S") + names, fused, plain):
        assert rel_err(a, b) <= (1e-6 if dtype == torch.float32 else 5e-3), name


def test_chunk_kda_kept_buffers_are_saved_tensors(bwd_chunk, monkeypatch):
    """The kept buffers go through autograd's saved-tensor hooks (so gradient checkpointing drops them with the
    inputs and its recomputed forward keeps them again), and under non-reentrant checkpointing the gradients are
    those of the plain recompute, with no recompute inside the backward (``output="stored"``, whose o the kept
    path reproduces bit for bit; see above)."""
    import k3_kernels.kda.triton_chunk_bwd as TB

    if bwd_chunk != 64:
        pytest.skip("only the 64-token backward takes kept buffers")

    x = make_raw(T=70, dtype=torch.float32, seed=7)
    names = ("q", "k", "v", "z", "beta_raw", "A_log", "dt_bias")
    recomputes = []
    recompute = TB._recompute_for_backward
    monkeypatch.setattr(TB, "_recompute_for_backward", lambda *a, **k: recomputes.append(1) or recompute(*a, **k))

    def layer(q, k, v, z, b, A_log, dt_bias):
        o, _ = TC.chunk_kda(q, k, v, z, b, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                            dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, output="stored")
        return o

    def run(keep, checkpoint=False):
        monkeypatch.setattr(TC._ChunkKDAFunction, "keep_buffers", keep)
        ts = [x[n].clone().requires_grad_() for n in names]
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.numel()) or t, lambda t: t):
            o = torch.utils.checkpoint.checkpoint(layer, *ts, use_reentrant=False) if checkpoint else layer(*ts)
        return sum(packed), torch.autograd.grad(o.pow(2).sum(), ts)

    plain_numel, plain = run(False)
    kept_numel, kept = run(True)
    assert kept_numel > plain_numel  # the buffers were saved through the hooks, not held on ctx
    del recomputes[:]
    _, ckpt = run(True, checkpoint=True)
    assert not recomputes  # the checkpoint's recomputed forward kept its buffers for the backward
    for name, a, b in zip(names, ckpt, plain):
        assert torch.equal(a, b), name


def test_keep_for_backward_needs_default_launches():
    x = make_raw(T=20)
    args = (x["q"], x["k"], x["v"], x["z"], torch.sigmoid(x["beta_raw"]))
    kw = dict(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], keep_for_backward=True)
    with pytest.raises(ValueError, match="default 64-token launches"):
        TC.chunk_kda_fwd(*args, block_v=16, **kw)
    with pytest.raises(ValueError, match="default 64-token launches"):
        TC.chunk_kda_fwd(*args, chunk_size=16, **kw)
    o, ht, kept = TC.chunk_kda_fwd(*args, output_final_state=True, **kw)
    with pytest.raises(ValueError, match="64-token backward only"):
        chunk_kda_bwd(*args, torch.randn_like(o), use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
                      chunk_size=16, kept=kept)
