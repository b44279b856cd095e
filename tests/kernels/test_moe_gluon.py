"""Gluon MXFP4 experts (`k3_kernels.moe.gluon_moe`) against the torch reference.

Gluon kernels do not run under `TRITON_INTERPRET` (they need a driver), so the numeric tests run on a Hopper GPU
only; on the CPU this file checks the selection rules and the errors. Tolerance rule, as for the Triton kernels: bf16
products with fp32 accumulation and h rounded to bf16, so rel_err <= 1e-2 against the fp32 reference on the same
(bf16-representable) inputs.
"""

import pytest
import torch

from helpers import moe_routing, mxfp4_experts, rel_err
from k3_kernels.moe.reference import moe_experts_mxfp4

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from k3_kernels.moe.gluon_moe import _k_step, moe_experts_gluon, tokens_per_tile  # noqa: E402
from k3_kernels.moe.triton_moe import moe_experts_triton  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_hopper = pytest.mark.skipif(not HOPPER, reason="Gluon wgmma kernels need a Hopper GPU")


@needs_hopper
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("nt", [None, 8, 16, 32, 64])
@pytest.mark.parametrize("N,E,k,D,I,hot", [
    (1, 8, 2, 64, 64, 0.0),  # one token: S = 1, most tiles spare
    (5, 7, 3, 256, 192, 0.0),  # S = 4 for gate_up, S = 1 for down
    (33, 6, 4, 384, 128, 0.5),  # a hot expert over several tiles; S = 2
    (100, 9, 2, 512, 320, 0.5),  # uneven loads, I = 5 x 64
])
def test_matches_reference(N, E, k, D, I, hot, nt, stages):
    g = torch.Generator().manual_seed(N * D + I)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    w = mxfp4_experts(E, D, I, g, DEVICE)
    top_idx, top_w = moe_routing(N, E, k, g, DEVICE, hot)
    want = moe_experts_mxfp4(x.float(), top_idx, top_w, *w)
    got = moe_experts_gluon(x, top_idx, top_w, *w, token_slots=nt, stages=stages)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.isfinite(got).all()
    assert rel_err(got.float(), want) <= 1e-2


@needs_hopper
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("k_step", [1, 2, 4])
def test_k_step_override(k_step, stages):
    """Every K-step width and ring depth over several steps (D = 512, I = 256: 2 to 8 steps, so the rings wrap and
    the last steps have nothing left to prefetch), with hot experts over several tiles."""
    N, E, k, D, I = 40, 6, 3, 512, 256
    g = torch.Generator().manual_seed(k_step)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    w = mxfp4_experts(E, D, I, g, DEVICE)
    top_idx, top_w = moe_routing(N, E, k, g, DEVICE, hot=0.5)
    got = moe_experts_gluon(x, top_idx, top_w, *w, k_step=k_step, stages=stages)
    assert rel_err(got.float(), moe_experts_mxfp4(x.float(), top_idx, top_w, *w)) <= 1e-2


@needs_hopper
def test_scale_range():
    """The unpack's bf16 multiplier 2^(s - 33) covers E8M0 bytes 34..160 exactly (weights of 2^-93 .. 2^33 scale);
    a byte of 161 or more gives non-finite output, not a wrong finite one."""
    N, E, k, D, I = 9, 4, 2, 128, 128
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    w13p, _, w2p, _ = mxfp4_experts(E, D, I, g, DEVICE)
    w13s = torch.randint(34, 161, (E, 2 * I, D // 32), generator=g, dtype=torch.uint8).to(DEVICE)
    w2s = torch.randint(34, 161, (E, D, I // 32), generator=g, dtype=torch.uint8).to(DEVICE)
    w13s[..., 0], w2s[..., 0] = 34, 160  # both ends in every row
    top_idx, top_w = moe_routing(N, E, k, g, DEVICE)
    w = (w13p, w13s, w2p, w2s)
    got = moe_experts_gluon(x, top_idx, top_w, *w).float()
    want = moe_experts_mxfp4(x.float(), top_idx, top_w, *w)
    assert torch.isfinite(want).all() and rel_err(got, want) <= 1e-2
    w2s[:, 5, 1] = 161  # one block of the down weights out of range: its output column is not finite
    got = moe_experts_gluon(x, top_idx, top_w, w13p, w13s, w2p, w2s)
    assert not torch.isfinite(got[:, 5]).all()


@needs_hopper
def test_k3_widths_and_the_triton_entry_point():
    """K3's latent and expert widths (3584, 3072: S = 4 for both), through `moe_experts_triton(config=...)`, which
    must give exactly what the Gluon function gives; the Triton kernels agree to the tolerance."""
    E, k, D, I, N = 12, 4, 3584, 3072, 6
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    w = mxfp4_experts(E, D, I, g, DEVICE)
    top_idx, top_w = moe_routing(N, E, k, g, DEVICE)
    fp4 = dict(w13_packed=w[0], w13_scale=w[1], w2_packed=w[2], w2_scale=w[3])
    got = moe_experts_triton(x, top_idx, top_w, **fp4, config={"gluon": True})
    assert rel_err(got.float(), moe_experts_mxfp4(x.float(), top_idx, top_w, *w)) <= 1e-2
    assert rel_err(got.float(), moe_experts_triton(x, top_idx, top_w, **fp4, config={"gluon": False}).float()) <= 1e-2
    # The atomics add a token's k slots in a varying order: equal to fp32 rounding, not bit for bit.
    assert rel_err(got.float(), moe_experts_gluon(x, top_idx, top_w, *w).float()) <= 1e-3


@needs_hopper
def test_cuda_graph_capture():
    """A decode step captured in a CUDA graph (as `generate` with a static cache does), with the operand-order
    gather first built inside the capture: the replay matches eager calls, and so does an eager call made after the
    capture, before any replay (nothing half-built is cached)."""
    from k3_kernels.moe import gluon_moe

    N, E, k, D, I = 16, 8, 4, 448, 128
    g = torch.Generator().manual_seed(11)
    w = mxfp4_experts(E, D, I, g, DEVICE)
    x = torch.randn(N, D, generator=g).bfloat16().to(DEVICE)
    top_idx, top_w = moe_routing(N, E, k, g, DEVICE)
    moe_experts_gluon(x, top_idx, top_w, *w)  # compile outside the capture
    gluon_moe._cached_operand_order.cache_clear()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = moe_experts_gluon(x, top_idx, top_w, *w)
    torch.cuda.current_stream().wait_stream(stream)
    eager = moe_experts_gluon(x, top_idx, top_w, *w).float()
    assert rel_err(eager, moe_experts_mxfp4(x.float(), top_idx, top_w, *w)) <= 1e-2
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out.float(), eager) <= 1e-3


@needs_hopper
def test_default_picks_gluon_from_the_threshold(monkeypatch):
    """Without a config, MXFP4 experts run on the Gluon kernels from `_GLUON_MIN_ASSIGNMENTS` assignments up to
    `_GLUON_MAX_ROWS` an expert on average, decode and prefill sizes alike, on the Triton kernels outside."""
    import k3_kernels.moe.gluon_moe as gluon_moe
    from k3_kernels.moe import triton_moe

    calls = []
    monkeypatch.setattr(gluon_moe, "moe_experts_gluon", lambda *a, **kw: calls.append(1) or a[0])
    fp4 = _tiny_fp4(E=8)  # decode sizes up to 8 x 24 assignments, prefill above
    idx_of = lambda n: torch.zeros(n, 1, dtype=torch.long, device=DEVICE)  # noqa: E731
    prefill, top = 8 * triton_moe._DECODE_MAX_ROWS["mxfp4"] + 1, 8 * triton_moe._GLUON_MAX_ROWS
    sizes = (triton_moe._GLUON_MIN_ASSIGNMENTS - 1, triton_moe._GLUON_MIN_ASSIGNMENTS, prefill, top, top + 1)
    for n in sizes:
        x = torch.zeros(n, 64, dtype=torch.bfloat16, device=DEVICE)
        calls.clear()
        moe_experts_triton(x, idx_of(n), torch.ones(n, 1, device=DEVICE), **fp4)
        assert len(calls) == (sizes[0] < n <= top), n
    # While a CUDA graph is captured, from one assignment: a replay pays no launch cost on the host.
    calls.clear()
    x = torch.zeros(1, 64, dtype=torch.bfloat16, device=DEVICE)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        moe_experts_triton(x, idx_of(1), torch.ones(1, 1, device=DEVICE), **fp4)
    assert len(calls) == 1


def test_tokens_per_tile_and_k_step():
    assert ([tokens_per_tile(a, 896) for a in (16, 1024, 896 * 4, 896 * 5, 896 * 12, 896 * 13, 896 * 30, 896 * 31)]
            == [8, 8, 8, 16, 16, 32, 32, 64])
    assert [_k_step(k, 32) for k in (3584, 3072, 128, 64, 320)] == [4, 4, 2, 1, 1]
    assert [_k_step(k, 64) for k in (3584, 3072, 128, 64, 320)] == [2, 2, 2, 1, 1]
    with pytest.raises(ValueError, match="multiples of 64"):
        _k_step(96, 8)


def _tiny_fp4(D=64, I=64, E=2):
    g = torch.Generator().manual_seed(0)
    w = mxfp4_experts(E, D, I, g, DEVICE)
    return dict(w13_packed=w[0], w13_scale=w[1], w2_packed=w[2], w2_scale=w[3])


def test_bad_requests():
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)
    idx, tw = torch.zeros(2, 1, dtype=torch.long, device=DEVICE), torch.ones(2, 1, device=DEVICE)
    fp4 = _tiny_fp4()
    with pytest.raises(ValueError, match=r"\['gluon'\] must be True or False"):
        moe_experts_triton(x, idx, tw, **fp4, config={"gluon": 1})
    gu = torch.zeros(1, 128, 64, dtype=torch.bfloat16, device=DEVICE)
    dn = torch.zeros(1, 64, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="MXFP4 experts only"):
        moe_experts_triton(x, idx, tw, gate_up=gu, down=dn, config={"gluon": True})
    if HOPPER:
        with pytest.raises(ValueError, match="token_slots must be 8, 16, 32 or 64"):
            moe_experts_gluon(x, idx, tw, *fp4.values(), token_slots=12)
        with pytest.raises(ValueError, match="k_step must be 1, 2 or 4"):
            moe_experts_gluon(x, idx, tw, *fp4.values(), k_step=2)  # 64 wide: only S = 1 divides
        with pytest.raises(ValueError, match="stages must be 2, 3 or 4"):
            moe_experts_gluon(x, idx, tw, *fp4.values(), stages=1)
        with pytest.raises(ValueError, match="multiples of 64"):
            moe_experts_gluon(torch.zeros(2, 96, dtype=torch.bfloat16, device=DEVICE), idx, tw,
                              *_tiny_fp4(D=96).values())
    else:
        # An explicit request where the kernels cannot run raises, naming what is missing.
        with pytest.raises(RuntimeError, match="compute capability 9"):
            moe_experts_triton(x, idx, tw, **fp4, config={"gluon": True})
        with pytest.raises(RuntimeError, match="compute capability 9"):
            moe_experts_gluon(x, idx, tw, *fp4.values())
