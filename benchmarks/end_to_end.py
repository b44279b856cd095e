"""End-to-end GPU check and timing: a K3-width model (hidden 7168, the real KDA/MLA/expert shapes, 3 KDA + 1 MLA
layers, 64 experts top-16) in bf16, run on the torch path and on our kernels (Triton KDA chunk + decode,
`k3_mla_paged` attention, `k3_triton` experts, fused AttnRes), same weights.

Checks: prefill logits of the kernel path against the torch path (bf16 tolerance), greedy generate tokens.
Times: prefill and decode (eager, per token) at B = 1 and 64 for a 1K prompt, and the cache bytes per token.

    . scripts/device_env.sh && python3 benchmarks/end_to_end.py
"""

import time

import torch

import transformers_k3  # noqa: F401
from transformers_k3 import KimiK3Cache, KimiK3Config, KimiK3ForConditionalGeneration
from transformers_k3.tiny import released_config_dict


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def set_path(lm, fast: bool):
    lm.config.kda_backend = "triton" if fast else "torch"
    lm.set_attn_implementation("k3_mla_paged" if fast else "sdpa")
    lm.set_experts_implementation("k3_triton" if fast else "grouped_mm")


@torch.no_grad()
def main():
    d = released_config_dict()
    t = d["text_config"]
    t.update(num_hidden_layers=4, num_experts=64, num_experts_per_token=16, vocab_size=4096)
    t["linear_attn_config"] = dict(t["linear_attn_config"], kda_layers=[1, 2, 3], full_attn_layers=[4])
    config = KimiK3Config(**d)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = KimiK3ForConditionalGeneration(config).eval()
    lm = m.language_model.to(torch.bfloat16)
    n = sum(p.numel() for p in lm.parameters())
    print(f"K3-width, 4 layers, {n / 1e9:.2f}B params, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    x = torch.randint(0, 4096, (64, 1024), device="cuda")
    logits = {}
    for fast in (False, True):
        set_path(lm, fast)
        logits[fast] = lm(input_ids=x[:2, :512], use_cache=False).logits
        cache = KimiK3Cache(lm.config)
        a = lm(input_ids=x[:2, :500], cache=cache).logits
        b = torch.cat([lm(input_ids=x[:2, s : s + 1], cache=cache).logits for s in range(500, 512)], 1)
        print(f"{'kernels' if fast else 'torch  '}: cached decode vs full prefill rel err {rel(torch.cat([a, b], 1), logits[fast]):.2e}")
    print(f"kernels vs torch path, prefill logits rel err {rel(logits[True], logits[False]):.2e}")
    gen = {}
    for fast in (False, True):
        set_path(lm, fast)
        gen[fast] = lm.generate(x[:2, :64], max_new_tokens=16, do_sample=False)
    same = (gen[True] == gen[False]).float().mean().item()
    print(f"greedy generate, 16 tokens x 2 sequences: {100 * same:.0f} % of tokens equal")
    print("\n| path | B | prompt | prefill ms | prefill tok/s | decode ms/step | decode tok/s | MLA cache bytes/token |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for fast in (False, True):
        set_path(lm, fast)
        for B in (1, 64):
            cache = KimiK3Cache(lm.config)
            torch.cuda.synchronize(); t0 = time.perf_counter()
            o = lm(input_ids=x[:B, :1024], cache=cache).logits
            torch.cuda.synchronize(); pre = time.perf_counter() - t0
            tok = o[:, -1:].argmax(-1)
            for _ in range(2):  # warm-up steps (compile / autotune)
                tok = lm(input_ids=tok, cache=cache).logits[:, -1:].argmax(-1)
            torch.cuda.synchronize(); t0 = time.perf_counter()
            steps = 16
            for _ in range(steps):
                tok = lm(input_ids=tok, cache=cache).logits[:, -1:].argmax(-1)
            torch.cuda.synchronize(); dec = (time.perf_counter() - t0) / steps
            nb = cache.nbytes()
            per_tok = nb["mla"] / (B * cache.get_seq_length())  # the growing part; KDA state is fixed per sequence
            print(f"| {'kernels' if fast else 'torch'} | {B} | 1024 | {pre * 1e3:.0f} | {B * 1024 / pre:.0f} | "
                  f"{dec * 1e3:.1f} | {B / dec:.0f} | {per_tok:.0f} |")


if __name__ == "__main__":
    main()
