"""The KDA layer's fused inference kernels against their torch references: the short-conv decode step
(`short_conv.triton_conv`) and the gated output norm (`gated_norm.triton_gated_norm`), plus the dispatch rules.
Runs under `TRITON_INTERPRET=1` on the CPU (set in conftest) and compiled on CUDA.

Tolerance rule: fp32 inputs match the fp32 reference to 1e-5 relative; bf16 outputs to 1e-2 (one bf16 rounding
of fp32 arithmetic in both). Conv states are copies of inputs: equal exactly. The wrappers' output buffers are
poisoned with NaN (torch.empty / empty_like patched), so an element the kernel leaves unwritten fails.
"""

import pytest
import torch

from helpers import rel_err
from k3_kernels import dispatch
from k3_kernels.gated_norm.reference import gated_rms_norm
from k3_kernels.short_conv.reference import causal_conv1d

pytest.importorskip("triton")
from k3_kernels.gated_norm.triton_gated_norm import gated_rms_norm_triton  # noqa: E402
from k3_kernels.short_conv.triton_conv import causal_conv1d_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def poisoned(monkeypatch):
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*a, **k):
        t = empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_empty_like(*a, **k):
        t = empty_like(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    monkeypatch.setattr(torch, "empty_like", nan_empty_like)


@pytest.mark.parametrize("B,T,D,W", [(1, 1, 37, 4), (3, 2, 300, 4), (2, 5, 64, 2), (2, 0, 16, 4), (1, 16, 513, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_step_matches_reference(B, T, D, W, dtype, activation, poisoned):
    g = torch.Generator().manual_seed(B * 100 + T * 10 + W)
    x = torch.randn(B, T, D, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(D, 1, W, generator=g).to(DEVICE)  # nn.Conv1d's depthwise layout, fp32
    state = torch.randn(B, D, W - 1, generator=g).to(DEVICE)
    y, s = causal_conv1d_step(x, w, state, activation=activation)
    y_ref, s_ref = causal_conv1d(x, w, initial_state=state, output_final_state=True, activation=activation)
    assert y.dtype == x.dtype and y.shape == y_ref.shape and s.dtype == torch.float32
    if T:
        assert not y.isnan().any()
        assert rel_err(y.float(), y_ref.float()) <= (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(s, s_ref)  # the last W-1 inputs, copied


def test_conv_step_leaves_the_input_state_and_chains():
    """Two steps of one token equal one call on both tokens; the caller's state is not modified (rollback)."""
    g = torch.Generator().manual_seed(0)
    B, D, W = 2, 40, 4
    x = torch.randn(B, 2, D, generator=g).to(DEVICE)
    w = torch.randn(D, W, generator=g).to(DEVICE)
    state = torch.randn(B, D, W - 1, generator=g).to(DEVICE)
    before = state.clone()
    y1, s1 = causal_conv1d_step(x[:, :1], w, state)
    y2, s2 = causal_conv1d_step(x[:, 1:], w, s1)
    y, s = causal_conv1d_step(x, w, state)
    assert torch.equal(state, before)
    assert torch.allclose(torch.cat([y1, y2], 1), y, rtol=1e-6, atol=1e-6) and torch.equal(s2, s)


def test_conv_step_bad_inputs():
    x = torch.zeros(2, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_step(x, torch.zeros(7, 4, device=DEVICE))
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d_step(x, torch.zeros(8, 4, device=DEVICE), torch.zeros(2, 8, 2, device=DEVICE))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_step(x, torch.zeros(8, 4, device=DEVICE), activation="gelu")


@pytest.mark.parametrize("shape", [(1, 1, 96, 128), (3, 2, 5, 128), (2, 7, 3, 48), (0, 1, 4, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_matches_reference(shape, dtype, poisoned):
    g = torch.Generator().manual_seed(sum(shape))
    o = (torch.randn(*shape, generator=g) * 3).to(DEVICE)  # the KDA output (fp32 or the model dtype)
    gate = torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE)
    got = gated_rms_norm_triton(o.to(dtype), gate, w, 1e-5)
    want = gated_rms_norm(o.to(dtype).double(), gate.double(), w.double(), 1e-5)  # fp64 reference of the same math
    assert got.dtype == dtype and got.shape == o.shape
    if got.numel():
        assert not got.isnan().any()
        assert rel_err(got, want) <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_gated_norm_bad_inputs():
    with pytest.raises(ValueError, match="must match"):
        gated_rms_norm_triton(torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 7, device=DEVICE),
                              torch.ones(8, device=DEVICE), 1e-5)


def test_dispatch_rules():
    """torch / fla / CPU tensors keep the references; an explicit 'triton' without CUDA raises; gradients keep the
    references under every backend (the fused kernels have no backward)."""
    x = torch.randn(1, 1, 8)
    w, s = torch.randn(8, 4), torch.randn(1, 8, 3)
    assert not dispatch._fused_inference("torch", "cuda", x)
    assert not dispatch._fused_inference("fla", "cuda", x)
    assert not dispatch._fused_inference("auto", "cpu", x)
    with pytest.raises(RuntimeError, match="kda_backend='triton'"):
        dispatch.causal_conv1d(x, w, s, True, backend="triton")
    y, st = dispatch.causal_conv1d(x, w, s, True, backend="auto")  # CPU: the reference
    y_ref, st_ref = causal_conv1d(x, w, initial_state=s, output_final_state=True)
    assert torch.equal(y, y_ref) and torch.equal(st, st_ref)
    if torch.cuda.is_available():
        xr = x.cuda().requires_grad_()
        assert not dispatch._fused_inference("triton", "cuda", xr)
        with torch.no_grad():
            assert dispatch._fused_inference("triton", "cuda", xr)
