"""Gluon names that changed between triton releases. The Gluon kernels (`mla/gluon_decode.py`, `moe/gluon_moe.py`)
take them from here, so that they compile with triton 3.6 (the GPU image's) and with newer releases (3.9 with
torch 2.13).

- `async_load`: the `cp.async` copy into shared memory. Triton 3.6 calls it `async_copy_global_to_shared`; later
  releases renamed it and removed the old name (compiling the kernels with triton 3.9 failed with "has been removed;
  call async_load instead").
- `thread_barrier`: a barrier across the program's threads. Triton 3.6 calls it `gl.thread_barrier()`; later
  releases call it `gl.barrier()` (which also takes `cluster=`).
- `tma_load`: the TMA bulk copy into shared memory (`tma.async_copy_global_to_shared` in 3.6, `tma.async_load`
  later): `moe/gluon_moe_ws.py`'s weight and token rings, and `benchmarks/gluon_probe.py`'s probes.
"""

from triton.experimental.gluon import language as _gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
from triton.experimental.gluon.language.nvidia.hopper import tma as _tma

async_load = getattr(_cp, "async_load", None) or _cp.async_copy_global_to_shared
thread_barrier = getattr(_gl, "thread_barrier", None) or _gl.barrier
tma_load = getattr(_tma, "async_load", None) or _tma.async_copy_global_to_shared
