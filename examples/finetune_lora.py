"""Fine-tune a K3 checkpoint with PEFT LoRA under `Trainer`: chat data, loss on the answers only, adapters on every
layer kind, padding-free batches; then save the adapter, reload it, merge it, and check each step gives the same
model.

The task is offline and made up, so the base model cannot know it: 32 codenames ("zq-17"), each paired with two
words ("amber otter"), asked and answered in K3's chat format. Accuracy is greedy exact match on those questions,
before and after (it measures that the adapters learned, not generalisation). Default model: the small K3 shipped
in the package; `--model` takes any K3 directory, the release included (its tokenizer loads through
`KimiK3Tokenizer`, its MXFP4 experts are unpacked for training).

    python3 examples/finetune_lora.py --smoke              # seconds on a CPU: the mechanics only
    python3 examples/finetune_lora.py --out lora_out       # a few CPU minutes: accuracy before and after
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

# Module names per layer kind (README, Fine-tuning): KDA, MLA, the dense and shared MLPs, the latent-MoE projections.
LORA_TARGET_MODULES = [
    "q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj", "o_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
    "gate_proj", "up_proj", "down_proj", "routed_expert_down_proj", "routed_expert_up_proj",
]
# The routed experts are 3-D parameters, not Linear modules: PEFT adapts them as parameters (lora_dropout must be 0).
LORA_TARGET_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]

_WORDS_A = ["amber", "cobalt", "scarlet", "ivory", "olive", "violet", "silver", "copper"]
_WORDS_B = ["otter", "falcon", "badger", "heron", "lynx", "marten", "osprey", "tapir"]


def make_facts(n: int, seed: int) -> list[tuple[str, str]]:
    """n (codename, answer) pairs, distinct codenames and answers."""
    rng = random.Random(seed)
    answers = [f"{a} {b}" for a in _WORDS_A for b in _WORDS_B]
    rng.shuffle(answers)
    names = set()
    while len(names) < n:
        names.add(f"{rng.choice('bcdfghjklmnpqrstvwxz')}{rng.choice('aeiouy')}-{rng.randint(10, 99)}")
    return list(zip(sorted(names), answers[:n]))


def question(name: str) -> str:
    return f"Which pair goes with {name}?"


def prompt_ids(tokenizer, name: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question(name)}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids


def encode_example(tokenizer, name: str, answer: str) -> dict:
    """input_ids of prompt + answer + end of message; labels -100 over the prompt (the loss is on the answer)."""
    prompt = prompt_ids(tokenizer, name)
    target = tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return {"input_ids": prompt + target, "labels": [-100] * len(prompt) + target}


@torch.no_grad()
def accuracy(model, tokenizer, facts, max_new_tokens: int = 8) -> float:
    """Greedy exact match of the answer, batched with left padding."""
    model.eval()
    prompts = [prompt_ids(tokenizer, name) for name, _ in facts]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=pad)
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(t.strip() == answer for t, (_, answer) in zip(texts, facts)) / len(facts)


@torch.no_grad()
def logits_of(model, tokenizer, facts):
    model.eval()
    ids = torch.tensor([encode_example(tokenizer, *facts[0])["input_ids"]], device=model.device)
    return model(input_ids=ids, use_cache=False).logits.float()


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="K3 checkpoint directory (default: the embedded small K3)")
    parser.add_argument("--out", default=None, help="where the adapter, the merged model and summary.json go")
    parser.add_argument("--facts", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="8 facts, 6 steps: the mechanics, not the accuracy")
    args = parser.parse_args(argv)
    if args.smoke:
        args.facts, args.steps, args.batch_size = 8, 6, 4

    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainingArguments

    from transformers_k3 import KimiK3Tokenizer
    from transformers_k3.cli import embedded_model_dir

    torch.manual_seed(args.seed)
    model_dir = Path(args.model) if args.model else embedded_model_dir()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="k3_lora_"))
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    tokenizer = KimiK3Tokenizer.from_pretrained(model_dir)
    facts = make_facts(args.facts, args.seed)
    train_set = [encode_example(tokenizer, name, answer) for name, answer in facts]

    def load_base():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                    device_map="cuda" if torch.cuda.is_available() else None)

    base = load_base()
    base_accuracy = accuracy(base, tokenizer, facts)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=LORA_TARGET_MODULES,
                      target_parameters=LORA_TARGET_PARAMETERS, task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    trainable, total = model.get_nb_trainable_parameters()

    training_args = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 20),
        logging_steps=max(1, args.steps // 20), save_strategy="no", report_to=[], seed=args.seed,
        gradient_checkpointing=args.gradient_checkpointing, bf16=dtype == torch.bfloat16,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    # Padding-free batches: the examples are concatenated and position_ids restart at each one; the model splits
    # its recurrences, convolutions and attention there (no padding tokens are computed).
    trainer = Trainer(model=model, args=training_args, train_dataset=train_set,
                      data_collator=DataCollatorWithFlattening(return_position_ids=True))
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    tuned_accuracy = accuracy(model, tokenizer, facts)
    tuned_logits = logits_of(model, tokenizer, facts)

    # The adapter alone (a few MB) is what to share; reloading it onto a fresh base must give the same model.
    model.save_pretrained(out / "adapter")
    tokenizer.save_pretrained(out / "adapter")
    reloaded = PeftModel.from_pretrained(load_base(), out / "adapter")
    reload_err = rel_err(logits_of(reloaded, tokenizer, facts), tuned_logits)
    # Merged into the weights: a plain K3 model again (its experts changed, so they save unquantised: a warning).
    merged = reloaded.merge_and_unload()
    merge_err = rel_err(logits_of(merged, tokenizer, facts), tuned_logits)
    merged.save_pretrained(out / "merged")
    tokenizer.save_pretrained(out / "merged")

    summary = {
        "model": str(model_dir), "facts": args.facts, "steps": args.steps, "batch_size": args.batch_size,
        "lora_rank": args.rank, "trainable_parameters": trainable, "total_parameters": total,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "accuracy_before": base_accuracy, "accuracy_after": tuned_accuracy,
        "reloaded_adapter_rel_err": reload_err, "merged_rel_err": merge_err,
        "train_seconds": round(train_seconds, 1), "device": "cuda" if torch.cuda.is_available() else "cpu",
        "out": str(out),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
