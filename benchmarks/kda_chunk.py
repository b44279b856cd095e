"""KDA prefill (chunked) forward on one GPU: our Triton kernels (16-token chunks, split; 64-token chunks of
16-token sub-tiles) vs fla's `chunk_kda`, same inputs, same flags.

Shapes: B = 1, H = 96, K = V = 128, bf16 q/k/v/z/beta, fp32 A_log/dt_bias/initial state; T = 8K, 32K (128K
with --long) and a FlashKDA-style varlen batch (8 sequences of mixed lengths summing to 32K). All run with the
in-kernel gate (`lower_bound * sigmoid(exp(A_log) * (z + dt_bias))`, lower_bound = -5), in-kernel beta sigmoid
and q/k L2 norm. First a correctness check on small shapes against the fp32 torch reference (and fla if
present); then the timing table (`triton.testing.do_bench` median, ms), ours vs fla, and the percentage of the
bandwidth ceiling (about 1.28 KB of unavoidable traffic per token-head, notes/performance.md, at the copy bandwidth
measured in the same run: 0.24 ms at T = 8K on the H200, 0.34 on the H100); below it one correctness line per
timed case (rel err = max|a - b| / max|b| of o and the final state against fla at the full size).

    pip install -e . && python benchmarks/kda_chunk.py --sweep     # with fla (its first call per shape
                                                                   # autotunes for minutes)
    python benchmarks/kda_chunk.py --no-fla --long --chunk-size 64 --block-v 32 --num-warps 4 --num-stages 2
    TRITON_INTERPRET=1 python benchmarks/kda_chunk.py --check-only --device cpu --no-fla   # CPU smoke
    python benchmarks/kda_chunk.py --no-fla --stored    # output="stored" vs "fused" at T = 8K, per-kernel ms

--sweep first times the 64-token kernel over block_v x num_warps x num_stages (state loop), then prep_num_warps
and state_dot at the best of those, and the 16-token split kernel over block_v x num_warps, all at T = 8K; the
best configuration of each is then used for the table (unless given on the command line).
"""

from __future__ import annotations

import argparse
import functools
import math

import torch
import triton
from ceilings import copy_tbs

from k3_kernels.kda import reference as R
from k3_kernels.kda.triton_chunk import chunk_kda_fwd

print = functools.partial(print, flush=True)  # noqa: A001 - progress visible when piped (device runs)

H, K, V = 96, 128, 128
CEIL_BYTES_PER_TOKEN_HEAD = 1280  # the fused layer's unavoidable traffic (notes/performance.md)
DEV = "cuda"
FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
# varlen case: 8 sequences, 32K total, boundaries at and off 64-token chunk edges
VARLEN_LENS = [1000, 7168, 2111, 5120, 3001, 6144, 4096, 4128]


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def inputs(T, H=H, K=K, V=V, seed=0, N=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    dev = dict(device=DEV, generator=gen)
    q = torch.randn(1, T, H, K, **dev).bfloat16()
    k = torch.randn(1, T, H, K, **dev).bfloat16()
    v = torch.randn(1, T, H, V, **dev).bfloat16()
    z = torch.randn(1, T, H, K, **dev).bfloat16()
    beta = torch.randn(1, T, H, **dev).bfloat16()
    A_log = torch.randn(H, **dev) * 0.5
    dt_bias = torch.randn(H * K, **dev) * 0.5
    h0 = torch.randn(N, H, K, V, **dev) * 0.1
    return q, k, v, z, beta, A_log, dt_bias, h0


def ours(x, cu=None, chunk_size=64, **tune):
    q, k, v, z, beta, A_log, dt_bias, h0 = x
    split = tune.pop("split", chunk_size == 16)
    return chunk_kda_fwd(q, k, v, z, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                         A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size, split=split, **FLAGS, **tune)


def fla_fn():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk
    except ImportError:
        return None

    def run(x, cu=None):
        q, k, v, z, beta, A_log, dt_bias, h0 = x
        return fla_chunk(q, k, v, z, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                         A_log=A_log, dt_bias=dt_bias, safe_gate=True, **FLAGS)

    return run


def reference(x, cu=None):
    q, k, v, z, beta, A_log, dt_bias, h0 = x
    g = R.kda_gate(z, A_log, dt_bias, lower_bound=-5.0)
    return R.chunk_kda(q.float(), k.float(), v.float(), g, torch.sigmoid(beta.float()), initial_state=h0,
                       output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)


def variants(args):
    """(label, chunk_size, tune kwargs) of our kernels to check and time."""
    out = []
    for c in args.chunk_size:
        tune = dict(TUNE[c])
        out.append((f"ours c{c}{' split' if c == 16 else ''}", c, tune))
        if c == 16 and args.fused16:
            out.append(("ours c16 fused", 16, dict(tune, split=False)))
        if c == 64:  # output="fused" is the 64-token default: the stored-state path beside it
            out.append(("ours c64 stored", 64, dict(tune, output="stored")))
    return out


def check(fla, args):
    # tolerance rule of the tests: 2e-2 for bf16 inputs, 3e-2 with a low-precision chunk-64 option
    lowp = TUNE[64].get("state_dot") == "bf16" or bool(TUNE[64].get("lowp_buffers"))
    tol = 3e-2 if lowp else 2e-2
    print(f"## correctness (small shapes, H = 4, vs fp32 torch reference, tolerance {tol:.0e})\n")
    print(f"configs: chunk 16 {TUNE[16] or 'defaults'}, chunk 64 {TUNE[64] or 'defaults'}\n")
    for T, cu in ((300, None), (300, [0, 5, 77, 150, 300]), (300, [0, 64, 65, 128, 300])):
        N = 1 if cu is None else len(cu) - 1
        x = inputs(T, H=4, N=N, seed=1)
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
        o_r, S_r = reference(x, cu=cu_t)
        line, ok = f"T={T} cu_seqlens={cu}:", True
        for label, c, tune in variants(args):
            o, S = ours(x, cu=cu_t, chunk_size=c, **tune)
            line += f" {label} o {rel(o, o_r):.2e} S {rel(S, S_r):.2e};"
            ok = ok and rel(o, o_r) <= tol and rel(S, S_r) <= tol
        if fla is not None:
            o_f, S_f = fla(x, cu=None if cu is None else cu_t.long())
            line += f" fla o {rel(o_f, o_r):.2e} S {rel(S_f, S_r):.2e}"
        print(line, "OK" if ok else "FAIL")
        if not ok:
            raise SystemExit("correctness check failed: not timing")
    print()


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def try_bench(fn):
    try:
        return bench(fn)
    except Exception as e:  # e.g. out of registers / shared memory for a config
        print(f"    (config failed: {type(e).__name__}: {str(e)[:100]})")
        return math.inf


def sweep(args):
    x = inputs(8192)
    fmt = lambda t: "failed" if t == math.inf else f"{t:.3f}"  # noqa: E731
    if 64 in args.chunk_size:
        print("## sweep, chunk 64, T = 8K (state loop config; prep_num_warps, state_dot, lowp_buffers at defaults)\n")
        print("| block_v | num_warps | num_stages | ms |\n|---|---|---|---|")
        best = (math.inf, None)
        for bv in (16, 32, 64, 128):
            for nw in (4, 8):
                for ns in (1, 2, 3):
                    t = try_bench(lambda: ours(x, chunk_size=64, block_v=bv, num_warps=nw, num_stages=ns))
                    print(f"| {bv} | {nw} | {ns} | {fmt(t)} |")
                    best = min(best, (t, dict(block_v=bv, num_warps=nw, num_stages=ns)), key=lambda p: p[0])
        cfg = best[1] or {}
        print("\n| prep_num_warps | state_dot | lowp_buffers | ms |\n|---|---|---|---|")
        best2 = (math.inf, None)
        for pw in (1, 2):
            for sd in ("tf32", "bf16"):
                for lp in (False, True):
                    t = try_bench(lambda: ours(x, chunk_size=64, prep_num_warps=pw, state_dot=sd, lowp_buffers=lp,
                                               **cfg))
                    print(f"| {pw} | {sd} | {lp} | {fmt(t)} |")
                    # the low-precision options cost accuracy (tests: <= 3e-2 instead of 2e-2): only report
                    # them as best if each one buys > 5 %
                    key = t * (1.05 if sd == "bf16" else 1.0) * (1.05 if lp else 1.0)
                    if key < best2[0]:
                        best2 = (key, dict(prep_num_warps=pw, state_dot=sd, lowp_buffers=lp))
        cfg.update(best2[1] or {})
        print(f"\nbest chunk-64 config: {cfg}\n")
        for n, val in cfg.items():
            if getattr(args, n, None) is None:
                TUNE[64][n] = val
    if 16 in args.chunk_size:
        print("## sweep, chunk 16 split, T = 8K\n")
        print("| block_v | num_warps | ms |\n|---|---|---|")
        best = (math.inf, None)
        for bv in (16, 32, 64):
            for nw in (2, 4, 8):
                t = try_bench(lambda: ours(x, chunk_size=16, block_v=bv, num_warps=nw))
                print(f"| {bv} | {nw} | {fmt(t)} |")
                best = min(best, (t, dict(block_v=bv, num_warps=nw)), key=lambda p: p[0])
        print(f"\nbest chunk-16 config: {best[1]}\n")
        for n, val in (best[1] or {}).items():
            if getattr(args, n, None) is None:
                TUNE[16][n] = val


TUNE = {16: {}, 64: {}}

_KERNELS = ("_kda_chunk_prep_kernel", "_kda_chunk64_prep_kernel", "_kda_chunk64_wu_kernel", "_kda_chunk64_state_kernel",
            "_kda_chunk_fwd_kernel", "_kda_chunk_output_kernel")


def breakdown(fn, iters=20):
    """Per-kernel ms of one call of fn: torch.cuda.Event pairs around every launch of our Triton kernels
    (their `.run` wrapped on the instance), averaged over iters calls after a warm-up call."""
    import k3_kernels.kda.triton_chunk as tc

    events, saved = [], {}
    for name in _KERNELS:
        kern = getattr(tc, name)
        saved[name] = kern.run

        def run(*a, _name=name, _orig=kern.run, **kw):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            r = _orig(*a, **kw)
            e1.record()
            events.append((_name, e0, e1))
            return r

        kern.run = run
    try:
        fn()
        torch.cuda.synchronize()
        events.clear()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    finally:
        for name, run in saved.items():
            getattr(tc, name).run = run
    ms = {}
    for name, e0, e1 in events:
        ms[name] = ms.get(name, 0.0) + e0.elapsed_time(e1) / iters
    return ms


def stored_sweep(args, fla):
    """--stored: at T = 8K, fla vs fused 16 / 64 vs output="stored" 16 / 64 over block_v x state num_warps x
    output num_warps, then a per-kernel breakdown of the best config of each variant."""
    x = inputs(8192)
    fmt = lambda t: "failed" if t == math.inf else f"{t:.3f}"  # noqa: E731
    print("## output='stored' vs 'fused', T = 8K (H = 96, K = V = 128, bf16)\n", flush=True)
    best = {}
    if fla is not None:
        fla(x)  # autotune outside the timing
        best["fla"] = (bench(lambda: fla(x)), {})
        print(f"fla: {best['fla'][0]:.3f} ms\n", flush=True)
    for c in (16, 64):
        tune = dict(TUNE[c], output="fused")
        best[f"fused-{c}"] = (try_bench(lambda: ours(x, chunk_size=c, **tune)), tune)
        print(f"fused-{c} {tune or 'defaults'}: {fmt(best[f'fused-{c}'][0])} ms", flush=True)
    print("\n| variant | block_v | state num_warps | out num_warps | ms |\n|---|---|---|---|---|", flush=True)
    for c in (16, 64):
        b = (math.inf, None)
        for bv in (32, 64):
            for nw in (2, 4, 8):
                for onw in (4, 8):
                    cfg = dict(output="stored", block_v=bv, num_warps=nw, out_num_warps=onw)
                    t = try_bench(lambda: ours(x, chunk_size=c, **cfg))
                    print(f"| stored-{c} | {bv} | {nw} | {onw} | {fmt(t)} |", flush=True)
                    b = min(b, (t, cfg), key=lambda p: p[0])
        best[f"stored-{c}"] = b
    print("\n| variant | best config | ms | " + " | ".join(n.replace("_kda_", "") for n in _KERNELS) +
          " |\n|---|---|---|" + "---|" * len(_KERNELS), flush=True)
    for name, (t, cfg) in best.items():
        if name == "fla" or cfg is None or t == math.inf:
            print(f"| {name} | - | {fmt(t)} |" + " - |" * len(_KERNELS), flush=True)
            continue
        c = int(name.split("-")[1])
        ms = breakdown(lambda: ours(x, chunk_size=c, **cfg))
        print(f"| {name} | {cfg} | {t:.3f} | " + " | ".join(f"{ms[n]:.3f}" if n in ms else "-" for n in _KERNELS)
              + " |", flush=True)
    # correctness of the best stored configs at the timed size, against fused-64 (and fla when present)
    o_f, S_f = ours(x, chunk_size=64, **dict(TUNE[64], output="fused"))
    ref = fla(x) if fla is not None else None
    for c in (16, 64):
        cfg = best[f"stored-{c}"][1]
        if cfg is None:
            continue
        o, S = ours(x, chunk_size=c, **cfg)
        line = f"stored-{c} vs fused-64: o {rel(o, o_f):.2e} S {rel(S, S_f):.2e}"
        if ref is not None:
            line += f"; vs fla: o {rel(o, ref[0]):.2e} S {rel(S, ref[1]):.2e}"
        print("-", line, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-fla", action="store_true", help="skip fla (its first call per shape autotunes for minutes)")
    ap.add_argument("--long", action="store_true", help="add T = 128K")
    ap.add_argument("--chunk-size", type=int, nargs="+", default=[16, 64], choices=[16, 64],
                    help="our kernels to time (16 = 16-token split path, 64 = 64-token path)")
    ap.add_argument("--fused16", action="store_true", help="also time the fused (split=False) 16-token kernel")
    ap.add_argument("--block-v", type=int, default=None,
                    help="V tile of our state kernels (default 128 at chunk 64; at chunk 16 64 stored, 32 fused)")
    ap.add_argument("--num-warps", type=int, default=None,
                    help="num_warps of our state loop (default 8 at block_v 128, else 4)")
    ap.add_argument("--num-stages", type=int, default=None, help="num_stages of the chunk-64 state loop")
    ap.add_argument("--prep-num-warps", type=int, default=None, help="num_warps of the chunk-64 prep (inverse) kernel")
    ap.add_argument("--state-dot", default=None, choices=["tf32", "bf16"], help="chunk-64 state products")
    ap.add_argument("--lowp-buffers", action="store_true", default=None, help="chunk-64: kd, Aqk stored in bf16")
    ap.add_argument("--sweep", action="store_true", help="tune our kernels at T = 8K first (see above)")
    ap.add_argument("--bwd", action="store_true", help="also time forward + backward at T = 8K (ours: chunk_kda)")
    ap.add_argument("--stored", action="store_true",
                    help="only the output='stored' vs 'fused' comparison at T = 8K (sweep + per-kernel breakdown)")
    ap.add_argument("--check-only", action="store_true", help="only the small-shape correctness check")
    ap.add_argument("--no-fla-check", action="store_true",
                    help="leave fla out of the small-shape check (its H = 4 shapes autotune separately)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    for n in ("block_v", "num_warps"):
        if getattr(args, n) is not None:
            TUNE[16][n] = TUNE[64][n] = getattr(args, n)
    for n in ("num_stages", "prep_num_warps", "state_dot", "lowp_buffers"):
        if getattr(args, n) is not None:
            TUNE[64][n] = getattr(args, n)
    torch.backends.cuda.matmul.allow_tf32 = False
    fla = None if args.no_fla else fla_fn()
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"GPU {gpu}, torch {torch.__version__}, triton {triton.__version__}, fla {'yes' if fla else 'no'}\n")
    check(None if args.no_fla_check else fla, args)
    if args.check_only:
        return
    if args.stored:
        stored_sweep(args, fla)
        return
    if args.sweep:
        sweep(args)
        check(fla, args)  # again, with the tuned configs

    cases = [("T=8K", 8192, None), ("T=32K", 32768, None)]
    if args.long:
        cases.append(("T=128K", 131072, None))
    cu = [0]
    for n in VARLEN_LENS:
        cu.append(cu[-1] + n)
    cases.append((f"varlen {len(VARLEN_LENS)} seqs, {cu[-1] / 1024:g}K", cu[-1], cu))

    vs = variants(args)
    print(f"configs: chunk 16 {TUNE[16] or 'defaults'}, chunk 64 {TUNE[64] or 'defaults'}\n")
    peak = copy_tbs(DEV)
    print("| case | " + " | ".join(f"{lab} ms" for lab, _, _ in vs) + " | fla ms | " +
          " | ".join(f"fla / {lab}" for lab, _, _ in vs) + f" | best ours % of ceiling (copy {peak:.2f} TB/s) |")
    print("|---" * (2 * len(vs) + 3) + "|")
    notes = []
    for name, T, cu_l in cases:
        N = 1 if cu_l is None else len(cu_l) - 1
        x = inputs(T, N=N)
        cu_t = None if cu_l is None else torch.tensor(cu_l, dtype=torch.int32, device=DEV)
        ts, outs = [], []
        for lab, c, tune in vs:
            outs.append(ours(x, cu=cu_t, chunk_size=c, **tune))
            ts.append(bench(lambda: ours(x, cu=cu_t, chunk_size=c, **tune)))
        t_fla, ref = float("nan"), None
        if fla is not None:
            cu_f = None if cu_t is None else cu_t.long()
            ref = fla(x, cu=cu_f)  # autotune outside the timing
            t_fla = bench(lambda: fla(x, cu=cu_f))
        ceil = CEIL_BYTES_PER_TOKEN_HEAD * T * H / (peak * 1e9)  # ms
        fla_cols = [f"{t_fla / t:.2f}x" if fla is not None else "-" for t in ts]
        print(f"| {name} | " + " | ".join(f"{t:.3f}" for t in ts) +
              f" | {f'{t_fla:.3f}' if fla is not None else '-'} | " + " | ".join(fla_cols) +
              f" | {100 * ceil / min(ts):.0f} % |")
        line = f"{name}:"
        for (lab, _, _), (o, S) in zip(vs, outs):
            if ref is not None:
                line += f" {lab} vs fla: o {rel(o, ref[0]):.2e} S {rel(S, ref[1]):.2e};"
            else:
                line += f" {lab}: finite {bool(torch.isfinite(o).all() and torch.isfinite(S).all())};"
        if len(outs) > 1:
            line += (f" {vs[0][0]} vs {vs[-1][0]}: o {rel(outs[0][0], outs[-1][0]):.2e}"
                     f" S {rel(outs[0][1], outs[-1][1]):.2e}")
        notes.append(line)
        del x, outs, ref
        torch.cuda.empty_cache()
    print("\ncorrectness at the timed sizes (rel err by max norm):\n")
    for line in notes:
        print("-", line)

    if args.bwd:
        from k3_kernels.kda.triton_chunk import chunk_kda

        print("\n| forward + backward, T=8K | ms |\n|---|---|")
        x = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs(8192)]
        do = torch.randn(1, 8192, H, V, device=DEV).bfloat16()

        def fb(fn):
            o, S = fn(x)
            torch.autograd.backward([o, S], [do, torch.zeros_like(S)])

        def ours_ad(x):
            q, k, v, z, beta, A_log, dt_bias, h0 = x
            return chunk_kda(q, k, v, z, beta, initial_state=h0, output_final_state=True, A_log=A_log,
                             dt_bias=dt_bias, **FLAGS)

        try:
            print(f"| ours (`chunk_kda`, default forward) | {bench(lambda: fb(ours_ad)):.2f} |")
        except torch.OutOfMemoryError:
            print("| ours (`chunk_kda`, default forward) | OOM |")
        if fla is not None:
            print(f"| fla | {bench(lambda: fb(fla)):.2f} |")


if __name__ == "__main__":
    main()
