"""Absorbed-MLA decode on one GPU: our paged kernels vs the torch absorbed bmm-softmax-bmm vs SDPA.

One layer, K3 shapes (H from the released config, r = 512, dr = 64), bf16, one query token per sequence, a
paged pool with shuffled page ids (page size 64, the config default). Every method is first checked against
an fp32 torch reference on the same latent; then timed with `triton.testing.do_bench_cudagraph` (median, the
decode setting) and, for ours, also with `do_bench` (eager, L2 flushed between calls). "ours" is the default of
`mla_paged_decode` (the Gluon split kernel on Hopper at these shapes); the Triton kernel is timed beside it.
TB/s counts the unavoidable traffic, the latent `B * L * 576 * 2` bytes, for every method (SDPA really reads
more: the expanded K/V); the ceiling is the copy bandwidth measured in the same run
(`ceilings.copy_tbs`: 4.27 TB/s on the H200, 3.00 on the H100).

    pip install -e . --no-deps --no-build-isolation && python benchmarks/mla_decode.py   # with a config sweep
    python benchmarks/mla_decode.py --quick    # the heuristic default config only
    python benchmarks/mla_decode.py --quick --probe   # + what bounds the kernels: each over one L2-resident page
                                                      #   (the products alone), the Triton kernel's loads alone
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import torch
import triton
import triton.language as tl
from triton.testing import do_bench, do_bench_cudagraph
from ceilings import copy_tbs

from k3_kernels.mla.triton_decode import mla_paged_decode

R, DR, PAGE = 512, 64, 64
CONFIG = pathlib.Path(__file__).resolve().parents[1] / "src" / "transformers_k3" / "released_config.json"
# (block_m, block_n, num_warps, num_stages[, num_splits]): the heuristic default is always run too.
SWEEP = [(64, 32, 8, 2), (64, 16, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2),
         (64, 64, 8, 1), (16, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 8, 2),
         (128, 64, 8, 2), (32, 64, 4, 3), (64, 32, 4, 2, 4), (64, 64, 4, 2, 8), (64, 64, 16, 2), (64, 32, 16, 2),
         (128, 16, 16, 1), (64, 32, 8, 2, 4), (64, 32, 8, 2, 8)]
GLUON_SWEEP = [(32, 2), (32, 3)]  # (block_n, ring buffers) of the Gluon kernel beside its default (64, 2)


@triton.jit
def _loads_only(POOL, BT, OUT, SPLIT_LEN, L, s_pool_p, s_pool_s, s_bt_b,
                R: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """The Triton split kernel's tile loads (latent and rope parts, through the block table) and a sum instead of
    its products: what its paged loads alone cost on its grid (head blocks, B, splits)."""
    b = tl.program_id(1)
    sp = tl.program_id(2)
    offs_r = tl.arange(0, R)
    offs_pe = tl.arange(0, DR)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    start = sp * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, L)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        page = tl.load(BT + b * s_bt_b + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        base = POOL + page * s_pool_p + (n % PAGE).to(tl.int64) * s_pool_s
        acc += tl.sum(tl.load(base[:, None] + offs_r[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32), 1)
        acc += tl.sum(tl.load(base[:, None] + R + offs_pe[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32), 1)
    tl.store(OUT + (b * tl.num_programs(2) + sp) * tl.num_programs(0) + tl.program_id(0), tl.sum(acc, 0))


def probe(B, L, H, pool, table, lengths, q_lat, q_pe, scale, nbytes):
    """Each kernel over one L2-resident page (every block-table entry page 0: its products alone), and the Triton
    kernel's paged loads alone at a few launches."""
    one_page = torch.zeros_like(table)
    for name, gluon in (("Gluon", None), ("Triton", False)):
        t = bench(lambda: mla_paged_decode(q_lat, q_pe, pool, one_page, lengths, scale, max_len=L, gluon=gluon))
        print(f"  probe: {name} kernel over one L2-resident page {t:.4f} ms ({nbytes / t / 1e9:.2f} TB/s)")
    out = torch.empty(B * 64 * 2, device="cuda")
    for bn, warps, stages, splits in [(32, 8, 2, 2), (64, 8, 3, 2), (32, 4, 2, 4)]:
        grid = (triton.cdiv(H, 64), B, splits)  # the Triton kernel's grid: head blocks (each re-reads), B, splits
        t = bench(lambda: _loads_only[grid](pool, table, out, triton.cdiv(L, splits), L, pool.stride(0),
                                            pool.stride(1), table.stride(0), R=R, DR=DR, BLOCK_N=bn, PAGE=PAGE,
                                            num_warps=warps, num_stages=stages))
        print(f"  probe: Triton kernel's loads alone, BLOCK_N {bn}, {warps} warps, {stages} stages, {splits} splits: "
              f"{t:.4f} ms ({nbytes / t / 1e9:.2f} TB/s)")


def heads_from_config() -> int:
    try:
        return int(json.loads(CONFIG.read_text())["text_config"]["num_attention_heads"])
    except (OSError, KeyError, ValueError):
        return 96


def make_inputs(B, L, H, gen):
    n_blocks = math.ceil(L / PAGE)
    pool = torch.randn(B * n_blocks, PAGE, R + DR, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(B * n_blocks, device="cuda", generator=gen).view(B, n_blocks)
    lengths = torch.full((B,), L, device="cuda", dtype=torch.int32)
    q_lat = torch.randn(B, 1, H, R, device="cuda", dtype=torch.bfloat16, generator=gen) / R**0.25
    q_pe = torch.randn(B, 1, H, DR, device="cuda", dtype=torch.bfloat16, generator=gen)
    return pool, table, lengths, q_lat, q_pe


def gathered(pool, table, L):
    B = table.shape[0]
    return pool[table].reshape(B, -1, R + DR)[:, :L]  # [B, L, r + dr], contiguous


def torch_absorbed(q_lat, q_pe, latent, scale):
    """The peer: bmm - softmax - bmm over the contiguous latent (MQA-style, heads as rows)."""
    B, _, H, _ = q_lat.shape
    q = torch.cat([q_lat, q_pe], dim=-1).view(B, H, R + DR)  # [B, H, 576]
    scores = torch.bmm(q, latent.transpose(1, 2)).float() * scale  # [B, H, L]
    probs = scores.softmax(-1).to(latent.dtype)
    return torch.bmm(probs, latent[..., :R]).view(B, 1, H, R)  # [B, 1, H, r]


def fp32_reference(q_lat, q_pe, latent, scale, chunk=8):
    out = []
    for lo in range(0, latent.shape[0], chunk):  # chunks keep the fp32 copy of the latent small
        lat = latent[lo:lo + chunk].float()
        q = torch.cat([q_lat[lo:lo + chunk], q_pe[lo:lo + chunk]], dim=-1)[:, 0].float()  # [b, H, 576]
        p = (torch.einsum("bhd,bld->bhl", q, lat) * scale).softmax(-1)
        out.append(torch.einsum("bhl,blr->bhr", p, lat[..., :R])[:, None])
    return torch.cat(out)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def bench(fn):
    try:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception:  # noqa: BLE001  (a path that cannot be captured shows as nan, not a fake time)
        return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the heuristic kernel config")
    ap.add_argument("--heads", type=int, default=heads_from_config())
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--probe", action="store_true", help="also the one-L2-page and loads-alone probes")
    args = ap.parse_args()
    H = args.heads
    scale = (128 + DR) ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.cuda.get_device_properties(0)
    print(f"# MLA absorbed decode, {p.name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"H={H}, r={R}, dr={DR}, page={PAGE}, bf16, Tq=1\n")
    rows = []
    for B in [int(x) for x in args.batches.split(",")]:
        for L in [int(x) for x in args.lengths.split(",")]:
            torch.cuda.empty_cache()
            pool, table, lengths, q_lat, q_pe = make_inputs(B, L, H, gen)
            latent = gathered(pool, table, L)
            nbytes = B * L * (R + DR) * 2
            ref = fp32_reference(q_lat, q_pe, latent, scale)
            tol = 2e-2
            ours = mla_paged_decode(q_lat, q_pe, pool, table, lengths, scale, max_len=L)
            e_ours = rel(ours, ref)
            e_torch = rel(torch_absorbed(q_lat, q_pe, latent, scale), ref)
            status = "ok" if e_ours <= tol and e_torch <= tol else "MISMATCH"
            print(f"B={B} L={L}: rel err ours {e_ours:.2e}, torch {e_torch:.2e} ({status})", flush=True)
            if e_ours > tol:
                raise SystemExit(f"our kernel is wrong at B={B} L={L}: rel err {e_ours:.3e}")

            best, best_cfg = bench(lambda: mla_paged_decode(q_lat, q_pe, pool, table, lengths, scale, max_len=L)), "default"
            t_default = best
            for cfg in ([] if args.quick else SWEEP):
                bm, bn, nw, ns, splits = (*cfg, None)[:5]
                kw = dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, num_splits=splits, max_len=L)
                try:
                    o = mla_paged_decode(q_lat, q_pe, pool, table, lengths, scale, **kw)
                    if rel(o, ref) > tol:
                        print(f"  config {cfg}: WRONG (rel err {rel(o, ref):.2e})")
                        continue
                    t = bench(lambda: mla_paged_decode(q_lat, q_pe, pool, table, lengths, scale, **kw))
                except Exception as e:  # noqa: BLE001  (e.g. out of shared memory for this config)
                    print(f"  config {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
                    continue
                print(f"  config {cfg}: {t * 1e3:.1f} us")
                if t < best:
                    best, best_cfg = t, str(cfg)
            for bn, ns in ([] if args.quick else GLUON_SWEEP):
                kw = dict(block_n=bn, num_stages=ns, max_len=L, gluon=True)
                t = bench(lambda: mla_paged_decode(q_lat, q_pe, pool, table, lengths, scale, **kw))
                print(f"  Gluon block_n {bn}, {ns} buffers: {t * 1e3:.1f} us")
                if t < best:
                    best, best_cfg = t, f"gluon {bn}/{ns}"
            t_triton = bench(lambda: mla_paged_decode(q_lat, q_pe, pool, table, lengths, scale, max_len=L,
                                                      gluon=False))
            if args.probe:
                probe(B, L, H, pool, table, lengths, q_lat, q_pe, scale, nbytes)
            t_eager = do_bench(lambda: mla_paged_decode(q_lat, q_pe, pool, table, lengths, scale, max_len=L),
                               return_mode="median")
            t_torch = bench(lambda: torch_absorbed(q_lat, q_pe, latent, scale))
            t_sdpa = float("nan")
            if B * H * L * (128 + DR + 128) * 2 <= 60e9:  # the expanded K/V must fit
                w = torch.randn(H, 256, R, device="cuda", dtype=torch.bfloat16, generator=gen) / R**0.5
                k = torch.cat([torch.einsum("blr,hdr->bhld", latent[..., :R], w[:, :128]),
                               latent[:, None, :, R:].expand(B, H, L, DR)], dim=-1)  # [B, H, L, 192]
                v = torch.einsum("blr,hdr->bhld", latent[..., :R], w[:, 128:])  # [B, H, L, 128]
                q = torch.randn(B, H, 1, 128 + DR, device="cuda", dtype=torch.bfloat16, generator=gen)
                t_sdpa = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale))
                del k, v, q
            rows.append((B, L, nbytes, best, best_cfg, t_default, t_triton, t_eager, t_torch, t_sdpa))
            del pool, table, latent, ref, ours

    def tbs(ms, n):
        return n / (ms * 1e-3) / 1e12

    peak = copy_tbs()
    print(f"\n| B | L | latent MB | ours best ms (config) | TB/s | % of {peak:.2f} | ours default ms | "
          "Triton kernel ms | ours eager ms (L2 flushed) | torch bmm ms | TB/s | SDPA ms | speed-up vs torch |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for B, L, n, best, cfg, t_def, t_triton, t_eager, t_torch, t_sdpa in rows:
        print(f"| {B} | {L} | {n / 1e6:.0f} | {best:.4f} ({cfg}) | {tbs(best, n):.2f} | "
              f"{100 * tbs(best, n) / peak:.0f} % | {t_def:.4f} | {t_triton:.4f} | {t_eager:.4f} | "
              f"{t_torch:.4f} | "
              f"{tbs(t_torch, n):.2f} | {'-' if math.isnan(t_sdpa) else f'{t_sdpa:.4f}'} | {t_torch / best:.1f}x |")
    print("\nTimes: do_bench_cudagraph medians (decode runs inside a CUDA graph); rows whose latent is under the "
          "60 MB L2 may be flattered there, the eager column flushes L2 between calls. SDPA '-': the expanded "
          "K/V do not fit.")


if __name__ == "__main__":
    main()
