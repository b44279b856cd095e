"""Layers spread over two GPUs (`device_map`, as accelerate places them): the same greedy tokens and logits as on
one GPU, for the torch and the Triton paths, with the growing and the static cache. Needs two CUDA devices (CI has
none: skipped there)."""

import pytest
import torch
from accelerate import dispatch_model

from helpers import rel_err
from transformers_k3 import KimiK3ForCausalLM
from transformers_k3.tiny import tiny_config

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def _model(attn, experts):
    torch.manual_seed(0)
    config = tiny_config(num_hidden_layers=8).text_config  # MLA layers 3 and 7: one on each GPU below
    return KimiK3ForCausalLM._from_config(config, attn_implementation=attn, experts_implementation=experts,
                                          dtype=torch.float32).eval()


def _split(model):
    n = len(model.model.layers)
    device_map = {"model.embed_tokens": 0, "lm_head": 1}
    for name, _ in model.model.named_children():
        if name not in ("embed_tokens", "layers"):
            device_map[f"model.{name}"] = 1
    for i in range(n):
        device_map[f"model.layers.{i}"] = 0 if i < n // 2 else 1
    return dispatch_model(model, device_map=device_map)


@torch.no_grad()
@pytest.mark.parametrize("attn,experts", [("sdpa", "eager"), ("k3_mla_paged", "k3_triton")])
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_two_gpus_match_one(attn, experts, cache_implementation):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 500, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    gen = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
               cache_implementation=cache_implementation)
    one = _model(attn, experts).to("cuda:0")
    want = one.generate(ids.cuda(0), attention_mask=mask.cuda(0), **gen)
    two = _split(_model(attn, experts))
    assert {p.device.index for p in two.parameters()} == {0, 1}
    if cache_implementation == "static":  # a CUDA graph holds one GPU's work: the steps run eagerly, if asked to
        with pytest.raises(ValueError, match="disable_compile"):
            two.generate(ids.cuda(0), attention_mask=mask.cuda(0), **gen)
        gen["disable_compile"] = True
    got = two.generate(ids.cuda(0), attention_mask=mask.cuda(0), **gen)
    assert torch.equal(got.sequences.cpu(), want.sequences.cpu())
    assert rel_err(torch.stack(got.scores).cpu(), torch.stack(want.scores).cpu()) <= 1e-4
