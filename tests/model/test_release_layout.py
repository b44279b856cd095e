"""Faithfulness to the release: the published config, the weight count, the layout round trip, bad inputs."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from transformers_k3 import KimiK3Config, KimiK3ConfigError, KimiK3ForConditionalGeneration
from transformers_k3.tiny import released_config_dict, tiny_config

RELEASED_LM_WEIGHTS = 2_779_484_478_208


def test_released_config_loads_as_published(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(released_config_dict()))
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, KimiK3Config)
    t = config.text_config
    assert t.layer_types.count("linear_attention") == 69 and t.layer_types.count("full_attention") == 24
    assert [i for i, x in enumerate(t.layer_types) if x == "full_attention"][-2:] == [91, 92]
    assert t.checkpoint_quantization_config["format"] == "mxfp4-pack-quantized"
    config.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["text_config"]["model_type"] == "kimi_linear"
    assert saved["text_config"]["quantization_config"] == released_config_dict()["text_config"]["quantization_config"]
    assert saved["text_config"]["linear_attn_config"] == released_config_dict()["text_config"]["linear_attn_config"]


def test_released_config_builds_on_meta_with_the_released_weight_count():
    config = KimiK3Config(**released_config_dict())
    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(config)
    lm = model.language_model
    count = sum(t.numel() for t in lm.state_dict().values())
    assert count == RELEASED_LM_WEIGHTS
    assert lm.model.layers[0].self_attn.A_log.shape == (128,)
    assert lm.model.layers[1].block_sparse_moe.experts.gate_up_proj.shape == (896, 6144, 3584)


def _same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_released_layout_round_trips_bit_for_bit(tmp_path, dtype):
    from transformers_k3.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path / "a", dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert isinstance(model, KimiK3ForConditionalGeneration)
    model.save_pretrained(tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(_same_bytes(a[k], b[k]) for k in a)
    # the released names and dtypes
    assert a["language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight_packed"].dtype == torch.uint8
    assert a["language_model.model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert any(k.startswith("vision_tower.") for k in a) and any(k.startswith("mm_projector.") for k in a)


def test_trained_experts_are_saved_unquantised(tmp_path, tiny_dir, caplog):
    """Experts changed since loading (a fine-tune) no longer hold MXFP4 values: "auto" saves them unquantised and
    says so, so the saved model is the trained one (and a resumed Trainer run the uninterrupted one); "mxfp4"
    re-packs them on request."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    experts = model.language_model.model.layers[1].block_sparse_moe.experts
    assert experts.holds_mxfp4_values()  # as loaded
    with torch.no_grad():
        experts.down_proj[2, 0, 0] += 1e-3
    assert not experts.holds_mxfp4_values()
    with caplog.at_level("WARNING"):
        model.save_pretrained(tmp_path / "auto")
    assert "no longer hold MXFP4 values" in caplog.text
    raw = load_file(tmp_path / "auto" / "model.safetensors")
    assert not any(k.endswith("weight_packed") for k in raw)
    assert "quantization_config" not in json.dumps(json.load(open(tmp_path / "auto" / "config.json")))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "auto", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert model.config.text_config.checkpoint_quantization_config is not None  # the model's own config unchanged

    model.save_pretrained(tmp_path / "mxfp4", experts_format="mxfp4")
    raw = load_file(tmp_path / "mxfp4" / "model.safetensors")
    assert any(k.endswith("weight_packed") for k in raw)
    with pytest.raises(ValueError, match="experts_format"):
        model.save_pretrained(tmp_path / "bad", experts_format="fp8")


def test_resize_token_embeddings_on_the_container(tmp_path, tiny_dir):
    """Adding tokens for a fine-tune: both tables grow, the text config follows, and the resized model saves and
    loads back to the same logits."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    n = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(n + 7)
    assert model.get_input_embeddings().weight.shape[0] == model.get_output_embeddings().weight.shape[0] == n + 7
    assert model.config.text_config.vocab_size == n + 7
    ids = torch.tensor([[n + 3, 1, 2, n + 6]])
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_causal_lm_alone_from_the_container(tiny_dir, tiny_model, tmp_path):
    """KimiK3ForCausalLM.from_pretrained on the released layout gives the container's language model (the same
    logits), saves text-only and reloads; a checkpoint missing a tensor still fails loudly."""
    from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig

    lm = KimiK3ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    assert type(lm) is KimiK3ForCausalLM and isinstance(lm.config, KimiK3TextConfig)
    assert lm.generation_config.eos_token_id == tiny_model.generation_config.eos_token_id
    ids = torch.randint(0, 500, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = tiny_model(input_ids=ids).logits
        assert torch.equal(lm(input_ids=ids).logits, expected)
    lm.save_pretrained(tmp_path / "text_only")
    again = KimiK3ForCausalLM.from_pretrained(tmp_path / "text_only", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, expected)
    _tamper(tiny_dir, tmp_path / "broken", lambda t: t.pop("language_model.model.layers.0.self_attn.q_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors.*layers\.0\.self_attn\.q_proj"):
        KimiK3ForCausalLM.from_pretrained(tmp_path / "broken")


def test_unquantized_config_saves_experts_unconverted(tmp_path):
    config = tiny_config()
    config.text_config.checkpoint_quantization_config = None
    torch.manual_seed(0)
    model = KimiK3ForConditionalGeneration(config)
    model.save_pretrained(tmp_path)
    raw = load_file(tmp_path / "model.safetensors")
    key = "language_model.model.layers.1.block_sparse_moe.experts.gate_up_proj"
    assert key in raw and not any("weight_packed" in k for k in raw)
    assert torch.equal(raw[key], model.language_model.model.layers[1].block_sparse_moe.experts.gate_up_proj)
    again = KimiK3ForConditionalGeneration.from_pretrained(tmp_path)
    assert torch.equal(again.language_model.model.layers[1].block_sparse_moe.experts.down_proj,
                       model.language_model.model.layers[1].block_sparse_moe.experts.down_proj)


def test_precision_contract_after_bf16_load(tiny_dir):
    model = KimiK3ForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    kda = model.language_model.model.layers[0].self_attn
    moe = model.language_model.model.layers[1].block_sparse_moe
    for t in (kda.A_log, kda.dt_bias, kda.q_conv1d.weight, kda.k_conv1d.weight, kda.v_conv1d.weight,
              kda.o_norm.weight, moe.gate.e_score_correction_bias):
        assert t.dtype == torch.float32
    assert kda.q_proj.weight.dtype == torch.bfloat16
    out = model(input_ids=torch.randint(0, 500, (1, 6)), use_cache=True)
    cache = out.get("cache", out.get("past_key_values"))
    assert all(s.dtype == torch.float32 for s in cache.recurrent_states.values())


def test_precision_contract_survives_to_bf16(tiny_dir):
    model = KimiK3ForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32)
    kda = model.language_model.model.layers[0].self_attn
    a_log, conv = kda.A_log.detach().clone(), kda.q_conv1d.weight.detach().clone()
    model.to(torch.bfloat16)
    assert kda.q_proj.weight.dtype == torch.bfloat16
    assert kda.A_log.dtype == torch.float32 and torch.equal(kda.A_log, a_log)
    assert kda.q_conv1d.weight.dtype == torch.float32 and torch.equal(kda.q_conv1d.weight, conv)
    assert model.language_model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.dtype == torch.float32
    model.half()
    assert kda.dt_bias.dtype == torch.float32 and kda.o_norm.weight.dtype == torch.float32


def test_mxfp4_experts_dequantised_on_load(tiny_dir, tiny_model):
    from k3_kernels.mxfp4.reference import dequantize_mxfp4

    raw = load_file(tiny_dir / "model.safetensors")
    p = "language_model.model.layers.2.block_sparse_moe.experts.5."
    w1 = dequantize_mxfp4(raw[p + "w1.weight_packed"], raw[p + "w1.weight_scale"], torch.float32)
    w3 = dequantize_mxfp4(raw[p + "w3.weight_packed"], raw[p + "w3.weight_scale"], torch.float32)
    w2 = dequantize_mxfp4(raw[p + "w2.weight_packed"], raw[p + "w2.weight_scale"], torch.float32)
    experts = tiny_model.language_model.model.layers[2].block_sparse_moe.experts
    assert torch.equal(experts.gate_up_proj[5], torch.cat([w1, w3]))
    assert torch.equal(experts.down_proj[5], w2)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("hidden_act", "gelu", "hidden_act"),
        ("moe_router_activation_func", "softmax", "moe_router_activation_func"),
        ("attn_res_block_size", 0, "attn_res_block_size"),
        ("num_experts_per_token", 64, "num_experts_per_token"),
        ("mla_use_nope", False, "mla_use_nope"),
    ],
)
def test_bad_config_fields_name_the_field(field, value, match):
    with pytest.raises(KimiK3ConfigError, match=match):
        tiny_config(**{field: value})


@pytest.mark.parametrize(
    "kda, full, match",
    [([1, 2, 3, 4], [4, 5, 6, 7, 8], "overlaps"), ([1, 2, 3], [4, 8], "misses"), ([0, 1, 2], [4, 8], "1-indexed")],
    ids=["overlap", "missing", "zero-index"],
)
def test_bad_layer_lists(kda, full, match):
    d = tiny_config().to_dict()["text_config"]
    d["linear_attn_config"] = dict(d["linear_attn_config"], kda_layers=kda, full_attn_layers=full)
    with pytest.raises(KimiK3ConfigError, match=match):
        KimiK3Config(text_config=d)


def _tamper(src, dst, fn):
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    fn(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    name = "language_model.model.layers.3.self_attn.kv_b_proj.weight"
    _tamper(tiny_dir, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"missing tensors.*layers\.3\.self_attn\.kv_b_proj"):
        KimiK3ForConditionalGeneration.from_pretrained(tmp_path / "m")
    # strict=False is the transformers behaviour: load, report
    _, info = KimiK3ForConditionalGeneration.from_pretrained(tmp_path / "m", strict=False, output_loading_info=True)
    assert name in info["missing_keys"]


def test_wrong_shape_is_named(tiny_dir, tmp_path):
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    _tamper(tiny_dir, tmp_path / "s", lambda t: t.__setitem__(name, t[name][:-1].clone()))
    with pytest.raises(ValueError, match=r"wrong shape.*layers\.0\.self_attn\.q_proj"):
        KimiK3ForConditionalGeneration.from_pretrained(tmp_path / "s")


def test_corrupt_shard_is_named(tiny_dir, tmp_path):
    import shutil

    shutil.copytree(tiny_dir, tmp_path / "c")
    shard = tmp_path / "c" / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(Exception, match="safetensors|model.safetensors|header|incomplete|deserializ"):
        KimiK3ForConditionalGeneration.from_pretrained(tmp_path / "c")
