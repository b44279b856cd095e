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

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from k3_kernels.moe.gluon_moe_ws import _tile_groups, moe_experts_gluon_ws  # noqa: E402
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
def test_tile_groups(seed):
    """Every real tile is in exactly one group; a group is up to three consecutive tiles of one expert, starting at
    the expert's first tile or three after a group start; spare tiles (expert -1) are in none."""
    g = torch.Generator().manual_seed(seed)
    E, A = 7, int(torch.randint(1, 900, (1,), generator=g))
    flat = torch.randint(0, E, (A,), generator=g)
    flat[: A // 3] = seed % E  # a hot expert over several groups
    tiles = -(-A // 64) + min(E, A)
    _, block_expert, _, end, padded = _align_torch(flat, E, 64, tiles)
    groups, n = _tile_groups(block_expert, end, padded)
    want = []
    for e in range(E):
        first, count = int(end[e] - padded[e]) // 64, int(padded[e]) // 64
        want += list(range(first, first + count, 3))
    assert int(n) == len(want)
    assert groups[: len(want)].tolist() == want


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
                                    dict(stages=2, w_stages=2)])
@pytest.mark.parametrize("N,E,k,D,I,hot", [(1, 8, 2, 128, 64, 0.0), (300, 6, 4, 256, 128, 0.6), (1000, 16, 4, 384, 320, 0.3)])
def test_dense_matches_reference(N, E, k, D, I, hot, launch):
    """bf16 experts: the weight rows copied into the ring instead of unpacked, or (`w_stages`) every operand by TMA,
    the weights' ring deeper or shallower than the token tiles', down to two stages each; groups of one, two and
    three tiles (pad slots of x in slot order repeat a real token's row)."""
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
                                dict(w_stages=4, fp4=True)])
def test_bad_tma_launch(kw):
    """Every operand by TMA (`w_stages`) takes bf16 experts, at least 2 stages a ring, and no lead to set; the
    dispatcher's bf16 launch is accepted."""
    kw = dict(kw)
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    idx, wt = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    dense = dict(gate_up=torch.zeros(2, 128, 128, dtype=torch.bfloat16),
                 down=torch.zeros(2, 128, 64, dtype=torch.bfloat16))
    fp4 = (torch.zeros(2, 128, 64, dtype=torch.uint8), torch.zeros(2, 128, 4, dtype=torch.uint8),
           torch.zeros(2, 128, 32, dtype=torch.uint8), torch.zeros(2, 128, 2, dtype=torch.uint8))
    assert moe_experts_gluon_ws(x, idx[:0], wt[:0], **dense, **_WS_DENSE_LAUNCH).shape == (0, 128)
    weights, experts = ((fp4, {}) if kw.pop("fp4", False) else ((), dense))
    with pytest.raises(ValueError, match="w_stages takes bf16 experts"):
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
