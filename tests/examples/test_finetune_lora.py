"""examples/finetune_lora.py: the answer-only labels against the tokenizer, and the smoke run end to end (the loss
falls, the reloaded adapter and the merged model are the trained model, the merged model reloads)."""

import json

import pytest
import torch

from helpers import load_example


@pytest.fixture(scope="module")
def example():
    return load_example("finetune_lora")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers_k3 import KimiK3Tokenizer
    from transformers_k3.cli import embedded_model_dir

    return KimiK3Tokenizer.from_pretrained(embedded_model_dir())


def test_labels_cover_the_answer_only(example, tokenizer):
    facts = example.make_facts(32, seed=0)
    assert len({n for n, _ in facts}) == len({a for _, a in facts}) == 32
    name, answer = facts[0]
    ex = example.encode_example(tokenizer, name, answer)
    assert len(ex["input_ids"]) == len(ex["labels"])
    first = next(i for i, label in enumerate(ex["labels"]) if label != -100)
    assert all(label == -100 for label in ex["labels"][:first])
    assert ex["labels"][first:] == ex["input_ids"][first:]
    assert tokenizer.decode(ex["input_ids"][first:]) == answer + tokenizer.eos_token
    prompt = tokenizer.decode(ex["input_ids"][:first])
    assert prompt == f"{tokenizer.bos_token}<|open|>user<|sep|>{example.question(name)}<|end_of_msg|><|open|>assistant<|sep|>"


def test_smoke_run(example, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    summary = example.main(["--smoke", "--out", str(tmp_path)])
    assert summary["loss_last"] < summary["loss_first"]
    assert 0 < summary["trainable_parameters"] < summary["total_parameters"]
    assert summary["reloaded_adapter_rel_err"] <= 1e-6  # the same weights, the same computation
    assert summary["merged_rel_err"] <= 1e-4  # W + BA instead of Wx + BAx: fp32 rounding order only
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    for name in ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", "merged/config.json",
                 "merged/tokenizer.json"):
        assert (tmp_path / name).is_file(), name
    # The merged model is a plain K3 checkpoint again: it reloads without PEFT and gives the merged logits.
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    facts = example.make_facts(8, seed=0)
    reloaded = example.logits_of(merged, tokenizer, facts)
    adapter = example.logits_of(_adapter_model(tmp_path), tokenizer, facts)
    assert example.rel_err(reloaded, adapter) <= 1e-4


def _adapter_model(out):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from transformers_k3.cli import embedded_model_dir

    base = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32)
    return PeftModel.from_pretrained(base, out / "adapter")
