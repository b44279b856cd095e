"""MXFP4 routed experts kept packed (`keep_experts_packed`, implied by `experts_implementation="k3_triton"`).

The packed model holds the release's bytes, so it must give the dequantised model's logits (the eager path
dequantises exactly, one expert at a time: bit for bit against the dequantised model on the same eager loop,
rel_err <= 1e-5 in fp32 against grouped_mm, whose summation order differs), write the
checkpoint back bit for bit, feed those very bytes to the Triton kernel (its bf16 products: rel_err <= 2e-2, the
rule of tests/kernels/test_moe_triton.py), take 4.25 bits a weight, and refuse training and LoRA.
"""

import glob
import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import rel_err
from transformers_k3 import KimiK3ForConditionalGeneration
from transformers_k3.modeling_kimi_k3 import KimiK3Experts
from transformers_k3.tiny import write_tiny_checkpoint

PACKED = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernel: compiled on CUDA, interpreted here


def _load(path, **kw):
    return KimiK3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _experts(model):
    found = [m for m in model.modules() if isinstance(m, KimiK3Experts)]
    assert found
    return found


def _tensors(path):
    out = {}
    for f in sorted(glob.glob(f"{path}/*.safetensors")):
        out.update(load_file(f))
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model.language_model(input_ids=ids, use_cache=False).logits


@pytest.fixture(scope="module")
def packed(tiny_dir):
    return _load(tiny_dir, keep_experts_packed=True)


def test_packed_layout_and_logits(tiny_dir, packed, tiny_model):
    cfg = packed.config.get_text_config()
    E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    for m in _experts(packed):
        assert m.packed
        shapes = [tuple(getattr(m, n).shape) for n in PACKED]
        assert shapes == [(E, 2 * I, D // 2), (E, 2 * I, D // 32), (E, D, I // 2), (E, D, I // 32)]
        for n in PACKED:
            p = getattr(m, n)
            assert isinstance(p, torch.nn.Parameter) and p.dtype == torch.uint8 and not p.requires_grad
        assert not hasattr(m, "gate_up_proj") and not hasattr(m, "down_proj")
    assert cfg._experts_implementation == "eager"  # the default grouped_mm cannot read bytes
    # The bytes are the checkpoint's: stacking the released per-expert tensors gives them back.
    ckpt = _tensors(tiny_dir)
    layer = next(i for i, t in enumerate(cfg.mlp_layer_types) if t == "sparse")
    pre = f"language_model.model.layers.{layer}.block_sparse_moe.experts"
    m = packed.language_model.model.layers[layer].block_sparse_moe.experts
    w1 = torch.stack([ckpt[f"{pre}.{e}.w1.weight_packed"] for e in range(E)])
    w3 = torch.stack([ckpt[f"{pre}.{e}.w3.weight_packed"] for e in range(E)])
    assert torch.equal(m.gate_up_proj_blocks, torch.cat([w1, w3], dim=1))
    assert torch.equal(m.down_proj_scales, torch.stack([ckpt[f"{pre}.{e}.w2.weight_scale"] for e in range(E)]))
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    got = _logits(packed, ids)
    # Dequantised on load, same eager loop: the very same numbers, so the same logits bit for bit.
    assert torch.equal(got, _logits(_load(tiny_dir, experts_implementation="eager"), ids))
    # The default grouped_mm sums in another order.
    assert torch.isfinite(got).all() and rel_err(got, _logits(tiny_model, ids)) <= 1e-5


def test_packed_bytes_are_4_25_bits_a_weight(packed):
    for m in _experts(packed):
        weights = m.num_experts * 3 * m.intermediate_dim * m.hidden_dim  # w1, w3, w2
        nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
        assert nbytes * 8 / weights == 4.25  # 4-bit codes + one 8-bit scale per 32


def test_save_round_trip_is_bit_exact(tiny_dir, packed, tmp_path):
    packed.save_pretrained(tmp_path)
    want, got = _tensors(tiny_dir), _tensors(tmp_path)
    assert set(got) == set(want)
    assert any(k.endswith("w1.weight_packed") for k in got)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    # and the saved release loads both ways again
    assert all(m.packed for m in _experts(_load(tmp_path, keep_experts_packed=True)))
    assert not any(m.packed for m in _experts(_load(tmp_path)))


def test_k3_triton_consumes_the_packed_parameters(tiny_dir, tiny_model, monkeypatch):
    pytest.importorskip("triton")
    import k3_kernels.moe.triton_moe as triton_moe

    fast = _load(tiny_dir, experts_implementation="k3_triton").to(DEVICE)  # MXFP4 checkpoint + k3_triton: packed
    assert all(m.packed for m in _experts(fast))
    seen, real = [], triton_moe.moe_experts_triton
    monkeypatch.setattr(triton_moe, "moe_experts_triton", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(1))
    got = _logits(fast, ids.to(DEVICE)).cpu()
    experts = _experts(fast)
    assert len(seen) == len(experts)
    for kw, m in zip(seen, experts):
        assert "gate_up" not in kw
        assert kw["w13_packed"] is m.gate_up_proj_blocks and kw["w13_scale"] is m.gate_up_proj_scales
        assert kw["w2_packed"] is m.down_proj_blocks and kw["w2_scale"] is m.down_proj_scales
    assert rel_err(got, _logits(tiny_model, ids)) <= 2e-2
    # Opting out keeps the bf16/fp32 3-D experts on the same kernel.
    dense = _load(tiny_dir, experts_implementation="k3_triton", keep_experts_packed=False)
    assert not any(m.packed for m in _experts(dense))


def test_training_lora_and_bf16_paths_refuse(tiny_dir, packed):
    ids = torch.randint(0, 200, (1, 5))
    model = _load(tiny_dir, keep_experts_packed=True)
    model.train()
    with pytest.raises(RuntimeError, match="keep_experts_packed=False"):
        model.language_model(input_ids=ids, use_cache=False)
    with torch.no_grad():  # inference in train mode (e.g. dropout checks) is fine
        model.language_model(input_ids=ids, use_cache=False)
    with pytest.raises(RuntimeError, match="only Tensors of floating point"):
        _experts(model)[0].gate_up_proj_blocks.requires_grad_(True)
    model.eval()
    model.set_experts_implementation("grouped_mm")
    with pytest.raises(AttributeError, match="keep_experts_packed=False"):
        model.language_model(input_ids=ids, use_cache=False)
    with pytest.raises(ValueError, match="keep_experts_packed"):
        _load(tiny_dir, keep_experts_packed=True, experts_implementation="grouped_mm")


def test_lora_on_packed_experts_refuses(tiny_dir):
    peft = pytest.importorskip("peft")
    model = _load(tiny_dir, keep_experts_packed=True)
    # The bf16 3-D tensors LoRA targets do not exist on a packed model ...
    with pytest.raises(ValueError, match="target_parameters"):
        peft.get_peft_model(model.language_model, peft.LoraConfig(
            r=2, target_modules=[], target_parameters=["experts.gate_up_proj"], lora_dropout=0.0))
    # ... and an adapter forced onto the bytes is refused at the first forward, naming the way out.
    model = _load(tiny_dir, keep_experts_packed=True)
    lora = peft.get_peft_model(model.language_model, peft.LoraConfig(
        r=2, target_modules=[], target_parameters=["experts.gate_up_proj_blocks"], lora_dropout=0.0))
    with torch.no_grad(), pytest.raises(RuntimeError, match="keep_experts_packed=False"):
        lora(input_ids=torch.randint(0, 200, (1, 5)), use_cache=False)


def test_packing_needs_mxfp4_experts(tmp_path):
    write_tiny_checkpoint(tmp_path, seed=1, dtype=torch.float32, num_hidden_layers=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    # A checkpoint of bf16 3-D experts: save a dequantised model whose config has no MXFP4 block.
    model = _load(tmp_path)
    model.config.get_text_config().checkpoint_quantization_config = None
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    assert "quantization_config" in cfg["text_config"] and "quantization_config" not in json.loads(
        (plain / "config.json").read_text())["text_config"]
    with pytest.raises(ValueError, match="needs MXFP4 experts"):
        _load(plain, keep_experts_packed=True)
    assert not any(m.packed for m in _experts(_load(plain, experts_implementation="k3_triton")))
