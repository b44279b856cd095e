"""MXFP4 (W4A16) decode of the routed experts in Gluon, for Hopper: the weights as the wide side of the product.

At decode an expert gets a handful of tokens, so every weight is unpacked for a few rows and the unpack, not the
memory, sets the time of the Triton kernels (`triton_moe`, `tl.dot_scaled`: 6.5-7.3 SASS instructions a weight,
BENCHMARKS.md, thirteenth session). Gluon (`triton.experimental.gluon`, shipped with triton) lets the kernel pick
the operands' roles and register layouts that `tl.dot` chooses itself:

- The weights are wgmma's left operand, 64 rows a warpgroup, taken from registers; the expert's tokens (at most
  NT = 8, 16 or 32 of them, zero-padded) are the right operand, from shared memory. Nothing is padded to 64 rows.
- The packed bytes are loaded straight into the left operand's register layout: a thread loads 8 consecutive bytes
  of each 32-byte block of its two rows (one 8-byte load), and `gl.fp4_to_fp` turns them into bf16 in place.
- Those bytes are not the ones wgmma's layout assigns to the thread (it wants bytes c + 4 i, i = 0..7, of a block,
  c = lane % 4), so the operand's K order is a permutation of the inputs: position 2 (4 i + c) + h of each 64-input
  block holds input 2 (8 c + i) + h. A dot product does not care about the order of its terms, so the token side is
  loaded in the same permuted order (`_operand_inputs`) and the released layout is used as it is: no repacked copy
  of 2.8T weights, and `save_pretrained` has nothing to undo.
- A thread's 8 bytes of a block lie in one 32-input scale block (c // 2), applied as bf16 multiplies (exact: powers
  of two).

About 4.5 SASS instructions a weight in the K loop (triton 3.6, sm_90a, K3 widths). On an H100, the uniform probe
(`benchmarks/gluon_probe.py --w4a16`) ran the gate_up and down products 2.4-2.7x faster than bf16
`torch._grouped_mm` on the same experts.

Two kernels, the structure of `triton_moe` (whose `_align` sorts the assignments into expert tiles of NT rows):
`_gate_up_situ` writes `h = SiTU-GLU(gate, up)` for 64 intermediate columns of a tile's tokens, stored in the
operand order `_down` reads; `_down` multiplies by the routing weight and adds into `out[token]` with fp32 atomics.
Gluon kernels do not run under `TRITON_INTERPRET`, so they are tested on the GPU (`tests/kernels/test_moe_gluon.py`)
against the torch reference; CPU runs use the Triton or torch paths.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from k3_kernels.moe.triton_moe import _align

__all__ = ["gluon_decode_available", "moe_experts_gluon", "tokens_per_tile"]

BM = gl.constexpr(64)  # weight rows a program: one warpgroup's wgmma M


@gluon.jit
def _sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def _tanh(x):
    return 2.0 * _sigmoid(2.0 * x) - 1.0  # saturates cleanly to +-1 for large |x|


@gluon.jit
def _operand_inputs(BK: gl.constexpr, layout: gl.constexpr):
    """The input index held at each of the BK operand positions of a K step (see the module doc):
    position 64 b + 2 (4 i + c) + h holds input 64 b + 2 (8 c + i) + h."""
    kop = gl.arange(0, BK, layout=layout)
    j = (kop % 64) // 2
    return kop - kop % 64 + 2 * (8 * (j % 4) + j // 4) + kop % 2


@gluon.jit
def _unpack_mma(phys, sb, x_tile, acc, S: gl.constexpr, ACC: gl.constexpr):
    """One K step of S 64-input blocks: `phys` [64, 32 S] packed bytes as stored, `sb` [64, 2 S] E8M0 scales, the
    token tile [NT, 64 S] (operand order) in shared memory; returns acc + W x^T, `[64, NT]` fp32."""
    # A thread's 8 bytes of a block, read as the operand's bytes 4 i + c: a change of view, no data moves.
    wp = gl.reshape(gl.permute(gl.reshape(phys, [BM, S, 4, 8]), (0, 1, 3, 2)), [BM, 32 * S])
    w = gl.fp4_to_fp(gl.convert_layout(wp, gl.DotOperandLayout(0, ACC, 1)), gl.bfloat16, axis=1)  # [64, 64 S]
    sc = (sb.to(gl.int16) << 7).to(gl.bfloat16, bitcast=True)  # 2 ** (byte - 127), exact in bf16 for byte >= 1
    w6 = gl.reshape(w, [BM, S, 8, 2, 2, 2])  # (row, block, i, c // 2, c % 2, nibble): scale block c // 2
    L6: gl.constexpr = w6.type.layout
    sc6 = gl.convert_layout(gl.reshape(sc, [BM, S, 2]), gl.SliceLayout(2, gl.SliceLayout(4, gl.SliceLayout(5, L6))))
    sc6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(sc6, 2), 4), 5)
    w = gl.reshape(w6 * sc6, [BM, 64 * S])
    return warpgroup_mma(gl.convert_layout(w, gl.DotOperandLayout(0, ACC, 2)), x_tile.permute((1, 0)), acc)


@gluon.jit
def _weight_ptrs(W, WS, e, row0, K, S: gl.constexpr, PL: gl.constexpr):
    """Pointers to the first K step of 64 weight rows from row0 of expert e (packed `[E, R, K / 2]`, scales
    `[E, R, K / 32]`, R = num_programs(0) * 64 rows, hoisted: each K step only adds a scalar)."""
    R = gl.num_programs(0) * BM
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, PL))
    p = gl.arange(0, 32 * S, layout=gl.SliceLayout(0, PL))
    blocks = gl.arange(0, 2 * S, layout=gl.SliceLayout(0, PL))
    w_ptr = W + e * R * (K // 2) + rows[:, None] * (K // 2) + p[None, :]
    s_ptr = WS + e * R * (K // 32) + rows[:, None] * (K // 32) + blocks[None, :]
    return w_ptr, s_ptr


@gluon.jit
def _tile_rows(SORTED, tile, num_assign, top_k, NT: gl.constexpr, layout: gl.constexpr):
    """A tile's NT assignment ids, which are real, and their tokens."""
    assign = gl.load(SORTED + tile * NT + gl.arange(0, NT, layout=layout))
    valid = assign < num_assign
    return assign, valid, (assign // top_k).to(gl.int64)


@gluon.jit
def _gate_up_situ(X, W, WS, H, SORTED, BLOCK_EXPERT, num_assign, top_k, D, I, beta, linear_beta,
                  NT: gl.constexpr, S: gl.constexpr, ACC: gl.constexpr, PL: gl.constexpr, XL: gl.constexpr,
                  X_SMEM: gl.constexpr):
    """h[tile rows, 64 columns] = SiTU-GLU(x W_gate^T, x W_up^T); grid (I / 64, tiles). W `[E, 2I, D / 2]` (gate
    rows first, then up). h is stored in the operand order of `_down`'s K steps."""
    BK: gl.constexpr = 64 * S
    n0 = gl.program_id(0) * BM
    tile = gl.program_id(1)
    e = gl.load(BLOCK_EXPERT + tile)
    if e >= 0:  # spare tiles of `_align`'s bound have no expert
        e64 = e.to(gl.int64)
        wg_ptr, sg_ptr = _weight_ptrs(W, WS, e64 * 2, n0, D, S, PL)  # expert e's 2I rows: 2 e "experts" of I
        wu_ptr, su_ptr = _weight_ptrs(W, WS, e64 * 2 + 1, n0, D, S, PL)
        assign, valid, token = _tile_rows(SORTED, tile, num_assign, top_k, NT, gl.SliceLayout(1, XL))
        x_ptr = X + token[:, None] * D + _operand_inputs(BK, gl.SliceLayout(0, XL))[None, :]
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [NT, BK], X_SMEM)
        acc_g = gl.zeros([BM, NT], gl.float32, ACC)
        acc_u = gl.zeros([BM, NT], gl.float32, ACC)
        for k0 in range(0, D, BK):
            x_smem.store(gl.load(x_ptr + k0, mask=valid[:, None], other=0.0))
            fence_async_shared()
            acc_g = _unpack_mma(gl.load(wg_ptr + k0 // 2), gl.load(sg_ptr + k0 // 32), x_smem, acc_g, S, ACC)
            acc_u = _unpack_mma(gl.load(wu_ptr + k0 // 2), gl.load(su_ptr + k0 // 32), x_smem, acc_u, S, ACC)
        h = beta * _tanh(acc_g / beta) * _sigmoid(acc_g) * (linear_beta * _tanh(acc_u / linear_beta))
        # Column n of h goes where `_down` reads input n: operand position 64 b + 2 (4 i + c) + nib for
        # n = 64 b + 2 (8 c + i) + nib.
        n = n0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
        m = (n % 64) // 2
        q = n - n % 64 + 2 * (4 * (m % 8) + m // 8) + n % 2
        rows = (tile * NT + gl.arange(0, NT, layout=gl.SliceLayout(0, ACC))).to(gl.int64)
        gl.store(H + rows[None, :] * I + q[:, None], h.to(gl.bfloat16))


@gluon.jit
def _down(H, W, WS, OUT, TOPW, SORTED, BLOCK_EXPERT, num_assign, top_k, D, I,
          NT: gl.constexpr, S: gl.constexpr, ACC: gl.constexpr, PL: gl.constexpr, XL: gl.constexpr,
          X_SMEM: gl.constexpr):
    """out[token, 64 columns] += routing weight * (h W_down^T); grid (D / 64, tiles). W `[E, D, I / 2]`."""
    BK: gl.constexpr = 64 * S
    d0 = gl.program_id(0) * BM
    tile = gl.program_id(1)
    e = gl.load(BLOCK_EXPERT + tile)
    if e >= 0:
        w_ptr, s_ptr = _weight_ptrs(W, WS, e.to(gl.int64), d0, I, S, PL)
        rows = (tile * NT + gl.arange(0, NT, layout=gl.SliceLayout(1, XL))).to(gl.int64)
        h_ptr = H + rows[:, None] * I + gl.arange(0, BK, layout=gl.SliceLayout(0, XL))[None, :]
        h_smem = gl.allocate_shared_memory(gl.bfloat16, [NT, BK], X_SMEM)
        acc = gl.zeros([BM, NT], gl.float32, ACC)
        for k0 in range(0, I, BK):
            h_smem.store(gl.load(h_ptr + k0))  # pad rows of a tile hold finite values and get no output
            fence_async_shared()
            acc = _unpack_mma(gl.load(w_ptr + k0 // 2), gl.load(s_ptr + k0 // 32), h_smem, acc, S, ACC)
        assign, valid, token = _tile_rows(SORTED, tile, num_assign, top_k, NT, gl.SliceLayout(0, ACC))
        wt = gl.load(TOPW + assign, mask=valid, other=0.0)
        d = d0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
        gl.atomic_add(OUT + token[None, :] * D + d[:, None], acc * wt[None, :], mask=valid[None, :])


def _constexprs(nt: int, s: int) -> dict:
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, nt, 16])
    # [64 rows, 32 S bytes] as stored: a thread holds bytes 32 s + 8 c + i (i = 0..7, contiguous) of rows r and
    # r + 8, c = lane % 4, r = 16 warp + lane / 4: the rows and K pairs of wgmma's register operand.
    steps = [[0, 32 << j] for j in range(s.bit_length() - 1)]
    pl = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]] + steps,
                                    lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BM, 32 * s])
    cols = min(32, 8 * s)  # threads along K of the token tile, 8 inputs each
    return dict(NT=nt, S=s, ACC=acc, PL=pl, XL=gl.BlockedLayout([1, 8], [32 // cols, cols], [4, 1], [1, 0]),
                X_SMEM=gl.NVMMASharedLayout.get_default_for([nt, 64 * s], gl.bfloat16))


def gluon_decode_available(device: torch.device) -> bool:
    """Gluon kernels need a real CUDA device of compute capability 9.x (Hopper: wgmma)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def tokens_per_tile(assignments: int, num_experts: int) -> int:
    """NT, the token slots of a tile: the wgmma N of the products. An expert with more assignments takes more tiles,
    each re-reading its weights, so NT grows with the average load; the unpack cost does not depend on NT."""
    avg = assignments / num_experts
    return 8 if avg <= 4 else 16 if avg <= 12 else 32


def _k_step(k: int) -> int:
    """S, the 64-input blocks a K step: 4 where it divides the width (the H100 probe's best), else 2 or 1."""
    for s in (4, 2, 1):
        if k % (64 * s) == 0:
            return s
    raise ValueError(f"moe_experts_gluon: the latent and expert widths must be multiples of 64, got {k}")


def moe_experts_gluon(x, top_idx, top_w, w13_packed, w13_scale, w2_packed, w2_scale, *, beta: float = 4.0,
                      linear_beta: float = 25.0, token_slots: int | None = None):
    """x `[N, D]` -> `[N, D]` on MXFP4 experts in the released layout (see `triton_moe.moe_experts_triton`), for
    decode-sized batches; Hopper only (`gluon_decode_available`). `token_slots` overrides NT (8, 16 or 32)."""
    E, two_i, D = w13_packed.shape[0], w13_packed.shape[1], 2 * w13_packed.shape[2]
    I = two_i // 2
    if not gluon_decode_available(x.device):
        raise RuntimeError(f"moe_experts_gluon needs a compute capability 9.x CUDA device, got {x.device}")
    if D % 64 or I % 64:
        raise ValueError(f"moe_experts_gluon: the latent and expert widths must be multiples of 64, got {D} and {I}")
    N, k = top_idx.shape
    nt = token_slots or tokens_per_tile(N * k, E)
    if nt not in (8, 16, 32):
        raise ValueError(f"moe_experts_gluon: token_slots must be 8, 16 or 32, got {nt}")
    if N == 0:
        return torch.zeros((0, D), device=x.device, dtype=x.dtype)
    sorted_ids, block_expert, tiles, _, _ = _align(top_idx, E, nt)
    hbuf = torch.empty((tiles * nt, I), device=x.device, dtype=torch.bfloat16)
    out = torch.zeros((N, D), device=x.device, dtype=torch.float32)
    xb = x.to(torch.bfloat16).contiguous()
    s1, s2 = _k_step(D), _k_step(I)
    _gate_up_situ[(I // BM, tiles)](xb, w13_packed, w13_scale, hbuf, sorted_ids, block_expert, N * k, k, D, I,
                                    beta, linear_beta, **_constexprs(nt, s1), num_warps=4)
    _down[(D // BM, tiles)](hbuf, w2_packed, w2_scale, out, top_w.reshape(-1).float().contiguous(), sorted_ids,
                            block_expert, N * k, k, D, I, **_constexprs(nt, s2), num_warps=4)
    return out.to(x.dtype)
