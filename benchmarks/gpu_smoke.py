"""GPU check of the torch path: a tiny released-layout checkpoint in bf16 on CUDA (load, forward, cached =
full, greedy/beam/sampling generate), then a K3-width model (hidden 7168, the real KDA/MLA shapes, few layers
and experts) against its own fp32 forward, with prefill and decode timings.

    python benchmarks/gpu_smoke.py
"""

import tempfile
import time

import torch

import transformers_k3
from transformers_k3 import KimiK3Cache, KimiK3Config, KimiK3ForConditionalGeneration
from transformers_k3.tiny import released_config_dict, write_tiny_checkpoint


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@torch.no_grad()
def tiny_checks():
    path = tempfile.mkdtemp()
    write_tiny_checkpoint(path, dtype=torch.bfloat16)
    m = KimiK3ForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    lm = m.language_model
    x = torch.randint(0, 500, (3, 37), device="cuda")
    full = lm(input_ids=x, use_cache=False).logits
    cache = KimiK3Cache(lm.config)
    a = lm(input_ids=x[:, :30], cache=cache).logits
    b = torch.cat([lm(input_ids=x[:, t : t + 1], cache=cache).logits for t in range(30, 37)], 1)
    print(f"tiny bf16 cuda: cached vs full rel err {rel(torch.cat([a, b], 1), full):.2e}")
    g = lm.generate(x[:, :9], max_new_tokens=8, do_sample=False)
    bs = lm.generate(x[:, :9], max_new_tokens=8, num_beams=3)
    s = lm.generate(x[:, :9], max_new_tokens=8, do_sample=True, top_p=0.9)
    print("tiny generate greedy/beam/sample shapes", tuple(g.shape), tuple(bs.shape), tuple(s.shape))


@torch.no_grad()
def k3_width():
    d = released_config_dict()
    t = d["text_config"]
    t.update(num_hidden_layers=5, num_experts=32, num_experts_per_token=16, vocab_size=4096)
    t["linear_attn_config"] = dict(t["linear_attn_config"], kda_layers=[1, 2, 3], full_attn_layers=[4, 5])
    config = KimiK3Config(**d)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = KimiK3ForConditionalGeneration(config).eval()
    lm = m.language_model
    n = sum(p.numel() for p in lm.parameters())
    x = torch.randint(0, 4096, (1, 1024), device="cuda")
    ref = lm(input_ids=x[:, :256], use_cache=False).logits
    lm_bf16 = lm.to(torch.bfloat16)
    out = lm_bf16(input_ids=x[:, :256], use_cache=False).logits
    print(f"K3-width 5 layers ({n / 1e9:.2f}B params): bf16 vs fp32 logits rel err {rel(out, ref):.2e}")
    for T in (1024,):
        cache = KimiK3Cache(lm.config)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        o = lm_bf16(input_ids=x[:, :T], cache=cache).logits
        torch.cuda.synchronize(); pre = time.perf_counter() - t0
        tok = o[:, -1:].argmax(-1)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(16):
            tok = lm_bf16(input_ids=tok, cache=cache).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize(); dec = (time.perf_counter() - t0) / 16
        print(f"K3-width torch path, eager, B=1, prompt {T}: prefill {pre * 1e3:.0f} ms ({T / pre:.0f} tok/s), "
              f"decode {dec * 1e3:.1f} ms/token; cache {cache.nbytes()}")


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    import transformers
    print("transformers", transformers.__version__)
    tiny_checks()
    k3_width()
