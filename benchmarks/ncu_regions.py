"""Hardware counters of our kernels with Nsight Compute: one profiled region per workload, and a summary table.

Each mode warms its kernels up (compilation stays outside the region), then runs one call between
`cudaProfilerStart` / `cudaProfilerStop`, so `ncu --profile-from-start off` profiles exactly that call's kernels:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --csv --page details \
        python benchmarks/ncu_regions.py kda > ncu_kda.csv
    python benchmarks/ncu_regions.py --summarize ncu_kda.csv      # the markdown table of BENCHMARKS.md

Modes: `kda` (chunked forward + backward, T = 8K, H = 96, K = V = 128, bf16, all in-kernel flags), `mla` (absorbed
paged decode, B = 64, L = 32K, H = 96), `attnres` (forward, T = 8K, d = 7168, N = 3, 6, 9), `moe` (bf16 experts at
K3's widths with 8K tokens' load an expert, 146 rows, but 64 experts instead of 896: ncu saves and restores every
buffer a kernel may touch for each replay pass, which at the real expert count is 59 GB of bf16 weights a pass, and
the eleventh session's attempt ran out of its time limit), `moe_fp4` (MXFP4 experts through the default dispatch, the
Gluon kernels on Hopper, 64 experts with 1K then 8K tokens' load an expert: 18 and 146 rows).
`--clock-control none` leaves the GPU's clocks alone (the device notes ask for it).

Where inside a kernel the time goes: add `--section SourceCounters` (stall sampling per SASS instruction), save
the report with `-o kda` instead of `--csv`, export one kernel's source page and summarise it:

    ncu -i kda.ncu-rep --page source --csv --print-source sass -k regex:_bwd64_inter > src_inter.csv
    python benchmarks/ncu_regions.py --hotspots src_inter.csv     # stall reasons, opcodes, spill sectors, regions
"""

from __future__ import annotations

import argparse
import collections
import csv
import pathlib
import sys

import torch

SUMMARY = (("Duration", "ms", 1e-6), ("Registers Per Thread", "registers", 1), ("Theoretical Occupancy", "occupancy %", 1),
           ("DRAM Throughput", "DRAM % of peak", 1), ("Compute (SM) Throughput", "SM % of peak", 1),
           ("Issue Slots Busy", "issue %", 1), ("L2 Hit Rate", "L2 hit %", 1), ("L2 Cache Throughput", "L2 % of peak", 1),
           ("Local Memory Spilling Requests", "spill requests", 1))


def _region(fn, warm: int = 2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def kda():
    import kda_chunk_bwd as B

    x = B.inputs(8192)
    do = torch.randn(1, 8192, B.H, B.V, device="cuda").bfloat16()
    dS = torch.randn(1, B.H, B.K, B.V, device="cuda")
    _region(lambda: B.grads(B.ours, x, do, dS))


def mla():
    import mla_decode as M

    from k3_kernels.mla.triton_decode import mla_paged_decode

    gen = torch.Generator(device="cuda").manual_seed(0)
    pool, table, lengths, q_lat, q_pe = M.make_inputs(64, 32768, 96, gen)
    _region(lambda: mla_paged_decode(q_lat, q_pe, pool, table, lengths, 0.1))


def attnres():
    from k3_kernels.attnres.triton_attnres import attn_res_triton

    for n in (3, 6, 9):
        v = torch.randn(n, 8192, 7168, device="cuda", dtype=torch.bfloat16)
        qw, nw = torch.randn(7168, device="cuda") * 0.05, torch.ones(7168, device="cuda")
        _region(lambda: attn_res_triton(v, qw, nw))


def moe():
    import moe as M

    from k3_kernels.moe.triton_moe import moe_experts_triton

    E, k, D, I = 64, 16, 3584, 3072
    gate_up = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * D**-0.5
    down = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * I**-0.5
    x, top_idx, top_w, _ = M._tokens(8192 * E // 896, E, k, D, "cuda")  # 146 rows an expert, as 8K tokens at 896
    _region(lambda: moe_experts_triton(x, top_idx, top_w, gate_up=gate_up, down=down))


def moe_fp4():
    import moe as M

    from k3_kernels.moe.triton_moe import moe_experts_triton

    E, k, D, I = 64, 16, 3584, 3072
    fp4 = M.random_mxfp4(E, D, I, "cuda")
    for tokens in (1024, 8192):  # 18 and 146 rows an expert, as at 896 experts
        x, top_idx, top_w, _ = M._tokens(tokens * E // 896, E, k, D, "cuda")
        _region(lambda: moe_experts_triton(x, top_idx, top_w, **fp4))


def summarize(path: str):
    """One markdown row per profiled kernel (torch's own small kernels left out) from ncu's `--csv --page details`."""
    lines = [ln for ln in pathlib.Path(path).read_text().splitlines() if not ln.startswith("==")]
    rows = list(csv.reader(lines))
    col = {name: i for i, name in enumerate(rows[0])}
    kernels: dict[tuple[int, str], dict[str, str]] = {}
    for r in rows[1:]:
        kernels.setdefault((int(r[col["ID"]]), r[col["Kernel Name"]]), {})[r[col["Metric Name"]]] = r[col["Metric Value"]]
    print("| kernel | " + " | ".join(label for _, label, _ in SUMMARY) + " |")
    print("|---" * (len(SUMMARY) + 1) + "|")
    for (_, name), metrics in sorted(kernels.items()):
        if name.startswith("void ") or "::" in name:  # torch's own kernels
            continue
        cells = []
        for metric, _, factor in SUMMARY:
            value = metrics.get(metric, "").replace(",", "")
            cells.append(f"{float(value) * factor:.3g}" if value else "-")
        print(f"| `{name}` | " + " | ".join(cells) + " |")


def hotspots(path: str, region: int = 250):
    """Stall samples of one kernel's `--page source --csv --print-source sass` export: the stall reasons, the
    opcodes that hold the samples, global and local (spill) L2 sectors, and the samples by runs of `region` SASS
    instructions in address order (a loop or a straight-line stretch shows up as a run)."""
    lines = pathlib.Path(path).read_text().splitlines()
    rows = list(csv.reader(lines[1:]))  # the first line names the kernel
    col = {name: i for i, name in enumerate(rows[0])}
    data = rows[1:]

    def num(r, name):
        return float(r[col[name]].replace(",", "") or 0) if name in col else 0.0

    samples = "Warp Stall Sampling (All Samples)"
    total = sum(num(r, samples) for r in data) or 1.0
    reasons = [n for n in col if n.startswith("stall_") and "Not Issued" not in n]

    def shares(counter):
        return ", ".join(f"{k} {100 * v / total:.1f} %" for k, v in counter.most_common(8) if v / total >= 0.01)

    print(f"{len(data)} SASS instructions, {total:.0f} samples")
    print("stall reasons:", shares(collections.Counter({n[6:]: sum(num(r, n) for r in data) for n in reasons})))
    ops = collections.Counter()
    for r in data:
        words = [w for w in r[col["Source"]].split() if not w.startswith("@")]
        ops[words[0].split(".")[0] if words else "?"] += num(r, samples)
    print("opcodes:", shares(ops))
    sectors = [sum(num(r, f"L2 Theoretical Sectors {kind}") for r in data) for kind in ("Global", "Local")]
    print(f"L2 sectors: global {sectors[0]:.3g}, local (spills) {sectors[1]:.3g}")
    for i in range(0, len(data), region):
        part = data[i:i + region]
        top = collections.Counter({n[6:]: sum(num(r, n) for r in part) for n in reasons})
        print(f"  instructions {i:5d}-{i + len(part):5d}: {100 * sum(num(r, samples) for r in part) / total:5.1f} % of "
              "samples; " + ", ".join(k for k, v in top.most_common(3) if v))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", choices=["kda", "mla", "attnres", "moe", "moe_fp4"])
    ap.add_argument("--summarize", metavar="CSV", help="print the table of an ncu --csv --page details file")
    ap.add_argument("--hotspots", metavar="CSV", help="summarise an ncu --page source --print-source sass export")
    args = ap.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    if args.hotspots:
        return hotspots(args.hotspots)
    if args.mode is None:
        ap.error("give a mode or --summarize")
    sys.path.insert(0, str(pathlib.Path(__file__).parent))  # the sibling benchmark scripts' input builders
    {"kda": kda, "mla": mla, "attnres": attnres, "moe": moe, "moe_fp4": moe_fp4}[args.mode]()


if __name__ == "__main__":
    main()
