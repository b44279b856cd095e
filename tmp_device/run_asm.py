"""One device call: correctness, then whole-MoE timing of the Gluon MXFP4 decode variants (landed, scales branch,
int32 words + PTX bit-placement unpack at S = 4 / 2, with and without register prefetch)."""
import sys
import time

import torch
import triton

sys.path[:0] = [".", "benchmarks"]
from moe import _tokens, grouped_mm_experts  # noqa: E402

from k3_kernels.moe import gluon_moe  # noqa: E402
from k3_kernels.moe.reference import moe_experts_mxfp4  # noqa: E402
from k3_kernels.moe.triton_moe import moe_experts_triton  # noqa: E402
from k3_kernels.mxfp4.reference import dequantize_mxfp4, quantize_mxfp4  # noqa: E402
from tmp_device import gluon_asm, gluon_main  # noqa: E402

dev = "cuda"
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)


def asm(s, pf):
    def run(x, ti, tw, *w, token_slots=None):
        D, I = 2 * w[0].shape[2], w[0].shape[1] // 2
        ss = s if (D % (64 * s) == 0 and I % (64 * s) == 0) else None
        return gluon_asm.moe_experts_gluon_asm(x, ti, tw, *w, token_slots=token_slots, s=ss, prefetch=pf)
    return run


def new(s, a=False):
    def run(x, ti, tw, *w, token_slots=None):
        D, I = 2 * w[0].shape[2], w[0].shape[1] // 2
        ss = s if (D % (64 * s) == 0 and I % (64 * s) == 0) else None
        return gluon_moe.moe_experts_gluon(x, ti, tw, *w, token_slots=token_slots, k_step=ss, asynchronous=a)
    return run


IMPLS = {
    "landed": gluon_main.moe_experts_gluon,
    "new S4": new(4),
    "new S2": new(2),
    "new S4 async": new(4, True),
    "new S2 async": new(2, True),
}
if "--pf4" in sys.argv:
    IMPLS["asm S4 prefetch"] = asm(4, True)

# ---------------------------------------------------------------- correctness (the test file's cases and more)
CASES = [(5, 7, 3, 256, 256, 0.0), (100, 9, 2, 512, 512, 0.5), (64, 32, 8, 1024, 768, 0.0)]
bad = 0
for (N, E, k, D, I, hot) in CASES:
    g = torch.Generator().manual_seed(N * D + I)
    x = torch.randn(N, D, generator=g).bfloat16().to(dev)
    w13p, w13s = quantize_mxfp4(torch.randn(E, 2 * I, D, generator=g) * torch.logspace(-3, 1, D))
    w2p, w2s = quantize_mxfp4(torch.randn(E, D, I, generator=g) * 0.1)
    w = [t.to(dev) for t in (w13p, w13s, w2p, w2s)]
    scores = torch.rand(N, E, generator=g)
    scores[:, 0] += hot
    tw, ti = scores.topk(k, dim=-1)
    ti, tw = ti.to(dev), (tw / tw.sum(-1, keepdim=True)).to(dev)
    want = moe_experts_mxfp4(x.float(), ti, tw, *w)
    line = []
    for name, fn in IMPLS.items():
        for nt in (None, 32):
            try:
                got = fn(x, ti, tw, *w, token_slots=nt)
                torch.cuda.synchronize()
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
            except Exception as exc:  # noqa: BLE001
                err = float("nan")
                print(f"  {name} nt={nt}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            ok = err <= 1e-2
            bad += not ok
            line.append(f"{name}/{nt}:{err:.1e}{'' if ok else '!!'}")
    print(f"case N={N} E={E} k={k} D={D} I={I} hot={hot} s13={w13s.min().item()}..{w13s.max().item()}: "
          + "  ".join(line), flush=True)
print("correctness failures:", bad, flush=True)

# ---------------------------------------------------------------- whole MoE at K3 shapes
E, k, D, I = 896, 16, 3584, 3072
torch.manual_seed(0)
t0 = time.time()
w13p = torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, device=dev)
w13s = torch.randint(119, 123, (E, 2 * I, D // 32), dtype=torch.uint8, device=dev)
w2p = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device=dev)
w2s = torch.randint(119, 123, (E, D, I // 32), dtype=torch.uint8, device=dev)
gate_up = torch.empty(E, 2 * I, D, dtype=torch.bfloat16, device=dev)
down = torch.empty(E, D, I, dtype=torch.bfloat16, device=dev)
for e in range(E):
    gate_up[e] = dequantize_mxfp4(w13p[e], w13s[e])
    down[e] = dequantize_mxfp4(w2p[e], w2s[e])
fp4 = (w13p, w13s, w2p, w2s)
print(f"weights made in {time.time() - t0:.0f} s", flush=True)
rounds = 2
print("\n| tokens | touched | path | ms (best) | spread | vs grouped_mm |")
print("| --- | --- | --- | --- | --- | --- |")
for N in (8, 64, 256):
    x, ti, tw, touched = _tokens(N, E, k, D, dev)
    paths = {"grouped_mm bf16": lambda: grouped_mm_experts(x, ti, tw, gate_up, down),
             "Triton MXFP4": lambda: moe_experts_triton(x, ti, tw, *fp4, config={"gluon": False})}
    for name, fn in IMPLS.items():
        paths[name] = lambda fn=fn: fn(x, ti, tw, *fp4)
    ref = paths["grouped_mm bf16"]().float()
    for name, fn in paths.items():
        err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
        if err > 2e-2:
            print(f"| {N} | {touched} | {name} | WRONG rel err {err:.2e} | | |", flush=True)
    times = {n: [] for n in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            times[name].append(triton.testing.do_bench(fn, warmup=10, rep=100))
    peer = min(times["grouped_mm bf16"])
    for name, ts in times.items():
        ms = min(ts)
        print(f"| {N} | {touched} | {name} | {ms:.3f} | {100 * (max(ts) / ms - 1):.0f} % | {peer / ms:.2f}x |",
              flush=True)

# ---------------------------------------------------------------- where the time goes at 64 tokens
x, ti, tw, touched = _tokens(64, E, k, D, dev)
for name in ("new S4", "new S2"):
    fn = IMPLS[name]
    fn(x, ti, tw, *fp4)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn(x, ti, tw, *fp4)
        torch.cuda.synchronize()
    print(f"\n{name}, 64 tokens, CUDA time a call by kernel (us):")
    for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
        print(f"  {ev.key[:60]:60s} {ev.device_time_total / 10:9.1f}")
