"""KDA decode (T = 1) on one GPU: our Triton `fused_recurrent_kda` against fla's, inside CUDA graphs.

K3 shapes: H = 96, K = V = 128, fp32 state, bf16 q / k / v / gate logits / beta logits, with the gate, the beta
sigmoid and the q/k L2 norm fused in both kernels (the same flags for both). Correctness is checked first
against the torch reference (`k3_kernels.kda.reference`) and fla; any mismatch aborts before timing.

    python benchmarks/kda_decode.py               # checks + table (B = 1, 16, 64, 256)
    python benchmarks/kda_decode.py --sweep       # + a sweep of our (BV, num_warps)
    python benchmarks/kda_decode.py --check-only  # small shapes, correctness only (CPU: TRITON_INTERPRET=1)

Runs from a bare checkout too: without the package installed, `kernels/` is loaded as `k3_kernels`.

Bytes per call = state read + write (B * 2 * H * K * V * 4) + inputs + output; percent of the copy bandwidth
measured in the same run (`ceilings.copy_tbs`: 4.27 TB/s on the H200, 3.00 on the H100). Inputs are rotated over
enough copies to exceed L2 (60 MB) so that small batches are not served from cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import pathlib
import sys

import torch

if importlib.util.find_spec("k3_kernels") is None:
    _root = pathlib.Path(__file__).resolve().parents[1] / "kernels"
    _spec = importlib.util.spec_from_file_location(
        "k3_kernels", _root / "__init__.py", submodule_search_locations=[str(_root)]
    )
    sys.modules["k3_kernels"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["k3_kernels"])

from ceilings import copy_tbs
from k3_kernels.kda import reference as ref
from k3_kernels.kda.triton_recurrent import fused_recurrent_kda as ours

L2_BYTES = 60e6
LOWER_BOUND = -5.0


def rel_err(a, b):
    """max |a - b| / max |b| (the repository's tolerance rule)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def make_inputs(B, T, H, K, V, device, dtype=torch.bfloat16, seed=0, N=None):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=gen, device=device) * s

    return dict(
        q=rnd(B, T, H, K).to(dtype),
        k=rnd(B, T, H, K).to(dtype),
        v=rnd(B, T, H, V).to(dtype),
        z=rnd(B, T, H, K).to(dtype),  # raw gate logits
        b=rnd(B, T, H).to(dtype),  # raw beta logits
        A_log=rnd(max(H, K), s=0.5),  # padded like the release: only the first H are used
        dt_bias=rnd(H * K, s=0.5),
        h0=rnd(N or B, H, K, V, s=0.5),
    )


def gate_kwargs(d):
    return dict(
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        A_log=d["A_log"], dt_bias=d["dt_bias"], lower_bound=LOWER_BOUND,
    )


def run_ours(d, **kw):
    return ours(d["q"], d["k"], d["v"], d["z"], d["b"], initial_state=d["h0"], **gate_kwargs(d), **kw)


def run_fla(d, cu_seqlens=None):
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda

    return fla_fused_recurrent_kda(
        d["q"], d["k"], d["v"], d["z"], d["b"], initial_state=d["h0"], output_final_state=True,
        cu_seqlens=cu_seqlens, **gate_kwargs(d),
    )


def run_reference(d, cu_seqlens=None):
    H = d["q"].shape[2]
    g = ref.kda_gate(d["z"], d["A_log"][:H], d["dt_bias"], LOWER_BOUND)
    beta = torch.sigmoid(d["b"].float())
    return ref.fused_recurrent_kda(
        d["q"].float(), d["k"].float(), d["v"].float(), g, beta, initial_state=d["h0"],
        output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True,
    )


def check(name, got, want, tol):
    o, S = got
    o_r, S_r = want
    eo, es = rel_err(o, o_r), rel_err(S, S_r)
    ok = math.isfinite(eo) and math.isfinite(es) and eo <= tol and es <= tol
    print(f"  {name:<44} out {eo:.2e}  state {es:.2e}  (tol {tol:.0e})  {'ok' if ok else 'MISMATCH'}")
    return ok


def correctness(device, small, with_fla):
    """Ours (new-state, in-place with permuted slots, varlen) and fla against the fp32 torch reference."""
    H, K, V = (3, 32, 32) if small else (96, 128, 128)
    ok = True
    print(f"correctness, H={H} K={K} V={V}, on {device}")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        tag = "fp32" if dtype == torch.float32 else "bf16"
        for B, T in ((1, 1), (3, 1), (3, 3)):
            d = make_inputs(B, T, H, K, V, device, dtype, seed=B * 10 + T)
            want = run_reference(d)
            ok &= check(f"ours {tag} B={B} T={T}", run_ours(d, output_final_state=True), want, tol)
            # In place through permuted slots of a larger pool; an unused slot must stay as it was.
            pool = torch.randn(B + 2, H, K, V, device=device)
            idx = torch.randperm(B + 2, device=device)[:B]
            pool[idx] = d["h0"]
            spare = [i for i in range(B + 2) if i not in idx.tolist()]
            before = pool[spare].clone()
            o, _ = ours(
                d["q"], d["k"], d["v"], d["z"], d["b"], initial_state=pool, inplace_final_state=True,
                ssm_state_indices=idx, **gate_kwargs(d),
            )
            ok &= check(f"ours {tag} B={B} T={T} in place, slots", (o, pool[idx]), want, tol)
            if not torch.equal(pool[spare], before):
                print("  unused state slot was modified: MISMATCH")
                ok = False
            if with_fla:  # the peer's own error is reported, not held against our kernel
                check(f"fla  {tag} B={B} T={T} (peer, informative)", run_fla(d), want, tol)
        cu = torch.tensor([0, 2, 3, 7], device=device)
        d = make_inputs(1, 7, H, K, V, device, dtype, seed=99, N=3)
        want = run_reference(d, cu_seqlens=cu)
        ok &= check(f"ours {tag} varlen {cu.tolist()}", run_ours(d, output_final_state=True, cu_seqlens=cu), want, tol)
    return ok


def bytes_per_call(B, H, K, V):
    state = B * 2 * H * K * V * 4
    inputs = B * H * (3 * K + V + 1) * 2 + B * H * V * 2  # q, k, z, v, beta logits in bf16 + bf16 output
    params = (H + H * K) * 4
    return state + inputs + params


def rotating(B, H, K, V, device, nbytes):
    """Enough input sets to exceed L2 twice over; fn(i) runs on set i mod R."""
    R = max(1, math.ceil(2 * L2_BYTES / nbytes))
    return [make_inputs(B, 1, H, K, V, device, seed=r) for r in range(R)]


def bench(fn, sets):
    from triton.testing import do_bench_cudagraph

    state = {"i": 0}

    def step():
        fn(sets[state["i"] % len(sets)])
        state["i"] += 1

    for _ in range(len(sets)):
        step()  # compile and warm up outside the graph
    torch.cuda.synchronize()
    return do_bench_cudagraph(step, rep=100, return_mode="median") * 1e3  # us


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check-only", action="store_true", help="small-shape correctness checks only")
    p.add_argument("--sweep", action="store_true", help="also sweep our (BV, num_warps) at each B")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    args = p.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        import fla
        import fla.ops.kda  # noqa: F401

        with_fla = device == "cuda"
        fla_version = getattr(fla, "__version__", "?")
    except Exception as exc:  # fla is the peer, not a requirement of the checks
        print(f"fla not importable ({exc}); checks run without it")
        with_fla, fla_version = False, None
    if args.check_only:
        sys.exit(0 if correctness(device, small=True, with_fla=with_fla) else 1)
    if device != "cuda":
        sys.exit("timing needs CUDA (use --check-only on a CPU with TRITON_INTERPRET=1)")
    if not with_fla:
        sys.exit("the timing run needs fla-core (the peer): pip install fla-core")
    if not correctness(device, small=False, with_fla=True):
        sys.exit("correctness check failed: no timings")

    import triton

    H, K, V = 96, 128, 128
    props = torch.cuda.get_device_properties(0)
    print(f"\n{props.name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"fla-core {fla_version}; H={H} K=V={K}, T=1, bf16 inputs, fp32 state, CUDA graphs")
    rows, sweep_rows = [], []
    for B in args.batches:
        nbytes = bytes_per_call(B, H, K, V)
        sets = rotating(B, H, K, V, device, nbytes)
        t_fla = bench(run_fla, sets)
        t_new = bench(lambda d: run_ours(d, output_final_state=True), sets)
        t_inp = bench(lambda d: run_ours(d, inplace_final_state=True), sets)
        rows.append((B, t_new, t_inp, t_fla, nbytes))
        if args.sweep:
            for bv in (16, 32, 64):
                for w in (1, 2, 4, 8):
                    t = bench(lambda d: run_ours(d, inplace_final_state=True, block_v=bv, num_warps=w), sets)
                    sweep_rows.append((B, bv, w, t, nbytes))
        del sets
        torch.cuda.empty_cache()

    peak = copy_tbs()
    print(f"\n| B | ours us | fla us | fla / ours | ours TB/s | % of {peak:.2f} TB/s | ours in-place us | "
          f"in-place TB/s | % of {peak:.2f} TB/s | fla TB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for B, t_new, t_inp, t_fla, nbytes in rows:
        tbs = [nbytes / (t * 1e-6) / 1e12 for t in (t_new, t_inp, t_fla)]
        print(f"| {B} | {t_new:.1f} | {t_fla:.1f} | {t_fla / t_new:.2f} | {tbs[0]:.2f} | {100 * tbs[0] / peak:.0f} % "
              f"| {t_inp:.1f} | {tbs[1]:.2f} | {100 * tbs[1] / peak:.0f} % | {tbs[2]:.2f} |")
    if sweep_rows:
        print("\nsweep (in place): | B | BV | num_warps | us | TB/s |")
        for B, bv, w, t, nbytes in sweep_rows:
            print(f"| {B} | {bv} | {w} | {t:.1f} | {nbytes / (t * 1e-6) / 1e12:.2f} |")


if __name__ == "__main__":
    main()
