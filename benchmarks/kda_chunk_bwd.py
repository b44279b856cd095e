"""KDA prefill forward + backward on one GPU: our Triton chunk kernels vs fla's `chunk_kda`, same inputs/flags.

Shapes: B = 1, H = 96, K = V = 128, bf16 q/k/v/z/beta, fp32 A_log/dt_bias and h0; T = 8K and 32K. Both run
with the in-kernel gate (`lower_bound * sigmoid(exp(A_log) * (z + dt_bias))`, lower_bound = -5), in-kernel
beta sigmoid and q/k L2 norm. Our forward is `triton_chunk.chunk_kda_fwd`, our backward the Triton core of
`kernels/kda/triton_chunk_bwd.py` (16-token chunks with fp32 and with bf16 stored states, then 64-token chunks, the
default, with and without the forward keeping its buffers for the backward: `keep_buffers`).

First a gradient-agreement check at a small shape: every gradient (q, k, v, z, beta logits, A_log, dt_bias,
h0) of ours and of fla against autograd through the fp32 torch reference (rel_err = max|a - b| / max|b|).
Timing: `triton.testing.do_bench` median of forward + backward (loss <o, do> + <S_T, dS>).

    pip install -e . && python benchmarks/kda_chunk_bwd.py       # fla's first call autotunes for minutes
    python benchmarks/kda_chunk_bwd.py --no-fla
    python benchmarks/kda_chunk_bwd.py --ts 8192 --chunk64-only --no-fla-check   # the default backward vs fla only
    python benchmarks/kda_chunk_bwd.py --no-fla --ts 0 --launches "32,32,4/32,4 16,32,4/32,4 32,32,4/16,4"
        # the 64-token backward's parallel kernels at other launches (inter BK,BV,warps / intra BC,warps), T = 8K
    TRITON_INTERPRET=1 python benchmarks/kda_chunk_bwd.py --check-only --device cpu --no-fla   # CPU smoke
"""

from __future__ import annotations

import argparse

import torch
import triton

from k3_kernels.kda import reference as R
from k3_kernels.kda import triton_chunk as TC
from k3_kernels.kda import triton_chunk_bwd as TB

H, K, V = 96, 128, 128
DEV = "cuda"
FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
NAMES = ("q", "k", "v", "z", "beta", "A_log", "dt_bias", "h0")


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def inputs(T, H=H, K=K, V=V, seed=0, N=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    dev = dict(device=DEV, generator=gen)
    x = [
        torch.randn(1, T, H, K, **dev).bfloat16(),  # q
        torch.randn(1, T, H, K, **dev).bfloat16(),  # k
        torch.randn(1, T, H, V, **dev).bfloat16(),  # v
        torch.randn(1, T, H, K, **dev).bfloat16(),  # z (raw gate input)
        torch.randn(1, T, H, **dev).bfloat16(),  # beta logits
        torch.randn(H, **dev) * 0.5,  # A_log
        torch.randn(H * K, **dev) * 0.5,  # dt_bias
        torch.randn(N, H, K, V, **dev) * 0.1,  # h0
    ]
    return [t.requires_grad_() for t in x]


def step_inputs(T):
    """The K3-shaped inputs of one timed forward + backward at T, with the output and final-state cotangents."""
    return inputs(T), torch.randn(1, T, H, V, device=DEV).bfloat16(), torch.randn(1, H, K, V, device=DEV)


def ours(q, k, v, z, beta, A_log, dt_bias, h0=None, cu=None):
    return TC.chunk_kda(q, k, v, z, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                        A_log=A_log, dt_bias=dt_bias, **FLAGS)


def fla_fn():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk
    except ImportError:
        return None

    def run(q, k, v, z, beta, A_log, dt_bias, h0=None, cu=None):
        return fla_chunk(q, k, v, z, beta, initial_state=h0, output_final_state=True,
                         cu_seqlens=None if cu is None else cu.long(), A_log=A_log, dt_bias=dt_bias,
                         safe_gate=True, **FLAGS)

    return run


def reference(q, k, v, z, beta, A_log, dt_bias, h0=None, cu=None):
    g = R.kda_gate(z, A_log, dt_bias, lower_bound=-5.0)
    return R.chunk_kda(q.float(), k.float(), v.float(), g, torch.sigmoid(beta.float()), initial_state=h0,
                       output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, chunk_size=16)


def grads(fn, x, do, dS, cu=None):
    o, S = fn(*x, cu=cu)
    return torch.autograd.grad([o, S], x, [do.to(o.dtype), dS], allow_unused=True)


def check(fla, small):
    print("## gradient agreement (small shape, rel_err vs autograd through the fp32 torch reference)\n")
    h, d = (2, 16) if small else (4, K)
    ok = True
    for T, cu in ((100 if small else 300, None), (100 if small else 300, [0, 5, 37, 60, 100] if small else
                                                  [0, 5, 77, 150, 300])):
        N = 1 if cu is None else len(cu) - 1
        x = inputs(T, H=h, K=d, V=d, N=N, seed=1)
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
        gen = torch.Generator(device=DEV).manual_seed(2)
        do = torch.randn(1, T, h, d, device=DEV, generator=gen)
        dS = torch.randn(N, h, d, d, device=DEV, generator=gen)
        want = grads(reference, x, do, dS, cu_t)
        rows = [("ours", grads(ours, x, do, dS, cu_t))]
        if fla is not None:
            rows.append(("fla", grads(fla, x, do, dS, cu_t)))
        print(f"T={T} varlen={cu is not None}\n")
        print("| impl | " + " | ".join(NAMES) + " |\n|---|" + "---|" * len(NAMES))
        for name, got in rows:
            errs = [float("nan") if a is None else rel(a, b) for a, b in zip(got, want)]  # None: no grad
            print(f"| {name} | " + " | ".join(f"{e:.1e}" for e in errs) + " |")
            if name == "ours":
                ok = ok and all(e <= 2e-2 for e in errs)  # NaN (a missing gradient) fails too
        print()
    if not ok:
        raise SystemExit("our gradients disagree with the reference beyond 2e-2: not timing")


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def profile(label, fn, T=8192, iters=5):
    """CUDA time per kernel of fn's forward + backward (ours: its default backward), averaged over iters calls after a
    warm-up: which backward kernels and which torch elementwise work around them bound the step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    x, do, dS = step_inputs(T)
    step = lambda: grads(fn, x, do, dS)  # noqa: E731
    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / iters / 1e3, e.count // iters) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"## per-kernel CUDA time, {label} forward + backward, T = {T} (total {total:.2f} ms a step)\n")
    print("| kernel | ms a step | calls a step | share |\n|---|---|---|---|")
    for name, ms, n in rows[:25]:
        print(f"| `{name[:90]}` | {ms:.3f} | {n} | {100 * ms / total:.0f} % |")
    print(flush=True)
    del x, do


def launches(specs, T=8192, rounds=3):
    """Forward + backward of ours at T with the 64-token backward's inter / intra kernels at each launch of specs
    ("BK,BV,warps/BC,warps", module defaults restored after): ms (the least of `rounds` medians, the launches taken
    round-robin so clock drift spreads over all of them), the two kernels' CUDA times from one profiled step, and
    the largest gradient difference from the first launch's, relative to each gradient's largest value."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    default = TB._INTER64, TB._INTRA64
    x, do, dS = step_inputs(T)
    parsed = []
    for spec in specs:
        inter, intra = (tuple(int(n) for n in part.split(",")) for part in spec.split("/"))
        parsed.append(((*inter, default[0][3]), intra))
    best, first, rows = [float("inf")] * len(parsed), None, []
    try:
        for r in range(rounds):
            for i, launch in enumerate(parsed):
                TB._INTER64, TB._INTRA64 = launch
                if r == 0:  # compile, gradients, kernel times
                    got = grads(ours, x, do, dS)
                    first = first or got
                    diff = max(rel(a, b) for a, b in zip(got, first))
                    us = dict.fromkeys(("_bwd64_inter", "_bwd64_intra"), float("nan"))
                    if DEV == "cuda":
                        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                            grads(ours, x, do, dS)
                            torch.cuda.synchronize()
                        us = {n: sum(e.device_time_total for e in prof.key_averages() if n in e.key) for n in us}
                    rows.append((diff, us))
                best[i] = min(best[i], bench(lambda: grads(ours, x, do, dS)))
    finally:
        TB._INTER64, TB._INTRA64 = default
    print(f"## the 64-token backward's launches, forward + backward at T = {T}\n")
    print("| inter (BK, BV, warps) | intra (BC, warps) | ms | inter us | intra us | gradients vs the first |")
    print("|---|---|---|---|---|---|")
    for ((bk, bv, nw, _), intra), ms, (diff, us) in zip(parsed, best, rows):
        print(f"| {bk}, {bv}, {nw} | {intra[0]}, {intra[1]} | {ms:.3f} | {us['_bwd64_inter']:.0f} | "
              f"{us['_bwd64_intra']:.0f} | {diff:.1e} |")
    print(flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-fla", action="store_true", help="skip fla (its first call autotunes for minutes)")
    ap.add_argument("--check-only", action="store_true", help="only the small-shape gradient check")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ts", default="8192,32768", help="sequence lengths to time, comma separated")
    ap.add_argument("--sweep", action="store_true", help="first time block_v x num_warps of our backward, T=8K")
    ap.add_argument("--no-fla-check", action="store_true",
                    help="leave fla out of the small-shape check (its H = 4 shapes autotune separately)")
    ap.add_argument("--chunk64-only", action="store_true",
                    help="time only the 64-token backward (default and keep_buffers), not the 16-token ones")
    ap.add_argument("--launches", default="",
                    help="space-separated 64-token backward launches to time first, 'BK,BV,warps/BC,warps' (the "
                         "inter / intra kernels; include the default, 32,32,4/32,4, to compare against)")
    ap.add_argument("--launch-t", type=int, default=8192, help="the sequence length of --launches")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel CUDA time of one forward + backward of ours at T = 8K (torch.profiler)")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    fla = None if args.no_fla else fla_fn()
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"GPU {gpu}, torch {torch.__version__}, triton {triton.__version__}\n")
    check(None if args.no_fla_check else fla, small=DEV != "cuda")
    if args.check_only:
        return
    if args.profile:
        profile("ours", ours)
        if fla is not None:
            profile("fla", fla)

    if args.launches:
        launches(args.launches.split(), T=args.launch_t)

    if args.sweep:
        print("## sweep of our 16-token backward kernels' tiling, forward + backward ms at T=8K\n")
        print("| block_v | num_warps | chunk_block_v | chunk_num_warps | chunk_num_stages | ms |\n|---|---|---|---|---|---|")
        x, do, dS = step_inputs(8192)
        configs = [(bv, nw, 16, 8, None) for bv, nw in ((32, 2), (32, 4), (64, 2), (64, 4))]  # the sequential kernels
        # the per-chunk kernel: V tile, warps, V-loop pipelining depth
        # (ptxas, sm_90a, triton 3.6, with u / du loaded: 8 warps spill <= 16 bytes up to chunk_block_v = 32,
        # 4 warps ~0.5-0.9 KB, chunk_block_v = 64 ~0.4 KB)
        configs += [(32, 4, cbv, cw, ns) for cbv, cw, ns in (
            (16, 8, None), (16, 8, 1), (16, 8, 2), (32, 8, 1), (32, 8, 2), (32, 8, None), (64, 8, 1), (16, 4, 1))]
        for bv, nw, cbv, cw, ns in configs:
            TC._ChunkKDAFunction.bwd_options = dict(chunk_size=16, block_v=bv, num_warps=nw, chunk_block_v=cbv,
                                                    chunk_num_warps=cw, chunk_num_stages=ns)
            try:
                t = f"{bench(lambda: grads(ours, x, do, dS)):.2f}"
            except Exception as e:  # e.g. out of registers / shared memory for a config
                t = f"failed: {type(e).__name__}"
            print(f"| {bv} | {nw} | {cbv} | {cw} | {ns or 'default'} | {t} |", flush=True)
        TC._ChunkKDAFunction.bwd_options = {}
        del x, do
        print()

    ts = [int(t) for t in args.ts.split(",") if int(t)]  # --ts 0: no table
    if not ts:
        return
    print("## forward + backward, B=1, H=96, K=V=128, bf16, in-kernel gate / beta sigmoid / L2 norm\n")
    print("| T | ours fwd ms | ours fwd+bwd ms (16-token bwd, fp32 states) | ours fwd+bwd ms (16-token bwd, bf16 "
          "states) | ours fwd+bwd ms (64-token bwd: default) | ours fwd+bwd ms (64-token, keep_buffers) | fla fwd ms "
          "| fla fwd+bwd ms | fla / ours default | fla / ours keep_buffers |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for T in ts:
        x, do, dS = step_inputs(T)

        def fb(fn):
            o, S = fn(*x)
            torch.autograd.backward([o, S], [do, dS])

        def fwd(fn):
            with torch.no_grad():
                fn(*x)

        t_of = bench(lambda: fwd(ours))
        times = []
        # the 16-token backward with fp32 and with bf16 stored states, the 64-token backward (the default)
        # then the default again with the forward keeping its buffers for the backward (opt-in: memory for time)
        for opts, keep in ((dict(chunk_size=16, state_dtype=torch.float32), False), (dict(chunk_size=16), False),
                           ({}, False), ({}, True)):
            if args.chunk64_only and opts:
                times.append(float("nan"))
                continue
            TC._ChunkKDAFunction.bwd_options, TC._ChunkKDAFunction.keep_buffers = opts, keep
            try:
                times.append(bench(lambda: fb(ours)))
            except torch.OutOfMemoryError:
                times.append(float("nan"))
            torch.cuda.empty_cache()
        TC._ChunkKDAFunction.bwd_options, TC._ChunkKDAFunction.keep_buffers = {}, False
        t_ff = t_fb = float("nan")
        if fla is not None:
            fb(fla)  # autotune outside the timing
            t_ff, t_fb = bench(lambda: fwd(fla)), bench(lambda: fb(fla))
        print(f"| {T} | {t_of:.2f} | " + " | ".join(f"{t:.2f}" for t in times) + f" | {t_ff:.2f} | {t_fb:.2f} "
              f"| {t_fb / times[2]:.2f}x | {t_fb / times[3]:.2f}x |")
        del x, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
