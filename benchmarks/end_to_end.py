"""End-to-end GPU check and timing of a K3-width model (hidden 7168, the real KDA / MLA / latent-MoE shapes, 3 KDA
+ 1 MLA layers, `--experts` routed experts top-16) in bf16: the torch path against our kernels (Triton KDA chunk +
decode, `k3_mla_paged` attention, `k3_triton` experts, fused AttnRes), same weights, and against transformers'
native Kimi Linear (fla kernels when fla is importable) at a matching size as the peer.

Checks: prefill logits of the kernel path against the torch path (bf16 tolerance), cached decode against the
full forward, greedy generate tokens.
Times: prefill and eager decode per token at B = 1 and 64 for a 1K prompt (and B = 1 at 32K with `--long`),
each after an untimed warm-up at the same batch and prompt length (compilation, autotuning), and the cache bytes that each token
adds (the growing part; K3's KDA state and the peer's recurrent state are fixed per sequence).

`--mxfp4` builds the routed experts as the release ships them, MXFP4-packed (random bytes, scales near 2**-7), at the
real expert count by default (896: 47 GB for the three MoE layers, where bf16 would need 177): the kernel path runs
them packed (W4A16), the torch path through the "eager" experts, which dequantise one touched expert at a time (the
bf16 `grouped_mm` needs 3-D bf16 experts). That path is slow by design, so it is timed at B = 1 only.

    . scripts/device_env.sh && python3 -u benchmarks/end_to_end.py [--peer | --peer-only] [--long] [--experts 64]
    . scripts/device_env.sh && python3 -u benchmarks/end_to_end.py --mxfp4 [--long] [--graph] [--batches 1]

`--graph` adds kernel-path rows whose decode steps replay a CUDA graph over a static cache (`max_cache_len` = the
prompt + 64: the cache bytes a token then include the unused capacity).
"""

import argparse
import time

import torch

import transformers_k3  # noqa: F401
from transformers_k3 import KimiK3Cache, KimiK3Config, KimiK3ForConditionalGeneration
from transformers_k3.cuda_graph import DecodeGraph
from transformers_k3.modeling_kimi_k3 import _PACK_EXPERTS, KimiK3Experts
from transformers_k3.tiny import released_config_dict

VOCAB = 4096


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def set_path(lm, fast: bool, packed: bool = False):
    lm.config.kda_backend = "triton" if fast else "torch"
    lm.set_attn_implementation("k3_mla_paged" if fast else "sdpa")
    lm.set_experts_implementation("k3_triton" if fast else ("eager" if packed else "grouped_mm"))


def k3_model(experts: int, mxfp4: bool = False):
    d = released_config_dict()  # carries the release's MXFP4 quantization_config
    t = d["text_config"]
    t.update(num_hidden_layers=4, num_experts=experts, num_experts_per_token=16, vocab_size=VOCAB)
    t["linear_attn_config"] = dict(t["linear_attn_config"], kda_layers=[1, 2, 3], full_attn_layers=[4])
    torch.manual_seed(0)
    # What `from_pretrained(..., keep_experts_packed=True)` sets while it builds the model (no checkpoint here).
    token = _PACK_EXPERTS.set("explicit" if mxfp4 else None)
    try:
        with torch.device("cuda"):
            m = KimiK3ForConditionalGeneration(KimiK3Config(**d)).eval()
    finally:
        _PACK_EXPERTS.reset(token)
    for mod in m.modules():
        if isinstance(mod, KimiK3Experts) and mod.packed:
            mod.gate_up_proj_blocks.random_(0, 256)
            mod.down_proj_blocks.random_(0, 256)
            mod.gate_up_proj_scales.random_(119, 123)  # dequantised weights ~N(0, 0.01)-sized
            mod.down_proj_scales.random_(119, 123)
    return m.language_model.to(torch.bfloat16), t


def kimi_linear_peer(t: dict, experts: int, device="cuda"):
    """Transformers' Kimi Linear at K3's widths: same layer pattern, heads, MLA ranks, expert count and width."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    la = t["linear_attn_config"]
    cfg = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
        moe_intermediate_size=t["moe_intermediate_size"], num_hidden_layers=4,
        num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_attention_heads"],
        kv_lora_rank=t["kv_lora_rank"], q_lora_rank=t["q_lora_rank"], qk_rope_head_dim=t["qk_rope_head_dim"],
        qk_nope_head_dim=t["qk_nope_head_dim"], v_head_dim=t["v_head_dim"], num_local_experts=experts,
        num_experts_per_tok=16, n_shared_experts=t["num_shared_experts"],
        linear_attn_config=dict(head_dim=la["head_dim"], num_heads=la["num_heads"], short_conv_kernel_size=4,
                                kda_layers=[1, 2, 3], full_attn_layers=[4]),
        first_k_dense_replace=1, pad_token_id=VOCAB - 1, bos_token_id=VOCAB - 4, eos_token_id=VOCAB - 3,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return KimiLinearForCausalLM(cfg).eval().to(torch.bfloat16)


def tensor_bytes(obj, seen=None) -> int:
    """Bytes of every CUDA tensor reachable from a cache object (layers, lists, dicts, attributes)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        return sum(tensor_bytes(x, seen) for x in vars(obj).values())
    return 0


def timed(model, x, B, P, steps, make_cache, prefill_chunk=None, graph=False):
    """(prefill s, decode s per step, cache bytes added per token). ``prefill_chunk``: feed the prompt in pieces
    of that many tokens through the cache (the peer at B = 64, whose experts cannot take 64K tokens at once).
    ``graph``: decode steps replayed from a CUDA graph (`DecodeGraph`, a static cache from ``make_cache``); its
    eager first step and its capture run before the timer."""
    def run(prompt, n):
        cache = make_cache()
        kw = {"cache": cache} if isinstance(cache, KimiK3Cache) else {"past_key_values": cache}
        torch.cuda.synchronize(); t0 = time.perf_counter()
        step = prefill_chunk or prompt.shape[1]
        for s in range(0, prompt.shape[1], step):
            out = model(input_ids=prompt[:, s:s + step], use_cache=True, **kw)
            if cache is None:
                cache = out.past_key_values
                kw = {"past_key_values": cache}
        torch.cuda.synchronize(); pre = time.perf_counter() - t0
        kw = {"cache": cache} if isinstance(cache, KimiK3Cache) else {"past_key_values": cache}
        tok = out.logits[:, -1:].argmax(-1)
        step = lambda t: model(input_ids=t, use_cache=True, **kw).logits  # noqa: E731
        if graph:
            step = DecodeGraph(model, cache)
            for _ in range(2):
                tok = step(tok)[:, -1:].argmax(-1)
        b0 = cache.nbytes()["mla"] if isinstance(cache, KimiK3Cache) else tensor_bytes(cache)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(n):
            tok = step(tok)[:, -1:].argmax(-1)
        torch.cuda.synchronize(); dec = (time.perf_counter() - t0) / max(n, 1)
        if isinstance(cache, KimiK3Cache):
            per_tok = cache.nbytes()["mla"] / (B * cache.get_seq_length())
        else:
            per_tok = (tensor_bytes(cache) - b0) / (B * n)
        return pre, dec, per_tok

    # Warm-up at the same batch and prompt length, as many decode steps as are timed: kernel variants (the MLA
    # split count, fla's autotuning, Triton's divisible-by-16 integer specialisation) are picked by shape and
    # length, and a shorter warm-up left compilation inside the timed region.
    run(x[:B, :P], steps)
    return run(x[:B, :P], steps)


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--peer", action="store_true", help="also time transformers' Kimi Linear (fla if importable)")
    ap.add_argument("--long", action="store_true", help="add a 32K prompt at B = 1")
    ap.add_argument("--peer-only", action="store_true", help="time only the peer (its own process: fla autotunes)")
    ap.add_argument("--mxfp4", action="store_true", help="MXFP4-packed routed experts, 896 unless --experts is given")
    ap.add_argument("--graph", action="store_true", help="add kernel rows with CUDA-graph decode (static cache)")
    ap.add_argument("--batches", default="1,64", help="batch sizes of the 1K-prompt rows (B = 64 needs the H200's "
                    "memory with --mxfp4)")
    args = ap.parse_args()
    args.peer = args.peer or args.peer_only
    if args.mxfp4 and args.experts == ap.get_default("experts"):
        args.experts = 896
    lm, t = k3_model(args.experts, args.mxfp4)
    n = sum(p.numel() for p in lm.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in lm.parameters())
    print(f"K3-width, 4 layers, {args.experts} experts{' MXFP4-packed' if args.mxfp4 else ''}, {n / 1e9:.2f}B "
          f"stored values ({nbytes / 1e9:.1f} GB), {torch.cuda.get_device_name()}, torch {torch.__version__}",
          flush=True)
    x = torch.randint(0, VOCAB, (64, 32768 if args.long else 1024), device="cuda")
    logits, rows = {}, []
    cases = [(int(b), 1024) for b in args.batches.split(",")] + ([(1, 32768)] if args.long else [])
    for fast in (() if args.peer_only else (False, True)):
        set_path(lm, fast, args.mxfp4)
        logits[fast] = lm(input_ids=x[:2, :512], use_cache=False).logits
        cache = KimiK3Cache(lm.config)
        a = lm(input_ids=x[:2, :500], cache=cache).logits
        b = torch.cat([lm(input_ids=x[:2, s : s + 1], cache=cache).logits for s in range(500, 512)], 1)
        print(f"{'kernels' if fast else 'torch  '}: cached decode vs full prefill rel err "
              f"{rel(torch.cat([a, b], 1), logits[fast]):.2e}", flush=True)
    if not args.peer_only:
        print(f"kernels vs torch path, prefill logits rel err {rel(logits[True], logits[False]):.2e}")
        gen = {}
        for fast in (False, True):
            set_path(lm, fast, args.mxfp4)
            gen[fast] = lm.generate(x[:2, :64], max_new_tokens=16, do_sample=False)
        same = (gen[True] == gen[False]).float().mean().item()
        print(f"greedy generate, 16 tokens x 2 sequences: {100 * same:.0f} % of tokens equal", flush=True)

    for fast in (() if args.peer_only else (False, True)):
        set_path(lm, fast, args.mxfp4)
        # the packed torch path dequantises every touched expert at every call: B = 1 only
        for B, P in (cases if fast or not args.mxfp4 else [(1, 1024)]):
            pre, dec, per_tok = timed(lm, x, B, P, 16, lambda: KimiK3Cache(lm.config))
            rows.append(("K3 kernels" if fast else "K3 torch", B, P, pre, dec, per_tok))
            print(rows[-1], flush=True)
            if fast and args.graph:
                static = lambda: KimiK3Cache(lm.config, max_cache_len=P + 64)  # noqa: E731
                pre, dec, per_tok = timed(lm, x, B, P, 16, static, graph=True)
                rows.append(("K3 kernels, CUDA-graph decode (static cache)", B, P, pre, dec, per_tok))
                print(rows[-1], flush=True)
    if args.peer:
        del lm
        torch.cuda.empty_cache()
        peer = kimi_linear_peer(t, args.experts)
        try:
            import fla  # noqa: F401
            name = "Kimi Linear (transformers, fla)"
        except ImportError:
            name = "Kimi Linear (transformers, torch)"
        print(f"peer: {name}, {sum(p.numel() for p in peer.parameters()) / 1e9:.2f}B params", flush=True)
        for B, P in cases:
            label = name
            try:
                pre, dec, per_tok = timed(peer, x, B, P, 16, lambda: None)
            except torch.OutOfMemoryError as e:  # transformers' grouped_mm materialises [tokens * top-k, hidden]
                print(f"{name} B={B} P={P}: out of memory ({str(e).splitlines()[0]}); again with the prompt in "
                      f"256-token pieces", flush=True)
                torch.cuda.empty_cache()
                label = f"{name}, prefill in 256-token pieces"
                try:
                    pre, dec, per_tok = timed(peer, x, B, P, 16, lambda: None, prefill_chunk=256)
                except Exception as e2:  # out of memory again, or the peer's cache refusing a chunked prompt
                    print(f"{name} B={B} P={P}: failed again ({type(e2).__name__}: {str(e2).splitlines()[0]})",
                          flush=True)
                    torch.cuda.empty_cache()
                    pre = dec = per_tok = float("nan")
            rows.append((label, B, P, pre, dec, per_tok))
            print(rows[-1], flush=True)
    print("\n| model / path | B | prompt | prefill ms | prefill tok/s | decode ms/step | decode tok/s | "
          "cache bytes/token |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, B, P, pre, dec, per_tok in rows:
        print(f"| {name} | {B} | {P} | {pre * 1e3:.0f} | {B * P / pre:,.0f} | {dec * 1e3:.1f} | {B / dec:,.0f} | "
              f"{per_tok:,.0f} |")


if __name__ == "__main__":
    main()
