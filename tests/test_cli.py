"""The `k3` CLI: generation from the embedded small K3 (streamed), the embedded checkpoint's released layout,
the clear error when it is missing, and the existing `write-tiny` / `--model` path."""

import pytest
import torch
from safetensors import safe_open

import transformers_k3  # noqa: F401  (registers the Auto classes)
from transformers_k3 import cli


@pytest.fixture(scope="module")
def embedded():
    return cli.embedded_model_dir()


def test_generate_embedded_streams(embedded, capsys, monkeypatch):
    from transformers import TextStreamer

    chunks = []
    original = TextStreamer.on_finalized_text

    def record(self, text, stream_end=False):
        chunks.append(text)
        return original(self, text, stream_end=stream_end)

    monkeypatch.setattr(TextStreamer, "on_finalized_text", record)
    assert cli.main(["generate", "def fibonacci(", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def fibonacci(")
    generated = out[len("def fibonacci("):]
    assert generated.strip(), "no generated text on stdout"
    # Streamed: the streamer emitted text in several pieces during generation, and stdout is exactly them.
    assert len([c for c in chunks if c]) >= 2, chunks
    assert "".join(chunks) == generated[:-1] and generated.endswith("\n")  # TextStreamer ends with a newline


def test_generate_sampling_options(embedded, capsys):
    argv = ["generate", "import os", "--max-new-tokens", "6", "--do-sample", "--temperature", "1.0", "--seed", "3"]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == first  # the seed makes sampling reproducible
    assert len(first) > len("import os")


def test_bad_arguments_named(embedded):
    with pytest.raises(ValueError, match="--max-new-tokens"):
        cli.main(["generate", "x", "--max-new-tokens", "0"])
    with pytest.raises(ValueError, match="--temperature"):
        cli.main(["generate", "x", "--do-sample", "--temperature", "0"])


def test_embedded_checkpoint_is_released_layout_and_loads_strictly(embedded):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    keys = []
    for f in sorted(embedded.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            keys += list(sf.keys())
    expert_keys = [k for k in keys if ".experts." in k]
    assert expert_keys and all(k.endswith((".weight_packed", ".weight_scale")) for k in expert_keys), expert_keys[:4]
    assert any(k.endswith(".weight_packed") for k in expert_keys)
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)

    model, info = AutoModelForCausalLM.from_pretrained(embedded, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tok = AutoTokenizer.from_pretrained(embedded)
    cfg = model.config
    # Special ids as SPEC 8 orders them, after the BPE ranks, and consistent with the config.
    assert tok.convert_tokens_to_ids("[BOS]") == cfg.bos_token_id == cfg.text_config.bos_token_id
    assert tok.convert_tokens_to_ids("<|end_of_msg|>") == cfg.eos_token_id
    assert tok.convert_tokens_to_ids("[PAD]") == cfg.pad_token_id == len(tok) - 1
    assert tok.convert_tokens_to_ids("<|media_pad|>") == cfg.media_placeholder_token_id
    assert cfg.text_config.vocab_size >= len(tok)
    assert set(cfg.text_config.layer_types) == {"linear_attention", "full_attention"}
    assert cfg.text_config.layer_types[-1] == "full_attention"
    size_mb = sum(f.stat().st_size for f in embedded.iterdir() if f.is_file()) / 1e6
    assert size_mb <= 40, size_mb


def test_missing_embedded_dir_says_how_to_create(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "EMBEDDED_DIR", tmp_path / "embedded")
    with pytest.raises(FileNotFoundError, match="train_small_k3.py"):
        cli.main(["generate", "x"])


def test_write_tiny_then_generate_with_model(tmp_path, capsys):
    path = tmp_path / "tiny"
    assert cli.main(["write-tiny", str(path), "--layers", "4"]) == 0
    assert cli.main(["generate", "hello", "--model", str(path), "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "new token ids" in out


def test_generate_with_a_released_tokenizer_directory(tmp_path, capsys):
    """`--model` on a directory shipping the release's tokenizer files (tiktoken.model + tokenizer_config.json):
    the tokenizer is converted (no remote code) and must match the model's vocabulary, or the error says so."""
    import base64
    import json

    path = tmp_path / "tiny"
    assert cli.main(["write-tiny", str(path), "--layers", "4"]) == 0
    vocab = json.loads((path / "config.json").read_text())["text_config"]["vocab_size"]

    def write_tokenizer(ranks):  # the release's layout: the ranks, then 256 special ids
        tokens = [bytes([b]) for b in range(256)] + [f"<{i}>".encode() for i in range(256, ranks)]
        (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n"
                                                     for i, t in enumerate(tokens)))
        (path / "tokenizer_config.json").write_text(json.dumps({
            "added_tokens_decoder": {str(ranks): {"content": "[BOS]", "special": True},
                                     str(ranks + 2): {"content": "<|end_of_msg|>", "special": True}},
            "bos_token": "[BOS]", "eos_token": "<|end_of_msg|>", "tokenizer_class": "TikTokenTokenizer",
            "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}))

    write_tokenizer(vocab - 256)
    assert cli.main(["generate", "hello", "--model", str(path), "--max-new-tokens", "3"]) == 0
    assert "[k3] 3 tokens" in capsys.readouterr().err
    write_tokenizer(vocab - 255)  # one token more than the model has
    with pytest.raises(ValueError, match=f"{vocab + 1} tokens but the model's vocabulary has {vocab}"):
        cli.main(["generate", "hello", "--model", str(path), "--max-new-tokens", "3"])


def _train_script():
    from helpers import load_example

    return load_example("train_small_k3")


def test_train_script_tokenizer_and_recall_data(tmp_path):
    import random

    t = _train_script()
    texts = [f"def f{i}(a, b):\n    return a + b * {i}\n\nclass C{i}:\n    pass\n" for i in range(200)]
    tok, ids, n_bpe = t.train_tokenizer(texts, 300, tmp_path)
    # Specials follow the BPE ranks in SPEC 8's order.
    assert [ids[s] for s in t.SPECIAL_TOKENS] == list(range(n_bpe, n_bpe + len(t.SPECIAL_TOKENS)))
    assert len(tok) == n_bpe + len(t.SPECIAL_TOKENS)
    enc = t.Encoded(tok, texts, ids["[BOS]"], ids["[EOS]"])
    assert int((enc.stream == ids["[BOS]"]).sum()) == len(texts)
    recall = t.RecallMaker(tok)
    rng = random.Random(0)
    for length in (150, 197, 300):
        prompt, want = recall.eval_example(rng, enc.lines, length)
        assert len(prompt) == length
        text = tok.decode(prompt)
        key = text.rsplit("assert ", 1)[1].split(" ==")[0]
        assert f'{key} = {want}\n' in text  # the queried key was defined with that value
        ex = recall.train_example(rng, enc.lines, length)
        assert len(ex) == length
    with pytest.raises(ValueError, match="eval length"):
        recall.eval_example(rng, enc.lines, 8)
    ds = t.MixedDataset(enc, recall, 160, 10, 0.5, seed=0)
    a, b = ds[3], ds[3]
    assert torch.equal(a["input_ids"], b["input_ids"]) and a["input_ids"].shape == (160,)  # deterministic in i
