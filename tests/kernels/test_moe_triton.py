"""Triton routed experts (bf16 and MXFP4-packed) against the torch reference; MXFP4 unpacking against hand-built
weights. Runs under `TRITON_INTERPRET=1` on the CPU (set in conftest) and compiled on CUDA.

Tolerance rule: the kernel multiplies in bf16 with fp32 accumulation, so outputs are compared with the fp32
reference on the same (bf16-representable) inputs at rel_err <= 1e-2.
"""

import pytest
import torch

from helpers import rel_err
from k3_kernels.mxfp4.reference import dequantize_mxfp4, quantize_mxfp4
from k3_kernels.moe.reference import moe_experts, moe_experts_mxfp4

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from k3_kernels.moe.triton_moe import (  # noqa: E402
    _DECODE_MAX_ROWS, _align, _fp4_dot, _is_decode, _launch_row_tiles, moe_experts_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _triton_kernels_only(monkeypatch):
    """MXFP4 decode defaults to the Gluon kernels on Hopper (`tests/kernels/test_moe_gluon.py`); here the Triton
    kernels are under test, on every device."""
    monkeypatch.setattr("k3_kernels.moe.triton_moe._GLUON_MIN_ASSIGNMENTS", float("inf"))


@triton.jit
def _tile(W, S, OUT, e, N_ROWS, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Expert e's weights read back through the kernel's own MXFP4 product (`_fp4_dot`) with an identity on the left:
    `I @ W_tile^T` is the dequantised tile (1 * w is exact and the zeros add nothing), stored as OUT[n, k] (fp32)."""
    n = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    eye = tl.where(k[:, None] == k[None, :], 1.0, 0.0).to(tl.bfloat16)  # [BLOCK_K, BLOCK_K]
    for k0 in range(0, K, BLOCK_K):
        w_t = _fp4_dot(eye, W, S, e, n, k0, N_ROWS, K, tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32), BLOCK_K)
        tl.store(OUT + n[None, :] * K + k0 + k[:, None], w_t, mask=n[None, :] < N_ROWS)


def _routing(N, E, k, g):
    scores = torch.rand(N, E, generator=g)
    scores[:, 0] += 0.5  # a hot expert: its run spans several row tiles
    top_w, top_idx = scores.topk(k, dim=-1)
    return top_idx.to(DEVICE), (top_w / top_w.sum(-1, keepdim=True)).to(DEVICE)


@pytest.mark.parametrize("N,E,k,block_m", [(1, 8, 2, 16), (37, 8, 3, 16), (300, 5, 2, 64), (4, 896, 16, 16)])
def test_align_tiles(N, E, k, block_m):
    """`_align` without a host sync: every assignment once, each real tile holds only its expert's assignments
    (then pads), the grid's spare tiles (expert -1) come after the real ones and hold only pads."""
    g = torch.Generator().manual_seed(N * E)
    top_idx = torch.rand(N, E, generator=g).topk(k, dim=-1).indices.to(DEVICE)
    sorted_ids, block_expert, tiles, run_end, run_len = _align(top_idx, E, block_m)
    A = N * k
    assert tiles == triton.cdiv(A, block_m) + min(E, A)
    assert sorted_ids.shape == (tiles * block_m,) and block_expert.shape == (tiles,)
    ids, be, flat = sorted_ids.cpu().long(), block_expert.cpu().long(), top_idx.reshape(-1).cpu()
    real = ids[ids < A]
    assert torch.equal(real.sort().values, torch.arange(A))  # each assignment exactly once
    assert (ids[ids >= A] == A).all()  # pads hold num_assign
    n_real = int((be >= 0).sum())
    assert (be[:n_real] >= 0).all() and (be[n_real:] == -1).all()
    assert (ids.view(tiles, block_m)[n_real:] == A).all()
    counts = torch.bincount(flat, minlength=E)
    assert n_real == int(((counts + block_m - 1) // block_m).sum())
    for t in range(n_real):
        row = ids.view(tiles, block_m)[t]
        assert (flat[row[row < A]] == be[t]).all()
    # The runs `_program_tile` orders the grid by: expert e's padded rows, ending at run_end[e].
    run_end, run_len = run_end.cpu(), run_len.cpu()
    assert torch.equal(run_len, (counts + block_m - 1) // block_m * block_m)
    assert torch.equal(run_end, run_len.cumsum(0))
    for t in range(n_real):
        e = be[t]
        assert run_end[e] - run_len[e] <= t * block_m < run_end[e]


@pytest.mark.parametrize("N,E,k,block_m", [(1, 8, 2, 16), (37, 8, 3, 16), (300, 5, 2, 64), (256, 896, 16, 8),
                                           (3, 1, 1, 16)])
def test_align_kernel_matches_torch(N, E, k, block_m):
    """The one-program `_align_kernel` (up to `_ALIGN_KERNEL_MAX` assignments) gives `_align_torch`'s tensors
    exactly: the same stable order within an expert, pads, spare tiles and runs. Hot expert 0: runs of many tiles."""
    from k3_kernels.moe.triton_moe import _ALIGN_KERNEL_MAX, _align_torch

    g = torch.Generator().manual_seed(N + E)
    top_idx, _ = _routing(N, E, k, g)
    assert N * k <= _ALIGN_KERNEL_MAX
    got = _align(top_idx, E, block_m)
    want = _align_torch(top_idx.reshape(-1), E, block_m, got[2])
    for name, a, b in zip(("sorted_ids", "block_expert", "tiles", "run_end", "run_len"), got, want):
        if name == "tiles":
            assert a == b
        else:
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), name


@pytest.mark.parametrize("fp4", [False, True])
def test_regime_boundary(fp4):
    """Decode tiles up to `_DECODE_MAX_ROWS` average rows an expert (per weight format), prefill tiles above."""
    E = 896
    limit = _DECODE_MAX_ROWS["mxfp4" if fp4 else "dense"] * E
    assert _is_decode(limit, E, fp4) and not _is_decode(limit + 1, E, fp4)
    assert _is_decode(64 * 16, E, fp4) and not _is_decode(8192 * 16, E, fp4)  # K3 decode at B = 64, 8K prefill


@pytest.mark.parametrize("order", ["expert", "tile"])
@pytest.mark.parametrize("fp4", [False, True])
def test_experts_with_many_row_tiles_and_column_blocks(fp4, order):
    """Experts of several row tiles times several column blocks in both kernels: each program order
    (`_program_tile`) must reach every (row tile, column block) once. A program it missed leaves rows at zero, one
    it repeated adds its atomic twice; either fails the comparison."""
    N, E, k, D, I = 80, 3, 2, 96, 64  # ~53 rows an expert: 3-4 row tiles of 16
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    top_idx, top_w = _routing(N, E, k, g)
    config = {"block_m": 16, "order": order, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 32},
              "down": {"BLOCK_N": 32, "BLOCK_K": 32}}
    if fp4:
        w13p, w13s = quantize_mxfp4(torch.randn(E, 2 * I, D, generator=g) * 0.1)
        w2p, w2s = quantize_mxfp4(torch.randn(E, D, I, generator=g) * 0.1)
        args = [t.to(DEVICE) for t in (w13p, w13s, w2p, w2s)]
        want = moe_experts_mxfp4(x.float(), top_idx, top_w, *args)
        got = moe_experts_triton(x, top_idx, top_w, w13_packed=args[0], w13_scale=args[1], w2_packed=args[2],
                                 w2_scale=args[3], config=config)
    else:
        gate_up = (torch.randn(E, 2 * I, D, generator=g) * D**-0.5).bfloat16().to(DEVICE)
        down = (torch.randn(E, D, I, generator=g) * I**-0.5).bfloat16().to(DEVICE)
        want = moe_experts(x.float(), top_idx, top_w, gate_up.float(), down.float())
        got = moe_experts_triton(x, top_idx, top_w, gate_up=gate_up, down=down, config=config)
    assert torch.bincount(top_idx.reshape(-1).cpu(), minlength=E).min() > 32  # every expert has 3+ row tiles
    assert rel_err(got.float(), want) <= 1e-2


def test_launch_row_tiles_capped_at_the_average_expert():
    """K3 (896 experts, top-16, 64-row tiles): 2K tokens hold 36 rows an expert (one tile), 8K 146 (three)."""
    assert _launch_row_tiles(3, 2048 * 16, 896, 64) == 1
    assert _launch_row_tiles(3, 4096 * 16, 896, 64) == 2
    assert _launch_row_tiles(3, 8192 * 16, 896, 64) == 3
    assert _launch_row_tiles(3, 16384 * 16, 896, 64) == 3
    assert _launch_row_tiles(1, 16384 * 16, 896, 64) == 1
    assert _launch_row_tiles(4, 1, 896, 64) == 1


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("reduce", ["atomic", "sorted"])
@pytest.mark.parametrize("row_tiles", [1, 2, 3, 4])
def test_row_groups(row_tiles, reduce, tma):
    """Programs covering up to `row_tiles` row tiles of one expert, weights (and down's h) read through pointers or
    TMA descriptors: experts of 13, 9, 3, 2 and 1 row tiles of 16, so groups are
    full, partial (the program's later tiles belong to the next expert and must be neither read nor written) and
    single, and each weight tile serves every row tile of its group. A row tile missed leaves zeros, one done twice
    adds its atomic twice, a neighbour's rows multiplied by the wrong expert's weights: each fails the comparison."""
    N, E, k, D, I = 200, 5, 2, 96, 64  # 5 row tiles an expert on average: `_launch_row_tiles` keeps up to 4
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    scores = torch.rand(N, E, generator=g) + torch.tensor([0.8, 0.3, 0.0, -0.1, -0.3])  # uneven loads
    top_w, top_idx = scores.topk(k, dim=-1)
    top_idx, top_w = top_idx.to(DEVICE), (top_w / top_w.sum(-1, keepdim=True)).to(DEVICE)
    tiles_per_expert = (torch.bincount(top_idx.reshape(-1).cpu(), minlength=E) + 15) // 16
    assert tiles_per_expert.max() >= row_tiles + 1 and tiles_per_expert.min() >= 1
    assert row_tiles == 1 or len(set((tiles_per_expert % row_tiles).tolist())) > 1  # partial groups, several sizes
    assert _launch_row_tiles(row_tiles, N * k, E, 16) == row_tiles  # the groups asked for are the groups launched
    gate_up = (torch.randn(E, 2 * I, D, generator=g) * D**-0.5).bfloat16().to(DEVICE)
    down = (torch.randn(E, D, I, generator=g) * I**-0.5).bfloat16().to(DEVICE)
    want = moe_experts(x.float(), top_idx, top_w, gate_up.float(), down.float())
    # K tiles of 64 do not divide D = 96: the TMA loads' zero fill past the edge is exercised too.
    config = {"block_m": 16, "reduce": reduce,
              "gate_up": {"BLOCK_N": 32, "BLOCK_K": 64, "row_tiles": row_tiles, "tma": tma},
              "down": {"BLOCK_N": 32, "BLOCK_K": 32, "row_tiles": row_tiles, "tma": tma}}
    got = moe_experts_triton(x, top_idx, top_w, gate_up=gate_up, down=down, config=config)
    assert rel_err(got.float(), want) <= 1e-2


@pytest.mark.parametrize("N,E,k,D,I,block_m", [(1, 4, 2, 64, 32, 16), (37, 8, 3, 96, 64, 16), (70, 5, 2, 64, 96, 64)])
def test_dense_matches_reference(N, E, k, D, I, block_m):
    g = torch.Generator().manual_seed(N + E)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    gate_up = (torch.randn(E, 2 * I, D, generator=g) * D**-0.5).bfloat16().to(DEVICE)
    down = (torch.randn(E, D, I, generator=g) * I**-0.5).bfloat16().to(DEVICE)
    top_idx, top_w = _routing(N, E, k, g)
    want = moe_experts(x.float(), top_idx, top_w, gate_up.float(), down.float())
    got = moe_experts_triton(x, top_idx, top_w, gate_up=gate_up, down=down, block_m=block_m)
    assert got.dtype == x.dtype and torch.isfinite(got).all()
    assert rel_err(got.float(), want) <= 1e-2


@pytest.mark.parametrize("N,block_m", [(5, 16), (50, 64)])
def test_mxfp4_matches_reference(N, block_m):
    E, k, D, I = 6, 2, 64, 64
    g = torch.Generator().manual_seed(N)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    w13p, w13s = quantize_mxfp4(torch.randn(E, 2 * I, D, generator=g) * torch.logspace(-3, 1, D))
    w2p, w2s = quantize_mxfp4(torch.randn(E, D, I, generator=g) * 0.1)
    top_idx, top_w = _routing(N, E, k, g)
    args = [t.to(DEVICE) for t in (w13p, w13s, w2p, w2s)]
    want = moe_experts_mxfp4(x.float(), top_idx, top_w, *args)
    got = moe_experts_triton(
        x, top_idx, top_w, w13_packed=args[0], w13_scale=args[1], w2_packed=args[2], w2_scale=args[3], block_m=block_m
    )
    assert rel_err(got.float(), want) <= 1e-2
    # Packed and dequantised-bf16 weights multiply the same bf16 numbers (the unpack is exact, see the bit-exact
    # test below); only the fp32 accumulation order differs (even/odd halves per 32 inputs vs 64-input tiles).
    dense = moe_experts_triton(
        x, top_idx, top_w, gate_up=dequantize_mxfp4(args[0], args[1]), down=dequantize_mxfp4(args[2], args[3]),
        block_m=block_m,
    )
    assert rel_err(got.float(), dense.float()) <= 1e-2 / 4  # bf16 rounding of the output and of h, nothing more


# Non-default tiles per kernel (narrower and wider than the outputs, K tiles past the K width for dense, where the
# column mask covers it), block_m 32, a lone BLOCK_K, the launch options (ignored by the interpreter, compiled by
# benchmarks/compile_check.py), each with both reduces.
_DENSE_CONFIGS = [
    {"block_m": 32, "gate_up": {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4},
     "down": {"BLOCK_N": 128, "BLOCK_K": 16, "num_warps": 2, "num_stages": 1}},
    {"gate_up": {"BLOCK_K": 32}, "down": {"BLOCK_N": 16}},
]


@pytest.mark.parametrize("reduce", ["atomic", "sorted"])
@pytest.mark.parametrize("cfg", range(len(_DENSE_CONFIGS)))
def test_dense_configs_match_reference(cfg, reduce):
    N, E, k, D, I = 37, 8, 3, 96, 64
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    gate_up = (torch.randn(E, 2 * I, D, generator=g) * D**-0.5).bfloat16().to(DEVICE)
    down = (torch.randn(E, D, I, generator=g) * I**-0.5).bfloat16().to(DEVICE)
    top_idx, top_w = _routing(N, E, k, g)
    want = moe_experts(x.float(), top_idx, top_w, gate_up.float(), down.float())
    config = {**_DENSE_CONFIGS[cfg], "reduce": reduce}
    got = moe_experts_triton(x, top_idx, top_w, gate_up=gate_up, down=down, config=config)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert rel_err(got.float(), want) <= 1e-2


@pytest.mark.parametrize("reduce", ["atomic", "sorted"])
def test_mxfp4_configs_match_reference(reduce):
    """MXFP4 with K tiles of 128 (all of D) and 32 (half of I) and output tiles of 16 and 128, block_m 32."""
    N, E, k, D, I = 20, 6, 2, 128, 64
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    w13p, w13s = quantize_mxfp4(torch.randn(E, 2 * I, D, generator=g) * 0.1)
    w2p, w2s = quantize_mxfp4(torch.randn(E, D, I, generator=g) * 0.1)
    top_idx, top_w = _routing(N, E, k, g)
    args = [t.to(DEVICE) for t in (w13p, w13s, w2p, w2s)]
    want = moe_experts_mxfp4(x.float(), top_idx, top_w, *args)
    fp4 = dict(w13_packed=args[0], w13_scale=args[1], w2_packed=args[2], w2_scale=args[3])
    config = {"block_m": 32, "reduce": reduce, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 8},
              "down": {"BLOCK_N": 128, "BLOCK_K": 32, "num_stages": 4}}
    got = moe_experts_triton(x, top_idx, top_w, **fp4, config=config)
    assert rel_err(got.float(), want) <= 1e-2
    if reduce == "sorted":  # no atomics: the same bits every run
        assert torch.equal(got, moe_experts_triton(x, top_idx, top_w, **fp4, config=config))


@pytest.mark.parametrize("config,match", [
    ({"blockm": 16}, "'blockm'"),
    ({"gate_up": {"BLOCK_N": 64, "warps": 4}}, "'warps'"),
    ({"block_m": 24}, "block_m"),
    ({"reduce": "tree"}, "reduce"),
    ({"order": "row"}, "order"),
    ({"gate_up": {"BLOCK_N": 48}}, "BLOCK_N"),
    ({"down": {"BLOCK_K": 8}}, "BLOCK_K"),
    ({"down": {"num_warps": 3}}, "num_warps"),
    ({"gate_up": {"num_stages": 0}}, "num_stages"),
    ({"gate_up": {"row_tiles": 0}}, "row_tiles"),
    ({"down": {"row_tiles": 5}}, "row_tiles"),
    ({"gate_up": {"row_tiles": 2.0}}, "row_tiles"),
    ({"down": {"row_tiles": 2}, "order": "tile"}, "row_tiles.*order 'expert'"),
    ({"gate_up": {"tma": 1}}, r"\['tma'\] must be True or False"),
])
def test_bad_configs(config, match):
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)
    idx, w = torch.zeros(2, 1, dtype=torch.long, device=DEVICE), torch.ones(2, 1, device=DEVICE)
    gu, dn = torch.zeros(1, 64, 64, dtype=torch.bfloat16, device=DEVICE), torch.zeros(1, 64, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        moe_experts_triton(x, idx, w, gate_up=gu, down=dn, config=config)


def test_bad_configs_block_m_twice_and_mxfp4_k_width():
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)
    idx, w = torch.zeros(2, 1, dtype=torch.long, device=DEVICE), torch.ones(2, 1, device=DEVICE)
    gu, dn = torch.zeros(1, 64, 64, dtype=torch.bfloat16, device=DEVICE), torch.zeros(1, 64, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="block_m given twice"):
        moe_experts_triton(x, idx, w, gate_up=gu, down=dn, block_m=16, config={"block_m": 32})
    out = moe_experts_triton(x, idx, w, gate_up=gu, down=dn, block_m=32, config={"block_m": 32})  # agreeing is fine
    assert out.shape == x.shape
    u8 = lambda *shape: torch.zeros(*shape, dtype=torch.uint8, device=DEVICE)  # noqa: E731
    fp4 = dict(w13_packed=u8(1, 64, 32), w13_scale=u8(1, 64, 2), w2_packed=u8(1, 64, 16), w2_scale=u8(1, 64, 1))
    with pytest.raises(ValueError, match="K width D=64"):  # gate_up reads the latent width: 128 does not divide it
        moe_experts_triton(x, idx, w, **fp4, config={"gate_up": {"BLOCK_K": 128}})
    with pytest.raises(ValueError, match="K width I=32"):  # down reads the expert width; 16 is no multiple of 32
        moe_experts_triton(x, idx, w, **fp4, config={"down": {"BLOCK_K": 16}})
    with pytest.raises(ValueError, match="row_tiles.*bf16"):  # MXFP4 unpacks per product: no row groups
        moe_experts_triton(x, idx, w, **fp4, config={"gate_up": {"row_tiles": 2}})
    with pytest.raises(ValueError, match=r"\['tma'\] needs bf16"):
        moe_experts_triton(x, idx, w, **fp4, config={"down": {"tma": True}})


def test_mxfp4_unpack_hand_built():
    """One expert, one token, identity-like weights built from known codes: every E2M1 code and scale byte."""
    D = I = 32
    codes = torch.arange(16).repeat(2)  # all 16 codes along the inputs
    # gate row r has code r at input r (others +0): w[r, r] = E2M1[r] * 2**(s - 127)
    packed = torch.zeros(I, D // 2, dtype=torch.uint8)
    scale = torch.full((I, 1), 127, dtype=torch.uint8)
    for r in range(I):
        c = int(codes[r])
        packed[r, r // 2] = c if r % 2 == 0 else c << 4
        scale[r, 0] = 125 + (r % 5)  # 2**-2 .. 2**2
    want = dequantize_mxfp4(packed, scale, torch.float32)
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    for r in range(I):
        assert want[r, r] == table[int(codes[r])] * 2.0 ** ((r % 5) - 2)
    # Probe the kernel's unpack: x = e_c picks column c of the gate; up rows are +1 at input c so SiTU's linear
    # factor is 25*tanh(1/25) (known), and down = identity columns read h back out.
    up = torch.eye(I, D)
    up_p, up_s = quantize_mxfp4(up)
    w13p = torch.cat([packed, up_p])[None]
    w13s = torch.cat([scale, up_s])[None]
    w2p, w2s = quantize_mxfp4(torch.eye(D, I)[None])
    x = torch.eye(D).bfloat16()
    idx = torch.zeros(D, 1, dtype=torch.long)
    w = torch.ones(D, 1)
    got = moe_experts_triton(
        x.to(DEVICE), idx.to(DEVICE), w.to(DEVICE), w13_packed=w13p.to(DEVICE), w13_scale=w13s.to(DEVICE),
        w2_packed=w2p.to(DEVICE), w2_scale=w2s.to(DEVICE),
    ).float().cpu()
    ref = moe_experts_mxfp4(x.float(), idx, w, w13p, w13s, w2p, w2s)
    assert rel_err(got, ref) <= 1e-2
    assert torch.equal(got.diagonal() != 0, ref.diagonal() != 0)


def test_mxfp4_unpack_exact():
    """The kernel's MXFP4 product against the reference dequantiser, value for value: every byte (so every code in
    both nibbles), scale bytes 3..252 (all whose products are normal bf16 numbers: real checkpoints sit around
    110..127), a non-zero expert, rows past N_ROWS clamped and never written. (-0.0 reads back as +0.0.)"""
    E, rows, K, block_n, block_k, e = 2, 40, 256, 64, 64, 1
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (E, rows, K // 2), dtype=torch.uint8, generator=g)
    packed[e, 0] = torch.arange(128, dtype=torch.uint8)
    packed[e, 1] = torch.arange(128, 256, dtype=torch.uint8)
    scale = torch.randint(3, 253, (E, rows, K // 32), dtype=torch.uint8, generator=g)
    scale[e] = (3 + torch.arange(rows * K // 32) % 250).view(rows, K // 32).to(torch.uint8)
    out = torch.full((block_n, K), float("nan"), device=DEVICE)
    _tile[(1,)](packed.to(DEVICE), scale.to(DEVICE), out, e, rows, K, BLOCK_N=block_n, BLOCK_K=block_k)
    want = dequantize_mxfp4(packed[e], scale[e], torch.float32)
    got = out.cpu()
    assert torch.equal(got[:rows], want)
    assert got[rows:].isnan().all()


def test_bad_inputs():
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)
    idx, w = torch.zeros(2, 1, dtype=torch.long, device=DEVICE), torch.ones(2, 1, device=DEVICE)
    with pytest.raises(ValueError, match="either"):
        moe_experts_triton(x, idx, w)
    gu, dn = torch.zeros(1, 64, 64, dtype=torch.bfloat16, device=DEVICE), torch.zeros(1, 64, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="hidden_states"):
        moe_experts_triton(x[:, :32], idx, w, gate_up=gu, down=dn)
    with pytest.raises(ValueError, match="uint8"):
        moe_experts_triton(x, idx, w, w13_packed=gu, w13_scale=gu, w2_packed=dn, w2_scale=dn)


def test_experts_implementation_selects_the_kernel(tiny_dir, monkeypatch):
    """`experts_implementation="k3_triton"` runs the model's experts through the kernel (on the MXFP4 checkpoint:
    its packed bytes, W4A16): same logits as eager up to the kernel's bf16 products; training mode with grad
    refuses (no backward). More on packed experts in tests/model/test_packed_experts.py."""
    from transformers_k3 import KimiK3ForConditionalGeneration

    eager = KimiK3ForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32, experts_implementation="eager").to(DEVICE)
    fast = KimiK3ForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32, experts_implementation="k3_triton").to(DEVICE)
    assert fast.config.get_text_config()._experts_implementation == "k3_triton"
    assert all(m.packed for m in fast.modules() if type(m).__name__ == "KimiK3Experts")
    import k3_kernels.moe.triton_moe as triton_moe

    calls = []
    real = triton_moe.moe_experts_triton
    monkeypatch.setattr(triton_moe, "moe_experts_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ids = torch.randint(0, 200, (2, 9), device=DEVICE)
    with torch.no_grad():
        want = eager.eval().language_model(input_ids=ids, use_cache=False).logits
        got = fast.eval().language_model(input_ids=ids, use_cache=False).logits
    assert rel_err(got, want) <= 2e-2
    n_sparse = sum(t == "sparse" for t in fast.config.get_text_config().mlp_layer_types)
    assert len(calls) == n_sparse > 0  # every MoE layer went through the kernel
    fast.train()
    with pytest.raises(RuntimeError, match="no backward"):
        fast.language_model(input_ids=ids, use_cache=False)
