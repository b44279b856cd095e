"""Compile every Triton (and Gluon) kernel in `k3_kernels` for an H200 (sm_90) with whatever triton is importable, no
GPU needed.

The CPU tests run the kernels under `TRITON_INTERPRET=1`, which skips Triton's frontend type checks and codegen:
a kernel can pass there and still fail to compile on the GPU (triton 3.6 rejected the MoE FP4 path that 3.9's
interpreter ran). This script runs each op's public Python wrapper on small CPU tensors with `JITFunction.run`
replaced by `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`: the launch configurations are the
ones the wrappers really pick (block sizes, flags, dtypes), the kernels are compiled through TTIR, TTGIR, LLVM,
PTX and ptxas (shipped in the wheel), and nothing is launched. A kernel that needs more shared memory than an
H200 block may have (the launch would raise OutOfResources) fails too, and so does a launch that does not pass
`enable_fp_fusion=True` (every launch pins it; tests/conftest.py says why). Outputs of the "launches" are left
unwritten, so nothing is checked numerically here: that is what the tests are for.

    python benchmarks/compile_check.py                      # the installed triton
    PYTHONPATH=/tmp/t36 python benchmarks/compile_check.py  # e.g. a triton 3.6.0 wheel unzipped into /tmp/t36
    python benchmarks/compile_check.py --gluon              # the Gluon kernels only (tests/kernels/test_gluon_compile.py)

Prints one line per (kernel, constexprs) compiled, then any kernel launched in the source that no case reached;
exits 1 if any compile failed or a kernel was not reached.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import traceback
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("compile_check: unset TRITON_INTERPRET (the interpreter is what this script is meant to go past)")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

TARGET = GPUTarget("cuda", 90, 32)  # H200: compute capability 9.0, warps of 32
H200_SHARED_BYTES = 232448  # opt-in shared memory a block may use on sm_90 (227 KB)
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
           torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
           torch.bool: "i1"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")

compiled: dict[tuple, str] = {}  # (kernel, constexprs) -> "ok" or the error
# Kernels whose atomics order memory on purpose (the AttnRes cooperative kernel's arrival counter); any other atomic
# with acquire / release semantics is a failure: on sm_90a each one compiles to a GPU-wide fence and an L1
# invalidation around the atomic (tl.atomic_add's default is acq_rel; the MoE scatter-adds ran 38 % slower so).
_ORDERED_ATOMICS = ("triton_attnres._attnres_fwd_coop", "triton_attnres._attnres_bwd_coop")


def _status(name, kernel, case):
    """"ok", or why a compiled kernel would fail or is slowed: shared memory over the block limit, ordered atomics."""
    shared = kernel.metadata.shared
    if shared > H200_SHARED_BYTES:
        return f"FAILED in case {case}: needs {shared} bytes of shared memory, the H200 has {H200_SHARED_BYTES}"
    ordered = sorted(set(re.findall(r"\b(?:atom|red)\.[\w.]*?(?:acq_rel|acquire|release)[\w.]*", kernel.asm["ptx"])))
    if ordered and name not in _ORDERED_ATOMICS:
        return f"FAILED in case {case}: ordered atomics {ordered} (pass sem='relaxed' where the order does not matter)"
    return "ok"


_current_case = ["?"]


def _arg_type(name, value):
    if isinstance(value, TensorDescriptor):  # the launcher's name for a host-side TMA descriptor argument
        return f"tensordesc<{_DTYPES[value.base.dtype]}{list(value.block_shape)}>"
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument {name}: no Triton type for {type(value).__name__}")


def _compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
    options = {k: kwargs.pop(k) for k in _LAUNCH_OPTIONS if k in kwargs}
    if options.get("enable_fp_fusion") is not True:  # every launch pins it (tests/conftest.py says why)
        name = self.fn.__module__.rsplit(".", 1)[-1] + "." + self.__name__
        compiled[(name, (), ())] = f"FAILED in case {_current_case[0]}: launched without enable_fp_fusion=True"
        return None
    bound = inspect.signature(self.fn).bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(self.params):
        value = bound.arguments[p.name]
        if p.is_constexpr or value is None:
            signature[p.name], constexprs[p.name] = "constexpr", value
            continue
        signature[p.name] = _arg_type(p.name, value)
        # The launcher's specialisation: 16-aligned pointers and multiples of 16 are known to be so (vector loads).
        aligned = value.data_ptr() % 16 == 0 if isinstance(value, torch.Tensor) else (
            not isinstance(value, (bool, float, TensorDescriptor)) and value % 16 == 0)
        if aligned and not (p.do_not_specialize or p.do_not_specialize_on_alignment):
            attrs[(i,)] = [["tt.divisibility", 16]]
    key = (self.fn.__module__.rsplit(".", 1)[-1] + "." + self.__name__,
           tuple(sorted((k, str(v)) for k, v in constexprs.items())), tuple(sorted(options.items())))
    if key in compiled:
        return None
    try:
        kernel = triton.compile(ASTSource(fn=self, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=TARGET, options=options or None)
        # The shared-memory check happens at load time on the GPU, not in triton.compile: do it here.
        compiled[key] = _status(key[0], kernel, _current_case[0])
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then the script exits 1
        compiled[key] = f"FAILED in case {_current_case[0]}: {type(exc).__name__}: {exc}"
    return None


def _moe_cases():
    import importlib.util

    from k3_kernels.moe.triton_moe import moe_experts_triton

    E, k = 4, 2  # few experts: nothing is touched
    u8 = lambda *shape: torch.empty(*shape, dtype=torch.uint8)  # noqa: E731

    def run(fmt, D, I, N, config=None, block_m=None):
        x = torch.zeros(N, D, dtype=torch.bfloat16)
        idx = (torch.arange(N * k) % E).view(N, k)
        w = torch.full((N, k), 0.5)
        if fmt == "mxfp4":
            weights = dict(w13_packed=u8(E, 2 * I, D // 2), w13_scale=u8(E, 2 * I, D // 32),
                           w2_packed=u8(E, D, I // 2), w2_scale=u8(E, D, I // 32))
        else:
            weights = dict(gate_up=torch.empty(E, 2 * I, D, dtype=torch.bfloat16),
                           down=torch.empty(E, D, I, dtype=torch.bfloat16))
        return moe_experts_triton(x, idx, w, **weights, block_m=block_m, config=config)

    # The one-program routing (`_align` takes it on CUDA tensors only): K3's 896 experts at 64 and 256 tokens.
    from k3_kernels.moe.triton_moe import _align_kernel

    for n_assign in (1024, 4096):
        tiles = n_assign // 16 + 896
        yield f"moe align kernel A={n_assign}", lambda: _align_kernel[(1,)](
            torch.zeros(n_assign, dtype=torch.long), torch.empty(tiles * 16, dtype=torch.int32),
            torch.empty(tiles, dtype=torch.int32), torch.empty(896, dtype=torch.long),
            torch.empty(896, dtype=torch.long), n_assign, 896, tiles, BLOCK_M=16, A_P=n_assign, E_P=1024, num_warps=4,
            enable_fp_fusion=True)
    # K3's latent and expert widths (decode and prefill tiles), then the tiny test model's (K tiles of 32).
    for D, I, N in ((3584, 3072, 1), (3584, 3072, 64), (32, 32, 1)):
        for fmt in ("mxfp4", "bf16"):
            yield f"moe {fmt} D={D} I={I} N={N}", lambda: run(fmt, D, I, N, block_m=16 if N == 1 else 64)
    # Tunable launches at K3 shapes: a 128x128x64 8-warp prefill tile (gate_up's two accumulators make it 128 x 256),
    # the sorted reduce, a wide-K decode tile; then every config `benchmarks/moe.py --sweep` times, so the sweep
    # meets no compile failure on the GPU.
    # (config, formats): the wide-K decode tile is MXFP4's (with bf16's 128-wide, 4-stage decode tile it would need
    # 408 KB of shared memory)
    both = ("mxfp4", "bf16")
    extra = [
        ({"block_m": 128, "gate_up": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
          "down": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}}, both),
        ({"block_m": 64, "reduce": "sorted", "down": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 4}}, both),
        ({"block_m": 16, "reduce": "sorted", "gate_up": {"BLOCK_K": 256}, "down": {"BLOCK_K": 256}}, ("mxfp4",)),
        ({"gate_up": {"tma": True}, "down": {"tma": True}}, ("bf16",)),
        ({"block_m": 16, "gate_up": {"tma": True}, "down": {"tma": True}}, ("bf16",)),
    ]
    spec = importlib.util.spec_from_file_location("_moe_bench", Path(__file__).with_name("moe.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sweep = [(c, ("bf16",) if bench._dense_only(c) else both) for regime in bench.SWEEP_CONFIGS.values()
             for c in regime if c is not None]
    for i, (config, formats) in enumerate(extra + sweep):
        for fmt in formats:
            # the sweep runs each config in both program orders (row groups: "expert" only)
            for order in ("expert",) if bench._grouped(config) else ("expert", "tile"):
                cfg = {**config, "order": order}
                yield f"moe {fmt} K3 config {i} {cfg}", lambda: run(fmt, 3584, 3072, 64, config=cfg)


def _kda_cases():
    from k3_kernels.kda.triton_chunk import chunk_kda, chunk_kda_fwd
    from k3_kernels.kda.triton_recurrent import fused_recurrent_kda

    B, T, H, K = 1, 130, 2, 128
    q = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    g = torch.zeros(B, T, H, K)
    beta = torch.zeros(B, T, H, dtype=torch.bfloat16)
    gate = dict(use_gate_in_kernel=True, A_log=torch.zeros(H), dt_bias=torch.zeros(H * K), lower_bound=-5.0)
    yield "kda chunk", lambda: chunk_kda(q, q, q, g, beta, initial_state=torch.zeros(B, H, K, K), output_final_state=True)
    yield "kda chunk gate+l2norm+beta", lambda: chunk_kda(
        q, q, q, g, beta, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **gate)
    for split in (False, True):  # the fused 16-token kernel, with and without the parallel w/u0 prep kernel
        yield f"kda chunk16 split={split}", lambda: chunk_kda_fwd(q, q, q, g, beta, chunk_size=16, split=split,
                                                                  output="fused")
    yield "kda chunk64 fused", lambda: chunk_kda_fwd(q, q, q, g, beta, chunk_size=64, output_final_state=True,
                                                     output="fused")
    for cs in (16, 64):  # output="stored": prep writing qg/kd/Aqk, state kernel storing h, parallel output kernel
        yield f"kda chunk{cs} stored", lambda: chunk_kda_fwd(q, q, q, g, beta, chunk_size=cs, output="stored",
                                                             output_final_state=True)
        yield f"kda chunk{cs} stored bf16 h, block_v 64", lambda: chunk_kda_fwd(
            q, q, q, g, beta, chunk_size=cs, output="stored", h_dtype=torch.bfloat16, block_v=64, out_block_v=128,
            use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **gate)
    try:
        from k3_kernels.kda.triton_chunk_bwd import chunk_kda_bwd
    except ImportError:
        chunk_kda_bwd = None
    if chunk_kda_bwd is not None:
        h0 = torch.zeros(B, H, K, K)
        # the 16-token backward
        yield "kda chunk16 backward", lambda: chunk_kda_bwd(q, q, q, g, beta, q, initial_state=h0, dht=h0,
                                                            chunk_size=16)
        yield "kda chunk16 backward fp32 states", lambda: chunk_kda_bwd(q, q, q, g, beta, q, chunk_size=16,
                                                                        state_dtype=torch.float32)
        yield "kda chunk16 backward, in-kernel gate/l2norm/beta", lambda: chunk_kda_bwd(
            q, q, q, g, beta, q, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, chunk_size=16, **gate)
        yield "kda chunk16 backward, l2norm only", lambda: chunk_kda_bwd(
            q, q, q, g, beta, q, use_qk_l2norm_in_kernel=True, chunk_size=16)
        # the 64-token backward (the default: recompute through the forward's kernels with X / Akk kept, then the
        # state-gradient carry, the inter, UT, intra and L2-norm kernels), bf16 and fp32 inputs (the tests' K3
        # head dims in fp32 once needed 256 KB of shared memory in the carry kernel)
        yield "kda chunk64 backward", lambda: chunk_kda_bwd(q, q, q, g, beta, q, initial_state=h0, dht=h0)
        yield "kda chunk64 backward, in-kernel gate/l2norm/beta", lambda: chunk_kda_bwd(
            q, q, q, g, beta, q, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, **gate)
        yield "kda chunk64 backward, l2norm only (the model's call)", lambda: chunk_kda_bwd(
            q, q, q, g, beta, q, use_qk_l2norm_in_kernel=True)
        qf = q.float()
        yield "kda chunk64 backward fp32, in-kernel gate/l2norm/beta", lambda: chunk_kda_bwd(
            qf, qf, qf, g, beta.float(), qf, initial_state=h0, dht=h0, use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, **gate)
    yield "kda recurrent", lambda: fused_recurrent_kda(
        q[:, :1], q[:, :1], q[:, :1], g[:, :1], beta[:, :1], initial_state=torch.zeros(B, H, K, K),
        output_final_state=True)
    yield "kda recurrent gate+l2norm+beta", lambda: fused_recurrent_kda(
        q[:, :1], q[:, :1], q[:, :1], g[:, :1], beta[:, :1], use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, **gate)


def _mla_cases():
    from k3_kernels.mla.triton_decode import mla_paged_decode

    B, H, r, dr, page = 2, 4, 512, 64, 64
    pool = torch.zeros(8, page, r + dr, dtype=torch.bfloat16)
    table = torch.arange(8, dtype=torch.int32).view(B, 4)
    lengths = torch.tensor([100, 200], dtype=torch.int32)
    for Tq in (1, 2):
        qlat = torch.zeros(B, Tq, H, r, dtype=torch.bfloat16)
        qpe = torch.zeros(B, Tq, H, dr, dtype=torch.bfloat16)
        yield f"mla decode Tq={Tq}", lambda: mla_paged_decode(qlat, qpe, pool, table, lengths, 0.07, num_splits=2)


def _attnres_cases():
    from k3_kernels.attnres.triton_attnres import attn_res_triton

    for dtype in (torch.float32, torch.bfloat16):
        v = torch.zeros(4, 3, 7168, dtype=dtype, requires_grad=True)
        q = torch.zeros(1, 7168, requires_grad=True)
        nw = torch.ones(7168, requires_grad=True)
        for variant in ("row", "tiled", "resident", "cooperative", "stream"):
            yield f"attnres {variant} {dtype}", lambda: attn_res_triton(v, q, nw, variant=variant).float().sum().backward()


def _fused_cases():
    from k3_kernels.gated_norm.triton_gated_norm import gated_rms_norm_triton
    from k3_kernels.short_conv.triton_conv import causal_conv1d_step

    for dtype in (torch.bfloat16, torch.float32):  # K3's decode shapes: H * K = 12288 channels, width 4, K = 128
        x = torch.zeros(2, 1, 12288, dtype=dtype)
        yield f"short conv step {dtype}", lambda: causal_conv1d_step(x, torch.zeros(12288, 1, 4),
                                                                     torch.zeros(2, 12288, 3))
        o = torch.zeros(2, 1, 96, 128, dtype=dtype)
        yield f"gated norm {dtype}", lambda: gated_rms_norm_triton(o, o, torch.ones(128), 1e-5)


def _compile_gluon(fn, cex, type_of, div16, key_names, num_warps, case):
    """Compile a Gluon kernel for sm_90 directly (Hopper only, so no CPU wrapper call reaches it) and record its
    status under a key like the Triton launches': `type_of(name)` gives each non-constexpr argument's type; pointers
    and the `div16` integers (K3's widths and row strides) are declared multiples of 16, as the launcher specialises
    them."""
    from triton.experimental.gluon._runtime import GluonASTSource

    params = list(inspect.signature(fn.fn).parameters)
    signature = {p: "constexpr" if p in cex else type_of(p) for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if signature[p].startswith("*") or p in div16}
    key = (f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}",
           tuple(sorted((k, str(v)) for k, v in cex.items() if k in key_names)), (("num_warps", num_warps),))
    try:
        kernel = triton.compile(GluonASTSource(fn, signature, cex, attrs), target=TARGET,
                                options={"num_warps": num_warps, "enable_fp_fusion": True})
        compiled[key] = _status(key[0], kernel, case)
    except Exception as exc:  # noqa: BLE001 - reported like the Triton kernels' failures
        compiled[key] = f"FAILED: {type(exc).__name__}: {exc}"


def _gluon_moe_cases():
    """The Gluon MXFP4 decode kernels: K3's widths and the other K-step sizes, for each tokens-a-tile and ring
    depth."""
    from k3_kernels.moe import gluon_moe

    common = dict(W="*u8", WS="*u8", SORTED="*i32", BLOCK_EXPERT="*i32", num_assign="i32", top_k="i32", D="i32",
                  I="i32", DW="i32", DS="i32", IW="i32", IS="i32")
    kernels = ((gluon_moe._gate_up_situ, dict(common, X="*bf16", H="*bf16", beta="fp32", linear_beta="fp32")),
               (gluon_moe._down, dict(common, H="*bf16", OUT="*fp32", TOPW="*fp32")))

    def run(fn, types, nt, s, stages):
        cex = gluon_moe._constexprs(nt, s, stages)
        if fn is gluon_moe._down:
            cex = dict(cex, **gluon_moe._down_constexprs(nt))
        _compile_gluon(fn, cex, types.__getitem__, ("D", "I", "DW", "DS", "IW", "IS"), ("NT", "S", "STAGES"), 4,
                       f"NT={nt} S={s} stages={stages}")

    for fn, types in kernels:
        for nt in (8, 16, 32, 64):
            for s in (1, 2, 4):
                for st in (2, 3, 4):
                    yield (f"gluon {fn.__name__} NT={nt} S={s} stages={st}",
                           lambda fn=fn, types=types, nt=nt, s=s, st=st: run(fn, types, nt, s, st))


def _gluon_moe_ws_cases():
    """The warp-specialised Gluon experts (prefill sizes): MXFP4 and bf16 weights, gate_up and down, the default ring
    and the other depths the tests launch."""
    from k3_kernels.moe import gluon_moe_ws

    types = dict(X="*bf16", H="*bf16", OUT="*fp32", TOPW="*fp32", SORTED="*i32", GROUPS="*i32", BLOCK_EXPERT="*i32",
                 NGROUPS="*i32", beta="fp32", linear_beta="fp32")

    def run(fp4, gate, stages, pre, wdepth, w_stages=0):
        cex = dict(gluon_moe_ws._constexprs(stages, pre, wdepth, 112, 160, w_stages), FP4=fp4, GATE=gate)
        w = "*u8" if fp4 else "*bf16"
        # the TMA descriptors (as the launcher types them), or None without TMA: the weights', the token tiles'
        desc = dict(W_DESC=f"tensordesc<bf16[{64 if gate else 128},64],{cex['X_SMEM' if gate else 'W_SMEM']!r}>",
                    X_DESC=f"tensordesc<bf16[64,64],{cex['X_SMEM']!r}>")
        if not w_stages:
            cex["W_DESC"] = cex["X_DESC"] = None
        _compile_gluon(gluon_moe_ws._ws_experts, cex,
                       lambda p: desc.get(p) or types.get(p, w if p in ("W", "WS") else "i32"),
                       ("K", "ROWS_E", "HALF", "KW", "I", "D"),
                       ("FP4", "GATE", "STAGES", "PRE", "WDEPTH", "W_STAGES"), 4,
                       f"FP4={fp4} GATE={gate} stages={stages} pre={pre} w_stages={w_stages}")

    def run_tn(gate, stages, w_stages, w_regs):
        cex = dict(gluon_moe_ws._constexprs_tn(stages, w_stages, 232, 40, w_regs), GATE=gate)
        w_box = ",".join(map(str, gluon_moe_ws.TN_W_BOX.value)) if gate else "128,64"
        desc = dict(W_DESC=f"tensordesc<bf16[{w_box}],{gluon_moe_ws.TN_W_SMEM if gate else cex['W_SMEM']!r}>",
                    X_DESC=f"tensordesc<bf16[64,64],{cex['X_SMEM']!r}>", COUNTS="*i32")
        _compile_gluon(gluon_moe_ws._ws_experts_tn, cex, lambda p: desc.get(p) or types.get(p, "i32"),
                       ("K", "ROWS_E", "HALF", "I", "D"), ("GATE", "STAGES", "W_STAGES", "A_REGS"), 4,
                       f"tokens_n GATE={gate} stages={stages} w_stages={w_stages} w_regs={w_regs}")

    for fp4 in (True, False):
        for gate in (True, False):
            launches = ((4, 2, 2), (3, 1, 2), (4, 1, 1)) if fp4 else ((4, 2, 2), (3, 1, 2), (4, 0, 2, 6), (2, 0, 2, 2))
            for launch in launches:
                yield (f"gluon ws experts FP4={fp4} GATE={gate} launch={launch}",
                       lambda a=(fp4, gate, *launch): run(*a))
    for gate in (True, False):
        for launch in ((4, 6, False), (2, 2, False), (4, 6, True), (2, 2, True)):
            yield (f"gluon ws experts tokens_n GATE={gate} launch={launch}", lambda a=(gate, *launch): run_tn(*a))


def _gluon_mla_cases():
    """The Gluon MLA split kernel: K3's shapes, each tile width and ring depth, with and without the mask, one split
    or several."""
    from k3_kernels.mla import gluon_decode

    types = dict(Q="*bf16", QPE="*bf16", POOL="*bf16", BT="*i32", LENS="*i32", MASK="*u8", O="*bf16",
                 PART_O="*fp32", PART_LSE="*fp32", qk_scale_log2="fp32")
    # the strides of K3's q, pool and out, H = 96
    div16 = ("H", "s_qb", "s_qt", "s_qh", "s_pb", "s_pt", "s_ph", "s_pool_p", "s_pool_s", "s_ob", "s_ot", "s_oh")

    def run(block_n, stages, has_mask, one):
        cex = dict(gluon_decode._constexprs(block_n, stages, 64, torch.bfloat16), HAS_MASK=has_mask, ONE_SPLIT=one)
        _compile_gluon(gluon_decode._mla_split_gluon, cex, lambda p: types.get(p, "i32"), div16,
                       ("BLOCK_N", "HAS_MASK", "ONE_SPLIT", "STAGES"), 8, f"BLOCK_N={block_n} STAGES={stages}")

    for block_n, stages in ((64, 2), (32, 2), (32, 3)):
        for has_mask, one in ((False, False), (True, False), (False, True)):
            yield (f"gluon MLA split BLOCK_N={block_n} STAGES={stages} mask={has_mask} one_split={one}",
                   lambda b=block_n, st=stages, m=has_mask, o=one: run(b, st, m, o))


def _launched_kernels() -> set[str]:
    """Names launched as `name[grid](...)` in the kernel sources: what the cases must reach."""
    root = Path(__file__).resolve().parents[1] / "kernels"
    names = set()
    for path in root.rglob("*.py"):
        src = path.read_text()
        for name in re.findall(r"^def (\w+)\(", src, flags=re.M):
            if re.search(rf"\b{name}\[", src) and (f"@triton.jit\ndef {name}(" in src or f"@gluon.jit\ndef {name}(" in src):
                names.add(f"{path.stem}.{name}")
    return names


def main(argv: list[str]) -> int:
    gluon_only = argv == ["--gluon"]
    if argv and not gluon_only:
        sys.exit(f"usage: compile_check.py [--gluon], got {argv}")
    print(f"triton {triton.__version__} ({Path(triton.__file__).parent}), target {TARGET}")
    JITFunction.run = _compile_instead_of_launch
    case_errors = []
    all_cases = (_moe_cases, _gluon_moe_cases, _gluon_moe_ws_cases, _kda_cases, _mla_cases, _gluon_mla_cases,
                 _attnres_cases, _fused_cases)
    for cases in (_gluon_moe_cases, _gluon_moe_ws_cases, _gluon_mla_cases) if gluon_only else all_cases:
        try:
            for name, fn in cases():
                _current_case[0] = name
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - a wrapper that cannot even reach its launch is reported
                    case_errors.append(f"{name}: {type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - an import error of one op must not hide the others
            case_errors.append(f"{cases.__name__}: {traceback.format_exc(limit=1)}")
    failed = 0
    for (kernel, constexprs, options), status in sorted(compiled.items()):
        cx = ", ".join(f"{k}={v}" for k, v in constexprs)
        opts = ", ".join(f"{k}={v}" for k, v in options)
        print(f"{'ok  ' if status.startswith('ok') else 'FAIL'} {kernel}[{cx}{'; ' + opts if opts else ''}] {status}")
        failed += not status.startswith("ok")
    missing = sorted(k for k in _launched_kernels() - {k for k, _, _ in compiled}
                     if not gluon_only or k.startswith("gluon_"))
    for name in missing:
        print(f"NOT REACHED {name}: no case launched it")
    for err in case_errors:
        print(f"CASE ERROR {err}")
    print(f"{len(compiled) - failed} compiled, {failed} failed, {len(missing)} not reached, {len(case_errors)} case errors")
    return 1 if failed or missing or case_errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
