"""KDA prefill (chunked) forward on one GPU: our Triton kernel vs fla's `chunk_kda`, same inputs, same flags.

Shapes: B = 1, H = 96, K = V = 128, bf16 q/k/v/z/beta, fp32 A_log/dt_bias; T = 8K, 32K (128K with --long) and
a FlashKDA-style varlen batch (8 sequences summing to 32K). Both run with the in-kernel gate
(`lower_bound * sigmoid(exp(A_log) * (z + dt_bias))`, lower_bound = -5), in-kernel beta sigmoid and q/k L2 norm.
First a correctness check on a small shape against the fp32 torch reference (and fla if present).
Timing: `triton.testing.do_bench` median. Ceiling: 0.23 ms at T = 8K, linear in T (notes/performance.md).

    pip install -e . && python benchmarks/kda_chunk.py     # with fla (its first call autotunes 3-4 min)
    python benchmarks/kda_chunk.py --no-fla --bwd --long --block-v 32
    TRITON_INTERPRET=1 python benchmarks/kda_chunk.py --check-only --device cpu --no-fla   # CPU smoke

Forward + backward (--bwd): our backward is currently the torch reference recomputed under autograd, so
that row measures correctness plumbing, not a kernel; it is run at T = 8K only.
"""

from __future__ import annotations

import argparse

import torch
import triton

from k3_kernels.kda import reference as R
from k3_kernels.kda.triton_chunk import chunk_kda, chunk_kda_fwd

H, K, V = 96, 128, 128
CEIL_MS_8K = 0.23
DEV = "cuda"


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


FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)


TUNE = {}  # block_v / num_warps of our kernel, from the command line


def ours(q, k, v, z, beta, A_log, dt_bias, h0=None, cu=None, block_v=None, fwd_only=True, split=False):
    if fwd_only:
        return chunk_kda_fwd(q, k, v, z, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                             A_log=A_log, dt_bias=dt_bias, block_v=block_v, split=split, **FLAGS, **TUNE)
    return chunk_kda(q, k, v, z, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                     A_log=A_log, dt_bias=dt_bias, **FLAGS)


def fla_fn():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk
    except ImportError:
        return None

    def run(q, k, v, z, beta, A_log, dt_bias, h0=None, cu=None):
        return fla_chunk(q, k, v, z, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                         A_log=A_log, dt_bias=dt_bias, safe_gate=True, **FLAGS)

    return run


def reference(q, k, v, z, beta, A_log, dt_bias, h0=None, cu=None):
    g = R.kda_gate(z, A_log, dt_bias, lower_bound=-5.0)
    return R.chunk_kda(q.float(), k.float(), v.float(), g, torch.sigmoid(beta.float()), initial_state=h0,
                       output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)


def check(fla, block_v):
    print("## correctness (small shape, vs fp32 torch reference)\n")
    for T, cu in ((300, None), (300, [0, 5, 77, 150, 300])):
        N = 1 if cu is None else len(cu) - 1
        x = inputs(T, H=4, N=N, seed=1)
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
        o_r, S_r = reference(*x, cu=cu_t)
        line, ok = f"T={T} varlen={cu is not None}:", True
        for split in (False, True):
            o, S = ours(*x, cu=cu_t, block_v=block_v, split=split)
            line += f" ours{'-split' if split else ''} rel_err o {rel(o, o_r):.2e} S {rel(S, S_r):.2e}"
            ok = ok and rel(o, o_r) <= 2e-2 and rel(S, S_r) <= 2e-2
        if fla is not None:
            o_f, S_f = fla(*x, cu=None if cu is None else cu_t.long())
            line += f" | fla o {rel(o_f, o_r):.2e} S {rel(S_f, S_r):.2e}"
        print(line, "OK" if ok else "FAIL")
        if not ok:
            raise SystemExit("correctness check failed: not timing")
    print()


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-fla", action="store_true", help="skip fla (its first call autotunes for minutes)")
    ap.add_argument("--long", action="store_true", help="add T = 128K")
    ap.add_argument("--bwd", action="store_true", help="also time forward + backward at T = 8K")
    ap.add_argument("--block-v", type=int, default=None, help="V tile of our kernel (default 32)")
    ap.add_argument("--num-warps", type=int, default=4, help="num_warps of our kernel")
    ap.add_argument("--sweep", action="store_true", help="time block_v x num_warps of our kernel at T = 8K first")
    ap.add_argument("--check-only", action="store_true", help="only the small-shape correctness check")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    TUNE["num_warps"] = args.num_warps
    torch.backends.cuda.matmul.allow_tf32 = False
    fla = None if args.no_fla else fla_fn()
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"GPU {gpu}, torch {torch.__version__}, triton {triton.__version__}\n")
    check(fla, args.block_v)
    if args.check_only:
        return
    if args.sweep:
        print("| block_v | num_warps | ours fused ms, T=8K | ours split ms, T=8K |\n|---|---|---|---|")
        x = inputs(8192)
        for bv in (16, 32, 64, 128):
            for nw in (2, 4, 8):
                row = f"| {bv} | {nw} |"
                for split in (False, True):
                    try:
                        t = bench(lambda: chunk_kda_fwd(x[0], x[1], x[2], x[3], x[4], initial_state=x[7],
                                                        output_final_state=True, A_log=x[5], dt_bias=x[6],
                                                        block_v=bv, num_warps=nw, split=split, **FLAGS))
                        row += f" {t:.3f} |"
                    except Exception as e:  # e.g. out of registers / shared memory for a config
                        row += f" failed: {type(e).__name__} |"
                print(row)
        print()

    cases = [("T=8K", 8192, None), ("T=32K", 32768, None)]
    if args.long:
        cases.append(("T=128K", 131072, None))
    lens = [1024, 7168, 2048, 5120, 3072, 6144, 4096, 4096]  # 8 sequences, 32K total
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    cases.append(("varlen 8 seqs, 32K", 32768, cu))

    print("| case | ours fused ms | ours split ms | fla ms | fla / best ours | best ours % of ceiling |")
    print("|---|---|---|---|---|---|")
    for name, T, cu_l in cases:
        N = 1 if cu_l is None else len(cu_l) - 1
        x = inputs(T, N=N)
        cu_t = None if cu_l is None else torch.tensor(cu_l, dtype=torch.int32, device=DEV)
        t_fused = bench(lambda: ours(*x, cu=cu_t, block_v=args.block_v))
        t_split = bench(lambda: ours(*x, cu=cu_t, block_v=args.block_v, split=True))
        t_ours = min(t_fused, t_split)
        t_fla = float("nan")
        if fla is not None:
            cu_f = None if cu_t is None else cu_t.long()
            fla(*x, cu=cu_f)  # autotune outside the timing
            t_fla = bench(lambda: fla(*x, cu=cu_f))
        ceil = CEIL_MS_8K * T / 8192
        print(f"| {name} | {t_fused:.3f} | {t_split:.3f} | {t_fla:.3f} | {t_fla / t_ours:.2f}x "
              f"| {100 * ceil / t_ours:.0f} % |")

    if args.bwd:
        print("\n| forward + backward, T=8K | ms |\n|---|---|")
        x = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs(8192)]
        do = torch.randn(1, 8192, H, V, device=DEV).bfloat16()

        def fb(fn):
            o, S = fn(*x)
            torch.autograd.backward([o, S], [do, torch.zeros_like(S)])

        try:
            print(f"| ours (torch-reference backward) | {bench(lambda: fb(lambda *a: ours(*a, fwd_only=False))):.2f} |")
        except torch.OutOfMemoryError:
            print("| ours (torch-reference backward) | OOM |")
        if fla is not None:
            print(f"| fla | {bench(lambda: fb(fla)):.2f} |")


if __name__ == "__main__":
    main()
