import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from k3_kernels.attnres import attn_res
from k3_kernels.situ import situ_glu


# ---------------------------------------------------------------- SiTU-GLU
def test_situ_matches_swiglu_near_zero():
    g = torch.Generator().manual_seed(0)
    gate = (torch.rand(4096, generator=g) * 2 - 1) * 0.05
    up = (torch.rand(4096, generator=g) * 2 - 1) * 0.05
    out = situ_glu(gate, up)
    ref = F.silu(gate) * up
    assert torch.allclose(out, ref, rtol=1e-3, atol=1e-9)


def test_situ_bounded_and_dtype():
    x = torch.tensor([-1e30, -1e4, -50.0, 0.0, 50.0, 1e4, 1e30])
    gate, up = torch.meshgrid(x, x, indexing="ij")
    out = situ_glu(gate, up)
    assert torch.isfinite(out).all() and out.abs().max() <= 100.0
    assert torch.allclose(situ_glu(torch.tensor(1e30), torch.tensor(1e30)), torch.tensor(100.0))
    bf = situ_glu(gate.bfloat16(), up.bfloat16())
    assert bf.dtype == torch.bfloat16 and bf.float().abs().max() <= 100.0
    assert situ_glu(gate, up, beta=2.0, linear_beta=3.0).abs().max() <= 6.0


def test_situ_formula():
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(64, generator=g) * 10, torch.randn(64, generator=g) * 30
    ref = 4 * torch.tanh(gate / 4) * torch.sigmoid(gate) * 25 * torch.tanh(up / 25)
    assert torch.allclose(situ_glu(gate, up), ref, rtol=1e-6, atol=1e-6)


def test_situ_gradients_large_inputs():
    g = torch.Generator().manual_seed(2)
    sign = torch.where(torch.rand(256, generator=g) < 0.5, -1.0, 1.0)
    gate = (sign * (8 + 22 * torch.rand(256, generator=g))).requires_grad_()
    up = (sign.flip(0) * (8 + 40 * torch.rand(256, generator=g))).requires_grad_()
    situ_glu(gate, up).sum().backward()
    for grad in (gate.grad, up.grad):
        assert torch.isfinite(grad).all() and (grad != 0).all()


# ---------------------------------------------------------------- AttnRes
def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _naive(cands, q, w, eps=1e-5):
    v = torch.stack(cands).double()
    k = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    a = torch.softmax((k * (w.flatten() * q.flatten()).double()).sum(-1), 0)
    return (a[..., None] * v).sum(0)


def test_attnres_zero_query_is_mean():
    cands = [_rand(2, 5, 16, seed=i) for i in range(4)]
    out = attn_res(cands, torch.zeros(1, 16), _rand(16, seed=9))
    assert torch.allclose(out, torch.stack(cands).mean(0), atol=1e-6)


def test_attnres_single_candidate_is_identity():
    v = _rand(3, 16, seed=1, dtype=torch.bfloat16)
    out = attn_res([v], _rand(16, seed=2), _rand(16, seed=3))
    assert out.dtype == torch.bfloat16 and torch.equal(out, v)


def test_attnres_matches_formula_list_and_stacked():
    cands = [_rand(2, 3, 32, seed=i) * (i + 1) for i in range(5)]
    q, w = _rand(1, 32, seed=10), _rand(32, seed=11)
    out_list = attn_res(cands, q, w)
    out_stack = attn_res(torch.stack(cands), q.flatten(), w)
    assert torch.equal(out_list, out_stack)
    assert torch.allclose(out_list.double(), _naive(cands, q, w), rtol=1e-5, atol=1e-5)
    bf = attn_res([c.bfloat16() for c in cands], q, w)
    assert bf.dtype == torch.bfloat16


def test_attnres_gradcheck():
    cands = tuple(_rand(2, 8, seed=i, dtype=torch.float64).requires_grad_() for i in range(3))
    q = _rand(1, 8, seed=5, dtype=torch.float64).requires_grad_()
    w = (1 + 0.1 * _rand(8, seed=6, dtype=torch.float64)).requires_grad_()

    def fn(a, b, c, q, w):
        return attn_res([a, b, c], q, w)

    assert torch.autograd.gradcheck(fn, (*cands, q, w), eps=1e-6, atol=1e-5)


def test_attnres_errors():
    with pytest.raises(ValueError):
        attn_res([], torch.zeros(4), torch.ones(4))
    with pytest.raises(ValueError):
        attn_res([torch.zeros(2, 4)], torch.zeros(5), torch.ones(4))
    with pytest.raises(ValueError):
        attn_res([torch.zeros(2, 4), torch.zeros(3, 4)], torch.zeros(4), torch.ones(4))


def _load_fla_naive():
    # Load fla/ops/attnres/naive.py by path: importing the `fla` package itself costs seconds on CPU.
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "attnres", "naive.py")
    if not os.path.exists(path):
        pytest.skip("fla has no ops/attnres/naive.py")
    pytest.importorskip("einops")
    mod_spec = importlib.util.spec_from_file_location("_fla_attnres_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.naive_attnres


def test_attnres_matches_fla_naive():
    naive_attnres = _load_fla_naive()
    cands = [_rand(2, 7, 64, seed=i) * (1 + i) for i in range(4)]
    q, w = _rand(1, 64, seed=20), 1 + 0.1 * _rand(64, seed=21)
    ours = attn_res(cands, q, w, eps=1e-5)
    # fold the norm weight into the query, fla's norm weight = ones
    theirs = naive_attnres((q.flatten() * w), cands, torch.ones(64), rms_eps=1e-5)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    # and with fla's own norm weight
    theirs2 = naive_attnres(q.flatten(), cands, w, rms_eps=1e-5)
    assert torch.allclose(ours, theirs2, rtol=1e-5, atol=1e-5)
