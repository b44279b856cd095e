"""Released checkpoint layout <-> model layout, through transformers' weight-conversion machinery.

Every released name is the model's name except the routed experts, stored per expert in MXFP4
(`experts.{E}.w{1,3,2}.weight_packed/weight_scale`) and held in the model as 3-D tensors
(`experts.gate_up_proj [E, 2I, D]`, `experts.down_proj [E, D, I]`). The ops live in `k3_conversion`.
Whether experts are MXFP4 is read from `text_config.quantization_config` (never guessed from shapes).
"""

from transformers.conversion_mapping import register_checkpoint_conversion_mapping

from k3_conversion.mxfp4_experts import expert_conversions

MXFP4_FORMAT = "mxfp4-pack-quantized"


def experts_are_mxfp4(text_config) -> bool:
    qc = getattr(text_config, "checkpoint_quantization_config", None)
    if qc is None:
        return False
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    fmt = qc.get("format")
    if fmt != MXFP4_FORMAT:
        raise ValueError(f"text_config.quantization_config.format {fmt!r} is not supported (only {MXFP4_FORMAT!r})")
    return True


def register_conversions() -> None:
    # Keyed by the text model type only: transformers applies it to `KimiK3ForCausalLM` alone and, scoped to
    # `language_model.`, inside the container (registering the container too would apply it twice).
    # Models whose config has no MXFP4 block save their experts unconverted (`KimiK3PreTrainedModel.save_pretrained`).
    register_checkpoint_conversion_mapping("kimi_k3_text", expert_conversions(quantized=True), overwrite=True)
