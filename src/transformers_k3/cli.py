"""`k3`: command-line entry points.

    k3 write-tiny DIR            write a small random checkpoint in the released layout
    k3 generate PROMPT [--model DIR] [--max-new-tokens N] [--do-sample --temperature T --top-k K --top-p P]
                                 stream a continuation to stdout, token by token; without --model it runs the
                                 embedded small K3 trained from scratch (`transformers_k3/embedded/`)
    k3 convert-tokenizer SRC DST write the released tokenizer (tiktoken.model) as tokenizer.json, which loads
                                 with plain transformers
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
_CREATE_HINT = (
    "create it with `python3 examples/train_small_k3.py --smoke` (a CPU minute) or the full run "
    "`python3 examples/train_small_k3.py --max-minutes 4 --out src/transformers_k3/embedded` (one GPU), "
    "from the repository root"
)


def embedded_model_dir() -> Path:
    """The checkpoint shipped inside the package; a clear error when it has not been built."""
    if not (EMBEDDED_DIR / "config.json").is_file() or not (EMBEDDED_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(f"the embedded K3 model is missing from {EMBEDDED_DIR}: {_CREATE_HINT}")
    return EMBEDDED_DIR


def _generate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, TextStreamer

    import transformers_k3  # registers the Auto classes

    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.do_sample and args.temperature <= 0:
        raise ValueError(f"--temperature must be positive when sampling, got {args.temperature}")
    model_dir = Path(args.model) if args.model is not None else embedded_model_dir()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = None
    if any((model_dir / name).is_file() for name in ("tokenizer.json", "tiktoken.model")):
        # Not AutoTokenizer: a released directory names a remote-code class, and this converts its tiktoken.model.
        tokenizer = transformers_k3.KimiK3Tokenizer.from_pretrained(model_dir)
    # else: a random checkpoint from `write-tiny`, which has no tokenizer
    vocab = model.config.get_text_config(decoder=True).vocab_size
    if tokenizer is not None and len(tokenizer) > vocab:
        raise ValueError(f"{model_dir}: the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has "
                         f"{vocab}: they are not one checkpoint's")
    if tokenizer is not None:
        ids = tokenizer(args.prompt, add_special_tokens=False).input_ids
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids  # training documents start with [BOS]
        input_ids = torch.tensor([ids])
    else:
        # No tokenizer (a random write-tiny checkpoint): bytes of the prompt, folded into the vocabulary.
        input_ids = torch.tensor([[b % (vocab - 8) for b in args.prompt.encode()]])
    stop = [model.config.eos_token_id] if model.config.eos_token_id is not None else []
    if tokenizer is not None and "[EOS]" in tokenizer.get_vocab():
        stop.append(tokenizer.convert_tokens_to_ids("[EOS]"))  # the document end of the embedded model
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                      eos_token_id=stop or None,
                      pad_token_id=model.config.pad_token_id)
    if args.do_sample:
        torch.manual_seed(args.seed)
        gen_kwargs.update(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    start = time.perf_counter()
    with torch.no_grad():
        if tokenizer is not None:
            print(args.prompt, end="", flush=True)
            out = model.generate(input_ids, streamer=TextStreamer(tokenizer, skip_prompt=True), **gen_kwargs)
        else:
            out = model.generate(input_ids, **gen_kwargs)
            print("[k3] new token ids:", out[0, input_ids.shape[1]:].tolist())
    elapsed = time.perf_counter() - start
    n_new = out.shape[1] - input_ids.shape[1]
    print(f"[k3] {n_new} tokens in {elapsed:.2f} s ({model_dir})", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 for transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write-tiny", help="write a small random checkpoint in the released layout")
    w.add_argument("path")
    w.add_argument("--layers", type=int, default=8)
    w.add_argument("--seed", type=int, default=0)
    g = sub.add_parser("generate", help="stream a continuation of PROMPT")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the embedded small K3)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    c = sub.add_parser("convert-tokenizer", help="write tokenizer.json for a released tiktoken.model directory")
    c.add_argument("source", help="directory (or hub id) with tiktoken.model and tokenizer_config.json")
    c.add_argument("destination")
    args = parser.parse_args(argv)
    if args.command == "convert-tokenizer":
        from transformers_k3.tokenization_kimi_k3 import convert_tiktoken_directory

        tokenizer = convert_tiktoken_directory(args.source, args.destination)
        print(f"[k3] wrote {args.destination}: {len(tokenizer)} tokens, loads with AutoTokenizer and no remote code")
        return 0
    if args.command == "write-tiny":
        from transformers_k3.tiny import write_tiny_checkpoint

        write_tiny_checkpoint(args.path, seed=args.seed, num_hidden_layers=args.layers)
        print(f"[k3] wrote {args.path}")
        return 0
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
