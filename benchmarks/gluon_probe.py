"""Probe: does a warp-specialised Hopper pipeline (Gluon, triton >= 3.6) beat our Triton tiles on MoE-prefill GEMMs?

The routed-expert prefill kernel (`k3_kernels.moe.triton_moe._gate_up_situ`) reaches about 365 TFLOP/s on padded
64-row tiles on an H100, bound neither by its loop's instruction count nor clearly by L2 (BENCHMARKS.md, eighteenth
session). What CUTLASS / FlashMLA add on Hopper is warp specialisation: a producer warp issuing TMA loads into a
ring of shared-memory stages and consumer warpgroups issuing asynchronous wgmma, synchronised by mbarriers, with
registers moved from producer to consumers (`setmaxnreg`). Triton's own `tl.range(warp_specialize=True)` does
nothing on sm_90a in 3.6, but Gluon (`triton.experimental.gluon`, shipped with triton) expresses it directly.

This script times one uniform grouped GEMM, the MoE gate_up product with the bookkeeping stripped: E experts, each
`rows` rows of x `[rows, D]` against its weights `[N, D]` (N = 2 I = 6144, D = 3584), written as bf16 `[rows, N]`.
192 rows is K3 at 8K tokens (146 an expert) in 64-row tiles; 256 lets the 128-row tiles run too. A variant whose
row tile does not divide `rows` is skipped. Paths, same data, one run:

- `gluon-ws`: the warp-specialised Gluon kernel below, 64 or 128 rows a tile (128: two consumer warpgroups, each
  with its own 64 rows, sharing every weight stage, like `row_tiles=2`);
- `gluon pipelined`: the same product without the producer warp (the consumers issue the TMA loads ahead);
- `triton`: a `tl.dot` kernel with pointer loads, the structure of `_gate_up_situ` without the gather and SiTU;
- `triton-tma`: the same with host TMA descriptors (what the `tma` option of the MoE kernel does);
- `torch._grouped_mm`, the peer of the MoE benchmark.

Each path is checked against torch in fp32 first. Run on the GPU:

    . scripts/device_env.sh && python3 benchmarks/gluon_probe.py
    python benchmarks/gluon_probe.py --compile-only   # CPU: compile the Gluon kernels for sm_90a, print PTX features
    . scripts/device_env.sh && python3 benchmarks/gluon_probe.py --w4a16 [--skip TMA]  # the W4A16 variants
    python benchmarks/gluon_probe.py --w4a16-sass     # CPU: SASS a weight of each W4A16 variant's K loop
    python benchmarks/gluon_probe.py --mla-compile    # CPU: an MLA tile with the heads as the wgmma N side

The script also holds the W4A16 (MXFP4 decode) loop variants that led to `k3_kernels.moe.gluon_moe` (repacked or
released layout, K-step width, register prefetch, `cp.async` and TMA rings: `--w4a16` times them on a uniform grouped
product against bf16 `torch._grouped_mm`, BENCHMARKS.md, nineteenth session), and a compile-only MLA tile with the
heads on the N side of the products (see their comments below).

Not part of the package: the prefill product kernels stay Triton (they run under the CPU interpreter, which Gluon
does not); the package's one Gluon path is the MXFP4 decode of `gluon_moe`, which measured worth a GPU-only path.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from k3_kernels.gluon_compat import async_load as _cp_async
from k3_kernels.gluon_compat import thread_barrier as _thread_barrier
from k3_kernels.gluon_compat import tma_load as _tma_load
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


def _cuda_tool(tool: str, data, suffix: str, *args: str) -> str:
    """Run one of the CUDA tools shipped in the triton wheel (ptxas, nvdisasm) on `data` written to a temporary
    file; returns its stdout and stderr together."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # triton >= 3.7 assembles sm_90 with its newer `ptxas-blackwell`; the older `ptxas` beside it rejects that PTX
    if tool == "ptxas" and os.path.exists(os.path.join(bin_dir, "ptxas-blackwell")):
        tool = "ptxas-blackwell"
    path = os.path.join(bin_dir, tool)
    with tempfile.NamedTemporaryFile("wb" if isinstance(data, bytes) else "w", suffix=suffix, delete=False) as f:
        f.write(data)
    try:
        done = subprocess.run([path, *args, f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    return done.stdout + done.stderr


def _ptxas_info(ptx: str) -> str:
    """ptxas's register and spill lines for sm_90a."""
    info = _cuda_tool("ptxas", ptx, ".ptx", "-arch=sm_90a", "-v", "-o", os.devnull)
    return "; ".join(" ".join(ln.split()) for ln in info.splitlines() if "registers" in ln or "spill" in ln) or (
        "ptxas: " + " ".join(info.split())[:160])


# ---------------------------------------------------------------------------------------------- Gluon, warp-specialised
@gluon.jit
def _ws_load(x_desc, w_desc, ready, empty, x_bufs, w_bufs, off_m, off_w, K, BK: gl.constexpr, STAGES: gl.constexpr):
    """Producer (one warp): TMA loads of the x and weight tiles of every K step into the stage ring."""
    for i in range(gl.cdiv(K, BK)):
        s = i % STAGES
        # A fresh mbarrier counts as having completed the phase before phase 0, so the first lap does not wait.
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        _tma_load(x_desc, [off_m, i * BK], ready.index(s), x_bufs.index(s))
        _tma_load(w_desc, [off_w, i * BK], ready.index(s), w_bufs.index(s))


@gluon.jit
def _ws_mma(ready, empty, x_bufs, w_bufs, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
            STAGES: gl.constexpr, ACC: gl.constexpr):
    """Consumers (the default partition's warpgroups): asynchronous wgmma, one product in flight; a stage is handed
    back to the producer once the product that read it has retired."""
    acc = gl.zeros([BM, BN], gl.float32, ACC)
    for i in range(gl.cdiv(K, BK)):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        acc = warpgroup_mma(x_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    return (acc, )


@gluon.jit
def _barriers(STAGES: gl.constexpr):
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    return bars


@gluon.jit
def _operands(X, W, ROWS, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              X_SMEM: gl.constexpr, W_SMEM: gl.constexpr):
    """This program's tile (rows off_m.., weight rows off_w.., output columns off_n..), the TMA descriptors of X
    `[experts * ROWS, K]` and W `[experts * N, K]` (built on the device: a 128-byte scratch each, from
    `triton.set_allocator`), the stage ring and its ready barriers."""
    e = gl.program_id(2)
    off_m = e * ROWS + gl.program_id(0) * BM
    off_n = gl.program_id(1) * BN
    x_desc = tma.make_tensor_descriptor(X, [gl.num_programs(2) * ROWS, K], [K, 1], [BM, BK], X_SMEM)
    w_desc = tma.make_tensor_descriptor(W, [gl.num_programs(2) * N, K], [K, 1], [BN, BK], W_SMEM)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], X_SMEM)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], W_SMEM)
    return off_m, e * N + off_n, off_n, x_desc, w_desc, x_bufs, w_bufs, _barriers(STAGES)


@gluon.jit
def _store_tile(C, acc, off_m, off_n, N, BM: gl.constexpr, BN: gl.constexpr, ACC: gl.constexpr):
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
    cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, ACC))
    gl.store(C + rows.to(gl.int64)[:, None] * N + cols[None, :], acc.to(gl.bfloat16))


@gluon.jit
def _ws_grouped_gemm(X, W, C, ROWS, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                     STAGES: gl.constexpr, X_SMEM: gl.constexpr, W_SMEM: gl.constexpr, ACC: gl.constexpr):
    """C[e * ROWS + m, n] = X[e * ROWS + m, :] . W[e * N + n, :]; grid (ROWS / BM, N / BN, experts)."""
    off_m, off_w, off_n, x_desc, w_desc, x_bufs, w_bufs, ready = _operands(X, W, ROWS, N, K, BM, BN, BK, STAGES,
                                                                             X_SMEM, W_SMEM)
    empty = _barriers(STAGES)
    (acc, ) = gl.warp_specialize([
        (_ws_mma, (ready, empty, x_bufs, w_bufs, K, BM, BN, BK, STAGES, ACC)),
        (_ws_load, (x_desc, w_desc, ready, empty, x_bufs, w_bufs, off_m, off_w, K, BK, STAGES)),
    ], [1], [24])
    _store_tile(C, acc, off_m, off_n, N, BM, BN, ACC)


@gluon.jit
def _pipelined_grouped_gemm(X, W, C, ROWS, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                            STAGES: gl.constexpr, X_SMEM: gl.constexpr, W_SMEM: gl.constexpr, ACC: gl.constexpr):
    """The same product without warp specialisation: the consumer warps also issue the TMA loads, STAGES - 1 K steps
    ahead, into the stage the last retired product read. Separates what async wgmma + TMA give from what the
    producer warp adds. Needs K / BK >= STAGES - 1."""
    off_m, off_w, off_n, x_desc, w_desc, x_bufs, w_bufs, ready = _operands(X, W, ROWS, N, K, BM, BN, BK, STAGES,
                                                                             X_SMEM, W_SMEM)
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    for p in gl.static_range(STAGES - 1):
        mbarrier.expect(ready.index(p), nbytes)
        _tma_load(x_desc, [off_m, p * BK], ready.index(p), x_bufs.index(p))
        _tma_load(w_desc, [off_w, p * BK], ready.index(p), w_bufs.index(p))
    acc = gl.zeros([BM, BN], gl.float32, ACC)
    n_k = gl.cdiv(K, BK)
    for i in range(n_k):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        acc = warpgroup_mma(x_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        # Product i - 1 has retired: its stage takes K step i + STAGES - 1.
        j = i + STAGES - 1
        sj = j % STAGES
        mbarrier.expect(ready.index(sj), nbytes, pred=j < n_k)
        _tma_load(x_desc, [off_m, j * BK], ready.index(sj), x_bufs.index(sj), pred=j < n_k)
        _tma_load(w_desc, [off_w, j * BK], ready.index(sj), w_bufs.index(sj), pred=j < n_k)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    _store_tile(C, acc, off_m, off_n, N, BM, BN, ACC)


def _gluon_constexprs(bm, bn, bk, stages):
    consumer_warps = bm // 16  # one warpgroup (4 warps) per 64 rows
    return dict(
        BM=bm, BN=bn, BK=bk, STAGES=stages,
        X_SMEM=gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16),
        W_SMEM=gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16),
        ACC=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[consumer_warps, 1], instr_shape=[16, bn, 16]),
    ), consumer_warps


def gluon_ws(x, w, rows, bm=64, bn=128, bk=64, stages=4, specialise=True):
    E, N, K = x.shape[0] // rows, w.shape[0] // (x.shape[0] // rows), x.shape[1]
    c = torch.empty(x.shape[0], N, device=x.device, dtype=torch.bfloat16)
    cex, warps = _gluon_constexprs(bm, bn, bk, stages)
    kernel = _ws_grouped_gemm if specialise else _pipelined_grouped_gemm
    kernel[(rows // bm, N // bn, E)](x, w, c, rows, N, K, **cex, num_warps=warps)
    return c


# ----------------------------------------------------------------------------------------------------- Triton peers
@triton.jit
def _tl_grouped_gemm(X, W, C, ROWS, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(2)
    m = e * ROWS + tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(X + m.to(tl.int64)[:, None] * K + k[None, :])
        w = tl.load(W + (e * N + n).to(tl.int64)[:, None] * K + k[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(C + m.to(tl.int64)[:, None] * N + n[None, :], acc.to(tl.bfloat16))


@triton.jit
def _tl_tma_grouped_gemm(XD, WD, C, ROWS, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(2)
    off_m = e * ROWS + tl.program_id(0) * BM
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        acc = tl.dot(XD.load([off_m, k0]), tl.trans(WD.load([e * N + tl.program_id(1) * BN, k0])), acc)
    m = off_m + tl.arange(0, BM)
    tl.store(C + m.to(tl.int64)[:, None] * N + n[None, :], acc.to(tl.bfloat16))


def triton_dot(x, w, rows, bm=64, bn=128, bk=64, warps=8, stages=4, tma_loads=False):
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, K = x.shape[0] // rows, x.shape[1]
    N = w.shape[0] // E
    c = torch.empty(x.shape[0], N, device=x.device, dtype=torch.bfloat16)
    grid = (rows // bm, N // bn, E)
    if tma_loads:
        xd = TensorDescriptor.from_tensor(x, block_shape=[bm, bk])
        wd = TensorDescriptor.from_tensor(w, block_shape=[bn, bk])
        _tl_tma_grouped_gemm[grid](xd, wd, c, rows, N, K, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    else:
        _tl_grouped_gemm[grid](x, w, c, rows, N, K, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return c


def grouped_mm(x, w, rows):
    E = x.shape[0] // rows
    offs = torch.arange(1, E + 1, device=x.device, dtype=torch.int32) * rows
    return torch._grouped_mm(x, w.view(E, -1, x.shape[1]).transpose(-2, -1), offs=offs)


# --------------------------------------------------------------------------- Gluon W4A16: the MXFP4 decode unpack
# The MXFP4 decode target (3x bf16 grouped_mm at 64 tokens) needs about 4 or fewer SASS instructions a weight in the
# unpack loop (BENCHMARKS.md, thirteenth session); `tl.dot_scaled` compiles to 6.5-7.3. In Gluon the packed bytes
# can be loaded straight into the register layout of wgmma's left operand: `gl.fp4_to_fp` of a
# `DotOperandLayout(0, acc, k_width=1)` byte tensor is the bf16 operand, with no layout conversion. The bytes a thread
# needs (c + 4 i, i = 0..7, of each 32-byte block of a row) are made contiguous by storing each block transposed as
# [4, 8] instead of [8, 4] (a one-time repack of the released layout), so a thread loads 8 bytes a row at once.
# Weights are the left operand (64 rows a warpgroup), the few tokens an expert gets the right one (N = 8 or 16).
@gluon.jit
def _w4a16_unpack_mma(phys, sb, x_tile, acc, BM: gl.constexpr, S: gl.constexpr, ACC: gl.constexpr,
                      RELEASED: gl.constexpr):
    """One K step: [BM, 32 S] stored bytes and [BM, 2 S] E8M0 scales -> the bf16 wgmma register operand, times the
    [NT, 64 S] token tile in shared memory.

    The operand's K position 2 (4 i + c) + h of a 64-input block is the stored byte 8 c + i, nibble h (a change of
    view: the registers stay where they are). Repacked weights (each 32-byte block stored transposed) make that the
    released input order. RELEASED weights are read as released instead, so the operand's K order is a permutation
    of the inputs: the token tile is permuted the same way (`permute_k`, on the host) and the product is unchanged;
    each thread's 8 bytes of a block then lie in one 32-input scale block, c // 2."""
    wp = gl.reshape(gl.permute(gl.reshape(phys, [BM, S, 4, 8]), (0, 1, 3, 2)), [BM, 32 * S])
    w = gl.fp4_to_fp(gl.convert_layout(wp, gl.DotOperandLayout(0, ACC, 1)), gl.bfloat16, axis=1)  # [BM, 64 S]
    sc = (sb.to(gl.int16) << 7).to(gl.bfloat16, bitcast=True)  # 2 ** (byte - 127): exact in bf16 for byte >= 1
    if RELEASED:
        w6 = gl.reshape(w, [BM, S, 8, 2, 2, 2])  # (row, block, i, c // 2, c % 2, h)
        L6: gl.constexpr = w6.type.layout
        sc6 = gl.convert_layout(gl.reshape(sc, [BM, S, 2]), gl.SliceLayout(2, gl.SliceLayout(4, gl.SliceLayout(5, L6))))
        sc6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(sc6, 2), 4), 5)
        w = gl.reshape(w6 * sc6, [BM, 64 * S])
    else:
        w3 = gl.reshape(w, [BM, 2 * S, 32])
        w = gl.reshape(w3 * gl.expand_dims(gl.convert_layout(sc, gl.SliceLayout(2, w3.type.layout)), 2),
                       [BM, 64 * S])
    return warpgroup_mma(gl.convert_layout(w, gl.DotOperandLayout(0, ACC, 2)), x_tile.permute((1, 0)), acc)


@gluon.jit
def _w4a16_ptrs(WP, WS, X, R, K, NT: gl.constexpr, BM: gl.constexpr, S: gl.constexpr, PL: gl.constexpr,
                XL: gl.constexpr):
    """This program's first K step: weight bytes `[BM, 32 S]` and scales `[BM, 2 S]` (in PL, as stored), tokens
    `[NT, 64 S]` (in XL); hoisted, so each K step only adds a scalar. Grid (R / BM, E)."""
    BK: gl.constexpr = 64 * S
    e = gl.program_id(1).to(gl.int64)
    rows = gl.program_id(0) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, PL))
    p = gl.arange(0, 32 * S, layout=gl.SliceLayout(0, PL))  # physical byte 32 s + 8 c + i of the row's step
    blocks = gl.arange(0, 2 * S, layout=gl.SliceLayout(0, PL))
    tok = gl.arange(0, NT, layout=gl.SliceLayout(1, XL))
    kx = gl.arange(0, BK, layout=gl.SliceLayout(0, XL))
    w_ptr = WP + e * R * (K // 2) + rows[:, None] * (K // 2) + p[None, :]
    s_ptr = WS + e * R * (K // 32) + rows[:, None] * (K // 32) + blocks[None, :]
    x_ptr = X + e * NT * K + tok[:, None] * K + kx[None, :]
    return w_ptr, s_ptr, x_ptr


@gluon.jit
def _w4a16_store(OUT, acc, R, NT: gl.constexpr, BM: gl.constexpr, ACC: gl.constexpr):
    ro = gl.program_id(0) * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
    co = gl.arange(0, NT, layout=gl.SliceLayout(0, ACC))
    gl.store(OUT + gl.program_id(1).to(gl.int64) * R * NT + ro[:, None] * NT + co[None, :], acc)


@gluon.jit
def _w4a16_grouped(WP, WS, X, OUT, R, K, NT: gl.constexpr, BM: gl.constexpr, S: gl.constexpr,
                   PREFETCH: gl.constexpr, RELEASED: gl.constexpr, ACC: gl.constexpr, PL: gl.constexpr,
                   XL: gl.constexpr, X_SMEM: gl.constexpr):
    """OUT[e, r, t] = sum_k dequant(W[e])[r, k] X[e, t, k] for E experts of R rows, each with NT (padded) tokens.
    W packed E2M1 `[E, R, K / 2]` bytes (each 32-byte block stored transposed, see above), E8M0 scales
    `[E, R, K / 32]`, X `[E, NT, K]` bf16, OUT `[E, R, NT]` fp32. One warpgroup a program, BM = 64 rows; a K step is
    S blocks of 64 inputs. With PREFETCH the next step's weights, scales and tokens are loaded before this step's
    unpack (carried in registers across the loop, which costs unpack instructions: bytes carried one a register);
    without it the latency is hidden by the other programs on the SM only."""
    BK: gl.constexpr = 64 * S
    w_ptr, s_ptr, x_ptr = _w4a16_ptrs(WP, WS, X, R, K, NT, BM, S, PL, XL)
    acc = gl.zeros([BM, NT], gl.float32, ACC)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [NT, BK], X_SMEM)
    phys = gl.load(w_ptr)
    sb = gl.load(s_ptr)
    xs = gl.load(x_ptr)
    for k0 in range(0, K, BK):
        if PREFETCH:
            kn = gl.minimum(k0 + BK, K - BK)  # the last step reloads itself rather than masking every load
            phys_n = gl.load(w_ptr + kn // 2)
            sb_n = gl.load(s_ptr + kn // 32)
            xs_n = gl.load(x_ptr + kn)
        else:
            phys = gl.load(w_ptr + k0 // 2)  # [BM, 32 S] bytes, 8 contiguous a thread a row and block
            sb = gl.load(s_ptr + k0 // 32)  # [BM, 2 S] E8M0
            xs = gl.load(x_ptr + k0)
        x_smem.store(xs)
        fence_async_shared()
        acc = _w4a16_unpack_mma(phys, sb, x_smem, acc, BM, S, ACC, RELEASED)
        if PREFETCH:
            phys, sb, xs = phys_n, sb_n, xs_n
    _w4a16_store(OUT, acc, R, NT, BM, ACC)


@gluon.jit
def _w4a16_whole_x(WP, WS, X, OUT, R, K, NT: gl.constexpr, BM: gl.constexpr, S: gl.constexpr,
                   KSTEPS: gl.constexpr, ACC: gl.constexpr, PL: gl.constexpr, XL: gl.constexpr,
                   X_SMEM: gl.constexpr):
    """`_w4a16_grouped` with the expert's whole token tile `[KSTEPS, NT, 64 S]` put in shared memory once, so the K
    loop has no barrier, store or token load; BM = 64 or 128 (two warpgroups sharing the token tile)."""
    BK: gl.constexpr = 64 * S
    w_ptr, s_ptr, x_ptr = _w4a16_ptrs(WP, WS, X, R, K, NT, BM, S, PL, XL)
    x_all = gl.allocate_shared_memory(gl.bfloat16, [KSTEPS, NT, BK], X_SMEM)
    for i in range(KSTEPS):
        x_all.index(i).store(gl.load(x_ptr + i * BK))
    fence_async_shared()
    _thread_barrier()
    acc = gl.zeros([BM, NT], gl.float32, ACC)
    for i in range(KSTEPS):
        acc = _w4a16_unpack_mma(gl.load(w_ptr + i * (BK // 2)), gl.load(s_ptr + i * (BK // 32)), x_all.index(i), acc,
                                BM, S, ACC, False)
    _w4a16_store(OUT, acc, R, NT, BM, ACC)


@gluon.jit
def _w4a16_tma(WP, WS, X, OUT, R, K, NT: gl.constexpr, BM: gl.constexpr, S: gl.constexpr, STAGES: gl.constexpr,
               RELEASED: gl.constexpr, ACC: gl.constexpr, PL: gl.constexpr, W_SMEM: gl.constexpr,
               X_SMEM: gl.constexpr):
    """`_w4a16_grouped` with the weights and tokens read by TMA into a ring of STAGES shared-memory stages, issued
    STAGES - 1 K steps ahead (no registers held for them; read back with 8-byte shared loads through the 128-byte
    swizzle); the scales are loaded one step ahead into registers. Needs K / (64 S) >= STAGES - 1."""
    BK: gl.constexpr = 64 * S
    pid = gl.program_id(0)
    e = gl.program_id(1)
    E = gl.num_programs(1)
    w_desc = tma.make_tensor_descriptor(WP, [E * R, K // 2], [K // 2, 1], [BM, 32 * S], W_SMEM)
    x_desc = tma.make_tensor_descriptor(X, [E * NT, K], [K, 1], [NT, BK], X_SMEM)
    w_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, BM, 32 * S], W_SMEM)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, NT, BK], X_SMEM)
    ready = _barriers(STAGES)
    nbytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
    off_w = e * R + pid * BM
    off_x = e * NT
    for p in gl.static_range(STAGES - 1):
        mbarrier.expect(ready.index(p), nbytes)
        _tma_load(w_desc, [off_w, p * 32 * S], ready.index(p), w_bufs.index(p))
        _tma_load(x_desc, [off_x, p * BK], ready.index(p), x_bufs.index(p))
    rows = pid * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, PL))
    blocks = gl.arange(0, 2 * S, layout=gl.SliceLayout(0, PL))
    s_ptr = WS + e.to(gl.int64) * R * (K // 32) + rows[:, None] * (K // 32) + blocks[None, :]
    sb = gl.load(s_ptr)
    acc = gl.zeros([BM, NT], gl.float32, ACC)
    n_k = K // BK
    for i in range(n_k):
        st = i % STAGES
        sb_n = gl.load(s_ptr + gl.minimum(i + 1, n_k - 1) * (BK // 32))
        # Every warp is past step i - 1, whose product retired: its stage takes K step i + STAGES - 1, issued before
        # this step's unpack.
        _thread_barrier()
        j = i + STAGES - 1
        sj = j % STAGES
        mbarrier.expect(ready.index(sj), nbytes, pred=j < n_k)
        _tma_load(w_desc, [off_w, j * 32 * S], ready.index(sj), w_bufs.index(sj), pred=j < n_k)
        _tma_load(x_desc, [off_x, j * BK], ready.index(sj), x_bufs.index(sj), pred=j < n_k)
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        acc = _w4a16_unpack_mma(w_bufs.index(st).load(PL), sb, x_bufs.index(st), acc, BM, S, ACC, RELEASED)
        sb = sb_n
    _w4a16_store(OUT, acc, R, NT, BM, ACC)


@gluon.jit
def _w4a16_cp_async(WP, WS, X, OUT, R, K, NT: gl.constexpr, BM: gl.constexpr, S: gl.constexpr,
                    STAGES: gl.constexpr, RELEASED: gl.constexpr, ACC: gl.constexpr, PL: gl.constexpr,
                    XL: gl.constexpr, W_SMEM: gl.constexpr, X_SMEM: gl.constexpr):
    """`_w4a16_grouped` with the weights and tokens prefetched STAGES - 1 K steps ahead by asynchronous copies
    (`cp.async`, 8 bytes a thread and row for the weights) into a ring of shared-memory stages: many loads in flight
    without holding registers for them (carried bytes cost unpack instructions, see `_w4a16_grouped`). Each thread
    reads back only the weight bytes it copied; the token tile is shared by the warpgroup's product, hence the
    barrier. The scales are loaded one step ahead into registers. Needs K / (64 S) >= STAGES - 1."""
    BK: gl.constexpr = 64 * S
    w_ptr, s_ptr, x_ptr = _w4a16_ptrs(WP, WS, X, R, K, NT, BM, S, PL, XL)
    w_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, BM, 32 * S], W_SMEM)
    x_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, NT, BK], X_SMEM)
    for q in gl.static_range(STAGES - 1):
        _cp_async(w_bufs.index(q), w_ptr + q * (BK // 2))
        _cp_async(x_bufs.index(q), x_ptr + q * BK)
        async_copy.commit_group()
    sb = gl.load(s_ptr)
    acc = gl.zeros([BM, NT], gl.float32, ACC)
    n_k = K // BK
    for i in range(n_k):
        st = i % STAGES
        sb_n = gl.load(s_ptr + gl.minimum(i + 1, n_k - 1) * (BK // 32))
        async_copy.wait_group(STAGES - 2)  # this thread's copies of step i have landed
        _thread_barrier()  # ... and every thread's (the token tile), and all are past step i - 1
        # Step i - 1's stage takes step i + STAGES - 1 (a clamped re-read past the end keeps the group count).
        j = gl.minimum(i + STAGES - 1, n_k - 1)
        sj = (i + STAGES - 1) % STAGES
        _cp_async(w_bufs.index(sj), w_ptr + j * (BK // 2))
        _cp_async(x_bufs.index(sj), x_ptr + j * BK)
        async_copy.commit_group()
        fence_async_shared()  # the copies wrote through the generic proxy; wgmma reads through the async one
        acc = _w4a16_unpack_mma(w_bufs.index(st).load(PL), sb, x_bufs.index(st), acc, BM, S, ACC, RELEASED)
        sb = sb_n
    async_copy.wait_group(0)
    _w4a16_store(OUT, acc, R, NT, BM, ACC)


def _w4a16_constexprs(nt=8, s=4, prefetch=False, released=False, bm=64):
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[bm // 16, 1], instr_shape=[16, nt, 16])
    # [64 rows, 32 S bytes] as stored: a thread holds bytes 32 s + 8 c + i (i = 0..7, contiguous) of rows r and
    # r + 8, c = lane % 4, r = 16 warp + lane / 4 (the wgmma operand's rows and K pairs).
    steps = [[0, 32 << j] for j in range(s.bit_length() - 1)]
    pl = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]] + steps,
                                    lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                    warp_bases=[[16 << j, 0] for j in range((bm // 16).bit_length() - 1)],
                                    block_bases=[], shape=[bm, 32 * s])
    cols = min(32, 8 * s)  # threads along K of the token tile, 8 inputs each
    xl = gl.BlockedLayout([1, 8], [32 // cols, cols], [bm // 16, 1], [1, 0])
    return dict(NT=nt, BM=bm, S=s, PREFETCH=prefetch, RELEASED=released, ACC=acc, PL=pl, XL=xl,
                X_SMEM=gl.NVMMASharedLayout.get_default_for([nt, 64 * s], gl.bfloat16))


def _w4a16_tma_constexprs(nt=8, s=4, stages=4, released=False, bm=64):
    cex = _w4a16_constexprs(nt=nt, s=s, bm=bm)
    # TMA boxes: the 32 S-byte weight rows in the 128-byte swizzle (conflict-free 8-byte reads for S <= 4); the token
    # tile unswizzled, since a swizzled box may not be wider than its 128-byte span.
    return dict(NT=nt, BM=bm, S=s, STAGES=stages, RELEASED=released, ACC=cex["ACC"], PL=cex["PL"],
                W_SMEM=gl.NVMMASharedLayout.get_default_for([bm, 32 * s], gl.uint8),
                X_SMEM=gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))


def _w4a16_cp_async_constexprs(nt=8, s=4, stages=4, released=False, bm=64):
    cex = _w4a16_constexprs(nt=nt, s=s, released=released, bm=bm)
    del cex["PREFETCH"]
    # 16-byte chunks XOR-swizzled by row: the 8-byte reads of 8 rows x 4 lanes hit distinct banks.
    cex.update(STAGES=stages, W_SMEM=gl.SwizzledSharedLayout(16, 1, min(8, 2 * s), order=[1, 0]))
    return cex


def _w4a16_signature(cex):
    return dict(WP="*u8", WS="*u8", X="*bf16", OUT="*fp32", R="i32", K="i32", **{k: "constexpr" for k in cex})


def pack_mxfp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K / 2] E2M1 byte pairs in the released order -> each 32-byte block stored transposed (see above)."""
    *lead, kb = codes.shape
    return codes.reshape(*lead, kb // 32, 8, 4).transpose(-1, -2).reshape(*lead, kb)




def permute_k(x: torch.Tensor) -> torch.Tensor:
    """The token tile's inputs in the operand order of released (not repacked) weights: within each 64-input block,
    position 2 (4 i + c) + h takes input 2 (8 c + i) + h (see `_w4a16_unpack_mma`)."""
    *lead, k = x.shape
    return x.reshape(*lead, k // 64, 4, 8, 2).transpose(-3, -2).reshape(*lead, k)


def _w4a16_whole_x_constexprs(nt=8, s=4, bm=64, k=3584):
    cex = _w4a16_constexprs(nt=nt, s=s, bm=bm)
    del cex["PREFETCH"], cex["RELEASED"]
    cex["KSTEPS"] = k // (64 * s)
    return cex


def _w4a16_kernel(nt=8, s=4, prefetch=False, stages=0, released=False, cp_async=False, whole_x=0, k=3584):
    """The kernel and its constexprs: stages > 0 a ring kernel (`_w4a16_cp_async` or `_w4a16_tma`), else
    `_w4a16_grouped`."""
    if whole_x:  # whole_x = the rows a program: 64 or 128
        return _w4a16_whole_x, _w4a16_whole_x_constexprs(nt=nt, s=s, bm=whole_x, k=k)
    if stages and cp_async:
        return _w4a16_cp_async, _w4a16_cp_async_constexprs(nt=nt, s=s, stages=stages, released=released)
    if stages:
        return _w4a16_tma, _w4a16_tma_constexprs(nt=nt, s=s, stages=stages, released=released)
    return _w4a16_grouped, _w4a16_constexprs(nt=nt, s=s, prefetch=prefetch, released=released)


def w4a16(wp, ws, x, **variant):
    """OUT [E, R, NT] fp32 for weights `wp` `[E, R, K / 2]` (repacked, or as released with `released=True`)."""
    E, R, K = wp.shape[0], wp.shape[1], wp.shape[2] * 2
    out = torch.empty(E, R, x.shape[1], device=x.device, dtype=torch.float32)
    kernel, cex = _w4a16_kernel(**dict(variant, nt=x.shape[1], k=K))
    bm = variant.get("whole_x") or 64
    kernel[(R // bm, E)](wp, ws, permute_k(x) if variant.get("released") else x, out, R, K, **cex,
                         num_warps=bm // 16)
    return out


def _w4a16_name(nt=8, s=4, prefetch=False, stages=0, released=False, cp_async=False, whole_x=0, k=3584):
    how = f", {'cp.async' if cp_async else 'TMA'} ring of {stages}" if stages else ", prefetch" if prefetch else ""
    how += f", whole token tile in shared memory, {whole_x} rows a program" if whole_x else ""
    return f"gluon N = {nt}, S = {s}{how}{', released layout' if released else ''}"


# N = 16 with S = 2 and a TMA ring finds no wgmma layout (triton 3.6), so the TMA variants are N = 8 only. They
# come last: on an H100 they stopped with an illegal address (eighteenth session, not yet found), which ends the run.
W4A16_VARIANTS = ([dict(nt=nt, s=s, prefetch=pf) for nt in (8, 16) for s in (2, 4, 8) for pf in (False, True)]
                  + [dict(nt=nt, s=s, stages=st, cp_async=True) for nt in (8, 16) for s, st in ((2, 4), (2, 8), (4, 3),
                                                                                               (4, 4), (4, 6))]
                  + [dict(nt=nt, s=s, whole_x=bm) for nt in (8, 16) for s in (2, 4) for bm in (64, 128)]
                  + [dict(nt=8, s=s, released=True) for s in (2, 4, 8)]
                  + [dict(nt=8, s=s, stages=st, cp_async=True, released=True) for s, st in ((2, 8), (4, 4))]
                  + [dict(nt=8, s=s, stages=st) for s, st in ((2, 6), (4, 4), (4, 6), (8, 3))])


def w4a16_sass() -> int:
    """CPU: compile the W4A16 variants for sm_90a and count the SASS of their K loop, per weight."""
    import collections
    import re

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    print(f"triton {triton.__version__}: the W4A16 kernels compiled for sm_90a, their K loop (64 rows x 64 S "
          "inputs a step, one warpgroup: 32 S weights a thread)")
    for variant in W4A16_VARIANTS:
        fn, cex = _w4a16_kernel(**variant)
        kernel = triton.compile(GluonASTSource(fn, _w4a16_signature(cex), cex,
                                               {(i, ): [["tt.divisibility", 16]] for i in range(6)}),
                                target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=(variant.get("whole_x") or 64) // 16,
                                             enable_fp_fusion=True))
        sass = _cuda_tool("nvdisasm", kernel.asm["cubin"], ".cubin", "-c")
        ins, labels = [], {}
        for line in sass.splitlines():
            if m := re.match(r"\s*\.(L_x_\d+):", line):
                labels[m.group(1)] = len(ins)
            elif m := re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
                ins.append(m.group(1))
        loops = [(labels[m.group(1)], i) for i, x in enumerate(ins)
                 if (m := re.search(r"BRA.*\.(L_x_\d+)", x)) and labels.get(m.group(1), i + 1) <= i]
        start, end = max(loops, key=lambda ab: ab[1] - ab[0])
        body = ins[start:end + 1]
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in body)
        print(f"- {_w4a16_name(**variant)}: {len(body)} instructions a K step, "
              f"{len(body) / (32 * variant['s']):.1f} a weight; {_ptxas_info(kernel.asm['ptx'])}; "
              + ", ".join(f"{k} {v}" for k, v in ops.most_common(8)))
    return 0


def w4a16_bench(E: int, tokens: int, rounds: int, skip: str = "") -> int:
    """GPU: the Gluon W4A16 grouped decode at the MoE shapes (gate_up: 6144 x 3584, down: 3584 x 3072), E experts
    with `tokens` tokens each (padded to 8 or 16), against bf16 `torch._grouped_mm` on the same experts."""
    from ceilings import copy_tbs
    from k3_kernels.mxfp4.reference import dequantize_mxfp4  # the package's reference (scripts/device_env.sh)

    ceiling = copy_tbs() * 1e12  # the copy rate measured in this run
    print(f"\nW4A16 (MXFP4) grouped decode, {E} experts x {tokens} tokens, {torch.cuda.get_device_name()}; "
          f"% of a {ceiling / 1e12:.2f} TB/s copy rate\n")
    print("| shape (R x K) | path | rel err | ms (best of rounds) | spread | weight GB/s | % of copy rate | vs grouped_mm |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    torch.manual_seed(0)
    for R, K in ((6144, 3584), (3584, 3072)):
        codes = torch.randint(0, 256, (E, R, K // 2), device="cuda", dtype=torch.uint8)
        scales = torch.randint(118, 131, (E, R, K // 32), device="cuda", dtype=torch.uint8)
        wp = pack_mxfp4(codes)
        x = torch.randn(E, tokens, K, device="cuda", dtype=torch.bfloat16)
        want = torch.einsum("erk,etk->ert", dequantize_mxfp4(codes[:2], scales[:2], torch.float32), x[:2].float())
        wb = torch.empty(E, R, K, device="cuda", dtype=torch.bfloat16)
        for e0 in range(0, E, 32):  # the bf16 copy for the peer, dequantised in slices (fp32 of all would not fit)
            wb[e0:e0 + 32] = dequantize_mxfp4(codes[e0:e0 + 32], scales[e0:e0 + 32])
        offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * tokens
        xf = x.reshape(E * tokens, K)
        paths = {"torch._grouped_mm bf16": lambda: torch._grouped_mm(xf, wb.transpose(-1, -2), offs=offs)}
        padded = {}
        for variant in W4A16_VARIANTS:
            nt, st = variant["nt"], variant.get("stages", 0)
            if (nt < tokens or (nt == 16 and tokens <= 8) or (st and K // (64 * variant["s"]) < st - 1)
                    or (skip and skip in _w4a16_name(**variant))):
                continue
            if nt not in padded:
                padded[nt] = torch.zeros(E, nt, K, device="cuda", dtype=torch.bfloat16)
                padded[nt][:, :tokens] = x
            paths[_w4a16_name(**variant)] = lambda xp=padded[nt], v=variant: w4a16(
                codes if v.get("released") else wp, scales, xp, **v)
        err, times = {}, {}
        for name, fn in paths.items():
            try:
                got = fn()
                got = got[:2 * tokens].reshape(2, tokens, R).transpose(1, 2) if got.dim() == 2 else got[:2, :, :tokens]
                err[name] = ((got.float() - want).abs().max() / want.abs().max()).item()
                times[name] = []
            except Exception as exc:  # noqa: BLE001 - report and go on: one variant's failure is a finding
                msg = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")[:300]
                print(f"| {R} x {K} | {name} | FAILED: {msg} | | | | | |", flush=True)
        for _ in range(rounds):
            for name in times:
                times[name].append(triton.testing.do_bench(paths[name], warmup=5, rep=50))
        packed = wp.nbytes + scales.nbytes
        base = min(times["torch._grouped_mm bf16"])
        for name, ts in times.items():
            ms = min(ts)
            nbytes = wb.nbytes if name.startswith("torch") else packed
            print(f"| {R} x {K} | {name} | {err[name]:.1e}{' (!)' if err[name] > 1e-2 else ''} | {ms:.3f} | "
                  f"{100 * (max(ts) / ms - 1):.0f} % | {nbytes / ms / 1e6:.0f} | {100 * nbytes / ms * 1e3 / ceiling:.0f} % "
                  f"| {base / ms:.2f}x |", flush=True)
    return 0


# ------------------------------------------------------------------------ Gluon MLA decode tile: heads as the N side
# `tl.dot` puts the 96 absorbed heads on the M side of the products, padded to 128 rows of 64-row wgmma tiles, which
# caps the decode near 77 % of bandwidth (BENCHMARKS.md, twelfth session). In Gluon the cache tile can be the left
# operand and a 32-head slice the right one (96 = 3 x 32, nothing padded): S^T = C Q^T, a softmax down each head's
# column, O^T += C^T P^T with the cache tile read transposed from shared memory. One warpgroup, plain loads, one
# sequence: a compile probe of the pieces, not a decode kernel (no paging, splits or producer warp).
@gluon.jit
def _mla_heads_as_n(C, Q, O, L, NH: gl.constexpr, BT: gl.constexpr, R: gl.constexpr, DR: gl.constexpr,
                    S_ACC: gl.constexpr, LD: gl.constexpr, C_SMEM: gl.constexpr, PE_SMEM: gl.constexpr,
                    Q_SMEM: gl.constexpr, QPE_SMEM: gl.constexpr, P_SMEM: gl.constexpr):
    """O[h, :] = softmax_t(Q[h] . C[t]) C[t, :R] for NH heads over L cached rows `[c (R) | k_pe (DR)]`; log2-scaled
    scores assumed (no scale, no mask)."""
    qr = gl.arange(0, NH, layout=gl.SliceLayout(1, LD))
    tr = gl.arange(0, BT, layout=gl.SliceLayout(1, LD))
    dr = gl.arange(0, R, layout=gl.SliceLayout(0, LD))
    dp = R + gl.arange(0, DR, layout=gl.SliceLayout(0, LD))
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [NH, R], Q_SMEM)
    q_smem.store(gl.load(Q + qr[:, None] * (R + DR) + dr[None, :]))
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [NH, DR], QPE_SMEM)
    qpe_smem.store(gl.load(Q + qr[:, None] * (R + DR) + dp[None, :]))
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [BT, R], C_SMEM)
    pe_smem = gl.allocate_shared_memory(gl.bfloat16, [BT, DR], PE_SMEM)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BT, NH], P_SMEM)
    m_i = gl.full([NH], float("-inf"), gl.float32, gl.SliceLayout(0, S_ACC))
    l_i = gl.zeros([NH], gl.float32, gl.SliceLayout(0, S_ACC))
    o = gl.zeros([R, NH], gl.float32, S_ACC)  # O^T
    for t0 in range(0, L, BT):
        c_smem.store(gl.load(C + (t0 + tr)[:, None] * (R + DR) + dr[None, :]))
        pe_smem.store(gl.load(C + (t0 + tr)[:, None] * (R + DR) + dp[None, :]))
        fence_async_shared()
        s = warpgroup_mma(c_smem, q_smem.permute((1, 0)), gl.zeros([BT, NH], gl.float32, S_ACC))  # S^T [BT, NH]
        s = warpgroup_mma(pe_smem, qpe_smem.permute((1, 0)), s)
        m_new = gl.maximum(m_i, gl.max(s, axis=0))  # down each head's column
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 0))
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        o = warpgroup_mma(c_smem.permute((1, 0)), p_smem, o * gl.expand_dims(alpha, 0))  # O^T += C^T P^T
    o = o / gl.expand_dims(l_i, 0)
    rr = gl.arange(0, R, layout=gl.SliceLayout(1, S_ACC))
    hh = gl.arange(0, NH, layout=gl.SliceLayout(0, S_ACC))
    gl.store(O + hh[None, :] * R + rr[:, None], o)


def mla_compile() -> int:
    """CPU: compile `_mla_heads_as_n` for sm_90a (32 heads, 64-token tiles, r = 512, dr = 64), print its wgmma shapes
    and ptxas's registers."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    nh, bt, r, dr = 32, 64, 512, 64
    nvmma = gl.NVMMASharedLayout.get_default_for
    cex = dict(NH=nh, BT=bt, R=r, DR=dr,
               S_ACC=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, nh, 16]),
               LD=gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]), C_SMEM=nvmma([bt, r], gl.bfloat16),
               PE_SMEM=nvmma([bt, dr], gl.bfloat16), Q_SMEM=nvmma([nh, r], gl.bfloat16),
               QPE_SMEM=nvmma([nh, dr], gl.bfloat16), P_SMEM=nvmma([bt, nh], gl.bfloat16))
    sig = dict(C="*bf16", Q="*bf16", O="*fp32", L="i32", **{k: "constexpr" for k in cex})
    kernel = triton.compile(GluonASTSource(_mla_heads_as_n, sig, cex, {(i, ): [["tt.divisibility", 16]]
                                                                        for i in range(4)}),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, enable_fp_fusion=True))
    ptx = kernel.asm["ptx"]
    shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
    print(f"triton {triton.__version__}: `_mla_heads_as_n`, {nh} heads x {bt}-token tiles: {ptx.count('wgmma.mma_async')} "
          f"wgmma a tile ({', '.join(shapes)}), {kernel.metadata.shared} B shared; "
          + _ptxas_info(ptx))
    return 0


# ----------------------------------------------------------------------------------------------------------- drivers
VARIANTS = {  # name -> (fn, kwargs)
    "gluon-ws m64 n128 k64 s4": (gluon_ws, dict(bm=64, bn=128, bk=64, stages=4)),
    "gluon-ws m64 n128 k64 s6": (gluon_ws, dict(bm=64, bn=128, bk=64, stages=6)),
    "gluon-ws m128 n128 k64 s4 (two consumer warpgroups)": (gluon_ws, dict(bm=128, bn=128, bk=64, stages=4)),
    "gluon-ws m128 n256 k64 s3 (two consumer warpgroups)": (gluon_ws, dict(bm=128, bn=256, bk=64, stages=3)),
    "gluon pipelined, no specialisation, m64 n128 k64 s4": (gluon_ws, dict(bm=64, bn=128, bk=64, stages=4,
                                                                            specialise=False)),
    "gluon pipelined, no specialisation, m128 n128 k64 s4": (gluon_ws, dict(bm=128, bn=128, bk=64, stages=4,
                                                                             specialise=False)),
    "triton m64 n128 k64 w8 s4 (the MoE kernel's tile)": (triton_dot, dict(bm=64, bn=128, bk=64, warps=8, stages=4)),
    "triton m128 n128 k64 w8 s4": (triton_dot, dict(bm=128, bn=128, bk=64, warps=8, stages=4)),
    "triton-tma m64 n128 k64 w8 s4": (triton_dot, dict(bm=64, bn=128, bk=64, warps=8, stages=4, tma_loads=True)),
    "torch._grouped_mm": (grouped_mm, {}),
}


def compile_only() -> int:
    """Compile the Gluon variants for sm_90a with the importable triton (no GPU) and print what the PTX holds."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    print(f"triton {triton.__version__}: the Gluon kernels compiled for sm_90a (PTX instruction counts, ptxas)")
    for name, (fn, kw) in VARIANTS.items():
        if fn is not gluon_ws:
            continue
        cex, warps = _gluon_constexprs(kw["bm"], kw["bn"], kw["bk"], kw["stages"])
        sig = dict(X="*bf16", W="*bf16", C="*bf16", ROWS="i32", N="i32", K="i32", **{k: "constexpr" for k in cex})
        attrs = {(i, ): [["tt.divisibility", 16]] for i in range(6)}
        fn_ = _ws_grouped_gemm if kw.get("specialise", True) else _pipelined_grouped_gemm
        kernel = triton.compile(GluonASTSource(fn_, sig, cex, attrs), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps, enable_fp_fusion=True))
        ptx = kernel.asm["ptx"]
        counts = {k: ptx.count(k) for k in ("setmaxnreg", "wgmma.mma_async", "wgmma.wait_group",
                                            "cp.async.bulk.tensor", "mbarrier.try_wait")}
        print(f"- {name}: {kernel.metadata.num_warps} warps, {kernel.metadata.shared} B shared, {_ptxas_info(ptx)}; "
              + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true", help="CPU: compile the Gluon kernels for sm_90a")
    ap.add_argument("--mla-compile", action="store_true",
                    help="CPU: compile the Gluon MLA tile with the heads on the N side for sm_90a")
    ap.add_argument("--w4a16-sass", action="store_true",
                    help="CPU: compile the Gluon W4A16 decode loop for sm_90a and count its instructions a weight")
    ap.add_argument("--w4a16", action="store_true", help="GPU: time the Gluon W4A16 grouped decode instead")
    ap.add_argument("--skip", default="", help="--w4a16: leave out the variants whose name holds this")
    ap.add_argument("--tokens", type=int, default=2, help="--w4a16: tokens an expert (64 tokens, top-16: ~1.7)")
    ap.add_argument("--experts", type=int, default=256,
                    help="experts timed (weights 44 MB each in bf16); --w4a16 defaults to 598 (64 tokens, top-16)")
    ap.add_argument("--rows", type=int, nargs="+", default=[192, 256], help="rows an expert, multiples of 64")
    ap.add_argument("--dims", type=int, nargs=2, default=[3584, 6144], metavar=("D", "N"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.compile_only:
        return compile_only()
    if args.w4a16_sass:
        return w4a16_sass()
    if args.mla_compile:
        return mla_compile()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("gluon_probe: needs a Hopper (or newer) GPU; --compile-only runs on the CPU")
    # Device-side TMA descriptors take their 128-byte scratch from here.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    if args.w4a16:
        return w4a16_bench(598 if args.experts == 256 else args.experts, args.tokens, args.rounds, args.skip)
    (D, N), E = args.dims, args.experts
    print(f"Grouped GEMM, {E} experts, D = {D}, N = {N}, bf16, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, triton {triton.__version__}\n")
    print("| rows an expert | path | rel err | ms (best of rounds) | spread | TFLOP/s | weight GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    torch.manual_seed(0)
    w = torch.randn(E * N, D, device="cuda", dtype=torch.bfloat16) * D**-0.5
    for rows in args.rows:
        if rows % 64:
            sys.exit(f"gluon_probe: --rows {rows} is not a multiple of 64")
        x = torch.randn(E * rows, D, device="cuda", dtype=torch.bfloat16)
        # Correctness on the first two experts' first 64 rows (fp32 reference).
        want = torch.cat([x[e * rows:e * rows + 64].float() @ w[e * N:(e + 1) * N].float().T for e in range(2)])
        ok = {}
        for name, (fn, kw) in VARIANTS.items():
            if rows % kw.get("bm", 64):
                continue
            try:
                got = fn(x, w, rows, **kw)
                got = torch.cat([got[e * rows:e * rows + 64] for e in range(2)]).float()
                ok[name] = ((got - want).abs().max() / want.abs().max()).item()
            except Exception as exc:  # noqa: BLE001 - report and go on: one variant's failure is a finding
                msg = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")[:300]
                print(f"| {rows} | {name} | FAILED: {msg} | | | | |", flush=True)
        times = {name: [] for name in ok}
        for _ in range(args.rounds):
            for name in ok:
                fn, kw = VARIANTS[name]
                times[name].append(triton.testing.do_bench(lambda fn=fn, kw=kw: fn(x, w, rows, **kw), warmup=10,
                                                           rep=100))
        flops = 2 * E * rows * N * D
        for name in ok:
            ms = min(times[name])
            print(f"| {rows} | {name} | {ok[name]:.1e}{' (!)' if ok[name] > 1e-2 else ''} | {ms:.3f} | "
                  f"{100 * (max(times[name]) / ms - 1):.0f} % | {flops / ms / 1e9:.0f} | {w.nbytes / ms / 1e6:.0f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
