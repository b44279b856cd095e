"""transformers weight-conversion ops for Kimi K3's MXFP4 routed experts.

Released layout, per MoE layer (``...block_sparse_moe.experts.``)::

    {E}.w1.weight_packed  uint8 [I, D/2]   {E}.w1.weight_scale  uint8 [I, D/32]   (gate)
    {E}.w3.weight_packed  uint8 [I, D/2]   {E}.w3.weight_scale  uint8 [I, D/32]   (up)
    {E}.w2.weight_packed  uint8 [D, I/2]   {E}.w2.weight_scale  uint8 [D, I/32]   (down)

Model layout: ``experts.gate_up_proj [E, 2I, D]`` (w1 rows then w3 rows) and ``experts.down_proj [E, D, I]`` in the
model dtype. Loading dequantises (:func:`k3_kernels.mxfp4.dequantize_mxfp4`); saving re-quantises
(:func:`k3_kernels.mxfp4.quantize_mxfp4`) and splits back to the released per-expert keys, which is bit-exact for
checkpoints whose scales follow the OCP rule (``quantize_mxfp4`` is idempotent on its own output).

Packed layout (``expert_conversions(quantized=True, packed=True)``, for models loaded with ``keep_experts_packed``):
the bytes are only stacked, never converted: ``experts.gate_up_proj_blocks uint8 [E, 2I, D/2]`` +
``gate_up_proj_scales [E, 2I, D/32]`` (w1 rows then w3 rows) and ``down_proj_blocks [E, D, I/2]`` +
``down_proj_scales [E, D, I/32]``; saving splits them back (stock ``MergeModulelist``/``Concatenate`` and their
reverses), so a packed load/save round trip is bit for bit whatever the scales.
"""

from __future__ import annotations

import torch
from transformers.core_model_loading import (
    Concatenate,
    ConversionOps,
    MergeModulelist,
    WeightConverter,
)

from k3_kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

__all__ = [
    "Mxfp4DequantizeMergeExperts",
    "Mxfp4QuantizeSplitExperts",
    "expert_conversions",
]

_PACKED = "weight_packed"
_SCALE = "weight_scale"


def _as_uint8(t: torch.Tensor, name: str) -> torch.Tensor:
    """The loader casts every source to the param dtype (bf16/fp32 hold 0..255 exactly): undo that cast."""
    if t.dtype == torch.uint8:
        return t
    if t.is_floating_point():
        r = t.round()
        if not torch.equal(r, t) or (t.numel() and (t.min() < 0 or t.max() > 255)):
            raise ValueError(f"{name}: expected uint8 codes, got {t.dtype} values that are not bytes")
        return r.to(torch.uint8)
    return t.to(torch.uint8)


def _pairs(patterns: list[str]) -> list[tuple[str, str]]:
    """Group ``[p0.weight_packed, p0.weight_scale, p1.weight_packed, ...]`` into (packed, scale) pairs, in order."""
    if len(patterns) % 2:
        raise ValueError(f"expected (weight_packed, weight_scale) pattern pairs, got {patterns}")
    pairs = list(zip(patterns[0::2], patterns[1::2]))
    for packed, scale in pairs:
        if not (packed.endswith(_PACKED) and scale.endswith(_SCALE)):
            raise ValueError(f"expected a '{_PACKED}' then a '{_SCALE}' pattern, got {packed!r}, {scale!r}")
    return pairs


class Mxfp4DequantizeMergeExperts(ConversionOps):
    """Many-to-one load op: per-expert MXFP4 (packed, scale) lists for each projection -> one ``[E, sum(rows), cols]``.

    ``source_patterns`` are (packed, scale) pairs in output-row order (``w1`` then ``w3`` for ``gate_up_proj``; just
    ``w2`` for ``down_proj``); each pattern maps to a list with one tensor per expert (index order).
    """

    def __init__(self, dim: int = 1):
        self.dim = dim  # row dim of the stacked [E, rows, cols] tensor along which projections are concatenated

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, model=None, full_layer_name=None, **kwargs):
        try:
            dtype = model.get_parameter(full_layer_name).dtype
        except (AttributeError, TypeError):
            dtype = torch.bfloat16
        parts = []
        for packed_pat, scale_pat in _pairs(source_patterns):
            if packed_pat not in input_dict or scale_pat not in input_dict:
                raise ValueError(f"missing {packed_pat!r} or {scale_pat!r} for {full_layer_name}")
            packed = input_dict.pop(packed_pat)
            scale = input_dict.pop(scale_pat)
            packed = packed if isinstance(packed, list) else [packed]
            scale = scale if isinstance(scale, list) else [scale]
            if len(packed) != len(scale):
                raise ValueError(f"{full_layer_name}: {len(packed)} {packed_pat} tensors but {len(scale)} {scale_pat}")
            p = torch.stack([_as_uint8(t, packed_pat) for t in packed], dim=0)
            s = torch.stack([_as_uint8(t, scale_pat) for t in scale], dim=0)
            parts.append(dequantize_mxfp4(p, s, dtype=dtype))
        return {target_patterns[0]: torch.cat(parts, dim=self.dim)}

    @property
    def reverse_op(self) -> ConversionOps:
        return Mxfp4QuantizeSplitExperts(self.dim)


class Mxfp4QuantizeSplitExperts(ConversionOps):
    """One-to-many save op (reverse of :class:`Mxfp4DequantizeMergeExperts`): ``[E, sum(rows), cols]`` -> per-expert
    ``weight_packed`` / ``weight_scale`` keys, the ``*`` in each target pattern replaced by the expert index."""

    def __init__(self, dim: int = 1):
        self.dim = dim

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        if len(input_dict) != 1:
            raise ValueError(f"expected one fused expert tensor, got {list(input_dict)}")
        tensor = next(iter(input_dict.values()))
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        pairs = _pairs(target_patterns)
        out = {}
        for (packed_pat, scale_pat), chunk in zip(pairs, torch.chunk(tensor, len(pairs), dim=self.dim)):
            packed, scale = quantize_mxfp4(chunk)  # [E, rows, cols/2], [E, rows, cols/32]
            for e in range(packed.shape[0]):
                out[packed_pat.replace("*", str(e))] = packed[e].contiguous()
                out[scale_pat.replace("*", str(e))] = scale[e].contiguous()
        return out

    @property
    def reverse_op(self) -> ConversionOps:
        return Mxfp4DequantizeMergeExperts(self.dim)


class StackExpertBytes(ConversionOps):
    """Many-to-one load op for packed experts: per-expert uint8 tensors of one or two projections -> one
    ``[E, sum(rows), cols]``, rows of the projections in pattern order; no numeric change.

    Its own reverse (rather than stock ``MergeModulelist`` + ``Concatenate``) because transformers 5.17's stock
    reverse drops a size-1 trailing dim (a scale column of a small model), which would not save bit for bit.
    """

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, **kwargs):
        parts = []
        for pat in source_patterns:
            if pat not in input_dict:
                raise ValueError(f"missing {pat!r} for {full_layer_name}")
            ts = input_dict.pop(pat)
            ts = ts if isinstance(ts, list) else [ts]
            parts.append(torch.stack([_as_uint8(t, pat) for t in ts], dim=0))  # [E, rows, cols]
        return {target_patterns[0]: torch.cat(parts, dim=1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return SplitExpertBytes()


class SplitExpertBytes(ConversionOps):
    """One-to-many save op (reverse of :class:`StackExpertBytes`): ``[E, sum(rows), cols]`` -> per-expert keys, the
    ``*`` of each target pattern replaced by the expert index, equal row blocks per pattern."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        if len(input_dict) != 1:
            raise ValueError(f"expected one stacked expert tensor, got {list(input_dict)}")
        tensor = next(iter(input_dict.values()))
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        out = {}
        for pat, chunk in zip(target_patterns, torch.chunk(tensor, len(target_patterns), dim=1)):
            for e in range(chunk.shape[0]):
                out[pat.replace("*", str(e))] = chunk[e].contiguous()
        return out

    @property
    def reverse_op(self) -> ConversionOps:
        return StackExpertBytes()


def _stack(sources: list[str], target: str) -> WeightConverter:
    """Per-expert bytes of one or two projections -> one ``[E, rows, cols]`` (rows of the projections in order)."""
    return WeightConverter(source_patterns=sources, target_patterns=target, operations=[StackExpertBytes()])


def expert_conversions(quantized: bool, packed: bool = False) -> list[WeightConverter]:
    """Converters from the released per-expert keys to ``experts.gate_up_proj`` / ``experts.down_proj``.

    ``quantized=True``: MXFP4 ``w{1,2,3}.weight_packed`` + ``weight_scale``, dequantised; with ``packed=True`` they
    are kept as uint8 bytes instead, stacked into ``experts.{gate_up,down}_proj_{blocks,scales}``.
    ``quantized=False``: plain per-expert ``w{1,2,3}.weight`` (stock ``MergeModulelist`` + ``Concatenate``, as
    transformers' mixtral mapping).
    """
    if packed and not quantized:
        raise ValueError("expert_conversions: packed=True needs quantized=True (only MXFP4 experts can stay packed)")
    if packed:
        moe = "block_sparse_moe.experts"
        return [
            _stack([f"{moe}.*.w1.{_PACKED}", f"{moe}.*.w3.{_PACKED}"], f"{moe}.gate_up_proj_blocks"),
            _stack([f"{moe}.*.w1.{_SCALE}", f"{moe}.*.w3.{_SCALE}"], f"{moe}.gate_up_proj_scales"),
            _stack([f"{moe}.*.w2.{_PACKED}"], f"{moe}.down_proj_blocks"),
            _stack([f"{moe}.*.w2.{_SCALE}"], f"{moe}.down_proj_scales"),
        ]
    if quantized:
        return [
            WeightConverter(
                source_patterns=[
                    "block_sparse_moe.experts.*.w1.weight_packed",
                    "block_sparse_moe.experts.*.w1.weight_scale",
                    "block_sparse_moe.experts.*.w3.weight_packed",
                    "block_sparse_moe.experts.*.w3.weight_scale",
                ],
                target_patterns="block_sparse_moe.experts.gate_up_proj",
                operations=[Mxfp4DequantizeMergeExperts(dim=1)],
            ),
            WeightConverter(
                source_patterns=["block_sparse_moe.experts.*.w2.weight_packed", "block_sparse_moe.experts.*.w2.weight_scale"],
                target_patterns="block_sparse_moe.experts.down_proj",
                operations=[Mxfp4DequantizeMergeExperts(dim=1)],
            ),
        ]
    return [
        WeightConverter(
            source_patterns=["block_sparse_moe.experts.*.w1.weight", "block_sparse_moe.experts.*.w3.weight"],
            target_patterns="block_sparse_moe.experts.gate_up_proj",
            operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter(
            source_patterns=["block_sparse_moe.experts.*.w2.weight"],
            target_patterns="block_sparse_moe.experts.down_proj",
            operations=[MergeModulelist(dim=0)],
        ),
    ]
