"""Configuration of Kimi K3, read from the released `config.json` exactly as published.

The release nests the language model under `text_config` (whose own `model_type` says `kimi_linear`, a
leftover of the predecessor's code) and the vision encoder under `vision_config`. The layer pattern comes
from the 1-indexed `linear_attn_config.kda_layers` / `full_attn_layers`; it is parsed in one place
(`_derive_layer_types`) into `layer_types` with the standard transformers names.
"""

from __future__ import annotations

import copy

from transformers import PretrainedConfig

# The names transformers' cache and mask code understand (an unknown name breaks both).
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"

SUPPORTED_HIDDEN_ACTS = ("situ",)
SUPPORTED_ROUTER_ACTS = ("sigmoid",)
SUPPORTED_TOPK_METHODS = ("noaux_tc",)
SUPPORTED_BALANCING = ("none", "quantile", "sign")  # see transformers_k3.balancing
KDA_BACKENDS = ("auto", "torch", "triton", "fla")

_DEFAULT_LINEAR_ATTN = {
    "kda_layers": [1, 2, 3],
    "full_attn_layers": [4],
    "gate_lower_bound": -5.0,
    "head_dim": 128,
    "num_heads": 96,
    "short_conv_kernel_size": 4,
    "use_full_rank_gate": True,
}


class KimiK3ConfigError(ValueError):
    """A config field holds a value K3 cannot run with. The message names the field."""


def _field_error(field: str, message: str) -> KimiK3ConfigError:
    return KimiK3ConfigError(f"KimiK3 config field `{field}`: {message}")


class KimiK3TextConfig(PretrainedConfig):
    r"""The K3 language model (`text_config` of the release).

    Non-standard fields:
        linear_attn_config (`dict`): KDA settings: `kda_layers` / `full_attn_layers` (1-indexed layer lists that
            together cover every layer once), `num_heads`, `head_dim`, `short_conv_kernel_size`,
            `gate_lower_bound` (the K3 bounded gate `g = lower_bound * sigmoid(exp(A) * (z + dt_bias))`),
            `use_full_rank_gate` (output gate d -> H*V).
        attn_res_block_size (`int`): layers per Block Attention Residuals block (a snapshot every that many).
        activation_situ_beta / activation_situ_linear_beta (`float`): SiTU-GLU bounds b1 and b2.
        routed_expert_hidden_size (`int`): width of the latent the routed experts work in.
        latent_moe_use_norm (`bool`): RMSNorm on the mixed latent before the up-projection.
        mla_use_nope / mla_use_output_gate (`bool`): K3 uses NoPE MLA with an output gate; both must be true.
        mla_latent_norm_eps (`float`): eps of the MLA latent norms (1e-6 in the reference code; uncertain).
        moe_balancing (`str`): router-bias update during training (`transformers_k3.balancing`): "none" (the
            release), "quantile" (Quantile Balancing, SPEC 5) or "sign" (DeepSeek-V3 sign step). The update runs
            in `MoEBalancingCallback` / `update_moe_balancing`; the bias is frozen at inference.
        moe_balancing_bins (`int`, 256): histogram bins of the Quantile Balancing estimate.
        moe_bias_update_speed (`float`, 1e-3): step size of the "sign" update.
        kda_backend (`str`): "auto" (Triton on CUDA when present, else torch), "torch", "triton" or "fla".
        mla_page_size (`int`): tokens per page of the paged latent cache.
    """

    model_type = "kimi_k3_text"
    base_config_key = "text_config"
    # The release writes `kimi_linear` as the text model type; `KimiK3Config.to_dict` writes it back.
    released_model_type = "kimi_linear"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "num_local_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_token",
        "n_routed_experts": "num_experts",
        "n_shared_experts": "num_shared_experts",
    }

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 7168,
        intermediate_size: int = 33792,
        moe_intermediate_size: int = 3072,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 96,
        num_key_value_heads: int | None = None,
        hidden_act: str = "situ",
        activation_situ_beta: float = 4.0,
        activation_situ_linear_beta: float = 25.0,
        max_position_embeddings: int = 1048576,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-5,
        mla_latent_norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int | None = 163839,
        bos_token_id: int | None = 163584,
        eos_token_id: int | list[int] | None = 163586,
        tie_word_embeddings: bool = False,
        q_lora_rank: int | None = 1536,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = True,
        linear_attn_config: dict | None = None,
        attn_res_block_size: int = 12,
        num_experts: int = 896,
        num_experts_per_token: int = 16,
        num_shared_experts: int = 2,
        routed_expert_hidden_size: int = 3584,
        latent_moe_use_norm: bool = True,
        first_k_dense_replace: int = 1,
        moe_layer_freq: int = 1,
        moe_renormalize: bool = True,
        moe_router_activation_func: str = "sigmoid",
        routed_scaling_factor: float = 1.0,
        num_expert_group: int = 1,
        topk_group: int = 1,
        topk_method: str = "noaux_tc",
        use_grouped_topk: bool = True,
        num_nextn_predict_layers: int = 0,
        moe_balancing: str = "none",
        moe_balancing_bins: int = 256,
        moe_bias_update_speed: float = 1e-3,
        kda_backend: str = "auto",
        mla_page_size: int = 64,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.mla_latent_norm_eps = mla_latent_norm_eps
        self.use_cache = use_cache
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.head_dim = self.qk_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        self.linear_attn_config = {**_DEFAULT_LINEAR_ATTN, **copy.deepcopy(linear_attn_config or {})}
        if linear_attn_config is None and num_hidden_layers != 4:
            # A config built in code with only a layer count: the K3 pattern (3 KDA, 1 MLA, last layer MLA).
            kda = [i + 1 for i in range(num_hidden_layers) if (i % 4 != 3 and i != num_hidden_layers - 1)]
            self.linear_attn_config["kda_layers"] = kda
            self.linear_attn_config["full_attn_layers"] = [
                i + 1 for i in range(num_hidden_layers) if i + 1 not in kda
            ]
        self.attn_res_block_size = attn_res_block_size
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.moe_renormalize = moe_renormalize
        self.moe_router_activation_func = moe_router_activation_func
        self.routed_scaling_factor = routed_scaling_factor
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.topk_method = topk_method
        self.use_grouped_topk = use_grouped_topk
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.moe_balancing = moe_balancing
        self.moe_balancing_bins = moe_balancing_bins
        self.moe_bias_update_speed = moe_bias_update_speed
        self.kda_backend = kda_backend
        self.mla_page_size = mla_page_size
        # Standard transformers names: `layer_types` drives the cache and masks, `mlp_layer_types` the FFN kind.
        self.layer_types = self._derive_layer_types()
        self.mlp_layer_types = [
            "dense" if (i < first_k_dense_replace or i % max(moe_layer_freq, 1) != 0) else "sparse"
            for i in range(num_hidden_layers)
        ]
        kwargs.pop("layer_types", None)
        kwargs.pop("mlp_layer_types", None)
        # The release's compressed-tensors block (MXFP4 routed experts). It is kept under another name so that
        # transformers does not route loading to its compressed-tensors quantizer: the experts are unpacked by
        # our own weight conversion (`transformers_k3.conversion`). `to_dict` writes it back as published.
        self.checkpoint_quantization_config = kwargs.pop("quantization_config", None)
        self.checkpoint_quantization_config = kwargs.pop(
            "checkpoint_quantization_config", self.checkpoint_quantization_config
        )
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_k3()

    # KDA accessors used by the model (the release keeps them inside `linear_attn_config`).
    @property
    def linear_num_heads(self) -> int:
        return int(self.linear_attn_config["num_heads"])

    @property
    def linear_head_dim(self) -> int:
        return int(self.linear_attn_config["head_dim"])

    @property
    def linear_conv_kernel_size(self) -> int:
        return int(self.linear_attn_config["short_conv_kernel_size"])

    @property
    def gate_lower_bound(self) -> float:
        return float(self.linear_attn_config["gate_lower_bound"])

    def _derive_layer_types(self) -> list[str]:
        lac = self.linear_attn_config
        n = self.num_hidden_layers
        kda, full = lac.get("kda_layers"), lac.get("full_attn_layers")
        if not isinstance(kda, (list, tuple)) or not isinstance(full, (list, tuple)):
            raise _field_error("linear_attn_config.kda_layers/full_attn_layers", "both must be lists of layer numbers")
        for name, layers in (("kda_layers", kda), ("full_attn_layers", full)):
            bad = [i for i in layers if not isinstance(i, int) or not 1 <= i <= n]
            if bad:
                raise _field_error(
                    f"linear_attn_config.{name}", f"entries are 1-indexed layer numbers in 1..{n}, got {bad}"
                )
            if len(set(layers)) != len(layers):
                raise _field_error(f"linear_attn_config.{name}", "has repeated layers")
        overlap = sorted(set(kda) & set(full))
        if overlap:
            raise _field_error("linear_attn_config.kda_layers", f"overlaps full_attn_layers at {overlap}")
        missing = sorted(set(range(1, n + 1)) - set(kda) - set(full))
        if missing:
            raise _field_error(
                "linear_attn_config.kda_layers", f"with full_attn_layers misses layers {missing} (1-indexed)"
            )
        return [LINEAR_ATTENTION if (i + 1) in kda else FULL_ATTENTION for i in range(n)]

    def validate_k3(self) -> None:
        def positive(field, value):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise _field_error(field, f"must be a positive integer, got {value!r}")

        if self.hidden_act not in SUPPORTED_HIDDEN_ACTS:
            raise _field_error("hidden_act", f"must be one of {SUPPORTED_HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.moe_router_activation_func not in SUPPORTED_ROUTER_ACTS:
            raise _field_error(
                "moe_router_activation_func",
                f"must be one of {SUPPORTED_ROUTER_ACTS}, got {self.moe_router_activation_func!r}",
            )
        if self.topk_method not in SUPPORTED_TOPK_METHODS:
            raise _field_error("topk_method", f"must be one of {SUPPORTED_TOPK_METHODS}, got {self.topk_method!r}")
        if self.num_expert_group != 1 or self.topk_group != 1:
            raise _field_error("num_expert_group", "K3 routes over one group; grouped routing is not supported")
        for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                      "qk_nope_head_dim", "v_head_dim", "attn_res_block_size", "num_experts",
                      "num_experts_per_token", "routed_expert_hidden_size", "moe_intermediate_size",
                      "intermediate_size", "vocab_size", "mla_page_size"):
            positive(field, getattr(self, field))
        if self.qk_rope_head_dim < 0:
            raise _field_error("qk_rope_head_dim", f"must be >= 0, got {self.qk_rope_head_dim}")
        for field in ("num_heads", "head_dim", "short_conv_kernel_size"):
            positive(f"linear_attn_config.{field}", self.linear_attn_config.get(field))
        if not self.gate_lower_bound < 0:
            raise _field_error("linear_attn_config.gate_lower_bound", f"must be negative, got {self.gate_lower_bound}")
        if not self.linear_attn_config.get("use_full_rank_gate", True):
            raise _field_error("linear_attn_config.use_full_rank_gate", "K3 uses a full-rank output gate")
        if not self.mla_use_nope:
            raise _field_error("mla_use_nope", "K3's MLA has no rotary embedding; only NoPE is supported")
        if not self.mla_use_output_gate:
            raise _field_error("mla_use_output_gate", "K3's MLA is gated; the ungated form is not supported")
        if self.num_experts_per_token > self.num_experts:
            raise _field_error(
                "num_experts_per_token", f"({self.num_experts_per_token}) exceeds num_experts ({self.num_experts})"
            )
        if self.num_nextn_predict_layers:
            raise _field_error("num_nextn_predict_layers", "multi-token prediction layers are not supported")
        if self.q_lora_rank is not None:
            positive("q_lora_rank", self.q_lora_rank)
        if self.moe_balancing not in SUPPORTED_BALANCING:
            raise _field_error("moe_balancing", f"must be one of {SUPPORTED_BALANCING}, got {self.moe_balancing!r}")
        positive("moe_balancing_bins", self.moe_balancing_bins)
        speed = self.moe_bias_update_speed
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed < float("inf"):
            raise _field_error("moe_bias_update_speed", f"must be a positive finite number, got {speed!r}")
        if self.moe_balancing != "none" and self.num_experts_per_token >= self.num_experts:
            raise _field_error("moe_balancing", "needs num_experts_per_token < num_experts (a (k+1)-th expert)")
        if self.kda_backend not in KDA_BACKENDS:
            raise _field_error("kda_backend", f"must be one of {KDA_BACKENDS}, got {self.kda_backend!r}")
        if self.first_k_dense_replace < 0:
            raise _field_error("first_k_dense_replace", "must be >= 0")
        positive("moe_layer_freq", self.moe_layer_freq)
        if self.routed_expert_hidden_size % 32 or self.moe_intermediate_size % 32:
            # MXFP4 scales cover 32 inputs; the expert input dims must be whole groups.
            raise _field_error("routed_expert_hidden_size", "and moe_intermediate_size must be multiples of 32")

    def to_dict(self):
        out = super().to_dict()
        out["model_type"] = self.model_type
        for derived in ("layer_types", "mlp_layer_types", "qk_head_dim", "head_dim"):
            out.pop(derived, None)
        qc = out.pop("checkpoint_quantization_config", None)
        if qc is not None:
            out["quantization_config"] = qc
        return out


class KimiK3VisionConfig(PretrainedConfig):
    r"""MoonViT-V2 settings (SPEC 6), kept with the released field names.

    Fields the model reads: `patch_size`, `init_pos_emb_height` / `init_pos_emb_width` (the learnable position
    table `[height, width, vt_hidden_size]`, resized to each image's patch grid with `pos_emb_interpolation_mode`),
    `vt_hidden_size`, `vt_intermediate_size`, `vt_num_attention_heads`, `vt_num_hidden_layers`, `qkv_hidden_size`
    (heads * head dim of `wqkv`), `mm_hidden_size` (tower width seen by the projector), `text_hidden_size`,
    `merge_kernel_size` (the 2x2 patch merge), `projector_ln_eps` (the projector's `post_norm`),
    `activation_func` (tower MLP), `projector_hidden_act`.

    Not in the release, documented guesses:
        vt_norm_eps (`float`, 1e-6): eps of the tower's RMSNorms (`norm0`, `norm1`, `final_layernorm`); the
            release names no eps for them.
        vt_rope_theta (`float`, 10000.0): base of the 2-D rotary inside the tower (MoonViT's reference value).

    Released fields that only have one supported value (anything else raises, naming the field): `norm_type`
    "rmsnorm", `attn_bias` / `linear_bias` / `patch_embed_proj_bias` false, `merge_type` "sd2_tpool",
    `mm_projector_type` "patchmergerv2", `mlp_type` "mlp2", `pos_emb_type` "divided_fixed" (its fixed temporal
    part, `init_pos_emb_time`, only matters for video, which is not supported: images have t = 1).
    """

    model_type = "kimi_k3_vision"
    base_config_key = "vision_config"
    _only_supported = {
        "norm_type": "rmsnorm", "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
        "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "mlp_type": "mlp2",
        "pos_emb_type": "divided_fixed",
    }

    def __init__(
        self,
        patch_size: int = 14,
        init_pos_emb_height: int = 64,
        init_pos_emb_width: int = 64,
        init_pos_emb_time: int = 4,
        vt_hidden_size: int = 1024,
        vt_intermediate_size: int = 4096,
        vt_num_attention_heads: int = 12,
        vt_num_hidden_layers: int = 27,
        qkv_hidden_size: int = 1536,
        mm_hidden_size: int = 1024,
        text_hidden_size: int = 7168,
        merge_kernel_size=(2, 2),
        projector_ln_eps: float = 1e-5,
        activation_func: str = "gelu_pytorch_tanh",
        projector_hidden_act: str = "gelu",
        pos_emb_interpolation_mode: str = "bilinear",
        norm_type: str = "rmsnorm",
        attn_bias: bool = False,
        linear_bias: bool = False,
        patch_embed_proj_bias: bool = False,
        merge_type: str = "sd2_tpool",
        mm_projector_type: str = "patchmergerv2",
        mlp_type: str = "mlp2",
        pos_emb_type: str = "divided_fixed",
        vt_norm_eps: float = 1e-6,
        vt_rope_theta: float = 10000.0,
        **kwargs,
    ):
        self.patch_size = patch_size
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.init_pos_emb_time = init_pos_emb_time
        self.vt_hidden_size = vt_hidden_size
        self.vt_intermediate_size = vt_intermediate_size
        self.vt_num_attention_heads = vt_num_attention_heads
        self.vt_num_hidden_layers = vt_num_hidden_layers
        self.qkv_hidden_size = qkv_hidden_size
        self.mm_hidden_size = mm_hidden_size
        self.text_hidden_size = text_hidden_size
        self.merge_kernel_size = list(merge_kernel_size)
        self.projector_ln_eps = projector_ln_eps
        self.activation_func = activation_func
        self.projector_hidden_act = projector_hidden_act
        self.pos_emb_interpolation_mode = pos_emb_interpolation_mode
        self.norm_type = norm_type
        self.attn_bias = attn_bias
        self.linear_bias = linear_bias
        self.patch_embed_proj_bias = patch_embed_proj_bias
        self.merge_type = merge_type
        self.mm_projector_type = mm_projector_type
        self.mlp_type = mlp_type
        self.pos_emb_type = pos_emb_type
        self.vt_norm_eps = vt_norm_eps
        self.vt_rope_theta = vt_rope_theta
        # The release asks for flash_attention_2 here; the language model's choice is independent.
        released_attn = kwargs.pop("_attn_implementation", None)
        super().__init__(**kwargs)
        self.released_attn_implementation = released_attn
        self.validate_k3()

    @property
    def vt_head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    def validate_k3(self) -> None:
        for field, value in self._only_supported.items():
            if getattr(self, field) != value:
                raise _field_error(f"vision_config.{field}", f"only {value!r} is supported, got {getattr(self, field)!r}")
        for field in ("patch_size", "init_pos_emb_height", "init_pos_emb_width", "vt_hidden_size",
                      "vt_intermediate_size", "vt_num_attention_heads", "vt_num_hidden_layers", "qkv_hidden_size",
                      "mm_hidden_size", "text_hidden_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise _field_error(f"vision_config.{field}", f"must be a positive integer, got {value!r}")
        if self.qkv_hidden_size % self.vt_num_attention_heads or self.vt_head_dim % 4:
            # The 2-D rotary turns head_dim / 4 pairs by the row and as many by the column.
            raise _field_error(
                "vision_config.qkv_hidden_size",
                f"({self.qkv_hidden_size}) / vt_num_attention_heads ({self.vt_num_attention_heads}) must be a "
                "whole head dim divisible by 4",
            )
        if self.mm_hidden_size != self.vt_hidden_size:
            raise _field_error("vision_config.mm_hidden_size", "must equal vt_hidden_size (the projector reads the tower)")
        if len(self.merge_kernel_size) != 2 or any(int(k) <= 0 for k in self.merge_kernel_size):
            raise _field_error("vision_config.merge_kernel_size", f"must be two positive ints, got {self.merge_kernel_size}")
        if self.pos_emb_interpolation_mode not in ("bilinear", "bicubic"):
            raise _field_error(
                "vision_config.pos_emb_interpolation_mode",
                f"must be 'bilinear' or 'bicubic', got {self.pos_emb_interpolation_mode!r}",
            )


class KimiK3Config(PretrainedConfig):
    """The released container config: `text_config`, `vision_config` and the multimodal token ids."""

    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiK3TextConfig, "vision_config": KimiK3VisionConfig}

    def __init__(
        self,
        text_config: dict | KimiK3TextConfig | None = None,
        vision_config: dict | KimiK3VisionConfig | None = None,
        media_placeholder_token_id: int = 163605,
        image_placeholder: str = "<|kimi_image_placeholder|>",
        ignore_index: int = -100,
        pad_token_id: int | None = 163839,
        bos_token_id: int | None = 163584,
        eos_token_id: int | None = 163586,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        if isinstance(text_config, dict):
            text_config = dict(text_config)
            text_config.pop("model_type", None)
            text_config = KimiK3TextConfig(**text_config)
        elif text_config is None:
            text_config = KimiK3TextConfig()
        if isinstance(vision_config, dict):
            vision_config = dict(vision_config)
            vision_config.pop("model_type", None)
            vision_config = KimiK3VisionConfig(**vision_config)
        elif vision_config is None:
            vision_config = KimiK3VisionConfig()
        self.text_config = text_config
        self.vision_config = vision_config
        self.media_placeholder_token_id = media_placeholder_token_id
        self.image_placeholder = image_placeholder
        self.ignore_index = ignore_index
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def to_dict(self):
        out = super().to_dict()
        out["text_config"] = self.text_config.to_dict()
        out["text_config"]["model_type"] = KimiK3TextConfig.released_model_type
        vision = self.vision_config.to_dict()
        vision.pop("model_type", None)
        released_attn = vision.pop("released_attn_implementation", None)
        if released_attn is not None:
            vision["_attn_implementation"] = released_attn
        out["vision_config"] = vision
        return out


__all__ = ["KimiK3Config", "KimiK3TextConfig", "KimiK3VisionConfig", "KimiK3ConfigError"]
