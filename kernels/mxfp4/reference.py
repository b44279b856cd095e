"""Pure PyTorch reference for OCP MXFP4 (compressed-tensors ``mxfp4-pack-quantized`` layout).

Layout of a weight ``W`` of shape ``[..., rows, cols]``:

* ``weight_packed``: ``uint8 [..., rows, cols // 2]``, two E2M1 codes per byte along the last (input) dim,
  the LOW nibble holds the even element, the HIGH nibble the odd one.
* ``weight_scale``: ``uint8 [..., rows, cols // 32]``, one E8M0 exponent byte per 32 consecutive inputs,
  value ``2 ** (byte - 127)``. Byte 255 (NaN in E8M0) is never produced by :func:`quantize_mxfp4`.

E2M1 code (sign in bit 3): ``[0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, -1, -1.5, -2, -3, -4, -6]``.

Quantisation follows the OCP MX rule: per group of 32, ``e = floor(log2(amax)) - 2`` (2 = emax of E2M1),
clamped to ``[-127, 127]``; codes are round-to-nearest, ties to the even code, saturating at +-6. Groups with
``amax == 0`` get scale byte 0 (``2 ** -127``) and zero codes. The sign bit of a code is the sign bit of the input
(``torch.signbit``), so ``+0.0`` gives code 0, ``-0.0`` and small negatives that round to zero give code 8 (-0).
With this rule ``quantize_mxfp4(dequantize_mxfp4(p, s)) == (p, s)`` bit for bit for any ``(p, s)`` produced by
:func:`quantize_mxfp4` (and for any checkpoint whose scales follow the OCP rule). NaN/Inf inputs are not supported.
"""

from __future__ import annotations

import torch

__all__ = ["E2M1_VALUES", "GROUP_SIZE", "dequantize_mxfp4", "quantize_mxfp4", "e8m0_to_float32"]

GROUP_SIZE = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between consecutive E2M1 magnitudes [0, 0.5, 1, 1.5, 2, 3, 4, 6].
_E2M1_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """Exact E8M0 byte -> float32 ``2 ** (byte - 127)`` built from the bit pattern (byte 0 -> subnormal 2**-127)."""
    b = scale.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)
    return bits.view(torch.float32)


def _check(packed: torch.Tensor, scale: torch.Tensor) -> None:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError(f"weight_packed must be a torch.uint8 tensor, got {getattr(packed, 'dtype', type(packed))}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.uint8:
        raise ValueError(f"weight_scale must be a torch.uint8 tensor, got {getattr(scale, 'dtype', type(scale))}")
    if packed.dim() < 2 or scale.dim() != packed.dim():
        raise ValueError(
            f"weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} must have the same rank (>= 2)"
        )
    if packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(
            f"weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} disagree on leading dims"
        )
    cols = 2 * packed.shape[-1]
    if cols != GROUP_SIZE * scale.shape[-1]:
        raise ValueError(
            f"weight_packed last dim {packed.shape[-1]} implies cols={cols}, but weight_scale last dim "
            f"{scale.shape[-1]} implies cols={GROUP_SIZE * scale.shape[-1]} (need cols/2 and cols/32)"
        )


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``packed`` uint8 ``[..., rows, cols/2]`` + ``scale`` uint8 ``[..., rows, cols/32]`` -> ``[..., rows, cols]``."""
    _check(packed, scale)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    p = packed.long()
    codes = torch.stack((p & 0xF, p >> 4), dim=-1)  # even element in the low nibble
    values = table[codes].reshape(*packed.shape[:-1], scale.shape[-1], GROUP_SIZE)
    values = values * e8m0_to_float32(scale)[..., None]  # power-of-two scaling: exact
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1]).to(dtype)


@torch.no_grad()
def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., rows, cols]`` (cols % 32 == 0) -> ``(packed uint8 [..., rows, cols/2], scale uint8 [..., rows, cols/32])``."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ValueError(f"weight must be a floating point tensor, got {getattr(w, 'dtype', type(w))}")
    if w.dim() < 2 or w.shape[-1] % GROUP_SIZE != 0:
        raise ValueError(f"weight shape {tuple(w.shape)}: need rank >= 2 and last dim divisible by {GROUP_SIZE}")
    lead, cols = w.shape[:-1], w.shape[-1]
    x = w.float().reshape(*lead, cols // GROUP_SIZE, GROUP_SIZE)
    amax = x.abs().amax(dim=-1)
    # floor(log2(amax)) exactly: amax = m * 2**k with m in [0.5, 1) -> floor(log2) = k - 1
    _, k = torch.frexp(amax)
    e = (k.to(torch.int32) - 1 - 2).clamp(-127, 127)
    byte = torch.where(amax == 0, torch.zeros_like(e), e + 127)
    inv = e8m0_to_float32((254 - byte).clamp(0, 254))  # 2 ** -e (byte 0 -> e=-127 -> 2**127 = byte 254)
    mag = x.abs() * inv[..., None]
    bounds = torch.tensor(_E2M1_BOUNDARIES, dtype=torch.float32, device=w.device)
    lo = torch.bucketize(mag, bounds, right=False)  # x == boundary -> lower code
    hi = torch.bucketize(mag, bounds, right=True)  # x == boundary -> upper code
    code = torch.where(lo % 2 == 0, lo, hi)  # differs only on ties: pick the even code; saturates at 7 (=6.0)
    code = code | (torch.signbit(x).long() << 3)
    code = code.reshape(*lead, cols)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), byte.to(torch.uint8).contiguous()
