"""Released checkpoint layout <-> model layout, through transformers' weight-conversion machinery.

Every released name is the model's name except the routed experts, stored per expert in MXFP4
(`experts.{E}.w{1,3,2}.weight_packed/weight_scale`) and held in the model as 3-D tensors
(`experts.gate_up_proj [E, 2I, D]`, `experts.down_proj [E, D, I]`). The ops live in `k3_conversion`.
Whether experts are MXFP4 is read from `text_config.quantization_config` (never guessed from shapes).
"""

import contextlib
import threading

from transformers.conversion_mapping import register_checkpoint_conversion_mapping

from k3_conversion.mxfp4_experts import expert_conversions

MXFP4_FORMAT = "mxfp4-pack-quantized"
_TEXT_MODEL_TYPE = "kimi_k3_text"
_packed_lock = threading.RLock()


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
    register_checkpoint_conversion_mapping(_TEXT_MODEL_TYPE, expert_conversions(quantized=True), overwrite=True)


@contextlib.contextmanager
def packed_expert_conversions(active: bool = True):
    """Within the block the MXFP4 experts load and save as their packed bytes (no dequantisation); a no-op when
    `active` is False.

    transformers looks conversions up by model type, not per model instance, so a model that keeps its experts
    packed (`from_pretrained(..., keep_experts_packed=True)`) swaps the registered mapping for the duration of its
    load or save; the lock keeps two such loads in different threads from restoring each other's mapping early.
    """
    if not active:
        yield
        return
    with _packed_lock:
        register_checkpoint_conversion_mapping(
            _TEXT_MODEL_TYPE, expert_conversions(quantized=True, packed=True), overwrite=True
        )
        try:
            yield
        finally:
            register_conversions()
