"""KimiK3Tokenizer: the released tiktoken vocabulary as a `tokenizers` BPE, checked against tiktoken itself.

Oracles: `tiktoken.Encoding` built from the same ranks and pattern (what the release's remote-code class runs),
on a vocabulary trained here and, where `splintr-rs` is installed (it bundles Moonshot's K3 vocabulary), on the
released one, whose ids for "Hello world" SPEC 8 gives. Equality of ids is the rule: tokenisation is exact.
"""

import base64
import json
import os
import random
import subprocess
import sys

import pytest
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer, TokenizersBackend

from transformers_k3 import KimiK3Tokenizer
from transformers_k3.cli import main as k3_main
from transformers_k3.tokenization_kimi_k3 import (
    KIMI_K3_PATTERN, NUM_SPECIAL_IDS, read_tiktoken_ranks, special_token_names,
)

tiktoken = pytest.importorskip("tiktoken")

# Characters that exercise every branch of the pattern: Han next to Latin, case changes (A-Z, accented, Greek,
# Cyrillic), combining marks, kana (Lo but not Han), digits in runs, contractions in both cases, punctuation runs,
# every kind of whitespace, emoji.
_POOL = (list("abcxyzABCXYZ") + list("éÉßΣσжЖ") + ["\u0301"] + list("中文汉字北京") + list("のテ")
         + list("0123456789") + ["'s", "'T", "'re", "'LL", "'d"] + list(".,!?(){}<>-_=+#\"'")
         + [" ", "  ", "\n", "\r\n", "\t", "\u3000"] + ["🌍", "🙂"])


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_POOL) for _ in range(rng.randint(0, 40))) for _ in range(n)]


def write_tiktoken(path, ranks: dict[bytes, int]) -> str:
    with open(path, "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    return str(path)


def write_released_layout(directory, ranks: dict[bytes, int], named: dict[int, str], **config) -> str:
    """A directory as the release ships it: tiktoken.model, and a tokenizer_config.json naming the specials
    and pointing at a remote-code class."""
    os.makedirs(directory, exist_ok=True)
    write_tiktoken(os.path.join(directory, "tiktoken.model"), ranks)
    tok_config = {
        "added_tokens_decoder": {str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, name in named.items()},
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        **config,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(tok_config, f)
    return str(directory)


@pytest.fixture(scope="module")
def small_ranks():
    """A byte-level BPE of 600 ranks trained with tiktoken's reference trainer and Kimi's pattern on mixed text."""
    from tiktoken._educational import bpe_train

    corpus = " ".join(random_texts(400, seed=1)) + " The quick brown fox's 12345 jumps. 中文English混合 数据data"
    return bpe_train(corpus, vocab_size=600, pat_str=KIMI_K3_PATTERN, visualise=None)


@pytest.fixture(scope="module")
def small_dir(small_ranks, tmp_path_factory):
    n = len(small_ranks)
    named = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|end_of_msg|>", n + 3: "<|open|>", n + NUM_SPECIAL_IDS - 1: "[PAD]"}
    return write_released_layout(tmp_path_factory.mktemp("released"), small_ranks, named,
                                 bos_token="[BOS]", eos_token="<|end_of_msg|>", pad_token="[PAD]")


def oracle(ranks, names):
    n = len(ranks)
    return tiktoken.Encoding("k3", pat_str=KIMI_K3_PATTERN, mergeable_ranks=ranks,
                             special_tokens={name: n + i for i, name in enumerate(names)})


def test_pattern_splits_han_runs_apart_from_letters():
    split = pre_tokenizers.Split(__import__("tokenizers").Regex(KIMI_K3_PATTERN), behavior="isolated")
    pieces = lambda text: [p for p, _ in split.pre_tokenize_str(text)]  # noqa: E731
    assert pieces("中文English混合") == ["中文", "English", "混合"]
    assert pieces("北京市 Pascal") == ["北京市", " Pascal"]
    assert pieces("camelCaseWORDS it's") == ["camel", "Case", "WORDS", " it's"]
    assert pieces("1234567") == ["123", "456", "7"]


def test_matches_tiktoken_on_random_text(small_ranks, small_dir):
    tok = KimiK3Tokenizer.from_pretrained(small_dir)
    names = special_token_names(len(small_ranks), {int(i): t["content"] for i, t in json.load(
        open(os.path.join(small_dir, "tokenizer_config.json")))["added_tokens_decoder"].items()})
    enc = oracle(small_ranks, names)
    texts = random_texts(300, seed=7)
    mismatches = [t for t in texts if tok(t, add_special_tokens=False).input_ids != enc.encode(t)]
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, e.g. {mismatches[:3]!r}"
    for text in texts[:100]:
        assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_special_block_and_roles(small_ranks, small_dir):
    n = len(small_ranks)
    tok = KimiK3Tokenizer.from_pretrained(small_dir)
    assert len(tok) == n + NUM_SPECIAL_IDS
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (n, n + 2, n + NUM_SPECIAL_IDS - 1)
    assert tok.convert_ids_to_tokens(n + 100) == f"<|reserved_token_{n + 100}|>"
    # Specials are matched in text, as the release encodes with allowed_special="all", and dropped on request.
    enc = oracle(small_ranks, special_token_names(n, {n + 3: "<|open|>", n + 2: "<|end_of_msg|>"}))
    text = "<|open|>hello 中文<|end_of_msg|>"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids == enc.encode(text, allowed_special="all")
    assert ids[0] == n + 3 and ids[-1] == n + 2
    assert tok.decode(ids, skip_special_tokens=True) == "hello 中文"


def test_chat_template(small_dir, tmp_path):
    """Without a template in the checkpoint, the package's K3 chat format (processing_kimi_k3); with one, that one."""
    from transformers_k3.processing_kimi_k3 import DEFAULT_CHAT_TEMPLATE

    messages = [{"role": "user", "content": "hi"}]
    tok = KimiK3Tokenizer.from_pretrained(small_dir)
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|open|>user<|sep|>hi<|end_of_msg|><|open|>assistant<|sep|>"
    own = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    config_file = os.path.join(small_dir, "tokenizer_config.json")
    with open(config_file) as f:
        tok_config = json.load(f)
    (tmp_path / "tiktoken.model").write_bytes(open(os.path.join(small_dir, "tiktoken.model"), "rb").read())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tok_config, "chat_template": own}))
    assert KimiK3Tokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False) == "[hi]"


def test_save_reload_and_plain_transformers(small_dir, tmp_path):
    tok = KimiK3Tokenizer.from_pretrained(small_dir)
    out = tmp_path / "saved"
    tok.save_pretrained(out)
    saved_config = json.loads((out / "tokenizer_config.json").read_text())
    assert "auto_map" not in saved_config and "vocab_file" not in saved_config  # no remote code, no stale path
    assert (out / "tokenizer.json").is_file()
    texts = random_texts(50, seed=3) + ["<|open|>hi<|end_of_msg|>"]
    expected = [tok(t).input_ids for t in texts]
    again = KimiK3Tokenizer.from_pretrained(out)
    assert [again(t).input_ids for t in texts] == expected
    # Without transformers_k3 the saved tokenizer.json still carries Kimi's pattern.
    script = ("import json, sys\nfrom transformers import AutoTokenizer\n"
              f"tok = AutoTokenizer.from_pretrained({str(out)!r})\n"
              "print(json.dumps([tok(t).input_ids for t in json.loads(sys.stdin.read())]))\n")
    result = subprocess.run([sys.executable, "-c", script], input=json.dumps(texts), capture_output=True, text=True,
                            check=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


def test_auto_tokenizer_on_the_released_layout_asks_for_remote_code(small_dir):
    """Not a silent fallback: with no local class registered for the K3 config, transformers keeps asking for the
    release's remote code instead of converting tiktoken.model with its generic (GPT-4) pattern."""
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoTokenizer.from_pretrained(small_dir, trust_remote_code=False)


def test_cli_convert_tokenizer(small_dir, tmp_path, capsys):
    assert k3_main(["convert-tokenizer", small_dir, str(tmp_path / "converted")]) == 0
    assert "loads with AutoTokenizer" in capsys.readouterr().out
    a, b = AutoTokenizer.from_pretrained(tmp_path / "converted"), KimiK3Tokenizer.from_pretrained(small_dir)
    assert a("数据data 12345")["input_ids"] == b("数据data 12345")["input_ids"]


def test_bare_tiktoken_file_uses_spec_names(tmp_path):
    """A directory with only tiktoken.model of the released size: the specials get SPEC 8's names and roles."""
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({f"<{i}>".encode(): i for i in range(256, 163584)})  # filler up to the released rank count
    write_tiktoken(tmp_path / "tiktoken.model", ranks)
    tok = KimiK3Tokenizer.from_pretrained(tmp_path)
    assert len(tok) == 163840
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (163584, 163586, 163839)
    assert tok.convert_tokens_to_ids(["<|media_pad|>", "<|open|>"]) == [163605, 163587]


def test_bad_files_name_the_problem(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_text("IQ== 0\nnot-base64! 1\n")
    with pytest.raises(ValueError, match="line 2"):
        read_tiktoken_ranks(str(bad))
    bad.write_text("IQ== 0\nIg== 2\n")
    with pytest.raises(ValueError, match="not 0..1 once each"):
        read_tiktoken_ranks(str(bad))
    bad.write_text("IQ== 0\nIQ== 1\n")
    with pytest.raises(ValueError, match="appears twice"):
        read_tiktoken_ranks(str(bad))
    with pytest.raises(ValueError, match="outside the special block"):
        special_token_names(100, {99: "[BOS]"})


@pytest.fixture(scope="module")
def released_ranks(tmp_path_factory):
    """The released vocabulary, from splintr-rs (it bundles Moonshot's tiktoken.model for K3): id -> bytes."""
    splintr = pytest.importorskip("splintr", reason="splintr-rs bundles the released K3 vocabulary")
    source = splintr.Tokenizer.from_pretrained("kimi_k3")
    ranks = {source.decode_token_bytes(i): i for i in range(163584)}
    assert len(ranks) == 163584
    return ranks


def test_released_vocabulary_matches_spec_and_tiktoken(released_ranks, tmp_path):
    path = write_tiktoken(tmp_path / "tiktoken.model", released_ranks)
    tok = KimiK3Tokenizer.from_pretrained(tmp_path)
    assert tok("Hello world", add_special_tokens=False).input_ids == [19180, 2695]  # SPEC 8's golden encoding
    enc = tiktoken.Encoding("k3", pat_str=KIMI_K3_PATTERN, mergeable_ranks=read_tiktoken_ranks(path),
                            special_tokens={})
    texts = random_texts(300, seed=11) + ["你好世界", "中文English混合", "I'M HERE it's",
                                          "def fibonacci(n):\n    return"]
    mismatches = [t for t in texts if tok(t, add_special_tokens=False).input_ids != enc.encode(t)]
    assert not mismatches, f"{len(mismatches)} of {len(texts)} differ, e.g. {mismatches[:3]!r}"
    # transformers' generic tiktoken conversion (GPT-4 pattern) differs, here on a contraction after a capital
    # run: the reason this class exists.
    generic = TokenizersBackend.from_pretrained(tmp_path)
    text = "I'M HERE it's"
    assert generic(text, add_special_tokens=False).input_ids != enc.encode(text)
    assert tok(text, add_special_tokens=False).input_ids == enc.encode(text)


def test_embedded_model_tokenizer_unchanged():
    """The CLI now loads through KimiK3Tokenizer: on the embedded model's tokenizer.json it is the same tokenizer."""
    from transformers_k3.cli import embedded_model_dir

    path = embedded_model_dir()
    a, b = KimiK3Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    for text in ["def fibonacci(n):\n    return n", "[BOS]x<|end_of_msg|>"] + random_texts(20, seed=5):
        assert a(text).input_ids == b(text).input_ids
    assert (a.bos_token_id, a.eos_token_id) == (b.bos_token_id, b.eos_token_id)
