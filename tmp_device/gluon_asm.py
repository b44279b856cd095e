"""Experiment: the Gluon MXFP4 decode with words loaded as int32 and a bit-placement e2m1 -> bf16 conversion in
inline PTX, and optionally the next K step's words prefetched in registers (int32 words carry at no cost).

A thread loads two int32 words (8 stored bytes, 16 nibbles) of each 32-byte block of its rows r and r + 8
(c = lane % 4 takes words 2c, 2c + 1). Output register o (0..7) of a word pair holds nibbles j and j + 4 of word
o // 4 (j = o % 4): the nibble's e1 e0 m bits land on bf16 bits 8..6 (exponent 1..0, mantissa top) and its sign on
bit 15, so the bf16 is the e2m1 value times 2^-126 (subnormal for the codes 0 and 0.5, exact); the E8M0 scale is
applied as 2^(s - 1) (bf16, exact for 1 <= s <= 128).

Operand position 16 t + 8 h + 2 c + q of a 64-input block (wgmma's register layout: lane c holds 2c, 2c+1, 2c+8,
2c+9 of each 16-wide slab t) holds register o = 2 t + h, half q: input 16 c + 8 (o // 4) + 4 q + o % 4.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from k3_kernels.moe.gluon_moe import _sigmoid, _tanh, _tile_rows, _k_step, tokens_per_tile
from k3_kernels.moe.triton_moe import _align

BM = gl.constexpr(64)

_ASM = gl.constexpr("""
{
.reg .b32 m<8>, s<8>;
shl.b32 m0, $8, 6;   shl.b32 s0, $8, 12;
shl.b32 m1, $8, 2;   shl.b32 s1, $8, 8;
shr.u32 m2, $8, 2;   shl.b32 s2, $8, 4;
shr.u32 m3, $8, 6;
shl.b32 m4, $9, 6;   shl.b32 s4, $9, 12;
shl.b32 m5, $9, 2;   shl.b32 s5, $9, 8;
shr.u32 m6, $9, 2;   shl.b32 s6, $9, 4;
shr.u32 m7, $9, 6;
and.b32 s0, s0, 0x80008000; and.b32 s1, s1, 0x80008000; and.b32 s2, s2, 0x80008000; and.b32 s3, $8, 0x80008000;
and.b32 s4, s4, 0x80008000; and.b32 s5, s5, 0x80008000; and.b32 s6, s6, 0x80008000; and.b32 s7, $9, 0x80008000;
lop3.b32 $0, m0, 0x01C001C0, s0, 0xEA; lop3.b32 $1, m1, 0x01C001C0, s1, 0xEA;
lop3.b32 $2, m2, 0x01C001C0, s2, 0xEA; lop3.b32 $3, m3, 0x01C001C0, s3, 0xEA;
lop3.b32 $4, m4, 0x01C001C0, s4, 0xEA; lop3.b32 $5, m5, 0x01C001C0, s5, 0xEA;
lop3.b32 $6, m6, 0x01C001C0, s6, 0xEA; lop3.b32 $7, m7, 0x01C001C0, s7, 0xEA;
}
""")  # lop3 0xEA = (a & b) | c


@gluon.jit
def _operand_inputs(BK: gl.constexpr, layout: gl.constexpr):
    """Input held at each operand position (module doc)."""
    P = gl.arange(0, BK, layout=layout)
    p = P % 64
    o = 2 * (p // 16) + (p // 8) % 2
    return P - p + 16 * ((p // 2) % 4) + 8 * (o // 4) + 4 * (p % 2) + o % 4


@gluon.jit
def _store_position(n):
    """Operand position of input n (the inverse of `_operand_inputs`)."""
    p = n % 64
    c = p // 16
    r = p % 16
    o = 4 * (r // 8) + r % 4
    return n - p + 16 * (o // 2) + 8 * (o % 2) + 2 * c + (r % 8) // 4


@gluon.jit
def _unpack_mma(words, sb, x_tile, acc, S: gl.constexpr, ACC: gl.constexpr):
    """words int32 `[64, S, 4, 2]` (row, block, c, word), sb uint8 `[64, S, 4]` (the scale of (row, block, c // 2))."""
    r = gl.inline_asm_elementwise(_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words], dtype=(gl.bfloat16,) * 8,
                                  is_pure=True, pack=2)
    # 2^(s - 1 - 32): the placed value's 2^-126 and the E8M0 bias folded in, and 2^-32 so that s up to 160 fits
    # bf16 (the accumulator is multiplied back by 2^32); s >= 161 (weights beyond 2^33) gives inf, not a wrong value.
    sc = gl.expand_dims(((gl.minimum(sb.to(gl.int32), 161) + 94) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True), 3)
    r0 = gl.join(r[0] * sc, r[1] * sc)  # [.., q, h]
    r1 = gl.join(r[2] * sc, r[3] * sc)
    r2 = gl.join(r[4] * sc, r[5] * sc)
    r3 = gl.join(r[6] * sc, r[7] * sc)
    w = gl.join(gl.join(r0, r1), gl.join(r2, r3))  # [64, S, c, q, h, t0, t1]
    w = gl.reshape(gl.permute(w, (0, 1, 6, 5, 4, 2, 3)), [BM, 64 * S])
    return warpgroup_mma(gl.convert_layout(w, gl.DotOperandLayout(0, ACC, 2)), x_tile.permute((1, 0)), acc)


@gluon.jit
def _weight_ptrs(W, WS, e, row0, K, S: gl.constexpr, WL: gl.constexpr):
    """int32 word pointers `[64, S, 4, 2]` and scale pointers `[64, S, 4]` of the first K step."""
    R = gl.num_programs(0) * BM
    Wi = W.to(gl.pointer_type(gl.int32))
    L3: gl.constexpr = gl.SliceLayout(3, WL)
    r = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    b = gl.arange(0, S, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    q = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, WL))))
    r3 = gl.expand_dims(gl.expand_dims(r, 1), 2)
    b3 = gl.expand_dims(gl.expand_dims(b, 0), 2)
    c3 = gl.expand_dims(gl.expand_dims(c, 0), 1)
    base = e * R * (K // 8) + r3 * (K // 8) + b3 * 8 + c3 * 2  # int32 words: K / 8 a row, 8 a block
    w_ptr = Wi + gl.expand_dims(base, 3) + gl.expand_dims(gl.expand_dims(gl.expand_dims(q, 0), 1), 2)
    s_ptr = WS + e * R * (K // 32) + r3 * (K // 32) + b3 * 2 + c3 // 2
    return w_ptr, s_ptr


@gluon.jit
def _gate_up_situ(X, W, WS, H, SORTED, BLOCK_EXPERT, num_assign, top_k, D, I, beta, linear_beta,
                  NT: gl.constexpr, S: gl.constexpr, PREFETCH: gl.constexpr, ACC: gl.constexpr, WL: gl.constexpr,
                  XL: gl.constexpr, X_SMEM: gl.constexpr):
    BK: gl.constexpr = 64 * S
    n0 = gl.program_id(0) * BM
    tile = gl.program_id(1)
    e = gl.load(BLOCK_EXPERT + tile)
    if e >= 0:
        e64 = e.to(gl.int64)
        wg_ptr, sg_ptr = _weight_ptrs(W, WS, e64 * 2, n0, D, S, WL)
        wu_ptr, su_ptr = _weight_ptrs(W, WS, e64 * 2 + 1, n0, D, S, WL)
        assign, valid, token = _tile_rows(SORTED, tile, num_assign, top_k, NT, gl.SliceLayout(1, XL))
        x_ptr = X + token[:, None] * D + _operand_inputs(BK, gl.SliceLayout(0, XL))[None, :]
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [NT, BK], X_SMEM)
        acc_g = gl.zeros([BM, NT], gl.float32, ACC)
        acc_u = gl.zeros([BM, NT], gl.float32, ACC)
        if PREFETCH:
            wg = gl.load(wg_ptr)
            wu = gl.load(wu_ptr)
            sg = gl.load(sg_ptr)
            su = gl.load(su_ptr)
            xs = gl.load(x_ptr, mask=valid[:, None], other=0.0)
            for k0 in range(0, D, BK):
                kn = gl.minimum(k0 + BK, D - BK)
                wg_n = gl.load(wg_ptr + kn // 8)
                wu_n = gl.load(wu_ptr + kn // 8)
                sg_n = gl.load(sg_ptr + kn // 32)
                su_n = gl.load(su_ptr + kn // 32)
                xs_n = gl.load(x_ptr + kn, mask=valid[:, None], other=0.0)
                x_smem.store(xs)
                fence_async_shared()
                acc_g = _unpack_mma(wg, sg, x_smem, acc_g, S, ACC)
                acc_u = _unpack_mma(wu, su, x_smem, acc_u, S, ACC)
                wg, wu, sg, su, xs = wg_n, wu_n, sg_n, su_n, xs_n
        else:
            for k0 in range(0, D, BK):
                x_smem.store(gl.load(x_ptr + k0, mask=valid[:, None], other=0.0))
                fence_async_shared()
                acc_g = _unpack_mma(gl.load(wg_ptr + k0 // 8), gl.load(sg_ptr + k0 // 32), x_smem, acc_g, S, ACC)
                acc_u = _unpack_mma(gl.load(wu_ptr + k0 // 8), gl.load(su_ptr + k0 // 32), x_smem, acc_u, S, ACC)
        acc_g = acc_g * 4294967296.0  # 2^32, see _unpack_mma
        acc_u = acc_u * 4294967296.0
        h = beta * _tanh(acc_g / beta) * _sigmoid(acc_g) * (linear_beta * _tanh(acc_u / linear_beta))
        n = n0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
        rows = (tile * NT + gl.arange(0, NT, layout=gl.SliceLayout(0, ACC))).to(gl.int64)
        gl.store(H + rows[None, :] * I + _store_position(n)[:, None], h.to(gl.bfloat16))


@gluon.jit
def _down(H, W, WS, OUT, TOPW, SORTED, BLOCK_EXPERT, num_assign, top_k, D, I,
          NT: gl.constexpr, S: gl.constexpr, PREFETCH: gl.constexpr, ACC: gl.constexpr, WL: gl.constexpr,
          XL: gl.constexpr, X_SMEM: gl.constexpr):
    BK: gl.constexpr = 64 * S
    d0 = gl.program_id(0) * BM
    tile = gl.program_id(1)
    e = gl.load(BLOCK_EXPERT + tile)
    if e >= 0:
        w_ptr, s_ptr = _weight_ptrs(W, WS, e.to(gl.int64), d0, I, S, WL)
        rows = (tile * NT + gl.arange(0, NT, layout=gl.SliceLayout(1, XL))).to(gl.int64)
        h_ptr = H + rows[:, None] * I + gl.arange(0, BK, layout=gl.SliceLayout(0, XL))[None, :]
        h_smem = gl.allocate_shared_memory(gl.bfloat16, [NT, BK], X_SMEM)
        acc = gl.zeros([BM, NT], gl.float32, ACC)
        if PREFETCH:
            w = gl.load(w_ptr)
            sb = gl.load(s_ptr)
            hs = gl.load(h_ptr)
            for k0 in range(0, I, BK):
                kn = gl.minimum(k0 + BK, I - BK)
                w_n = gl.load(w_ptr + kn // 8)
                sb_n = gl.load(s_ptr + kn // 32)
                hs_n = gl.load(h_ptr + kn)
                h_smem.store(hs)
                fence_async_shared()
                acc = _unpack_mma(w, sb, h_smem, acc, S, ACC)
                w, sb, hs = w_n, sb_n, hs_n
        else:
            for k0 in range(0, I, BK):
                h_smem.store(gl.load(h_ptr + k0))
                fence_async_shared()
                acc = _unpack_mma(gl.load(w_ptr + k0 // 8), gl.load(s_ptr + k0 // 32), h_smem, acc, S, ACC)
        assign, valid, token = _tile_rows(SORTED, tile, num_assign, top_k, NT, gl.SliceLayout(0, ACC))
        wt = gl.load(TOPW + assign, mask=valid, other=0.0) * 4294967296.0  # 2^32, see _unpack_mma
        d = d0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
        gl.atomic_add(OUT + token[None, :] * D + d[:, None], acc * wt[None, :], mask=valid[None, :])


def _constexprs(nt: int, s: int, prefetch: bool) -> dict:
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, nt, 16])
    # [64 rows, S blocks, 4 (c), 2 words]: a thread holds words 2c, 2c + 1 of each block of rows r and r + 8.
    steps = [[0, 1 << j, 0, 0] for j in range(s.bit_length() - 1)]
    wl = gl.DistributedLinearLayout(reg_bases=[[0, 0, 0, 1], [8, 0, 0, 0]] + steps,
                                    lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
                                    warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[64, s, 4, 2])
    cols = min(32, 8 * s)
    return dict(NT=nt, S=s, PREFETCH=prefetch, ACC=acc, WL=wl,
                XL=gl.BlockedLayout([1, 8], [32 // cols, cols], [4, 1], [1, 0]),
                X_SMEM=gl.NVMMASharedLayout.get_default_for([nt, 64 * s], gl.bfloat16))


def moe_experts_gluon_asm(x, top_idx, top_w, w13_packed, w13_scale, w2_packed, w2_scale, *, beta=4.0,
                          linear_beta=25.0, token_slots=None, s=None, prefetch=False):
    E, two_i, D = w13_packed.shape[0], w13_packed.shape[1], 2 * w13_packed.shape[2]
    I = two_i // 2
    N, k = top_idx.shape
    nt = token_slots or tokens_per_tile(N * k, E)
    sorted_ids, block_expert, tiles, _, _ = _align(top_idx, E, nt)
    hbuf = torch.empty((tiles * nt, I), device=x.device, dtype=torch.bfloat16)
    out = torch.zeros((N, D), device=x.device, dtype=torch.float32)
    xb = x.to(torch.bfloat16).contiguous()
    s1, s2 = s or _k_step(D), s or _k_step(I)
    _gate_up_situ[(I // 64, tiles)](xb, w13_packed, w13_scale, hbuf, sorted_ids, block_expert, N * k, k, D, I,
                                    beta, linear_beta, **_constexprs(nt, s1, prefetch), num_warps=4)
    _down[(D // 64, tiles)](hbuf, w2_packed, w2_scale, out, top_w.reshape(-1).float().contiguous(), sorted_ids,
                            block_expert, N * k, k, D, I, **_constexprs(nt, s2, prefetch), num_warps=4)
    return out.to(x.dtype)
