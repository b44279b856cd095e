import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.conversion_mapping import register_checkpoint_conversion_mapping

from k3_conversion.mxfp4_experts import (
    Mxfp4DequantizeMergeExperts,
    Mxfp4QuantizeSplitExperts,
    expert_conversions,
)
from k3_kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

E, I, D = 4, 64, 64
PREFIX = "layers.0.block_sparse_moe.experts."


class ProbeConfig(PretrainedConfig):
    model_type = "k3_mxfp4_probe"

    def __init__(self, num_experts=E, moe_intermediate_size=I, routed_expert_hidden_size=D, packed=False, **kwargs):
        self.packed = packed  # hold the uint8 bytes (expert_conversions(packed=True)) instead of dense experts
        self.num_experts = num_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.routed_expert_hidden_size = routed_expert_hidden_size
        super().__init__(**kwargs)


class ProbeExperts(nn.Module):
    def __init__(self, config):
        super().__init__()
        n, i, d = config.num_experts, config.moe_intermediate_size, config.routed_expert_hidden_size
        if config.packed:
            u8 = dict(dtype=torch.uint8)
            self.gate_up_proj_blocks = nn.Parameter(torch.zeros(n, 2 * i, d // 2, **u8), requires_grad=False)
            self.gate_up_proj_scales = nn.Parameter(torch.zeros(n, 2 * i, d // 32, **u8), requires_grad=False)
            self.down_proj_blocks = nn.Parameter(torch.zeros(n, d, i // 2, **u8), requires_grad=False)
            self.down_proj_scales = nn.Parameter(torch.zeros(n, d, i // 32, **u8), requires_grad=False)
            self.probe_scale = nn.Parameter(torch.ones(d))  # save_pretrained needs one float parameter for `dtype`
        else:
            self.gate_up_proj = nn.Parameter(torch.zeros(n, 2 * i, d))
            self.down_proj = nn.Parameter(torch.zeros(n, d, i))


class ProbeMoe(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.experts = ProbeExperts(config)


class ProbeLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.block_sparse_moe = ProbeMoe(config)


class ProbeModel(PreTrainedModel):
    config_class = ProbeConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList([ProbeLayer(config)])
        self.post_init()

    def _init_weights(self, module):
        pass


@pytest.fixture(scope="module", autouse=True)
def _register():
    register_checkpoint_conversion_mapping("k3_mxfp4_probe", expert_conversions(quantized=True), overwrite=True)


def _released_checkpoint():
    g = torch.Generator().manual_seed(0)
    sd = {}
    for e in range(E):
        for name, shape in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            w = torch.randn(shape, generator=g) * 0.02
            packed, scale = quantize_mxfp4(w)
            sd[f"{PREFIX}{e}.{name}.weight_packed"] = packed
            sd[f"{PREFIX}{e}.{name}.weight_scale"] = scale
    return sd


def _write(tmp_path, sd, **config_kwargs):
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = ProbeConfig(**config_kwargs).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))


def _expected(sd, dtype):
    def deq(e, name):
        return dequantize_mxfp4(sd[f"{PREFIX}{e}.{name}.weight_packed"], sd[f"{PREFIX}{e}.{name}.weight_scale"], dtype)

    gate_up = torch.stack([torch.cat([deq(e, "w1"), deq(e, "w3")], dim=0) for e in range(E)])
    down = torch.stack([deq(e, "w2") for e in range(E)])
    return gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_and_save_roundtrip(tmp_path, dtype):
    sd = _released_checkpoint()
    src = tmp_path / "src"
    _write(src, sd)
    model, info = ProbeModel.from_pretrained(str(src), dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    experts = model.layers[0].block_sparse_moe.experts
    assert experts.gate_up_proj.dtype == dtype
    assert experts.gate_up_proj.shape == (E, 2 * I, D)
    assert experts.down_proj.shape == (E, D, I)
    gate_up, down = _expected(sd, dtype)
    assert torch.equal(experts.gate_up_proj.data, gate_up)
    assert torch.equal(experts.down_proj.data, down)

    dst = tmp_path / "dst"
    model.save_pretrained(str(dst))
    saved = load_file(str(dst / "model.safetensors"))
    assert set(saved) == set(sd)
    for k, v in sd.items():
        assert saved[k].dtype == torch.uint8, k
        assert torch.equal(saved[k], v), k


def test_ops_direct_reverse_is_inverse():
    g = torch.Generator().manual_seed(1)
    w1 = [quantize_mxfp4(torch.randn(I, D, generator=g)) for _ in range(E)]
    w3 = [quantize_mxfp4(torch.randn(I, D, generator=g)) for _ in range(E)]
    pats = [".experts.*.w1.weight_packed", ".experts.*.w1.weight_scale",
            ".experts.*.w3.weight_packed", ".experts.*.w3.weight_scale"]
    inputs = {pats[0]: [p for p, _ in w1], pats[1]: [s for _, s in w1],
              pats[2]: [p for p, _ in w3], pats[3]: [s for _, s in w3]}
    # the loader hands sources over cast to the param dtype: bytes survive a float cast
    cast = {k: [t.to(torch.float32) for t in v] for k, v in inputs.items()}
    op = Mxfp4DequantizeMergeExperts()
    fused = op.convert(cast, pats, [".experts.gate_up_proj"])[".experts.gate_up_proj"]
    assert fused.shape == (E, 2 * I, D) and fused.dtype == torch.bfloat16
    rev = op.reverse_op
    assert isinstance(rev, Mxfp4QuantizeSplitExperts)
    out = rev.convert({".experts.gate_up_proj": [fused]}, [".experts.gate_up_proj"], pats)
    for e in range(E):
        assert torch.equal(out[f".experts.{e}.w1.weight_packed"], w1[e][0])
        assert torch.equal(out[f".experts.{e}.w1.weight_scale"], w1[e][1])
        assert torch.equal(out[f".experts.{e}.w3.weight_packed"], w3[e][0])
        assert torch.equal(out[f".experts.{e}.w3.weight_scale"], w3[e][1])


def test_unquantized_conversions_load(tmp_path):
    register_checkpoint_conversion_mapping("k3_mxfp4_probe", expert_conversions(quantized=False), overwrite=True)
    try:
        g = torch.Generator().manual_seed(2)
        sd = {}
        for e in range(E):
            for name, shape in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
                sd[f"{PREFIX}{e}.{name}.weight"] = torch.randn(shape, generator=g)
        _write(tmp_path, sd)
        model, info = ProbeModel.from_pretrained(str(tmp_path), dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        ex = model.layers[0].block_sparse_moe.experts
        for e in range(E):
            assert torch.equal(ex.gate_up_proj[e, :I], sd[f"{PREFIX}{e}.w1.weight"])
            assert torch.equal(ex.gate_up_proj[e, I:], sd[f"{PREFIX}{e}.w3.weight"])
            assert torch.equal(ex.down_proj[e], sd[f"{PREFIX}{e}.w2.weight"])
        dst = tmp_path / "dst"
        model.save_pretrained(str(dst))
        saved = load_file(str(dst / "model.safetensors"))
        assert set(saved) == set(sd)
        for k, v in sd.items():
            assert torch.equal(saved[k], v), k
    finally:
        register_checkpoint_conversion_mapping("k3_mxfp4_probe", expert_conversions(quantized=True), overwrite=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_conversions_keep_the_bytes(tmp_path, dtype):
    """packed=True stacks the bytes as they are (any byte, even scales no quantiser would emit) and splits them
    back bit for bit; the model dtype does not touch uint8 parameters."""
    g = torch.Generator().manual_seed(3)
    sd = {}
    for e in range(E):
        for name, (rows, cols) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            sd[f"{PREFIX}{e}.{name}.weight_packed"] = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
            sd[f"{PREFIX}{e}.{name}.weight_scale"] = torch.randint(0, 256, (rows, cols // 32), dtype=torch.uint8, generator=g)
    sd[f"{PREFIX}probe_scale"] = torch.ones(D)
    _write(tmp_path / "src", sd, packed=True)
    register_checkpoint_conversion_mapping("k3_mxfp4_probe", expert_conversions(quantized=True, packed=True), overwrite=True)
    try:
        model, info = ProbeModel.from_pretrained(str(tmp_path / "src"), dtype=dtype, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        ex = model.layers[0].block_sparse_moe.experts
        for e in range(E):
            assert torch.equal(ex.gate_up_proj_blocks[e], torch.cat([sd[f"{PREFIX}{e}.w1.weight_packed"],
                                                                     sd[f"{PREFIX}{e}.w3.weight_packed"]]))
            assert torch.equal(ex.gate_up_proj_scales[e, I:], sd[f"{PREFIX}{e}.w3.weight_scale"])
            assert torch.equal(ex.down_proj_blocks[e], sd[f"{PREFIX}{e}.w2.weight_packed"])
            assert torch.equal(ex.down_proj_scales[e], sd[f"{PREFIX}{e}.w2.weight_scale"])
        assert all(p.dtype == torch.uint8 and not p.requires_grad for n, p in ex.named_parameters() if "proj" in n)
        model.save_pretrained(str(tmp_path / "dst"))
        saved = load_file(str(tmp_path / "dst" / "model.safetensors"))
        assert set(saved) == set(sd)
        for k, v in sd.items():
            if v.dtype == torch.uint8:
                assert saved[k].dtype == torch.uint8 and torch.equal(saved[k], v), k
    finally:
        register_checkpoint_conversion_mapping("k3_mxfp4_probe", expert_conversions(quantized=True), overwrite=True)
    with pytest.raises(ValueError, match="packed=True needs quantized=True"):
        expert_conversions(quantized=False, packed=True)
