"""The hardware ceilings the benchmark tables divide by, measured on the GPU that runs them.

`notes/performance.md` gives the H200's: a 4.27 TB/s device-to-device copy (bytes read + written) and about
790 TFLOP/s of dense bf16 matmul (989 on the spec sheet). The device tool lends an H100 as often as an H200, and
a percentage of the H200's figures measured on an H100 (copy 3.00 TB/s) would be wrong. So each script measures
its own card's ceilings once per run with the functions below. On the CPU (smoke runs under the interpreter) they
return the H200's figures, so the tables still print.

Scripts run as `python benchmarks/<name>.py` import this module by name (`from ceilings import ...`): the
script's folder is first on `sys.path`.
"""

from __future__ import annotations

import functools

import torch
import triton

H200_COPY_TBS = 4.27
H200_MATMUL_TFLOPS = 790.0


@functools.cache
def copy_tbs(device: str = "cuda") -> float:
    """TB/s of a 1 GiB device-to-device copy, bytes read + written (`do_bench` median)."""
    if torch.device(device).type != "cuda":
        return H200_COPY_TBS
    x = torch.empty(1 << 30, device=device, dtype=torch.uint8)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e9


@functools.cache
def matmul_tflops(device: str = "cuda") -> float:
    """TFLOP/s of an 8192 x 8192 x 8192 bf16 `torch.matmul` (cuBLAS), `do_bench` median."""
    if torch.device(device).type != "cuda":
        return H200_MATMUL_TFLOPS
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b)
    return 2 * n**3 / ms / 1e9
