"""Small checkpoints in the released layout, for tests and demos.

`tiny_config()` scales the released config down while keeping every structural feature: both layer kinds in
the 3:1 pattern with a final MLA layer, several AttnRes blocks, a dense layer 0, the latent MoE with MXFP4
experts (the release's `quantization_config`), a padded `A_log` (head_dim > num_heads), the vision slots.
`write_tiny_checkpoint(dir)` saves random weights there through `save_pretrained`, i.e. in the released layout.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

import torch

from .configuration_kimi_k3 import KimiK3Config

_RELEASED_CONFIG = Path(__file__).with_name("released_config.json")


def released_config_dict() -> dict:
    return json.loads(_RELEASED_CONFIG.read_text())


def tiny_config(num_hidden_layers: int = 8, vocab_size: int = 512, **text_overrides) -> KimiK3Config:
    d = released_config_dict()
    t = d["text_config"]
    n = num_hidden_layers
    mla = [i for i in range(1, n + 1) if i % 4 == 0 or i == n]
    t.update(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=16, num_experts_per_token=4,
        routed_expert_hidden_size=32, attn_res_block_size=3, mla_page_size=8,
        bos_token_id=vocab_size - 4, eos_token_id=vocab_size - 3, pad_token_id=vocab_size - 1,
    )
    t["linear_attn_config"] = dict(
        t["linear_attn_config"], num_heads=4, head_dim=16,
        kda_layers=[i for i in range(1, n + 1) if i not in mla], full_attn_layers=mla,
    )
    t.update(text_overrides)
    d["vision_config"].update(
        vt_hidden_size=32, vt_intermediate_size=64, vt_num_attention_heads=2, vt_num_hidden_layers=2,
        qkv_hidden_size=32, mm_hidden_size=32, text_hidden_size=t["hidden_size"],
        # the released 64 x 64 position table (only its width is small): images are resized from it as in K3
    )
    d.update(bos_token_id=vocab_size - 4, eos_token_id=vocab_size - 3, pad_token_id=vocab_size - 1,
             media_placeholder_token_id=vocab_size - 2)
    return KimiK3Config(**copy.deepcopy(d))


def write_tiny_checkpoint(path, seed: int = 0, dtype: torch.dtype = torch.bfloat16, **config_kwargs):
    from .modeling_kimi_k3 import KimiK3ForConditionalGeneration

    torch.manual_seed(seed)
    config = tiny_config(**config_kwargs)
    model = KimiK3ForConditionalGeneration(config)
    with torch.no_grad():
        # Give the zero-initialised AttnRes queries and router bias some signal so tests see them work.
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.01)
    model.to(dtype)  # the precision-contract tensors stay fp32 (KimiK3PreTrainedModel._apply)
    model.save_pretrained(path, experts_format="mxfp4")  # the released layout: random experts quantised
    return path


def save_small_checkpoint(model, out, *companions, max_mb: float | None = None) -> dict:
    """Save a trained small model into `out` in the released layout (bf16, MXFP4 experts) with its tokenizer or
    processor (`companions`), replacing the files already there; check that the experts really went out packed.

    Returns `{"dir", "mb", "n_tensors", "n_weight_packed", "files"}`; warns when the folder exceeds `max_mb`.
    """
    import warnings

    from safetensors import safe_open

    out = Path(out)
    if out.exists():
        for f in out.iterdir():
            if f.is_file():
                f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    model.config.get_text_config().kda_backend = "auto"
    model.to("cpu").to(torch.bfloat16)  # precision-contract tensors stay fp32 (KimiK3PreTrainedModel._apply)
    model.save_pretrained(out, experts_format="mxfp4")  # the released layout: trained experts quantised
    for companion in companions:
        companion.save_pretrained(out)
    keys = []
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            keys += list(sf.keys())
    packed = [k for k in keys if k.endswith(".weight_packed")]
    if not packed:
        raise RuntimeError("save_pretrained wrote no *.weight_packed expert tensors (MXFP4 block missing?)")
    size_mb = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1e6
    print(f"[save] {out}: {size_mb:.1f} MB, {len(keys)} tensors, {len(packed)} *.weight_packed", flush=True)
    if max_mb is not None and size_mb > max_mb:
        warnings.warn(f"saved checkpoint is {size_mb:.1f} MB (> {max_mb:g} MB target)")
    return {"dir": str(out), "mb": size_mb, "n_tensors": len(keys), "n_weight_packed": len(packed),
            "files": sorted(f.name for f in out.iterdir() if f.is_file())}


def time_lr_lambda(start_holder: list, budget_s: float, warmup_steps: int, min_ratio: float = 0.1):
    """LR factor for `LambdaLR` in the wall-clock-budgeted training examples: linear warmup by step, then cosine
    decay by the elapsed fraction of `budget_s` (timed from the first step after warmup, kept in `start_holder`)."""

    def f(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if not start_holder:
            start_holder.append(time.monotonic())
        frac = min((time.monotonic() - start_holder[0]) / budget_s, 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return f
