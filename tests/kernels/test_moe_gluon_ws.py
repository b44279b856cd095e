"""The warp-specialised Gluon MXFP4 experts (`k3_kernels.moe.gluon_moe_ws`) against the torch reference.

Gluon kernels need a Hopper GPU (no `TRITON_INTERPRET`), so the numeric tests run there only; on the CPU this file
checks the work list (`_tile_groups`, torch ops) and the argument errors. Tolerance rule, as for `gluon_moe`: bf16
products with fp32 accumulation and h rounded to bf16, so rel_err <= 1e-2 against the fp32 reference on the same
(bf16-representable) inputs.
"""

import pytest
import torch
from helpers import moe_routing, mxfp4_experts, rel_err
from k3_kernels.moe.reference import moe_experts, moe_experts_mxfp4
from k3_kernels.situ.reference import situ_glu

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from k3_kernels.moe.gluon_moe_ws import (  # noqa: E402
    _TN_PIECES,
    TN,
    TN_TILES,
    TN_W_BOX,
    _tile_groups,
    _tn_gate_up_view,
    moe_experts_gluon_ws,
)
from k3_kernels.moe.triton_moe import (  # noqa: E402
    _WS_DENSE_LAUNCH,
    _WS_MIN_ROWS,
    _align_torch,
    moe_experts_triton,
)

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_hopper = pytest.mark.skipif(not HOPPER, reason="Gluon wgmma kernels need a Hopper GPU")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block,per_group", [(64, 3), (16, 12)])
def test_tile_groups(seed, block, per_group):
    """Every real tile is in exactly one group; a group is up to `per_group` consecutive tiles of one expert, starting
    at the expert's first tile or `per_group` after a group start; spare tiles (expert -1) are in none; with `counts`
    each group's count is the expert's tiles left from its start, at most `per_group` (the 64-row kernels' groups of
    three, and the 16-row items of `tokens_n`)."""
    g = torch.Generator().manual_seed(seed)
    E, A = 7, int(torch.randint(1, 900, (1,), generator=g))
    flat = torch.randint(0, E, (A,), generator=g)
    flat[: A // 3] = seed % E  # a hot expert over several groups
    tiles = -(-A // block) + min(E, A)
    _, block_expert, _, end, padded = _align_torch(flat, E, block, tiles)
    groups, n, counts = _tile_groups(block_expert, end, padded, per_group, block, counts=True)
    assert all(torch.equal(a, b) for a, b in zip(_tile_groups(block_expert, end, padded, per_group, block),
                                                 (groups, n)))
    want, want_counts = [], []
    for e in range(E):
        first, count = int(end[e] - padded[e]) // block, int(padded[e]) // block
        want += list(range(first, first + count, per_group))
        want_counts += [min(per_group, first + count - t) for t in range(first, first + count, per_group)]
    assert int(n) == len(want)
    assert groups[: len(want)].tolist() == want
    assert counts[: len(want)].tolist() == want_counts


def _emulate_tokens_n(x, top_idx, top_w, gate_up, down):
    """The `tokens_n` kernels' plan in torch: slots aligned to 16 an expert (`_align`), work items of up to 12 tiles
    (`_tile_groups`), each item multiplied in the accumulator form of its tile count (`_TN_PIECES`) over the token
    rows its TMA boxes bring: rows past the item's tiles are the next expert's or zeros, rows past the boxes are
    stale shared memory (NaN here), and only the columns of the item's own slots are stored."""
    from k3_kernels.moe.triton_moe import _align

    N, k = top_idx.shape
    E, two_i, D = gate_up.shape
    I = two_i // 2
    sorted_ids, block_expert, tiles, end, padded = _align(top_idx, E, TN.value)
    groups, n_groups, counts = _tile_groups(block_expert, end, padded, TN_TILES.value, TN.value, counts=True)
    xs = x.float()[sorted_ids.clamp(max=N * k - 1).long() // k]
    hbuf = torch.full((tiles * 16, I), float("nan"))
    out = torch.zeros(N, D)

    def rows(src, t, n):
        """The stage as the item's TMA boxes fill it: (n + 3) // 4 boxes of 64 rows from slot 16 t, NaN past them."""
        tile = torch.full((192, src.shape[1]), float("nan"))
        got = src[16 * t: 16 * t + 64 * ((n + 3) // 4)]
        tile[: got.shape[0]] = got
        tile[got.shape[0]: 64 * ((n + 3) // 4)] = 0.0  # past the tensor's end: zero-filled
        return tile

    def pieces(n):
        (form,) = [f for f in _TN_PIECES.value if f[0] < n <= f[1]]
        return [(0, form[2])] + ([(form[2], form[3])] if form[3] else [])

    items = [(int(groups[i]), int(counts[i])) for i in range(int(n_groups))]
    for t, n in items:
        e, stage, last = int(block_expert[t]), rows(xs, t, n), 16 * (t + n)
        for r0, P in pieces(n):
            slot = 16 * t + r0 + torch.arange(P)
            gu = stage[r0: r0 + P] @ gate_up[e].float().T  # [P, 2 I]
            h = situ_glu(gu[:, :I], gu[:, I:]).bfloat16().float()
            keep = slot < last
            hbuf[slot[keep]] = h[keep]
    for t, n in items:
        e, stage, last = int(block_expert[t]), rows(hbuf, t, n), 16 * (t + n)
        for r0, P in pieces(n):
            slot = 16 * t + r0 + torch.arange(P)
            y = stage[r0: r0 + P] @ down[e].float().T  # [P, D]
            assign = torch.where(slot < last, sorted_ids[slot.clamp(max=sorted_ids.numel() - 1)].long(), N * k)
            valid = assign < N * k
            out.index_add_(0, assign[valid] // k, y[valid] * top_w.reshape(-1)[assign[valid], None].float())
    return out


def _stairs(E, g):
    """Expert e (one assignment a token) takes 16 (e + 1) - 5 rows: items of every tile count from 1 to 12, and a
    13-tile expert over two items."""
    top_idx = torch.cat([torch.full((16 * (e + 1) - 5,), e) for e in range(E)])
    top_idx = top_idx[torch.randperm(top_idx.numel(), generator=g)][:, None]
    return top_idx, torch.rand(top_idx.shape, generator=g) + 0.5


@pytest.mark.parametrize("N,E,k,hot", [(1, 8, 2, 0.0), (150, 5, 4, 0.0), (300, 6, 4, 0.8), (None, 13, 1, 0.0)])
def test_tokens_n_plan(N, E, k, hot):
    """The `tokens_n` plan gives the reference's output, with the stale rows past an item's boxes NaN: every form
    (1 to 12 tiles, `_stairs`) covers its item's rows within the boxes it loads, and an expert over several items
    (a hot one) is split right."""
    g = torch.Generator().manual_seed(E * k)
    top_idx, top_w = _stairs(E, g) if N is None else moe_routing(N, E, k, g, "cpu", hot)
    D, I = 128, 64
    x = torch.randn(top_idx.shape[0], D, generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * I, D, generator=g) * 0.1).bfloat16()
    down = (torch.randn(E, D, I, generator=g) * 0.1).bfloat16()
    got = _emulate_tokens_n(x, top_idx, top_w, gate_up, down)
    assert torch.isfinite(got).all()
    assert rel_err(got, moe_experts(x.float(), top_idx, top_w, gate_up.float(), down.float())) <= 1e-2


def test_tokens_n_forms():
    """Each tile count 1-12 has exactly one form; its columns cover the count's rows, at most 16 rows and one
    power-of-two round-up more, and lie within the 64-row boxes the producer loads for it ((n + 3) // 4)."""
    forms = _TN_PIECES.value
    for n in range(1, TN_TILES.value + 1):
        ((_, _, p0, p1),) = [f for f in forms if f[0] < n <= f[1]]
        assert p0 in (16, 32, 64, 128) and p1 in (0, 16, 32, 64)
        assert 16 * n <= p0 + p1 <= 64 * ((n + 3) // 4)
        assert p1 == 0 or p0 == 128 or p0 + p1 <= 128  # the second piece within one of the two shared buffers


@pytest.mark.parametrize("I", [64, 192])
def test_tokens_n_weight_box(I):
    """gate_up's 5-D TMA box (`_tn_gate_up_view` at (e, 8 nb, 0, 0, 64 k), `TN_W_BOX`) brings the stage the
    epilogue splits: row 64 J + 16 a + 8 p + c is gate (p = 0) or up (p = 1) row 32 J + 8 a + c of column block nb,
    for every block, expert and K step; the view is the weights' own memory, with TMA-legal strides."""
    E, D = 3, 192
    gate_up = torch.randn(E, 2 * I, D)
    view = _tn_gate_up_view(gate_up)
    assert view.data_ptr() == gate_up.data_ptr() and view.stride(-1) == 1
    assert all(s * 2 % 16 == 0 for s in view.stride()[:-1])  # bf16 strides, 16-byte multiples
    b = TN_W_BOX.value
    J, a, p, c = torch.meshgrid(*map(torch.arange, (2, 4, 2, 8)), indexing="ij")
    stage_row, block_row = (64 * J + 16 * a + 8 * p + c).flatten(), (32 * J + 8 * a + c).flatten()
    for e in range(E):
        for nb in range(I // 64):
            for k0 in range(0, D, b[4]):
                box = view[e: e + b[0], 8 * nb: 8 * nb + b[1], : b[2], : b[3], k0: k0 + b[4]].reshape(128, b[4])
                want = gate_up[e, p.flatten() * I + 64 * nb + block_row, k0: k0 + b[4]]
                assert torch.equal(box[stage_row], want)


@needs_hopper
@pytest.mark.parametrize("stages,pre,wdepth", [(4, 2, 2), (3, 1, 2), (4, 1, 1)])
@pytest.mark.parametrize("N,E,k,D,I,hot", [
    (1, 8, 2, 128, 64, 0.0),  # one token: every group has one tile, two consumers idle
    (5, 7, 3, 256, 192, 0.0),
    (300, 6, 4, 256, 128, 0.6),  # a hot expert over two groups (five tiles: 3 + 2)
    (100, 9, 2, 512, 320, 0.5),  # I = 5 x 64
    (1000, 16, 4, 384, 256, 0.3),  # more work items than SMs: the persistent loop wraps
])
def test_matches_reference(N, E, k, D, I, hot, stages, pre, wdepth):
    g = torch.Generator().manual_seed(N * D + I)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    w = mxfp4_experts(E, D, I, g, DEVICE)
    top_idx, top_w = moe_routing(N, E, k, g, DEVICE, hot)
    got = moe_experts_gluon_ws(x, top_idx, top_w, *w, stages=stages, pre=pre, wdepth=wdepth)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.isfinite(got).all()
    assert rel_err(got.float(), moe_experts_mxfp4(x.float(), top_idx, top_w, *w)) <= 1e-2


@needs_hopper
@pytest.mark.parametrize("launch", [{}, dict(stages=3, pre=1), dict(w_stages=6), dict(stages=5, w_stages=4),
                                    dict(stages=2, w_stages=2), dict(w_stages=6, tokens_n=True),
                                    dict(stages=2, w_stages=2, tokens_n=True),
                                    dict(w_stages=6, tokens_n=True, w_regs=True),
                                    dict(stages=2, w_stages=2, tokens_n=True, w_regs=True)])
@pytest.mark.parametrize("N,E,k,D,I,hot", [(1, 8, 2, 128, 64, 0.0), (300, 6, 4, 256, 128, 0.6), (1000, 16, 4, 384, 320, 0.3),
                                           (200, 12, 6, 256, 192, 0.0)])
def test_dense_matches_reference(N, E, k, D, I, hot, launch):
    """bf16 experts: the weight rows copied into the ring instead of unpacked, or (`w_stages`) every operand by TMA,
    the weights' ring deeper or shallower than the token tiles', down to two stages each; groups of one, two and
    three tiles (pad slots of x in slot order repeat a real token's row); with `tokens_n`, items of 1 to 12 16-row
    tiles (100 rows an expert on average in the last case) and a hot expert over several items, with the weight rows
    through shared memory or registers (`w_regs`)."""
    g = torch.Generator().manual_seed(N + D + I)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    gate_up = (torch.randn(E, 2 * I, D, generator=g) * 0.05).bfloat16().to(DEVICE)
    down = (torch.randn(E, D, I, generator=g) * 0.05).bfloat16().to(DEVICE)
    top_idx, top_w = moe_routing(N, E, k, g, DEVICE, hot)
    got = moe_experts_gluon_ws(x, top_idx, top_w, gate_up=gate_up, down=down, **launch)
    want = moe_experts(x.float(), top_idx, top_w, gate_up.float(), down.float())
    assert torch.isfinite(got).all()
    assert rel_err(got.float(), want) <= 1e-2


@pytest.mark.parametrize("kw,match", [(dict(pre=0), "pre"), (dict(stages=2, pre=1), "pre"), (dict(stages=4, pre=3), "pre"),
                                      (dict(wdepth=3), "wdepth")])
def test_bad_arguments(kw, match):
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    w13p, w13s = torch.zeros(2, 128, 64, dtype=torch.uint8), torch.zeros(2, 128, 4, dtype=torch.uint8)
    w2p, w2s = torch.zeros(2, 128, 32, dtype=torch.uint8), torch.zeros(2, 128, 2, dtype=torch.uint8)
    idx, wt = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    with pytest.raises(ValueError, match=match):
        moe_experts_gluon_ws(x, idx, wt, w13p, w13s, w2p, w2s, **kw)


@pytest.mark.parametrize("kw", [dict(w_stages=1), dict(stages=1, w_stages=4), dict(pre=1, w_stages=4),
                                dict(w_stages=4, fp4=True), dict(tokens_n=True), dict(tokens_n=True, fp4=True),
                                dict(w_regs=True), dict(w_stages=6, w_regs=True)])
def test_bad_tma_launch(kw):
    """Every operand by TMA (`w_stages`) takes bf16 experts, at least 2 stages a ring, and no lead to set;
    `tokens_n` needs it, and `w_regs` needs `tokens_n`; the dispatcher's bf16 launch is accepted."""
    kw = dict(kw)
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    idx, wt = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    dense = dict(gate_up=torch.zeros(2, 128, 128, dtype=torch.bfloat16),
                 down=torch.zeros(2, 128, 64, dtype=torch.bfloat16))
    fp4 = (torch.zeros(2, 128, 64, dtype=torch.uint8), torch.zeros(2, 128, 4, dtype=torch.uint8),
           torch.zeros(2, 128, 32, dtype=torch.uint8), torch.zeros(2, 128, 2, dtype=torch.uint8))
    assert moe_experts_gluon_ws(x, idx[:0], wt[:0], **dense, **_WS_DENSE_LAUNCH).shape == (0, 128)
    weights, experts = ((fp4, {}) if kw.pop("fp4", False) else ((), dense))
    if "w_regs" in kw:
        match = "w_regs is an option of tokens_n"
    else:
        match = "w_stages" if "w_stages" in kw else "tokens_n takes every operand by TMA"
    with pytest.raises(ValueError, match=match):
        moe_experts_gluon_ws(x, idx, wt, *weights, **experts, **kw)


@needs_hopper
def test_dispatch():
    """`moe_experts_triton` takes these kernels for bf16 experts from `_WS_MIN_ROWS` assignments an expert at
    `_WS_DENSE_LAUNCH` (the same result as the Triton tiles, `ws=False`), and for MXFP4 experts only when asked."""
    N, E, k, D, I = 200, 4, 3, 256, 128
    assert N * k >= _WS_MIN_ROWS * E
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    gate_up = (torch.randn(E, 2 * I, D, generator=g) * 0.05).bfloat16().to(DEVICE)
    down = (torch.randn(E, D, I, generator=g) * 0.05).bfloat16().to(DEVICE)
    top_idx, top_w = moe_routing(N, E, k, g, DEVICE)
    auto = moe_experts_triton(x, top_idx, top_w, gate_up=gate_up, down=down)
    # the same kernels (up to the order of down's fp32 atomic adds)
    direct = moe_experts_gluon_ws(x, top_idx, top_w, gate_up=gate_up, down=down, **_WS_DENSE_LAUNCH)
    assert rel_err(auto.float(), direct.float()) <= 1e-3
    tiles = moe_experts_triton(x, top_idx, top_w, gate_up=gate_up, down=down, config={"ws": False})
    assert rel_err(auto.float(), tiles.float()) <= 1e-2
    w = mxfp4_experts(E, D, I, g, DEVICE)
    fp4 = dict(w13_packed=w[0], w13_scale=w[1], w2_packed=w[2], w2_scale=w[3])
    got = moe_experts_triton(x, top_idx, top_w, **fp4, config={"ws": True})
    assert rel_err(got.float(), moe_experts_gluon_ws(x, top_idx, top_w, *w).float()) <= 1e-3


def test_config_errors():
    x = torch.zeros(4, 128, dtype=torch.bfloat16, device=DEVICE)
    gate_up = torch.zeros(2, 128, 128, dtype=torch.bfloat16, device=DEVICE)
    down = torch.zeros(2, 128, 64, dtype=torch.bfloat16, device=DEVICE)
    idx, wt = torch.zeros(4, 1, dtype=torch.long, device=DEVICE), torch.ones(4, 1, device=DEVICE)
    with pytest.raises(ValueError, match="config\\['ws'\\]"):
        moe_experts_triton(x, idx, wt, gate_up=gate_up, down=down, config={"ws": 1})
    if not HOPPER:
        with pytest.raises(RuntimeError, match="config\\['ws'\\] = True"):
            moe_experts_triton(x, idx, wt, gate_up=gate_up, down=down, config={"ws": True})
    with pytest.raises(ValueError, match="bf16"):
        moe_experts_gluon_ws(x, idx, wt, gate_up=gate_up.half(), down=down.half())
