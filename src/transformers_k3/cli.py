"""`k3`: command-line entry points.

    k3 write-tiny DIR            write a small random checkpoint in the released layout
    k3 generate PROMPT [--model DIR] [--max-new-tokens N]
                                 stream a greedy continuation (token ids; a trained checkpoint with a tokenizer
                                 replaces the random demo model in a later release)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time


def _generate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, TextStreamer

    import transformers_k3  # noqa: F401
    from transformers_k3.tiny import write_tiny_checkpoint

    model_dir = args.model
    if model_dir is None:
        model_dir = tempfile.mkdtemp(prefix="k3-tiny-")
        write_tiny_checkpoint(model_dir, dtype=torch.float32)
        print(f"[k3] no --model given: wrote a random tiny checkpoint in the released layout to {model_dir}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception:
        pass
    vocab = model.config.text_config.vocab_size
    if tokenizer is not None:
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    else:
        # No tokenizer with the random demo model: bytes of the prompt, folded into the vocabulary.
        input_ids = torch.tensor([[b % (vocab - 8) for b in args.prompt.encode()]])
    start = time.perf_counter()
    with torch.no_grad():
        if tokenizer is not None:
            model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                           streamer=TextStreamer(tokenizer, skip_prompt=True))
        else:
            out = model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            print("[k3] new token ids:", out[0, input_ids.shape[1]:].tolist())
    elapsed = time.perf_counter() - start
    print(f"[k3] {args.max_new_tokens} tokens in {elapsed:.2f} s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 for transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write-tiny", help="write a small random checkpoint in the released layout")
    w.add_argument("path")
    w.add_argument("--layers", type=int, default=8)
    w.add_argument("--seed", type=int, default=0)
    g = sub.add_parser("generate", help="greedy generation")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="checkpoint directory (default: a random tiny one)")
    g.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    if args.command == "write-tiny":
        from transformers_k3.tiny import write_tiny_checkpoint

        write_tiny_checkpoint(args.path, seed=args.seed, num_hidden_layers=args.layers)
        print(f"[k3] wrote {args.path}")
        return 0
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
