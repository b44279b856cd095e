"""Routed experts on the H200 at K3 shapes (896 experts, top-16, latent 3584 = routed_expert_hidden_size, expert
width 3072 = moe_intermediate_size; SPEC 5 and the released config).

Paths, same routing and inputs, one run: our Triton kernel on MXFP4-packed experts (W4A16) and on bf16 experts,
`torch._grouped_mm` on bf16 experts (what transformers' `grouped_mm` experts implementation calls), and the
per-expert Python loop (transformers' eager). Each is checked against the fp32 reference on a sample of tokens
first. Decode is bandwidth-bound: the ceiling is the bytes of the touched experts at 4.27 TB/s (each path is
charged its own weight bytes: 2 a weight in bf16, 17/32 in MXFP4); prefill (8192 tokens) is compute-bound:
TFLOP/s against the measured ~790 bf16 dense (notes/performance.md; 989 is the spec sheet). Timed eagerly with
`triton.testing.do_bench` (the kernel's `_align` syncs once for its grid, so no CUDA graph); the weights (~75 GB
in all) are far bigger than L2, so nothing is served from cache. Last line: MXFP4 vs `torch._grouped_mm` at 64
tokens (target >= 3x: the 3.76x fewer weight bytes, less the unpack work).

    . scripts/device_env.sh && python3 benchmarks/moe.py
"""

import argparse
import time

import torch
import triton

from k3_kernels.moe.reference import moe_experts
from k3_kernels.moe.triton_moe import moe_experts_triton
from k3_kernels.mxfp4.reference import dequantize_mxfp4
from k3_kernels.situ.reference import situ_glu

PEAK_TBS, PEAK_TFLOPS = 4.27, 790.0


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


def loop_experts(x, top_idx, top_w, gate_up, down):
    out = torch.zeros_like(x)
    for e in torch.unique(top_idx).tolist():
        tok, slot = torch.where(top_idx == e)
        g, u = torch.nn.functional.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        h = torch.nn.functional.linear(situ_glu(g, u), down[e])
        out.index_add_(0, tok, h * top_w[tok, slot, None].to(h.dtype))
    return out


def _bench(fn, dev):
    if dev == "cuda":
        return triton.testing.do_bench(fn, warmup=5, rep=50)  # median ms
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 8192])
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--dims", type=int, nargs=2, default=[3584, 3072], metavar=("D", "I"),
                    help="latent width (routed_expert_hidden_size) and expert width (moe_intermediate_size)")
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke run of the script under TRITON_INTERPRET=1")
    ap.add_argument("--loop-max-tokens", type=int, default=8192, help="skip the Python loop above this many tokens")
    args = ap.parse_args()
    E, k, (D, I), dev = args.experts, args.top_k, args.dims, args.device
    torch.manual_seed(0)
    # Random MXFP4 experts (scales around 2**-7 so dequantised weights are ~N(0, 0.01)-sized), and their exact bf16.
    w13p = torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, device=dev)
    w13s = torch.randint(119, 123, (E, 2 * I, D // 32), dtype=torch.uint8, device=dev)
    w2p = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device=dev)
    w2s = torch.randint(119, 123, (E, D, I // 32), dtype=torch.uint8, device=dev)
    gate_up = torch.empty(E, 2 * I, D, dtype=torch.bfloat16, device=dev)
    down = torch.empty(E, D, I, dtype=torch.bfloat16, device=dev)
    for e in range(E):  # dequantise expert by expert: the fp32 temporaries of all 896 would not fit
        gate_up[e] = dequantize_mxfp4(w13p[e], w13s[e])
        down[e] = dequantize_mxfp4(w2p[e], w2s[e])
    fp4 = dict(w13_packed=w13p, w13_scale=w13s, w2_packed=w2p, w2_scale=w2s)
    rows = []
    for N in args.tokens:
        x = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
        scores = torch.rand(N, E, device=dev)
        top_w, top_idx = scores.topk(k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        touched = torch.unique(top_idx).numel()
        paths = {
            "ours MXFP4": lambda: moe_experts_triton(x, top_idx, top_w, **fp4),
            "ours bf16": lambda: moe_experts_triton(x, top_idx, top_w, gate_up=gate_up, down=down),
            "torch._grouped_mm bf16": lambda: grouped_mm_experts(x, top_idx, top_w, gate_up, down),
        }
        if N <= args.loop_max_tokens:
            paths["per-expert loop bf16"] = lambda: loop_experts(x, top_idx, top_w, gate_up, down)
        s = slice(0, min(N, 4))  # reference on a few tokens (fp32 over the touched experts)
        ref = moe_experts(x[s].float(), top_idx[s], top_w[s], gate_up, down)
        for name, fn in paths.items():
            err = ((fn()[s].float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, f"{name} N={N}: rel err {err}"
        flops = 2 * N * k * (3 * D * I)
        for name, fn in paths.items():
            ms = _bench(fn, dev)
            wbytes = touched * 3 * D * I * (0.5 + 1 / 32 if "MXFP4" in name else 2)
            rows.append((N, touched, name, ms, wbytes / ms / 1e6, flops / ms / 1e9))  # GB/s, TFLOP/s
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "CPU smoke run (timings meaningless)"
    print(f"\nMoE experts, E={E}, top-{k}, D={D}, I={I}, {gpu}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"expert weights: {w13p.nbytes + w13s.nbytes + w2p.nbytes + w2s.nbytes:.3e} bytes MXFP4, "
          f"{gate_up.nbytes + down.nbytes:.3e} bytes bf16\n")
    print("| tokens | experts touched | path | ms | weight GB/s | % of 4.27 TB/s | TFLOP/s | % of 790 | vs grouped_mm |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    peer = {N: ms for N, _, name, ms, _, _ in rows if name == "torch._grouped_mm bf16"}
    for N, t, name, ms, gbs, tf in rows:
        print(f"| {N} | {t} | {name} | {ms:.3f} | {gbs:.0f} | {100 * gbs / 1e3 / PEAK_TBS:.0f} % | {tf:.1f} | "
              f"{100 * tf / PEAK_TFLOPS:.1f} % | {peer[N] / ms:.2f}x |")
    fp4_ms = {N: ms for N, _, name, ms, _, _ in rows if name == "ours MXFP4"}
    if 64 in fp4_ms:
        print(f"\nours MXFP4 vs torch._grouped_mm bf16 at 64 tokens: {peer[64] / fp4_ms[64]:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
