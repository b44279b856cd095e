"""CPU prefill and decode throughput of a small released-layout checkpoint on the torch reference path.

    python benchmarks/cpu_torch_path.py [--prompt 512] [--new 64] [--batch 1]
"""

import argparse
import platform
import tempfile
import time

import torch
import transformers

import transformers_k3
from transformers_k3 import KimiK3Cache, KimiK3ForConditionalGeneration
from transformers_k3.tiny import write_tiny_checkpoint


@torch.no_grad()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = tempfile.mkdtemp()
    write_tiny_checkpoint(path, dtype=torch.float32)
    lm = KimiK3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval().language_model
    x = torch.randint(0, 500, (args.batch, args.prompt))
    lm(input_ids=x[:, :16], use_cache=False)  # warm-up
    cache = KimiK3Cache(lm.config)
    t0 = time.perf_counter()
    out = lm(input_ids=x, cache=cache, use_cache=True)
    prefill = time.perf_counter() - t0
    tok = out.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(args.new):
        tok = lm(input_ids=tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    decode = time.perf_counter() - t0
    params = sum(p.numel() for p in lm.parameters())
    print(f"| {time.strftime('%Y-%m-%d')} | {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads "
          f"| torch {torch.__version__}, transformers {transformers.__version__}, transformers-k3 {transformers_k3.__version__} "
          f"| {params / 1e6:.2f}M | {args.batch} | {args.prompt} | {args.batch * args.prompt / prefill:.0f} "
          f"| {args.batch * args.new / decode:.1f} | {1000 * decode / args.new:.1f} |")


if __name__ == "__main__":
    main()
