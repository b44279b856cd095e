"""MXFP4 (W4A16) routed experts in Gluon, for Hopper: the weights as the wide side of the product.

At decode an expert gets a handful of tokens, so every weight is unpacked for a few rows and the unpack, not the
memory, sets the time of the Triton kernels (`triton_moe`, `tl.dot_scaled`: 6.5-7.3 SASS instructions a weight,
BENCHMARKS.md, thirteenth session). Gluon (`triton.experimental.gluon`, shipped with triton) lets the kernel pick
the operands' roles and register layouts that `tl.dot` chooses itself:

- The weights are wgmma's left operand, 64 rows a warpgroup, taken from registers; the expert's tokens (at most
  NT = 8, 16, 32 or 64 of them, zero-padded) are the right operand, from shared memory. Nothing is padded to 64
  rows. An expert with more tokens than NT takes several tiles, each unpacking its weights again, so NT grows with
  the tokens an expert gets (`tokens_per_tile`), and the same kernels serve prefill sizes. H100, K3 shapes, 896
  experts (BENCHMARKS.md, twenty-fifth session): 2K / 4K / 8K tokens 12.0 / 21.4 / 35.3 ms, against 23.4 / 24.5 /
  44.3 for the Triton `tl.dot_scaled` tiles that ran there before; 10.3 / - / 29.3 since `_down`'s atomics are
  relaxed and the scales load straight into the unpack's layout (twenty-sixth session). Tried there and dropped:
  128 slots (57 % padding at 8K tokens, 255 registers: 43.0 ms), programs ordered expert-major so that an expert's
  tiles share its weights in L2 (10-30 % slower), 128 weight rows a program in two warpgroups sharing the token
  tile (8K: 36.4 against 34.4 ms; 1K: 8.2 against 8.7, from `_down`), asynchronous wgmma with the up block's unpack
  overlapping the gate block's product (more registers, fewer programs an SM: 1-13 % slower from 64 to 8K tokens).
- The packed weights are read coalesced: 16-byte `cp.async` copies, a warp's covering whole rows' K steps (4 rows
  x 128 bytes at S = 4), into shared-memory rings of STAGES buffers (XOR-swizzled by row), STAGES - 1 steps ahead,
  and read from there into the left operand's rows: of each 32-byte block (64 inputs) of its rows r and r + 8, the
  thread with c = lane % 4 takes words 2c and 2c + 1, 16 nibbles, and turns them into the 16 bf16 values that
  wgmma's layout gives it (`_E2M1_WORDS_TO_BF16`, PTX). Loading the words straight into that layout (each warp
  load touching 8 rows, 8 bytes a thread) was measured 14 % slower over the whole MoE at 64 tokens (BENCHMARKS.md,
  twenty-third session): the loads, not the unpack, set the time.
- The conversion places bits instead of looking codes up: a nibble's exponent and mantissa bits (e1 e0 m) go to bf16
  bits 8..6 and its sign to bit 15. That bf16 is the E2M1 value times 2^-126 for every code (the codes 0 and 0.5
  land on bf16 subnormals, exactly), so one bf16 multiply by 2^(s - 127 + 126) applies the E8M0 scale s as well.
  Output register o of a word pair holds nibbles j and j + 4 of word o // 4 (j = o % 4): 16 bits apart, so both
  halves need the same shifts. About 2 instructions a weight; `gl.fp4_to_fp`'s lookups took about 3.
- So the operand's K order is a permutation of the inputs (`_operand_order`): position 16 t + 8 h + 2 c + q of each
  64-input block holds input 16 c + 8 (o // 4) + 4 q + o % 4, o = 2 t + h. A dot product does not care about the
  order of its terms, so the token side is gathered into the same order (on the host, before the kernels) and the
  released layout is read as it is: no repacked copy of 2.8T weights, and `save_pretrained` has nothing to undo.
- A thread's 16 values of a block lie in one 32-input scale block (c // 2). The multiplier is kept in bf16 range by
  a constant 2^-32, taken back on the fp32 accumulator: scales up to 2^33 are exact (far above trained weights);
  a larger one gives inf, not a wrong finite value.

About 3.5 SASS instructions a weight in the K loop (triton 3.6, sm_90a, K3 widths), against 4.5 with
`gl.fp4_to_fp` and 6.5-7.3 with `tl.dot_scaled`.

Two kernels, the structure of `triton_moe` (whose `_align` sorts the assignments into expert tiles of NT rows):
`_gate_up_situ` writes `h = SiTU-GLU(gate, up)` for 64 intermediate columns of a tile's tokens, stored in the
operand order `_down` reads; `_down` multiplies by the routing weight and adds into `out[token]` with relaxed fp32
atomics.
Gluon kernels do not run under `TRITON_INTERPRET`, so they are tested on the GPU (`tests/kernels/test_moe_gluon.py`)
against the torch reference; CPU runs use the Triton or torch paths.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from ..gluon_compat import async_load, thread_barrier
from .triton_moe import _align

__all__ = ["gluon_available", "moe_experts_gluon", "tokens_per_tile"]

BM = gl.constexpr(64)  # weight rows a program: one warpgroup's wgmma M
# The most assignments an expert gets on average for 32 token slots a tile; above, 64 (see `tokens_per_tile`).
_NT32_MAX_AVG = 30
UNSCALE = gl.constexpr(4294967296.0)  # 2^32: the accumulator's factor back (see the module doc)

# Words $8, $9 (16 nibbles) -> 8 bf16 pairs: $o = nibbles j, j + 4 of word o // 4, j = o % 4, as bf16 bits: the
# nibble's low three bits shifted to bits 8..6 (and 24..22), its sign to bit 15 (and 31). lop3 0xEA: (a & b) | c.
_E2M1_WORDS_TO_BF16 = gl.constexpr("""
{
.reg .b32 m<8>, s<8>;
shl.b32 m0, $8, 6;  shl.b32 s0, $8, 12;
shl.b32 m1, $8, 2;  shl.b32 s1, $8, 8;
shr.u32 m2, $8, 2;  shl.b32 s2, $8, 4;
shr.u32 m3, $8, 6;
shl.b32 m4, $9, 6;  shl.b32 s4, $9, 12;
shl.b32 m5, $9, 2;  shl.b32 s5, $9, 8;
shr.u32 m6, $9, 2;  shl.b32 s6, $9, 4;
shr.u32 m7, $9, 6;
and.b32 s0, s0, 0x80008000; and.b32 s1, s1, 0x80008000; and.b32 s2, s2, 0x80008000; and.b32 s3, $8, 0x80008000;
and.b32 s4, s4, 0x80008000; and.b32 s5, s5, 0x80008000; and.b32 s6, s6, 0x80008000; and.b32 s7, $9, 0x80008000;
lop3.b32 $0, m0, 0x01C001C0, s0, 0xEA; lop3.b32 $1, m1, 0x01C001C0, s1, 0xEA;
lop3.b32 $2, m2, 0x01C001C0, s2, 0xEA; lop3.b32 $3, m3, 0x01C001C0, s3, 0xEA;
lop3.b32 $4, m4, 0x01C001C0, s4, 0xEA; lop3.b32 $5, m5, 0x01C001C0, s5, 0xEA;
lop3.b32 $6, m6, 0x01C001C0, s6, 0xEA; lop3.b32 $7, m7, 0x01C001C0, s7, 0xEA;
}
""")


@gluon.jit
def _sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def _tanh(x):
    return 2.0 * _sigmoid(2.0 * x) - 1.0  # saturates cleanly to +-1 for large |x|


@gluon.jit
def _operand_position(n):
    """The inverse of `_operand_order`: where input n sits in the operand order."""
    p = n % 64
    r = p % 16
    o = 4 * (r // 8) + r % 4
    return n - p + 16 * (o // 2) + 8 * (o % 2) + 2 * (p // 16) + (r % 8) // 4


@gluon.jit
def _unpack_mma(words, sb, x_tile, acc, S: gl.constexpr, ACC: gl.constexpr):
    """One K step of S 64-input blocks: `words` int32 `[64, S, 4, 2]` (row, block, c, word) as `_weight_ptrs` lays
    them out, `sb` `[64, S, 4]` the E8M0 scale of each (row, block, c // 2), the token tile `[NT, 64 S]` (operand
    order) in shared memory; returns acc + 2^-32 W x^T, `[64, NT]` fp32."""
    r = gl.inline_asm_elementwise(_E2M1_WORDS_TO_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                  dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)
    # 2^(s - 127 + 126 - 32) as bf16 bits; s >= 161 saturates to inf (bits 0x7F80) instead of wrapping.
    sc = ((gl.minimum(sb.to(gl.int32), 161) + 94) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
    sc = gl.expand_dims(sc, 3)
    w = gl.join(gl.join(gl.join(r[0] * sc, r[1] * sc), gl.join(r[2] * sc, r[3] * sc)),
                gl.join(gl.join(r[4] * sc, r[5] * sc), gl.join(r[6] * sc, r[7] * sc)))  # [64, S, c, q, h, t0, t1]
    w = gl.reshape(gl.permute(w, (0, 1, 6, 5, 4, 2, 3)), [BM, 64 * S])  # position 16 t + 8 h + 2 c + q of a block
    return warpgroup_mma(gl.convert_layout(w, gl.DotOperandLayout(0, ACC, 2)), x_tile.permute((1, 0)), acc)


@gluon.jit
def _weight_ptrs(W, WS, e, row0, RW, RS, S: gl.constexpr, LL: gl.constexpr, SL: gl.constexpr, WL: gl.constexpr,
                 SDIRECT: gl.constexpr):
    """Pointers to the first K step of 64 weight rows from row0 of expert e (packed `[E, R, K / 2]` bytes, read as
    int32 words, RW = K / 8 a row; scales `[E, R, K / 32]`, RS = K / 32 a row), R = num_programs(0) * 64 rows:
    words `[64, 8 S]` in layout LL (16 bytes a thread), scales `[64, 2 S]` in SL (a row's 2 S bytes a thread), or
    with SDIRECT `[64, S, 4]` in the unpack's layout.
    Hoisted, so each K step only adds a scalar. RW and RS are arguments of their own so that the launcher's
    divisibility specialisation sees them (K3's widths: multiples of 16), which vectorises the copies."""
    R = gl.num_programs(0) * BM
    rw = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, LL))
    w_ptr = (W.to(gl.pointer_type(gl.int32)) + (e * R + rw[:, None]) * RW
             + gl.arange(0, 8 * S, layout=gl.SliceLayout(0, LL))[None, :])
    if SDIRECT:
        # `[64, S, 4]` loaded straight into `_unpack_mma`'s scale layout, (row, block b, c) -> byte 2 b + c // 2 of the
        # row's step, instead of `_scales_wl`'s conversion (two barriers a weight block a K step). Taken at 64 token
        # slots (H100, twenty-sixth session: 2K / 8K tokens 10.34 / 29.30 against 10.60 / 29.79 ms); at 32 slots and
        # fewer, where S = 4, the byte loads cost registers (195 against 177 in `_gate_up_situ`) and it was slower
        # (1K tokens 8.17 against 7.73, 64 tokens 3.84 against 3.73).
        L3: gl.constexpr = gl.SliceLayout(3, WL)
        rs = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        bs = gl.arange(0, S, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        cs = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        off = (gl.expand_dims(gl.expand_dims((e * R + rs) * RS, 1), 2) + gl.expand_dims(gl.expand_dims(2 * bs, 0), 2)
               + gl.expand_dims(gl.expand_dims(cs // 2, 0), 1))
        s_ptr = WS + off
    else:
        rs = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, SL))
        s_ptr = WS + (e * R + rs[:, None]) * RS + gl.arange(0, 2 * S, layout=gl.SliceLayout(0, SL))[None, :]
    return w_ptr, s_ptr


@gluon.jit
def _scales_wl(sb, S: gl.constexpr, WL: gl.constexpr):
    """Scales as read, `[64, 2 S]`, as `[64, S, 4]` (c // 2's byte for each c) in the layout `_unpack_mma` takes."""
    sb = gl.reshape(sb, [BM, S, 2])
    return gl.convert_layout(gl.reshape(gl.join(sb, sb), [BM, S, 4]), gl.SliceLayout(3, WL))


@gluon.jit
def _issue(a_ptr, a_ring, b_ptr, b_ring, x_ptr, x_mask, x_ring, k, st, BK: gl.constexpr, TWO: gl.constexpr):
    """Start the copies of K step k (words of one or two weight blocks, the token tile) into ring buffer st."""
    async_load(a_ring.index(st), a_ptr + k * (BK // 8))
    if TWO:
        async_load(b_ring.index(st), b_ptr + k * (BK // 8))
    async_load(x_ring.index(st), x_ptr + k * BK, mask=x_mask)


@gluon.jit
def _k_async(a_ptr, b_ptr, sa_ptr, sb_ptr, x_ptr, x_mask, K, NT: gl.constexpr, S: gl.constexpr, ACC: gl.constexpr,
             WL: gl.constexpr, W2L: gl.constexpr, WSM: gl.constexpr, X_SMEM: gl.constexpr, STAGES: gl.constexpr,
             TWO: gl.constexpr, SDIRECT: gl.constexpr):
    """The K loop with the words (coalesced, `[64, 8 S]` a step) and the token tile (contiguous: the host gathers
    it into the operand order) streamed by `cp.async` into rings of STAGES buffers, STAGES - 1 steps ahead; the
    scales one step ahead in registers. Returns the accumulators of one (two when TWO) weight blocks."""
    BK: gl.constexpr = 64 * S
    n_k = K // BK
    a_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BM, 8 * S], WSM)
    if TWO:
        b_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BM, 8 * S], WSM)
    else:
        b_ring = a_ring
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, NT, BK], X_SMEM)
    acc_a = gl.zeros([BM, NT], gl.float32, ACC)
    acc_b = gl.zeros([BM, NT], gl.float32, ACC)
    for i in gl.static_range(STAGES - 1):
        if i < n_k:
            _issue(a_ptr, a_ring, b_ptr, b_ring, x_ptr, x_mask, x_ring, i, i, BK, TWO)
        cp.commit_group()
    sa = gl.load(sa_ptr)
    sb = sa
    if TWO:
        sb = gl.load(sb_ptr)
    for k in range(n_k):
        cp.wait_group(STAGES - 2)  # this thread's copies of step k have landed,
        fence_async_shared()  # are visible to wgmma's async proxy (cp.async writes through the generic one),
        thread_barrier()  # and so are everyone's; everyone is done with step k - 1's buffers, refilled next
        kn = k + STAGES - 1
        if kn < n_k:
            _issue(a_ptr, a_ring, b_ptr, b_ring, x_ptr, x_mask, x_ring, kn, kn % STAGES, BK, TWO)
        cp.commit_group()
        kq = gl.minimum(k + 1, n_k - 1) * (2 * S)
        sa_next = gl.load(sa_ptr + kq)
        sb_next = sa_next
        if TWO:
            sb_next = gl.load(sb_ptr + kq)
        st = k % STAGES
        words = gl.convert_layout(gl.reshape(a_ring.index(st).load(W2L), [BM, S, 4, 2]), WL)
        acc_a = _unpack_mma(words, sa if SDIRECT else _scales_wl(sa, S, WL), x_ring.index(st), acc_a, S, ACC)
        if TWO:
            words = gl.convert_layout(gl.reshape(b_ring.index(st).load(W2L), [BM, S, 4, 2]), WL)
            acc_b = _unpack_mma(words, sb if SDIRECT else _scales_wl(sb, S, WL), x_ring.index(st), acc_b, S, ACC)
        sa = sa_next
        sb = sb_next
    cp.wait_group(0)
    return acc_a, acc_b


@gluon.jit
def _tile_rows(SORTED, tile, num_assign, top_k, NT: gl.constexpr, layout: gl.constexpr):
    """A tile's NT assignment ids, which are real, and their tokens."""
    assign = gl.load(SORTED + tile * NT + gl.arange(0, NT, layout=layout))
    valid = assign < num_assign
    return assign, valid, (assign // top_k).to(gl.int64)


@gluon.jit
def _gate_up_situ(X, W, WS, H, SORTED, BLOCK_EXPERT, num_assign, top_k, D, I, DW, DS, beta, linear_beta,
                  NT: gl.constexpr, S: gl.constexpr, ACC: gl.constexpr, WL: gl.constexpr, XL: gl.constexpr,
                  X_SMEM: gl.constexpr, LL: gl.constexpr, SL: gl.constexpr, W2L: gl.constexpr, WSM: gl.constexpr,
                  STAGES: gl.constexpr, SDIRECT: gl.constexpr):
    """h[tile rows, 64 columns] = SiTU-GLU(x W_gate^T, x W_up^T); grid (I / 64, tiles). W `[E, 2I, D / 2]` (gate
    rows first, then up); X `[N, D]` gathered into the operand order. h is stored in the operand order of `_down`'s
    K steps."""
    BK: gl.constexpr = 64 * S
    n0 = gl.program_id(0) * BM
    tile = gl.program_id(1)
    e = gl.load(BLOCK_EXPERT + tile)
    if e >= 0:  # spare tiles of `_align`'s bound have no expert
        e64 = e.to(gl.int64)
        wg_ptr, sg_ptr = _weight_ptrs(W, WS, e64 * 2, n0, DW, DS, S, LL, SL, WL, SDIRECT)  # 2I rows: 2 e "experts"
        wu_ptr, su_ptr = _weight_ptrs(W, WS, e64 * 2 + 1, n0, DW, DS, S, LL, SL, WL, SDIRECT)
        assign, valid, token = _tile_rows(SORTED, tile, num_assign, top_k, NT, gl.SliceLayout(1, XL))
        x_ptr = X + token[:, None] * D + gl.arange(0, BK, layout=gl.SliceLayout(0, XL))[None, :]
        acc_g, acc_u = _k_async(wg_ptr, wu_ptr, sg_ptr, su_ptr, x_ptr, valid[:, None], D, NT, S, ACC, WL, W2L, WSM,
                                X_SMEM, STAGES, True, SDIRECT)
        acc_g = acc_g * UNSCALE
        acc_u = acc_u * UNSCALE
        h = beta * _tanh(acc_g / beta) * _sigmoid(acc_g) * (linear_beta * _tanh(acc_u / linear_beta))
        # Column n of h goes where `_down` reads input n: its operand position.
        q = _operand_position(n0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC)))
        rows = (tile * NT + gl.arange(0, NT, layout=gl.SliceLayout(0, ACC))).to(gl.int64)
        gl.store(H + rows[None, :] * I + q[:, None], h.to(gl.bfloat16))


@gluon.jit
def _down(H, W, WS, OUT, TOPW, SORTED, BLOCK_EXPERT, num_assign, top_k, D, I, IW, IS,
          NT: gl.constexpr, S: gl.constexpr, ACC: gl.constexpr, WL: gl.constexpr, XL: gl.constexpr,
          X_SMEM: gl.constexpr, LL: gl.constexpr, SL: gl.constexpr, W2L: gl.constexpr, WSM: gl.constexpr,
          STAGES: gl.constexpr, SDIRECT: gl.constexpr, ATL: gl.constexpr, COAL: gl.constexpr):
    """out[token, 64 columns] += routing weight * (h W_down^T); grid (D / 64, tiles). W `[E, D, I / 2]`.

    The adds are relaxed atomics: their order does not matter, and the kernel's end orders them for the reader. The
    default (acq_rel) put a GPU-wide fence and an L1 invalidation around each one (sm_90a SASS: `MEMBAR.ALL.GPU`,
    `ATOMG`, `CCTL.IVALL`, 32 a thread) and took 38 % more time in this kernel at 8K tokens (H100). COAL: first move
    the products to ATL, a warp's lanes along 32 consecutive columns of one token, so that each atomic instruction
    covers one 128-byte line instead of 32 bytes of four tokens' (3 % at 64 token slots, nothing at 32)."""
    BK: gl.constexpr = 64 * S
    d0 = gl.program_id(0) * BM
    tile = gl.program_id(1)
    e = gl.load(BLOCK_EXPERT + tile)
    if e >= 0:
        w_ptr, s_ptr = _weight_ptrs(W, WS, e.to(gl.int64), d0, IW, IS, S, LL, SL, WL, SDIRECT)
        rows = (tile * NT + gl.arange(0, NT, layout=gl.SliceLayout(1, XL))).to(gl.int64)
        h_ptr = H + rows[:, None] * I + gl.arange(0, BK, layout=gl.SliceLayout(0, XL))[None, :]
        # pad rows of a tile hold finite values and get no output: no mask on h
        acc, _ = _k_async(w_ptr, w_ptr, s_ptr, s_ptr, h_ptr, None, I, NT, S, ACC, WL, W2L, WSM, X_SMEM, STAGES, False,
                          SDIRECT)
        L: gl.constexpr = ATL if COAL else ACC
        acc = gl.convert_layout(acc, L)
        assign, valid, token = _tile_rows(SORTED, tile, num_assign, top_k, NT, gl.SliceLayout(0, L))
        wt = gl.load(TOPW + assign, mask=valid, other=0.0) * UNSCALE
        d = d0 + gl.arange(0, BM, layout=gl.SliceLayout(1, L))
        gl.atomic_add(OUT + token[None, :] * D + d[:, None], acc * wt[None, :], mask=valid[None, :], sem="relaxed")


# Cached: built once per shape (tens of microseconds of Python a launch otherwise); callers must not mutate it.
@functools.lru_cache(maxsize=None)
def _constexprs(nt: int, s: int, stages: int) -> dict:
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, nt, 16])
    # wgmma's operand layout of the words `[64 rows, S blocks, 4 (c), 2]`: a thread holds words 2c, 2c + 1 of each
    # block of rows r and r + 8, c = lane % 4, r = 16 warp + lane / 4; the word pair in consecutive registers.
    steps = [[0, 1 << j, 0, 0] for j in range(s.bit_length() - 1)]
    wl = gl.DistributedLinearLayout(reg_bases=[[0, 0, 0, 1], [8, 0, 0, 0]] + steps,
                                    lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
                                    warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[BM, s, 4, 2])
    # The copies: 16 bytes a thread, a warp's covering whole rows' K steps (4 rows x 128 bytes at S = 4); the scales
    # as the 2 S distinct bytes of each row, in one load a thread.
    ll = gl.BlockedLayout([1, 4], [32 // (2 * s), 2 * s], [4, 1], [1, 0])
    sl = gl.BlockedLayout([1, 2 * s], [32, 1], [4, 1], [1, 0])
    # wgmma's layout of the words as the 2-D `[64, 8 S]` they are in the ring (column 8 b + 2 c + q), whose 16-byte
    # chunks are XOR-swizzled by row so that those reads (8 rows, 32 bytes each, a warp) spread over the banks.
    w2l = gl.DistributedLinearLayout(reg_bases=[[0, 1], [8, 0]] + [[0, 8 << j] for j in range(s.bit_length() - 1)],
                                     lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                     warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BM, 8 * s])
    wsm = gl.SwizzledSharedLayout(4, max(1, 4 // s), min(8, 2 * s), [1, 0])
    cols = min(32, 8 * s)  # threads along K of the token tile, 8 inputs each
    return dict(NT=nt, S=s, ACC=acc, WL=wl, XL=gl.BlockedLayout([1, 8], [32 // cols, cols], [4, 1], [1, 0]),
                X_SMEM=gl.NVMMASharedLayout.get_default_for([nt, 64 * s], gl.bfloat16), LL=ll, SL=sl, W2L=w2l,
                WSM=wsm, STAGES=stages, SDIRECT=nt == 64)


# `_down`'s atomic adds: a warp's 32 lanes along 32 consecutive output columns of one token (a 128-byte line)
_ATOMIC_LAYOUT = gl.BlockedLayout([1, 1], [32, 1], [1, 4], [0, 1])


def _down_constexprs(nt: int) -> dict:
    """`_down`'s own constexprs: the atomics' layout, taken at 64 token slots (see its docstring)."""
    return dict(ATL=_ATOMIC_LAYOUT, COAL=nt == 64)


def _operand_order(k: int, device: torch.device) -> torch.Tensor:
    """The input held at each of the k operand positions: position 64 b + 16 t + 8 h + 2 c + q holds input
    64 b + 16 c + 8 (o // 4) + 4 q + o % 4, o = 2 t + h (see the module doc). Cached per width and device, except
    while a CUDA graph is captured: a tensor built then holds its values only once the graph replays."""
    if torch.cuda.is_current_stream_capturing():
        return _build_operand_order(k, device)
    return _cached_operand_order(k, device)


def _build_operand_order(k: int, device: torch.device) -> torch.Tensor:
    P = torch.arange(k, device=device)
    p = P % 64
    o = 2 * (p // 16) + (p // 8) % 2
    return P - p + 16 * ((p // 2) % 4) + 8 * (o // 4) + 4 * (p % 2) + o % 4


_cached_operand_order = functools.lru_cache(maxsize=None)(_build_operand_order)


def gluon_available(device: torch.device) -> bool:
    """Gluon kernels need a real CUDA device of compute capability 9.x (Hopper: wgmma)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def tokens_per_tile(assignments: int, num_experts: int) -> int:
    """NT, the token slots of a tile: the wgmma N of the products. An expert with more assignments takes more tiles,
    each re-reading and unpacking its weights, so NT grows with the average load. H100, K3 shapes, 896 experts, ms
    with 32 / 64 slots (twenty-fifth session): 18 assignments an expert 8.7 / 11.0, 27 10.7 / 12.0, 32 12.7 / 12.3,
    37 14.8 / 12.6."""
    avg = assignments / num_experts
    return 8 if avg <= 4 else 16 if avg <= 12 else 32 if avg <= _NT32_MAX_AVG else 64


def _k_step(k: int, nt: int) -> int:
    """S, the 64-input blocks a K step: at most 4 (the H100 probe's best up to 32 token slots) or 2 at 64 slots (the
    token ring is 4x larger there; S = 4 / 2 / 1 gave 41.6 / 35.9 / 37.6 ms at 8K tokens), the largest dividing the
    width."""
    for s in (4, 2, 1) if nt <= 32 else (2, 1):
        if k % (64 * s) == 0:
            return s
    raise ValueError(f"moe_experts_gluon: the latent and expert widths must be multiples of 64, got {k}")


def moe_experts_gluon(x, top_idx, top_w, w13_packed, w13_scale, w2_packed, w2_scale, *, beta: float = 4.0,
                      linear_beta: float = 25.0, token_slots: int | None = None, k_step: int | None = None,
                      stages: int = 2):
    """x `[N, D]` -> `[N, D]` on MXFP4 experts in the released layout (see `triton_moe.moe_experts_triton`), any
    batch size; Hopper only (`gluon_available`). `token_slots` overrides NT (8, 16, 32 or 64), `k_step` the
    64-input blocks of a K step (1, 2 or 4, dividing both widths), `stages` the ring buffers (2, 3 or 4; 2 measured
    fastest on the H100)."""
    E, two_i, D = w13_packed.shape[0], w13_packed.shape[1], 2 * w13_packed.shape[2]
    I = two_i // 2
    if not gluon_available(x.device):
        raise RuntimeError(f"moe_experts_gluon needs a compute capability 9.x CUDA device, got {x.device}")
    if D % 64 or I % 64:
        raise ValueError(f"moe_experts_gluon: the latent and expert widths must be multiples of 64, got {D} and {I}")
    N, k = top_idx.shape
    nt = token_slots or tokens_per_tile(N * k, E)
    if nt not in (8, 16, 32, 64):
        raise ValueError(f"moe_experts_gluon: token_slots must be 8, 16, 32 or 64, got {nt}")
    if k_step is not None and (k_step not in (1, 2, 4) or D % (64 * k_step) or I % (64 * k_step)):
        raise ValueError(f"moe_experts_gluon: k_step must be 1, 2 or 4 and divide {D // 64} and {I // 64}, "
                         f"got {k_step}")
    if stages not in (2, 3, 4):
        raise ValueError(f"moe_experts_gluon: stages must be 2, 3 or 4, got {stages}")
    if N == 0:
        return torch.zeros((0, D), device=x.device, dtype=x.dtype)
    sorted_ids, block_expert, tiles, _, _ = _align(top_idx, E, nt)
    hbuf = torch.empty((tiles * nt, I), device=x.device, dtype=torch.bfloat16)
    out = torch.zeros((N, D), device=x.device, dtype=torch.float32)
    # The rings copy the token tile contiguously: gather it into the operand order once. [N, D] -> [N, D]
    xb = x.to(torch.bfloat16)[:, _operand_order(D, x.device)]
    s1, s2 = k_step or _k_step(D, nt), k_step or _k_step(I, nt)
    _gate_up_situ[(I // BM, tiles)](xb, w13_packed, w13_scale, hbuf, sorted_ids, block_expert, N * k, k, D, I,
                                    D // 8, D // 32, beta, linear_beta, **_constexprs(nt, s1, stages), num_warps=4,
                                    enable_fp_fusion=True)
    _down[(D // BM, tiles)](hbuf, w2_packed, w2_scale, out, top_w.reshape(-1).float().contiguous(), sorted_ids,
                            block_expert, N * k, k, D, I, I // 8, I // 32, **_constexprs(nt, s2, stages),
                            **_down_constexprs(nt), num_warps=4, enable_fp_fusion=True)
    return out.to(x.dtype)
