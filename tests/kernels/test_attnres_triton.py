"""Fused AttnRes (Triton) against the torch reference and fla's `naive_attnres`, forward and backward.

Runs on the CPU under `TRITON_INTERPRET=1` (set in conftest.py when there is no GPU) and compiled on CUDA.
Tolerance rule: fp32 inputs rel_err <= 1e-5 forward and 1e-4 backward against the fp32 reference; bf16 inputs
rel_err <= 1e-2 forward and 2e-2 backward (the incoming gradient is bf16 too) against the fp32
reference evaluated on the same bf16 values. The same rule holds for every kernel design ("row", "tiled",
"resident", "cooperative") and every launch configuration tested.
"""

import os

# TRITON_INTERPRET is set by conftest.py when there is no GPU (before triton is first imported).

import pytest
import torch

from helpers import rel_err
from k3_kernels.attnres.reference import attn_res

triton = pytest.importorskip("triton")
from k3_kernels.attnres import triton_attnres  # noqa: E402
from k3_kernels.attnres.triton_attnres import attn_res_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(N, lead, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # Candidates of very different scales, as the depth stream has (embeddings vs. late-layer sums).
    scales = torch.logspace(-1, 1, N)
    cands = [(torch.randn(*lead, d, generator=g) * s).to(DEVICE, dtype).requires_grad_() for s in scales]
    q = (torch.randn(1, d, generator=g) * 0.5).to(DEVICE).requires_grad_()
    nw = (1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE).requires_grad_()
    return cands, q, nw


# (variant, block_t, block_d, num_warps, TILED_PASS2, TILED_PROGRAMS_PER_SM, _TILED_CHUNK); None = the default.
# The explicit tiled configs leave d not a multiple of block_d (d = 100, 200) and T not a multiple of block_t
# (T = 5, 21, 13 with 2; T = 5, 21, 13, 18 with 4), and T = 18 > 16 gives the tiled backward two programs of
# several token blocks each (its dw read-modify-write). Both forms of the tiled second sweep ("split", "tile")
# are covered; a programs-per-SM cap (the interpreter counts 2 SMs) makes forward programs run several token
# blocks too; a chunk below block_d runs pass 1's [block_t, C, NP, chunk] view with C > 1 (on the GPU: block_d
# >= 512 with the default chunk 256).
CONFIGS = [
    ("row", None, None, None, "split", None, 256),
    ("tiled", None, None, None, "split", None, 256),
    ("tiled", 2, 64, 4, "split", None, 16),
    ("tiled", 4, 32, 2, "split", None, 256),
    ("tiled", None, None, None, "tile", None, 32),
    ("tiled", 4, 32, 2, "tile", None, 256),
    ("tiled", 2, 64, 4, "split", 1, 256),
    ("tiled", 1, 32, 4, "tile", 2, 16),
]


@pytest.mark.parametrize("variant,block_t,block_d,num_warps,pass2,per_sm,chunk", CONFIGS, ids=lambda c: str(c))
@pytest.mark.parametrize("N,lead,d", [(1, (5,), 16), (2, (3, 7), 100), (5, (13,), 200), (9, (2, 9), 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_forward_backward(N, lead, d, dtype, variant, block_t, block_d, num_warps, pass2, per_sm,
                                            chunk, monkeypatch):
    monkeypatch.setattr(triton_attnres, "TILED_PASS2", pass2)
    monkeypatch.setattr(triton_attnres, "TILED_PROGRAMS_PER_SM", per_sm)
    monkeypatch.setattr(triton_attnres, "_TILED_CHUNK", chunk)
    _check_against_reference(N, lead, d, dtype, variant=variant, block_t=block_t, block_d=block_d,
                             num_warps=num_warps)


# The resident design, forward and backward: a persistent grid (the interpreter counts 2 SMs, so 2 or 4 programs
# walk several tokens each, and T = 1 leaves programs with none), the next token's tile prefetched into registers
# or not, a pipelined loop (stages > 1; the interpreter runs it as written, the compiled test on the GPU runs the
# shared-memory copies), N padded (3, 5, 9) and not, d not a power of two.
@pytest.mark.parametrize("prefetch,stages", [(True, 1), (False, 1), (False, 2), (None, None)])
@pytest.mark.parametrize("per_sm", [1, 2])
@pytest.mark.parametrize("N,lead,d", [(1, (5,), 16), (3, (1,), 48), (2, (3, 7), 100), (5, (13,), 200),
                                      (9, (2, 9), 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resident_matches_reference_forward_backward(N, lead, d, dtype, per_sm, prefetch, stages, monkeypatch):
    monkeypatch.setattr(triton_attnres, "RESIDENT_PROGRAMS_PER_SM", per_sm)
    monkeypatch.setattr(triton_attnres, "RESIDENT_PREFETCH", prefetch)
    monkeypatch.setattr(triton_attnres, "RESIDENT_STAGES", stages)
    _check_against_reference(N, lead, d, dtype, variant="resident", num_warps=None if d < 100 else 2)


# The cooperative design, forward and backward: slices narrower than d (d = 100, 200 leave a partial last slice;
# 48 / 16 = 3 slices, a slice count not a power of two) and one slice (d <= block_d), groups walking several tokens
# (the interpreter counts 2 SMs: programs_per_sm 1 gives one group, 8 several) and T = 1 (groups with no token),
# N padded (3, 5, 9) and not. Under the interpreter each launch runs as a publishing and
# a mixing pass; compiled on the GPU as one launch whose programs wait for each other.
@pytest.mark.parametrize("per_sm", [1, 8])
@pytest.mark.parametrize("N,lead,d,block_d", [(1, (5,), 16, 16), (3, (1,), 48, 16), (2, (3, 7), 100, 32),
                                              (5, (13,), 200, 64), (9, (2, 9), 64, 16), (4, (6,), 40, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cooperative_matches_reference_forward_backward(N, lead, d, block_d, dtype, per_sm, monkeypatch):
    monkeypatch.setattr(triton_attnres, "COOP_PROGRAMS_PER_SM", per_sm)
    _check_against_reference(N, lead, d, dtype, variant="cooperative", block_d=block_d,
                             num_warps=None if d < 100 else 2)


# The stream design's forward (its backward is resident up to 6 candidates, cooperative above):
# one loop over (token, candidate) pairs on a persistent grid, so programs of several tokens each (the interpreter
# counts 2 SMs: 1 or 8 programs an SM) and programs with none (T = 1 over 2 or 16 programs), the softmax state
# starting over at every token, the pipelined loop (stages > 1; compiled on the GPU as shared-memory copies), N
# padded and not, d not a power of two.
@pytest.mark.parametrize("per_sm,stages", [(1, 1), (1, 3), (8, 2)])
@pytest.mark.parametrize("N,lead,d", [(1, (5,), 16), (3, (1,), 48), (2, (3, 7), 100), (5, (13,), 200),
                                      (7, (6,), 40), (9, (2, 9), 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_matches_reference_forward_backward(N, lead, d, dtype, per_sm, stages, monkeypatch):
    monkeypatch.setattr(triton_attnres, "STREAM_PROGRAMS_PER_SM", per_sm)
    monkeypatch.setattr(triton_attnres, "STREAM_STAGES", stages)
    _check_against_reference(N, lead, d, dtype, variant="stream", num_warps=None if d < 100 else 2)


def test_stream_nan_stays_in_its_token(monkeypatch):
    # A program carries its softmax sums from token to token: a NaN candidate row must poison its own token only.
    monkeypatch.setattr(triton_attnres, "STREAM_PROGRAMS_PER_SM", 1)  # 2 programs of 3 tokens (interpreter)
    cands, q, nw = _inputs(4, (6,), 32, torch.float32, seed=13)
    v = torch.stack([c.detach() for c in cands])
    v[2, 0, 5] = float("nan")  # token 0, the first of its program
    out = attn_res_triton(v, q.detach(), nw.detach(), variant="stream")
    ref = attn_res(list(v), q.detach(), nw.detach())
    assert torch.isnan(out[0]).all()
    assert rel_err(out[1:], ref[1:]) <= 1e-5


def test_stream_backward_is_the_auto_one(monkeypatch):
    # The stream forward saves alpha, r and p as the resident and cooperative forwards do; its backward is theirs.
    seen = []
    for name in ("_attnres_bwd_resident", "_attnres_bwd_coop"):
        kernel = getattr(triton_attnres, name)
        monkeypatch.setattr(triton_attnres, name, _Spy(kernel, name, seen))
    monkeypatch.setattr(triton_attnres, "_coop_run", lambda k, g, *a, **kw: seen.append(k.name))
    for N in (3, 9):
        v = torch.randn(N, 4, 32, device=DEVICE, requires_grad=True)
        w = torch.ones(32, device=DEVICE)
        attn_res_triton(v, w, w, variant="stream").sum().backward()
    assert seen == ["_attnres_bwd_resident", "_attnres_bwd_coop"]


class _Spy:
    """Stands in for a Triton kernel: records its name at launch (`kernel[grid](...)`) and launches nothing."""

    def __init__(self, kernel, name, seen):
        self.kernel, self.name, self.seen = kernel, name, seen

    def __getitem__(self, grid):
        return lambda *a, **kw: self.seen.append(self.name)

    def warmup(self, *a, **kw):
        return self.kernel.warmup(*a, **kw)


def test_cooperative_grid_is_groups_of_slices(monkeypatch):
    # programs = groups x slices, a program's slice is pid % S: with 2 "SMs" and 8 programs an SM, d = 100 in
    # slices of 32 gives S = 4 and 4 groups (16 programs), fewer groups than tokens
    seen = []
    run = triton_attnres._coop_run
    monkeypatch.setattr(triton_attnres, "_coop_run",
                        lambda k, g, *a, **kw: seen.append((g, kw["S"])) or run(k, g, *a, **kw))
    monkeypatch.setattr(triton_attnres, "COOP_PROGRAMS_PER_SM", 8)
    cands, q, nw = _inputs(3, (21,), 100, torch.float32, seed=21)
    out = attn_res_triton(cands, q, nw, variant="cooperative", block_d=32)
    out.sum().backward()
    if DEVICE == "cpu":
        assert seen == [(4, 4), (4, 4)]
    else:
        assert all(s == 4 and 1 <= g <= 21 for g, s in seen)


def test_cooperative_grid_fits_the_gpu_at_once(monkeypatch):
    # The GPU sizing, without a GPU: a compiled forward of 255 registers at 1 warp takes 8192 of an SM's 65536
    # registers, so 8 programs an SM fit (under the cap of 16): 132 SMs hold 1056 programs, 150 groups of 7 slices.
    # The lookup is cached per launch; too few slots for one group of programs raises instead of hanging.
    from types import SimpleNamespace

    class FakeKernel:
        calls = 0

        def warmup(self, *args, grid, **kw):
            FakeKernel.calls += 1
            meta = SimpleNamespace(num_warps=1, shared=32)
            return SimpleNamespace(_init_handles=lambda: None, n_regs=255, metadata=meta)

    props = SimpleNamespace(multi_processor_count=132, shared_memory_per_multiprocessor=233472)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(triton_attnres, "_COOP_FIT", {})
    kernel, args, kw = FakeKernel(), (torch.zeros(1),), dict(T=8192, D=7168, S=7, num_warps=1)
    cuda = torch.device("cuda", 0)
    assert triton_attnres._coop_groups(kernel, args, kw, 16, cuda) == 150
    assert triton_attnres._coop_groups(kernel, args, {**kw, "T": 5}, 16, cuda) == 5  # fewer tokens than groups
    assert FakeKernel.calls == 1
    assert triton_attnres._coop_groups(kernel, args, kw, 2, cuda) == 2 * 132 // 7  # the cap
    props.multi_processor_count = 0
    monkeypatch.setattr(triton_attnres, "_COOP_FIT", {})
    with pytest.raises(RuntimeError, match="cannot be resident"):
        triton_attnres._coop_groups(kernel, args, kw, 16, cuda)


def _check_against_reference(N, lead, d, dtype, **kwargs):
    cands, q, nw = _inputs(N, lead, d, dtype, seed=N * 1000 + d)
    out = attn_res_triton(cands, q, nw, 1e-5, **kwargs)
    assert out.dtype == dtype and out.shape == (*lead, d)
    ref_in = [c.detach().float().requires_grad_() for c in cands]
    q_ref, nw_ref = q.detach().clone().requires_grad_(), nw.detach().clone().requires_grad_()
    ref = attn_res(ref_in, q_ref, nw_ref, 1e-5)
    tol_f, tol_b = (1e-5, 1e-4) if dtype == torch.float32 else (1e-2, 2e-2)
    assert torch.isfinite(out).all()
    assert rel_err(out.float(), ref) <= tol_f

    # The kernel's incoming gradient is in the output dtype: give the reference the same rounded values.
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(d)).to(DEVICE, dtype).float()
    (out.float() * dout).sum().backward()
    (ref * dout).sum().backward()
    for name, got, want in [("q", q.grad, q_ref.grad), ("norm_weight", nw.grad, nw_ref.grad)] + [
        (f"candidate {i}", c.grad, r.grad) for i, (c, r) in enumerate(zip(cands, ref_in))
    ]:
        assert got is not None and torch.isfinite(got).all(), name
        assert rel_err(got.float(), want) <= tol_b, (name, rel_err(got.float(), want))


@pytest.mark.parametrize("variant,block_t,block_d", [("row", None, None), ("tiled", None, None), ("tiled", 2, 32),
                                                     ("resident", None, None), ("cooperative", None, 16),
                                                     ("stream", None, None)])
def test_matches_fla_naive_attnres(variant, block_t, block_d):
    fla_naive = pytest.importorskip("fla.ops.attnres.naive").naive_attnres
    cands, q, nw = _inputs(4, (6,), 48, torch.float32, seed=7)
    # fla scores RMSNorm(v; rms_weight) against the query: our weight product folds the same way.
    want = fla_naive(q.detach().flatten(), [c.detach() for c in cands], nw.detach(), rms_eps=1e-5)
    got = attn_res_triton([c.detach() for c in cands], q.detach(), nw.detach(), 1e-5, variant=variant,
                          block_t=block_t, block_d=block_d)
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("N,d,grad,want", [
    (3, 40, False, "resident"), (6, 40, False, "resident"), (7, 40, False, "stream"), (9, 40, False, "stream"),
    (3, 40, True, "resident"), (6, 40, True, "resident"), (7, 40, True, "stream"), (9, 40, True, "stream"),
    (6, 16384, False, "stream"),  # 8 rows of 16384 do not fit one resident program; one row fits a stream program
    (3, 32768, False, "cooperative"),  # nor does one row of 32768 a stream program: slices
])
def test_auto_follows_the_measured_rule(N, d, grad, want, monkeypatch):
    seen = []
    apply = triton_attnres._AttnResFunction.apply
    monkeypatch.setattr(triton_attnres._AttnResFunction, "apply",
                        lambda *a: seen.append(a[-1][0]) or apply(*a))
    v = torch.randn(N, 2, d, device=DEVICE, requires_grad=grad)
    w = torch.ones(d, device=DEVICE)
    attn_res_triton(v, w, w)
    attn_res_triton(v, w, w, block_d=16 if d < 1000 else 4096)  # slice sizes asked for: "tiled"
    assert seen == [want, "tiled"]


def test_resident_schedule_rule():
    # measured: the register prefetch for up to 3 rows a token, a 2-stage pipeline above; explicit settings win
    assert triton_attnres._resident_schedule(3, None, None) == (True, 1)
    assert triton_attnres._resident_schedule(6, None, None) == (False, 2)
    assert triton_attnres._resident_schedule(3, None, 3) == (False, 3)
    assert triton_attnres._resident_schedule(6, True, None) == (True, 1)
    assert triton_attnres._resident_schedule(3, False, 1) == (False, 1)


def test_default_variant_switch(monkeypatch):
    """block_t is refused by the row design and accepted by the tiled one, which shows which design runs: "auto"
    (the default) takes "tiled" when slice sizes are given, and its own choice (for 9 candidates the stream forward
    and the cooperative backward) agrees with the reference."""
    cands, q, nw = _inputs(3, (5,), 40, torch.float32, seed=11)
    args = ([c.detach() for c in cands], q.detach(), nw.detach())
    assert triton_attnres.DEFAULT_VARIANT == "auto"
    got = attn_res_triton(*args, block_t=2, block_d=16)  # tiled
    assert rel_err(got, attn_res(*args)) <= 1e-5
    nine, q9, nw9 = _inputs(9, (4,), 32, torch.float32, seed=12)
    ref = attn_res([c.detach() for c in nine], q9.detach(), nw9.detach())
    assert rel_err(attn_res_triton([c.detach() for c in nine], q9.detach(), nw9.detach(), block_t=2), ref) <= 1e-5
    out = attn_res_triton(nine, q9, nw9)
    assert rel_err(out.detach(), ref) <= 1e-5
    out.sum().backward()  # the cooperative design's backward, chosen automatically after the stream forward
    assert all(c.grad is not None and torch.isfinite(c.grad).all() for c in nine)
    monkeypatch.setattr(triton_attnres, "DEFAULT_VARIANT", "row")
    with pytest.raises(ValueError, match="block_t"):
        attn_res_triton(*args, block_t=2)


@pytest.mark.parametrize("variant", ["row", "tiled", "resident", "cooperative", "stream"])
def test_stacked_input_and_errors(variant):
    cands, q, nw = _inputs(3, (4,), 32, torch.float32, seed=3)
    stacked = torch.stack([c.detach() for c in cands])
    assert torch.equal(attn_res_triton(stacked, q.detach(), nw.detach(), variant=variant), attn_res_triton(
        [c.detach() for c in cands], q.detach(), nw.detach(), variant=variant))
    with pytest.raises(ValueError, match="query_weight"):
        attn_res_triton(stacked, q.detach()[:, :16], nw.detach())
    with pytest.raises(ValueError, match="at most 16"):
        attn_res_triton(torch.zeros(17, 2, 32, device=DEVICE), q.detach(), nw.detach(), variant=variant)
    with pytest.raises(ValueError, match="at most 16"):
        attn_res_triton(torch.zeros(0, 2, 32, device=DEVICE), q.detach(), nw.detach(), variant=variant)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(variant="blocked"), "variant"),
        (dict(variant="row", block_d=64), "block_t and block_d"),
        (dict(variant="resident", block_t=2), "block_t and block_d"),
        (dict(variant="resident", num_warps=48), "num_warps"),
        (dict(variant="cooperative", block_t=2), "block_t applies only"),
        (dict(variant="cooperative", block_d=24), "block_d"),
        (dict(variant="stream", block_d=64), "block_t and block_d"),
        (dict(variant="stream", num_warps=3), "num_warps"),
        (dict(variant="tiled", block_t=3), "block_t"),
        (dict(variant="tiled", block_t=0), "block_t"),
        (dict(variant="tiled", block_t=32), "block_t"),
        (dict(variant="tiled", block_d=24), "block_d"),
        (dict(variant="tiled", block_d=True), "block_d"),
        (dict(variant="tiled", num_warps=3), "num_warps"),
        (dict(variant="row", num_warps=64), "num_warps"),
        # 16 tokens * 16 (padded N = 9) * 1024 lanes: far more than one program's registers hold.
        (dict(variant="tiled", block_t=16, block_d=1024), "per tile"),
    ],
)
def test_bad_launch_arguments(kwargs, match):
    cands, q, nw = _inputs(9, (2,), 1024, torch.float32, seed=5)
    with pytest.raises(ValueError, match=match):
        attn_res_triton([c.detach() for c in cands], q.detach(), nw.detach(), **kwargs)


def test_resident_refuses_a_tile_too_wide():
    # K3's widest case, 9 candidates of d = 7168: [16, 8192] per token does not fit one program's registers.
    v = torch.zeros(9, 1, 7168, device=DEVICE)
    w = torch.ones(7168, device=DEVICE)
    with pytest.raises(ValueError, match="variant='tiled'"):
        attn_res_triton(v, w, w, variant="resident")


def test_cooperative_refuses_a_slice_too_wide():
    # 9 candidates keep 9 rows: 9 x 8192 is over the 64K elements one program may hold, 9 x 4096 is not
    v = torch.zeros(9, 1, 8192, device=DEVICE)
    w = torch.ones(8192, device=DEVICE)
    with pytest.raises(ValueError, match="smaller block_d"):
        attn_res_triton(v, w, w, variant="cooperative", block_d=8192)
    assert triton_attnres._coop_cfg(9, 8192, 4096, None) == (8, 1, 4096, 2, 4)


def test_cooperative_default_warps():
    # ~288 values of the tile a thread forward, ~144 backward (measured on the H200: 1 and 2 warps at N = 9 and
    # 1024-wide slices); 16 rows take more warps, a narrow d fewer lanes
    assert triton_attnres._coop_cfg(9, 7168, 1024, None) == (8, 1, 1024, 7, 1)
    assert triton_attnres._coop_cfg(9, 7168, 1024, None, backward=True) == (8, 1, 1024, 7, 2)
    assert triton_attnres._coop_cfg(16, 7168, 1024, None) == (16, 0, 1024, 7, 2)
    assert triton_attnres._coop_cfg(7, 7168, 1024, None, backward=True) == (4, 4, 1024, 7, 2)
    assert triton_attnres._coop_cfg(9, 7168, 2048, 8, backward=True)[-1] == 8  # asked for: kept


@pytest.mark.parametrize("name,value", [("TILED_PASS2", "both"), ("TILED_PROGRAMS_PER_SM", 0),
                                        ("TILED_PROGRAMS_PER_SM", 1.5), ("RESIDENT_PROGRAMS_PER_SM", 0),
                                        ("RESIDENT_PROGRAMS_PER_SM", None), ("RESIDENT_STAGES", 0),
                                        ("COOP_PROGRAMS_PER_SM", 0), ("STREAM_PROGRAMS_PER_SM", 0),
                                        ("STREAM_STAGES", None)])
def test_bad_module_settings(monkeypatch, name, value):
    cands, q, nw = _inputs(2, (3,), 16, torch.float32, seed=9)
    monkeypatch.setattr(triton_attnres, name, value)
    with pytest.raises(ValueError, match=name):
        attn_res_triton([c.detach() for c in cands], q.detach(), nw.detach(), variant="tiled")


def test_resident_stages_fit_shared_memory():
    # One [rows, next_pow2(d)] tile a stage in shared memory: N = 3 (3 rows of 8192 bf16, 48 KB) keeps 3 stages,
    # the N = 6 backward (6 rows and dout, 112 KB) drops to 1 (no pipeline) rather than fail to launch, fp32 halves.
    assert triton_attnres._resident_stages(3, 3, 8192, 2) == 3
    assert triton_attnres._resident_stages(2, 7, 8192, 2) == 1
    assert triton_attnres._resident_stages(2, 6, 8192, 2) == 2
    assert triton_attnres._resident_stages(4, 3, 8192, 4) == 2
    assert triton_attnres._resident_stages(1, 1, 64, 4) == 1
