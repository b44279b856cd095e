"""Absorbed-MLA paged decode in Gluon, for Hopper: both products on wgmma from shared memory.

What bounds the Triton kernel (`triton_decode`, BENCHMARKS.md twenty-third session): its products, not its loads.
Over one L2-resident page it still takes 87 % of its time (2.94 of 3.38 ms at B = 64, L = 32K, H = 96 on the
H100), while its paged loads alone stream at 2.9 TB/s. This kernel keeps the same split-K design, partials and
merge (`triton_decode._mla_merge_kernel`), and changes how a tile is multiplied:

- Eight warps, two warpgroups. A program takes 64 query rows (query token x head) of one sequence and split. The
  rows' absorbed queries (`[64, 512]` latent, `[64, 64]` rope) are stored once in shared memory, NVMMA-swizzled.
- The cached rows stream by 16-byte `cp.async` through their block-table pages into shared rings of STAGES
  `[BLOCK_N, 512]` + `[BLOCK_N, 64]` tiles, STAGES - 1 tiles ahead. Rows past the split's end are read from its
  last row (finite bytes, masked to -inf scores), so no zero fill is needed.
- Scores S = Q C^T + Q_pe K_pe^T `[64, BLOCK_N]`: one wgmma over the 576 columns, both operands from shared memory,
  the two warpgroups each taking half the tile's keys (warps [4, 2]).
- Online softmax in fp32 (exp2, the Triton kernel's rules for rows with no visible key); P goes to shared memory
  as bf16, and O `[64, 512]` += P C with C the same shared tile read as the right operand with its 512 columns
  contiguous; each warpgroup holds half of O's columns (128 fp32 registers a thread).
- The block-table entries of the next tile to copy are read an iteration early, off the critical path (reading
  them just before the copies was 12 % slower at B = 64, L = 32K).

Measured on the H100 (BENCHMARKS.md, twenty-third session), B = 64, L = 32K, H = 96: 1.54 ms against 3.36 for the
Triton kernel and 4.36 for the torch absorbed bmm; 1.51 ms over one L2-resident page, so the products bound it,
not the loads: 390 TFLOP/s over the 128 padded rows of 96 heads, about 40 % of the tensor cores, with the score
product, the softmax and the value product in turn within one program an SM (shared memory holds one program).
64-token tiles beat 32-token ones by 1.4x (2 x 32 keys a warpgroup per wgmma instead of 2 x 16).

K3's shapes only (r = 512, dr = 64, 16-bit caches); `triton_decode.mla_paged_decode` picks it by default where it
runs (see `gluon`). Gluon does not run under `TRITON_INTERPRET`: its tests run on a GPU
(`tests/kernels/test_mla_gluon.py`).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from ..gluon_compat import async_load, thread_barrier

__all__ = ["gluon_mla_available", "mla_split_gluon"]

BM = gl.constexpr(64)  # query rows a program: wgmma's M
R = gl.constexpr(512)
DR = gl.constexpr(64)


@gluon.jit
def _tile_rows(POOL, BT, b64, s_bt_b, s_pool_p, s_pool_s, n0, end, BLOCK_N: gl.constexpr, PAGE: gl.constexpr,
               layout: gl.constexpr):
    """Row starts `[BLOCK_N]` (in `layout`) of cached tokens n0.. of the sequence; tokens at or past `end` read
    token end - 1 instead (their scores are masked). A tile wholly past the end (computed ahead, never copied)
    reads no block-table entry."""
    n = gl.maximum(gl.minimum(n0 + gl.arange(0, BLOCK_N, layout=layout), end - 1), 0)
    page = gl.load(BT + b64 * s_bt_b + n // PAGE, mask=n < end, other=0).to(gl.int64)
    return POOL + page * s_pool_p + (n % PAGE).to(gl.int64) * s_pool_s


@gluon.jit
def _issue(base, c_ring, pe_ring, st, CL: gl.constexpr, PL: gl.constexpr):
    """Start the copies of the tile whose row starts are `base` (`_tile_rows`) into ring buffer st: latent
    `[BLOCK_N, 512]`, rope `[BLOCK_N, 64]`."""
    async_load(c_ring.index(st), base[:, None] + gl.arange(0, R, layout=gl.SliceLayout(0, CL))[None, :])
    base = gl.convert_layout(base, gl.SliceLayout(1, PL))
    async_load(pe_ring.index(st), base[:, None] + R + gl.arange(0, DR, layout=gl.SliceLayout(0, PL))[None, :])


# As in `triton_decode`: ints that change as a decode run grows are not specialised (no compile stall mid-generation).
@gluon.jit(do_not_specialize=["SPLIT_LEN", "s_bt_b", "s_mb", "s_mt", "s_mn"])
def _mla_split_gluon(
    Q, QPE, POOL, BT, LENS, MASK, O, PART_O, PART_LSE,
    H, TQ, M_ROWS, SPLIT_LEN,
    s_qb, s_qt, s_qh, s_pb, s_pt, s_ph,
    s_pool_p, s_pool_s, s_bt_b, s_mb, s_mt, s_mn,
    s_ob, s_ot, s_oh,
    qk_scale_log2,
    BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, HAS_MASK: gl.constexpr,
    ONE_SPLIT: gl.constexpr, ACC_S: gl.constexpr, ACC_O: gl.constexpr, CL: gl.constexpr, PL: gl.constexpr,
    Q_SMEM: gl.constexpr, QPE_SMEM: gl.constexpr, C_SMEM: gl.constexpr, PE_SMEM: gl.constexpr,
    P_SMEM: gl.constexpr,
):
    """The split kernel of `triton_decode._mla_paged_split_kernel` (same arguments, partials and rules), for r = 512,
    dr = 64, 64 rows a program."""
    mb = gl.program_id(0)
    b = gl.program_id(1)
    sp = gl.program_id(2)
    n_splits = gl.num_programs(2)
    L = gl.load(LENS + b).to(gl.int32)
    b64 = b.to(gl.int64)

    # The queries, once, into shared memory (zero rows past M_ROWS).
    rows_c = mb * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, CL))
    ok_c = rows_c < M_ROWS
    q = gl.load(Q + b64 * s_qb + (rows_c // H)[:, None] * s_qt + (rows_c % H)[:, None] * s_qh
                + gl.arange(0, R, layout=gl.SliceLayout(0, CL))[None, :], mask=ok_c[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(q.dtype, [BM, R], Q_SMEM, q)
    rows_p = mb * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, PL))
    ok_p = rows_p < M_ROWS
    qpe = gl.load(QPE + b64 * s_pb + (rows_p // H)[:, None] * s_pt + (rows_p % H)[:, None] * s_ph
                  + gl.arange(0, DR, layout=gl.SliceLayout(0, PL))[None, :], mask=ok_p[:, None], other=0.0)
    qpe_smem = gl.allocate_shared_memory(qpe.dtype, [BM, DR], QPE_SMEM, qpe)
    c_ring = gl.allocate_shared_memory(q.dtype, [STAGES, BLOCK_N, R], C_SMEM)
    pe_ring = gl.allocate_shared_memory(q.dtype, [STAGES, BLOCK_N, DR], PE_SMEM)
    p_smem = gl.allocate_shared_memory(q.dtype, [BM, BLOCK_N], P_SMEM)

    rows = mb * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC_S))
    limit = L - TQ + rows // H + 1  # causal: query t of the last TQ tokens sees positions < limit
    start = sp * SPLIT_LEN
    end = gl.minimum(start + SPLIT_LEN, L)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    RL: gl.constexpr = gl.SliceLayout(1, CL)
    for i in gl.static_range(STAGES - 1):
        if i < n_tiles:
            _issue(_tile_rows(POOL, BT, b64, s_bt_b, s_pool_p, s_pool_s, start + i * BLOCK_N, end, BLOCK_N, PAGE, RL),
                   c_ring, pe_ring, i, CL, PL)
        cp.commit_group()
    # the block-table entries of the next tile to copy, read an iteration early (off the critical path)
    base_next = _tile_rows(POOL, BT, b64, s_bt_b, s_pool_p, s_pool_s, start + (STAGES - 1) * BLOCK_N, end,
                           BLOCK_N, PAGE, RL)

    m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, ACC_S))
    l_i = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, ACC_S))
    acc = gl.zeros([BM, R], gl.float32, layout=ACC_O)
    for j in range(n_tiles):
        cp.wait_group(STAGES - 2)  # this thread's copies of tile j have landed,
        fence_async_shared()  # are visible to wgmma's async proxy,
        thread_barrier()  # and so are everyone's; everyone is done with tile j - 1 (its buffers, P)
        jn = j + STAGES - 1
        if jn < n_tiles:
            _issue(base_next, c_ring, pe_ring, jn % STAGES, CL, PL)
        base_next = _tile_rows(POOL, BT, b64, s_bt_b, s_pool_p, s_pool_s, start + (jn + 1) * BLOCK_N, end,
                               BLOCK_N, PAGE, RL)
        cp.commit_group()
        n = start + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ACC_S))
        if HAS_MASK:  # loaded before the products, which hide its latency
            mk = gl.load(MASK + b64 * s_mb + (rows // H)[:, None] * s_mt + n[None, :] * s_mn,
                         mask=(rows < M_ROWS)[:, None] & (n[None, :] < end), other=0)
        st = j % STAGES
        c_tile = c_ring.index(st)
        s = warpgroup_mma(q_smem, c_tile.permute((1, 0)), gl.zeros([BM, BLOCK_N], gl.float32, layout=ACC_S),
                          use_acc=False)
        s = warpgroup_mma(qpe_smem, pe_ring.index(st).permute((1, 0)), s)
        s = s * qk_scale_log2
        visible = (n[None, :] < end) & (n[None, :] < limit[:, None])
        if HAS_MASK:
            visible = visible & (mk != 0)
        s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, ACC_O))[:, None]
        p_smem.store(p.to(q.dtype))
        fence_async_shared()
        thread_barrier()  # all of P is stored before either warpgroup reads it
        acc = warpgroup_mma(p_smem, c_tile, acc)
    cp.wait_group(0)

    l_safe = gl.where(l_i == 0.0, 1.0, l_i)  # no visible key: output 0 (the merge gives such a split weight 0)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, ACC_O))[:, None]
    rows_o = mb * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC_O))
    ok_o = (rows_o < M_ROWS)[:, None]
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, ACC_O))[None, :]
    if ONE_SPLIT:
        gl.store(O + b64 * s_ob + (rows_o // H)[:, None] * s_ot + (rows_o % H)[:, None] * s_oh + offs_r,
                 out.to(O.dtype.element_ty), mask=ok_o)
    else:
        lse = gl.where(l_i == 0.0, float("-inf"), m_i + gl.log2(l_safe))  # log2 domain
        gl.store(PART_LSE + (b64 * n_splits + sp) * M_ROWS + rows, lse, mask=rows < M_ROWS)
        part = (b64 * n_splits + sp) * M_ROWS + rows_o  # PART_* are [B, n_splits, M_ROWS(, R)]
        gl.store(PART_O + part[:, None] * R + offs_r, out, mask=ok_o)


# Cached: built once per shape (tens of microseconds of Python a launch otherwise); callers must not mutate it.
@functools.lru_cache(maxsize=None)
def _constexprs(block_n: int, stages: int, page: int, dtype: torch.dtype) -> dict:
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return dict(
        BLOCK_N=block_n, PAGE=page, STAGES=stages,
        # warps [4, 2]: the four warps of a warpgroup over the 64 rows, the two warpgroups over the columns
        ACC_S=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, block_n // 2, 16]),
        ACC_O=gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16]),
        # the copies: 16 bytes a thread, a warp's covering 512 contiguous bytes of a latent row, 128 of a rope row
        CL=gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]),
        PL=gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]),
        Q_SMEM=gl.NVMMASharedLayout.get_default_for([64, 512], gdt),
        QPE_SMEM=gl.NVMMASharedLayout.get_default_for([64, 64], gdt),
        C_SMEM=gl.NVMMASharedLayout.get_default_for([block_n, 512], gdt),
        PE_SMEM=gl.NVMMASharedLayout.get_default_for([block_n, 64], gdt),
        P_SMEM=gl.NVMMASharedLayout.get_default_for([64, block_n], gdt),
    )


def gluon_mla_available(device: torch.device, r: int, dr: int, dtype: torch.dtype) -> bool:
    """This kernel's shapes (r = 512, dr = 64, a 16-bit cache) on a compute capability 9.x CUDA device."""
    return (device.type == "cuda" and r == 512 and dr == 64 and dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(device)[0] == 9)


def mla_split_gluon(grid, args: tuple, *, block_n: int, stages: int, page: int, has_mask: bool, one_split: bool,
                    dtype: torch.dtype) -> None:
    """Launch the split kernel over `grid` = (row blocks of 64, B, splits) with `triton_decode`'s arguments."""
    _mla_split_gluon[grid](*args, HAS_MASK=has_mask, ONE_SPLIT=one_split,
                           **_constexprs(block_n, stages, page, dtype), num_warps=8, enable_fp_fusion=True)
