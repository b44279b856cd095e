"""Kimi K3's tokenizer without remote code: the released `tiktoken.model` as a `tokenizers` byte-level BPE.

The release ships its vocabulary as `tiktoken.model` (163,584 ranks, one `base64(token bytes) rank` line each;
by a port's account K2's file, unchanged) and names the 256 special ids above it (163584..163839) in `tokenizer_config.json`'s
`added_tokens_decoder`; its own Python class needs `trust_remote_code`. A tiktoken vocabulary is a byte-level
BPE whose merges follow from the ranks, and transformers' `TikTokenConverter` rebuilds them. What is Kimi's own
is the pre-tokenisation pattern (`KIMI_K3_PATTERN`): a run of Han characters is a piece of its own, and Han is
subtracted from the letter classes so that branch fires; otherwise it is the cl100k/o200k family's split by
case, digits in threes, punctuation and whitespace. With the default (GPT-4) pattern instead, Chinese text and
mixed-case words tokenise differently from the model's training.

`KimiK3Tokenizer.from_pretrained(dir)` reads `tokenizer.json` when there is one (what `save_pretrained` writes,
so a saved tokenizer reloads with plain transformers too) and otherwise converts `tiktoken.model` (about 1.5 s
on one CPU core for the released vocabulary). Not reproduced: the release's Python class cuts inputs into
pieces of at most 25,000 consecutive whitespace or non-whitespace characters before encoding (a guard against
tiktoken's slow path), which changes ids only inside such runs.
"""

from __future__ import annotations

import base64
import binascii
import os

from transformers import TokenizersBackend
from transformers.convert_slow_tokenizer import TikTokenConverter

NUM_SPECIAL_IDS = 256  # the release reserves 163584..163839, named or not

# Kimi's `pat_str` (Moonshot's tokenization_kimi.py since K2; the reference files of K3 do not include the tokenizer,
# and the test on the released vocabulary checks SPEC 8's golden ids with it), one alternative a line.
# `&&[^\p{Han}]` is class intersection (Oniguruma and tiktoken's regex engine both support it).
_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_K3_PATTERN = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}*{_LETTERS_LOWER}+{_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_UPPER}+{_LETTERS_LOWER}*{_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# SPEC 8: the named specials, used when no `tokenizer_config.json` names them (a bare `tiktoken.model`).
K3_SPECIAL_TOKENS = {
    163584: "[BOS]", 163585: "[EOS]", 163586: "<|end_of_msg|>", 163587: "<|open|>", 163588: "<|close|>",
    163589: "<|sep|>", 163602: "<|media_begin|>", 163603: "<|media_content|>", 163604: "<|media_end|>",
    163605: "<|media_pad|>", 163839: "[PAD]",
}
# The released config's ids: bos 163584, eos 163586 (the end of a message: what generation stops at), pad 163839.
_DEFAULT_ROLES = {"bos_token": "[BOS]", "eos_token": "<|end_of_msg|>", "pad_token": "[PAD]"}


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """`tiktoken.model` -> {token bytes: rank}, checking what the conversion relies on: every line is
    `base64 rank`, and the ranks are 0..n-1 once each (a BPE rank is also the token id)."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (ValueError, binascii.Error):
                raise ValueError(f"{path}, line {number}: expected 'base64-token rank', got {line[:80]!r}") from None
            if token in ranks:
                raise ValueError(f"{path}, line {number}: token {token!r} appears twice (ranks {ranks[token]}, {rank})")
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0..{len(ranks) - 1} once each, so they cannot be token ids")
    return ranks


class _KimiTikTokenConverter(TikTokenConverter):
    """transformers' converter on ranks read once here (its own reader needs the `tiktoken` package)."""

    def __init__(self, ranks: dict[bytes, int], **kwargs):
        super().__init__(**kwargs)
        self._ranks = ranks

    def load_tiktoken_bpe(self, path):
        return self._ranks


def special_token_names(num_ranks: int, named: dict[int, str]) -> list[str]:
    """The names of ids num_ranks..num_ranks+255 in order: `named` where it names them, the release's
    `<|reserved_token_{id}|>` otherwise."""
    outside = sorted(i for i in named if not num_ranks <= i < num_ranks + NUM_SPECIAL_IDS)
    if outside:
        raise ValueError(f"added_tokens_decoder names ids {outside[:5]} outside the special block "
                         f"{num_ranks}..{num_ranks + NUM_SPECIAL_IDS - 1} that follows the {num_ranks} tiktoken ranks")
    return [named.get(i, f"<|reserved_token_{i}|>") for i in range(num_ranks, num_ranks + NUM_SPECIAL_IDS)]


def tiktoken_to_tokenizer(path: str, named_specials: dict[int, str] | None = None):
    """A `tokenizers.Tokenizer` equal to the release's tiktoken encoding: byte-level BPE over the ranks, Kimi's
    split pattern, and the 256 specials (matched in text, as the release encodes with `allowed_special="all"`)."""
    ranks = read_tiktoken_ranks(path)
    names = special_token_names(len(ranks), K3_SPECIAL_TOKENS if named_specials is None else named_specials)
    return _KimiTikTokenConverter(ranks, vocab_file=path, pattern=KIMI_K3_PATTERN,
                                  extra_special_tokens=names).converted()


class KimiK3Tokenizer(TokenizersBackend):
    """The K3 tokenizer, from a released directory (`tiktoken.model` + `tokenizer_config.json`) or from a
    `tokenizer.json`; see the module docstring. What it saves loads with `AutoTokenizer` as transformers' generic
    `TokenizersBackend` (the same tokenizer: the pattern is in tokenizer.json)."""

    model_input_names = ["input_ids", "attention_mask"]

    @classmethod
    def _convert_from_tiktoken(cls, vocab_file: str, local_kwargs: dict) -> dict:
        # transformers' loader calls this when a directory has tiktoken.model and no tokenizer.json; its own version
        # converts with the GPT-4 pattern, which splits some text differently from the release.
        named = {int(i): t["content"] if isinstance(t, dict) else str(t)
                 for i, t in (local_kwargs.get("added_tokens_decoder") or {}).items()}
        local_kwargs["tokenizer_object"] = tiktoken_to_tokenizer(vocab_file, named or None)
        names = set(named.values() or K3_SPECIAL_TOKENS.values())
        for role, token in _DEFAULT_ROLES.items():
            if local_kwargs.get(role) is None and token in names:
                local_kwargs[role] = token
        return local_kwargs

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *init_inputs, **kwargs):
        tokenizer = super().from_pretrained(pretrained_model_name_or_path, *init_inputs, **kwargs)
        # Not written back by save_pretrained: the release's pointer to its remote class (it would make the saved
        # directory ask for remote code again) and the path of the file converted.
        for key in ("auto_map", "vocab_file"):
            tokenizer.init_kwargs.pop(key, None)
        if tokenizer.chat_template is None:  # the checkpoint's own template, where it has one, wins
            from .processing_kimi_k3 import DEFAULT_CHAT_TEMPLATE

            tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        return tokenizer


def convert_tiktoken_directory(source: str | os.PathLike, destination: str | os.PathLike) -> KimiK3Tokenizer:
    """Write `tokenizer.json` + `tokenizer_config.json` for a released tokenizer directory, so it loads with plain
    transformers (`AutoTokenizer`, no remote code, no transformers_k3) from then on."""
    tokenizer = KimiK3Tokenizer.from_pretrained(str(source))
    tokenizer.save_pretrained(str(destination))
    return tokenizer
