"""One rank of `test_context_parallel.py`:
`torchrun --nproc_per_node N context_parallel_script.py CKPT T OUT [checkpointing]`.

Every rank builds the same two rows of N * T tokens and runs them whole (the reference), then runs its own segment
of T tokens under `context_parallel`. It writes OUT/rank{RANK}.json: the largest relative difference of its
segment's logits, of the loss, and of every parameter gradient (summed over the ranks) to the reference's; then
how decoding alone from the cache the ranks prefilled together compares with generating from the whole prompt;
then which bad calls raised what."""

import json
import os
import sys

import torch
import torch.distributed as dist

from transformers_k3 import KimiK3ForConditionalGeneration
from transformers_k3.modeling_kimi_k3 import CACHE_KWARG
from transformers_k3.context_parallel import context_parallel, prefill


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def main(path, T, out, checkpointing=False):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    lm = KimiK3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).language_model.train()
    if checkpointing:  # the backward then re-runs each layer's forward, collectives included, inside the block
        lm.gradient_checkpointing_enable()
    ids = torch.randint(0, 500, (2, world * T), generator=torch.Generator().manual_seed(0))
    shift = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # the next token, over the whole sequence
    n_items = int((shift != -100).sum())  # one normaliser for the whole sequence: the ranks' losses then add up

    full = lm(input_ids=ids, shift_labels=shift, num_items_in_batch=n_items, use_cache=False)
    full.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad()

    seg = slice(rank * T, (rank + 1) * T)
    with context_parallel():
        part = lm(input_ids=ids[:, seg], shift_labels=shift[:, seg].contiguous(), num_items_in_batch=n_items)
        part.loss.backward()
    loss = part.loss.detach().clone()
    dist.all_reduce(loss)
    grad_err = {}
    for n, p in lm.named_parameters():
        if n in ref_grads:
            g = p.grad.clone()
            dist.all_reduce(g)  # each rank holds its segment's share of the gradient
            grad_err[n] = rel_err(g, ref_grads[n])
    # Prefill across the ranks, then decode alone: every rank holds the whole sequence's cache.
    lm.eval()
    more = torch.randint(0, 500, (2, 5), generator=torch.Generator().manual_seed(1))
    prompt = torch.cat([ids, more], 1)  # world * T + 5 tokens
    prefilled = prefill(lm, prompt)  # the first world * (T + 1) tokens: the largest multiple below the length
    cache_len = prefilled.get_seq_length()
    with torch.no_grad():
        gen = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        alone = lm.generate(prompt, **{CACHE_KWARG: prefilled}, **gen)
        whole = lm.generate(prompt, **gen)
        used = getattr(lm(input_ids=ids[:, :4], use_cache=True), CACHE_KWARG)  # a cache that holds tokens
    decode = {"cache_len": cache_len, "same_tokens": bool(torch.equal(alone.sequences, whole.sequences)),
              "logits": max(rel_err(a, b) for a, b in zip(alone.logits, whole.logits))}

    # What a segment cannot serve raises the same error on every rank (no rank is left waiting in a collective).
    refused = {}
    with context_parallel(), torch.no_grad():
        for name, kwargs in {
            "used cache": dict(input_ids=ids[:, seg], **{CACHE_KWARG: used}),
            "padding": dict(input_ids=ids[:, seg], attention_mask=torch.ones(2, T).index_fill_(1, torch.tensor(0), 0)),
            "unequal segments": dict(input_ids=ids[:, seg][:, : T - rank]),
        }.items():
            try:
                lm(**kwargs)
                refused[name] = None
            except ValueError as e:
                refused[name] = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"logits": rel_err(part.logits, full.logits[:, seg]), "loss": rel_err(loss, full.loss.detach()),
                   "grads": grad_err, "n_params": len(ref_grads), "refused": refused, "decode": decode}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], checkpointing=sys.argv[4:] == ["checkpointing"])
