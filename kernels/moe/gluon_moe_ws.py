"""Routed experts at prefill sizes in Gluon, for Hopper: one weight step shared by three token tiles of an expert.

`gluon_moe`'s MXFP4 kernels unpack an expert's weights once per 64-token tile, in the warps that then multiply (a
program that reused its unpack for several tiles lost more to registers than it saved, BENCHMARKS.md, thirty-sixth
session), and the Triton bf16 tiles load each weight tile once per row tile. Here the work is split across
warpgroups of one program (`gl.warp_specialize`):

- a producer warpgroup fills each ring stage with one K step of 64 inputs: the weights of 64 intermediate columns'
  gate and up rows (or 128 output rows of down) as bf16 `[128 rows, 64]`, copied (bf16 experts) or unpacked once
  from MXFP4 words loaded two steps ahead, and the token tiles of the step (`cp.async`, gathered through the sorted
  assignment ids). For bf16 experts (`w_stages`, the default through `moe_experts_triton`) every operand comes by
  TMA instead: the weights into a ring of their own, the token tiles from x gathered once into slot order; the
  producer then only waits for free stages, and each ring runs as far ahead as its depth;
- three consumer warpgroups each take one 64-token tile of the expert and issue `wgmma m64n128k16` with the tile as
  the left and the weights as the right operand, both from shared memory, asynchronously;
- mbarriers hand the stages over: `ready` (the producer's one arrival once its copies have landed and its stores
  are fenced; by TMA, its expect-tx arrival and the bulk copies' bytes), `empty` (each consumer's arrival once the
  product that read the stage has retired).

The unpacked weights land in shared memory in the inputs' natural order (the register permutation that `gluon_moe`
leaves in its operand is undone for free as a reshape of the unpacked values), so tokens and h need no reordering;
the gate and up rows are interleaved (row 2 i + p: p = 0 gate, 1 up), so each thread's accumulator holds the pairs
SiTU-GLU combines.

A persistent grid (one program an SM) walks the (token group, column block) work list: a group is up to three
consecutive tiles of one expert (`_tile_groups`). Consumers without a tile in the group still take part in the
hand-overs. H100 (thirty-seventh session): bf16 experts at K3's 146 rows an expert 1.11x the Triton tiles; MXFP4 at
8K tokens no faster than `gluon_moe` (30.41 against 29.71 ms: the one producer warpgroup's unpack sets the pace).
`tokens_n` (opt-in, bf16 experts with every operand by TMA) swaps the operands: the weights on the left, an expert's
token rows as the N side, rows aligned to 16 instead of 64 (the block before `_ws_experts_tn`).
Gluon kernels do not run under `TRITON_INTERPRET`; tested on the GPU against the torch reference.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..gluon_compat import async_load, thread_barrier, tma_load
from .gluon_moe import _E2M1_WORDS_TO_BF16, UNSCALE, _sigmoid, _tanh
from .triton_moe import _align

__all__ = ["moe_experts_gluon_ws"]

G = gl.constexpr(3)  # consumer warpgroups: token tiles of a group
BT = gl.constexpr(64)  # token slots a tile (wgmma M)
BK = gl.constexpr(64)  # inputs a K step (one 32-byte packed block a row)


@gluon.jit
def _unpack_half(words, sb):
    """words int32 `[64, 1, 4, 2]` (row, block, c, word), sb `[64, 1, 4]` E8M0 bytes -> bf16 `[64, 64]` in natural
    input order, times 2^-32 (see `gluon_moe`)."""
    r = gl.inline_asm_elementwise(_E2M1_WORDS_TO_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                  dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)
    sc = ((gl.minimum(sb.to(gl.int32), 161) + 94) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
    sc = gl.expand_dims(sc, 3)
    w = gl.join(gl.join(gl.join(r[0] * sc, r[1] * sc), gl.join(r[2] * sc, r[3] * sc)),
                gl.join(gl.join(r[4] * sc, r[5] * sc), gl.join(r[6] * sc, r[7] * sc)))  # [64, 1, c, q, h, t0, t1]
    # input 16 c + 8 t1 + 4 q + 2 t0 + h of the block (o = 4 t1 + 2 t0 + h; `gluon_moe`'s module doc)
    return gl.reshape(gl.permute(w, (0, 1, 2, 6, 3, 5, 4)), [64, 64])


@gluon.jit
def _word_ptrs(W, WS, row_a, row_b, KW, KS, WL: gl.constexpr):
    """Pointers to K step 0 of 64 rows from row_a and 64 from row_b (int64 row indices of W viewed as int32 words
    `[rows, KW]`, scales `[rows, KS]` bytes) in the unpack's layouts."""
    L3: gl.constexpr = gl.SliceLayout(3, WL)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    q = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WL))))
    rw = gl.expand_dims(gl.expand_dims(gl.expand_dims(r, 1), 2), 3)
    col = (gl.expand_dims(gl.expand_dims(gl.expand_dims(c, 0), 1), 3) * 2
           + gl.expand_dims(gl.expand_dims(gl.expand_dims(q, 0), 1), 2))
    Wi = W.to(gl.pointer_type(gl.int32))
    wa = Wi + (row_a + rw) * KW + col
    wb = Wi + (row_b + rw) * KW + col
    rs = gl.expand_dims(gl.expand_dims(r, 1), 2)
    cs = gl.expand_dims(gl.expand_dims(c // 2, 0), 1)
    return wa, wb, WS + (row_a + rs) * KS + cs, WS + (row_b + rs) * KS + cs


@gluon.jit
def _load_words(ptrs, k):
    """K step k's words and scales of both 64-row halves (`_word_ptrs`' pointers at step 0)."""
    wa_ptr, wb_ptr, sa_ptr, sb_ptr = ptrs
    return (gl.load(wa_ptr + k * (BK // 8)), gl.load(wb_ptr + k * (BK // 8)), gl.load(sa_ptr + k * (BK // 32)),
            gl.load(sb_ptr + k * (BK // 32)))


@gluon.jit
def _group(GROUPS, BLOCK_EXPERT, w, NB, tiles):
    """Work item w: its group's first tile, expert, column block and how many of the group's G tiles are real."""
    t = gl.load(GROUPS + w // NB)
    e = gl.load(BLOCK_EXPERT + t)
    n_t = 1
    for j in gl.static_range(1, G):
        same = (t + j < tiles) & (gl.load(BLOCK_EXPERT + gl.minimum(t + j, tiles - 1)) == e)
        n_t += (same & (n_t == j)).to(gl.int32)
    return t, e, w % NB, n_t


@gluon.jit
def _tile_src(SORTED, t, J: gl.constexpr, n_t, num_assign, top_k, K, GATE: gl.constexpr, XL: gl.constexpr):
    """Row offsets `[64, 1]` (int64, elements) and mask of tile t + J's token rows in the product's input: x rows
    gathered through the sorted assignment ids (gate_up), or the tile's own rows of h (down)."""
    rows = (t + J) * BT + gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
    if GATE:
        assign = gl.load(SORTED + rows, mask=(rows >= 0) & (J < n_t), other=num_assign)  # J < n_t as a row mask
        ok = assign < num_assign
        return gl.expand_dims((gl.where(ok, assign, 0) // top_k).to(gl.int64) * K, 1), gl.expand_dims(ok, 1)
    else:
        return gl.expand_dims(rows.to(gl.int64) * K, 1), gl.expand_dims((rows >= 0) & (J < n_t), 1)


@gluon.jit
def _fill(X, W, x_ring, w_ring, empty, n, k, cols, w_off, o0, m0, o1, m1, o2, m2, FP4: gl.constexpr,
          STAGES: gl.constexpr):
    """Start the copies of K step k (the producer's step n, counted over its work items) into stage n % STAGES once
    the consumers have handed it back: the group's three token tiles (masked rows: zeros), and bf16 weight rows."""
    st = n % STAGES
    # a fresh mbarrier counts as having completed the phase before phase 0, so the first lap does not wait
    mbarrier.wait(empty.index(st), ((n // STAGES) & 1) ^ 1)
    async_load(x_ring.index(st * G + 0), X + o0 + (k * BK + cols), mask=m0)
    async_load(x_ring.index(st * G + 1), X + o1 + (k * BK + cols), mask=m1)
    async_load(x_ring.index(st * G + 2), X + o2 + (k * BK + cols), mask=m2)
    if not FP4:
        async_load(w_ring.index(st), W + w_off + (k * BK + cols))


@gluon.jit
def _fill_w(W_DESC, w_ring, w_ready, w_empty, n, k, row_a, row_b, GATE: gl.constexpr, W_STAGES: gl.constexpr):
    """TMA: K step k's bf16 weights (the producer's step n) into weight stage n % W_STAGES once the consumers have
    handed it back; `w_ready` completes when its bytes have landed. gate_up: gate rows in stage rows 0-63, up rows in
    64-127; down: 128 consecutive output rows."""
    st = n % W_STAGES
    mbarrier.wait(w_empty.index(st), ((n // W_STAGES) & 1) ^ 1)
    mbarrier.expect(w_ready.index(st), 128 * BK * 2)
    if GATE:
        tma_load(W_DESC, [row_a.to(gl.int32), k * BK], w_ready.index(st), w_ring.index(st).slice(0, 64))
        tma_load(W_DESC, [row_b.to(gl.int32), k * BK], w_ready.index(st), w_ring.index(st).slice(64, 64))
    else:
        tma_load(W_DESC, [row_a.to(gl.int32), k * BK], w_ready.index(st), w_ring.index(st))


@gluon.jit
def _fill_x(X_DESC, x_ring, ready, empty, n, k, t, n_t, STAGES: gl.constexpr):
    """TMA: K step k's token tiles (the producer's step n) into stage n % STAGES once the consumers have handed it
    back: the group's n_t real tiles, consecutive rows of x in slot order (gate_up) or of h (down); `ready`
    completes when their bytes have landed."""
    st = n % STAGES
    mbarrier.wait(empty.index(st), ((n // STAGES) & 1) ^ 1)
    for j in gl.static_range(G):  # the byte count must be a compile-time constant
        if j + 1 == n_t:
            mbarrier.expect(ready.index(st), (j + 1) * BT * BK * 2)
    for j in gl.static_range(G):
        if j < n_t:
            tma_load(X_DESC, [(t + j) * BT, k * BK], ready.index(st), x_ring.index(st * G + j))


@gluon.jit
def _producer(X, W, WS, W_DESC, X_DESC, SORTED, GROUPS, BLOCK_EXPERT, NGROUPS, x_ring, w_ring, ready, empty, w_ready,
              w_empty, tiles, num_assign, top_k, K, NB, ROWS_E, HALF, KW, KS, FP4: gl.constexpr, GATE: gl.constexpr,
              STAGES: gl.constexpr, PRE: gl.constexpr, WDEPTH: gl.constexpr, TMA: gl.constexpr,
              W_STAGES: gl.constexpr, WL: gl.constexpr, XL: gl.constexpr):
    """The producer warpgroup: every operand by TMA (`_bulk_copies`), or by its own threads (`_thread_copies`)."""
    if TMA:
        _bulk_copies(W_DESC, X_DESC, GROUPS, BLOCK_EXPERT, NGROUPS, x_ring, w_ring, ready, empty, w_ready, w_empty,
                     tiles, K, NB, ROWS_E, HALF, GATE, STAGES, W_STAGES)
    else:
        _thread_copies(X, W, WS, SORTED, GROUPS, BLOCK_EXPERT, NGROUPS, x_ring, w_ring, ready, empty, tiles, num_assign,
                       top_k, K, NB, ROWS_E, HALF, KW, KS, FP4, GATE, STAGES, PRE, WDEPTH, WL, XL)


@gluon.jit
def _expert_rows(e, nb, ROWS_E, HALF, GATE: gl.constexpr):
    """The first weight rows of column block nb of expert e: gate rows n0.. and up rows I + n0.. (gate_up, W
    `[E, 2 I, D(/2)]`), or output rows d0.. and d0 + 64.. (down, W `[E, D, I(/2)]`); int64."""
    if GATE:
        row_a = e.to(gl.int64) * ROWS_E + nb * 64
        row_b = row_a + HALF
    else:
        row_a = e.to(gl.int64) * ROWS_E + nb * 128
        row_b = row_a + 64
    return row_a, row_b


@gluon.jit
def _bulk_copies(W_DESC, X_DESC, GROUPS, BLOCK_EXPERT, NGROUPS, x_ring, w_ring, ready, empty, w_ready, w_empty, tiles,
                 K, NB, ROWS_E, HALF, GATE: gl.constexpr, STAGES: gl.constexpr, W_STAGES: gl.constexpr):
    """Per K step the weights and the token tiles by TMA, each ring filled as soon as the consumers hand a stage
    back: no copies of the producer's own to wait for, so each runs as far ahead as its depth."""
    n_k = K // BK
    total = gl.load(NGROUPS) * NB
    it = 0
    for w in range(gl.program_id(0), total, gl.num_programs(0)):
        t, e, nb, n_t = _group(GROUPS, BLOCK_EXPERT, w, NB, tiles)
        row_a, row_b = _expert_rows(e, nb, ROWS_E, HALF, GATE)
        for ks in range(n_k):
            _fill_w(W_DESC, w_ring, w_ready, w_empty, it, ks, row_a, row_b, GATE, W_STAGES)
            _fill_x(X_DESC, x_ring, ready, empty, it, ks, t, n_t, STAGES)
            it += 1


@gluon.jit
def _thread_copies(X, W, WS, SORTED, GROUPS, BLOCK_EXPERT, NGROUPS, x_ring, w_ring, ready, empty, tiles, num_assign,
                   top_k, K, NB, ROWS_E, HALF, KW, KS, FP4: gl.constexpr, GATE: gl.constexpr, STAGES: gl.constexpr,
                   PRE: gl.constexpr, WDEPTH: gl.constexpr, WL: gl.constexpr, XL: gl.constexpr):
    """Per K step: the token tiles' copies (and, for bf16 experts, the weight rows', row 2 i + p of a stage from half
    p's row i) PRE steps ahead; MXFP4 words WDEPTH steps ahead in registers, unpacked into the step's stage."""
    n_k = K // BK
    total = gl.load(NGROUPS) * NB
    it = 0
    r = gl.arange(0, 128, layout=gl.SliceLayout(1, XL))
    for w in range(gl.program_id(0), total, gl.num_programs(0)):
        t, e, nb, n_t = _group(GROUPS, BLOCK_EXPERT, w, NB, tiles)
        row_a, row_b = _expert_rows(e, nb, ROWS_E, HALF, GATE)
        # The token rows of the group's tiles: gathered x rows (gate_up) or the tiles' own h rows (down).
        cols = gl.arange(0, BK, layout=gl.SliceLayout(0, XL))[None, :]
        o0, m0 = _tile_src(SORTED, t, 0, n_t, num_assign, top_k, K, GATE, XL)
        o1, m1 = _tile_src(SORTED, t, 1, n_t, num_assign, top_k, K, GATE, XL)
        o2, m2 = _tile_src(SORTED, t, 2, n_t, num_assign, top_k, K, GATE, XL)
        w_off = gl.expand_dims((gl.where(r % 2 == 0, row_a, row_b) + r // 2) * K, 1)  # bf16 rows `[128, 1]`
        for p in gl.static_range(PRE):
            if p < n_k:
                _fill(X, W, x_ring, w_ring, empty, it + p, p, cols, w_off, o0, m0, o1, m1, o2, m2, FP4, STAGES)
            cp.commit_group()
        if FP4:
            ptrs = _word_ptrs(W, WS, row_a, row_b, KW, KS, WL)
            wa, wb, sa, sb = _load_words(ptrs, 0)
            wa1, wb1, sa1, sb1 = _load_words(ptrs, gl.minimum(WDEPTH - 1, n_k - 1))  # WDEPTH 2: step 1's too
        for ks in range(n_k):
            if FP4:
                # words WDEPTH steps ahead, in flight during the unpacks
                wa_n, wb_n, sa_n, sb_n = _load_words(ptrs, gl.minimum(ks + WDEPTH, n_k - 1))
            if ks + PRE < n_k:
                _fill(X, W, x_ring, w_ring, empty, it + PRE, ks + PRE, cols, w_off, o0, m0, o1, m1, o2, m2, FP4,
                      STAGES)
            cp.commit_group()
            st = it % STAGES
            if FP4:
                ua = _unpack_half(wa, sa)
                ub = _unpack_half(wb, sb)
                wt = gl.reshape(gl.permute(gl.join(ua, ub), (0, 2, 1)), [128, BK])  # row 2 i + p: half p's row i
                w_ring.index(st).store(wt)  # free: its `empty` phase was awaited when its token copies were issued
                if WDEPTH == 2:
                    wa, wb, sa, sb = wa1, wb1, sa1, sb1
                    wa1, wb1, sa1, sb1 = wa_n, wb_n, sa_n, sb_n
                else:
                    wa, wb, sa, sb = wa_n, wb_n, sa_n, sb_n
            cp.wait_group(PRE)  # this thread's copies of step ks have landed,
            fence_async_shared()  # they and the stores are visible to wgmma's async proxy,
            thread_barrier()  # for every producer thread (a named barrier of this warpgroup)
            mbarrier.arrive(ready.index(st))
            it += 1
        cp.wait_group(0)


@gluon.jit
def _consumer(H, OUT, TOPW, SORTED, GROUPS, BLOCK_EXPERT, NGROUPS, x_ring, w_ring, ready, empty, w_ready, w_empty,
              tiles, num_assign, top_k, K, NB, I, D, beta, linear_beta, J: gl.constexpr, GATE: gl.constexpr,
              STAGES: gl.constexpr, FP4: gl.constexpr, TMA: gl.constexpr, W_STAGES: gl.constexpr, ACC: gl.constexpr,
              OL: gl.constexpr):
    """Consumer J: tile J of each work item's group times every K step's weights, one product in flight, then the
    epilogue (gate_up: SiTU-GLU into h; down: the routing weight and relaxed atomic adds into OUT). Without a tile J
    in the group it only hands the stages back."""
    n_k = K // BK
    total = gl.load(NGROUPS) * NB
    it = 0
    for w in range(gl.program_id(0), total, gl.num_programs(0)):
        t, _, nb, n_t = _group(GROUPS, BLOCK_EXPERT, w, NB, tiles)
        if J < n_t:
            acc = gl.zeros([BT, 128], gl.float32, ACC)
            for ks in range(n_k):
                st = it % STAGES
                mbarrier.wait(ready.index(st), (it // STAGES) & 1)
                if TMA:
                    sw = it % W_STAGES
                    mbarrier.wait(w_ready.index(sw), (it // W_STAGES) & 1)
                else:
                    sw = st
                acc = warpgroup_mma(x_ring.index(st * G + J), w_ring.index(sw).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc, ))
                # the previous step's product has retired: its stage goes back
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=ks > 0)
                if TMA:
                    mbarrier.arrive(w_empty.index((it + W_STAGES - 1) % W_STAGES), pred=ks > 0)
                it += 1
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
            if TMA:
                mbarrier.arrive(w_empty.index((it + W_STAGES - 1) % W_STAGES))
            if FP4:
                acc = acc * UNSCALE
            tile = t + J
            if GATE:
                if TMA:  # gate in columns 0-63, up in 64-127 (each thread holds column j and j + 64)
                    g, u = gl.split(gl.permute(gl.reshape(acc, [BT, 2, 64]), (0, 2, 1)))
                else:  # column 2 i + p
                    g, u = gl.split(gl.reshape(acc, [BT, 64, 2]))
                h = beta * _tanh(g / beta) * _sigmoid(g) * (linear_beta * _tanh(u / linear_beta))
                h = gl.convert_layout(h.to(gl.bfloat16), OL)
                rows = (tile * BT + gl.arange(0, BT, layout=gl.SliceLayout(1, OL))).to(gl.int64)
                cols = nb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, OL))
                gl.store(H + rows[:, None] * I + cols[None, :], h)
            else:
                assign = gl.load(SORTED + tile * BT + gl.arange(0, BT, layout=gl.SliceLayout(1, ACC)))
                valid = assign < num_assign
                token = (gl.where(valid, assign, 0) // top_k).to(gl.int64)
                wt = gl.load(TOPW + assign, mask=valid, other=0.0)
                c = gl.arange(0, 128, layout=gl.SliceLayout(0, ACC))
                if TMA:
                    d = nb * 128 + c
                else:
                    d = nb * 128 + (c % 2) * 64 + c // 2  # column 2 i + p: row d0 + 64 p + i of the weights
                gl.atomic_add(OUT + token[:, None] * D + d[None, :], acc * wt[:, None], mask=valid[:, None],
                              sem="relaxed")
        else:
            for ks in range(n_k):
                st = it % STAGES
                mbarrier.wait(ready.index(st), (it // STAGES) & 1)
                mbarrier.arrive(empty.index(st))
                if TMA:
                    sw = it % W_STAGES
                    mbarrier.wait(w_ready.index(sw), (it // W_STAGES) & 1)
                    mbarrier.arrive(w_empty.index(sw))
                it += 1


@gluon.jit
def _ws_experts(X, W, WS, W_DESC, X_DESC, H, OUT, TOPW, SORTED, GROUPS, BLOCK_EXPERT, NGROUPS, tiles, num_assign,
                top_k, K, NB, ROWS_E, HALF, KW, KS, I, D, beta, linear_beta, FP4: gl.constexpr, GATE: gl.constexpr,
                STAGES: gl.constexpr, PRE: gl.constexpr, WDEPTH: gl.constexpr, TMA: gl.constexpr,
                W_STAGES: gl.constexpr, ACC: gl.constexpr, WL: gl.constexpr,
                XL: gl.constexpr, OL: gl.constexpr, X_SMEM: gl.constexpr, W_SMEM: gl.constexpr,
                CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """gate_up (GATE): H[tile rows, 64 columns of block nb] = SiTU-GLU(x W_gate^T, x W_up^T); down: OUT[token,
    128 columns] += routing weight * (h W_down^T). Grid: programs walking the work list of NGROUPS[0] x NB items."""
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES * G, BT, BK], X_SMEM)
    # without TMA the weights share the token tiles' stages (W_STAGES = STAGES) and their barriers
    w_ring = gl.allocate_shared_memory(gl.bfloat16, [W_STAGES, 128, BK], W_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=G)
    for s in gl.static_range(W_STAGES):
        mbarrier.init(w_ready.index(s), count=1)
        mbarrier.init(w_empty.index(s), count=G)
    gl.warp_specialize([
        (_consumer, (H, OUT, TOPW, SORTED, GROUPS, BLOCK_EXPERT, NGROUPS, x_ring, w_ring, ready, empty, w_ready,
                     w_empty, tiles, num_assign, top_k, K, NB, I, D, beta, linear_beta, 0, GATE, STAGES, FP4, TMA,
                     W_STAGES, ACC, OL)),
        (_consumer, (H, OUT, TOPW, SORTED, GROUPS, BLOCK_EXPERT, NGROUPS, x_ring, w_ring, ready, empty, w_ready,
                     w_empty, tiles, num_assign, top_k, K, NB, I, D, beta, linear_beta, 1, GATE, STAGES, FP4, TMA,
                     W_STAGES, ACC, OL)),
        (_consumer, (H, OUT, TOPW, SORTED, GROUPS, BLOCK_EXPERT, NGROUPS, x_ring, w_ring, ready, empty, w_ready,
                     w_empty, tiles, num_assign, top_k, K, NB, I, D, beta, linear_beta, 2, GATE, STAGES, FP4, TMA,
                     W_STAGES, ACC, OL)),
        (_producer, (X, W, WS, W_DESC, X_DESC, SORTED, GROUPS, BLOCK_EXPERT, NGROUPS, x_ring, w_ring, ready, empty,
                     w_ready, w_empty, tiles, num_assign, top_k, K, NB, ROWS_E, HALF, KW, KS, FP4, GATE, STAGES, PRE,
                     WDEPTH, TMA, W_STAGES, WL, XL)),
    ], [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


# ---- tokens as the MMA's N side (`tokens_n`, bf16 experts, every operand by TMA)
#
# Above, each consumer multiplies a 64-row token tile (wgmma's M is 64 rows a warpgroup), so an expert's rows are
# padded to a multiple of 64: at K3's prefill load (146 rows an expert) three tiles, 192 slots, of which 24 % are
# padding the tensor cores multiply all the same. Here the operands swap places: the weights are the left operand
# (two consumers, 64 weight rows each) and the expert's token rows the right one, whose N side takes any multiple of
# 8. Rows are aligned to 16 an expert, a work item takes up to TN_TILES 16-row tiles of one expert (192 rows), and
# its token count is covered by one or two power-of-two accumulators (`_TN_PIECES`: 146 rows -> 128 + 32), so
# padding is at most 16 rows and one piece's round-up. gate_up takes its weights in one 5-D box a step
# (`_tn_gate_up_view`). Correct, but not yet faster (H100, 146 rows an expert: 14.05 against 12.65 ms; with full
# tiles within 4 % of the default): the second, narrow product of an item re-reads the weight rows from shared
# memory for few token columns, which `w_regs` (weights through registers) addresses (BENCHMARKS.md, forty-first
# session).
TN = gl.constexpr(16)  # rows a token tile (the expert alignment)
TN_TILES = gl.constexpr(12)  # token tiles a work item: 192 rows, three 64-row TMA boxes
# gate_up's weight box in `_tn_gate_up_view`: [1 expert, 8 groups, gate / up, 8 rows, 64 inputs]
TN_W_BOX = gl.constexpr((1, 8, 2, 8, 64))
# The forms a work item can take: (more than lo, at most hi 16-row tiles, first accumulator's columns, second's)
_TN_PIECES = gl.constexpr(((0, 1, 16, 0), (1, 2, 32, 0), (2, 3, 32, 16), (3, 4, 64, 0), (4, 6, 64, 32), (6, 8, 128, 0),
                           (8, 10, 128, 32), (10, 12, 128, 64)))


@gluon.jit
def _tn_fill_w(W_DESC, w_ring, w_ready, w_empty, n, k, e, nb, W_STAGES: gl.constexpr):
    """TMA, gate_up: K step k's weights into weight stage n % W_STAGES in one 5-D box of `_tn_gate_up_view`, consumer
    J's 64 rows its 32 columns' gate and up rows interleaved by 8 (stage row 64 J + 16 a + 8 p + c: gate (p = 0) or
    up row 32 J + 8 a + c of the column block), so each thread's accumulator holds the gate and up values SiTU-GLU
    combines (rows r and r + 8 of its warp's 16). Down takes `_fill_w`'s 128 consecutive output rows."""
    st = n % W_STAGES
    mbarrier.wait(w_empty.index(st), ((n // W_STAGES) & 1) ^ 1)
    mbarrier.expect(w_ready.index(st), 128 * BK * 2)
    # the stage's [128, 64] as the box `TN_W_BOX`: the same bytes, since the 128-byte swizzle runs along the rows of
    # 64 inputs whatever the outer dimensions
    tma_load(W_DESC, [e, nb * 8, 0, 0, k * BK], w_ready.index(st), w_ring.index(st).reshape(TN_W_BOX))


@gluon.jit
def _tn_fill_x(X_DESC, x_lo, x_hi, ready, empty, n, k, row0, nx, STAGES: gl.constexpr):
    """TMA: K step k's token rows into stage n % STAGES: nx (1-3) boxes of 64 rows from row0 of x in slot order
    (gate_up) or of h (down), rows 0-127 into `x_lo`, 128-191 into `x_hi` (shared-memory shapes are powers of two).
    Rows past the item's own belong to the next expert or lie past the end (zeros); the epilogues mask them."""
    st = n % STAGES
    mbarrier.wait(empty.index(st), ((n // STAGES) & 1) ^ 1)
    for j in gl.static_range(3):  # the byte count must be a compile-time constant
        if j + 1 == nx:
            mbarrier.expect(ready.index(st), (j + 1) * 64 * BK * 2)
    tma_load(X_DESC, [row0, k * BK], ready.index(st), x_lo.index(st).slice(0, 64))
    if nx > 1:
        tma_load(X_DESC, [row0 + 64, k * BK], ready.index(st), x_lo.index(st).slice(64, 64))
    if nx > 2:
        tma_load(X_DESC, [row0 + 128, k * BK], ready.index(st), x_hi.index(st))


@gluon.jit
def _tn_item(GROUPS, COUNTS, BLOCK_EXPERT, w, NB):
    """Work item w: its first 16-row tile, tile count, expert and column block."""
    grp = w // NB
    t = gl.load(GROUPS + grp)
    return t, gl.load(COUNTS + grp), gl.load(BLOCK_EXPERT + t), w % NB


@gluon.jit
def _tn_producer(W_DESC, X_DESC, GROUPS, COUNTS, BLOCK_EXPERT, NGROUPS, x_lo, x_hi, w_ring, ready, empty, w_ready,
                 w_empty, K, NB, ROWS_E, HALF, GATE: gl.constexpr, STAGES: gl.constexpr, W_STAGES: gl.constexpr):
    """Per K step the weights and the item's token rows by TMA, each ring filled as soon as a stage is handed back."""
    n_k = K // BK
    total = gl.load(NGROUPS) * NB
    it = 0
    for w in range(gl.program_id(0), total, gl.num_programs(0)):
        t, n, e, nb = _tn_item(GROUPS, COUNTS, BLOCK_EXPERT, w, NB)
        row_a, row_b = _expert_rows(e, nb, ROWS_E, HALF, GATE)  # down's weight rows (gate_up's box takes (e, nb))
        for ks in range(n_k):
            if GATE:
                _tn_fill_w(W_DESC, w_ring, w_ready, w_empty, it, ks, e, nb, W_STAGES)
            else:
                _fill_w(W_DESC, w_ring, w_ready, w_empty, it, ks, row_a, row_b, False, W_STAGES)
            _tn_fill_x(X_DESC, x_lo, x_hi, ready, empty, it, ks, t * TN, (n + 3) // 4, STAGES)
            it += 1


@gluon.jit
def _tn_epilogue(acc, r0: gl.constexpr, P: gl.constexpr, H, OUT, TOPW, SORTED, t, n, nb, num_assign, top_k, I, D, beta,
                 linear_beta, J: gl.constexpr, GATE: gl.constexpr, OLT: gl.constexpr):
    """Columns r0 .. r0 + P of the item's token rows (slots t * 16 + r0 + c; those past the item's tiles are masked).
    gate_up: SiTU-GLU of the interleaved gate / up rows into h's 32 columns 64 nb + 32 J..; down: the routing weight
    and relaxed atomic adds into OUT's rows 128 nb + 64 J.."""
    ACC: gl.constexpr = acc.type.layout
    end = (t + n) * TN
    if GATE:
        # accumulator row 16 a + 8 p + c: p (a register bit of the layout) picks gate or up of column 8 a + c
        g, u = gl.split(gl.permute(gl.reshape(acc, [4, 2, 8, P]), (0, 2, 3, 1)))
        g = gl.reshape(g, [32, P])
        u = gl.reshape(u, [32, P])
        h = beta * _tanh(g / beta) * _sigmoid(g) * (linear_beta * _tanh(u / linear_beta))
        h = gl.convert_layout(h.to(gl.bfloat16), OLT)  # a thread 8 consecutive columns of one slot: 16-byte stores
        slot = t * TN + r0 + gl.arange(0, P, layout=gl.SliceLayout(0, OLT))
        cols = nb * 64 + J * 32 + gl.arange(0, 32, layout=gl.SliceLayout(1, OLT))
        gl.store(H + slot.to(gl.int64)[None, :] * I + cols[:, None], h, mask=(slot < end)[None, :])
    else:
        slot = t * TN + r0 + gl.arange(0, P, layout=gl.SliceLayout(0, ACC))
        assign = gl.load(SORTED + slot, mask=slot < end, other=num_assign)
        valid = assign < num_assign
        token = (gl.where(valid, assign, 0) // top_k).to(gl.int64)
        wt = gl.load(TOPW + assign, mask=valid, other=0.0)
        d = nb * 128 + J * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
        gl.atomic_add(OUT + token[None, :] * D + d[:, None], acc * wt[None, :], mask=valid[None, :], sem="relaxed")


@gluon.jit
def _tn_consume(x_lo, x_hi, w_ring, ready, empty, w_ready, w_empty, it, n_k, H, OUT, TOPW, SORTED, t, n, nb, num_assign,
                top_k, I, D, beta, linear_beta, P0: gl.constexpr, P1: gl.constexpr, J: gl.constexpr,
                GATE: gl.constexpr, STAGES: gl.constexpr, W_STAGES: gl.constexpr, OLT: gl.constexpr,
                A_REGS: gl.constexpr):
    """One work item on consumer J: its 64 weight rows (left, from the weight stage) times the item's token rows
    (right: rows 0 .. P0 into one accumulator, P0 .. P0 + P1 into a second), one step's products in flight.
    `A_REGS`: the weight rows go through registers, read from shared memory once for both products instead of once
    each (a second product of 16 or 32 columns reads 2 KB of weights per 1 KB of tokens: shared-memory bound), and
    the weight stage goes back as soon as they are loaded."""
    A0: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, P0, 16])
    acc0 = gl.zeros([64, P0], gl.float32, A0)
    if P1 > 0:
        A1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, P1, 16])
        acc1 = gl.zeros([64, P1], gl.float32, A1)
    if A_REGS:
        AR: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=A0, k_width=2)
        # the previous step's weight registers, carried so that they live until the wait that retires its products
        a_prev = gl.zeros([64, BK], gl.bfloat16, AR)
    for ks in range(n_k):
        st = it % STAGES
        sw = it % W_STAGES
        mbarrier.wait(ready.index(st), (it // STAGES) & 1)
        mbarrier.wait(w_ready.index(sw), (it // W_STAGES) & 1)
        if A_REGS:
            a = w_ring.index(sw).slice(64 * J, 64).load(AR)
            mbarrier.arrive(w_empty.index(sw))
        else:
            a = w_ring.index(sw).slice(64 * J, 64)
        acc0 = warpgroup_mma(a, x_lo.index(st).slice(0, P0).permute((1, 0)), acc0, is_async=True)
        if P1 > 0:
            if P0 == 128:
                b1 = x_hi.index(st).slice(0, P1)
            else:
                b1 = x_lo.index(st).slice(P0, P1)
            if A_REGS:
                acc1 = warpgroup_mma(gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=A1, k_width=2)),
                                     b1.permute((1, 0)), acc1, is_async=True)
                acc0, acc1, a_prev = warpgroup_mma_wait(2, deps=(acc0, acc1, a_prev))
            else:
                acc1 = warpgroup_mma(a, b1.permute((1, 0)), acc1, is_async=True)
                acc0, acc1 = warpgroup_mma_wait(2, deps=(acc0, acc1))
        elif A_REGS:
            acc0, a_prev = warpgroup_mma_wait(1, deps=(acc0, a_prev))
        else:
            acc0 = warpgroup_mma_wait(1, deps=(acc0, ))
        if A_REGS:
            a_prev = a
        # the previous step's products have retired: its stages go back
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=ks > 0)
        if not A_REGS:
            mbarrier.arrive(w_empty.index((it + W_STAGES - 1) % W_STAGES), pred=ks > 0)
        it += 1
    if P1 > 0:
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
    else:
        acc0 = warpgroup_mma_wait(0, deps=(acc0, ))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
    if not A_REGS:
        mbarrier.arrive(w_empty.index((it + W_STAGES - 1) % W_STAGES))
    _tn_epilogue(acc0, 0, P0, H, OUT, TOPW, SORTED, t, n, nb, num_assign, top_k, I, D, beta, linear_beta, J, GATE, OLT)
    if P1 > 0:
        _tn_epilogue(acc1, P0, P1, H, OUT, TOPW, SORTED, t, n, nb, num_assign, top_k, I, D, beta, linear_beta, J, GATE,
                     OLT)
    return it


@gluon.jit
def _tn_consumer(H, OUT, TOPW, SORTED, GROUPS, COUNTS, BLOCK_EXPERT, NGROUPS, x_lo, x_hi, w_ring, ready, empty, w_ready,
                 w_empty, num_assign, top_k, K, NB, I, D, beta, linear_beta, J: gl.constexpr, GATE: gl.constexpr,
                 STAGES: gl.constexpr, W_STAGES: gl.constexpr, OLT: gl.constexpr, A_REGS: gl.constexpr):
    """Consumer J: every work item in the accumulator form of its tile count (`_TN_PIECES`; each form is its own
    code)."""
    n_k = K // BK
    total = gl.load(NGROUPS) * NB
    it = 0
    for w in range(gl.program_id(0), total, gl.num_programs(0)):
        t, n, _, nb = _tn_item(GROUPS, COUNTS, BLOCK_EXPERT, w, NB)
        for f in gl.static_range(len(_TN_PIECES)):
            if (n > _TN_PIECES[f][0]) & (n <= _TN_PIECES[f][1]):
                it = _tn_consume(x_lo, x_hi, w_ring, ready, empty, w_ready, w_empty, it, n_k, H, OUT, TOPW, SORTED, t, n,
                                 nb, num_assign, top_k, I, D, beta, linear_beta, _TN_PIECES[f][2], _TN_PIECES[f][3], J,
                                 GATE, STAGES, W_STAGES, OLT, A_REGS)


@gluon.jit
def _ws_experts_tn(W_DESC, X_DESC, H, OUT, TOPW, SORTED, GROUPS, COUNTS, BLOCK_EXPERT, NGROUPS, num_assign, top_k, K,
                   NB, ROWS_E, HALF, I, D, beta, linear_beta, GATE: gl.constexpr, STAGES: gl.constexpr,
                   W_STAGES: gl.constexpr, OLT: gl.constexpr, X_SMEM: gl.constexpr, W_SMEM: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, A_REGS: gl.constexpr):
    """`tokens_n`: gate_up (GATE): H[item slots, 64 columns of block nb] = SiTU-GLU(x W_gate^T, x W_up^T), computed
    transposed; down: OUT[token, 128 columns] += routing weight * (h W_down^T), likewise. Two consumer warpgroups
    (64 weight rows each) and a producer; grid: programs walking NGROUPS[0] x NB work items."""
    x_lo = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, BK], X_SMEM)  # an item's token rows 0-127
    x_hi = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 64, BK], X_SMEM)  # and 128-191
    w_ring = gl.allocate_shared_memory(gl.bfloat16, [W_STAGES, 128, BK], W_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [W_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    for s in gl.static_range(W_STAGES):
        mbarrier.init(w_ready.index(s), count=1)
        mbarrier.init(w_empty.index(s), count=2)
    gl.warp_specialize([
        (_tn_consumer, (H, OUT, TOPW, SORTED, GROUPS, COUNTS, BLOCK_EXPERT, NGROUPS, x_lo, x_hi, w_ring, ready, empty,
                        w_ready, w_empty, num_assign, top_k, K, NB, I, D, beta, linear_beta, 0, GATE, STAGES, W_STAGES,
                        OLT, A_REGS)),
        (_tn_consumer, (H, OUT, TOPW, SORTED, GROUPS, COUNTS, BLOCK_EXPERT, NGROUPS, x_lo, x_hi, w_ring, ready, empty,
                        w_ready, w_empty, num_assign, top_k, K, NB, I, D, beta, linear_beta, 1, GATE, STAGES, W_STAGES,
                        OLT, A_REGS)),
        (_tn_producer, (W_DESC, X_DESC, GROUPS, COUNTS, BLOCK_EXPERT, NGROUPS, x_lo, x_hi, w_ring, ready, empty, w_ready,
                        w_empty, K, NB, ROWS_E, HALF, GATE, STAGES, W_STAGES)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


@functools.lru_cache(maxsize=None)
def _constexprs(stages: int, pre: int, wdepth: int, consumer_regs: int, producer_regs: int, w_stages: int = 0) -> dict:
    """The kernel's launch constants; `w_stages` > 0 takes every operand by TMA, the bf16 weights into a ring of
    their own."""
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    # the words `[64 rows, 1 block, 4 (c), 2]` as `gluon_moe` unpacks them (S = 1)
    wl = gl.DistributedLinearLayout(reg_bases=[[0, 0, 0, 1], [8, 0, 0, 0]],
                                    lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
                                    warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[64, 1, 4, 2])
    return dict(STAGES=stages, PRE=pre, WDEPTH=wdepth, TMA=w_stages > 0, W_STAGES=w_stages or stages,
                ACC=acc, WL=wl,
                XL=gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]),  # 16-byte copies, a warp 4 rows x 128 bytes
                OL=gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]),
                X_SMEM=gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16),
                W_SMEM=gl.NVMMASharedLayout.get_default_for([128, 64], gl.bfloat16),
                CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs)



@functools.cache
def _constexprs_tn(stages: int, w_stages: int, consumer_regs: int, producer_regs: int, w_regs: bool = False) -> dict:
    """`tokens_n` launch constants: the rings' swizzled layouts (gate_up's 5-D weight box, `TN_W_SMEM`, lands in the
    128-row stage's layout) and h's store layout (a thread 8 consecutive columns of one slot)."""
    smem = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    return dict(STAGES=stages, W_STAGES=w_stages, X_SMEM=smem, W_SMEM=smem, A_REGS=w_regs,
                OLT=gl.BlockedLayout([8, 1], [4, 8], [1, 4], [0, 1]),
                CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs)


def _tile_groups(block_expert: torch.Tensor, run_end: torch.Tensor, run_len: torch.Tensor, per_group: int = G.value,
                 block: int = 64, counts: bool = False):
    """Groups of up to `per_group` consecutive `block`-row tiles of one expert, without a host sync: (GROUPS
    [tiles + 1] int32, the first tile of each group in order; NGROUPS [1] int32), and with `counts` also COUNTS
    [tiles + 1] int32, each group's number of tiles."""
    tiles = block_expert.numel()
    idx = torch.arange(tiles, device=block_expert.device)
    e = block_expert.long()
    real = e >= 0
    first = torch.where(real, (run_end - run_len)[e.clamp(min=0)] // block, 0)
    start = real & ((idx - first) % per_group == 0)
    slot = torch.where(start, torch.cumsum(start, 0) - 1, tiles)
    groups = torch.zeros(tiles + 1, dtype=torch.int32, device=block_expert.device)
    groups.scatter_(0, slot, idx.to(torch.int32))
    n_groups = start.sum().to(torch.int32).reshape(1)
    if not counts:
        return groups, n_groups
    left = torch.where(real, run_end[e.clamp(min=0)] // block - idx, 0)  # the expert's tiles from this one on
    n = torch.zeros(tiles + 1, dtype=torch.int32, device=block_expert.device)
    n.scatter_(0, slot, left.clamp(max=per_group).to(torch.int32))
    return groups, n_groups, n


def _programs(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def unsupported(fp4: bool, dtypes, D: int, I: int) -> str | None:
    """Why these kernels cannot take experts of this format (`dtypes`: of the dense weights), latent width D and
    expert width I, or None if they can."""
    if not fp4 and any(d != torch.bfloat16 for d in dtypes):
        return f"they take bf16 or MXFP4 experts, got {' / '.join(map(str, dtypes))}"
    if D % 128 or I % 64:
        return f"they need the latent width a multiple of 128 and the expert width of 64, got {D} and {I}"
    return None


def moe_experts_gluon_ws(x, top_idx, top_w, w13_packed=None, w13_scale=None, w2_packed=None, w2_scale=None, *,
                         gate_up=None, down=None, beta: float = 4.0, linear_beta: float = 25.0, stages: int = 4,
                         pre: int | None = None, wdepth: int = 2, consumer_regs: int | None = None,
                         producer_regs: int | None = None, w_stages: int = 0, tokens_n: bool = False,
                         w_regs: bool = False):
    """x `[N, D]` -> `[N, D]` on MXFP4 experts in the released layout (as `gluon_moe.moe_experts_gluon`), or on bf16
    experts (`gate_up` `[E, 2 I, D]`, `down` `[E, D, I]`); Hopper only. `stages` ring stages (40 KB each), `pre` K
    steps the copies run ahead (at most stages - 2; default 2), `wdepth` K steps the packed words are loaded ahead (1
    or 2). `w_stages` >= 2 (bf16 only): every operand by TMA, the weights into a ring of their own of `w_stages`
    16 KB stages and the token tiles, from x gathered once into slot order, into `stages` 24 KB stages (at least 2);
    the producer then waits only for free stages, so each ring runs as far ahead as its depth and `pre` does not
    apply. `tokens_n` (with `w_stages`): the weights as the products' left operand and each expert's token rows,
    aligned to 16 instead of 64, as the right (N) side, two consumer warpgroups of 64 weight rows (the block above
    the module's functions spells it out); `stages` then counts 24 KB token stages of up to 192 rows. `w_regs` (with
    `tokens_n`): each step's weight rows are read from shared memory into registers once for the item's one or two
    products instead of by each product."""
    fp4 = w13_packed is not None
    if fp4 == (gate_up is not None):
        raise ValueError("moe_experts_gluon_ws: pass either w13_packed/w13_scale/w2_packed/w2_scale or gate_up/down")
    if fp4:
        E, two_i, D = w13_packed.shape[0], w13_packed.shape[1], 2 * w13_packed.shape[2]
        W1, S1, W2, S2 = w13_packed, w13_scale, w2_packed, w2_scale
    else:
        E, two_i, D = gate_up.shape
        W1, W2 = gate_up.contiguous(), down.contiguous()
        S1, S2 = W1, W2  # unused
    I = two_i // 2
    why = unsupported(fp4, (W1.dtype, W2.dtype), D, I)
    if why is not None:
        raise ValueError(f"moe_experts_gluon_ws: {why}")
    if w_regs and not tokens_n:
        raise ValueError("moe_experts_gluon_ws: w_regs is an option of tokens_n (the weights as the left operand)")
    if w_stages:
        # Bulk copies complete on the stage's barrier, not in the producer's threads: the producer fills a stage as
        # soon as it is handed back, and a consumer hands stage j back once it has issued step j + 1, so 2 stages
        # a ring keep the consumers fed.
        if fp4 or w_stages < 2 or stages < 2 or pre is not None:
            raise ValueError(f"moe_experts_gluon_ws: w_stages takes bf16 experts, w_stages >= 2 and stages >= 2, and "
                             f"no pre; got {'MXFP4' if fp4 else 'bf16'} experts, w_stages {w_stages}, stages "
                             f"{stages}, pre {pre}")
        pre = 0
    elif tokens_n:
        raise ValueError("moe_experts_gluon_ws: tokens_n takes every operand by TMA: pass w_stages too")
    else:
        pre = 2 if pre is None else pre
        # A consumer hands stage j back once it has issued step j + 1, and the producer waits for step
        # ks + pre - stages to be handed back before it fills step ks: pre > stages - 2 deadlocks (seen on the GPU
        # with stages 2, pre 1).
        if not 1 <= pre <= stages - 2:
            raise ValueError(f"moe_experts_gluon_ws: pre must be in [1, stages - 2], got {pre} with {stages} stages")
    if wdepth not in (1, 2):
        raise ValueError(f"moe_experts_gluon_ws: wdepth must be 1 or 2, got {wdepth}")
    N, k = top_idx.shape
    if N == 0:
        return torch.zeros((0, D), device=x.device, dtype=x.dtype)
    if tokens_n:
        return _experts_tn(x, top_idx, top_w, W1, W2, stages, w_stages, consumer_regs or 232, producer_regs or 40,
                           w_regs, beta, linear_beta)
    consumer_regs, producer_regs = consumer_regs or 112, producer_regs or 160
    sorted_ids, block_expert, tiles, run_end, run_len = _align(top_idx, E, 64)
    groups, n_groups = _tile_groups(block_expert, run_end, run_len)
    hbuf = torch.empty((tiles * 64, I), device=x.device, dtype=torch.bfloat16)
    out = torch.zeros((N, D), device=x.device, dtype=torch.float32)
    topw = top_w.reshape(-1).float().contiguous()
    cex = dict(_constexprs(stages, pre, wdepth, consumer_regs, producer_regs, w_stages), FP4=fp4)
    xb = x.to(torch.bfloat16).contiguous()
    d1 = d2 = dx1 = dx2 = None
    if w_stages:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        # gate_up: 64-row boxes (gate rows, then the up rows I further); down: 128 output rows
        d1 = TensorDescriptor.from_tensor(W1.view(E * two_i, D), [64, BK.value], cex["X_SMEM"])
        d2 = TensorDescriptor.from_tensor(W2.view(E * D, I), [128, BK.value], cex["W_SMEM"])
        # x in slot order `[tiles * 64, D]` (pad slots repeat the last assignment's token: their h rows are never
        # read into the output), so a tile's rows are one box; down reads h's rows as they are
        xb = xb[sorted_ids.clamp(max=N * k - 1).long() // k]
        dx1 = TensorDescriptor.from_tensor(xb, [BT.value, BK.value], cex["X_SMEM"])
        dx2 = TensorDescriptor.from_tensor(hbuf, [BT.value, BK.value], cex["X_SMEM"])
    grid = (_programs(x.device),)
    # gate_up: K = D, I / 64 column blocks of 64 gate + 64 up rows (the up rows I further); down: K = I, D / 128
    _ws_experts[grid](xb, W1, S1, d1, dx1, hbuf, out, topw, sorted_ids, groups, block_expert, n_groups, tiles, N * k, k,
                      D, I // 64, two_i, I, D // 8, D // 32, I, D, beta, linear_beta, GATE=True, **cex, num_warps=4,
                      enable_fp_fusion=True)
    _ws_experts[grid](hbuf, W2, S2, d2, dx2, hbuf, out, topw, sorted_ids, groups, block_expert, n_groups, tiles, N * k,
                      k, I, D // 128, D, 64, I // 8, I // 32, I, D, beta, linear_beta, GATE=False, **cex, num_warps=4,
                      enable_fp_fusion=True)
    return out.to(x.dtype)


def _tn_gate_up_view(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up `[E, 2 I, D]` as `[E, I / 8, 2, 8, D]` (a view): [e, g, p, c] is gate (p = 0) or up (p = 1) row
    8 g + c of expert e, so the box [1, 8, 2, 8, 64] at (e, 8 nb, 0, 0, k) is column block nb's 64 gate and 64 up
    rows interleaved by 8, the stage `_tn_fill_w` loads."""
    E, two_i, D = gate_up.shape
    return gate_up.view(E, 2, two_i // 16, 8, D).permute(0, 2, 1, 3, 4)  # [E, I / 8, 2, 8, D]


# the shared layout of gate_up's weight box (`TN_W_BOX`): the 128-byte swizzle of the stage's 2-D layout
TN_W_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=5)


def _experts_tn(x, top_idx, top_w, W1, W2, stages, w_stages, consumer_regs, producer_regs, w_regs, beta, linear_beta):
    """`moe_experts_gluon_ws(..., tokens_n=True)` on bf16 experts `W1` `[E, 2 I, D]`, `W2` `[E, D, I]`."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    E, two_i, D = W1.shape
    I = two_i // 2
    N, k = top_idx.shape
    sorted_ids, block_expert, tiles, run_end, run_len = _align(top_idx, E, TN.value)
    groups, n_groups, counts = _tile_groups(block_expert, run_end, run_len, TN_TILES.value, TN.value, counts=True)
    hbuf = torch.empty((tiles * TN.value, I), device=x.device, dtype=torch.bfloat16)
    out = torch.zeros((N, D), device=x.device, dtype=torch.float32)
    topw = top_w.reshape(-1).float().contiguous()
    cex = _constexprs_tn(stages, w_stages, consumer_regs, producer_regs, w_regs)
    # x in slot order `[tiles * 16, D]`, pad slots repeating the last assignment's token (their h rows are never read
    # into the output); the 64-row boxes of an item's rows: x (gate_up) and h (down)
    xs = x.to(torch.bfloat16)[sorted_ids.clamp(max=N * k - 1).long() // k]
    dx1 = TensorDescriptor.from_tensor(xs, [64, BK.value], cex["X_SMEM"])
    dx2 = TensorDescriptor.from_tensor(hbuf, [64, BK.value], cex["X_SMEM"])
    # gate_up: one box of 8 groups of 8 gate and 8 up rows a step, interleaved into the stage (`_tn_fill_w`); down:
    # 128 output rows
    d1 = TensorDescriptor.from_tensor(_tn_gate_up_view(W1), list(TN_W_BOX.value), TN_W_SMEM)
    d2 = TensorDescriptor.from_tensor(W2.view(E * D, I), [128, BK.value], cex["W_SMEM"])
    grid = (_programs(x.device),)
    # gate_up: K = D, I / 64 column blocks (gate rows n0.., up rows I + n0..); down: K = I, D / 128 row blocks
    _ws_experts_tn[grid](d1, dx1, hbuf, out, topw, sorted_ids, groups, counts, block_expert, n_groups, N * k, k, D,
                         I // 64, two_i, I, I, D, beta, linear_beta, GATE=True, **cex, num_warps=4,
                         enable_fp_fusion=True)
    _ws_experts_tn[grid](d2, dx2, hbuf, out, topw, sorted_ids, groups, counts, block_expert, n_groups, N * k, k, I,
                         D // 128, D, 64, I, D, beta, linear_beta, GATE=False, **cex, num_warps=4, enable_fp_fusion=True)
    return out.to(x.dtype)
