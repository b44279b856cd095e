"""Fused AttnRes (Triton) against the torch reference and fla's `naive_attnres`, forward and backward.

Runs on the CPU under `TRITON_INTERPRET=1` (set in conftest.py when there is no GPU) and compiled on CUDA.
Tolerance rule: fp32 inputs rel_err <= 1e-5 forward and 1e-4 backward against the fp32 reference; bf16 inputs
rel_err <= 1e-2 forward and 2e-2 backward (the incoming gradient is bf16 too) against the fp32
reference evaluated on the same bf16 values.
"""

import os

# TRITON_INTERPRET is set by conftest.py when there is no GPU (before triton is first imported).

import pytest
import torch

from helpers import rel_err
from k3_kernels.attnres.reference import attn_res

triton = pytest.importorskip("triton")
from k3_kernels.attnres.triton_attnres import attn_res_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(N, lead, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # Candidates of very different scales, as the depth stream has (embeddings vs. late-layer sums).
    scales = torch.logspace(-1, 1, N)
    cands = [(torch.randn(*lead, d, generator=g) * s).to(DEVICE, dtype).requires_grad_() for s in scales]
    q = (torch.randn(1, d, generator=g) * 0.5).to(DEVICE).requires_grad_()
    nw = (1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE).requires_grad_()
    return cands, q, nw


@pytest.mark.parametrize("N,lead,d", [(1, (5,), 16), (2, (3, 7), 100), (5, (13,), 200), (9, (2, 9), 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_forward_backward(N, lead, d, dtype):
    cands, q, nw = _inputs(N, lead, d, dtype, seed=N * 1000 + d)
    out = attn_res_triton(cands, q, nw, 1e-5)
    assert out.dtype == dtype and out.shape == (*lead, d)
    ref_in = [c.detach().float().requires_grad_() for c in cands]
    q_ref, nw_ref = q.detach().clone().requires_grad_(), nw.detach().clone().requires_grad_()
    ref = attn_res(ref_in, q_ref, nw_ref, 1e-5)
    tol_f, tol_b = (1e-5, 1e-4) if dtype == torch.float32 else (1e-2, 2e-2)
    assert torch.isfinite(out).all()
    assert rel_err(out.float(), ref) <= tol_f

    # The kernel's incoming gradient is in the output dtype: give the reference the same rounded values.
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(d)).to(DEVICE, dtype).float()
    (out.float() * dout).sum().backward()
    (ref * dout).sum().backward()
    for name, got, want in [("q", q.grad, q_ref.grad), ("norm_weight", nw.grad, nw_ref.grad)] + [
        (f"candidate {i}", c.grad, r.grad) for i, (c, r) in enumerate(zip(cands, ref_in))
    ]:
        assert got is not None and torch.isfinite(got).all(), name
        assert rel_err(got.float(), want) <= tol_b, (name, rel_err(got.float(), want))


def test_matches_fla_naive_attnres():
    fla_naive = pytest.importorskip("fla.ops.attnres.naive").naive_attnres
    cands, q, nw = _inputs(4, (6,), 48, torch.float32, seed=7)
    # fla scores RMSNorm(v; rms_weight) against the query: our weight product folds the same way.
    want = fla_naive(q.detach().flatten(), [c.detach() for c in cands], nw.detach(), rms_eps=1e-5)
    got = attn_res_triton([c.detach() for c in cands], q.detach(), nw.detach(), 1e-5)
    assert rel_err(got, want) <= 1e-5


def test_stacked_input_and_errors():
    cands, q, nw = _inputs(3, (4,), 32, torch.float32, seed=3)
    stacked = torch.stack([c.detach() for c in cands])
    assert torch.equal(attn_res_triton(stacked, q.detach(), nw.detach()), attn_res_triton(
        [c.detach() for c in cands], q.detach(), nw.detach()))
    with pytest.raises(ValueError, match="query_weight"):
        attn_res_triton(stacked, q.detach()[:, :16], nw.detach())
    with pytest.raises(ValueError, match="at most 16"):
        attn_res_triton(torch.zeros(17, 2, 32, device=DEVICE), q.detach(), nw.detach())
