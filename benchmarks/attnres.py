"""AttnRes on the H200: our fused Triton kernel vs eager torch (the reference) vs fla's `fused_attnres`.

K3 width (d = 7168), 8192 tokens, bf16, N = 3 / 6 / 9 depth candidates (9 is the most K3 has). Checks each path
against the fp32 reference first, then times forward and forward + backward with `triton.testing.do_bench`
(median). Bandwidth counts the unavoidable bytes: forward reads N candidate rows and writes one; backward reads
N candidates, dout and out, writes N gradients. Our kernel takes the candidates stacked `[N, T, d]`; the
"ours (list)" row includes the `torch.stack` the model does today.

    . scripts/device_env.sh && python3 benchmarks/attnres.py

`--variants` compares the two kernel designs instead (stacked input, same byte counts): "row" at its default launch
and "tiled" over a pruned sweep of (block_t, block_d, num_warps), each checked against the fp32 reference (output)
and against "row" (gradients) before it is timed, then prints one markdown table and the best tiled config per N:

    . scripts/device_env.sh && python3 -u benchmarks/attnres.py --variants

`--pass2 split,tile` also times the tiled kernels' other second-sweep form (`TILED_PASS2`) and
`--programs-per-sm none,2,4` caps on resident programs (`TILED_PROGRAMS_PER_SM`); each multiplies the tiled runs.
`--tiled-configs` (instead of the pruned tiled sweep), `--resident`, `--cooperative` and `--stream` name launches to
time (a cooperative or stream num_warps of 0 takes the default), and fla's `fused_attnres` joins the rounds where
fla is installed; `--ns` picks the candidate counts; `--rounds 3` times
every run three times, round-robin over the runs of an N, and reports the median (single timings of these kernels
have varied by up to 2x between runs of the same launch):

    . scripts/device_env.sh && python3 -u benchmarks/attnres.py --variants --rounds 3 --tiled-configs 1:1024:4 \
        --resident 16:1:1:1,16:0:1:2 --cooperative 0:1024:16,2:1024:16,4:2048:4 --ns 3,6,7,9

A tiny CPU smoke run of the same code path (interpreter, one timed call per config, timings meaningless):

    TRITON_INTERPRET=1 python3 -u benchmarks/attnres.py --variants --device cpu --tokens 8 --hidden 64
"""

import argparse
import functools
import os
import statistics
import time

import torch
import triton
from ceilings import copy_tbs

from k3_kernels.attnres.reference import attn_res
from k3_kernels.attnres import triton_attnres
from k3_kernels.attnres.triton_attnres import attn_res_triton

def sweep_warps(T, d, N=9):
    """Forward and forward + backward of the stacked "row" kernel at each num_warps."""
    v = torch.randn(N, T, d, device="cuda").bfloat16().requires_grad_()
    q = (torch.randn(1, d, device="cuda") * 0.05).requires_grad_()
    nw = (1 + 0.1 * torch.randn(d, device="cuda")).requires_grad_()
    dout = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    for warps in (4, 8, 16, 32):
        kw = dict(variant="row", num_warps=warps)
        with torch.no_grad():
            f = triton.testing.do_bench(lambda: attn_res_triton(v, q, nw, 1e-5, **kw))
        fb = triton.testing.do_bench(lambda: attn_res_triton(v, q, nw, 1e-5, **kw).backward(dout),
                                     grad_to_none=[v, q, nw])
        print(f"sweep N={N} num_warps={warps}: fwd {f:.3f} ms ({(N + 1) * T * d * 2 / f / 1e9:.2f} TB/s), "
              f"fwd+bwd {fb:.3f} ms", flush=True)


def tiled_configs(N, max_configs=20):
    """(block_t, block_d, num_warps) of the "tiled" sweep: tiles of 16..128 fp32 values per thread (fewer leave
    the SM short of loads in flight, more spill), at most `max_configs`. Wide slices (2048, 4096) are in because
    pass 2 re-reads from L2: the bytes all resident programs touch between a slice's two reads grow as d / block_d
    (with the register file, not the tile, bounding how many programs run), and must stay well under L2's 50 MB."""
    NP = triton.next_power_of_2(N)
    cfgs = []
    for bt in (1, 2, 4):
        for bd in (256, 512, 1024, 2048, 4096):
            for warps in (4, 8):
                if 16 <= bt * NP * bd // (32 * warps) <= 128:
                    cfgs.append((bt, bd, warps))
    return cfgs[:max_configs]


def _timer(device):
    """Median ms via do_bench on CUDA; on the CPU (interpreter smoke run) one wall-clock call."""
    if device == "cuda":
        return lambda fn, grad_to_none=None: triton.testing.do_bench(fn, warmup=10, rep=50, grad_to_none=grad_to_none)

    def once(fn, grad_to_none=None):
        for t in grad_to_none or ():
            t.grad = None
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return once


_SETTINGS = ("TILED_PASS2", "TILED_PROGRAMS_PER_SM", "RESIDENT_PREFETCH", "RESIDENT_PROGRAMS_PER_SM", "RESIDENT_STAGES",
             "COOP_PROGRAMS_PER_SM", "STREAM_PROGRAMS_PER_SM", "STREAM_STAGES")


def compare_variants(T, d, device="cuda", max_configs=20, pass2=("split",), per_sm=(None,), tiled=None, resident=(),
                     coop=(), rounds=1, ns=(3, 6, 9), stream=()):
    """"row" (default launch) vs "tiled" over `tiled_configs` or the given `tiled` (block_t, block_d, num_warps)
    list (and each `TILED_PASS2` form in `pass2`) vs "resident" over `resident` (num_warps, prefetch,
    programs per SM, stages) where a token's tile fits vs "cooperative" over `coop` (num_warps or None for the
    per-kernel defaults, block_d, programs per SM) vs "stream" over `stream` (num_warps or None, stages, programs
    per SM), stacked [N, T, d] bf16, each N of `ns`; each timed
    `rounds` times, round-robin over the runs of an N."""
    bench = _timer(device)
    before = {k: getattr(triton_attnres, k) for k in _SETTINGS}
    try:
        _compare_variants(T, d, device, max_configs, pass2, per_sm, tiled, resident, coop, rounds, bench, ns, stream)
    finally:
        for k, v in before.items():
            setattr(triton_attnres, k, v)


@functools.cache  # looked up once: `_call` runs inside the timed lambdas
def _fla_attnres():
    """fla's `fused_attnres`, or None where fla is not installed."""
    try:
        from fla.ops.attnres import fused_attnres
    except Exception:  # fla absent (or broken): the peer is left out
        return None
    return fused_attnres


def _call(variant, v, q, nw, kw):
    """One AttnRes forward of the stacked candidates v: ours at `kw`, or fla's `fused_attnres` for "fla"."""
    if variant == "fla":
        return _fla_attnres()(q.flatten(), list(v), nw, rms_eps=1e-5)
    return attn_res_triton(v, q, nw, 1e-5, **kw)


def _apply_settings(variant, form):
    """The module settings a run needs (read by attn_res_triton at each call)."""
    if variant == "tiled":
        triton_attnres.TILED_PASS2, triton_attnres.TILED_PROGRAMS_PER_SM = form
    if variant == "resident":
        pf, st = form[0].split()
        triton_attnres.RESIDENT_PREFETCH = pf == "prefetch=1"
        triton_attnres.RESIDENT_STAGES = int(st.split("=")[1])
        triton_attnres.RESIDENT_PROGRAMS_PER_SM = form[1]
    if variant == "cooperative":
        triton_attnres.COOP_PROGRAMS_PER_SM = form[1]
    if variant == "stream":
        triton_attnres.STREAM_STAGES = int(form[0].split("=")[1])
        triton_attnres.STREAM_PROGRAMS_PER_SM = form[1]


def _compare_variants(T, d, device, max_configs, pass2, per_sm, tiled, resident, coop, rounds, bench, ns, stream):
    rows = []
    best = {}
    for N in ns:
        g = torch.Generator(device=device).manual_seed(N)
        # Candidates of growing scale, as the depth stream has.
        stacked = torch.stack([torch.randn(T, d, device=device, generator=g).bfloat16() * (i + 1) for i in range(N)])
        q = torch.randn(1, d, device=device, generator=g) * 0.05
        nw = 1 + 0.1 * torch.randn(d, device=device, generator=g)
        ref = attn_res(stacked.float(), q, nw, 1e-5)  # [T, d] fp32
        scale = ref.abs().max()
        dout = torch.randn(T, d, device=device, generator=g).bfloat16()
        fwd_bytes = (N + 1) * T * d * 2
        bwd_bytes = (2 * N + 2) * T * d * 2 + T * d * 4
        v_leaf = stacked.clone().requires_grad_()
        qg, nwg = q.clone().requires_grad_(), nw.clone().requires_grad_()
        grads_row = None
        runs = [("row", (None, None, None), ("-", None))]
        cfgs = tiled_configs(N, max_configs) if tiled is None else tiled
        runs += [("tiled", c, (form, k)) for form in pass2 for k in per_sm for c in cfgs]
        if triton_attnres._resident_fits(N, d):
            runs += [("resident", (None, None, w), (f"prefetch={int(pf)} stages={st}", k)) for w, pf, k, st in resident]
        runs += [("cooperative", (None, bd, w), ("-", k)) for w, bd, k in coop]
        runs += [("stream", (None, None, w), (f"stages={st}", k)) for w, st, k in stream]
        if _fla_attnres() is not None and device == "cuda":
            runs.append(("fla", (None, None, None), ("-", None)))  # the peer, in the same rounds
        checked = []  # (variant, cfg, form, kw, label, err, gerr) of the runs that compiled and ran
        for variant, cfg, form in runs:
            bt, bd, warps = cfg
            kw = dict(variant=variant, block_t=bt, block_d=bd, num_warps=warps)
            label = f"N={N} {variant} block_t={bt} block_d={bd} num_warps={warps} {form[0]} programs/SM={form[1]}"
            _apply_settings(variant, form)
            try:
                with torch.no_grad():
                    err = ((_call(variant, stacked, q, nw, kw).float() - ref).abs().max() / scale).item()
                for t in (v_leaf, qg, nwg):
                    t.grad = None
                _call(variant, v_leaf, qg, nwg, kw).backward(dout)
                grads = [t.grad.float().clone() for t in (v_leaf, qg, nwg)]  # timing below accumulates in .grad
                if grads_row is None:
                    grads_row, gerr = grads, 0.0
                else:
                    gerr = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                               for a, b in zip(grads, grads_row))
                del grads
            except Exception as exc:  # a config that does not compile (or run out of resources) must not stop the sweep
                print(f"{label}: failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                      flush=True)
                if variant == "row":
                    raise
                continue
            checked.append((variant, cfg, form, kw, label, err, gerr))
        # Timed in `rounds` passes over all the runs (round-robin), so a slow spell of the GPU does not land on one
        # run; the median is reported, and every pass's figure printed.
        times = [[] for _ in checked]
        for _ in range(rounds):
            for i, (variant, cfg, form, kw, label, err, gerr) in enumerate(checked):
                _apply_settings(variant, form)
                with torch.no_grad():
                    f_ms = bench(lambda: _call(variant, stacked, q, nw, kw))
                fb_ms = bench(lambda: _call(variant, v_leaf, qg, nwg, kw).backward(dout),
                              grad_to_none=[v_leaf, qg, nwg])
                times[i].append((f_ms, fb_ms))
        for (variant, cfg, form, kw, label, err, gerr), ts in zip(checked, times):
            bt, bd, warps = cfg
            f_ms, fb_ms = statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)
            ok = "" if err < 2e-2 and gerr < 5e-2 else "  WRONG"
            f_bw, fb_bw = fwd_bytes / f_ms / 1e9, (fwd_bytes + bwd_bytes) / fb_ms / 1e9
            rows.append((N, variant, form, bt, bd, warps, err, gerr, f_ms, f_bw, fb_ms, fb_bw, ok))
            passes = "" if rounds == 1 else (f" (passes: fwd {' / '.join(f'{t[0]:.3f}' for t in ts)}, fwd+bwd "
                                             f"{' / '.join(f'{t[1]:.3f}' for t in ts)})")
            print(f"{label}: rel err {err:.1e}, grad rel err vs row {gerr:.1e}{ok}, fwd {f_ms:.3f} ms "
                  f"({f_bw:.2f} TB/s), fwd+bwd {fb_ms:.3f} ms ({fb_bw:.2f} TB/s){passes}", flush=True)
            if variant not in ("row", "fla") and not ok:
                for key, ms in (("fwd", f_ms), ("fwd+bwd", fb_ms)):
                    if (N, key) not in best or ms < best[N, key][0]:
                        best[N, key] = (ms, cfg, form, variant)
        del stacked, ref, v_leaf, grads_row
    dev = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    peak = copy_tbs(device)
    print(f"\nAttnRes variants, T = {T}, d = {d}, bf16, stacked input, {dev}, torch {torch.__version__}, "
          f"triton {triton.__version__}\n", flush=True)
    print("| N | variant | pass2, programs/SM | block_t | block_d | num_warps | rel err | grad rel err vs row | fwd ms "
          f"| fwd TB/s | fwd % of {peak:.2f} | fwd+bwd ms | fwd+bwd TB/s | fwd+bwd % |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for N, variant, form, bt, bd, warps, err, gerr, f, fbw, fb, fbbw, ok in rows:
        show = lambda x: "default" if x is None else x  # noqa: E731
        print(f"| {N} | {variant}{ok} | {form[0]}, {show(form[1])} | {show(bt)} | {show(bd)} | {show(warps)} | "
              f"{err:.1e} | {gerr:.1e} | {f:.3f} | {fbw:.2f} | {100 * fbw / peak:.0f} % | {fb:.3f} | {fbbw:.2f} | "
              f"{100 * fbbw / peak:.0f} % |")
    print(flush=True)
    for N in ns:
        for key in ("fwd", "fwd+bwd"):
            if (N, key) in best:
                ms, (bt, bd, warps), form, variant = best[N, key]
                print(f"best {key} N={N}: {variant} block_t={bt} block_d={bd} num_warps={warps} {form[0]} "
                      f"programs/SM={form[1]} ({ms:.3f} ms)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--sweep", action="store_true", help="first time our kernels' num_warps at N = 9")
    ap.add_argument("--variants", action="store_true", help="only compare the 'row' and 'tiled' kernel designs")
    ap.add_argument("--max-configs", type=int, default=20, help="tiled configs per N in --variants")
    ap.add_argument("--pass2", default="split",
                    help="--variants: TILED_PASS2 forms to sweep, comma-separated ('split', 'tile'; both doubles it)")
    ap.add_argument("--programs-per-sm", default="none",
                    help="--variants: TILED_PROGRAMS_PER_SM values to sweep, comma-separated ('none' or ints)")
    ap.add_argument("--tiled-configs", default=None,
                    help="--variants: explicit tiled configs 'block_t:block_d:num_warps,...' instead of the pruned sweep")
    ap.add_argument("--resident", default="",
                    help="--variants: resident configs 'num_warps:prefetch(0/1):programs_per_sm:stages,...' (N where "
                         "the tile fits)")
    ap.add_argument("--cooperative", default="",
                    help="--variants: cooperative configs 'num_warps:block_d:programs_per_sm,...' (num_warps 0: each "
                         "kernel's default)")
    ap.add_argument("--stream", default="",
                    help="--variants: stream configs 'num_warps:stages:programs_per_sm,...' (num_warps 0: the default)")
    ap.add_argument("--ns", default="3,6,9", help="--variants: candidate counts, comma-separated (1..16)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--variants: time every run this many times, round-robin, and report the median")
    ap.add_argument("--ours-variant", default=None, choices=triton_attnres.VARIANTS + ("auto",),
                    help="the main table's 'ours' rows with this design instead of DEFAULT_VARIANT")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="--variants only; cpu needs TRITON_INTERPRET=1 (a smoke run, timings meaningless)")
    args = ap.parse_args()
    T, d = args.tokens, args.hidden
    if args.variants:
        if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--device cpu needs TRITON_INTERPRET=1 in the environment (set before triton is imported)")
        forms = tuple(f.strip() for f in args.pass2.split(",") if f.strip())
        if not forms or any(f not in ("split", "tile") for f in forms):
            ap.error(f"--pass2 takes 'split', 'tile' or 'split,tile', got {args.pass2!r}")
        try:
            per_sm = tuple(None if x.strip() == "none" else int(x) for x in args.programs_per_sm.split(","))
        except ValueError:
            ap.error(f"--programs-per-sm takes 'none' or ints, comma-separated, got {args.programs_per_sm!r}")
        if any(k is not None and k < 1 for k in per_sm):
            ap.error("--programs-per-sm values must be >= 1")
        def tuples(text, n):
            out = [tuple(int(x) for x in c.split(":")) for c in text.split(",") if c.strip()]
            if any(len(t) != n for t in out):
                raise ValueError
            return out

        try:
            tiled = None if args.tiled_configs is None else tuples(args.tiled_configs, 3)
            resident = [(w, bool(pf), k, st) for w, pf, k, st in tuples(args.resident, 4)]
            coop = [(w or None, bd, k) for w, bd, k in tuples(args.cooperative, 3)]
            stream = [(w or None, st, k) for w, st, k in tuples(args.stream, 3)]
            ns = tuple(int(x) for x in args.ns.split(",") if x.strip())
        except ValueError:
            ap.error("--tiled-configs takes block_t:block_d:num_warps, --resident num_warps:prefetch:per_sm:stages, "
                     "--cooperative num_warps:block_d:per_sm, --stream num_warps:stages:per_sm and --ns ints, "
                     "comma-separated")
        if not ns or any(not 1 <= n <= 16 for n in ns):
            ap.error(f"--ns takes candidate counts 1..16, got {args.ns!r}")
        if args.rounds < 1:
            ap.error("--rounds must be >= 1")
        compare_variants(T, d, args.device, args.max_configs, forms, per_sm, tiled, resident, coop, args.rounds, ns,
                         stream)
        return
    if args.device != "cuda":
        ap.error("--device cpu is supported with --variants only")
    if args.ours_variant is not None:
        triton_attnres.DEFAULT_VARIANT = args.ours_variant
    if args.sweep:
        sweep_warps(T, d)
    fused_attnres = _fla_attnres()
    if fused_attnres is None:
        print("fla unavailable: ours and torch only")
    rows = []
    for N in (3, 6, 9):
        g = torch.Generator(device="cuda").manual_seed(N)
        cands = [torch.randn(T, d, device="cuda", generator=g).bfloat16() * (i + 1) for i in range(N)]
        stacked = torch.stack(cands)
        q = torch.randn(1, d, device="cuda", generator=g) * 0.05
        nw = 1 + 0.1 * torch.randn(d, device="cuda", generator=g)
        ref = attn_res([c.float() for c in cands], q, nw, 1e-5)
        scale = ref.abs().max()
        paths = {
            "ours (stacked)": lambda: attn_res_triton(stacked, q, nw, 1e-5),
            "ours (list)": lambda: attn_res_triton(cands, q, nw, 1e-5),
            "eager torch": lambda: attn_res(cands, q, nw, 1e-5),
        }
        if fused_attnres is not None:
            paths["fla fused_attnres"] = lambda: fused_attnres(q.flatten(), cands, nw, rms_eps=1e-5)
        for name, fn in paths.items():
            err = ((fn().float() - ref).abs().max() / scale).item()
            assert err < 2e-2, f"{name} N={N}: rel err {err}"
        fwd_bytes = (N + 1) * T * d * 2
        bwd_bytes = (2 * N + 2) * T * d * 2 + T * d * 4
        leaves = [c.clone().requires_grad_() for c in cands]
        st_leaf = stacked.clone().requires_grad_()
        qg, nwg = q.clone().requires_grad_(), nw.clone().requires_grad_()
        dout = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
        train = {
            "ours (stacked)": lambda: attn_res_triton(st_leaf, qg, nwg, 1e-5).backward(dout),
            "ours (list)": lambda: attn_res_triton(leaves, qg, nwg, 1e-5).backward(dout),
            "eager torch": lambda: attn_res(leaves, qg, nwg, 1e-5).backward(dout),
        }
        if fused_attnres is not None:
            train["fla fused_attnres"] = lambda: fused_attnres(qg.flatten(), leaves, nwg, rms_eps=1e-5).backward(dout)
        for name in paths:
            f_ms = triton.testing.do_bench(paths[name])
            fb_ms = triton.testing.do_bench(train[name], grad_to_none=leaves + [st_leaf, qg, nwg])
            rows.append((N, name, f_ms, fwd_bytes / f_ms / 1e9, fb_ms, (fwd_bytes + bwd_bytes) / fb_ms / 1e9))
            print(f"N={N} {name}: fwd {f_ms:.3f} ms, fwd+bwd {fb_ms:.3f} ms", flush=True)
    print(f"\nAttnRes, T = {T}, d = {d}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, ours = variant {triton_attnres.DEFAULT_VARIANT!r} at its default launch\n")
    peak = copy_tbs()
    print(f"| N | path | fwd ms | fwd TB/s | fwd % of {peak:.2f} (copy) | fwd+bwd ms | fwd+bwd TB/s | fwd+bwd % |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for N, name, f, fbw, fb, fbbw in rows:
        print(f"| {N} | {name} | {f:.3f} | {fbw:.2f} | {100 * fbw / peak:.0f} % | {fb:.3f} | {fbbw:.2f} | {100 * fbbw / peak:.0f} % |")


if __name__ == "__main__":
    main()
