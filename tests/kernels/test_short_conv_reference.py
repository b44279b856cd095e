"""Tests for the causal short-convolution reference.

Tolerance rule: relative error ``||a - b|| / ||b||``; fp32 vs fp32 reference: 1e-5.
"""

import pytest
import torch
import torch.nn.functional as F

from k3_kernels.short_conv import causal_conv1d


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(B=2, T=20, D=8, W=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=gen), torch.randn(D, W, generator=gen)


def ref_conv(x, w, activation="silu"):
    D, W = w.shape
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), w.unsqueeze(1), groups=D).transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("T", [1, 2, 3, 20])
def test_matches_conv1d(activation, T):
    x, w = make(T=T)
    y, S = causal_conv1d(x, w, activation=activation, output_final_state=True)
    assert y.shape == x.shape and S.shape == (2, 8, 3) and S.dtype == torch.float32
    assert rel(y, ref_conv(x, w, activation)) < 1e-5
    # final state = last W-1 inputs (zero-padded on the left when T < W-1)
    xp = F.pad(x.transpose(1, 2), (3, 0))
    assert torch.equal(S, xp[..., -3:])


def test_weight_3d_accepted():
    x, w = make()
    assert torch.equal(causal_conv1d(x, w)[0], causal_conv1d(x, w.unsqueeze(1))[0])


@pytest.mark.parametrize("a", [1, 2, 3, 5])
def test_state_continuation(a):
    x, w = make(T=12)
    y_full, S_full = causal_conv1d(x, w, output_final_state=True)
    y1, S1 = causal_conv1d(x[:, :a], w, output_final_state=True)
    y2, S2 = causal_conv1d(x[:, a:], w, initial_state=S1, output_final_state=True)
    assert rel(torch.cat([y1, y2], 1), y_full) < 1e-5
    assert torch.equal(S2, S_full)


def test_decode_steps_chained():
    x, w = make(T=10, seed=1)
    y_full, S_full = causal_conv1d(x, w, output_final_state=True)
    S, ys = None, []
    for t in range(10):
        y_t, S = causal_conv1d(x[:, t:t + 1], w, initial_state=S, output_final_state=True)
        ys.append(y_t)
    assert rel(torch.cat(ys, 1), y_full) < 1e-5
    assert torch.equal(S, S_full)


def test_varlen_no_leak():
    cu = [0, 1, 3, 10, 20]
    N = len(cu) - 1
    x, w = make(B=1, T=20, seed=2)
    h0 = torch.randn(N, 8, 3, generator=torch.Generator().manual_seed(3))
    for init in (None, h0):
        y, S = causal_conv1d(x, w, initial_state=init, output_final_state=True,
                             cu_seqlens=torch.tensor(cu, dtype=torch.int32))
        assert S.shape == (N, 8, 3)
        for i in range(N):
            a, b = cu[i], cu[i + 1]
            y_i, S_i = causal_conv1d(x[:, a:b], w, initial_state=None if init is None else init[i:i + 1],
                                     output_final_state=True)
            assert rel(y[:, a:b], y_i) < 1e-5
            assert torch.equal(S[i:i + 1], S_i)


def test_bf16_output_dtype():
    x, w = make()
    y = causal_conv1d(x.bfloat16(), w)[0]
    assert y.dtype == torch.bfloat16
    assert rel(y.float(), ref_conv(x.bfloat16().float(), w)) < 1e-2


def test_bad_shapes():
    x, w = make()
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, w[:3])
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, w, initial_state=torch.zeros(2, 8, 2))
    with pytest.raises(ValueError, match="x must"):
        causal_conv1d(x[0], w)
    with pytest.raises(ValueError, match="B = 1"):
        causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 5, 20]))
