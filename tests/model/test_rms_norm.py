"""`KimiK3RMSNorm` on CUDA (torch's fused `rms_norm`, one launch) against its CPU formula (fp32 maths, the weight's
own dtype), forward and backward. Needs a GPU: skipped on the CPU, where only the formula runs.

Tolerance rule (relative L2 error against the formula run on the same device): fp32 results 1e-6 (the same fp32
maths, summed in another order); bf16 results 2^-8, one bf16 rounding step: both compute the same value in fp32 up
to summation order, so a bf16 result can only land one ulp away where that value sits near a rounding boundary.
Measured: fp32 at most 6e-8 (H200, twenty-fourth session); bf16 outputs 0 (H200)."""

import pytest
import torch

from transformers_k3.modeling_kimi_k3 import KimiK3RMSNorm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused branch runs on CUDA tensors only")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_cuda_branch_matches_the_formula(x_dtype, w_dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    norm = KimiK3RMSNorm(7168).cuda().to(w_dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(7168, device="cuda", generator=g))
    x = (3 * torch.randn(3, 5, 7168, device="cuda", generator=g)).to(x_dtype).requires_grad_()
    y = norm(x)
    assert y.dtype == x_dtype
    dy = torch.randn(y.shape, device="cuda", generator=g).to(x_dtype)
    dx, dw = torch.autograd.grad(y, (x, norm.weight), dy)

    xf = x.float()
    want = (norm.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5))).to(x_dtype)
    dx_want, dw_want = torch.autograd.grad(want, (x, norm.weight), dy)
    errs = {"y": (_rel(y, want), y.dtype), "dx": (_rel(dx, dx_want), dx.dtype), "dw": (_rel(dw, dw_want), dw.dtype)}
    for name, (err, dtype) in errs.items():
        assert err <= (1e-6 if dtype == torch.float32 else 2**-8), f"{name}: rel err {err:.2e} ({dtype}); all: {errs}"
