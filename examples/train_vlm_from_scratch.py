"""Train a small Kimi-K3 vision-language model from scratch by next-token prediction (SPEC 6), and compare it
with a contrastively pre-trained vision tower.

Everything is offline. The corpus is synthetic and regenerated from seeds: numpy-rasterised scenes of 1-4 shapes
(circle, square, triangle) in four colours, one per quadrant (top left / ... / bottom right), on images of 56-112 px per
side (so `image_grid_thw` varies and the processor pads some to multiples of 28). Each image comes with a caption
("two red circles and a blue square") and questions ("How many circles?" 2, "What colour is the square?" red,
"Where is the triangle?" top left). Held-out images come from another seed and are checked not to repeat a training
image pixel for pixel.

The model is the released config scaled down (`tiny_config`: KDA/MLA 3:1 with a final MLA layer, AttnRes blocks,
latent MoE with MXFP4 experts on save, the MoonViT-V2 tower with its released structure) with the embedded text
model's tokenizer. The vision tower starts random. `--init scratch` (the K3 recipe, default) trains everything
jointly with `transformers.Trainer` from the next-token loss on the answer/caption tokens only. `--init
contrastive` first spends `--contrastive-share` of the same wall-clock budget on CLIP-style InfoNCE between the
mean-pooled projected image features and a tiny GRU caption encoder, then runs the same next-token training.
`--compare` runs both. Held-out exact-match accuracy of greedy `generate` answers (through `KimiK3Processor`) is
reported per question type against chance; evidence goes to `--evidence`, the scratch model in the released
layout with its processor to `--out`.

    python3 examples/train_vlm_from_scratch.py --smoke --compare           # tiny CPU run (< 90 s on one core)
    python3 examples/train_vlm_from_scratch.py --compare --max-minutes 3.25  # one H200, both runs, ~8 min
    python3 examples/train_vlm_from_scratch.py --size cpu --max-minutes 25   # two CPU cores, scratch only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from transformers_k3.tiny import time_lr_lambda

REPO = Path(__file__).resolve().parent.parent
EMBEDDED = REPO / "src/transformers_k3/embedded"

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 60, 220), "yellow": (235, 200, 20)}
SLOTS = ("top left", "top right", "bottom left", "bottom right")
# Slot centres as fractions of (width, height): the four quadrants. Half-sizes are at most 0.22 of the shorter side
# and centres move by at most 0.02 of a side, so neighbouring shapes keep >= 0.46 - 2 * 0.22 > 0 apart and inside
# the image. Large shapes matter: with the earlier 0.12-radius shapes in a plus layout (a shape ~6 % of the image),
# the from-scratch model stayed at the answer prior for its whole GPU budget; a shape that covers a larger share
# of its patches gives the randomly initialised tower a stronger signal to start from.
SLOT_CENTRES = {"top left": (0.25, 0.25), "top right": (0.75, 0.25), "bottom left": (0.25, 0.75),
                "bottom right": (0.75, 0.75)}
RADIUS = 0.2  # nominal half-size, as a fraction of the shorter side (jittered by 0.85-1.1)
SIDES = (56, 70, 84, 98, 112)
NUMBER_WORDS = {1: "a", 2: "two", 3: "three", 4: "four"}
QUESTION_TYPES = ("count", "colour", "position")
CAPTION_PROMPT = "Describe the image."


# ----------------------------------------------------------------------------------------------------------
# Scenes: spec, rendering, text
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Shape:
    shape: str
    colour: str
    slot: str
    cx: int
    cy: int
    r: int


@dataclass
class Scene:
    width: int
    height: int
    background: int
    focus: str  # the shape the count question asks about
    objects: list[Shape] = field(default_factory=list)


def make_scene(rng: random.Random) -> Scene:
    """0-4 copies of a focus shape (uniform, so a count question's answer is uniform over 0-4) plus other shapes,
    1-4 objects in all, in distinct slots, colours random; sizes and centres jittered a little."""
    w, h = rng.choice(SIDES), rng.choice(SIDES)
    focus, k = rng.choice(SHAPES), rng.randint(0, 4)
    others = [s for s in SHAPES if s != focus]
    shapes = [focus] * k + [rng.choice(others) for _ in range(rng.randint(1 if k == 0 else 0, 4 - k))]
    rng.shuffle(shapes)
    scene = Scene(w, h, background=rng.randint(225, 255), focus=focus)
    base = RADIUS * min(w, h)
    for shape, slot in zip(shapes, rng.sample(SLOTS, len(shapes))):
        fx, fy = SLOT_CENTRES[slot]
        jx, jy = rng.uniform(-0.02, 0.02) * w, rng.uniform(-0.02, 0.02) * h
        scene.objects.append(Shape(shape, rng.choice(list(COLOURS)), slot, round(fx * w + jx), round(fy * h + jy),
                                   max(4, round(base * rng.uniform(0.85, 1.1)))))
    return scene


def render(scene: Scene) -> np.ndarray:
    """The scene as an RGB `[H, W, 3]` uint8 array (what `KimiK3ImageProcessor` takes, like a PIL image).

    Rasterised with numpy masks over pixel centres rather than PIL: no antialiasing, so every object pixel has its
    colour exactly, and no Pillow needed (the training machine's environment may lack it)."""
    img = np.full((scene.height, scene.width, 3), scene.background, dtype=np.uint8)
    y, x = np.mgrid[0:scene.height, 0:scene.width]  # [H, W] each
    for o in scene.objects:
        dx, dy = x - o.cx, y - o.cy
        if o.shape == "circle":
            mask = dx**2 + dy**2 <= o.r**2
        elif o.shape == "square":
            mask = (np.abs(dx) <= o.r) & (np.abs(dy) <= o.r)
        elif o.shape == "triangle":  # apex up at (cx, cy - r), base from (cx - r, cy + r) to (cx + r, cy + r)
            mask = (np.abs(dy) <= o.r) & (2 * np.abs(dx) <= dy + o.r)
        else:
            raise ValueError(f"scene object has unknown shape {o.shape!r}; expected one of {SHAPES}")
        img[mask] = COLOURS[o.colour]
    return img


def _noun(shape: str, n: int) -> str:
    return shape if n == 1 else shape + "s"


def caption(scene: Scene) -> str:
    """Groups of (colour, shape), most frequent first, then in SHAPES / COLOURS order: one canonical caption."""
    groups: dict[tuple[str, str], int] = {}
    for o in scene.objects:
        groups[(o.colour, o.shape)] = groups.get((o.colour, o.shape), 0) + 1
    colours = list(COLOURS)
    order = sorted(groups, key=lambda g: (-groups[g], SHAPES.index(g[1]), colours.index(g[0])))
    parts = [f"{NUMBER_WORDS[groups[g]]} {g[0]} {_noun(g[1], groups[g])}" for g in order]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def questions(scene: Scene) -> list[tuple[str, str, str]]:
    """(type, question, answer) for every well-posed question about the scene.

    count: the scene's focus shape (0-4 of them); colour and position: only shapes that occur exactly once
    (otherwise "the square" is ambiguous).
    """
    counts = {s: sum(o.shape == s for o in scene.objects) for s in SHAPES}
    out = [("count", f"How many {scene.focus}s?", str(counts[scene.focus]))]
    for o in scene.objects:
        if counts[o.shape] == 1:
            out.append(("colour", f"What colour is the {o.shape}?", o.colour))
            out.append(("position", f"Where is the {o.shape}?", o.slot))
    return out


def scene_tasks(scene: Scene) -> list[tuple[str, str, str]]:
    return questions(scene) + [("caption", CAPTION_PROMPT, caption(scene))]


# ----------------------------------------------------------------------------------------------------------
# Tokenizer, processor and the token layout of one example
# ----------------------------------------------------------------------------------------------------------


def load_processor():
    """`KimiK3Processor` around the embedded text model's tokenizer (byte-level BPE, 8192 ranks + K3 specials)."""
    from transformers import PreTrainedTokenizerFast

    from transformers_k3 import KimiK3ImageProcessor, KimiK3Processor

    cfg = json.loads((EMBEDDED / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(EMBEDDED / "tokenizer.json"), bos_token=cfg["bos_token"], eos_token=cfg["eos_token"],
        pad_token=cfg["pad_token"], additional_special_tokens=cfg.get("extra_special_tokens", []),
        model_max_length=cfg.get("model_max_length", 1 << 20),
    )
    # Our images are at most 112 px per side: the default budget never resizes them, only pads to 28 px.
    return KimiK3Processor(KimiK3ImageProcessor(max_patches=256, max_patches_per_side=16), tok)


class Layout:
    """Prompt = the processor's chat template for one user turn [image, question] plus the assistant header;
    target = answer + `<|end_of_msg|>` (the stop token). Token ids are built from cached pieces (the template's
    special tokens cut the text, so the pieces tokenize independently); a test checks they equal the processor's
    own output for the whole text."""

    def __init__(self, processor):
        self.processor = processor
        tok = processor.tokenizer
        marker = "\x00"
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": marker}]}],
            add_generation_prompt=True, tokenize=False,
        )
        self.prefix, self.suffix = text.split(marker)
        self.image_token_id = processor.image_token_id
        self.end_id = tok.convert_tokens_to_ids("<|end_of_msg|>")
        self.pad_id = tok.pad_token_id
        self._prefix_ids = tok(self.prefix, add_special_tokens=False).input_ids
        if self._prefix_ids.count(self.image_token_id) != 1:
            raise RuntimeError(f"chat template prefix {self.prefix!r} must hold exactly one image token")
        self._suffix_ids = tok(self.suffix, add_special_tokens=False).input_ids
        self._cache: dict[str, list[int]] = {}

    def prompt_text(self, question: str) -> str:
        return self.prefix + question + self.suffix

    def _ids(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = self.processor.tokenizer(text, add_special_tokens=False).input_ids
        return self._cache[text]

    def prompt_ids(self, question: str, n_image_tokens: int) -> list[int]:
        i = self._prefix_ids.index(self.image_token_id)
        return (self._prefix_ids[:i] + [self.image_token_id] * n_image_tokens + self._prefix_ids[i + 1:]
                + self._ids(question) + self._suffix_ids)

    def target_ids(self, answer: str) -> list[int]:
        return self._ids(answer) + [self.end_id]

    def example(self, question: str, answer: str, n_image_tokens: int) -> tuple[list[int], list[int]]:
        """(input_ids, labels): labels are -100 on the prompt (image placeholders included), ids on the target."""
        prompt = self.prompt_ids(question, n_image_tokens)
        target = self.target_ids(answer)
        return prompt + target, [-100] * len(prompt) + target


# ----------------------------------------------------------------------------------------------------------
# Corpus: precomputed tensors, a dataset, a collator
# ----------------------------------------------------------------------------------------------------------


class Corpus:
    """`n_images` scenes from `seed`, rendered and preprocessed once: pixel_values of all images concatenated
    `[total_patches, 3*14*14]`, `grids [n, 3]`, and every (image, task) pair as token ids."""

    def __init__(self, processor, layout: Layout, n_images: int, seed: int, exclude_hashes: set | None = None):
        rng = random.Random(seed)
        ip = processor.image_processor
        self.scenes, self.images, pixels, grids, self.hashes = [], [], [], [], set()
        while len(self.scenes) < n_images:
            scene = make_scene(rng)
            img = render(scene)
            digest = hashlib.sha1(img.tobytes() + bytes(str(img.shape), "ascii")).hexdigest()
            if exclude_hashes and digest in exclude_hashes:
                continue  # a held-out image identical to a training image would not be held out
            out = ip(img)
            self.scenes.append(scene)
            self.images.append(img)
            self.hashes.add(digest)
            pixels.append(out["pixel_values"])
            grids.append(out["image_grid_thw"])
        self.pixel_values = torch.cat(pixels)  # [total_patches, 588]
        self.grids = torch.cat(grids)  # [n, 3]
        n_patches = self.grids.prod(-1)
        self.offsets = F.pad(n_patches.cumsum(0), (1, 0)).tolist()
        self.n_tokens = (n_patches // ip.merge_size**2).tolist()
        self.items = []  # (image index, type, question, answer, input_ids, labels)
        for i, scene in enumerate(self.scenes):
            for kind, q, a in scene_tasks(scene):
                ids, labels = layout.example(q, a, self.n_tokens[i])
                self.items.append((i, kind, q, a, torch.tensor(ids), torch.tensor(labels)))

    def pixels(self, i: int) -> torch.Tensor:
        return self.pixel_values[self.offsets[i]:self.offsets[i + 1]]


class TaskDataset(torch.utils.data.Dataset):
    def __init__(self, corpus: Corpus, kinds=None):
        self.corpus = corpus
        self.index = [j for j, it in enumerate(corpus.items) if kinds is None or it[1] in kinds]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, j):
        i, _, _, _, ids, labels = self.corpus.items[self.index[j]]
        return {"input_ids": ids, "labels": labels, "pixel_values": self.corpus.pixels(i),
                "image_grid_thw": self.corpus.grids[i:i + 1]}


class VLMCollator:
    """Right-pads input_ids (pad id) and labels (-100); pixel_values concatenated, image_grid_thw stacked, in
    sample order, as `KimiK3Processor` lays out a batch. No attention_mask: padding sits after every real token
    of a causal model (KDA and MLA alike), so it cannot change a real position's output, and its labels are -100."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, items):
        T = max(len(x["input_ids"]) for x in items)
        input_ids = torch.full((len(items), T), self.pad_id, dtype=torch.long)  # [B, T]
        labels = torch.full((len(items), T), -100, dtype=torch.long)  # [B, T]
        for b, x in enumerate(items):
            input_ids[b, :len(x["input_ids"])] = x["input_ids"]
            labels[b, :len(x["labels"])] = x["labels"]
        return {"input_ids": input_ids, "labels": labels,
                "pixel_values": torch.cat([x["pixel_values"] for x in items]),  # [total_patches, 588]
                "image_grid_thw": torch.cat([x["image_grid_thw"] for x in items])}  # [B, 3]


# ----------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------


def make_config(processor, size: str, balancing: str):
    """The released config scaled down by `tiny_config` (every structural feature kept), vocab = the tokenizer's.

    size: "smoke" (tests), "cpu" (1.7M parameters, ~0.5 s a step of batch 32 on two CPU cores) or "full" (~10M,
    one GPU)."""
    from transformers_k3.tiny import tiny_config

    tok = processor.tokenizer
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids("<|end_of_msg|>"),
               pad_token_id=tok.pad_token_id)
    # kda_backend "auto": the Triton chunk kernels (forward and backward) on CUDA, the torch reference on the CPU.
    common = dict(vocab_size=len(tok), num_hidden_layers=4 if size == "cpu" else 8, moe_balancing=balancing,
                  kda_backend="auto", max_position_embeddings=4096, **ids)
    if size not in ("smoke", "cpu", "full"):
        raise ValueError(f"size must be 'smoke', 'cpu' or 'full', got {size!r}")
    if size == "cpu":
        size_kw = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, routed_expert_hidden_size=32,
                       num_experts=8, num_experts_per_token=2, num_attention_heads=2, num_key_value_heads=2,
                       q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        vision = dict(vt_hidden_size=64, vt_intermediate_size=128, vt_num_attention_heads=2, vt_num_hidden_layers=2,
                      qkv_hidden_size=64, mm_hidden_size=64)
    elif size == "smoke":
        size_kw = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, routed_expert_hidden_size=32,
                    num_experts=8, num_experts_per_token=2, num_attention_heads=2, num_key_value_heads=2,
                    q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
        vision = dict(vt_hidden_size=32, vt_intermediate_size=64, vt_num_attention_heads=2, vt_num_hidden_layers=1,
                      qkv_hidden_size=32, mm_hidden_size=32)
    else:
        size_kw = dict(hidden_size=192, intermediate_size=512, moe_intermediate_size=96, routed_expert_hidden_size=96,
                    num_experts=16, num_experts_per_token=4, num_shared_experts=1, attn_res_block_size=3,
                    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=96,
                    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, mla_page_size=64)
        vision = dict(vt_hidden_size=128, vt_intermediate_size=384, vt_num_attention_heads=2, vt_num_hidden_layers=3,
                      qkv_hidden_size=128, mm_hidden_size=128)
    cfg = tiny_config(**common, **size_kw)
    tc = cfg.text_config
    if size != "full":
        tc.linear_attn_config.update(num_heads=2, head_dim=16)
    else:
        tc.linear_attn_config.update(num_heads=4, head_dim=32)  # the Triton KDA kernels need power-of-two heads
    tc.validate_k3()
    for k, v in vision.items():
        setattr(cfg.vision_config, k, v)
    cfg.vision_config.text_hidden_size = tc.hidden_size
    # tiny_config puts the special ids at the vocabulary's end; here they are the tokenizer's.
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = ids["bos_token_id"], ids["eos_token_id"], ids["pad_token_id"]
    cfg.media_placeholder_token_id = processor.image_token_id
    return cfg


def count_params(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.vision_tower.parameters()) + sum(
        p.numel() for p in model.mm_projector.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {"total": total, "vision_tower_and_projector": vision, "routed_experts": experts}


# ----------------------------------------------------------------------------------------------------------
# Contrastive pre-training of the vision tower + projector (the comparison run)
# ----------------------------------------------------------------------------------------------------------


class CaptionEncoder(nn.Module):
    """A tiny GRU over the caption's tokens (a bag of words could not tell "red circle and blue square" from
    "blue circle and red square"); its last hidden state, projected, is the caption embedding."""

    def __init__(self, vocab_size: int, dim: int, out_dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.gru = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, out_dim)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.embed(ids))  # [B, L, dim]
        last = h[torch.arange(len(ids), device=ids.device), lengths - 1]  # [B, dim]
        return self.head(last)


def contrastive_pretrain(model, corpus: Corpus, tokenizer, budget_s: float, batch: int, lr: float, device,
                         use_bf16: bool, log_every: int, max_steps: int):
    """CLIP-style InfoNCE between mean-pooled projected image features and caption embeddings, both directions.
    Scenes with the same caption are all positives of each other (soft targets), not false negatives."""
    text_hidden = model.config.vision_config.text_hidden_size
    dim = 128
    caps = [caption(s) for s in corpus.scenes]
    cap_ids = {c: i for i, c in enumerate(sorted(set(caps)))}
    cap_index = torch.tensor([cap_ids[c] for c in caps])
    enc = [tokenizer(c, add_special_tokens=False).input_ids for c in caps]
    L = max(map(len, enc))
    cap_tokens = torch.zeros(len(enc), L, dtype=torch.long)  # [n, L], right-padded
    for i, e in enumerate(enc):
        cap_tokens[i, :len(e)] = torch.tensor(e)
    cap_len = torch.tensor([len(e) for e in enc])

    text_enc = CaptionEncoder(len(tokenizer), dim, dim).to(device)
    img_head = nn.Linear(text_hidden, dim).to(device)
    logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07), device=device))
    vision_params = list(model.vision_tower.parameters()) + list(model.mm_projector.parameters())
    params = vision_params + list(text_enc.parameters()) + list(img_head.parameters()) + [logit_scale]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, time_lr_lambda([], budget_s, warmup_steps=20))
    gen = torch.Generator().manual_seed(1234)
    history, t0, step = [], time.monotonic(), 0
    model.train()
    while step < max_steps and time.monotonic() - t0 < budget_s:
        idx = torch.randperm(len(corpus.scenes), generator=gen)[:batch].tolist()
        pv = torch.cat([corpus.pixels(i) for i in idx]).to(device)  # [patches, 588]
        grid = corpus.grids[idx]  # [b, 3]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            feats = model.get_image_features(pv, grid.to(device))  # b x [h*w/4, text_hidden]
        pooled = torch.stack([f.float().mean(0) for f in feats])  # [b, text_hidden]
        zi = F.normalize(img_head(pooled), dim=-1)  # [b, dim]
        # The caption encoder is tiny: fp32, outside autocast (no bf16 GRU needed).
        zt = F.normalize(text_enc(cap_tokens[idx].to(device), cap_len[idx].to(device)), dim=-1)  # [b, dim]
        logits = logit_scale.clamp(max=math.log(100)).exp() * zi @ zt.T  # [b, b]
        same = (cap_index[idx][:, None] == cap_index[idx][None, :]).float().to(device)  # [b, b]
        target = same / same.sum(-1, keepdim=True)
        loss = 0.5 * (-(target * logits.log_softmax(-1)).sum(-1).mean()
                      - (target * logits.T.log_softmax(-1)).sum(-1).mean())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        if step % log_every == 0 or step == 1:
            with torch.no_grad():
                acc = (logits.argmax(-1) == torch.arange(len(idx), device=device)).float()
                hit = same[torch.arange(len(idx), device=device), logits.argmax(-1)].mean().item()
            history.append({"step": step, "loss": loss.item(), "grad_norm": grad_norm.item(),
                            "retrieval_acc": hit, "exact_index_acc": acc.mean().item(),
                            "time_s": time.monotonic() - t0})
            if len(history) % 5 == 1:
                print(f"[contrastive] step {step} loss {loss.item():.4f} grad_norm {grad_norm.item():.3f} "
                      f"img->caption top-1 {hit:.2f} ({time.monotonic() - t0:.0f} s)", flush=True)
    return {"steps": step, "time_s": time.monotonic() - t0, "history": history,
            "final_loss": history[-1]["loss"] if history else float("nan")}


# ----------------------------------------------------------------------------------------------------------
# Next-token training under Trainer
# ----------------------------------------------------------------------------------------------------------


def make_callback(deadline: float, history: list, tag: str):
    from transformers import TrainerCallback

    class BudgetAndLog(TrainerCallback):
        """Stops at the wall-clock deadline; records Trainer's logged loss / grad_norm (every logging_steps, and at
        the step that stops)."""

        def on_step_end(self, args, state, control, **kw):
            if time.monotonic() > deadline:
                print(f"[{tag}] wall-clock budget reached at step {state.global_step}", flush=True)
                control.should_training_stop = True
                control.should_log = True  # the last step's loss, even when fewer than logging_steps ran
            return control

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                rec = {"step": state.global_step, "loss": float(logs["loss"]),
                       "grad_norm": float(logs["grad_norm"]) if logs.get("grad_norm") is not None else None,
                       "lr": logs.get("learning_rate")}
                history.append(rec)
                if len(history) % 10 == 1:
                    gn = "n/a" if rec["grad_norm"] is None else f"{rec['grad_norm']:.3f}"
                    print(f"[{tag}] step {rec['step']} loss {rec['loss']:.4f} grad_norm {gn}", flush=True)

    return BudgetAndLog()


def train_next_token(model, dataset, collator, budget_s: float, args, hp: dict, device, workdir: Path, tag: str):
    from transformers import Trainer, TrainingArguments

    callbacks = []
    if model.config.text_config.moe_balancing != "none":
        from transformers_k3.balancing import MoEBalancingCallback

        callbacks.append(MoEBalancingCallback())
    history: list = []
    t0 = time.monotonic()
    callbacks.insert(0, make_callback(t0 + budget_s, history, tag))
    optim = torch.optim.AdamW(model.parameters(), lr=hp["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, time_lr_lambda([], budget_s, warmup_steps=hp["warmup"]))
    use_cuda = device.type == "cuda"
    targs = TrainingArguments(
        output_dir=str(workdir / f"_trainer_{tag}"), use_cpu=not use_cuda, bf16=use_cuda,
        per_device_train_batch_size=hp["batch"], max_steps=hp["max_steps"], logging_steps=hp["log_every"],
        save_strategy="no", report_to=[], dataloader_num_workers=0, seed=args.seed, disable_tqdm=True,
        max_grad_norm=1.0, remove_unused_columns=False, label_names=["labels"],
    )
    trainer = Trainer(model=model, args=targs, train_dataset=dataset, data_collator=collator,
                      optimizers=(optim, sched), callbacks=callbacks)
    # Trainer's own printer would bury the progress lines (and the results) in a truncated log; ours print less.
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    result = trainer.train()
    shutil.rmtree(workdir / f"_trainer_{tag}", ignore_errors=True)
    steps = trainer.state.global_step
    train_s = time.monotonic() - t0
    print(f"[{tag}] {steps} steps in {train_s:.0f} s ({steps / max(train_s, 1e-9):.1f} steps/s)", flush=True)
    return {"steps": steps, "time_s": train_s, "history": history, "trainer_train_loss": result.training_loss,
            "final_loss": history[-1]["loss"] if history else float("nan")}


# ----------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def heldout_loss(model, dataset, collator, batch: int, device) -> float:
    """Mean next-token loss on the held-out targets (teacher forced), token-weighted."""
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(dataset), batch):
        b = collator([dataset[j] for j in range(i, min(i + batch, len(dataset)))])
        b = {k: v.to(device) for k, v in b.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=b["input_ids"], pixel_values=b["pixel_values"],
                           image_grid_thw=b["image_grid_thw"]).logits
        labels = b["labels"][:, 1:]
        nll = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels.flatten(), reduction="sum",
                              ignore_index=-100)
        total += nll.item()
        n += int((labels != -100).sum())
    return total / max(n, 1)


@torch.no_grad()
def generate_answers(model, processor, layout: Layout, images, prompts, max_new_tokens: int, batch: int, device):
    """Greedy answers through the processor (left-padded batch) and `generate`, decoded without specials."""
    model.eval()
    tok = processor.tokenizer
    old_side, tok.padding_side = tok.padding_side, "left"
    answers = []
    try:
        for i in range(0, len(prompts), batch):
            texts = [layout.prompt_text(q) for q in prompts[i:i + batch]]
            enc = processor(images=[[im] for im in images[i:i + batch]], text=texts, padding=True,
                            return_tensors="pt")
            enc = {k: v.to(device) for k, v in enc.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=layout.pad_id, eos_token_id=layout.end_id)
            T = enc["input_ids"].shape[1]
            answers += [tok.decode(row, skip_special_tokens=True).strip() for row in out[:, T:].tolist()]
    finally:
        tok.padding_side = old_side
    return answers


def chance_levels(train: Corpus, held: Corpus) -> dict:
    """Per type: uniform guessing over the answer set, and always giving the most frequent training answer."""
    out = {}
    for kind in QUESTION_TYPES:
        tr = [it[3] for it in train.items if it[1] == kind]
        he = [it[3] for it in held.items if it[1] == kind]
        options = sorted(set(tr) | set(he))
        majority = max(set(tr), key=tr.count) if tr else None
        out[kind] = {"uniform": 1 / len(options) if options else float("nan"),
                     "majority_answer": majority,
                     "majority": (sum(a == majority for a in he) / len(he)) if he else float("nan"),
                     "options": options}
    return out


def evaluate(model, processor, layout: Layout, held: Corpus, n_per_type: int, batch: int, device) -> dict:
    res = {}
    for kind in QUESTION_TYPES + ("caption",):
        items = [it for it in held.items if it[1] == kind][: (n_per_type if kind != "caption" else n_per_type // 2)]
        if not items:
            continue
        images = [held.images[it[0]] for it in items]
        # Room for the longest reference answer and its stop token: a longer output is wrong anyway.
        max_new = max(len(layout.target_ids(it[3])) for it in items)
        got = generate_answers(model, processor, layout, images, [it[2] for it in items], max_new, batch, device)
        hits = [g == it[3] for g, it in zip(got, items)]
        res[kind] = {"accuracy": sum(hits) / len(hits), "n": len(hits),
                     "samples": [{"question": it[2], "want": it[3], "got": g} for it, g in zip(items[:4], got[:4])]}
        print(f"[eval] {kind}: {res[kind]['accuracy']:.1%} of {len(hits)}  e.g. {res[kind]['samples'][:2]}",
              flush=True)
    return res


# ----------------------------------------------------------------------------------------------------------
# One run, saving, evidence
# ----------------------------------------------------------------------------------------------------------


def run_one(init: str, processor, layout, train: Corpus, held: Corpus, args, hp: dict, device, workdir: Path,
            balancing: str):
    """Builds a fresh model (same seed for both inits), optionally pre-trains its vision side contrastively, trains
    it by next-token prediction and evaluates it. Errors in evaluation are recorded, not raised."""
    from transformers_k3 import KimiK3ForConditionalGeneration

    torch.manual_seed(args.seed)
    config = make_config(processor, args.size, balancing)
    model = KimiK3ForConditionalGeneration(config).to(device)  # vision tower randomly initialised
    params = count_params(model)
    print(f"[{init}] params {params}", flush=True)
    budget_s = hp["budget_s"]
    record = {"init": init, "params": params}
    if init == "contrastive":
        share = budget_s * args.contrastive_share
        record["contrastive"] = contrastive_pretrain(
            model, train, processor.tokenizer, share, hp["contrastive_batch"], hp["contrastive_lr"], device,
            device.type == "cuda", hp["log_every"], hp["contrastive_max_steps"])
        budget_s -= record["contrastive"]["time_s"]
    collator = VLMCollator(layout.pad_id)
    record["next_token"] = train_next_token(model, TaskDataset(train), collator, budget_s, args, hp, device,
                                            workdir, init)
    try:
        record["heldout_loss"] = heldout_loss(model, TaskDataset(held), collator, hp["eval_batch"], device)
        print(f"[{init}] held-out target loss {record['heldout_loss']:.4f}", flush=True)
        record["eval"] = evaluate(model, processor, layout, held, hp["eval_n"], hp["eval_batch"], device)
    except Exception as e:  # noqa: BLE001  (evidence is still written for the other run)
        traceback.print_exc()
        record["eval_error"] = f"{type(e).__name__}: {e}"
    return model, record


def save_released_layout(model, processor, out: Path) -> dict:
    from transformers_k3.tiny import save_small_checkpoint

    return save_small_checkpoint(model, out, processor, max_mb=20)


def grad_norm_stats(history: list) -> dict:
    """Median and max of the logged grad norms after the first 10% of logs, and how many exceed 3x the median."""
    g = [h["grad_norm"] for h in history if h.get("grad_norm") is not None]
    g = g[max(1, len(g) // 10):] if len(g) > 1 else g
    if not g:
        return {}
    med = sorted(g)[len(g) // 2]
    return {"median": med, "max": max(g), "spikes_over_3x_median": sum(x > 3 * med for x in g), "n": len(g)}


def write_plots(ev: Path, runs: dict):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib missing: no plots")
        return
    n_panels = 3 if any("contrastive" in r for r in runs.values()) else 2
    fig, axes = plt.subplots(1, n_panels, figsize=(5 * n_panels, 4))
    for init, r in runs.items():
        h = r.get("next_token", {}).get("history", [])
        axes[0].plot([x["step"] for x in h], [x["loss"] for x in h], label=f"{init} init")
        gh = [x for x in h if x["grad_norm"] is not None]
        axes[1].plot([x["step"] for x in gh], [x["grad_norm"] for x in gh], label=f"{init} init")
    axes[0].set_title("next-token loss (answer tokens)"), axes[0].set_xlabel("Trainer step")
    axes[1].set_title("grad norm (Trainer log, before clipping at 1)"), axes[1].set_xlabel("Trainer step")
    axes[1].set_yscale("log")
    if n_panels == 3:
        c = next(r["contrastive"]["history"] for r in runs.values() if "contrastive" in r)
        ax = axes[2]
        ax.plot([x["step"] for x in c], [x["loss"] for x in c], label="InfoNCE loss")
        ax.plot([x["step"] for x in c], [x["grad_norm"] for x in c], label="grad norm")
        ax.set_title("contrastive pre-training (vision tower + projector)"), ax.set_xlabel("step")
    for ax in axes:
        ax.legend(), ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(ev / "curves.png", dpi=110)
    plt.close(fig)


def write_readme(ev: Path, m: dict, argv):
    chance = m["chance"]
    rows = []
    for kind in QUESTION_TYPES + ("caption",):
        cells = []
        for init, r in m["runs"].items():
            acc = r.get("eval", {}).get(kind, {}).get("accuracy")
            cells.append("error" if acc is None else f"{acc:.1%}")
        ch = chance.get(kind)
        ch_txt = f"{ch['majority']:.1%} / {ch['uniform']:.1%}" if ch else "~0%"
        n = next((r["eval"][kind]["n"] for r in m["runs"].values() if kind in r.get("eval", {})), 0)
        rows.append(f"| {kind} | {' | '.join(cells)} | {ch_txt} | {n} |")
    heads = " | ".join(f"{init} init" for init in m["runs"])
    info = []
    for init, r in m["runs"].items():
        nt = r.get("next_token", {})
        gs = r.get("grad_norm_stats", {})
        ctr = r.get("contrastive")
        ctr_txt = (f"{ctr['steps']} steps / {ctr['time_s']:.0f} s, final InfoNCE {ctr['final_loss']:.3f}"
                   if ctr else "none")
        info.append(
            f"| {init} | {ctr_txt} | {nt.get('steps', 0)} / {nt.get('time_s', 0):.0f} s | "
            f"{nt.get('final_loss', float('nan')):.4f} | {r.get('heldout_loss', float('nan')):.4f} | "
            f"{gs.get('median', float('nan')):.3f} / {gs.get('max', float('nan')):.3f} / "
            f"{gs.get('spikes_over_3x_median', '-')} |")
    p = next((r["params"] for r in m["runs"].values() if r.get("params")), None) or {
        "total": 0, "vision_tower_and_projector": 0, "routed_experts": 0}
    errors = "\n".join(f"- `{init}` run failed: {r['error']}" for init, r in m["runs"].items() if "error" in r)
    ck = m.get("checkpoint") or {}
    budget_txt = (f"Both runs get the same wall-clock budget ({m['budget_minutes']} min per run); the contrastive run "
                  f"spends {m['contrastive_share']:.0%} of it pre-training the vision tower + projector (InfoNCE "
                  f"against a GRU caption encoder), the rest on the same next-token training."
                  if len(m["runs"]) > 1 else f"One run, {m['budget_minutes']} min of training.")
    text = f"""# Small K3 vision-language model trained from scratch ({m['run']} run)

Produced by `python3 examples/train_vlm_from_scratch.py {' '.join(argv)}` on {m['hardware']}
(torch {m['torch']}, transformers {m['transformers']}), {m['wall_time_s']:.0f} s in all. Synthetic scenes of
1-4 shapes (numpy-rasterised, seeded); {m['n_train_images']} training images ({m['n_train_items']} image-text pairs),
{m['n_heldout_images']} held-out images from another seed (none equal to a training image). Parameters:
{p['total']:,} in all, {p['vision_tower_and_projector']:,} in the vision tower + projector (randomly
initialised), {p['routed_experts']:,} in routed experts.

Held-out exact-match accuracy of greedy `generate` answers (through `KimiK3Processor`):

| question type | {heads} | chance (majority answer / uniform) | questions |
|---|{'---|' * len(m['runs'])}---|---|
{chr(10).join(rows)}

| run | contrastive pre-training | next-token steps / time | final train loss | held-out target loss | \
grad norm median / max / spikes > 3x median |
|---|---|---|---|---|---|
{chr(10).join(info)}

{budget_txt} Loss is on answer / caption tokens only.
Checkpoint (scratch run, released layout, MXFP4 experts, bf16 rest): {ck.get('mb', float('nan')):.1f} MB in
`{ck.get('dir', '-')}`.

{errors}

Plots: `curves.png` (next-token loss and Trainer's grad norm for both runs, contrastive pre-training curves).
All numbers are in `metrics.json`.
"""
    (ev / "README.md").write_text(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run into a temp dir unless --out/--evidence")
    ap.add_argument("--init", choices=("scratch", "contrastive"), default="scratch")
    ap.add_argument("--size", choices=("cpu", "full"), default="full", help="model size (--smoke: a tiny one)")
    ap.add_argument("--compare", action="store_true", help="run both inits with the same budget each")
    ap.add_argument("--out", default=None, help="checkpoint dir for the first run's model (the scratch one with "
                    "--compare); default src/transformers_k3/embedded_vlm")
    ap.add_argument("--evidence", default=None, help="evidence dir (default evidence/vlm_from_scratch)")
    ap.add_argument("--max-minutes", type=float, default=3.5, help="wall-clock training budget per run")
    ap.add_argument("--contrastive-share", type=float, default=0.25)
    ap.add_argument("--n-images", type=int, default=None)
    ap.add_argument("--n-heldout", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--eval-n", type=int, default=None, help="held-out questions per type")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 0.0 < args.contrastive_share < 1.0:
        raise ValueError(f"--contrastive-share must be in (0, 1), got {args.contrastive_share}")

    smoke = args.smoke
    if smoke:
        args.size = "smoke"
    cpu_size = args.size == "cpu"
    tmp = Path(tempfile.mkdtemp(prefix="k3_vlm_smoke_")) if smoke else None
    out = Path(args.out) if args.out else (tmp / "model" if smoke else REPO / "src/transformers_k3/embedded_vlm")
    ev = Path(args.evidence) if args.evidence else (tmp / "evidence" if smoke else REPO / "evidence/vlm_from_scratch")
    ev.mkdir(parents=True, exist_ok=True)
    hp = dict(
        budget_s=(min(args.max_minutes, 0.25) if smoke else args.max_minutes) * 60,
        batch=args.batch_size or (8 if smoke else 32 if cpu_size else 64), lr=args.lr or (3e-3 if smoke else 2e-3),
        max_steps=args.max_steps or (8 if smoke else 100_000), warmup=3 if smoke else 30 if cpu_size else 50,
        log_every=2 if smoke else 10, eval_n=args.eval_n or (4 if smoke else 300), eval_batch=8 if smoke else 50 if cpu_size else 150,
        contrastive_batch=8 if smoke else 64 if cpu_size else 256, contrastive_lr=2e-3,
        contrastive_max_steps=4 if smoke else 100_000,
    )
    n_images = args.n_images or (48 if smoke else 16000)
    n_held = args.n_heldout or (16 if smoke else 600)

    import transformers

    import transformers_k3  # noqa: F401  (registers the Auto classes)

    t_start = time.monotonic()
    torch.manual_seed(args.seed)
    use_cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if use_cuda else "cpu")
    if use_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    balancing = "quantile"
    try:
        from transformers_k3.balancing import MoEBalancingCallback  # noqa: F401
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"transformers_k3.balancing unavailable ({e}); training with moe_balancing='none'")
        balancing = "none"

    processor = load_processor()
    layout = Layout(processor)
    train = Corpus(processor, layout, n_images, seed=args.seed)
    held = Corpus(processor, layout, n_held, seed=args.seed + 10_000, exclude_hashes=train.hashes)
    kinds = {k: sum(it[1] == k for it in train.items) for k in QUESTION_TYPES + ("caption",)}
    print(f"[data] {n_images} train images -> {len(train.items)} pairs {kinds}; {n_held} held-out images -> "
          f"{len(held.items)} pairs; grids {sorted(set(map(tuple, train.grids.tolist())))[:6]}... "
          f"({time.monotonic() - t_start:.1f} s)", flush=True)
    chance = chance_levels(train, held)

    inits = ("scratch", "contrastive") if args.compare else (args.init,)
    runs, saved = {}, None
    for init in inits:
        try:
            model, record = run_one(init, processor, layout, train, held, args, hp, device, ev, balancing)
        except Exception as e:  # noqa: BLE001  (the other run and the evidence still get written)
            traceback.print_exc()
            runs[init] = {"init": init, "error": f"{type(e).__name__}: {e}", "params": {}}
            continue
        record["grad_norm_stats"] = grad_norm_stats(record["next_token"]["history"])
        runs[init] = record
        if init == inits[0]:  # the scratch run when comparing: the K3 recipe is what ships
            try:
                saved = save_released_layout(model, processor, out)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                saved = {"error": f"{type(e).__name__}: {e}"}
        del model
        if use_cuda:
            torch.cuda.empty_cache()

    hw = torch.cuda.get_device_name(0) if use_cuda else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    metrics = {
        "run": args.size, "hardware": hw, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": sys.version.split()[0],
        "wall_time_s": time.monotonic() - t_start, "budget_minutes": hp["budget_s"] / 60,
        "contrastive_share": args.contrastive_share, "hyperparameters": hp,
        "n_train_images": n_images, "n_train_items": len(train.items), "n_heldout_images": n_held,
        "n_heldout_items": len(held.items), "chance": chance, "runs": runs, "checkpoint": saved,
    }
    (ev / "metrics.json").write_text(json.dumps(metrics, indent=1))
    try:
        write_plots(ev, {k: v for k, v in runs.items() if "error" not in v})
        write_readme(ev, metrics, argv if argv is not None else sys.argv[1:])
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    summary = {init: {k: v.get("accuracy") for k, v in r.get("eval", {}).items()} for init, r in runs.items()}
    print(f"[done] accuracy {summary}; chance {({k: round(v['majority'], 3) for k, v in chance.items()})}; "
          f"evidence in {ev}, model in {out}, total {metrics['wall_time_s']:.0f} s", flush=True)
    metrics["evidence_dir"], metrics["out_dir"] = str(ev), str(out)
    return metrics


if __name__ == "__main__":
    main()
