"""Routed experts on the H200 at K3 shapes (896 experts, top-16, latent 3584 = routed_expert_hidden_size, expert
width 3072 = moe_intermediate_size; SPEC 5 and the released config).

Paths, same routing and inputs, one run: our Triton kernel on MXFP4-packed experts (W4A16) and on bf16 experts,
`torch._grouped_mm` on bf16 experts (what transformers' `grouped_mm` experts implementation calls), and the
per-expert Python loop (transformers' eager). Each is checked against the fp32 reference on a sample of tokens
first. Decode is bandwidth-bound: the ceiling is the bytes of the touched experts at the copy bandwidth (each
path is charged its own weight bytes: 2 a weight in bf16, 17/32 in MXFP4); prefill (8192 tokens) is compute-bound:
TFLOP/s against a large bf16 matmul. Both ceilings are measured in the same run, before the weights are made
(`ceilings`: 4.27 TB/s and about 790 TFLOP/s on the H200; 989 is the spec sheet). Timed eagerly with
`triton.testing.do_bench` (the `grouped_mm` peer syncs on its counts, so no CUDA graph); the weights (~75 GB
in all) are far bigger than L2, so nothing is served from cache. Last line: MXFP4 vs `torch._grouped_mm` at 64
tokens (target >= 3x: the 3.76x fewer weight bytes, less the unpack work). On Hopper at prefill loads (from
`_WS_MIN_ROWS` rows an expert) "ours bf16" runs the warp-specialised Gluon kernels (`gluon_moe_ws`, every operand
by TMA), and the rows "ours bf16, Triton tiles", "ours MXFP4, warp-specialised" and "ours bf16, warp-specialised,
cp.async tokens" (the kernels' own default launch) time the alternatives.

    . scripts/device_env.sh && python3 benchmarks/moe.py
    . scripts/device_env.sh && python3 benchmarks/moe.py --sweep --tokens 64 8192   # tile / launch sweep of ours

`--sweep` times our kernel (MXFP4 and bf16) over a curated list of `config=` values per regime (`SWEEP_CONFIGS`)
instead of the paths above: one markdown row per config, the best per (tokens, format) marked, each config checked
once against the default config's output. Drop a winner into `_DEFAULT_CONFIGS` in kernels/moe/triton_moe.py.
`--rounds 3` times the configs three times, interleaved, and reports each one's best round and spread (one round's
figures moved by up to 7 % between identical configs); `--kernel-times` adds each kernel's profiler time;
`--formats bf16` skips MXFP4 and frees its packed weights, so the sweep fits an 80 GB card:

    . scripts/device_env.sh && python3 benchmarks/moe.py --sweep --tokens 8192 16384 2048 --formats bf16 \
        --orders expert --rounds 3 --kernel-times

`--gluon-sweep` times the Gluon MXFP4 kernels (`gluon_moe`) over their launch overrides (ring buffers, K step,
token slots: `GLUON_SWEEP`) beside `torch._grouped_mm` and the Triton tiles, `--rounds` interleaved rounds, each
variant checked against the default's output, with each kernel's profiler time at 64 tokens (prefill sizes up to
4K tokens fit an 80 GB card next to the bf16 copy):

    . scripts/device_env.sh && python3 benchmarks/moe.py --gluon-sweep --tokens 8 64 256 --rounds 5
    . scripts/device_env.sh && python3 benchmarks/moe.py --gluon-sweep --tokens 1024 1536 2048 4096 --rounds 3

`--ws-sweep` does the same for the warp-specialised kernels on bf16 experts (`gluon_moe_ws`) over their launches
(`WS_SWEEP`: ring depths with every operand by TMA, the tokens as the N side, and the `cp.async` launch) beside
`torch._grouped_mm` and the Triton bf16 tiles, with TFLOP/s; the MXFP4 copy is freed first (896 experts fit an H200,
448 an 80 GB card). A launch that fails or disagrees with the first is reported and left out of the timing.
`--probe` then times them with every token on one expert (`compute_probe`: weights L2-resident, full tiles), so
the weight stream is not the bound:

    . scripts/device_env.sh && python3 benchmarks/moe.py --ws-sweep --tokens 8192 --rounds 3 --probe
"""

import argparse
import time

import torch
import triton
from ceilings import copy_tbs, matmul_tflops

from k3_kernels.moe.reference import moe_experts
from k3_kernels.moe.triton_moe import _DEFAULT_CONFIGS, _WS_DENSE_LAUNCH, _WS_MIN_ROWS, _is_decode, moe_experts_triton
from k3_kernels.mxfp4.reference import dequantize_mxfp4
from k3_kernels.situ.reference import situ_glu



def grouped_mm_experts(x, top_idx, top_w, gate_up, down):
    """What transformers' `grouped_mm` experts path does: sort by expert, two `torch._grouped_mm`, scatter-add."""
    N, k = top_idx.shape
    flat = top_idx.reshape(-1)
    order = torch.argsort(flat)
    counts = torch.bincount(flat, minlength=gate_up.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm(situ_glu(g, u), down.transpose(-2, -1), offs=offs)
    y = y * top_w.reshape(-1)[order, None].to(y.dtype)
    out = torch.zeros(N, x.shape[1], device=x.device, dtype=torch.float32)
    out.index_add_(0, order // k, y.float())
    return out.to(x.dtype)


def grouped_mm_gemms(x, top_idx, gate_up, down):
    """The two `torch._grouped_mm` products of `grouped_mm_experts` alone, on inputs gathered and activated beforehand:
    what a path that keeps those GEMMs and fuses the rest (gather, SiTU-GLU, weighted scatter) could reach."""
    flat = top_idx.reshape(-1)
    order = torch.argsort(flat)
    offs = torch.cumsum(torch.bincount(flat, minlength=gate_up.shape[0]), 0).to(torch.int32)
    xs = x[order // top_idx.shape[1]]
    hs = torch.empty(xs.shape[0], down.shape[-1], device=x.device, dtype=x.dtype).normal_()

    def run():
        torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(hs, down.transpose(-2, -1), offs=offs)

    return run


def loop_experts(x, top_idx, top_w, gate_up, down):
    out = torch.zeros_like(x)
    for e in torch.unique(top_idx).tolist():
        tok, slot = torch.where(top_idx == e)
        g, u = torch.nn.functional.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        h = torch.nn.functional.linear(situ_glu(g, u), down[e])
        out.index_add_(0, tok, h * top_w[tok, slot, None].to(h.dtype))
    return out


def _tokens(N, E, k, D, dev):
    """N random bf16 tokens routed to the top k of uniform random scores (weights renormalised), and how many
    distinct experts they touch."""
    x = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    top_w, top_idx = torch.rand(N, E, device=dev).topk(k, dim=-1)
    return x, top_idx, top_w / top_w.sum(-1, keepdim=True), torch.unique(top_idx).numel()


def _bench(fn, dev):
    if dev == "cuda":
        # median ms; rep 200 ms keeps >= 5 timed calls at prefill sizes (~30-50 ms a call): with fewer, a clock
        # change inside one call moved the figure by up to 15 %
        return triton.testing.do_bench(fn, warmup=25, rep=200)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _cfg(bm, bn, bk, warps, stages, reduce="atomic", down=None, row_tiles=(1, 1), tma=False):
    """One sweep entry: the same tile for both kernels unless `down` (BLOCK_N, BLOCK_K, warps, stages) is given;
    `row_tiles` (gate_up, down); `tma` for both."""
    gu = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
    dn = gu if down is None else dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), down))
    return {"block_m": bm, "reduce": reduce, "gate_up": dict(gu, row_tiles=row_tiles[0], tma=tma),
            "down": dict(dn, row_tiles=row_tiles[1], tma=tma)}


def _kernel_option(cfg, key, default):
    return [(cfg or {}).get(kern, {}).get(key, default) for kern in ("gate_up", "down")]


def _grouped(cfg) -> bool:
    """Row groups: bf16 weights in "expert" order only (the kernel refuses the rest)."""
    return max(_kernel_option(cfg, "row_tiles", 1)) > 1


def _dense_only(cfg) -> bool:
    """Row groups and TMA loads: bf16 weights only."""
    return _grouped(cfg) or any(_kernel_option(cfg, "tma", False))


# Curated per regime, not the full product. `_gate_up_situ` keeps two [BLOCK_M, BLOCK_N] fp32 accumulators (gate and
# up), so its effective tile is BLOCK_M x 2 BLOCK_N: 128 x 64 there is as big as 128 x 128 in `_down` (and 128 x 128
# there, 255 registers a thread at 8 warps, is the largest entry).
# Decode (bandwidth-bound on the weights, ~1 row per touched expert at 64 tokens): block_m 16 (tl.dot's smallest),
# wide K tiles and deeper pipelines keep more weight bytes in flight per SM. Prefill (compute-bound): 64x128 and
# 128x128 tiles with 8 warps, 3-4 stages (a 128x64x64 gate_up stage is 48 KB of shared memory in bf16: 4 fit in
# 227 KB). Every entry compiles for sm_90 with triton 3.6 (benchmarks/compile_check.py) within 227 KB.
SWEEP_CONFIGS = {
    "decode": [
        None,  # the default (`_DEFAULT_CONFIGS["decode", fmt]`): the reference of the correctness check
        _cfg(16, 64, 128, 4, 3),
        _cfg(16, 64, 128, 4, 4),
        _cfg(16, 64, 256, 4, 3),
        _cfg(16, 64, 256, 8, 3),
        _cfg(16, 128, 128, 4, 3),
        _cfg(16, 128, 128, 8, 4),
        _cfg(16, 32, 128, 4, 4),
        _cfg(16, 32, 256, 4, 3),
        _cfg(16, 64, 64, 4, 5),
        _cfg(16, 64, 128, 8, 5),
        _cfg(32, 64, 128, 4, 4),
        _cfg(16, 64, 128, 4, 4, reduce="sorted"),
        _cfg(16, 64, 256, 4, 3, reduce="sorted"),
    ],
    "prefill": [
        None,  # the default (`_DEFAULT_CONFIGS["prefill", fmt]`)
        _cfg(64, 128, 64, 4, 3),
        _cfg(64, 128, 64, 8, 3),
        _cfg(64, 128, 64, 8, 4),
        _cfg(64, 64, 64, 8, 4, down=(128, 64, 8, 4)),
        _cfg(128, 64, 64, 8, 3, down=(128, 64, 8, 3)),
        _cfg(128, 64, 64, 8, 4, down=(128, 64, 8, 4)),
        _cfg(128, 128, 64, 8, 3),
        _cfg(128, 64, 128, 8, 3, down=(128, 128, 8, 3)),
        _cfg(128, 64, 64, 4, 4, down=(128, 64, 4, 4)),
        _cfg(64, 64, 128, 8, 3, down=(128, 128, 8, 3)),  # gate_up BLOCK_N 128 here: 240 KB of bf16 stages, over 227
        _cfg(128, 32, 64, 4, 4, down=(64, 64, 4, 4)),
        _cfg(128, 64, 64, 8, 4, reduce="sorted", down=(128, 64, 8, 4)),
        _cfg(64, 128, 64, 8, 3, reduce="sorted"),
        # Row groups (bf16 only, "expert" order): each weight tile is loaded once for up to row_tiles row tiles
        # of its expert (K3 at 8K tokens: ~146 rows an expert, three 64-row tiles). Fewer accumulators fit: gate_up
        # 64-wide (two 64 x 64 a row tile), down 128-wide; 183-255 registers a thread at 8 warps, no spills.
        _cfg(64, 64, 64, 8, 4, down=(128, 64, 8, 4), row_tiles=(3, 3)),
        _cfg(64, 64, 64, 8, 4, down=(128, 64, 8, 4), row_tiles=(3, 1)),
        _cfg(64, 64, 64, 8, 4, down=(128, 64, 8, 4), row_tiles=(3, 3), reduce="sorted"),
        _cfg(64, 64, 64, 8, 4, down=(128, 64, 8, 4), row_tiles=(3, 1), reduce="sorted"),
        _cfg(64, 128, 64, 8, 3, down=(256, 64, 8, 3), row_tiles=(2, 2)),
        _cfg(64, 64, 64, 8, 3, down=(128, 64, 8, 3), row_tiles=(4, 4)),
        # The weights (and down's h) through Hopper TMA descriptors: one bulk copy a tile instead of per-thread
        # addresses (x, gathered by token, keeps its pointer loads).
        _cfg(64, 128, 64, 8, 4, tma=True),
        _cfg(64, 128, 64, 8, 3, tma=True),
        _cfg(64, 128, 64, 8, 4, reduce="sorted", tma=True),
        _cfg(64, 64, 64, 8, 4, down=(128, 64, 8, 4), row_tiles=(3, 1), tma=True),
        _cfg(64, 64, 64, 8, 4, down=(128, 64, 8, 4), row_tiles=(3, 3), reduce="sorted", tma=True),
        _cfg(128, 128, 64, 8, 3, tma=True),
        # More bytes in flight an SM (one 8-warp block an SM holds 3 of its 4 stages in flight): 5 stages of 64-deep
        # K, or 8-10 of 32-deep K, within 227 KB of shared memory.
        _cfg(64, 128, 64, 8, 5),
        _cfg(64, 128, 32, 8, 8),
        _cfg(64, 64, 32, 8, 10, down=(128, 32, 8, 10), row_tiles=(3, 3), reduce="sorted"),
        _cfg(64, 64, 64, 8, 5, down=(128, 64, 8, 5), row_tiles=(3, 3), reduce="sorted"),
    ],
}


def _cfg_name(cfg, regime, fmt, order=None):
    if cfg is None:
        return f"default ({_cfg_name(_DEFAULT_CONFIGS[regime, fmt], regime, fmt, order)})"
    g, d = cfg["gate_up"], cfg["down"]
    def tile(c):
        rows = f" r{c['row_tiles']}" if c.get("row_tiles", 1) > 1 else ""
        return f"{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}{rows}{' tma' if c.get('tma') else ''}"

    order = order or cfg.get("order") or _DEFAULT_CONFIGS[regime, fmt]["order"]
    return f"m{cfg['block_m']} gate_up {tile(g)} / down {tile(d)} {cfg['reduce']} {order}"


def _kernel_ms(fn, calls=3):
    """Device ms a call of `_gate_up_situ` and `_down` (torch.profiler over `calls` calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = {ev.key: ev.device_time_total for ev in prof.key_averages()}
    return [total.get(name, 0.0) / calls / 1e3 for name in ("_gate_up_situ", "_down")]


def sweep(args, E, k, D, I, dev, fp4, gate_up, down):
    """Time `SWEEP_CONFIGS` of the token count's regime for MXFP4 and bf16, each in every program order of
    `--orders`; one markdown row per config."""
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "CPU smoke run (timings meaningless)"
    print(f"\nMoE experts config sweep, E={E}, top-{k}, D={D}, I={I}, {gpu}, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    print("config: m<block_m>, per kernel <BLOCK_N>x<BLOCK_K> w<num_warps> s<num_stages>, r<row_tiles> if > 1, "
          "tma if on, then the reduce and the program order; rel err: "
          "max abs difference to the default config's output over its max\n", flush=True)
    print("| tokens | format | config | ms (best round) | spread over rounds | gate_up / down ms (profiler) | "
          "weight GB/s | TFLOP/s | vs grouped_mm | rel err vs default | best |", flush=True)
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for N in args.tokens:
        x, top_idx, top_w, touched = _tokens(N, E, k, D, dev)
        flops = 2 * N * k * (3 * D * I)
        peer = _bench(lambda: grouped_mm_experts(x, top_idx, top_w, gate_up, down), dev)
        for fmt, weights in (("MXFP4", fp4), ("bf16", dict(gate_up=gate_up, down=down))):
            if fmt.lower() not in args.formats.lower().split(","):
                continue
            regime = "decode" if _is_decode(N * k, E, fmt == "MXFP4") else "prefill"  # the kernel's own rule
            wbytes = touched * 3 * D * I * (0.5 + 1 / 32 if fmt == "MXFP4" else 2)
            ref = moe_experts_triton(x, top_idx, top_w, **weights).float()
            runs = []  # (name, fn, err) of the configs that compiled and ran
            for cfg, order in [(c, o) for c in SWEEP_CONFIGS[regime] for o in args.orders.split(",")]:
                if (_dense_only(cfg) and fmt == "MXFP4") or (_grouped(cfg) and order != "expert"):
                    continue
                name = _cfg_name(cfg, regime, "mxfp4" if fmt == "MXFP4" else "dense", order)
                cfg = {**(cfg or {}), "order": order}
                try:
                    fn = lambda cfg=cfg: moe_experts_triton(x, top_idx, top_w, **weights, config=cfg)  # noqa: E731
                    err = ((fn().float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: report the config, go on
                    msg = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")[:160]
                    print(f"| {N} | {fmt} | {name} | FAILED: {msg} | | | | | | |", flush=True)
                    continue
                runs.append((name, fn, err))
            # Rounds interleave the configs: identical configs timed back to back differed by up to 7 % on an H100
            # (eighteenth session), so a config's figure is its best round and the spread is reported beside it.
            times = {name: [] for name, _, _ in runs}
            for _ in range(args.rounds):
                for name, fn, _ in runs:
                    times[name].append(_bench(fn, dev))
            results = []
            for name, fn, err in runs:
                ms = min(times[name])
                spread = f"{100 * (max(times[name]) / ms - 1):.0f} %" if args.rounds > 1 else ""
                kern = " / ".join(f"{v:.2f}" for v in _kernel_ms(fn)) if args.kernel_times and dev == "cuda" else ""
                results.append((ms, name))
                print(f"| {N} | {fmt} | {name} | {ms:.3f} | {spread} | {kern} | {wbytes / ms / 1e6:.0f} | "
                      f"{flops / ms / 1e9:.1f} | {peer / ms:.2f}x | {err:.1e}{' (!)' if err > 2e-2 else ''} | |",
                      flush=True)
            if results:
                ms, name = min(results)
                print(f"| {N} | {fmt} | **best: {name}** | **{ms:.3f}** | | | {wbytes / ms / 1e6:.0f} | "
                      f"{flops / ms / 1e9:.1f} | {peer / ms:.2f}x | | **best** |", flush=True)
        gbs = touched * 3 * D * I * 2 / peer / 1e6
        print(f"| {N} | bf16 | torch._grouped_mm (for scale) | {peer:.3f} | | | {gbs:.0f} | "
              f"{flops / peer / 1e9:.1f} | 1.00x | | |", flush=True)


GLUON_SWEEP = {"default (2 buffers; K step 4, 2 at 64 slots)": {}, "3 buffers": dict(stages=3),
               "4 buffers": dict(stages=4),
               "K step 2": dict(k_step=2), "3 buffers, K step 2": dict(stages=3, k_step=2),
               "16 token slots": dict(token_slots=16), "32 token slots": dict(token_slots=32),
               "64 token slots": dict(token_slots=64), "64 token slots, K step 4": dict(token_slots=64, k_step=4)}
# `--ws-sweep`: launches of the warp-specialised kernels on bf16 experts (`gluon_moe_ws`); "TMA a + b" = every operand
# by TMA, a token stages and b weight stages. The first is `_WS_DENSE_LAUNCH`, what "ours bf16" runs at prefill sizes;
# "tokens as N" = `tokens_n` (the expert's token rows as the products' N side, padded to 16 rows, not 64), "weights in
# registers" = its `w_regs`.
WS_SWEEP = {"TMA 4 + 6 (default)": dict(stages=4, w_stages=6), "TMA 4 + 4": dict(stages=4, w_stages=4),
            "TMA 4 + 5": dict(stages=4, w_stages=5), "TMA 5 + 4": dict(stages=5, w_stages=4),
            "TMA 3 + 6": dict(stages=3, w_stages=6), "cp.async tokens 4 / 2": {},
            "tokens as N, TMA 4 + 6": dict(stages=4, w_stages=6, tokens_n=True),
            "tokens as N, TMA 4 + 4": dict(stages=4, w_stages=4, tokens_n=True),
            "tokens as N, TMA 3 + 6": dict(stages=3, w_stages=6, tokens_n=True),
            "tokens as N, weights in registers, TMA 4 + 6": dict(stages=4, w_stages=6, tokens_n=True, w_regs=True),
            "tokens as N, weights in registers, TMA 5 + 4": dict(stages=5, w_stages=4, tokens_n=True, w_regs=True)}


def random_mxfp4(E, D, I, dev):
    """Random MXFP4 experts in the released layout (`moe_experts_triton`'s keywords): uniform E2M1 bytes, E8M0 scales
    around 2**-7 so that the dequantised weights are ~N(0, 0.01)-sized."""
    return dict(w13_packed=torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, device=dev),
                w13_scale=torch.randint(119, 123, (E, 2 * I, D // 32), dtype=torch.uint8, device=dev),
                w2_packed=torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device=dev),
                w2_scale=torch.randint(119, 123, (E, D, I // 32), dtype=torch.uint8, device=dev))


def gluon_sweep(args, E, k, D, I, dev, fp4, gate_up, down, ws=False):
    """The Gluon MXFP4 kernels at each `GLUON_SWEEP` launch (or, `ws`, the warp-specialised kernels on bf16 experts
    at each `WS_SWEEP` launch), `grouped_mm` and the Triton tiles beside them."""
    if ws:
        from k3_kernels.moe.gluon_moe_ws import moe_experts_gluon_ws

        launches, label, tiles = WS_SWEEP, "Gluon ws bf16", {"gate_up": gate_up, "down": down, "config": {"ws": False}}

        def run(x, top_idx, top_w, **kw):
            return moe_experts_gluon_ws(x, top_idx, top_w, gate_up=gate_up, down=down, **kw)
    else:
        from k3_kernels.moe.gluon_moe import moe_experts_gluon

        launches, label, tiles = GLUON_SWEEP, "Gluon MXFP4", dict(fp4, config={"gluon": False})
        w = (fp4["w13_packed"], fp4["w13_scale"], fp4["w2_packed"], fp4["w2_scale"])

        def run(x, top_idx, top_w, **kw):
            return moe_experts_gluon(x, top_idx, top_w, *w, **kw)
    print(f"{label} kernels, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for N in args.tokens:
        x, top_idx, top_w, touched = _tokens(N, E, k, D, dev)
        paths = {"torch._grouped_mm bf16": lambda: grouped_mm_experts(x, top_idx, top_w, gate_up, down),
                 f"Triton {'bf16' if ws else 'MXFP4'} tiles": lambda: moe_experts_triton(x, top_idx, top_w, **tiles)}
        for name, kw in launches.items():
            paths[f"{label}, {name}"] = (lambda kw: lambda: run(x, top_idx, top_w, **kw))(kw)
        want = run(x, top_idx, top_w, **next(iter(launches.values()))).float()
        for name, kw in launches.items():
            try:
                err = ((run(x, top_idx, top_w, **kw).float() - want).abs().max() / want.abs().max()).item()
            except Exception as exc:  # noqa: BLE001 - one launch must not cost the others' figures
                err = f"{type(exc).__name__}: {exc}"
            # bf16 outputs whose fp32 atomics add in another order (other tiles): a rounding step apart at most
            if not (isinstance(err, float) and err < 1e-2):
                print(f"{label} {name} N={N}: left out, rel err / error against the first launch: {err}")
                del paths[f"{label}, {name}"]
        times = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, fn in paths.items():
                times[name].append(_bench(fn, dev))
        peer = times["torch._grouped_mm bf16"]
        flops = 2 * N * k * (3 * D * I)
        print(f"\n{N} tokens, {touched} experts touched, {args.rounds} rounds\n")
        print("| path | best ms | spread | TFLOP/s (best) | vs grouped_mm: best / median / worst round |")
        print("| --- | --- | --- | --- | --- |")
        for name, t in times.items():
            med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
            print(f"| {name} | {min(t):.3f} | {100 * (max(t) / min(t) - 1):.1f} % | {flops / min(t) / 1e9:.1f} | "
                  f"{min(peer) / min(t):.2f}x / {med(peer) / med(t):.2f}x / {max(peer) / max(t):.2f}x |", flush=True)
        if N == 64 and not ws:
            for name, fn in paths.items():
                if name.startswith("Gluon"):
                    print(f"{name}: kernels {_kernel_ms(fn)}")
    if ws and args.probe:
        compute_probe(args, k, D, I, dev, run)


def compute_probe(args, k, D, I, dev, run):
    """`--ws-sweep --probe`: what the warp-specialised kernels reach when the weights are not the bound. N * k
    one-assignment tokens all go to expert 0: its weights (44 MB of gate_up rows) stay in L2 across the programs
    working on it at once, every tile is full, and no two rows of a tile add into one output row."""
    print("\nCompute probe: every token to expert 0 (weights L2-resident, full tiles)\n")
    print("| rows | launch | best ms | TFLOP/s |")
    print("| --- | --- | --- | --- |")
    for N in args.tokens:
        rows = N * k
        x = torch.randn(rows, D, device=dev, dtype=torch.bfloat16)
        top_idx = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        top_w = torch.ones(rows, 1, device=dev)
        for name, kw in WS_SWEEP.items():
            if kw.get("w_stages") in (None, 6):  # the ring depths the sweep defaults to, and the cp.async launch
                try:
                    ms = min(_bench(lambda kw=kw: run(x, top_idx, top_w, **kw), dev) for _ in range(args.rounds))
                except Exception as exc:  # noqa: BLE001 - one launch must not cost the others' figures
                    print(f"| {rows} | {name} | {type(exc).__name__}: {exc} | |")
                    continue
                print(f"| {rows} | {name} | {ms:.3f} | {2 * rows * 3 * D * I / ms / 1e9:.1f} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 8192])
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--dims", type=int, nargs=2, default=[3584, 3072], metavar=("D", "I"),
                    help="latent width (routed_expert_hidden_size) and expert width (moe_intermediate_size)")
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke run of the script under TRITON_INTERPRET=1")
    ap.add_argument("--loop-max-tokens", type=int, default=8192, help="skip the Python loop above this many tokens")
    ap.add_argument("--sweep", action="store_true", help="time our kernel over SWEEP_CONFIGS instead of the paths")
    ap.add_argument("--orders", default="expert,tile", help="program orders the sweep runs each config in")
    ap.add_argument("--formats", default="mxfp4,bf16", help="weight formats the sweep times")
    ap.add_argument("--rounds", type=int, default=1, help="sweep: time every config this many times, interleaved")
    ap.add_argument("--kernel-times", action="store_true", help="sweep: add each kernel's time (torch.profiler)")
    ap.add_argument("--gluon-sweep", action="store_true", help="time the Gluon decode kernels' launch overrides")
    ap.add_argument("--ws-sweep", action="store_true", help="time the warp-specialised bf16 kernels' launches")
    ap.add_argument("--probe", action="store_true", help="--ws-sweep: then their compute ceiling (one expert)")
    args = ap.parse_args()
    # top-k capped at the expert count, so a smoke run with few experts keeps the default --top-k
    E, k, (D, I), dev = args.experts, min(args.top_k, args.experts), args.dims, args.device
    peak_tbs, peak_tflops = copy_tbs(dev), matmul_tflops(dev)  # before the weights fill the card
    torch.manual_seed(0)
    fp4 = random_mxfp4(E, D, I, dev)
    w13p, w13s, w2p, w2s = fp4.values()
    # their exact bf16
    gate_up = torch.empty(E, 2 * I, D, dtype=torch.bfloat16, device=dev)
    down = torch.empty(E, D, I, dtype=torch.bfloat16, device=dev)
    for e in range(E):  # dequantise expert by expert: the fp32 temporaries of all 896 would not fit
        gate_up[e] = dequantize_mxfp4(w13p[e], w13s[e])
        down[e] = dequantize_mxfp4(w2p[e], w2s[e])
    if args.ws_sweep or (args.sweep and "mxfp4" not in args.formats.lower().split(",")):
        del fp4, w13p, w13s, w2p, w2s  # 16 GB: room for prefill's activations next to 59 GB of bf16 on an 80 GB card
        fp4 = None
    if args.sweep:
        return sweep(args, E, k, D, I, dev, fp4, gate_up, down)
    if args.gluon_sweep:
        return gluon_sweep(args, E, k, D, I, dev, fp4, gate_up, down)
    if args.ws_sweep:
        return gluon_sweep(args, E, k, D, I, dev, fp4, gate_up, down, ws=True)
    rows = []
    for N in args.tokens:
        x, top_idx, top_w, touched = _tokens(N, E, k, D, dev)
        paths = {
            "ours MXFP4": lambda: moe_experts_triton(x, top_idx, top_w, **fp4),
            "ours bf16": lambda: moe_experts_triton(x, top_idx, top_w, gate_up=gate_up, down=down),
            "torch._grouped_mm bf16": lambda: grouped_mm_experts(x, top_idx, top_w, gate_up, down),
        }
        if dev == "cuda" and torch.cuda.get_device_capability()[0] == 9:
            from k3_kernels.moe.gluon_moe_ws import moe_experts_gluon_ws

            # The Gluon W4A16 kernels (`k3_kernels.moe.gluon_moe`), and the Triton ones they replace.
            paths["ours MXFP4, Gluon"] = lambda: moe_experts_triton(x, top_idx, top_w, **fp4, config={"gluon": True})
            paths["ours MXFP4, Triton"] = lambda: moe_experts_triton(x, top_idx, top_w, **fp4,
                                                                      config={"gluon": False})
            if N * k >= _WS_MIN_ROWS * E:  # "ours bf16" is the warp-specialised kernels there (`gluon_moe_ws`)
                paths["ours bf16, Triton tiles"] = lambda: moe_experts_triton(x, top_idx, top_w, gate_up=gate_up,
                                                                           down=down, config={"ws": False})
                paths["ours MXFP4, warp-specialised"] = lambda: moe_experts_triton(x, top_idx, top_w, **fp4,
                                                                                config={"ws": True})
                # "ours bf16" takes every operand by TMA (`_WS_DENSE_LAUNCH`); the kernels' own default launch
                # gathers the token rows by cp.async instead
                paths["ours bf16, warp-specialised, cp.async tokens"] = lambda: moe_experts_gluon_ws(
                    x, top_idx, top_w, gate_up=gate_up, down=down)
                # the token rows as the products' N side, padded to 16 rows an expert instead of 64 (`tokens_n`)
                paths["ours bf16, warp-specialised, tokens as N"] = lambda: moe_experts_gluon_ws(
                    x, top_idx, top_w, gate_up=gate_up, down=down, **_WS_DENSE_LAUNCH, tokens_n=True)
        if N <= args.loop_max_tokens:
            paths["per-expert loop bf16"] = lambda: loop_experts(x, top_idx, top_w, gate_up, down)
        s = slice(0, min(N, 4))  # reference on a few tokens (fp32 over the touched experts)
        ref = moe_experts(x[s].float(), top_idx[s], top_w[s], gate_up, down)
        for name, fn in paths.items():
            err = ((fn()[s].float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, f"{name} N={N}: rel err {err}"
        flops = 2 * N * k * (3 * D * I)
        if dev == "cuda" and not _is_decode(N * k, E, False):  # not a path: no output to check
            paths["torch._grouped_mm bf16, the two GEMMs alone"] = grouped_mm_gemms(x, top_idx, gate_up, down)
        for name, fn in paths.items():
            ms = _bench(fn, dev)
            wbytes = touched * 3 * D * I * (0.5 + 1 / 32 if "MXFP4" in name else 2)
            rows.append((N, touched, name, ms, wbytes / ms / 1e6, flops / ms / 1e9))  # GB/s, TFLOP/s
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "CPU smoke run (timings meaningless)"
    print(f"\nMoE experts, E={E}, top-{k}, D={D}, I={I}, {gpu}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"expert weights: {w13p.nbytes + w13s.nbytes + w2p.nbytes + w2s.nbytes:.3e} bytes MXFP4, "
          f"{gate_up.nbytes + down.nbytes:.3e} bytes bf16\n")
    print(f"| tokens | experts touched | path | ms | weight GB/s | % of {peak_tbs:.2f} TB/s | TFLOP/s | "
          f"% of {peak_tflops:.0f} | vs grouped_mm |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    peer = {N: ms for N, _, name, ms, _, _ in rows if name == "torch._grouped_mm bf16"}
    for N, t, name, ms, gbs, tf in rows:
        print(f"| {N} | {t} | {name} | {ms:.3f} | {gbs:.0f} | {100 * gbs / 1e3 / peak_tbs:.0f} % | {tf:.1f} | "
              f"{100 * tf / peak_tflops:.1f} % | {peer[N] / ms:.2f}x |")
    for path in ("ours MXFP4", "ours MXFP4, Gluon", "ours MXFP4, Triton"):
        fp4_ms = {N: ms for N, _, name, ms, _, _ in rows if name == path}
        if 64 in fp4_ms:
            print(f"\n{path} vs torch._grouped_mm bf16 at 64 tokens: {peer[64] / fp4_ms[64]:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
