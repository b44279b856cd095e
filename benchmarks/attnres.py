"""AttnRes on the H200: our fused Triton kernel vs eager torch (the reference) vs fla's `fused_attnres`.

K3 width (d = 7168), 8192 tokens, bf16, N = 3 / 6 / 9 depth candidates (9 is the most K3 has). Checks each path
against the fp32 reference first, then times forward and forward + backward with `triton.testing.do_bench`
(median). Bandwidth counts the unavoidable bytes: forward reads N candidate rows and writes one; backward reads
N candidates, dout and out, writes N gradients. Our kernel takes the candidates stacked `[N, T, d]`; the
"ours (list)" row includes the `torch.stack` the model does today.

    . scripts/device_env.sh && python3 benchmarks/attnres.py
"""

import argparse

import torch
import triton

from k3_kernels.attnres.reference import attn_res
from k3_kernels.attnres.triton_attnres import attn_res_triton

PEAK_TBS = 4.27


def sweep_warps(T, d, N=9):
    """Forward and forward + backward of the stacked kernel at each num_warps (monkeypatching `_launch_cfg`)."""
    from k3_kernels.attnres import triton_attnres as mod

    default = mod._launch_cfg
    v = torch.randn(N, T, d, device="cuda").bfloat16().requires_grad_()
    q = (torch.randn(1, d, device="cuda") * 0.05).requires_grad_()
    nw = (1 + 0.1 * torch.randn(d, device="cuda")).requires_grad_()
    dout = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    try:
        for warps in (4, 8, 16, 32):
            mod._launch_cfg = lambda D, w=warps: (default(D)[0], w)
            with torch.no_grad():
                f = triton.testing.do_bench(lambda: attn_res_triton(v, q, nw, 1e-5))
            fb = triton.testing.do_bench(lambda: attn_res_triton(v, q, nw, 1e-5).backward(dout), grad_to_none=[v, q, nw])
            print(f"sweep N={N} num_warps={warps}: fwd {f:.3f} ms ({(N + 1) * T * d * 2 / f / 1e9:.2f} TB/s), "
                  f"fwd+bwd {fb:.3f} ms", flush=True)
    finally:
        mod._launch_cfg = default


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--sweep", action="store_true", help="first time our kernels' num_warps at N = 9")
    args = ap.parse_args()
    T, d = args.tokens, args.hidden
    if args.sweep:
        sweep_warps(T, d)
    try:
        from fla.ops.attnres import fused_attnres
    except Exception as exc:  # fla absent: report ours and torch only
        print(f"fla unavailable: {exc}")
        fused_attnres = None
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
    print(f"\nAttnRes, T = {T}, d = {d}, bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n")
    print("| N | path | fwd ms | fwd TB/s | fwd % of 4.27 | fwd+bwd ms | fwd+bwd TB/s | fwd+bwd % |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for N, name, f, fbw, fb, fbbw in rows:
        print(f"| {N} | {name} | {f:.3f} | {fbw:.2f} | {100 * fbw / PEAK_TBS:.0f} % | {fb:.3f} | {fbbw:.2f} | {100 * fbbw / PEAK_TBS:.0f} % |")


if __name__ == "__main__":
    main()
