"""Kimi K3, the whole forward pass, in the order of the report (SPEC sections 2-5).

Norms and SiTU-GLU; Kimi Delta Attention; gated NoPE MLA; Block Attention Residuals; Stable LatentMoE; the
decoder layer; the model; the heads. The torch references in `k3_kernels` are the default path; faster
backends are chosen in `k3_kernels.dispatch`, never here.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.integrations import use_experts_implementation
from transformers.integrations.moe import ExpertsInterface
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.utils import logging

from k3_kernels import dispatch
from k3_kernels.kda.reference import kda_gate
from k3_kernels.mla.reference import mla_absorbed_attention
from k3_kernels.situ.reference import situ_glu

from . import context_parallel
from .cache_kimi_k3 import KimiK3Cache
from .cuda_graph import DecodeGraph
from .conversion import experts_are_mxfp4, packed_expert_conversions
from .configuration_kimi_k3 import FULL_ATTENTION, KimiK3Config, KimiK3TextConfig

logger = logging.get_logger(__name__)

# transformers renamed the cache keyword from `past_key_values` to `cache` (5.2x); speak whichever it speaks.
CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)


def _pop_cache(kwargs: dict, cache=None, past_key_values=None):
    found = cache if cache is not None else past_key_values
    for key in ("cache", "past_key_values"):
        value = kwargs.pop(key, None)
        if found is None:
            found = value
    return found


class KimiK3RMSNorm(nn.Module):
    """RMSNorm computed in fp32; the weight keeps the dtype it was loaded in."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if x.is_cuda:
            # The same fp32 maths in torch's fused CUDA kernel: one launch instead of six elementwise ones, which a
            # B = 1 decode step, bound by small launches, pays at every norm (BENCHMARKS.md, twenty-fourth session).
            return torch.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.variance_epsilon).to(dtype)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * x).to(dtype)


class KimiK3MLP(nn.Module):
    """SiTU-GLU MLP: the dense layer-0 MLP and the shared experts."""

    def __init__(self, config: KimiK3TextConfig, intermediate_size: int):
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = situ_glu(
            self.gate_proj(x), self.up_proj(x),
            self.config.activation_situ_beta, self.config.activation_situ_linear_beta,
        )
        return self.down_proj(hidden)


# ----------------------------------------------------------------------------------------------------------
# Kimi Delta Attention (SPEC 2)
# ----------------------------------------------------------------------------------------------------------


class KimiK3DeltaAttention(nn.Module):
    """KDA with the lower-bounded gate, short convs, L2-normed q/k, full-rank output gate and gated head norm."""

    def __init__(self, config: KimiK3TextConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        self.conv_size = config.linear_conv_kernel_size
        self.lower_bound = config.gate_lower_bound
        d, inner = config.hidden_size, self.num_heads * self.head_dim
        self.q_proj = nn.Linear(d, inner, bias=False)
        self.k_proj = nn.Linear(d, inner, bias=False)
        self.v_proj = nn.Linear(d, inner, bias=False)
        conv = dict(kernel_size=self.conv_size, groups=inner, bias=False, dtype=torch.float32)
        self.q_conv1d = nn.Conv1d(inner, inner, **conv)
        self.k_conv1d = nn.Conv1d(inner, inner, **conv)
        self.v_conv1d = nn.Conv1d(inner, inner, **conv)
        self.f_a_proj = nn.Linear(d, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, inner, bias=False)
        self.b_proj = nn.Linear(d, self.num_heads, bias=False)
        # The release stores A_log as [head_dim], zero-padded: only the first num_heads entries are used.
        self.A_log = nn.Parameter(torch.zeros(max(self.head_dim, self.num_heads), dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(inner, dtype=torch.float32))
        self.g_proj = nn.Linear(d, inner, bias=False)
        self.o_norm = KimiK3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_norm.weight.data = self.o_norm.weight.data.float()
        self.o_proj = nn.Linear(inner, d, bias=False)

    def forward(self, x, pad_mask=None, cache: KimiK3Cache | None = None, cu_seqlens=None):
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        if pad_mask is not None:
            # Padding contributes nothing: zero inputs, no decay (g = 0) and no write (beta = 0).
            x = x * pad_mask[..., None].to(x.dtype)
        conv_states, recurrent = cache.get_kda_state(self.layer_idx) if cache is not None else (None, None)
        conv_states = conv_states or (None, None, None)
        want_state = cache is not None
        cp = context_parallel.context_parallel_group()  # a segment of a sequence split across ranks (SPEC 7)
        qkv, new_conv, pre_conv = [], [], []
        for proj, conv, state in zip(
            (self.q_proj, self.k_proj, self.v_proj), (self.q_conv1d, self.k_conv1d, self.v_conv1d), conv_states
        ):
            if type(conv) is not nn.Conv1d:
                # The conv is run from its weight by the op (with its state); a wrapper (e.g. a LoRA) would be
                # bypassed silently. Depthwise convs (groups > 1) cannot take mergeable adapters anyway.
                raise TypeError(
                    f"layer {self.layer_idx}: the depthwise short convs (q_conv1d, k_conv1d, v_conv1d) cannot be "
                    f"adapted or replaced (found {type(conv).__name__}); leave them out of target_modules"
                )
            px = proj(x)  # [B, T, H*K]
            if cp is not None:  # the conv reads the previous segment's last inputs
                state = context_parallel.conv_halo(px, self.conv_size - 1, cp)
            with _weights_of(conv):
                y, s = dispatch.causal_conv1d(
                    px, conv.weight, initial_state=state, output_final_state=want_state, cu_seqlens=cu_seqlens,
                    backend=self.config.kda_backend,
                )
            if cp is not None and want_state:  # the cache continues after the whole sequence: the last segment's
                s = context_parallel.last_segment(s, cp)
            qkv.append(y.view(B, T, H, K))  # [B, T, H, K]
            new_conv.append(s)
            pre_conv.append(px)
        q, k, v = qkv
        z = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K)
        g = kda_gate(z, self.A_log, self.dt_bias, self.lower_bound)  # fp32 [B, T, H, K]
        beta = torch.sigmoid(self.b_proj(x).float())  # fp32 [B, T, H]
        if pad_mask is not None:
            g = g * pad_mask[..., None, None]
            beta = beta * pad_mask[..., None]
        ops = dispatch.kda_ops(self.config.kda_backend, x.device.type, head_dim=K)
        rollback = cache.rollback_tokens if cache is not None else 0
        head = None
        if rollback:
            # Keep what `cache.crop` needs to roll back into the last `rollback` tokens: run the recurrence up to
            # the window, save the states there and the window's inputs, then run the window.
            split = max(0, T - rollback)
            if split:
                head, recurrent = self._recurrence(ops, *(t[:, :split] for t in (q, k, v, g, beta)), recurrent,
                                                   True, None)
            width = self.conv_size - 1
            conv_before = []
            for state, px in zip(conv_states, pre_conv):  # the conv states at the window start: [B, D, W-1]
                state = px.new_zeros(B, px.shape[-1], width, dtype=torch.float32) if state is None else state
                full = torch.cat([state, px[:, :split].float().transpose(1, 2)], dim=-1)  # [B, D, W-1 + split]
                conv_before.append(full[..., full.shape[-1] - width:])
            q, k, v, g, beta = (t[:, split:] for t in (q, k, v, g, beta))
            cache.save_rollback(self.layer_idx, tuple(conv_before), None if recurrent is None else recurrent.clone(),
                                tuple(px[:, split:] for px in pre_conv), (q, k, v, g, beta))
        if cp is not None:
            o, final = context_parallel.kda(ops[0], q, k, v, g, beta, cp, use_qk_l2norm_in_kernel=True)
        else:
            o, final = self._recurrence(ops, q, k, v, g, beta, recurrent, want_state, cu_seqlens)
        if head is not None:
            o = torch.cat([head, o], dim=1)  # [B, T, H, V]
        if cache is not None:
            cache.update_kda_state(self.layer_idx, tuple(new_conv), final)
        gate = self.g_proj(x).view(B, T, H, K)
        if type(self.o_norm) is KimiK3RMSNorm:  # per-head RMSNorm in fp32 with the fp32 weight, then the gate
            with _weights_of(self.o_norm):
                o = dispatch.gated_rms_norm(o, gate, self.o_norm.weight, self.o_norm.variance_epsilon,
                                            backend=self.config.kda_backend)
        else:  # a replaced norm module keeps its own forward
            o = torch.sigmoid(gate) * self.o_norm(o.float()).to(x.dtype)
        return self.o_proj(o.reshape(B, T, H * K))

    @staticmethod
    def _recurrence(ops, q, k, v, g, beta, recurrent, want_state, cu_seqlens):
        """The KDA core over these tokens: the decode kernel for a few cached tokens, the chunked one otherwise."""
        chunk_kda, recurrent_kda = ops
        T = q.shape[1]
        kda = recurrent_kda if (recurrent is not None and T <= 4) else chunk_kda
        extra = {}
        if (
            getattr(kda, "supports_inplace_state", False)
            and recurrent is not None
            and recurrent.dtype == torch.float32
            and recurrent.is_contiguous()
        ):
            # Decode on the Triton kernel updates the cache's fp32 state in place (no second [B, H, K, V]
            # buffer per step); `final` is then that same tensor and the cache stores it back unchanged.
            extra["inplace_final_state"] = True
        return kda(
            q, k, v, g, beta, initial_state=recurrent, output_final_state=want_state,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True, **extra,
        )


# ----------------------------------------------------------------------------------------------------------
# Gated NoPE MLA (SPEC 3)
# ----------------------------------------------------------------------------------------------------------


def eager_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, H, Tq, D], key [B, H, L, D], value [B, H, L, Dv], bool mask [B, 1, Tq, L] -> [B, Tq, H, Dv]."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling
    if attention_mask is None and kwargs.get("is_causal") and query.shape[2] > 1:
        attention_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    probs = scores.softmax(-1)
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs.to(value.dtype), value)
    return out.transpose(1, 2).contiguous(), probs


def k3_mla_paged_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`attn_implementation="k3_mla_paged"` without a cache (prefill): SDPA over the expanded keys and values.

    With a cache, `KimiK3Attention` runs the paged Triton kernel instead (`k3_kernels.mla.triton_decode`). An
    explicit request on a device the kernel cannot serve raises rather than silently using another backend.
    """
    from k3_kernels.mla.triton_decode import check_paged_backend  # lazy: Triton is optional

    check_paged_backend(query.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


# Registering the name makes transformers' attn_implementation validation accept it (`valid_keys()`); the mask
# entry keeps transformers' own mask creation working for the name (the K3 model builds its masks itself).
AttentionInterface.register("k3_mla_paged", k3_mla_paged_attention_forward)
AttentionMaskInterface.register("k3_mla_paged", sdpa_mask)


# A cached chunk of at least this many tokens attends over the expanded keys / values ((dn + dr, dv) = (192, 128)
# heads, SDPA) instead of the absorbed latent ((r + dr, r) = (576, 512) heads). Expanding the L cached latents costs
# L * H * r * (dn + dv) * 2 FLOPs; the narrower heads save T * L * H * ((r + dr + r) - (dn + dr + dv)) * 2, so the
# expanded form wins from T ~ 170 at K3's shapes. Decode and short chunks stay absorbed (and on the paged kernel).
EXPANDED_PREFILL_MIN_TOKENS = 256


class KimiK3Attention(nn.Module):
    """Multi-head latent attention without rotary (NoPE) and with a sigmoid output gate."""

    def __init__(self, config: KimiK3TextConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = True
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_rank = config.v_head_dim, config.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        self.scaling = self.qk_dim**-0.5
        d, H = config.hidden_size, self.num_heads
        eps = config.mla_latent_norm_eps
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_a_layernorm = KimiK3RMSNorm(config.q_lora_rank, eps=eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = KimiK3RMSNorm(self.kv_rank, eps=eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)

    def _kv_b_weight(self) -> torch.Tensor:
        """The weight `kv_b_proj` applies, `[H * (dn + dv), r]`, also when it is wrapped (a LoRA adds its delta)."""
        if type(self.kv_b_proj) is nn.Linear:
            with _weights_of(self.kv_b_proj):  # the loaded tensor outlives the hook's offloading of the module
                return self.kv_b_proj.weight
        eye = torch.eye(self.kv_rank, device=self.kv_b_proj.weight.device, dtype=self.kv_b_proj.weight.dtype)
        return self.kv_b_proj(eye).T  # a linear map is its action on the basis

    def forward(self, x, attention_mask=None, cache: KimiK3Cache | None = None, causal_only=False, **kwargs):
        B, T, _ = x.shape
        H = self.num_heads
        if self.config.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, self.qk_dim)  # [B, T, H, dn + dr]
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)  # [B, T, r]; NoPE: k_pe is used as is, never rotated
        cp = context_parallel.context_parallel_group()  # a segment of a sequence split across ranks (SPEC 7)
        expand = cache is None or T >= EXPANDED_PREFILL_MIN_TOKENS or cp is not None
        # Which new tokens are real keys (the last query row sees every new key but padding): static caches keep it
        # for decode steps that run without the host-built mask.
        key_valid = None if attention_mask is None or cache is None else attention_mask[:, 0, -1, -T:]  # [B, T]
        if not expand and self.config._attn_implementation == "k3_mla_paged":
            from k3_kernels.mla.triton_decode import mla_paged_attention  # lazy: Triton is optional

            # The Triton kernel attends over the layer's pages through the block table (kv_b_proj absorbed).
            out = mla_paged_attention(self, q_nope, q_pe, torch.cat([c, k_pe], dim=-1), cache, attention_mask,
                                      key_valid)
        elif not expand:
            # Decode and short cached chunks attend over the latent directly (kv_b_proj absorbed).
            latent = cache.update_latent(self.layer_idx, torch.cat([c, k_pe], dim=-1), key_valid)  # [B, L, r + dr]
            c_all, k_pe_all = latent.to(x.dtype).split([self.kv_rank, self.rope_dim], dim=-1)
            out = mla_absorbed_attention(
                q_nope, q_pe, c_all, k_pe_all, self._kv_b_weight(), self.v_dim, self.scaling, attention_mask
            )
        else:
            if cp is not None:  # every segment's latents, all of which a prefilled cache keeps
                latent, attention_mask = context_parallel.mla_latents(torch.cat([c, k_pe], dim=-1), cp)
                if cache is not None:
                    cache.update_latent(self.layer_idx, latent)
                c, k_pe = latent.split([self.kv_rank, self.rope_dim], dim=-1)  # [B, L, r], [B, L, dr]
            elif cache is not None:  # a long prefill chunk: expand the whole cached latent, prefix included
                latent = cache.update_latent(self.layer_idx, torch.cat([c, k_pe], dim=-1), key_valid)  # [B, L, r + dr]
                c, k_pe = latent.to(x.dtype).split([self.kv_rank, self.rope_dim], dim=-1)
            L = c.shape[1]
            kv = self.kv_b_proj(c).view(B, L, H, self.nope_dim + self.v_dim)
            k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
            k = torch.cat([k_nope, k_pe[:, :, None].expand(B, L, H, self.rope_dim)], dim=-1)  # [B, L, H, dn + dr]
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            # A plain causal mask goes as `is_causal` with no mask: SDPA can then take its flash / cuDNN kernels,
            # 3x faster than with a boolean mask at K3's heads on the H200 (benchmarks/mla_prefill.py).
            plain = causal_only and L == T
            out, _ = attention(
                self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None if plain else attention_mask,
                dropout=0.0, scaling=self.scaling, is_causal=plain,
            )
        out = out.reshape(B, T, H * self.v_dim).to(x.dtype)
        return self.o_proj(torch.sigmoid(self.g_proj(x)) * out)


# ----------------------------------------------------------------------------------------------------------
# Stable LatentMoE (SPEC 5)
# ----------------------------------------------------------------------------------------------------------


class KimiK3TopkRouter(nn.Module):
    """Sigmoid router: select on `s + e_score_correction_bias`, mix with the unbiased `s`, renormalised.

    With `config.moe_balancing` set and the module in training mode, it also routes top-(k+1) so the (k+1)-th
    biased score (the admission cutoff) reaches the balancer (`transformers_k3.balancing`); the bias itself only
    moves in `update_moe_balancing`, after the optimizer step. Eval mode routes exactly as with "none".
    """

    def __init__(self, config: KimiK3TextConfig):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_token
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        self._moe_balancer, self._moe_balancer_key = None, None

    def moe_balancer(self):
        """This layer's `RouterBalancer` for the config's method (None for "none"); rebuilt if the config changed."""
        c = self.config
        method = getattr(c, "moe_balancing", "none")
        if method == "none":
            return None
        key = (method, c.num_experts, self.top_k, c.moe_balancing_bins, c.moe_bias_update_speed)
        if self._moe_balancer is None or self._moe_balancer_key != key:
            from .balancing import RouterBalancer  # lazy: balancing imports transformers' Trainer machinery

            self._moe_balancer, self._moe_balancer_key = RouterBalancer(*key), key
        return self._moe_balancer

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None):
        """`x [N, d]`; `valid [N]` bool, the real tokens (the balancer does not count padding)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E] fp32
        biased = scores + self.e_score_correction_bias.float()
        balancer = self.moe_balancer() if self.training else None
        if balancer is not None:
            top_vals, top_idx_k1 = biased.topk(self.top_k + 1, dim=-1)  # [N, k + 1]
            top_idx = top_idx_k1[:, : self.top_k]  # [N, k]
            # A forward run by the autograd engine is a gradient-checkpointing recompute (reentrant or not) of
            # a forward that was already counted: count each token once. The graph-task id is -1 outside
            # backward (torch.utils.checkpoint reads the same id).
            if torch._C._current_graph_task_id() == -1:
                balancer.observe(scores.detach(), top_vals[:, self.top_k].detach(), top_idx,
                                 self.e_score_correction_bias, valid)
        else:
            top_idx = biased.topk(self.top_k, dim=-1).indices  # [N, k]
        top_w = scores.gather(1, top_idx)
        if self.config.moe_renormalize:
            top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        return scores, top_w * self.config.routed_scaling_factor, top_idx


from contextvars import ContextVar  # noqa: E402  (experts only: the packed-load request below)

from k3_kernels.mxfp4.reference import dequantize_mxfp4, quantize_mxfp4  # noqa: E402

# Set by `KimiK3PreTrainedModel.from_pretrained` while it builds the model: "explicit" (keep_experts_packed=True),
# "auto" (experts_implementation="k3_triton": packed if the checkpoint's experts are MXFP4) or None (dequantise).
_PACK_EXPERTS: ContextVar[str | None] = ContextVar("k3_pack_experts", default=None)
_PACKED_NAMES = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
_NO_TRAINING_PACKED = (
    "KimiK3Experts holds MXFP4-packed experts (frozen 4-bit weights: no backward, no LoRA); load with "
    "keep_experts_packed=False to train them or adapt them (they are then dequantised to the model dtype)"
)


def _refuse_adapter_on_packed(experts: nn.Module) -> None:
    """Refuse a LoRA adapter on the packed experts' bytes before peft's own forward runs. peft wraps the module of
    each targeted parameter (`parameter_name`, the wrapped module in `base_layer`); peft 0.20 then fails inside its
    forward, on the uint8 tensor, with a dtype error that names neither the cause nor the cure."""
    while isinstance(getattr(experts, "base_layer", None), nn.Module):
        if getattr(experts, "parameter_name", None) in _PACKED_NAMES:
            raise RuntimeError(_NO_TRAINING_PACKED)
        experts = experts.base_layer


@use_experts_implementation
class KimiK3Experts(nn.Module):
    """Routed experts as 3-D tensors (`gate_up_proj [E, 2I, D]`, `down_proj [E, D, I]`) in the latent width D.

    Packed (`from_pretrained(..., keep_experts_packed=True)`, or implied by `experts_implementation="k3_triton"`
    on an MXFP4 checkpoint): the release's bytes instead, stacked per expert and frozen,
    `gate_up_proj_blocks uint8 [E, 2I, D/2]` + `gate_up_proj_scales uint8 [E, 2I, D/32]` (w1 rows, then w3) and
    `down_proj_blocks [E, D, I/2]` + `down_proj_scales [E, D, I/32]` (E2M1 pairs, E8M0 per 32 inputs): 4.25 bits a
    weight instead of 16. "k3_triton" consumes them directly (W4A16); "eager" dequantises one touched expert at a
    time (exactly, so it gives the dequantised model's numbers); the bf16 implementations ("grouped_mm",
    "batched_mm") need the 3-D bf16 tensors and refuse.
    """

    def __init__(self, config: KimiK3TextConfig):
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.hidden_dim = config.routed_expert_hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        request = _PACK_EXPERTS.get()
        self.packed = request is not None and experts_are_mxfp4(config)
        if request == "explicit" and not self.packed:
            raise ValueError(
                "keep_experts_packed=True needs MXFP4 experts in the checkpoint (text_config.quantization_config "
                f"with format 'mxfp4-pack-quantized'), got quantization_config="
                f"{getattr(config, 'checkpoint_quantization_config', None)!r}"
            )
        E, I, D = self.num_experts, self.intermediate_dim, self.hidden_dim
        if self.packed:
            shapes = ((E, 2 * I, D // 2), (E, 2 * I, D // 32), (E, D, I // 2), (E, D, I // 32))
            for name, shape in zip(_PACKED_NAMES, shapes):
                setattr(self, name, nn.Parameter(torch.zeros(shape, dtype=torch.uint8), requires_grad=False))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
            self.down_proj = nn.Parameter(torch.empty(E, D, I))

    def __getattr__(self, name):
        if name in ("gate_up_proj", "down_proj") and self.__dict__.get("packed"):
            raise AttributeError(
                f"KimiK3Experts has no bf16 '{name}': its experts are MXFP4-packed ({', '.join(_PACKED_NAMES)}). "
                f"experts_implementation={self.config._experts_implementation!r} needs 3-D bf16 experts; use "
                "'k3_triton' (CUDA) or 'eager', or load with keep_experts_packed=False"
            )
        return super().__getattr__(name)

    def _check_packed_frozen(self):
        if self.training and torch.is_grad_enabled():
            raise RuntimeError(_NO_TRAINING_PACKED + "; or call model.eval() / torch.no_grad() for inference")
        if any(torch.nn.utils.parametrize.is_parametrized(self, name) for name in _PACKED_NAMES):
            raise RuntimeError(_NO_TRAINING_PACKED)

    @torch.no_grad()
    def holds_mxfp4_values(self) -> bool:
        """Whether MXFP4 holds these experts exactly (packed ones, or 3-D ones as loaded from an MXFP4 checkpoint and
        not changed since): what decides if saving may re-quantise them without loss. One expert at a time."""
        if self.packed:
            return True
        for w in (self.gate_up_proj, self.down_proj):
            if w.device.type == "meta":  # offloaded: the saver reads the checkpoint's own values
                continue
            for e in range(w.shape[0]):
                if not torch.equal(dequantize_mxfp4(*quantize_mxfp4(w[e]), dtype=w.dtype), w[e]):
                    return False
        return True

    def _expert_weights(self, expert: int, dtype: torch.dtype):
        """`(gate_up [2I, D], down [D, I])` of one expert; packed ones dequantised (exact) to `dtype`."""
        if not self.packed:
            return self.gate_up_proj[expert], self.down_proj[expert]
        return (
            dequantize_mxfp4(self.gate_up_proj_blocks[expert], self.gate_up_proj_scales[expert], dtype),
            dequantize_mxfp4(self.down_proj_blocks[expert], self.down_proj_scales[expert], dtype),
        )

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return situ_glu(gate, up, self.config.activation_situ_beta, self.config.activation_situ_linear_beta)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if self.packed:
            self._check_packed_frozen()
        out = torch.zeros_like(hidden_states)
        hit = torch.unique(top_k_index)
        for expert in hit.tolist():
            token, slot = torch.where(top_k_index == expert)
            gate_up, down = self._expert_weights(expert, hidden_states.dtype)
            h = F.linear(hidden_states[token], gate_up)
            h = F.linear(self._apply_gate(h), down)
            out.index_add_(0, token, (h * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def _k3_triton_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """`experts_implementation="k3_triton"`: grouped Triton matmuls with SiTU-GLU fused, bf16 tensor cores; on
    packed experts the MXFP4 bytes are unpacked in registers (W4A16), on Hopper by the Gluon kernels of
    `k3_kernels.moe.gluon_moe`.

    Inference only (the kernel has no backward; train with "grouped_mm"). Needs CUDA (or TRITON_INTERPRET=1).
    """
    if self.packed:
        self._check_packed_frozen()
    if self.training and torch.is_grad_enabled():
        raise RuntimeError("experts_implementation='k3_triton' has no backward; train with 'grouped_mm' or 'eager'")
    if hidden_states.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"experts_implementation='k3_triton' needs CUDA tensors, got {hidden_states.device}")
    from k3_kernels.moe.triton_moe import moe_experts_triton  # lazy: triton is optional

    if self.packed:
        weights = dict(w13_packed=self.gate_up_proj_blocks, w13_scale=self.gate_up_proj_scales,
                       w2_packed=self.down_proj_blocks, w2_scale=self.down_proj_scales)
    else:
        weights = dict(gate_up=self.gate_up_proj, down=self.down_proj)
    out = moe_experts_triton(
        hidden_states, top_k_index, top_k_weights, **weights,
        beta=self.config.activation_situ_beta, linear_beta=self.config.activation_situ_linear_beta,
    )
    return out.to(hidden_states.dtype)


ExpertsInterface.register("k3_triton", _k3_triton_experts_forward)


class KimiK3LatentMoE(nn.Module):
    """Route in full width, run the experts in a half-width latent, norm, project back, add the shared experts."""

    def __init__(self, config: KimiK3TextConfig):
        super().__init__()
        self.config = config
        self.gate = KimiK3TopkRouter(config)
        self.routed_expert_down_proj = nn.Linear(config.hidden_size, config.routed_expert_hidden_size, bias=False)
        self.experts = KimiK3Experts(config)
        if config.latent_moe_use_norm:
            self.routed_expert_norm = KimiK3RMSNorm(config.routed_expert_hidden_size, eps=config.rms_norm_eps)
        self.routed_expert_up_proj = nn.Linear(config.routed_expert_hidden_size, config.hidden_size, bias=False)
        self.shared_experts = KimiK3MLP(config, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`x [B, T, d]`; `pad_mask [B, T]` (1 = real token), or None when every token is real."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, d]
        _, top_w, top_idx = self.gate(flat, None if pad_mask is None else pad_mask.reshape(-1) > 0)
        z = self.routed_expert_down_proj(flat)  # [N, D]
        if not isinstance(self.experts, KimiK3Experts):  # wrapped by an adapter
            _refuse_adapter_on_packed(self.experts)
        u = self.experts(z, top_idx, top_w.to(z.dtype))
        if self.config.latent_moe_use_norm:
            u = self.routed_expert_norm(u)
        y = self.routed_expert_up_proj(u) + self.shared_experts(flat)
        return y.view(shape)


# ----------------------------------------------------------------------------------------------------------
# Decoder layer with Block Attention Residuals (SPEC 4)
# ----------------------------------------------------------------------------------------------------------


class KimiK3DecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: KimiK3TextConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        d, eps = config.hidden_size, config.rms_norm_eps
        if self.layer_type == FULL_ATTENTION:
            self.self_attn = KimiK3Attention(config, layer_idx)
        else:
            self.self_attn = KimiK3DeltaAttention(config, layer_idx)
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.block_sparse_moe = KimiK3LatentMoE(config)
        else:
            self.mlp = KimiK3MLP(config, config.intermediate_size)
        self.input_layernorm = KimiK3RMSNorm(d, eps)
        self.post_attention_layernorm = KimiK3RMSNorm(d, eps)
        # AttnRes sites: a pseudo-query (`*_res_proj.weight [1, d]`) and a key-norm weight (`*_res_norm.weight`).
        self.self_attention_res_norm = KimiK3RMSNorm(d, eps)
        self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
        self.mlp_res_norm = KimiK3RMSNorm(d, eps)
        self.mlp_res_proj = nn.Linear(d, 1, bias=False)

    def _mix(self, norm, proj, blocks, partial):
        with _weights_of(proj, norm):
            return dispatch.attn_res(blocks + [partial], proj.weight, norm.weight, norm.variance_epsilon)

    def forward(self, partial, blocks, attention_mask=None, pad_mask=None, cache=None, cu_seqlens=None,
                causal_only=False):
        """`partial` is the running sum P of the current block, `blocks` the completed block snapshots.

        `causal_only`: `attention_mask` is the plain causal mask of a fresh prompt (no padding, no prefix, no
        packing), so MLA may attend with `is_causal=True` and no mask (flash / cuDNN SDPA kernels)."""
        with _on_device_of(partial):
            return self._forward(partial, blocks, attention_mask, pad_mask, cache, cu_seqlens, causal_only)

    def _forward(self, partial, blocks, attention_mask, pad_mask, cache, cu_seqlens, causal_only):
        # Layer 0 has no completed block: its mix has the one candidate P, weight 1, an exact identity whose query
        # and key norm get zero gradient. Training runs it all the same, so that those released parameters take
        # part in the loss: DDP without find_unused_parameters (Trainer's choice under gradient checkpointing)
        # fails on parameters that do not.
        if blocks or self.training:
            h = self._mix(self.self_attention_res_norm, self.self_attention_res_proj, blocks, partial)
        else:
            h = partial
        if self.layer_idx % self.config.attn_res_block_size == 0:
            blocks, partial = blocks + [partial], None
        normed = self.input_layernorm(h)
        if self.layer_type == FULL_ATTENTION:
            a = self.self_attn(normed, attention_mask=attention_mask, cache=cache, causal_only=causal_only)
        else:
            a = self.self_attn(normed, pad_mask=pad_mask, cache=cache, cu_seqlens=cu_seqlens)
        partial = a if partial is None else partial + a
        h = self._mix(self.mlp_res_norm, self.mlp_res_proj, blocks, partial)
        normed = self.post_attention_layernorm(h)
        if hasattr(self, "block_sparse_moe"):
            partial = partial + self.block_sparse_moe(normed, pad_mask)
        else:
            partial = partial + self.mlp(normed)
        return partial, blocks


@contextlib.contextmanager
def _weights_of(*modules: nn.Module):
    """Modules whose weights a fused op reads directly instead of calling the module: under accelerate's CPU or
    disk offload (`device_map` entries "cpu" / "disk") a module's weights sit on the meta device until its own hook
    loads them, which only a call to the module would do; run those hooks around the read (a no-op otherwise)."""
    hooked = [(m, m._hf_hook) for m in modules if getattr(m, "_hf_hook", None) is not None]
    for m, hook in hooked:
        hook.pre_forward(m)
    try:
        yield
    finally:
        for m, hook in hooked:
            hook.post_forward(m, None)


def _on_device_of(x: torch.Tensor):
    """Triton launches its kernels on the current CUDA device, whatever their tensors' device: with the layers
    spread over GPUs (`device_map`), each layer runs with its own GPU current."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------
# Model and heads
# ----------------------------------------------------------------------------------------------------------


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3TextConfig
    config: KimiK3TextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiK3DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_attention_backend = True
    # transformers reads this only to refuse assisted generation; the cache can roll KDA states back (rollback_tokens).
    _is_stateful = False
    _can_compile_fullgraph = False
    # The precision contract: these stay fp32 whatever dtype the model is loaded in.
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "o_norm",
                                    "e_score_correction_bias"]
    _keys_to_ignore_on_load_unexpected = [r"^vision_tower\.", r"^mm_projector\."]

    @classmethod
    def from_pretrained(cls, *args, strict: bool = True, keep_experts_packed: bool | None = None, **kwargs):
        """transformers' loader, made strict: a missing tensor or one of the wrong shape raises, naming it.

        transformers itself only warns and re-initialises such weights, which would silently give a broken
        model. Pass `strict=False` to get that behaviour back (e.g. to load a partial checkpoint on purpose).

        `keep_experts_packed`: keep MXFP4 routed experts as the release's uint8 bytes (see `KimiK3Experts`) instead
        of dequantising them. Default (None): packed exactly when `experts_implementation="k3_triton"` and the
        checkpoint's experts are MXFP4, as transformers keeps gpt-oss's MXFP4 experts packed when its kernel can
        read them; storage is a load-time choice, not a config field, so a saved config stays the released one.
        True without an `experts_implementation` selects "eager" (the bf16 "grouped_mm" default cannot read bytes).
        """
        want_info = kwargs.pop("output_loading_info", False)
        if strict:
            # Let the loader finish so the error below can name every offending tensor.
            kwargs["ignore_mismatched_sizes"] = True
        impl = kwargs.get("experts_implementation")
        if keep_experts_packed:
            impl = kwargs.setdefault("experts_implementation", "eager")
            if isinstance(impl, str) and impl not in ("eager", "k3_triton"):
                raise ValueError(
                    f"keep_experts_packed=True works with experts_implementation 'eager' or 'k3_triton', got {impl!r} "
                    f"({impl!r} needs bf16 3-D experts: load with keep_experts_packed=False for it)"
                )
        asks_triton = impl == "k3_triton" or (isinstance(impl, dict) and "k3_triton" in impl.values())
        request = "explicit" if keep_experts_packed else ("auto" if keep_experts_packed is None and asks_triton else None)
        token = _PACK_EXPERTS.set(request)
        try:
            with packed_expert_conversions(active=request is not None):
                model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        finally:
            _PACK_EXPERTS.reset(token)
        if strict:
            problems = []
            if info.get("missing_keys"):
                problems.append(f"missing tensors: {sorted(info['missing_keys'])}")
            if info.get("mismatched_keys"):
                problems.append(f"tensors of the wrong shape (checkpoint vs model): {sorted(info['mismatched_keys'])}")
            if problems:
                raise ValueError(f"{cls.__name__}: the checkpoint does not match the model: " + "; ".join(problems))
        return (model, info) if want_info else model

    def _apply(self, fn, recurse=True):
        """`.to(dtype)`, `.bfloat16()`, `.half()` keep the precision contract: those tensors stay fp32, unrounded."""
        keep = set(self._keep_in_fp32_modules_strict)
        saved = [
            (module, name, tensor.detach().clone())
            for module_name, module in self.named_modules()
            for name, tensor in list(module._parameters.items()) + list(module._buffers.items())
            if tensor is not None and tensor.dtype == torch.float32
            and keep & set(f"{module_name}.{name}".split("."))
        ]
        out = super()._apply(fn, recurse)
        for module, name, original in saved:
            current = getattr(module, name)
            if current.is_floating_point() and current.dtype != torch.float32:
                current.data = original.to(current.device)
        return out

    def save_pretrained(self, *args, experts_format: str = "auto", **kwargs):
        """The released layout (MXFP4 experts) when the config says the experts are MXFP4 and they still hold MXFP4
        values; otherwise the 3-D experts as they are, unquantised.

        `experts_format`: "auto" (default) as just said. Re-quantising experts that training changed would throw
        part of the update away (and make a resumed Trainer run differ), so "auto" saves them unquantised, drops the
        MXFP4 block from the saved config and warns. "mxfp4" re-packs them whatever they hold (lossy after training);
        "dense" saves them unquantised. Packed experts (`keep_experts_packed`) are always written back as the bytes
        they hold. Without this override a model trained from scratch would be quantised on save.
        """
        if experts_format not in ("auto", "mxfp4", "dense"):
            raise ValueError(f"experts_format must be 'auto', 'mxfp4' or 'dense', got {experts_format!r}")
        text_config = self.config.get_text_config(decoder=True)
        experts = [m for m in self.modules() if isinstance(m, KimiK3Experts)]
        packed = any(m.packed for m in experts)
        mxfp4 = experts_are_mxfp4(text_config)
        if packed and experts_format == "dense":
            raise ValueError("experts_format='dense': these experts are MXFP4-packed (keep_experts_packed); load "
                             "with keep_experts_packed=False to save them unquantised")
        if mxfp4 and experts_format == "auto" and not packed and not all(m.holds_mxfp4_values() for m in experts):
            logger.warning(
                "Kimi K3: the routed experts no longer hold MXFP4 values (trained or edited since loading): saved "
                "unquantised, with no MXFP4 block in the saved config; save_pretrained(..., experts_format='mxfp4') "
                "re-packs them (lossy)"
            )
            experts_format = "dense"
        if mxfp4 and experts_format != "dense":
            # Packed experts are written back as the bytes they hold (no re-quantisation), even for a model that
            # was not loaded by `from_pretrained` and so has no recorded conversions.
            with packed_expert_conversions(active=packed):
                return super().save_pretrained(*args, **kwargs)
        # An empty (not None) list tells transformers' saver there are no conversions to revert.
        saved = self.__dict__.get("_weight_conversions", None)
        quant = text_config.checkpoint_quantization_config
        self._weight_conversions = []
        text_config.checkpoint_quantization_config = None  # the saved config then says the experts are dense
        try:
            return super().save_pretrained(*args, **kwargs)
        finally:
            text_config.checkpoint_quantization_config = quant
            if saved is None:
                del self._weight_conversions
            else:
                self._weight_conversions = saved

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.get_text_config().initializer_range if hasattr(self.config, "get_text_config") else 0.02
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            if module.weight.device.type != "meta":
                module.weight.normal_(0.0, std)
            if getattr(module, "bias", None) is not None and module.bias.device.type != "meta":
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            if module.weight.device.type != "meta":
                module.weight.normal_(0.0, std)
        elif isinstance(module, KimiK3RMSNorm):
            if module.weight.device.type != "meta":
                module.weight.fill_(1.0)
        elif isinstance(module, KimiK3Experts) and not module.packed:  # packed bytes only ever come from a checkpoint
            if module.gate_up_proj.device.type != "meta":
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
        elif isinstance(module, KimiK3TopkRouter):
            if module.weight.device.type != "meta":
                module.weight.normal_(0.0, std)
                module.e_score_correction_bias.zero_()
        elif isinstance(module, KimiK3DeltaAttention) and module.A_log.device.type != "meta":
            # fla's initialisation: A in [1, 16], dt = softplus^-1 of log-uniform [1e-3, 1e-1]; padding stays 0.
            module.A_log.zero_()
            module.A_log[: module.num_heads].uniform_(1.0, 16.0).log_()
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        if isinstance(module, KimiK3DecoderLayer) or isinstance(module, KimiK3Model):
            # AttnRes pseudo-queries start at zero: a uniform mix over depth.
            for proj in ("self_attention_res_proj", "mlp_res_proj", "output_attn_res_proj"):
                sub = getattr(module, proj, None)
                if sub is not None and sub.weight.device.type != "meta":
                    sub.weight.zero_()


def _attention_inputs(attention_mask, position_ids, batch, length, past, device, cu_seqlens, has_cache):
    """Build what the two layer kinds need from the usual transformers inputs.

    Returns `(mla_mask [B, 1, T, past + T] bool, pad_mask [B, T] float or None, cu_seqlens or None)`.
    Packed sequences (position ids restarting at 0 with no attention mask, or `cu_seqlens`) get a
    block-diagonal mask and varlen boundaries for the recurrence and the convs.
    """
    total = past + length
    q_pos = torch.arange(past, total, device=device)
    k_pos = torch.arange(total, device=device)
    mask = (k_pos[None, :] <= q_pos[:, None])[None, None].expand(batch, 1, length, total)  # causal
    pad_mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape != (batch, total):
            raise ValueError(
                f"attention_mask must be 2-D [batch, past + new tokens] = [{batch}, {total}], "
                f"got {list(attention_mask.shape)}"
            )
        valid = attention_mask.bool()
        # Decode applies the masks unchecked: the all-valid test is a host sync, which in a decode step would hold
        # the CPU's launches until the GPU is idle; prefill keeps it (an all-valid prompt keeps SDPA's causal path).
        if length == 1 or not bool(valid.all()):
            mask = mask & valid[:, None, None, :]
            pad_mask = valid[:, past:].float()
    segments = None
    if cu_seqlens is None and attention_mask is None and position_ids is not None and past == 0 and length > 1:
        if bool((position_ids[:, 1:] == 0).any()):
            starts = (position_ids == 0).clone()
            starts[:, 0] = True
            flat = starts.reshape(-1).nonzero().flatten()
            cu_seqlens = torch.cat([flat, flat.new_tensor([batch * length])])
    if cu_seqlens is not None:
        if has_cache:
            raise ValueError("packed sequences (cu_seqlens or restarting position_ids) cannot be used with a cache")
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.long)
        if int(cu_seqlens[-1]) != batch * length:
            raise ValueError(f"cu_seqlens must end at batch * seq_len = {batch * length}, got {int(cu_seqlens[-1])}")
        seg_ids = torch.zeros(batch * length, dtype=torch.long, device=device)
        seg_ids[cu_seqlens[1:-1]] = 1
        segments = seg_ids.cumsum(0).view(batch, length)
        mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])
    # A query with no visible key (left padding) would give NaN; let it see itself. Its output is never used.
    diag = k_pos[None, :] == q_pos[:, None]  # [T, past + T]
    return mask | diag, pad_mask, cu_seqlens


class KimiK3Model(KimiK3PreTrainedModel):
    def __init__(self, config: KimiK3TextConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([KimiK3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.output_attn_res_norm = KimiK3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
        self.norm = KimiK3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        use_cache=None,
        output_hidden_states=None,
        cu_seqlens=None,
        past_key_values=None,
        cache=None,
        return_dict=None,
        **kwargs,
    ):
        cache = _pop_cache(kwargs, cache, past_key_values)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        cp = context_parallel.context_parallel_group()
        if use_cache is None:
            # As in transformers: a cache by default at inference; none while training (nothing reads it). A segment
            # of a sequence split across ranks (context parallel) fills one only when given one or use_cache=True.
            use_cache = (self.config.use_cache and not self.training) if cp is None else cache is not None
        if self.gradient_checkpointing and self.training:
            use_cache = False  # checkpointed layers re-run their forward: a state must never advance twice
        if not use_cache:
            cache = None
        if cache is not None and not isinstance(cache, KimiK3Cache):
            raise TypeError(f"Kimi K3 needs a KimiK3Cache, got {type(cache).__name__}")
        if cu_seqlens is None:
            cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
        if cp is not None:
            padded = attention_mask is not None and not bool(attention_mask.all())
            if cu_seqlens is not None or padded:
                raise ValueError("context parallel runs whole unpadded sequences: no padding, no packed sequences")
            if cache is not None and (cache.get_seq_length() > 0 or cache.is_static or cache.rollback_tokens):
                raise ValueError("context parallel prefills a fresh KimiK3Cache (empty, not static, no "
                                 "rollback_tokens): the segments' tokens are the sequence's first")
            attention_mask = position_ids = None  # NoPE: positions only mark packing, which a segment cannot hold
            context_parallel.check_segment(inputs_embeds.shape[1], self.config.linear_conv_kernel_size - 1, cp,
                                            inputs_embeds.device)
        B, T, _ = inputs_embeds.shape
        if cache is not None:
            cache.check_batch(B)
        past = cache.get_seq_length() if cache is not None else 0
        if (cache is not None and cache.is_static and T == 1 and attention_mask is None and cu_seqlens is None
                and self.config._attn_implementation == "k3_mla_paged"):
            # A static decode step (what `cuda_graph.DecodeGraph` captures): no host-built mask, whose width grows
            # with the length; the paged kernel reads the cache's own key-padding flags (`key_valid`).
            mla_mask = pad_mask = None
        else:
            mla_mask, pad_mask, cu_seqlens = _attention_inputs(
                attention_mask, position_ids, B, T, past, inputs_embeds.device, cu_seqlens, cache is not None
            )
        if use_cache and cache is None and cu_seqlens is None:
            cache = KimiK3Cache(self.config)  # a fresh cache: past = 0, so the masks above still hold
        packed = cu_seqlens is not None
        partial, blocks = inputs_embeds, []
        hidden_states = (inputs_embeds,) if output_hidden_states else None
        for layer in self.layers:
            if packed:
                partial, blocks = self._packed_layer(layer, partial, blocks, mla_mask, cu_seqlens)
            else:
                partial, blocks = layer(partial, blocks, mla_mask, pad_mask, cache, None,
                                        causal_only=pad_mask is None and past == 0)
            if output_hidden_states:
                hidden_states += (partial,)
        with _weights_of(self.output_attn_res_proj, self.output_attn_res_norm):
            w, w_norm = self.output_attn_res_proj.weight, self.output_attn_res_norm.weight
        if partial.device != w.device:  # layers and the output mix on different GPUs (device_map)
            partial, blocks = partial.to(w.device), [b.to(w.device) for b in blocks]
        with _on_device_of(partial):
            h = dispatch.attn_res(blocks + [partial], w, w_norm, self.output_attn_res_norm.variance_epsilon)
        h = self.norm(h)
        return BaseModelOutputWithPast(last_hidden_state=h, hidden_states=hidden_states, **{CACHE_KWARG: cache})

    def _packed_layer(self, layer, partial, blocks, mla_mask, cu_seqlens):
        """Packed rows: MLA uses the block-diagonal mask; KDA sees one flat stream cut at `cu_seqlens`."""
        if layer.layer_type == FULL_ATTENTION:
            return layer(partial, blocks, mla_mask, None, None, None)
        B, T, d = partial.shape
        # AttnRes and the FFN are per token, so running the whole layer on the flat stream changes nothing else.
        flat_blocks = [b.reshape(1, B * T, d) for b in blocks]
        out, new_blocks = layer(partial.reshape(1, B * T, d), flat_blocks, None, None, None, cu_seqlens)
        return out.view(B, T, d), [b.view(B, T, d) for b in new_blocks]


# How far back a cache made for assisted generation can be cropped. Transformers' assistant drafts at most
# `num_assistant_tokens` (default 20, grown by its heuristic) and prompt lookup `prompt_lookup_num_tokens` (default
# 10) tokens a round; a longer draft makes `crop` raise with the numbers.
ASSISTED_ROLLBACK_TOKENS = 64


class _KimiK3GenerationMixin:
    """Plug the hybrid cache into generate (transformers would otherwise build a DynamicCache)."""

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        from transformers.generation.utils import GenerationMode

        mode = args[0] if args else kwargs.get("generation_mode")
        # Assisted / prompt-lookup decoding crops the cache after verifying the draft tokens, and the assistant
        # model's own cache after the main model rejects its drafts: such caches keep what rolling the KDA states
        # back needs (ASSISTED_ROLLBACK_TOKENS covers transformers' draft lengths plus the verified token).
        assisted = mode == GenerationMode.ASSISTED_GENERATION or getattr(generation_config, "is_assistant", False)
        user_cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if user_cache is not None:
            if not isinstance(user_cache, KimiK3Cache):
                raise TypeError(f"Kimi K3 generates with a KimiK3Cache, got {type(user_cache).__name__}")
            if assisted and not user_cache.is_croppable:
                raise ValueError(
                    "assisted decoding crops the cache after verifying drafts: pass "
                    f"KimiK3Cache(config, rollback_tokens={ASSISTED_ROLLBACK_TOKENS}) (or leave the cache to generate)"
                )
            return
        if generation_config.use_cache is False:
            return
        impl = generation_config.cache_implementation
        if impl not in (None, "dynamic", "hybrid", "kimi_k3", "static"):
            raise ValueError(
                f"cache_implementation={impl!r} is not supported by Kimi K3: it uses its own hybrid paged cache "
                "(None / 'dynamic' / 'hybrid' / 'kimi_k3', or 'static' for CUDA-graph decode steps)"
            )
        if impl == "static":
            if assisted:
                raise ValueError("cache_implementation='static' does not serve assisted decoding (it crops the cache)")
            # generate passes (generation_mode, batch_size, max_cache_length): the prompt plus the new tokens
            max_cache_len = args[2] if len(args) > 2 else kwargs.get("max_cache_length", generation_config.max_length)
            model_kwargs[CACHE_KWARG] = KimiK3Cache(self.config, max_cache_len=int(max_cache_len))
            return
        rollback = ASSISTED_ROLLBACK_TOKENS if assisted else 0
        model_kwargs[CACHE_KWARG] = KimiK3Cache(self.config, rollback_tokens=rollback)

    def _supports_default_dynamic_cache(self):
        return False

    def init_continuous_batching(self, *args, **kwargs):
        """transformers' continuous batching (`generate_batch`, `continuous_batching_context_manager`, `transformers
        serve`; all enter here) pages full- and sliding-attention KV only: K3's KDA layers carry a recurrent state
        per sequence, which its paged cache cannot hold, so it is refused here with the alternatives."""
        raise NotImplementedError(
            "continuous batching (generate_batch / init_continuous_batching) is not supported by Kimi K3: "
            "transformers' paged cache holds attention KV only, not the KDA layers' recurrent states. Batch the "
            "prompts with padding through generate() (cache_implementation='static' replays decode steps from a "
            "CUDA graph)"
        )

    def create_masks_for_generate(self, *args, attention_mask=None, **kwargs):
        """generate turns the 2-D padding mask into 4-D masks when the cache is compileable (a static one); K3
        builds its own masks from the 2-D one (and a static decode step needs none), so it is passed through."""
        return attention_mask

    def get_compiled_call(self, compile_config):
        """What generate runs for decode steps when the cache is static (`is_compileable`) on a GPU: the step
        captured once in a CUDA graph and replayed (`cuda_graph.DecodeGraph`), where transformers would
        `torch.compile` the forward (K3's Triton kernels and paged cache do not go through dynamo).
        `compile_config` has nothing to set here."""
        return functools.partial(_static_decode_step, self)


def _static_decode_step(model, input_ids=None, inputs_embeds=None, **inputs):
    """One generate step on a static cache: a replayed CUDA graph for one token per sequence on CUDA, else eager."""
    cache = inputs.get("cache", inputs.get("past_key_values"))
    step = (
        input_ids is not None and inputs_embeds is None and input_ids.shape[1] == 1 and input_ids.is_cuda
        and isinstance(cache, KimiK3Cache) and cache.is_static and inputs.get("use_cache", True) is not False
        and not any(inputs.get(k) is not None for k in ("pixel_values", "labels"))
    )
    if not step:
        return model(input_ids=input_ids, inputs_embeds=inputs_embeds, **inputs)
    devices = set(getattr(model, "hf_device_map", {}).values())
    if len(devices) > 1:
        raise ValueError(
            f"cache_implementation='static' replays decode steps from a CUDA graph of one GPU, but the model is "
            f"spread over {sorted(map(str, devices))} (device_map): pass disable_compile=True to run them eagerly"
        )
    impl = model.config.get_text_config(decoder=True)._attn_implementation
    if impl != "k3_mla_paged":
        raise ValueError(
            f"cache_implementation='static' replays decode steps from a CUDA graph, which needs "
            f"attn_implementation='k3_mla_paged' (got {impl!r}); or pass disable_compile=True to run them eagerly"
        )
    logits_to_keep = inputs.get("logits_to_keep", 1) or 1
    if cache.decode_graph is None:
        cache.decode_graph = DecodeGraph(model, cache, logits_to_keep)
    logits = cache.decode_graph(input_ids)
    return CausalLMOutputWithPast(logits=logits, **{CACHE_KWARG: cache})


class KimiK3ForCausalLM(_KimiK3GenerationMixin, KimiK3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: KimiK3TextConfig):
        super().__init__(config)
        self.model = KimiK3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """As `KimiK3PreTrainedModel.from_pretrained`; a released (container) directory loads too, as its language
        model: the container loads (MXFP4 conversion, strictness and all) and its `language_model` is returned,
        the vision side dropped (under 0.1 % of the release's weights). A `device_map` dict names text-model
        modules, as for a text-only checkpoint; the vision side goes where the embeddings go."""
        config = kwargs.get("config")
        if config is None and pretrained_model_name_or_path is not None:
            from transformers import AutoConfig

            hub = {k: kwargs[k] for k in ("cache_dir", "force_download", "local_files_only", "token", "revision",
                                          "subfolder", "trust_remote_code") if k in kwargs}
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        if not isinstance(config, KimiK3Config):
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict):
            first = device_map.get("model.embed_tokens", device_map.get("", next(iter(device_map.values()), "cpu")))
            kwargs["device_map"] = {"vision_tower": first, "mm_projector": first, **{
                f"language_model.{name}" if name else "language_model": where for name, where in device_map.items()}}
        want_info = kwargs.pop("output_loading_info", False)
        container, info = KimiK3ForConditionalGeneration.from_pretrained(
            pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        model = container.language_model
        model.generation_config = container.generation_config
        if hasattr(container, "hf_device_map"):
            model.hf_device_map = {name.removeprefix("language_model").removeprefix("."): where
                                   for name, where in container.hf_device_map.items()
                                   if name == "language_model" or name.startswith("language_model.")}
        return (model, info) if want_info else model

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        past_key_values=None,
        cache=None,
        **kwargs,
    ):
        cache = _pop_cache(kwargs, cache, past_key_values)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, use_cache=use_cache, cache=cache,
            output_hidden_states=kwargs.pop("output_hidden_states", None), cu_seqlens=kwargs.pop("cu_seqlens", None),
            cu_seq_lens_q=kwargs.pop("cu_seq_lens_q", None),
        )
        h = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(h[:, keep, :])
        loss = None
        if labels is not None or kwargs.get("shift_labels") is not None:  # shift_labels: already the next tokens
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states,
            **{CACHE_KWARG: getattr(outputs, CACHE_KWARG)},
        )


# ----------------------------------------------------------------------------------------------------------
# The released container: language model, vision tower (MoonViT-V2, SPEC 6), projector
# ----------------------------------------------------------------------------------------------------------

from transformers.activations import ACT2FN  # noqa: E402  (used only by the vision tower and projector)


def vision_rope_angles(grid_thw: torch.Tensor, head_dim: int, theta: float, device=None) -> torch.Tensor:
    """The 2-D rotary of the vision tower: one angle per rotated pair of head dims, `[total_patches, head_dim / 2]`.

    The one place that fixes the frequency layout (MoonViT's, as in Kimi-VL's reference code): the head dim is cut
    into `head_dim / 2` adjacent pairs `(2p, 2p + 1)`, each turned as one complex number. Pair `2j` turns by
    `col * f_j`, pair `2j + 1` by `row * f_j`, with `f_j = theta ** (-4j / head_dim)` for `j < head_dim / 4`: half
    the dims follow the row, half the column, with the same frequencies. `(row, col)` is the patch's place in its
    own image's `(h, w)` grid (raster order, the order of `pixel_values`), so every image starts at (0, 0).
    """
    freqs = theta ** (-torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)  # [D/4]
    rows, cols = [], []
    for t, h, w in grid_thw.tolist():  # built on the CPU (small integer work) and moved once
        rows.append(torch.arange(h).repeat_interleave(w).repeat(t))  # [t*h*w]
        cols.append(torch.arange(w).repeat(h * t))
    row, col = torch.cat(rows).float(), torch.cat(cols).float()
    angles = torch.stack([col[:, None] * freqs, row[:, None] * freqs], dim=-1)  # [N, D/4, 2]: (col, row)
    return angles.flatten(1).to(device)  # [N, D/2]


def vision_groups(bounds: list[int], device) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Images of equal patch count, batched together for attention: `(perm, inverse, [(n_images, length)])`.

    `perm` [N] lists the patch rows group by group (images of one length in input order), `inverse` undoes it,
    so one attention call per distinct length serves a whole batch of same-sized images.
    """
    by_length: dict[int, list[int]] = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        by_length.setdefault(b - a, []).append(a)
    perm = torch.cat([torch.arange(a, a + n) for n, starts in by_length.items() for a in starts])
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(len(perm))
    sizes = [(len(starts), n) for n, starts in by_length.items()]
    return perm.to(device), inverse.to(device), sizes


def apply_vision_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x `[N, H, D]`, angles `[N, D/2]`: pair p of every head turned by `angles[:, p]`, in fp32."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # each [N, H, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # [N, 1, D/2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).to(x.dtype)


def vision_eager_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Bidirectional attention, query/key/value `[B, H, L, D]` -> `[B, L, H, D]`; softmax in fp32."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    probs = F.dropout(scores.softmax(-1), p=dropout, training=module.training)
    return torch.matmul(probs.to(value.dtype), value).transpose(1, 2).contiguous(), probs


def _check_vision_inputs(pixel_values: torch.Tensor, grid_thw: torch.Tensor, vc) -> torch.Tensor:
    """Validate the flattened-patch layout (see `KimiK3VisionTower`) and return `grid_thw` as int64 on the CPU."""
    p = vc.patch_size
    if not torch.is_tensor(grid_thw) or grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        shape = list(grid_thw.shape) if torch.is_tensor(grid_thw) else type(grid_thw).__name__
        raise ValueError(f"image_grid_thw must be a [num_images, 3] tensor of (t, h, w) patch counts, got {shape}")
    grid = grid_thw.detach().to("cpu", torch.long)
    if bool((grid <= 0).any()):
        raise ValueError(f"image_grid_thw entries must be positive, got {grid.tolist()}")
    if bool((grid[:, 0] != 1).any()):
        raise ValueError(f"image_grid_thw: only still images (t = 1) are supported, got t = {grid[:, 0].tolist()}")
    kh, kw = vc.merge_kernel_size
    if bool((grid[:, 1] % kh != 0).any() or (grid[:, 2] % kw != 0).any()):
        raise ValueError(
            f"image_grid_thw: h and w must be multiples of merge_kernel_size {vc.merge_kernel_size} "
            f"(the image processor pads to {p * kh} px), got {grid[:, 1:].tolist()}"
        )
    if pixel_values.dim() != 2 or pixel_values.shape[1] != 3 * p * p:
        raise ValueError(
            f"pixel_values must be flattened patches [total_patches, 3*{p}*{p}] = [N, {3 * p * p}], "
            f"got {list(pixel_values.shape)}"
        )
    total = int(grid.prod(-1).sum())
    if pixel_values.shape[0] != total:
        raise ValueError(
            f"pixel_values has {pixel_values.shape[0]} patches but image_grid_thw {grid.tolist()} describes {total}"
        )
    return grid


class KimiK3VisionMLP(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.fc0 = nn.Linear(vc.vt_hidden_size, vc.vt_intermediate_size, bias=False)
        self.act = ACT2FN[vc.activation_func]
        self.fc1 = nn.Linear(vc.vt_intermediate_size, vc.vt_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.act(self.fc0(x)))


class KimiK3VisionBlock(GradientCheckpointingLayer):
    """Pre-norm ViT block: `x + wo(attn(norm0(x)))`, then `x + mlp(norm1(x))`. No biases anywhere."""

    def __init__(self, vc):
        super().__init__()
        self.config = vc
        self.num_heads, self.head_dim = vc.vt_num_attention_heads, vc.vt_head_dim
        self.scaling = self.head_dim**-0.5
        self.is_causal = False  # read by transformers' attention functions
        self.norm0 = KimiK3RMSNorm(vc.vt_hidden_size, eps=vc.vt_norm_eps)
        self.norm1 = KimiK3RMSNorm(vc.vt_hidden_size, eps=vc.vt_norm_eps)
        self.wqkv = nn.Linear(vc.vt_hidden_size, 3 * vc.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(vc.qkv_hidden_size, vc.vt_hidden_size, bias=False)
        self.mlp = KimiK3VisionMLP(vc)

    def _attention(self, x, angles, cu_seqlens, bounds, groups):
        N, H, D = x.shape[0], self.num_heads, self.head_dim
        # The fused projection is laid out (q | k | v), each (head, head_dim), as MoonViT's reference code.
        q, k, v = self.wqkv(x).view(N, 3, H, D).unbind(1)  # each [N, H, D]
        q, k = apply_vision_rope(q, angles), apply_vision_rope(k, angles)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, N, D]
        impl = self.config._attn_implementation or "sdpa"
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(impl, vision_eager_attention_forward)
        if "flash" in impl:
            max_seqlen = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
            # Varlen kernels take the images as one stream cut at cu_seqlens: no padding, no mask.
            out, _ = attention(
                self, q, k, v, None, dropout=0.0, scaling=self.scaling, is_causal=False,
                cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen,
            )
        else:
            # One batched call per group of equally long images (`vision_groups`): the block-diagonal pattern
            # without an N x N mask (which would also keep sdpa off its fused kernels) and without a call per image.
            perm, inverse, sizes = groups
            q, k, v = (t[0].index_select(1, perm) for t in (q, k, v))  # [H, N, D], grouped order
            outs, start = [], 0
            for n_img, length in sizes:
                sl = slice(start, start + n_img * length)
                qg, kg, vg = (t[:, sl].view(H, n_img, length, D).transpose(0, 1) for t in (q, k, v))  # [n, H, L, D]
                o = attention(self, qg, kg, vg, None, dropout=0.0, scaling=self.scaling, is_causal=False)[0]
                outs.append(o.reshape(n_img * length, H, D))  # [n * L, H, D]
                start += n_img * length
            out = torch.cat(outs).index_select(0, inverse)  # [N, H, D], back in image order
        return self.wo(out.reshape(N, H * D))

    def forward(self, x, angles, cu_seqlens, bounds, groups):
        """x `[N, hidden]`; cu_seqlens the image boundaries on x's device (int32), bounds the same as a list,
        groups the equal-length image groups of `vision_groups`."""
        x = x + self._attention(self.norm0(x), angles, cu_seqlens, bounds, groups)
        return x + self.mlp(self.norm1(x))


class KimiK3VisionPosEmb(nn.Module):
    """The learnable table `[init_pos_emb_height, init_pos_emb_width, hidden]`, resized to each image's grid."""

    def __init__(self, vc):
        super().__init__()
        self.mode = vc.pos_emb_interpolation_mode
        self.weight = nn.Parameter(torch.zeros(vc.init_pos_emb_height, vc.init_pos_emb_width, vc.vt_hidden_size))

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """x `[total_patches, hidden]` in raster order per image; grid `[num_images, 3]` (t = 1)."""
        table = self.weight.float().permute(2, 0, 1)[None]  # [1, hidden, H0, W0]
        resized = {}  # one interpolation per distinct grid, not per image
        parts = []
        for _, h, w in grid.tolist():
            if (h, w) not in resized:
                if (h, w) == tuple(self.weight.shape[:2]):
                    pos = table[0]
                else:
                    # align_corners=False (torch's default, and MoonViT's): the table's cells are areas covering
                    # the grid, not points at its corners; the same call for growing and shrinking.
                    pos = F.interpolate(table, size=(h, w), mode=self.mode, align_corners=False)[0]
                resized[(h, w)] = pos.flatten(1).T  # [h*w, hidden]
            parts.append(resized[(h, w)])
        return x + torch.cat(parts).to(x.dtype)


class KimiK3VisionTower(nn.Module):
    """MoonViT-V2 under its released names: patch conv, position table, rotary ViT blocks, final norm, 2x2 merge.

    Inputs (the layout of transformers' Qwen2-VL family, which `KimiK3ImageProcessor` writes):
        pixel_values `[total_patches, 3 * patch_size**2]`: one row per 14x14 patch, flattened channels-first
            `(3, 14, 14)`; an image's patches in raster order over its `(h, w)` patch grid; images one after the other.
        grid_thw `[num_images, 3]`: `(t, h, w)` per image in patches; t = 1 (still images only), h and w multiples of
            the merge kernel.
    Returns `[sum(h * w / 4), 4 * hidden]`: per image, its 2x2 neighbourhoods in raster order over `(h/2, w/2)`,
    each the concatenation of its four patches in the order (0, 0), (0, 1), (1, 0), (1, 1).
    Images attend only within themselves (varlen over `cu_seqlens`), so a batch gives each image's result alone.
    """

    def __init__(self, vc):
        super().__init__()
        self.config = vc
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, vc.vt_hidden_size, vc.patch_size, vc.patch_size, bias=False)
        self.patch_embed.pos_emb = KimiK3VisionPosEmb(vc)
        self.encoder = nn.Module()
        self.encoder.blocks = nn.ModuleList([KimiK3VisionBlock(vc) for _ in range(vc.vt_num_hidden_layers)])
        self.encoder.final_layernorm = KimiK3RMSNorm(vc.vt_hidden_size, eps=vc.vt_norm_eps)

    def patch_merge(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        kh, kw = self.config.merge_kernel_size
        d = x.shape[-1]
        # One gather: per image, its rows in (h/kh, w/kw, kh, kw) order, the index built on the CPU.
        order, start = [], 0
        for _, h, w in grid.tolist():
            rows = torch.arange(h * w).view(h // kh, kh, w // kw, kw).permute(0, 2, 1, 3)  # [h/kh, w/kw, kh, kw]
            order.append(rows.reshape(-1) + start)
            start += h * w
        index = torch.cat(order).to(x.device)
        return x.index_select(0, index).view(-1, kh * kw * d)  # [N / (kh * kw), kh * kw * d]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        vc = self.config
        grid = _check_vision_inputs(pixel_values, grid_thw, vc)
        weight = self.patch_embed.proj.weight
        patches = pixel_values.to(weight.dtype).view(-1, 3, vc.patch_size, vc.patch_size)  # [N, 3, p, p]
        x = self.patch_embed.proj(patches).flatten(1)  # [N, hidden]
        x = self.patch_embed.pos_emb(x, grid)
        bounds = F.pad(grid.prod(-1).cumsum(0), (1, 0))  # [num_images + 1], on the CPU: no device syncs
        cu_seqlens = bounds.to(device=x.device, dtype=torch.int32)
        bounds = bounds.tolist()
        angles = vision_rope_angles(grid, vc.vt_head_dim, vc.vt_rope_theta, device=x.device)
        groups = vision_groups(bounds, x.device)
        for block in self.encoder.blocks:
            x = block(x, angles, cu_seqlens, bounds, groups)
        return self.patch_merge(self.encoder.final_layernorm(x), grid)


class KimiK3Projector(nn.Module):
    """Merged patches `[M, 4 * hidden]` -> text embeddings `[M, text_hidden]`: Linear, GELU, Linear, RMSNorm."""

    def __init__(self, vc):
        super().__init__()
        merged = vc.mm_hidden_size * vc.merge_kernel_size[0] * vc.merge_kernel_size[1]
        self.proj = nn.Sequential(nn.Linear(merged, merged, bias=False), ACT2FN[vc.projector_hidden_act],
                                  nn.Linear(merged, vc.text_hidden_size, bias=False))
        self.post_norm = KimiK3RMSNorm(vc.text_hidden_size, eps=vc.projector_ln_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(x))


class KimiK3ForConditionalGeneration(_KimiK3GenerationMixin, KimiK3PreTrainedModel, GenerationMixin):
    """The released container. Images enter as `pixel_values` + `image_grid_thw` (see `KimiK3VisionTower`).

    Placeholders follow the transformers convention: the processor repeats the media placeholder token
    (`media_placeholder_token_id`) `h * w / 4` times per image, in image order, and the model scatters the projected
    features over those positions before the language model runs. A count mismatch raises.
    """

    config_class = KimiK3Config
    config: KimiK3Config
    _keys_to_ignore_on_load_unexpected = None
    _tied_weights_keys = {}
    _no_split_modules = ["KimiK3DecoderLayer", "KimiK3VisionBlock"]

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        if config.vision_config.text_hidden_size != config.text_config.hidden_size:
            raise ValueError(
                f"KimiK3 config field `vision_config.text_hidden_size` ({config.vision_config.text_hidden_size}) must "
                f"equal text_config.hidden_size ({config.text_config.hidden_size})"
            )
        if config.vision_config._attn_implementation is None:
            # The tower is no PreTrainedModel, so nothing else resolves its default; the release's own
            # "flash_attention_2" is kept aside (`released_attn_implementation`), so it runs on any machine.
            # Choose another with `set_attn_implementation({"vision_config": "eager"})`.
            config.vision_config._attn_implementation_internal = "sdpa"
        self.language_model = KimiK3ForCausalLM(config.text_config)
        self.vision_tower = KimiK3VisionTower(config.vision_config)
        self.mm_projector = KimiK3Projector(config.vision_config)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, KimiK3VisionPosEmb) and module.weight.device.type != "meta":
            module.weight.normal_(0.0, 1.0)  # MoonViT's initialisation of the table

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def set_output_embeddings(self, value):  # resize_token_embeddings swaps the head through this
        self.language_model.set_output_embeddings(value)

    def get_image_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per image, its projected features `[h * w / 4, text_hidden]`, in input order."""
        features = self.mm_projector(self.vision_tower(pixel_values, grid_thw))
        kh, kw = self.config.vision_config.merge_kernel_size
        counts = (grid_thw.detach().to("cpu", torch.long).prod(-1) // (kh * kw)).tolist()
        return features.split(counts)

    def get_placeholder_mask(self, input_ids, inputs_embeds, image_features: torch.Tensor) -> torch.Tensor:
        """Bool mask `[B, T, hidden]` of the placeholder positions; raises unless they match the feature count."""
        ph = self.config.media_placeholder_token_id
        if input_ids is not None:
            is_ph = input_ids == ph
        else:
            token = self.get_input_embeddings()(torch.tensor(ph, device=inputs_embeds.device))
            is_ph = (inputs_embeds == token.to(inputs_embeds.dtype)).all(-1)
        found, needed = int(is_ph.sum()), image_features.shape[0]
        if found != needed:
            raise ValueError(
                f"the prompt holds {found} image placeholder tokens (id {ph}) but the images give {needed} features: "
                f"each image needs its placeholder repeated h*w/4 times (the processor expands it)"
            )
        return is_ph[..., None].expand_as(inputs_embeds)

    def forward(self, input_ids=None, pixel_values=None, image_grid_thw=None, attention_mask=None, position_ids=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, past_key_values=None, cache=None,
                grid_thw=None, **kwargs):
        """The language model's arguments, named (Trainer keeps only the dataset columns the forward's signature
        names: with `**kwargs` alone it dropped `labels`), plus the images."""
        grid_thw = image_grid_thw if image_grid_thw is not None else grid_thw
        cache = _pop_cache(kwargs, cache, past_key_values)
        kwargs.update(attention_mask=attention_mask, position_ids=position_ids, labels=labels, use_cache=use_cache,
                      logits_to_keep=logits_to_keep, cache=cache)
        if pixel_values is None:
            continuing = cache is not None and cache.get_seq_length() > 0
            # A placeholder token sampled during decoding is embedded as an ordinary token; in a fresh prompt it
            # means an image is missing.
            if (not continuing and input_ids is not None
                    and bool((input_ids == self.config.media_placeholder_token_id).any())):
                raise ValueError(
                    f"input_ids contain the media placeholder token {self.config.media_placeholder_token_id} "
                    "but no pixel_values were given"
                )
            return self.language_model(input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)
        if grid_thw is None:
            raise ValueError("pixel_values were given without image_grid_thw ([num_images, 3] of (t, h, w))")
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
            inputs_embeds = self.get_input_embeddings()(input_ids)
        features = torch.cat(self.get_image_features(pixel_values, grid_thw)).to(inputs_embeds.dtype)
        mask = self.get_placeholder_mask(input_ids, inputs_embeds, features)
        inputs_embeds = inputs_embeds.masked_scatter(mask, features)
        return self.language_model(inputs_embeds=inputs_embeds, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, inputs_embeds=None, **kwargs):
        """Images go in with the prompt only; later steps continue from the cache, which already holds them.

        The named arguments are there because generate validates its kwargs against this signature.
        """
        first = kwargs.get("is_first_iteration")
        if first is None:  # older transformers: the first step is the one that starts from an empty cache
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            first = cache is None or cache.get_seq_length() == 0
        inputs = super().prepare_inputs_for_generation(
            input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs
        )
        if not first and inputs.get("use_cache", kwargs.get("use_cache", True)) is not False:
            for key in ("pixel_values", "image_grid_thw", "grid_thw"):
                inputs.pop(key, None)
        return inputs


__all__ = [
    "KimiK3PreTrainedModel", "KimiK3Model", "KimiK3ForCausalLM", "KimiK3ForConditionalGeneration",
    "KimiK3Attention", "KimiK3DeltaAttention", "KimiK3LatentMoE", "KimiK3Experts", "KimiK3DecoderLayer",
    "KimiK3VisionTower", "KimiK3VisionBlock", "KimiK3Projector",
]
