"""Fused Block Attention Residuals (AttnRes) in Triton: the per-token softmax mix over depth candidates.

Same maths as `reference.attn_res` (beside this file), written so each candidate row is read from HBM once and
nothing of size `[N, T, d]` is made in fp32:

    logit_i = r_i * p_i,   r_i = rsqrt(mean(v_i^2) + eps),   p_i = <v_i, norm_weight * query_weight>
    alpha = softmax_i(logit),   out = sum_i alpha_i v_i

The key RMSNorm is folded into the logit (`<v_i r_i, w> = r_i <v_i, w>`), so one pass gives both statistics.
Backward (one read of every candidate row, `out` and `dout`; `sum_j alpha_j dalpha_j = <dout, out>`):

    dalpha_i = <dout, v_i>,   dlogit_i = alpha_i (dalpha_i - sum_j alpha_j dalpha_j)
    dv_i = alpha_i dout + dlogit_i (r_i w - p_i r_i^3 v_i / d)
    dw = sum_{t, i} dlogit_i r_i v_i   (partial sums per program of 16 tokens, summed by torch)

Five designs of the same maths, chosen with `attn_res_triton(..., variant=)` (default `DEFAULT_VARIANT`):

* "row" (`_attnres_fwd` / `_attnres_bwd`): one program per token, the whole d-row of ONE candidate in registers,
  an online softmax over the candidates. Every byte is read once, but candidate i + 1's load can only overlap
  candidate i's full-row reductions (which end in barriers), so few loads are in flight per SM: 38 % of HBM
  bandwidth at N = 9, d = 7168 on the H200.
* "tiled" (`_attnres_fwd_tiled` / `_attnres_bwd_tiled`): one program per BLOCK_T tokens, d walked in slices of
  BLOCK_D, each slice of ALL candidates loaded at once (a `[BLOCK_T, NP, BLOCK_D]` tile, NP = next power of two
  >= N, rows i >= N masked, never loaded). The N loads of a slice are independent of each other and of the
  previous slice's arithmetic (only fp32 `[BLOCK_T, NP]` partial sums are carried), so each warp has up to N
  times more loads in flight: memory-level parallelism instead of latency-bound chains. Two passes:
  forward pass 1 accumulates ss_i = sum v_i^2 and pw_i = <v_i, w> over the slices, then logit_i = rsqrt(ss_i / d
  + eps) pw_i and the softmax over the valid candidates; pass 2 re-reads the slices and writes out = sum_i
  alpha_i v_i. The re-read should come from L2: the program read those bytes moments before (pass 1 loads hint
  `evict_last`, pass 2 loads `evict_first`); HBM traffic stays one read of every candidate as long as what all
  resident programs read between a slice's two reads fits in L2 (`TILED_PROGRAMS_PER_SM` caps the resident
  programs; `benchmarks/attnres.py --variants` sweeps BLOCK_T, BLOCK_D and num_warps).
  No barrier inside the d loops (checked in the sm_90 PTX for the default "split" form): pass 1 views a slice
  as `[BLOCK_T, C, NP, CHUNK]` (CHUNK = 256 = 32 lanes x 8 bf16) so the warps sit on the candidate axis and
  its sums stay inside a warp; w and dout are loaded at the tile's full shape (L1 repeats) rather than
  broadcast, which would cost a layout conversion through shared memory; pass 2 ("split", `TILED_PASS2`)
  takes the candidates one `[BLOCK_T, BLOCK_D]` load at a time (unrolled, still N independent loads) rather
  than summing a 3D tile over the candidate axis across warps, reading alpha_i and the backward's
  per-candidate coefficients back from tiny global buffers after one barrier.
  The forward saves r_i and p_i (`[N, T]` fp32, tiny), so backward pass 1 needs only dalpha_i = <dout, v_i>;
  since all N dalpha of a token are then at hand, `<dout, out> = sum_j alpha_j dalpha_j` is formed in fp32
  from them, exactly, so this design neither writes an fp32 copy of `out` in the forward nor reads `out` in the
  backward (the row design needs that copy: it sees one candidate at a time and must know `<dout, out>` first).
  Backward pass 2 re-reads `dout` and the slices (L2) and writes dv_i; each program handles about 16 tokens
  (BLOCK_T at a time) and adds its dw slice partials into its own fp32 row of a `[programs, d]` buffer (a
  barrier between token blocks orders the read-modify-writes), summed by torch: deterministic, no atomics.
* "resident" (`_attnres_fwd_resident` / `_attnres_bwd_resident`): a persistent grid whose programs each hold one
  token's whole tile of all candidates (two power-of-two row groups of next_pow2(d)), so the forward's
  statistics, softmax and mix, and the backward's dalpha_i and dv_i, read it once, with no second sweep to hope
  for L2 on. The next token's tile is in flight while one is reduced: loaded into registers beforehand
  (`RESIDENT_PREFETCH`) or copied into shared memory by Triton's software pipeline (`RESIDENT_STAGES`). The
  forward saves r_i and p_i as the tiled one does; the backward keeps dw in registers, one partial row per
  program. Only where the tile fits one program (rows * next_pow2(d) <= 64K elements: N <= 8 at K3's d = 7168).

* "cooperative" (`_attnres_fwd_coop` / `_attnres_bwd_coop`): "resident" split over S programs, each holding one
  BLOCK_D-wide slice of a token's candidates (small tiles, many programs an SM). Program (g, s) of a persistent
  grid of G groups publishes its slice's partial sums (ss_i and p_i; the backward's dalpha_i) to a small global
  buffer, counts itself on the token's counter and waits until all S slices have, then adds the S partials in
  slice order (deterministic) and mixes its slice (writes its dv_i slices) from the registers it loaded: one read
  of every byte at any N (the resident tile does not fit past N = 8 at K3's d = 7168). Waiting for other programs
  needs the whole grid resident at once, so the grid is sized from the compiled kernel's registers and shared
  memory. The interpreter runs programs one after another, so there the kernel runs as two launches (publish,
  then mix), the same code without the wait.
* "stream" (`_attnres_fwd_stream`, forward only): the row design's online softmax on a persistent grid whose one
  loop runs over (token, candidate) pairs, so Triton's software pipeline keeps the next rows in flight (copied to
  shared memory) across token boundaries, where a loop per token drains it every N rows; no exchange between
  programs, no second sweep. Its forward saves alpha_i, r_i and p_i as the resident and cooperative forwards do, and
  its backward is theirs (`_backward_variant`: a backward needs <dout, out> before any dv_i, so all of a token's
  candidates at once). "auto" takes it above RESIDENT_MAX_N candidates: 93 % of the copy bandwidth at N = 9 on the
  H100, against the cooperative forward's 85 % and fla's 90 %.
* The resident and cooperative kernels widen bf16 to fp32 twice (statistics, then mix) rather than keep an fp32
  copy of the tile: one fewer tile-sized set of registers (the N = 6 resident forward spilled 104 bytes a thread
  before, none now: 0.357 -> 0.291 ms on the H100).

Triton is imported here, so import this module only where Triton is available (see `k3_kernels.dispatch`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["attn_res_triton", "DEFAULT_VARIANT", "VARIANTS", "TILED_PASS2", "TILED_PROGRAMS_PER_SM"]

VARIANTS = ("row", "tiled", "resident", "cooperative", "stream")
# Design used when `attn_res_triton` is called without `variant=` (as `k3_kernels.dispatch` does). "auto" = the
# faster one as measured (T = 8K, d = 7168, bf16; BENCHMARKS.md): "resident" up to RESIDENT_MAX_N candidates,
# forward and backward (H100, N = 6: forward 0.291 ms against the tiled 0.373 and the stream 0.296, forward +
# backward 0.943 against 1.234; H200 forward 0.235 ms; sixteenth and thirty-third sessions); above, the "stream"
# forward and the "cooperative" backward (H100, thirty-third session, same run: N = 9 forward 0.418 ms against the
# cooperative 0.458 and fla's 0.433; N = 7 0.337 against 0.381 and 0.350; the cooperative backward beat the row
# and tiled ones, sixteenth session). "tiled" when block_t or block_d is given.
DEFAULT_VARIANT = "auto"
RESIDENT_MAX_N = 6
# "tiled" tokens per program when block_t is not given (block_t = 2 was slower at every N measured).
DEFAULT_TILED_BLOCK_T = 1
# How the tiled kernels' second d-sweep reads the candidates: "split" = N separate [BLOCK_T, BLOCK_D] loads per
# slice (no sum over the candidate axis, which may cross warps), "tile" = the [BLOCK_T, NP, BLOCK_D] tile of
# pass 1 again. `benchmarks/attnres.py --variants --pass2 split,tile` measures both.
TILED_PASS2 = "split"
# Programs per SM of the tiled kernels: None = one program per BLOCK_T tokens in the forward, per ~16 tokens in
# the backward; k = at most k programs per SM, each taking a contiguous run of token blocks (bounds what L2 must
# hold between a slice's two reads, and the backward's dw partial rows). `--programs-per-sm` in the benchmark.
TILED_PROGRAMS_PER_SM = None
# Widest chunk of pass 1's [BLOCK_T, C, NP, CHUNK] view (see `_attnres_fwd_tiled`): 32 lanes x 8 bf16 = 256.
# The tests lower it to run C > 1 on small shapes.
_TILED_CHUNK = 256
# "resident": programs per SM of its persistent grid; whether each program loads its next token's tile into
# registers before reducing the current one (PREFETCH); software-pipeline stages of its token loop (> 1: the next
# tiles are copied to shared memory asynchronously). `benchmarks/attnres.py --variants --resident ...` sweeps them.
# None = the measured rule (H200, fifteenth session, 16 warps): the register prefetch up to 3 rows a token (N = 3:
# forward 0.130 ms, 0.134 / 0.132 pipelined with 2 / 3 stages; forward + backward 0.540 against 0.657 / 0.700), a
# 2-stage pipeline above (N = 6: 0.316 ms; the register prefetch spills, 0.955).
RESIDENT_PROGRAMS_PER_SM = 1
RESIDENT_PREFETCH = None
RESIDENT_STAGES = None
_RESIDENT_PREFETCH_ROWS = 3
# "cooperative": the most programs an SM of its persistent grid (fewer where the compiled kernel's registers or
# shared memory allow fewer: the grid must be resident as a whole, since each program waits for the other slices
# of its tokens) and the default d-slice width. Without `num_warps`, the forward takes about 288 values of the tile
# a thread and the backward 144 (`_COOP_VALUES_PER_THREAD`). Measured on the H200 (sixteenth session, N = 9,
# T = 8K, d = 7168): the forward at 1 warp and 1024-wide slices 0.376 ms, 2 warps 0.414, 4 warps and 2048 0.434,
# 8 warps 0.59-0.60; the forward + backward with 2 warps and 1024 for both 1.147 ms, 1 warp 1.547 (its backward
# spills 1.2 KB a thread). A form that loaded the next token's tile into registers before the wait lost at every
# launch on both GPUs (0.508 against 0.414 ms at 2 warps: its registers halved the programs an SM) and was removed.
# `benchmarks/attnres.py --variants --cooperative ...` sweeps them.
COOP_PROGRAMS_PER_SM = 16
COOP_BLOCK_D = 1024
_COOP_VALUES_PER_THREAD = {False: 288, True: 144}  # forward, backward
# "stream" (forward only; its backward is `_backward_variant`'s): programs an SM of its persistent grid
# and the software-pipeline stages of its row loop (each stage one next_pow2(d) row in shared memory: 16 KB at
# K3's d in bf16). `benchmarks/attnres.py --variants --stream ...` sweeps them.
# Measured on the H100 (thirty-third session, N = 9): 8 warps, 4 stages, 4 programs an SM 0.418 ms; 2 an SM 0.421
# (3 stages the same, 6 stages 0.430); 4 warps 0.419; 16 warps, 1 an SM 0.468.
STREAM_PROGRAMS_PER_SM = 4
STREAM_STAGES = 4
_MAX_TILE = 1 << 16  # elements of one [BLOCK_T, NP, BLOCK_D] tile: beyond this the registers spill hopelessly


@triton.jit
def _attnres_fwd(
    V, W, O, OF, ALPHA, T, D, eps, N: tl.constexpr, SAVE_F32: tl.constexpr, BLOCK_D: tl.constexpr
):
    # One token row per program, the whole row of one candidate at a time in registers: an online softmax over
    # the candidates reads every candidate exactly once. The next candidate's row is loaded before this one's
    # reductions: those end in barriers the compiler does not move loads across, so without the prefetch every
    # candidate paid a full memory latency in turn (32 % of bandwidth at N = 9 on the H200).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < D
    w = tl.load(W + offs, mask=dmask, other=0.0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    m = float("-inf")
    den = 0.0
    v_next = tl.load(V + row * D + offs, mask=dmask, other=0.0)
    for i in tl.static_range(N):
        v = v_next.to(tl.float32)
        if i + 1 < N:
            v_next = tl.load(V + ((i + 1) * T + row) * D + offs, mask=dmask, other=0.0)
        r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
        logit = r * tl.sum(v * w, axis=0)
        tl.store(ALPHA + i * T + row, logit)  # logits now, turned into alpha below
        m_new = tl.maximum(m, logit)
        scale = tl.exp(m - m_new)
        e = tl.exp(logit - m_new)
        acc = acc * scale + e * v
        den = den * scale + e
        m = m_new
    out = acc / den
    tl.store(O + row * D + offs, out.to(O.dtype.element_ty), mask=dmask)
    if SAVE_F32:
        # Backward needs <dout, out> to cancel against <dout, v_i>: a bf16-rounded out would swamp the difference.
        tl.store(OF + row * D + offs, out, mask=dmask)
    for i in tl.static_range(N):
        logit = tl.load(ALPHA + i * T + row)
        tl.store(ALPHA + i * T + row, tl.exp(logit - m) / den)


@triton.jit
def _attnres_bwd(
    V, W, O, DO, ALPHA, DV, DW, T, D, eps, N: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    # `sum_j alpha_j dalpha_j = <dout, out>`, so each candidate's gradient needs only its own row: one read of
    # every candidate, `dout` and the fp32 `out`. Each program takes ROWS tokens and keeps a partial dw in registers.
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < D
    w = tl.load(W + offs, mask=dmask, other=0.0)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(ROWS):
        row = pid.to(tl.int64) * ROWS + j
        if row < T:
            do = tl.load(DO + row * D + offs, mask=dmask, other=0.0).to(tl.float32)
            o = tl.load(O + row * D + offs, mask=dmask, other=0.0).to(tl.float32)
            do_o = tl.sum(do * o, axis=0)
            v_next = tl.load(V + row * D + offs, mask=dmask, other=0.0)  # prefetched as in the forward
            for i in tl.static_range(N):
                v = v_next.to(tl.float32)
                if i + 1 < N:
                    v_next = tl.load(V + ((i + 1) * T + row) * D + offs, mask=dmask, other=0.0)
                alpha = tl.load(ALPHA + i * T + row)
                r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
                p = tl.sum(v * w, axis=0)
                dlogit = alpha * (tl.sum(do * v, axis=0) - do_o)
                dv = alpha * do + (dlogit * r) * w - (dlogit * p * r * r * r / D) * v
                tl.store(DV + (i * T + row) * D + offs, dv.to(DV.dtype.element_ty), mask=dmask)
                dw += (dlogit * r) * v
    tl.store(DW + pid.to(tl.int64) * D + offs, dw, mask=dmask)


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _attnres_fwd_stream(
    V, W, O, ALPHA, RS, PS, T, D, eps, TPP, N: tl.constexpr, NP: tl.constexpr, SAVE_STATS: tl.constexpr,
    BLOCK_D: tl.constexpr, STAGES: tl.constexpr,
):
    # The row design's online softmax over whole candidate rows, on a persistent grid whose one loop runs over
    # (token, candidate) pairs: program p takes tokens [p TPP, (p + 1) TPP), and Triton's software pipeline keeps
    # the next STAGES - 1 rows in flight (copied to shared memory) across token boundaries too, where a loop per
    # token would drain the pipeline N rows at a time. A token's softmax state starts over at its first candidate,
    # and its output and alpha_i (from the logits kept in a [NP] vector) are written at its last (r_i, p_i at
    # each). Both row sums come from one two-operand reduction: one trip through shared memory.
    t_lo = tl.program_id(0) * TPP
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < D
    w = tl.load(W + offs, mask=dmask, other=0.0)  # [BLOCK_D] fp32
    idx = tl.arange(0, NP)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    m = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], dtype=tl.float32)
    lg = tl.full([NP], float("-inf"), tl.float32)  # this token's logits so far
    for it in tl.range(0, (tl.minimum(T, t_lo + TPP) - t_lo) * N, num_stages=STAGES):
        j = it // N
        i = it - j * N  # candidate
        t = t_lo + j  # token
        v = _widen(tl.load(V + (i.to(tl.int64) * T + t) * D + offs, mask=dmask, other=0.0))
        ss, p = tl.reduce((v * v, v * w), 0, _add2)
        r = 1.0 / tl.sqrt(ss / D + eps)
        logit = r * p
        if SAVE_STATS:
            tl.store(RS + i * T + t, r)
            tl.store(PS + i * T + t, p)
        if (logit > m) | (i == 0):
            # A new running max (or a new token: its sums start from zero, whatever the previous token left, NaN
            # included): rescale what is summed so far. Block-uniform, and skipped whenever the max stands, which
            # saves a multiply an element of the ~10 instructions an element the loop issues (at the H200's rate
            # the issue slots are about two thirds of a row's time budget: BENCHMARKS.md, thirty-third session).
            acc = tl.where(i == 0, 0.0, acc * tl.exp(m - logit))
            den = tl.where(i == 0, 0.0, den * tl.exp(m - logit))
            m = logit
        e = tl.exp(logit - m)
        acc += e * v
        den += e
        lg = tl.where(idx == i, logit, tl.where(i == 0, float("-inf"), lg))
        if i == N - 1:
            tl.store(O + t.to(tl.int64) * D + offs, (acc * (1.0 / den)).to(O.dtype.element_ty), mask=dmask)
            tl.store(ALPHA + idx * T + t, tl.exp(lg - m) / den, mask=idx < N)


@triton.jit
def _attnres_fwd_tiled(
    V, W, O, ALPHA, RS, PS, T, D, eps, NB, N: tl.constexpr, NP: tl.constexpr, SAVE_STATS: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
):
    # NB blocks of BLOCK_T tokens per program, one after the other (NB > 1 bounds how many programs run at once,
    # hence what L2 must hold between a slice's two reads); every d-slice is one [BLOCK_T, NP, BLOCK_D] load of
    # all candidates at once (independent loads: memory-level parallelism), only [BLOCK_T, NP] fp32 partial
    # sums cross slices.
    offs_n = tl.arange(0, NP)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_D // CHUNK) * CHUNK  # [C = BLOCK_D // CHUNK] chunk starts inside a slice
    offs_j = tl.arange(0, CHUNK)
    nmask = offs_n < N
    for b in range(NB):
        offs_t = (tl.program_id(0).to(tl.int64) * NB + b) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
        tmask = offs_t < T
        rmask = tmask[:, None] & nmask[None, :]  # [BLOCK_T, NP]
        rows = (offs_n[None, :].to(tl.int64) * T + offs_t[:, None]) * D  # [BLOCK_T, NP]: start of v[i, t, :]
        ss = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
        pw = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
        # Pass 1 views a slice as [BLOCK_T, C, NP, CHUNK] (BLOCK_D = C * CHUNK, CHUNK <= 256): a warp's 32 lanes
        # x 8 values span one CHUNK, so Triton's default layout puts the warps on the candidate axis and both
        # sums (over CHUNK: lanes, over C: a thread's own registers) stay inside a warp, with no shared memory
        # or barrier per slice. w is loaded at that full shape (repeats hit L1) for the same reason.
        for d0 in range(0, D, BLOCK_D):
            dd = tl.multiple_of(d0, BLOCK_D) + offs_c[None, :, None, None] + offs_j[None, None, None, :]
            vmask = rmask[:, None, :, None] & (dd < D)  # [BLOCK_T, C, NP, CHUNK]
            w = tl.load(W + tl.zeros([BLOCK_T, BLOCK_D // CHUNK, NP, 1], dtype=tl.int32) + dd, mask=vmask,
                        other=0.0)
            v = tl.load(
                V + rows[:, None, :, None] + dd, mask=vmask, other=0.0,
                eviction_policy="evict_last",  # read again by pass 2 right away: keep it in L2
            ).to(tl.float32)
            ss += tl.sum(tl.sum(v * v, axis=3), axis=1)
            pw += tl.sum(tl.sum(v * w, axis=3), axis=1)
        r = 1.0 / tl.sqrt(ss / D + eps)
        logit = tl.where(nmask[None, :], r * pw, float("-inf"))  # padded candidates get no weight
        m = tl.max(logit, axis=1)
        e = tl.exp(logit - m[:, None])
        alpha = e / tl.sum(e, axis=1)[:, None]  # [BLOCK_T, NP]
        sidx = offs_n[None, :] * T + offs_t[:, None]  # [BLOCK_T, NP] into the [N, T] buffers
        tl.store(ALPHA + sidx, alpha, mask=rmask)
        if SAVE_STATS:
            tl.store(RS + sidx, r, mask=rmask)
            tl.store(PS + sidx, pw, mask=rmask)
        if SPLIT:
            # Pass 2 takes the candidates one [BLOCK_T, BLOCK_D] load at a time (still N independent loads per
            # slice): the sum over the padded candidate axis of a 3D tile may cross warps (shared memory and a
            # barrier per slice), the unrolled per-candidate FMAs need neither. alpha_i is read back from ALPHA
            # (L1): the barrier makes this program's stores visible to all its threads.
            tl.debug_barrier()
            for d0 in range(0, D, BLOCK_D):
                dd = tl.multiple_of(d0, BLOCK_D) + offs_d
                omask = tmask[:, None] & (dd < D)[None, :]  # [BLOCK_T, BLOCK_D]
                acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
                for i in tl.static_range(N):
                    a = tl.load(ALPHA + i * T + offs_t, mask=tmask, other=0.0)  # [BLOCK_T]
                    v = tl.load(V + (offs_t[:, None] + i * T) * D + dd[None, :], mask=omask, other=0.0,
                                eviction_policy="evict_first").to(tl.float32)
                    acc += a[:, None] * v
                tl.store(O + offs_t[:, None] * D + dd[None, :], acc.to(O.dtype.element_ty), mask=omask)
        else:
            # Pass 2 on the same [BLOCK_T, NP, BLOCK_D] tiles, summed over the candidate axis.
            for d0 in range(0, D, BLOCK_D):
                dd = tl.multiple_of(d0, BLOCK_D) + offs_d
                dmask = dd < D
                v = tl.load(
                    V + rows[:, :, None] + dd[None, None, :], mask=rmask[:, :, None] & dmask[None, None, :],
                    other=0.0, eviction_policy="evict_first",
                ).to(tl.float32)
                out = tl.sum(alpha[:, :, None] * v, axis=1)  # [BLOCK_T, BLOCK_D]
                tl.store(O + offs_t[:, None] * D + dd[None, :], out.to(O.dtype.element_ty),
                         mask=tmask[:, None] & dmask[None, :])


@triton.jit
def _resident_offsets(T, D, COL0, ROW0: tl.constexpr, NR: tl.constexpr, N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Offsets `[NR, BLOCK_D]` of v[ROW0 + j, 0, COL0:COL0 + BLOCK_D] and their mask (rows past N and columns past D
    off)."""
    offs_n = ROW0 + tl.arange(0, NR)
    offs_d = COL0 + tl.arange(0, BLOCK_D)
    return offs_n[:, None].to(tl.int64) * T * D + offs_d[None, :], (offs_n[:, None] < N) & (offs_d[None, :] < D)


@triton.jit
def _resident_load(V, rows, mask, t, T, D, NR: tl.constexpr):
    """Token t's `[NR, BLOCK_D]` rows (zeros when t >= T)."""
    return tl.load(V + rows + t.to(tl.int64) * D, mask=mask & (tl.full([NR, 1], t, tl.int32) < T), other=0.0)


@triton.jit
def _logits(ss, p, D, eps, ROW0: tl.constexpr, NR: tl.constexpr, N: tl.constexpr):
    """r_i, p_i and logit_i `[NR]` of a row group from its sums ss_i = sum v_i^2 and p_i = <v_i, w> over the whole
    row (padded rows get logit -inf)."""
    r = 1.0 / tl.sqrt(ss / D + eps)
    return r, p, tl.where(ROW0 + tl.arange(0, NR) < N, r * p, float("-inf"))


@triton.jit
def _load_tiles(V, rows_a, mask_a, rows_b, mask_b, t, T, D, NA: tl.constexpr, NB: tl.constexpr):
    """Token t's two row groups (the second is the first again when NB = 0, never used then)."""
    va = _resident_load(V, rows_a, mask_a, t, T, D, NA)
    vb = va
    if NB > 0:
        vb = _resident_load(V, rows_b, mask_b, t, T, D, NB)
    return va, vb


@triton.jit
def _load_bwd_tiles(V, DO, rows_a, mask_a, rows_b, mask_b, do_rows, do_mask, t, T, D, NA: tl.constexpr,
                    NB: tl.constexpr):
    """Token t's two row groups and its dout row `[1, BLOCK_D]`."""
    va, vb = _load_tiles(V, rows_a, mask_a, rows_b, mask_b, t, T, D, NA, NB)
    return va, vb, _resident_load(DO, do_rows, do_mask, t, T, D, 1)


@triton.jit
def _resident_logits(f, w, D, eps, ROW0: tl.constexpr, NR: tl.constexpr, N: tl.constexpr):
    """r_i, p_i and logit_i `[NR]` of a row group `f` `[NR, BLOCK_D]` fp32 holding whole rows."""
    return _logits(tl.sum(f * f, axis=1), tl.sum(f * w, axis=1), D, eps, ROW0, NR, N)


@triton.jit
def _softmax2(la, lb, HAS_B: tl.constexpr):
    """alpha of the two row groups' logits `[NA]`, `[NB]` (lb unused unless HAS_B)."""
    m = tl.max(la, axis=0)
    if HAS_B:
        m = tl.maximum(m, tl.max(lb, axis=0))
    ea = tl.exp(la - m)
    den = tl.sum(ea, axis=0)
    eb = lb
    if HAS_B:
        eb = tl.exp(lb - m)
        den += tl.sum(eb, axis=0)
    return ea / den, eb / den


@triton.jit
def _resident_store_stats(ALPHA, RS, PS, alpha, r, p, t, T, SAVE_STATS: tl.constexpr, ROW0: tl.constexpr,
                          NR: tl.constexpr, N: tl.constexpr):
    i = ROW0 + tl.arange(0, NR)
    tl.store(ALPHA + i * T + t, alpha, mask=i < N)
    if SAVE_STATS:
        tl.store(RS + i * T + t, r, mask=i < N)
        tl.store(PS + i * T + t, p, mask=i < N)


@triton.jit
def _mix_store(O, va, vb, aa, ab, t, offs_d, dmask, D, HAS_B: tl.constexpr):
    """out[t, offs_d] = sum_i alpha_i v_i over the two row groups. v is widened here again rather than kept in fp32
    from the statistics: the fp32 copy of a 6-row tile spilled at 16 warps (sm_90, triton 3.6: 104 bytes a thread;
    none with this)."""
    out = tl.sum(aa[:, None] * _widen(va), axis=0)  # [BLOCK_D]
    if HAS_B:
        out += tl.sum(ab[:, None] * _widen(vb), axis=0)
    tl.store(O + t.to(tl.int64) * D + offs_d, out.to(O.dtype.element_ty), mask=dmask)


@triton.jit
def _widen(x):
    """x in fp32, for bf16 by moving its bits (not a `.to`, so the compiler keeps the bf16 tile live, not an fp32
    copy)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _attnres_fwd_resident(
    V, W, O, ALPHA, RS, PS, T, D, eps, N: tl.constexpr, NA: tl.constexpr, NB: tl.constexpr,
    SAVE_STATS: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr,
):
    # Persistent: program p takes tokens p, p + P, p + 2P, ... Each token's whole tile of all candidates is loaded
    # once and kept (registers, or shared memory when pipelined) through the statistics, the softmax and the mix,
    # so every byte is read from HBM once and nothing is re-read (the tiled design's second sweep depends on L2).
    # The tile is two row groups, `[NA, BLOCK_D]` (NA = the largest power of two <= N) and `[NB, BLOCK_D]` (the rest,
    # padded to a power of two; NB = 0: none), so N = 3, 5, 6 hold 3, 5, 6 rows instead of 4, 8, 8.
    # The next tokens' bytes must be in flight while this one is reduced (its reductions end in barriers): PREFETCH
    # loads the next tile into registers before this one's arithmetic; STAGES > 1 has Triton's software pipeline
    # copy the next STAGES - 1 tiles into shared memory asynchronously instead. w is loaded once per program.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    w = tl.load(W + offs_d, mask=dmask, other=0.0)[None, :]  # [1, BLOCK_D] fp32
    rows_a, mask_a = _resident_offsets(T, D, 0, 0, NA, N, BLOCK_D)
    rows_b, mask_b = _resident_offsets(T, D, 0, NA, max(NB, 1), N, BLOCK_D)
    if PREFETCH:
        va_next, vb_next = _load_tiles(V, rows_a, mask_a, rows_b, mask_b, pid, T, D, NA, NB)
    for t0 in tl.range(0, T, n_prog, num_stages=STAGES):
        t = t0 + pid  # this program's token (t0 is the same in every program: its tail is past T in some)
        if PREFETCH:
            va, vb = va_next, vb_next
            va_next, vb_next = _load_tiles(V, rows_a, mask_a, rows_b, mask_b, t + n_prog, T, D, NA, NB)
        else:
            va, vb = _load_tiles(V, rows_a, mask_a, rows_b, mask_b, t, T, D, NA, NB)
        if t < T:
            ra, pa, la = _resident_logits(va.to(tl.float32), w, D, eps, 0, NA, N)  # [NA]
            rb, pb, lb = ra, pa, la
            if NB > 0:
                rb, pb, lb = _resident_logits(vb.to(tl.float32), w, D, eps, NA, NB, N)  # [NB]
            aa, ab = _softmax2(la, lb, NB > 0)
            _resident_store_stats(ALPHA, RS, PS, aa, ra, pa, t, T, SAVE_STATS, 0, NA, N)
            if NB > 0:
                _resident_store_stats(ALPHA, RS, PS, ab, rb, pb, t, T, SAVE_STATS, NA, NB, N)
            _mix_store(O, va, vb, aa, ab, t, offs_d, dmask, D, NB > 0)


@triton.jit
def _resident_saved(ALPHA, RS, PS, t, T, ROW0: tl.constexpr, NR: tl.constexpr, N: tl.constexpr):
    """The forward's alpha_i, r_i, p_i of a row group of token t, each `[NR]` (zeros when t >= T)."""
    i = ROW0 + tl.arange(0, NR)
    sidx = i * T + t  # [NR] into the [N, T] buffers
    ok = (i < N) & (tl.full([NR], t, tl.int32) < T)
    return (tl.load(ALPHA + sidx, mask=ok, other=0.0), tl.load(RS + sidx, mask=ok, other=0.0),
            tl.load(PS + sidx, mask=ok, other=0.0))


@triton.jit
def _resident_dv_store(v, do, w, dalpha, alpha, r, p, s, DV, rows, mask, t, D):
    """dv_i of a row group given s = <dout, out>, written; returns the group's sum_i dlogit_i r_i v_i (for dw)."""
    dlogit = alpha * (dalpha - s)
    c_w = dlogit * r
    c_v = dlogit * p * r * r * r / D
    f = _widen(v)
    dv = alpha[:, None] * do + c_w[:, None] * w - c_v[:, None] * f
    tl.store(DV + rows + t.to(tl.int64) * D, dv.to(DV.dtype.element_ty), mask=mask)
    return tl.sum(c_w[:, None] * f, axis=0)


@triton.jit
def _attnres_bwd_resident(
    V, W, DO, ALPHA, RS, PS, DV, DW, T, D, N: tl.constexpr, NA: tl.constexpr, NB: tl.constexpr,
    BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr,
):
    # The forward's persistent walk and row groups again, one read of each token's tile and dout row: with all N
    # dalpha_i = <dout, v_i> of the token at hand, sum_j alpha_j dalpha_j = <dout, out> comes out exactly in fp32,
    # and dv_i is written from the same registers. dw accumulates over the program's tokens in registers: one
    # partial row per program, summed by torch.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    w = tl.load(W + offs_d, mask=dmask, other=0.0)[None, :]  # [1, BLOCK_D] fp32
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    rows_a, mask_a = _resident_offsets(T, D, 0, 0, NA, N, BLOCK_D)
    rows_b, mask_b = _resident_offsets(T, D, 0, NA, max(NB, 1), N, BLOCK_D)
    do_rows = offs_d[None, :].to(tl.int64)  # [1, BLOCK_D]: dout is one row a token
    if PREFETCH:
        va_next, vb_next, do_next = _load_bwd_tiles(V, DO, rows_a, mask_a, rows_b, mask_b, do_rows, dmask[None, :],
                                                    pid, T, D, NA, NB)
    for t0 in tl.range(0, T, n_prog, num_stages=STAGES):
        t = t0 + pid
        if PREFETCH:
            va, vb, do = va_next, vb_next, do_next
            va_next, vb_next, do_next = _load_bwd_tiles(V, DO, rows_a, mask_a, rows_b, mask_b, do_rows,
                                                        dmask[None, :], t + n_prog, T, D, NA, NB)
        else:
            va, vb, do = _load_bwd_tiles(V, DO, rows_a, mask_a, rows_b, mask_b, do_rows, dmask[None, :], t, T, D,
                                         NA, NB)
        # Loaded here, not under `if t < T`: Triton's pipeliner leaves a loop alone when it has loads in a branch.
        aa, ra, pa = _resident_saved(ALPHA, RS, PS, t, T, 0, NA, N)
        if NB > 0:
            ab, rb, pb = _resident_saved(ALPHA, RS, PS, t, T, NA, NB, N)
        if t < T:
            fa = va.to(tl.float32)
            fdo = do.to(tl.float32)  # [1, BLOCK_D]
            da = tl.sum(fa * fdo, axis=1)  # [NA]: dalpha_i = <dout, v_i>
            s = tl.sum(aa * da, axis=0)
            if NB > 0:
                fb = vb.to(tl.float32)
                db = tl.sum(fb * fdo, axis=1)
                s += tl.sum(ab * db, axis=0)
                dw += _resident_dv_store(vb, fdo, w, db, ab, rb, pb, s, DV, rows_b, mask_b, t, D)
            dw += _resident_dv_store(va, fdo, w, da, aa, ra, pa, s, DV, rows_a, mask_a, t, D)
    tl.store(DW + pid.to(tl.int64) * D + offs_d, dw, mask=dmask)


@triton.jit
def _coop_put(PART, x, t, s, S, K: tl.constexpr, KQ: tl.constexpr, ROW0: tl.constexpr, NR: tl.constexpr,
              NT: tl.constexpr):
    """Publish this slice's partial sums x `[NR]` of quantity K of token t: PART[t, K, s, ROW0:ROW0 + NR]."""
    tl.store(PART + ((t.to(tl.int64) * KQ + K) * S + s) * NT + ROW0 + tl.arange(0, NR), x)


@triton.jit
def _coop_total(PART, t, S, K: tl.constexpr, KQ: tl.constexpr, ROW0: tl.constexpr, NR: tl.constexpr,
                NT: tl.constexpr, SP: tl.constexpr):
    """The sums `[NR]` of quantity K of token t over its S slices, in slice order (deterministic)."""
    j = tl.arange(0, SP)
    offs = ((t.to(tl.int64) * KQ + K) * S + j[:, None]) * NT + ROW0 + tl.arange(0, NR)[None, :]  # [SP, NR]
    # .cg: from L2, where the other programs' stores are, never a stale L1 line
    return tl.sum(tl.load(PART + offs, mask=j[:, None] < S, other=0.0, cache_modifier=".cg"), axis=0)


@triton.jit
def _coop_wait(CNT, t, S):
    """Count this program's slice of token t as published, then wait until all S are (CUTLASS's semaphore pattern:
    a barrier orders every thread's stores before one release at GPU scope; the acquire before the reads)."""
    tl.debug_barrier()
    tl.atomic_add(CNT + t, 1, sem="release", scope="gpu")
    n = tl.atomic_add(CNT + t, 0, sem="acquire", scope="gpu")
    while n < S:
        n = tl.atomic_add(CNT + t, 0, sem="acquire", scope="gpu")


@triton.jit
def _coop_program(W, T, D, S, N: tl.constexpr, NA: tl.constexpr, NB: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's place in a cooperative grid of G groups of S: (G, group g, slice s), the slice's columns,
    their mask, its w `[1, BLOCK_D]` and the two row groups' offsets and masks."""
    pid = tl.program_id(0)
    s = pid % S
    offs_d = s * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    w = tl.load(W + offs_d, mask=dmask, other=0.0)[None, :]  # [1, BLOCK_D] fp32
    rows_a, mask_a = _resident_offsets(T, D, s * BLOCK_D, 0, NA, N, BLOCK_D)
    rows_b, mask_b = _resident_offsets(T, D, s * BLOCK_D, NA, max(NB, 1), N, BLOCK_D)
    return tl.num_programs(0) // S, pid // S, s, offs_d, dmask, w, rows_a, mask_a, rows_b, mask_b


@triton.jit
def _attnres_fwd_coop(
    V, W, O, ALPHA, RS, PS, PART, CNT, T, D, eps, S, N: tl.constexpr, NA: tl.constexpr, NB: tl.constexpr,
    SP: tl.constexpr, SAVE_STATS: tl.constexpr, BLOCK_D: tl.constexpr, PHASE: tl.constexpr,
):
    # A persistent grid of G groups of S programs: program (g, s) owns the d-slice s (BLOCK_D wide) of tokens
    # g, g + G, ... It loads its `[N, BLOCK_D]` tile of a token once, publishes the slice's partial sums
    # ss_i = sum v_i^2 and p_i = <v_i, w> to PART, waits for the token's other S - 1 slices (a counter per token),
    # adds the S partials up and mixes its slice from the same registers: every byte is read once, as in
    # "resident", but with small tiles and many programs an SM, whose loads overlap each other's waits.
    # PHASE 0 = all of it; the interpreter, which runs programs one after another (a wait there would never end),
    # launches PHASE 1 (publish only) and then PHASE 2 (reload and mix, no wait) instead.
    G, g, s, offs_d, dmask, w, rows_a, mask_a, rows_b, mask_b = _coop_program(W, T, D, S, N, NA, NB, BLOCK_D)
    NT: tl.constexpr = NA + NB
    for j in tl.range(0, tl.cdiv(T - g, G)):
        t = g + j * G
        va, vb = _load_tiles(V, rows_a, mask_a, rows_b, mask_b, t, T, D, NA, NB)
        if PHASE != 2:
            fa = va.to(tl.float32)
            _coop_put(PART, tl.sum(fa * fa, axis=1), t, s, S, 0, 2, 0, NA, NT)
            _coop_put(PART, tl.sum(fa * w, axis=1), t, s, S, 1, 2, 0, NA, NT)
            if NB > 0:
                fb = vb.to(tl.float32)
                _coop_put(PART, tl.sum(fb * fb, axis=1), t, s, S, 0, 2, NA, NB, NT)
                _coop_put(PART, tl.sum(fb * w, axis=1), t, s, S, 1, 2, NA, NB, NT)
        if PHASE == 0:
            _coop_wait(CNT, t, S)
        if PHASE != 1:
            ra, pa, la = _logits(_coop_total(PART, t, S, 0, 2, 0, NA, NT, SP),
                                 _coop_total(PART, t, S, 1, 2, 0, NA, NT, SP), D, eps, 0, NA, N)
            rb, pb, lb = ra, pa, la
            if NB > 0:
                rb, pb, lb = _logits(_coop_total(PART, t, S, 0, 2, NA, NB, NT, SP),
                                     _coop_total(PART, t, S, 1, 2, NA, NB, NT, SP), D, eps, NA, NB, N)
            aa, ab = _softmax2(la, lb, NB > 0)
            if s == 0:
                _resident_store_stats(ALPHA, RS, PS, aa, ra, pa, t, T, SAVE_STATS, 0, NA, N)
                if NB > 0:
                    _resident_store_stats(ALPHA, RS, PS, ab, rb, pb, t, T, SAVE_STATS, NA, NB, N)
            _mix_store(O, va, vb, aa, ab, t, offs_d, dmask, D, NB > 0)


@triton.jit
def _attnres_bwd_coop(
    V, W, DO, ALPHA, RS, PS, DV, DW, PART, CNT, T, D, S, N: tl.constexpr, NA: tl.constexpr, NB: tl.constexpr,
    SP: tl.constexpr, BLOCK_D: tl.constexpr, PHASE: tl.constexpr,
):
    # The forward's groups and slices: program (g, s) publishes its slice's partial dalpha_i = <dout, v_i>, waits
    # for the token's other slices, then writes its slice of every dv_i from the same registers. dw: one partial
    # row per group (each program fills its slice), summed by torch.
    G, g, s, offs_d, dmask, w, rows_a, mask_a, rows_b, mask_b = _coop_program(W, T, D, S, N, NA, NB, BLOCK_D)
    NT: tl.constexpr = NA + NB
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    do_rows = offs_d[None, :].to(tl.int64)  # [1, BLOCK_D]: dout is one row a token
    for j in tl.range(0, tl.cdiv(T - g, G)):
        t = g + j * G
        va, vb, do = _load_bwd_tiles(V, DO, rows_a, mask_a, rows_b, mask_b, do_rows, dmask[None, :], t, T, D, NA, NB)
        fdo = do.to(tl.float32)  # [1, BLOCK_D]
        if PHASE != 2:
            _coop_put(PART, tl.sum(va.to(tl.float32) * fdo, axis=1), t, s, S, 0, 1, 0, NA, NT)
            if NB > 0:
                _coop_put(PART, tl.sum(vb.to(tl.float32) * fdo, axis=1), t, s, S, 0, 1, NA, NB, NT)
        if PHASE == 0:
            _coop_wait(CNT, t, S)
        if PHASE != 1:
            da = _coop_total(PART, t, S, 0, 1, 0, NA, NT, SP)  # [NA]
            aa, ra, pa = _resident_saved(ALPHA, RS, PS, t, T, 0, NA, N)
            sd = tl.sum(aa * da, axis=0)  # <dout, out>
            if NB > 0:
                db = _coop_total(PART, t, S, 0, 1, NA, NB, NT, SP)
                ab, rb, pb = _resident_saved(ALPHA, RS, PS, t, T, NA, NB, N)
                sd += tl.sum(ab * db, axis=0)
                dw += _resident_dv_store(vb, fdo, w, db, ab, rb, pb, sd, DV, rows_b, mask_b, t, D)
            dw += _resident_dv_store(va, fdo, w, da, aa, ra, pa, sd, DV, rows_a, mask_a, t, D)
    if PHASE != 1:
        tl.store(DW + g.to(tl.int64) * D + offs_d, dw, mask=dmask)


@triton.jit
def _attnres_bwd_tiled(
    V, W, DO, ALPHA, RS, PS, SCR, DV, DW, T, D, NB, N: tl.constexpr, NP: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
):
    # NB token blocks of BLOCK_T tokens per program, each done in two d-sweeps (pass 2 re-reads from L2).
    # r_i, p_i come from the forward, so pass 1 needs only dalpha_i = <dout, v_i>; <dout, out> is
    # sum_j alpha_j dalpha_j, formed from those in fp32 (no out read). SCR: [2, N, T] fp32 scratch for the
    # per-candidate coefficients pass 2 reads back.
    pid = tl.program_id(0)
    offs_n = tl.arange(0, NP)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_D // CHUNK) * CHUNK  # [C = BLOCK_D // CHUNK] chunk starts inside a slice
    offs_j = tl.arange(0, CHUNK)
    nmask = offs_n < N
    dw_row = DW + pid.to(tl.int64) * D
    for b in range(NB):
        offs_t = (pid.to(tl.int64) * NB + b) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
        tmask = offs_t < T
        rmask = tmask[:, None] & nmask[None, :]  # [BLOCK_T, NP]
        rows = (offs_n[None, :].to(tl.int64) * T + offs_t[:, None]) * D  # [BLOCK_T, NP]
        orow = offs_t[:, None] * D  # [BLOCK_T, 1]
        sidx = offs_n[None, :] * T + offs_t[:, None]
        # Masked (padded candidate or past-the-end token) entries load alpha = r = 0: no gradient from them.
        alpha = tl.load(ALPHA + sidx, mask=rmask, other=0.0)
        r = tl.load(RS + sidx, mask=rmask, other=0.0)
        p = tl.load(PS + sidx, mask=rmask, other=0.0)
        da = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
        # Pass 1 in the forward's [BLOCK_T, C, NP, CHUNK] view; dout loaded at that full shape as w there (no
        # layout conversion; the repeats hit L1).
        do_rows4 = orow[:, :, None, None] + tl.zeros([BLOCK_T, BLOCK_D // CHUNK, NP, 1], dtype=tl.int64)
        for d0 in range(0, D, BLOCK_D):
            dd = tl.multiple_of(d0, BLOCK_D) + offs_c[None, :, None, None] + offs_j[None, None, None, :]
            vmask = rmask[:, None, :, None] & (dd < D)  # [BLOCK_T, C, NP, CHUNK]
            do = tl.load(DO + do_rows4 + dd, mask=vmask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            v = tl.load(V + rows[:, None, :, None] + dd, mask=vmask, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            da += tl.sum(tl.sum(do * v, axis=3), axis=1)
        do_rows = orow[:, :, None] + tl.zeros([BLOCK_T, NP, 1], dtype=tl.int64)  # [BLOCK_T, NP, 1], "tile" pass 2
        do_o = tl.sum(alpha * da, axis=1)  # [BLOCK_T] = <dout, out>
        dlogit = alpha * (da - do_o[:, None])
        if SPLIT:
            tl.store(SCR + sidx, dlogit * r, mask=rmask)  # coefficient of w in dv_i, and of v_i in dw
            tl.store(SCR + N * T + sidx, dlogit * p * r * r * r / D, mask=rmask)  # coefficient of v_i in dv_i
            tl.debug_barrier()  # pass 2's threads read those back
            # Pass 2 one candidate at a time, as the forward's SPLIT pass 2 (no cross-warp sum over candidates).
            for d0 in range(0, D, BLOCK_D):
                dd = tl.multiple_of(d0, BLOCK_D) + offs_d
                dmask = dd < D
                omask = tmask[:, None] & dmask[None, :]  # [BLOCK_T, BLOCK_D]
                w = tl.load(W + dd, mask=dmask, other=0.0)
                do = tl.load(DO + orow + dd[None, :], mask=omask, other=0.0,
                             eviction_policy="evict_first").to(tl.float32)
                dwp = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
                for i in tl.static_range(N):
                    a = tl.load(ALPHA + i * T + offs_t, mask=tmask, other=0.0)  # [BLOCK_T]
                    cw = tl.load(SCR + i * T + offs_t, mask=tmask, other=0.0)
                    cv = tl.load(SCR + (N + i) * T + offs_t, mask=tmask, other=0.0)
                    vi = (offs_t[:, None] + i * T) * D + dd[None, :]  # [BLOCK_T, BLOCK_D] into [N, T, D]
                    v = tl.load(V + vi, mask=omask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                    dv = a[:, None] * do + cw[:, None] * w[None, :] - cv[:, None] * v
                    tl.store(DV + vi, dv.to(DV.dtype.element_ty), mask=omask)
                    dwp += cw[:, None] * v
                part = tl.sum(dwp, axis=0)  # [BLOCK_D]
                # The program's own dw row (L2-resident), read-modify-written; the first block starts from zero.
                prev = tl.load(dw_row + dd, mask=dmask & (b > 0), other=0.0)
                tl.store(dw_row + dd, prev + part, mask=dmask)
        else:
            cw = dlogit * r  # [BLOCK_T, NP] coefficient of w in dv_i, and of v_i in dw
            cv = dlogit * p * r * r * r / D  # coefficient of v_i in dv_i
            for d0 in range(0, D, BLOCK_D):
                dd = tl.multiple_of(d0, BLOCK_D) + offs_d
                dmask = dd < D
                vmask = rmask[:, :, None] & dmask[None, None, :]
                w = tl.load(W + tl.zeros([BLOCK_T, NP, 1], dtype=tl.int32) + dd[None, None, :], mask=vmask,
                            other=0.0)
                do = tl.load(DO + do_rows + dd[None, None, :], mask=vmask, other=0.0,
                             eviction_policy="evict_first").to(tl.float32)
                v = tl.load(V + rows[:, :, None] + dd[None, None, :], mask=vmask, other=0.0,
                            eviction_policy="evict_first").to(tl.float32)
                dv = alpha[:, :, None] * do + cw[:, :, None] * w - cv[:, :, None] * v
                tl.store(DV + rows[:, :, None] + dd[None, None, :], dv.to(DV.dtype.element_ty), mask=vmask)
                part = tl.sum(tl.sum(cw[:, :, None] * v, axis=1), axis=0)  # [BLOCK_D]
                prev = tl.load(dw_row + dd, mask=dmask & (b > 0), other=0.0)
                tl.store(dw_row + dd, prev + part, mask=dmask)
        # The next block overwrites SCR's entries of other tokens only, but reads back the dw row that other
        # threads of this program just stored: order it.
        tl.debug_barrier()


def _launch_cfg(D: int, num_warps: int | None = None):
    BLOCK_D = max(16, triton.next_power_of_2(D))
    if BLOCK_D > 16384:
        raise ValueError(f"attn_res_triton keeps a whole row in registers: hidden size {D} > 16384 is not supported")
    if num_warps is None:
        # ~32 fp32 values of a row per thread.
        num_warps = max(1, min(16, BLOCK_D // (32 * 32)))
    return BLOCK_D, num_warps


_BWD_ROWS = 16  # tokens per backward program: partial dw buffers are T/16 rows of d floats


def _is_pow2(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and (x & (x - 1)) == 0


def _check_pow2(name: str, value, lo: int, hi: int):
    if not (_is_pow2(value) and lo <= value <= hi):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {value!r}")


def _sm_count(device) -> int:
    # The interpreter has no SMs: 2 stand in, so the tests run several token blocks per program.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def _tiled_grid(n_blocks: int, min_nb: int, per_sm, device) -> tuple[int, int]:
    """(programs, token blocks per program) for `n_blocks` blocks, at least `min_nb` blocks per program."""
    nb = min_nb
    if per_sm is not None:
        nb = max(nb, triton.cdiv(n_blocks, per_sm * _sm_count(device)))
    return triton.cdiv(n_blocks, nb), nb


def _tiled_cfg(N: int, D: int, block_t, block_d, num_warps, grad: bool = False):
    """(BLOCK_T, NP, BLOCK_D, num_warps) of the tiled kernels; arguments already validated or None."""
    NP = triton.next_power_of_2(N)
    block_t = DEFAULT_TILED_BLOCK_T if block_t is None else block_t
    if block_d is None:
        # 16K-element slices of all candidates: the fastest forward measured at N = 3, 6 and 9 (block_d 4096,
        # 2048, 1024 at d = 7168; narrower slices leave fewer bytes in flight, wider ones spill)
        block_d = max(256, (_MAX_TILE // 4) // (NP * block_t))
    # A slice wider than the (padded) row only adds masked lanes.
    block_d = min(block_d, max(16, triton.next_power_of_2(D)))
    if block_t * NP * block_d > _MAX_TILE:
        raise ValueError(
            f"block_t * next_pow2(N) * block_d = {block_t} * {NP} * {block_d} exceeds {_MAX_TILE} elements per tile"
        )
    if num_warps is None:
        # measured: 4 warps best for the forward at N = 3 and 9, 8 at N = 6 and whenever the backward runs too
        num_warps = 8 if (grad or NP == 8) else 4
    return block_t, NP, block_d, num_warps


def _resident_rows(N: int) -> tuple[int, int]:
    NA = 1 << (N.bit_length() - 1)  # the largest power of two <= N
    return NA, 0 if N == NA else triton.next_power_of_2(N - NA)


def _resident_fits(N: int, D: int) -> bool:
    return sum(_resident_rows(N)) * max(16, triton.next_power_of_2(D)) <= _MAX_TILE


def _backward_variant(N: int, D: int) -> str:
    """The backward design of "auto" and "stream" (the measured rule, see `DEFAULT_VARIANT`)."""
    return "resident" if N <= RESIDENT_MAX_N and _resident_fits(N, D) else "cooperative"


def _auto_variant(N: int, D: int) -> str:
    """The design "auto" takes without slice sizes: the backward's where it is "resident", else the stream forward
    where its whole row fits a program (`_launch_cfg`), else "cooperative" (any d, in slices)."""
    backward = _backward_variant(N, D)
    return "stream" if backward == "cooperative" and triton.next_power_of_2(D) <= 16384 else backward


def _resident_cfg(N: int, D: int, num_warps):
    """(NA, NB, BLOCK_D, num_warps) of the resident kernels: one token's rows as two power-of-two groups."""
    NA, NB = _resident_rows(N)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    if not _resident_fits(N, D):
        raise ValueError(
            f"variant='resident' keeps a token's {NA + NB} (padded) rows of next_pow2(d) = {BLOCK_D} in one program, "
            f"at most {_MAX_TILE} elements: use variant='cooperative' or variant='tiled'"
        )
    if num_warps is None:
        # ~64 values of the tile per thread, at most 16 warps (16 beat 32 at N = 3 and 6 on the H200: 0.130 / 0.316
        # against 0.191 / 0.425 ms at their best, fifteenth session)
        num_warps = min(16, triton.next_power_of_2(max(1, (NA + NB) * BLOCK_D // (32 * 64))))
    return NA, NB, BLOCK_D, num_warps


def _resident_schedule(rows: int, prefetch, stages) -> tuple[bool, int]:
    """(register prefetch, pipeline stages) of the resident kernels for `rows` (padded) rows a token; None = the
    measured rule (`RESIDENT_PREFETCH`)."""
    if prefetch is None:
        prefetch = rows <= _RESIDENT_PREFETCH_ROWS and not (stages is not None and stages > 1)
    if stages is None:
        stages = 1 if prefetch else 2
    return bool(prefetch), stages


def _coop_cfg(N: int, D: int, block_d: int, num_warps, backward: bool = False):
    """(NA, NB, BLOCK_D, S, num_warps) of a cooperative kernel: one token's rows as two power-of-two groups, in
    S slices of BLOCK_D."""
    NA, NB = _resident_rows(N)
    BLOCK_D = min(block_d, max(16, triton.next_power_of_2(D)))
    if (NA + NB) * BLOCK_D > _MAX_TILE:
        raise ValueError(f"variant='cooperative': {NA + NB} (padded) rows x block_d {BLOCK_D} exceed {_MAX_TILE} "
                         "elements a program: use a smaller block_d")
    if num_warps is None:
        num_warps = min(32, triton.next_power_of_2(
            triton.cdiv((NA + NB) * BLOCK_D, 32 * _COOP_VALUES_PER_THREAD[backward])))
    return NA, NB, BLOCK_D, triton.cdiv(D, BLOCK_D), num_warps


_REGS_PER_SM, _THREADS_PER_SM, _BLOCKS_PER_SM = 65536, 2048, 32
_COOP_FIT: dict = {}  # programs an SM that fit, per compiled launch (the warmup lookup costs tens of microseconds)


def _coop_groups(kernel, args, kw, per_sm: int, device) -> int:
    """G, the groups of S = kw["S"] programs of a cooperative launch over T = kw["T"] tokens: at most `per_sm`
    programs an SM, and never more than the SMs can hold at once (from the compiled kernel's registers and shared
    memory), since a program waits for the other programs of its group and a group not wholly resident would wait
    for SMs its own members hold."""
    S, T = kw["S"], kw["T"]
    if device.type != "cuda":
        return max(1, min(T, per_sm * _sm_count(device) // S))
    props = torch.cuda.get_device_properties(device)
    key = (kernel, device.index, args[0].dtype, per_sm, *sorted((k, v) for k, v in kw.items() if k not in ("T", "eps")))
    fit = _COOP_FIT.get(key)
    if fit is None:
        k = kernel.warmup(*args, args[0].new_empty(1, dtype=torch.int32), grid=(1,), **kw, PHASE=0)
        k._init_handles()  # n_regs is known once the binary is loaded
        warps = k.metadata.num_warps
        regs_per_warp = triton.cdiv(max(k.n_regs, 1) * 32, 256) * 256  # allocated 256 registers at a time
        fit = _COOP_FIT[key] = min(
            per_sm, _REGS_PER_SM // regs_per_warp // warps, _THREADS_PER_SM // (32 * warps), _BLOCKS_PER_SM,
            props.shared_memory_per_multiprocessor // max(k.metadata.shared + 1024, 1))
    if fit * props.multi_processor_count < S:
        raise RuntimeError(f"variant='cooperative': the {S} programs of a token cannot be resident at once "
                           f"({fit} an SM fit): use a larger block_d")
    return max(1, min(T, fit * props.multi_processor_count // S))


def _coop_run(kernel, n_groups: int, args, device, **kw):
    """Launch a cooperative kernel over n_groups groups of kw["S"] programs: one launch with the exchange on a GPU;
    under the interpreter, which runs the programs one after another, a publishing launch and then a mixing one
    (PHASE 1, 2) over the same buffers."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        for phase in (1, 2):
            kernel[(n_groups * kw["S"],)](*args, torch.empty(1, device=device, dtype=torch.int32), **kw, PHASE=phase,
                enable_fp_fusion=True)
    else:
        kernel[(n_groups * kw["S"],)](*args, torch.zeros(kw["T"], device=device, dtype=torch.int32), **kw, PHASE=0,
            enable_fp_fusion=True)


_SHARED_BUDGET = 200 * 1024  # of the H200's 227 KB a block may use, leaving room for the reductions' scratch


def _resident_stages(stages: int, rows: int, block_d: int, itemsize: int) -> int:
    """`stages` lowered until its pipeline buffers (one `[rows, block_d]` tile a stage) fit shared memory."""
    return max(1, min(stages, _SHARED_BUDGET // (rows * block_d * itemsize)))


def _resident_launch(N: int, D: int, num_warps, prefetch, stages, extra_rows: int, itemsize: int):
    """(NA, NB, BLOCK_D, num_warps, prefetch, stages) of a resident kernel whose token tile has `extra_rows` rows
    beside the candidates' (the backward's dout row)."""
    NA, NB, BLOCK_D, warps = _resident_cfg(N, D, num_warps)
    prefetch, stages = _resident_schedule(NA + NB, prefetch, stages)
    return NA, NB, BLOCK_D, warps, prefetch, _resident_stages(stages, NA + NB + extra_rows, BLOCK_D, itemsize)


class _AttnResFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v, query_weight, norm_weight, eps, cfg):
        (variant, block_t, block_d, num_warps, split, per_sm, chunk, res_per_sm, prefetch, stages, coop_per_sm,
         stream_per_sm, stream_stages) = cfg
        N, D = v.shape[0], v.shape[-1]
        lead = v.shape[1:-1]
        v3 = v.reshape(N, -1, D).contiguous()  # [N, T, D], T = all leading token dims
        T = v3.shape[1]
        w = (norm_weight.reshape(D).float() * query_weight.reshape(D).float()).contiguous()
        out = torch.empty((T, D), device=v.device, dtype=v.dtype)
        alpha = torch.empty((N, T), device=v.device, dtype=torch.float32)
        grad = any(ctx.needs_input_grad[:3])
        ctx.lead, ctx.eps, ctx.cfg = lead, eps, cfg
        if variant in ("tiled", "resident", "cooperative", "stream"):
            # r_i and p_i per (candidate, token): backward then needs only <dout, v_i> from its first sweep.
            rs = torch.empty((N, T), device=v.device, dtype=torch.float32) if grad else alpha
            ps = torch.empty((N, T), device=v.device, dtype=torch.float32) if grad else alpha
            if T > 0 and variant == "cooperative":
                NA, NB, BLOCK_D, S, warps = _coop_cfg(N, D, block_d, num_warps)
                part = torch.empty(T * 2 * S * (NA + NB), device=v.device, dtype=torch.float32)  # [T, 2, S, NA + NB]
                args = (v3, w, out, alpha, rs, ps, part)
                kw = dict(T=T, D=D, eps=eps, S=S, N=N, NA=NA, NB=NB, SP=triton.next_power_of_2(S), SAVE_STATS=grad,
                          BLOCK_D=BLOCK_D, num_warps=warps)
                G = _coop_groups(_attnres_fwd_coop, args, kw, coop_per_sm, v.device)
                _coop_run(_attnres_fwd_coop, G, args, v.device, **kw)
            elif T > 0 and variant == "stream":
                BLOCK_D, warps = _launch_cfg(D, num_warps)
                tpp = triton.cdiv(T, stream_per_sm * _sm_count(v.device))  # tokens a program
                _attnres_fwd_stream[(triton.cdiv(T, tpp),)](
                    v3, w, out, alpha, rs, ps, T, D, eps, tpp, N=N, NP=triton.next_power_of_2(N), SAVE_STATS=grad,
                    BLOCK_D=BLOCK_D, STAGES=stream_stages, num_warps=warps, num_stages=stream_stages,
                    enable_fp_fusion=True,
                )
            elif T > 0 and variant == "resident":
                NA, NB, BLOCK_D, warps, prefetch, st = _resident_launch(N, D, num_warps, prefetch, stages, 0,
                                                                        v3.element_size())
                _attnres_fwd_resident[(min(T, res_per_sm * _sm_count(v.device)),)](
                    v3, w, out, alpha, rs, ps, T, D, eps, N=N, NA=NA, NB=NB, SAVE_STATS=grad, BLOCK_D=BLOCK_D,
                    PREFETCH=prefetch, STAGES=st, num_warps=warps, num_stages=st, enable_fp_fusion=True,
                )
            elif T > 0:
                BLOCK_T, NP, BLOCK_D, warps = _tiled_cfg(N, D, block_t, block_d, num_warps, grad)
                n_prog, nb = _tiled_grid(triton.cdiv(T, BLOCK_T), 1, per_sm, v.device)
                _attnres_fwd_tiled[(n_prog,)](
                    v3, w, out, alpha, rs, ps, T, D, eps, nb, N=N, NP=NP, SAVE_STATS=grad, SPLIT=split,
                    BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, CHUNK=min(BLOCK_D, chunk), num_warps=warps, enable_fp_fusion=True,
                )
            ctx.save_for_backward(v3, w, alpha, rs, ps, query_weight, norm_weight)
            return out.view(*lead, D)
        out_f32 = out if v.dtype == torch.float32 or not grad else torch.empty(out.shape, device=v.device)
        BLOCK_D, warps = _launch_cfg(D, num_warps)
        if T > 0:
            _attnres_fwd[(T,)](
                v3, w, out, out_f32, alpha, T, D, eps, N=N, SAVE_F32=out_f32 is not out, BLOCK_D=BLOCK_D,
                num_warps=warps, enable_fp_fusion=True,
            )
        ctx.save_for_backward(v3, w, out_f32, alpha, query_weight, norm_weight)
        return out.view(*lead, D)

    @staticmethod
    def backward(ctx, dout):
        variant, block_t, block_d, num_warps, split, per_sm, chunk, res_per_sm, prefetch, stages, coop_per_sm, *_ = (
            ctx.cfg)
        if variant in ("tiled", "resident", "cooperative", "stream"):
            v3, w, alpha, rs, ps, query_weight, norm_weight = ctx.saved_tensors
        else:
            v3, w, out, alpha, query_weight, norm_weight = ctx.saved_tensors
        N, T, D = v3.shape
        if variant == "stream":  # the forward saved what the resident and cooperative backwards read
            variant, num_warps = _backward_variant(N, D), None
        do = dout.reshape(T, D).contiguous()
        dv = torch.empty_like(v3)
        if variant == "cooperative":
            NA, NB, BLOCK_D, S, warps = _coop_cfg(N, D, block_d, num_warps, backward=True)
            part = torch.empty(T * S * (NA + NB), device=v3.device, dtype=torch.float32)  # [T, 1, S, NA + NB]
            kw = dict(T=T, D=D, S=S, N=N, NA=NA, NB=NB, SP=triton.next_power_of_2(S), BLOCK_D=BLOCK_D,
                      num_warps=warps)
            dw_probe = torch.empty(1, device=v3.device, dtype=torch.float32)
            n_prog = _coop_groups(_attnres_bwd_coop, (v3, w, do, alpha, rs, ps, dv, dw_probe, part), kw, coop_per_sm,
                                  v3.device)  # dw: one partial row per group
        elif variant == "resident":
            NA, NB, BLOCK_D, warps, prefetch, st = _resident_launch(N, D, num_warps, prefetch, stages, 1,
                                                                    v3.element_size())  # + the dout row
            n_prog = min(T, res_per_sm * _sm_count(v3.device))
        elif variant == "tiled":
            BLOCK_T, NP, BLOCK_D, warps = _tiled_cfg(N, D, block_t, block_d, num_warps, grad=True)
            # ~16 tokens per program at least, as the row design: fewer dw partial rows
            n_prog, nb = _tiled_grid(triton.cdiv(T, BLOCK_T), max(1, _BWD_ROWS // BLOCK_T), per_sm, v3.device)
        else:
            n_prog = triton.cdiv(T, _BWD_ROWS)
        dw_part = torch.empty((max(n_prog, 1), D), device=v3.device, dtype=torch.float32)
        if T == 0:
            dw_part.zero_()
        elif variant == "cooperative":
            _coop_run(_attnres_bwd_coop, n_prog, (v3, w, do, alpha, rs, ps, dv, dw_part, part), v3.device, **kw)
        elif variant == "resident":
            _attnres_bwd_resident[(n_prog,)](
                v3, w, do, alpha, rs, ps, dv, dw_part, T, D, N=N, NA=NA, NB=NB, BLOCK_D=BLOCK_D, PREFETCH=prefetch,
                STAGES=st, num_warps=warps, num_stages=st, enable_fp_fusion=True,
            )
        elif variant == "tiled":
            # [2, N, T] per-candidate coefficients of the split pass 2 (unused by "tile")
            scratch = torch.empty((2, N, T) if split else (1,), device=v3.device, dtype=torch.float32)
            _attnres_bwd_tiled[(n_prog,)](
                v3, w, do, alpha, rs, ps, scratch, dv, dw_part, T, D, nb, N=N, NP=NP, SPLIT=split,
                BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, CHUNK=min(BLOCK_D, chunk), num_warps=warps, enable_fp_fusion=True,
            )
        else:
            BLOCK_D, warps = _launch_cfg(D, num_warps)
            _attnres_bwd[(n_prog,)](
                v3, w, out, do, alpha, dv, dw_part, T, D, ctx.eps, N=N, ROWS=_BWD_ROWS, BLOCK_D=BLOCK_D,
                num_warps=warps, enable_fp_fusion=True,
            )
        dw = dw_part.sum(0)  # [D]
        dq = (dw * norm_weight.reshape(D).float()).reshape(query_weight.shape).to(query_weight.dtype)
        dn = (dw * query_weight.reshape(D).float()).reshape(norm_weight.shape).to(norm_weight.dtype)
        return dv.view(N, *ctx.lead, D), dq, dn, None, None


def attn_res_triton(
    candidates,
    query_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float = 1e-5,
    *,
    variant: str | None = None,
    block_t: int | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
):
    """Drop-in for `reference.attn_res` on CUDA (or under `TRITON_INTERPRET=1`): list or stacked `[N, ..., d]`.

    `variant`: "row", "tiled", "resident", "cooperative", "stream" (see the module docstring) or "auto" (the
    faster for this call as measured, see `DEFAULT_VARIANT`; "tiled" when `block_t` or `block_d` is given), None =
    `DEFAULT_VARIANT`. `block_t` (tokens per program, 1..16, "tiled" only) and `block_d` (d-slice width, 16..16384,
    "tiled" and "cooperative"), powers of two; `num_warps` (power of two, 1..32) to all (for "stream", to its
    forward: its backward is the resident or cooperative one at that design's default). None picks the defaults.
    """
    variant = DEFAULT_VARIANT if variant is None else variant
    if variant not in VARIANTS + ("auto",):
        raise ValueError(f"variant must be one of {VARIANTS + ('auto',)}, got {variant!r}")
    if block_t is not None:
        _check_pow2("block_t", block_t, 1, 16)
    if block_d is not None:
        _check_pow2("block_d", block_d, 16, 16384)
    if num_warps is not None:
        _check_pow2("num_warps", num_warps, 1, 32)
    v = candidates if isinstance(candidates, torch.Tensor) else torch.stack(list(candidates), dim=0)
    if v.dim() < 2:
        raise ValueError(f"stacked candidates must be [N, ..., d], got {tuple(v.shape)}")
    d = v.shape[-1]
    if query_weight.numel() != d or norm_weight.numel() != d:
        raise ValueError(
            f"query_weight {tuple(query_weight.shape)} and norm_weight {tuple(norm_weight.shape)} must have {d} elements"
        )
    if not 1 <= v.shape[0] <= 16:
        raise ValueError(f"attn_res_triton supports 1 to at most 16 depth candidates, got {v.shape[0]}")
    if variant == "auto":
        # slice sizes asked for: "tiled"
        variant = "tiled" if block_t is not None or block_d is not None else _auto_variant(v.shape[0], d)
    if variant in ("row", "resident", "stream") and (block_t is not None or block_d is not None):
        raise ValueError(f"block_t and block_d apply only to variant='tiled' (the {variant} design keeps whole rows)")
    if variant == "cooperative" and block_t is not None:
        raise ValueError("block_t applies only to variant='tiled' (the cooperative design takes one token at a time)")
    if variant == "tiled":
        _tiled_cfg(v.shape[0], d, block_t, block_d, num_warps)  # tile-size errors before any launch
    if variant == "resident":
        _resident_cfg(v.shape[0], d, num_warps)
    res_per_sm = RESIDENT_PROGRAMS_PER_SM
    for name, value, none_ok in (("RESIDENT_PROGRAMS_PER_SM", res_per_sm, False),
                                 ("RESIDENT_STAGES", RESIDENT_STAGES, True),
                                 ("COOP_PROGRAMS_PER_SM", COOP_PROGRAMS_PER_SM, False),
                                 ("STREAM_PROGRAMS_PER_SM", STREAM_PROGRAMS_PER_SM, False),
                                 ("STREAM_STAGES", STREAM_STAGES, False)):
        if not ((none_ok and value is None) or (isinstance(value, int) and not isinstance(value, bool) and value > 0)):
            raise ValueError(f"{name} must be a positive int{' or None' if none_ok else ''}, got {value!r}")
    if TILED_PASS2 not in ("split", "tile"):
        raise ValueError(f"TILED_PASS2 must be 'split' or 'tile', got {TILED_PASS2!r}")
    per_sm = TILED_PROGRAMS_PER_SM
    if per_sm is not None and not (isinstance(per_sm, int) and not isinstance(per_sm, bool) and per_sm > 0):
        raise ValueError(f"TILED_PROGRAMS_PER_SM must be None or a positive int, got {per_sm!r}")
    # The module settings are read once here, so the backward runs the forward's configuration.
    if variant in ("cooperative", "stream"):  # the stream design's backward may be the cooperative one
        block_d = COOP_BLOCK_D if block_d is None else block_d
        _check_pow2("COOP_BLOCK_D", block_d, 16, 16384)
    if variant == "cooperative":
        _coop_cfg(v.shape[0], d, block_d, num_warps)
    cfg = (variant, block_t, block_d, num_warps, TILED_PASS2 == "split", per_sm, _TILED_CHUNK, res_per_sm,
           RESIDENT_PREFETCH, RESIDENT_STAGES, COOP_PROGRAMS_PER_SM, STREAM_PROGRAMS_PER_SM, STREAM_STAGES)
    return _AttnResFunction.apply(v, query_weight, norm_weight, float(eps), cfg)
