"""MLA prefill on one GPU at K3's head shape (H = 96, q/k 192 = 128 NoPE + 64 shared, v 128), bf16, causal.

The model's long cached chunks and its cache-free forward attend over the expanded K/V through the attention
interface (`sdpa` / `k3_mla_paged` -> `torch.nn.functional.scaled_dot_product_attention` with the model's bool
mask). This script times that call against SDPA with `is_causal=True` and each backend forced (cuDNN, flash,
memory-efficient), and against the absorbed form on our Triton kernel (576 / 512-wide heads over the latent,
what a decode-style kernel would do for prefill). Every path is first checked against an fp32 reference on a
short prefix. TFLOP/s counts causal attention only: 2 * H * T^2 / 2 * (192 + 128) per sequence; the percentage
is of a large bf16 matmul measured in the same run (`ceilings.matmul_tflops`: about 790 on the H200; 989 is the
spec sheet).

    . scripts/device_env.sh && python3 -u benchmarks/mla_prefill.py [--lengths 8192 32768]
"""

import argparse
import math

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench
from ceilings import matmul_tflops

from k3_kernels.mla.triton_decode import mla_paged_decode

H, DN, DR, DV, R = 96, 128, 64, 128, 512


def inputs(T, gen):
    c = torch.randn(1, T, R, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_pe = torch.randn(1, T, DR, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(H, DN + DV, R, device="cuda", dtype=torch.bfloat16, generator=gen) / R**0.5
    q = torch.randn(1, T, H, DN + DR, device="cuda", dtype=torch.bfloat16, generator=gen)
    return c, k_pe, w, q


def expanded(c, k_pe, w):
    kv = torch.einsum("btr,hdr->bhtd", c, w)  # [1, H, T, DN + DV]
    k = torch.cat([kv[..., :DN], k_pe[:, None].expand(-1, H, -1, -1)], dim=-1)  # [1, H, T, 192]
    return k, kv[..., DN:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    args = ap.parse_args()
    scale = (DN + DR) ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# MLA prefill, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"H={H}, qk {DN + DR}, v {DV}, bf16, causal, B=1\n", flush=True)
    rows = []
    for T in args.lengths:
        c, k_pe, w, q = inputs(T, gen)
        k, v = expanded(c, k_pe, w)
        qh = q.transpose(1, 2)  # [1, H, T, 192]
        mask = torch.ones(T, T, dtype=torch.bool, device="cuda").tril()[None, None]
        n = min(T, 1024)  # fp32 reference on the first n queries (causal: they only see the first n keys)
        ref = F.scaled_dot_product_attention(qh[:, :, :n].float(), k[:, :, :n].float(), v[:, :, :n].float(),
                                             is_causal=True, scale=scale)
        w_k, w_v = w[:, :DN], w[:, DN:]
        q_lat = torch.einsum("bthd,hdr->bthr", q[..., :DN], w_k)  # [1, T, H, R] absorbed query
        pool = torch.cat([c, k_pe], -1).view(-1, 64, R + DR)  # pages of 64 in order
        table = torch.arange(pool.shape[0], device="cuda", dtype=torch.int32)[None]
        lengths = torch.full((1,), T, device="cuda", dtype=torch.int32)

        def absorbed(tq=T):
            o = mla_paged_decode(q_lat[:, -tq:], q[:, -tq:, :, DN:], pool, table, lengths, scale, max_len=T)
            return torch.einsum("bthr,hdr->bhtd", o, w_v)

        def sdpa(backend=None, use_mask=False):
            def fn():
                kw = dict(attn_mask=mask, scale=scale) if use_mask else dict(is_causal=True, scale=scale)
                if backend is None:
                    return F.scaled_dot_product_attention(qh, k, v, **kw)
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qh, k, v, **kw)
            return fn

        paths = {
            "SDPA, bool mask (the model's call)": sdpa(use_mask=True),
            "SDPA is_causal, default backend": sdpa(),
            "SDPA is_causal, cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION),
            "SDPA is_causal, flash": sdpa(SDPBackend.FLASH_ATTENTION),
            "SDPA is_causal, mem-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
            "SDPA bool mask, cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION, use_mask=True),
            "absorbed, our Triton kernel": absorbed,
        }
        flops = 2 * H * T * T / 2 * (DN + DR + DV)
        for name, fn in paths.items():
            try:
                out = fn()
                err = ((out[:, :, :n].float() - ref).abs().max() / ref.abs().max()).item()
                if err > 2e-2:
                    print(f"T={T} {name}: WRONG (rel err {err:.2e})", flush=True)
                    continue
                ms = do_bench(fn, return_mode="median")
            except Exception as e:  # noqa: BLE001  (a backend that does not support the shape)
                print(f"T={T} {name}: unsupported ({type(e).__name__}: {str(e)[:100]})", flush=True)
                continue
            rows.append((T, name, ms, flops / ms / 1e9, err))
            print(f"T={T} {name}: {ms:.3f} ms, rel err {err:.1e}", flush=True)
        del c, k_pe, w, q, k, v, qh, mask, q_lat, pool
        torch.cuda.empty_cache()
    peak = matmul_tflops()
    print(f"\n| T | path | ms | TFLOP/s | % of {peak:.0f} | rel err vs fp32 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for T, name, ms, tf, err in rows:
        print(f"| {T} | {name} | {ms:.3f} | {tf:.0f} | {100 * tf / peak:.0f} % | {err:.1e} |")


if __name__ == "__main__":
    main()
