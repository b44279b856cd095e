"""Train a small Kimi-K3-architecture model from scratch and ship it as the package's embedded default model.

Everything is offline: the corpus is the Python standard library's own sources (files sorted for determinism,
a few held out for validation) mixed with a synthetic long-range recall task

    key_37 = "qzxw"
    key_05 = "abru"
    ... filler code from the corpus ...
    assert key_37 == "qzxw"

A byte-level BPE tokenizer (the `tokenizers` library) is trained on the corpus, K3's special tokens (SPEC 8) are
appended after the BPE ranks. The model keeps every structural feature of K3 at a small size (KDA/MLA in the 3:1
pattern with a final MLA layer, AttnRes blocks, latent MoE with MXFP4 experts on save, SiTU-GLU, NoPE MLA).
Training runs under `transformers.Trainer` with a wall-clock budget (`--max-minutes`) that also drives the
learning-rate decay, then evaluates (validation loss, recall exact-match at 1x/4x/16x the training length),
saves the released layout with the tokenizer into `--out` and writes evidence into `--evidence`.

    python3 examples/train_small_k3.py --smoke                          # tiny CPU run (< 2 min on one core)
    python3 examples/train_small_k3.py --max-minutes 4 --out src/transformers_k3/embedded   # one H200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import string
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch

from transformers_k3.tiny import time_lr_lambda
from transformers_k3.tokenization_kimi_k3 import K3_SPECIAL_TOKENS

REPO = Path(__file__).resolve().parent.parent

# SPEC 8: K3's named special tokens, in release (id) order; they are appended after the BPE ranks.
SPECIAL_TOKENS = list(K3_SPECIAL_TOKENS.values())


# ----------------------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p for p in root.rglob("*.py")
        if not any(part in ("site-packages", "dist-packages", "__pycache__") for part in p.parts)
    ]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def build_corpus(max_chars: int, n_val_files: int, seed: int):
    """Train / validation texts from the stdlib: files sorted, every k-th file held out (deterministic)."""
    files = stdlib_files()
    if not files:
        raise RuntimeError(f"no *.py files under {sysconfig.get_paths()['stdlib']}")
    rng = random.Random(seed)
    val_idx = set(rng.sample(range(len(files)), min(n_val_files, len(files) // 10 or 1)))
    train, val, n_chars = [], [], 0
    # A seeded permutation of the sorted list: a capped corpus then samples the whole stdlib, not its first files.
    order = list(range(len(files)))
    rng.shuffle(order)
    for i in order:
        p = files[i]
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        if i in val_idx:
            val.append(text)
        elif n_chars < max_chars:
            train.append(text)
            n_chars += len(text)
    return train, val, len(files)


# ----------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], bpe_vocab: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False, special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    n_bpe = tok.get_vocab_size()
    # Specials come after the BPE ranks, in SPEC 8's order.
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[BOS]", eos_token="<|end_of_msg|>", pad_token="[PAD]",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("[BOS]", "<|end_of_msg|>", "[PAD]")],
        model_max_length=1 << 20,
    )
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert ids["[BOS]"] == n_bpe and ids["[PAD]"] == n_bpe + len(SPECIAL_TOKENS) - 1, ids
    return hf, ids, n_bpe


# ----------------------------------------------------------------------------------------------------------
# Data: corpus chunks and the recall task, all at the token level
# ----------------------------------------------------------------------------------------------------------


class Encoded:
    """The corpus as one token stream (documents between [BOS] ... [EOS]) plus per-line token lists for filler."""

    def __init__(self, tokenizer, texts: list[str], bos: int, eos: int):
        stream, lines = [], []
        for enc in tokenizer.backend_tokenizer.encode_batch(texts):
            stream.append(bos)
            stream.extend(enc.ids)
            stream.append(eos)
        self.stream = torch.tensor(stream, dtype=torch.long)
        all_lines = [ln + "\n" for t in texts for ln in t.splitlines() if ln.strip()]
        for enc in tokenizer.backend_tokenizer.encode_batch(all_lines):
            lines.append(enc.ids)
        self.lines = lines


_VALUE_CHARS = string.ascii_lowercase


class RecallMaker:
    """Builds `key_NN = "vvvv"` definitions, filler code, then `assert key_NN == "vvvv"` queries."""

    def __init__(self, tokenizer, n_keys: int = 4, value_len: int = 4):
        self.tok = tokenizer.backend_tokenizer
        self.n_keys = n_keys
        self.value_len = value_len

    def enc(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def _keys(self, rng):
        names = rng.sample(range(100), self.n_keys)
        values = ["".join(rng.choice(_VALUE_CHARS) for _ in range(self.value_len)) for _ in names]
        return names, values

    def _filler(self, rng, lines, n_tokens: int) -> list[int]:
        out: list[int] = []
        i = rng.randrange(len(lines))
        while len(out) < n_tokens:
            out.extend(lines[i])
            i = (i + 1) % len(lines)
        return out[:n_tokens]

    def train_example(self, rng, lines, length: int) -> list[int]:
        """Definitions, filler, then every key queried (random order); exactly `length` tokens."""
        names, values = self._keys(rng)
        head = self.enc("".join(f'key_{n:02d} = "{v}"\n' for n, v in zip(names, values)))
        order = list(range(self.n_keys))
        rng.shuffle(order)
        tail: list[int] = []
        for j in order:
            tail += self.enc("\n") + self.enc(f"assert key_{names[j]:02d} == ") + self.enc(f'"{values[j]}"\n')
        n_fill = max(length - len(head) - len(tail), 0)
        ids = head + self._filler(rng, lines, n_fill) + tail
        return ids[-length:]

    def eval_example(self, rng, lines, length: int):
        """A prompt of exactly `length` tokens ending in `assert key_NN == `, and the value to recall."""
        names, values = self._keys(rng)
        head = self.enc("".join(f'key_{n:02d} = "{v}"\n' for n, v in zip(names, values)))
        j = rng.randrange(self.n_keys)
        query = self.enc("\n") + self.enc(f"assert key_{names[j]:02d} == ")
        n_fill = length - len(head) - len(query)
        if n_fill < 0:
            raise ValueError(f"eval length {length} is shorter than the recall scaffold ({len(head) + len(query)})")
        return head + self._filler(rng, lines, n_fill) + query, f'"{values[j]}"'


class MixedDataset(torch.utils.data.Dataset):
    """Item i is deterministic in (seed, i): a corpus chunk or (with prob. `recall_frac`) a recall example."""

    def __init__(self, enc: Encoded, recall: RecallMaker, length: int, n_items: int, recall_frac: float, seed: int):
        self.enc, self.recall, self.length, self.n = enc, recall, length, n_items
        self.recall_frac, self.seed = recall_frac, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = random.Random(self.seed * 1_000_003 + i)
        if rng.random() < self.recall_frac:
            ids = torch.tensor(self.recall.train_example(rng, self.enc.lines, self.length), dtype=torch.long)
        else:
            start = rng.randrange(len(self.enc.stream) - self.length)
            ids = self.enc.stream[start:start + self.length].clone()
        return {"input_ids": ids, "labels": ids.clone()}


# ----------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------


def make_config(vocab_size: int, ids: dict, smoke: bool, balancing: str):
    """The released config scaled down (tiny.py keeps the MXFP4 quantization block, so save packs experts)."""
    from transformers_k3.tiny import tiny_config

    common = dict(
        vocab_size=vocab_size, num_hidden_layers=8, moe_balancing=balancing,
        bos_token_id=ids["[BOS]"], eos_token_id=ids["<|end_of_msg|>"], pad_token_id=ids["[PAD]"],
        max_position_embeddings=1 << 16, kda_backend="torch",
    )
    if smoke:
        size = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, routed_expert_hidden_size=32,
                    num_experts=16, num_experts_per_token=4, attn_res_block_size=3)
    else:
        size = dict(
            hidden_size=320, intermediate_size=1024, moe_intermediate_size=128, routed_expert_hidden_size=160,
            num_experts=32, num_experts_per_token=4, num_shared_experts=1, attn_res_block_size=3,
            num_attention_heads=5, num_key_value_heads=5, q_lora_rank=128, kv_lora_rank=128,
            qk_nope_head_dim=64, qk_rope_head_dim=16, v_head_dim=64, mla_page_size=64,
        )
    cfg = tiny_config(**common, **size)
    if not smoke:
        cfg.text_config.linear_attn_config.update(num_heads=5, head_dim=64)
        cfg.text_config.validate_k3()
    # The container's ids follow the tokenizer (tiny_config sets them from the vocabulary's end).
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = ids["[BOS]"], ids["<|end_of_msg|>"], ids["[PAD]"]
    cfg.media_placeholder_token_id = ids["<|media_pad|>"]
    tc = cfg.text_config
    tc.bos_token_id, tc.eos_token_id, tc.pad_token_id = cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id
    return cfg


def count_params(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    lm = sum(p.numel() for p in model.language_model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return {"total": total, "language_model": lm, "routed_experts": experts}


# ----------------------------------------------------------------------------------------------------------
# Callbacks
# ----------------------------------------------------------------------------------------------------------


def make_callbacks(model, val_batch, every: int, deadline: float, history: dict):
    from transformers import TrainerCallback

    from transformers_k3.modeling_kimi_k3 import KimiK3TopkRouter

    routers = [(n, m) for n, m in model.named_modules() if isinstance(m, KimiK3TopkRouter)]

    class ExpertLoadCallback(TrainerCallback):
        """Every `every` steps: a forward on a fixed validation batch; per MoE layer the max/mean expert load
        (top-k selection counts, read by forward hooks on the routers), and that batch's loss."""

        def probe(self, step):
            counts = {}

            def hook(name):
                def fn(module, inputs, output):
                    top_idx = output[2]  # [N, k]
                    counts[name] = torch.bincount(top_idx.reshape(-1), minlength=module.weight.shape[0]).cpu()
                return fn

            handles = [m.register_forward_hook(hook(n)) for n, m in routers]
            was_training = model.training
            model.eval()
            try:
                with torch.no_grad(), torch.autocast(val_batch.device.type, dtype=torch.bfloat16,
                                                     enabled=val_batch.device.type == "cuda"):
                    loss = model(input_ids=val_batch, labels=val_batch).loss.item()
            finally:
                for h in handles:
                    h.remove()
                model.train(was_training)
            loads = {}
            for name, c in counts.items():
                layer = int(name.split("layers.")[1].split(".")[0])
                c = c.float()
                loads[layer] = {"max_over_mean": (c.max() / c.mean()).item(),
                                "min_over_mean": (c.min() / c.mean()).item(),
                                "dead_experts": int((c == 0).sum())}
            history["probe"].append({"step": step, "val_batch_loss": loss, "expert_load": loads})
            worst = max(v["max_over_mean"] for v in loads.values()) if loads else float("nan")
            print(f"[probe] step {step}: val-batch loss {loss:.4f}, worst expert max/mean load {worst:.2f}",
                  flush=True)

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % every == 0:
                self.probe(state.global_step)
            if time.monotonic() > deadline:
                print(f"[train] wall-clock budget reached at step {state.global_step}", flush=True)
                control.should_training_stop = True
            return control

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                history["train"].append({"step": state.global_step, "loss": logs["loss"],
                                         "lr": logs.get("learning_rate")})

    return ExpertLoadCallback()


# ----------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def val_loss(model, stream: torch.Tensor, length: int, n_chunks: int, batch: int, device) -> float:
    n_chunks = min(n_chunks, (len(stream) - 1) // length)
    chunks = stream[: n_chunks * length].view(n_chunks, length)  # [n, T]
    losses = []
    for i in range(0, n_chunks, batch):
        x = chunks[i:i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            losses.append(model(input_ids=x, labels=x).loss.float().item() * len(x))
    return sum(losses) / n_chunks


@torch.no_grad()
def recall_accuracy(model, tokenizer, recall: RecallMaker, lines, length: int, n: int, batch: int, device, seed):
    rng = random.Random(seed)
    examples = [recall.eval_example(rng, lines, length) for _ in range(n)]
    hits = 0
    samples = []
    for i in range(0, n, batch):
        part = examples[i:i + batch]
        x = torch.tensor([p for p, _ in part], device=device)  # [b, length], equal lengths: no padding
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            # No attention_mask: the prompts are unpadded (and the container's generate rejects the kwarg).
            out = model.generate(x, max_new_tokens=recall.value_len + 4,
                                 do_sample=False, pad_token_id=model.config.pad_token_id)
        for (_, want), row in zip(part, out[:, length:]):
            got = tokenizer.decode(row.tolist(), skip_special_tokens=True)
            hits += got.startswith(want)
            if len(samples) < 3:
                samples.append({"want": want, "got": got})
    return hits / n, samples


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run: tiny model, few steps, small corpus")
    ap.add_argument("--out", default=str(REPO / "src/transformers_k3/embedded"))
    ap.add_argument("--evidence", default=str(REPO / "evidence/small_k3"))
    ap.add_argument("--max-minutes", type=float, default=4.0, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--bpe-vocab", type=int, default=None)
    ap.add_argument("--corpus-mb", type=float, default=None)
    ap.add_argument("--recall-frac", type=float, default=0.5)
    ap.add_argument("--recall-n", type=int, default=None, help="recall eval examples per length")
    ap.add_argument("--probe-every", type=int, default=None)
    ap.add_argument("--kda-backend", default="torch", help="KDA backend during training (torch reference default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    smoke = args.smoke
    seq_len = args.seq_len or (128 if smoke else 512)
    batch = args.batch_size or (4 if smoke else 32)
    lr = args.lr or (3e-3 if smoke else 2e-3)
    bpe_vocab = args.bpe_vocab or (2048 if smoke else 8192)
    corpus_chars = int((args.corpus_mb or (1.0 if smoke else 12.0)) * 1e6)
    max_steps = args.max_steps or (120 if smoke else 100_000)
    budget_min = min(args.max_minutes, 0.75) if smoke else args.max_minutes
    recall_n = args.recall_n or (8 if smoke else 100)
    probe_every = args.probe_every or (20 if smoke else 50)

    import transformers
    from transformers import Trainer, TrainingArguments

    import transformers_k3  # noqa: F401  (registers the Auto classes)
    from transformers_k3 import KimiK3ConfigError, KimiK3ForConditionalGeneration

    t_start = time.monotonic()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    use_cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda" if use_cuda else "cpu")
    if use_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True

    # Balancing comes from another part of the project; train without it (and say so) if it is not there yet.
    balancing, balancing_cb = "quantile", None
    try:
        from transformers_k3.balancing import MoEBalancingCallback
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"transformers_k3.balancing unavailable ({e}); training with moe_balancing='none'")
        balancing, MoEBalancingCallback = "none", None

    # ---- corpus and tokenizer
    train_texts, val_texts, n_files = build_corpus(corpus_chars, n_val_files=4 if smoke else 12, seed=args.seed)
    print(f"[data] {n_files} stdlib files; train {len(train_texts)} files / {sum(map(len, train_texts))/1e6:.1f} "
          f"MB, val {len(val_texts)} files", flush=True)
    work = Path(args.out)
    tokenizer, special_ids, n_bpe = train_tokenizer(train_texts, bpe_vocab, work)
    vocab_size = len(tokenizer)
    print(f"[tok] {n_bpe} BPE ranks + {len(SPECIAL_TOKENS)} specials = {vocab_size}; specials {special_ids}",
          flush=True)
    enc_train = Encoded(tokenizer, train_texts, special_ids["[BOS]"], special_ids["[EOS]"])
    enc_val = Encoded(tokenizer, val_texts, special_ids["[BOS]"], special_ids["[EOS]"])
    print(f"[data] train tokens {len(enc_train.stream):,}, val tokens {len(enc_val.stream):,} "
          f"({time.monotonic() - t_start:.0f} s)", flush=True)
    recall = RecallMaker(tokenizer)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # dataloader workers fork after the tokenizer ran

    # ---- model
    try:
        config = make_config(vocab_size, special_ids, smoke, balancing)
    except KimiK3ConfigError as e:
        warnings.warn(f"config rejects moe_balancing={balancing!r} ({e}); training with 'none'")
        balancing, MoEBalancingCallback = "none", None
        config = make_config(vocab_size, special_ids, smoke, balancing)
    config.text_config.kda_backend = args.kda_backend
    model = KimiK3ForConditionalGeneration(config).to(device)
    params = count_params(model)
    print(f"[model] params {params}", flush=True)
    if MoEBalancingCallback is not None:
        try:
            balancing_cb = MoEBalancingCallback()
        except TypeError:
            balancing_cb = MoEBalancingCallback(model)

    # ---- training
    train_ds = MixedDataset(enc_train, recall, seq_len, max_steps * batch, args.recall_frac, args.seed)
    val_batch = enc_val.stream[: 8 * seq_len].view(8, seq_len).to(device)  # fixed probe batch [8, T]
    history = {"train": [], "probe": []}
    t_train = time.monotonic()
    budget_s = budget_min * 60
    probe_cb = make_callbacks(model, val_batch, probe_every, t_train + budget_s, history)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, time_lr_lambda([], budget_s, warmup_steps=10 if smoke else 50))
    targs = TrainingArguments(
        output_dir=str(Path(args.evidence) / "_trainer"), use_cpu=not use_cuda, bf16=use_cuda,
        per_device_train_batch_size=batch, max_steps=max_steps, logging_steps=5 if smoke else 10,
        save_strategy="no", report_to=[], dataloader_num_workers=0 if smoke else 4, seed=args.seed,
        disable_tqdm=True, max_grad_norm=1.0, remove_unused_columns=False, label_names=["labels"],
    )
    callbacks = [probe_cb] + ([balancing_cb] if balancing_cb is not None else [])
    trainer = Trainer(model=model, args=targs, train_dataset=train_ds, optimizers=(optim, sched), callbacks=callbacks)
    probe_cb.probe(0)
    result = trainer.train()
    train_s = time.monotonic() - t_train
    steps = trainer.state.global_step
    shutil.rmtree(Path(args.evidence) / "_trainer", ignore_errors=True)
    if history["probe"][-1]["step"] != steps:
        probe_cb.probe(steps)
    print(f"[train] {steps} steps in {train_s:.0f} s ({steps * batch * seq_len / train_s:,.0f} tok/s)", flush=True)

    # ---- evaluation
    model.eval()
    vloss = val_loss(model, enc_val.stream, seq_len, 16 if smoke else 128, batch, device)
    final_train = history["train"][-1]["loss"] if history["train"] else float("nan")
    print(f"[eval] final train loss {final_train:.4f}, val loss {vloss:.4f}", flush=True)
    recall_res = {}
    for mult in (1, 4, 16):
        length = seq_len * mult
        # Equal-length prompts are batched without padding: ~64k prompt tokens per generate call on a GPU.
        eb = min(max(1, 65536 // length), 50) if use_cuda else 2
        acc, samples = recall_accuracy(model, tokenizer, recall, enc_val.lines, length, recall_n, eb,
                                       device, seed=1000 + mult)
        recall_res[f"{mult}x"] = {"length": length, "accuracy": acc, "n": recall_n, "samples": samples}
        print(f"[eval] recall @ {mult}x ({length} tokens): {acc:.2%} of {recall_n}  e.g. {samples[:1]}", flush=True)

    # ---- save in the released layout
    from transformers_k3.tiny import save_small_checkpoint

    saved = save_small_checkpoint(model, args.out, tokenizer, max_mb=40)
    size_mb, n_packed = saved["mb"], saved["n_weight_packed"]

    # ---- evidence
    ev = Path(args.evidence)
    ev.mkdir(parents=True, exist_ok=True)
    hw = torch.cuda.get_device_name(0) if use_cuda else f"CPU ({platform.processor() or platform.machine()}, " \
        f"{torch.get_num_threads()} threads)"
    metrics = {
        "run": "smoke" if smoke else "full", "hardware": hw, "torch": torch.__version__,
        "transformers": transformers.__version__, "python": sys.version.split()[0],
        "wall_time_s": time.monotonic() - t_start, "train_time_s": train_s, "steps": steps,
        "batch_size": batch, "seq_len": seq_len, "tokens_seen": steps * batch * seq_len, "lr": lr,
        "moe_balancing": balancing, "params": params, "vocab_size": vocab_size, "bpe_ranks": n_bpe,
        "special_token_ids": special_ids, "final_train_loss": final_train, "val_loss": vloss,
        "trainer_train_loss": result.training_loss, "recall": recall_res, "checkpoint_mb": size_mb,
        "n_weight_packed": n_packed, "history": history,
        "config": {k: getattr(config.text_config, k) for k in (
            "hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_token", "moe_intermediate_size",
            "routed_expert_hidden_size", "attn_res_block_size", "layer_types")},
    }
    (ev / "metrics.json").write_text(json.dumps(metrics, indent=1))
    write_plots(ev, history, vloss, steps)
    write_readme(ev, metrics, argv if argv is not None else sys.argv[1:])
    print(f"[done] evidence in {ev}, total {metrics['wall_time_s']:.0f} s", flush=True)
    return metrics


def write_plots(ev: Path, history: dict, vloss: float, steps: int):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib missing: no plots")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    tr = history["train"]
    ax.plot([h["step"] for h in tr], [h["loss"] for h in tr], label="train loss")
    pr = history["probe"]
    ax.plot([h["step"] for h in pr], [h["val_batch_loss"] for h in pr], "o-", label="val loss (probe batch)")
    ax.plot([steps], [vloss], "r*", markersize=12, label="val loss (final, held-out files)")
    ax.set_xlabel("step"), ax.set_ylabel("cross-entropy (nats)"), ax.legend(), ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(ev / "loss.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    layers = sorted({int(k) for h in pr for k in h["expert_load"]})
    for layer in layers:
        pts = [(h["step"], h["expert_load"][layer]["max_over_mean"]) for h in pr if layer in h["expert_load"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"layer {layer}")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xlabel("step"), ax.set_ylabel("max / mean expert load"), ax.legend(fontsize=7), ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(ev / "expert_load.png", dpi=110)
    plt.close(fig)


def write_readme(ev: Path, m: dict, argv):
    last = m["history"]["probe"][-1]["expert_load"] if m["history"]["probe"] else {}
    rows = "\n".join(
        f"| {layer} | {v['max_over_mean']:.2f} | {v['min_over_mean']:.2f} | {v['dead_experts']} |"
        for layer, v in sorted(last.items(), key=lambda kv: int(kv[0]))
    )
    rec = "\n".join(f"| {k} | {v['length']} | {v['accuracy']:.0%} | {v['n']} |" for k, v in m["recall"].items())
    p = m["params"]
    text = f"""# Small K3 trained from scratch ({m['run']} run)

Produced by `python3 examples/train_small_k3.py {' '.join(argv)}`; the checkpoint it wrote is the package's
embedded default model (`k3 generate "def fibonacci("`). Corpus: the Python standard library's sources (held-out
files for validation) mixed with a synthetic recall task (`key_NN = "vvvv"`, filler code, `assert key_NN == `).

| quantity | value |
|---|---|
| hardware | {m['hardware']} |
| torch / transformers | {m['torch']} / {m['transformers']} |
| parameters (total / language model / routed experts) | {p['total']:,} / {p['language_model']:,} / {p['routed_experts']:,} |
| layers | {', '.join('KDA' if t == 'linear_attention' else 'MLA' for t in m['config']['layer_types'])} |
| experts | {m['config']['num_experts']} routed, top-{m['config']['num_experts_per_token']}, balancing `{m['moe_balancing']}` |
| steps x batch x seq len | {m['steps']} x {m['batch_size']} x {m['seq_len']} ({m['tokens_seen']:,} tokens) |
| training time / total wall time | {m['train_time_s']:.0f} s / {m['wall_time_s']:.0f} s |
| final train loss (last logged) | {m['final_train_loss']:.4f} |
| validation loss (held-out stdlib files) | {m['val_loss']:.4f} |
| checkpoint size (MXFP4 experts, bf16 rest) | {m['checkpoint_mb']:.1f} MB, {m['n_weight_packed']} `*.weight_packed` tensors |

Recall accuracy (exact match of the recalled value, greedy decoding):

| length | tokens | accuracy | examples |
|---|---|---|---|
{rec}

Expert load at the end (fixed validation batch; max/mean of top-k selection counts per MoE layer):

| layer | max/mean | min/mean | dead experts |
|---|---|---|---|
{rows}

Plots: `loss.png` (train loss, probe-batch validation loss, final validation loss), `expert_load.png`.
All numbers are in `metrics.json`.
"""
    (ev / "README.md").write_text(text)


if __name__ == "__main__":
    main()
