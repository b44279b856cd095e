"""Backend choice for the K3 ops, in one place.

`auto` picks the fastest available path for the tensors' device and falls back to the torch reference with
one warning; an explicitly requested backend that is unavailable raises with an install hint. KDA: "triton"
(and "auto" on CUDA with Triton installed) runs decode on the Triton recurrent kernel and prefill on the
Triton chunk kernel where that module exists (else the torch chunk reference, with one warning); Triton
modules are imported only here, lazily. fla is used only where it is installed and asked for.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from .gated_norm import reference as gated_norm_reference
from .kda import reference as kda_reference
from .short_conv import reference as conv_reference

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_kda_ops():
    """The Triton recurrent kernel, and the Triton chunk kernel when that module is present."""
    from .kda.triton_recurrent import fused_recurrent_kda

    # The chunk kernel ships separately: only its absence falls back; a broken module still raises.
    if importlib.util.find_spec(f"{__package__}.kda.triton_chunk") is None:
        _warn_once(
            "kda-triton-chunk",
            "transformers-k3: no Triton chunk KDA kernel in this build; prefill uses the torch reference "
            "(decode uses the Triton recurrent kernel).",
        )
        return kda_reference.chunk_kda, fused_recurrent_kda
    from .kda.triton_chunk import chunk_kda

    return chunk_kda, fused_recurrent_kda


def _chunk_tiles_fit(head_dim: int | None) -> bool:
    """The Triton chunk kernel tiles K = V = head_dim with tl.dot: a power of two >= 16."""
    return head_dim is None or (head_dim >= 16 and head_dim & (head_dim - 1) == 0)


def kda_ops(backend: str, device_type: str, head_dim: int | None = None):
    """Return `(chunk_kda, fused_recurrent_kda)` for `backend` in {"auto", "torch", "triton", "fla"}.

    `head_dim` (K = V of the layer), when given, is checked against the Triton chunk kernel's tiles: an explicit
    "triton" raises for a head dim it cannot tile, "auto" then runs the chunked prefill on the torch reference
    (warning once) and keeps the Triton decode kernel, which takes any head dim.
    """
    if backend == "torch":
        return kda_reference.chunk_kda, kda_reference.fused_recurrent_kda
    if backend == "triton":
        if device_type != "cuda":
            raise RuntimeError(
                f"kda_backend='triton' needs CUDA tensors (got device type {device_type!r}); "
                "use kda_backend='torch' or 'auto' on this device."
            )
        if not _triton_available():
            raise RuntimeError("kda_backend='triton' needs Triton: `pip install triton` (or use kda_backend='torch').")
        if not _chunk_tiles_fit(head_dim):
            raise ValueError(
                f"kda_backend='triton': linear_attn_config.head_dim = {head_dim} is not a power of two >= 16, which "
                "the Triton chunk kernel needs; use kda_backend='auto' (torch reference for prefill) or 'torch'."
            )
        return _triton_kda_ops()
    if backend == "fla":
        if importlib.util.find_spec("fla") is None or device_type != "cuda":
            raise RuntimeError("kda_backend='fla' needs CUDA tensors and `pip install fla-core`.")
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        return chunk_kda, fused_recurrent_kda
    if backend != "auto":
        raise ValueError(f"kda_backend must be one of auto, torch, triton, fla; got {backend!r}")
    if device_type == "cuda":
        if _triton_available():
            chunk, recurrent = _triton_kda_ops()
            if not _chunk_tiles_fit(head_dim):
                _warn_once(
                    "kda-auto-head-dim",
                    f"transformers-k3: KDA head_dim {head_dim} is not a power of two >= 16; chunked prefill uses the "
                    "torch reference (decode stays on the Triton kernel).",
                )
                chunk = kda_reference.chunk_kda
            return chunk, recurrent
        _warn_once("kda-auto", "transformers-k3: Triton is not installed; KDA uses the torch reference on CUDA.")
    return kda_reference.chunk_kda, kda_reference.fused_recurrent_kda


def _fused_inference(backend: str, device_type: str, *tensors) -> bool:
    """Whether the KDA layer's fused inference kernels (the short-conv step, the gated output norm) run.

    They follow the layer's `kda_backend`: "triton" (CUDA, Triton installed, else raises as `kda_ops` does) and
    "auto" (CUDA with Triton; without Triton the torch path, warned once by `kda_ops`); "torch" and "fla" keep
    the torch path. They have no backward, so a call that needs gradients runs the torch path under every backend.
    """
    if backend not in ("triton", "auto"):
        return False
    if backend == "triton" and (device_type != "cuda" or not _triton_available()):
        raise RuntimeError(
            f"kda_backend='triton' needs CUDA tensors and Triton (got device type {device_type!r}); "
            "use kda_backend='torch' or 'auto'."
        )
    if device_type != "cuda" or not _triton_available():
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def causal_conv1d(x, weight, initial_state=None, output_final_state=False, cu_seqlens=None, activation="silu",
                  backend: str = "torch"):
    """The KDA short conv: the Triton decode step (`short_conv.triton_conv`) for a few cached tokens (T <= 16,
    no varlen) when `_fused_inference` allows, else the torch reference (prefill: cuDNN's conv1d)."""
    if (initial_state is not None and cu_seqlens is None and x.dim() == 3 and x.shape[1] <= 16
            and _fused_inference(backend, x.device.type, x, weight, initial_state)):
        from .short_conv.triton_conv import causal_conv1d_step

        y, state = causal_conv1d_step(x, weight, initial_state, activation=activation)
        return y, (state if output_final_state else None)
    return conv_reference.causal_conv1d(x, weight, initial_state=initial_state, output_final_state=output_final_state,
                                        cu_seqlens=cu_seqlens, activation=activation)


def gated_rms_norm(o, gate, weight, eps, backend: str = "torch"):
    """KDA's output `sigmoid(gate) * RMSNorm(o)`: one Triton launch when `_fused_inference` allows, else the
    torch reference (`gated_norm.reference`)."""
    if _fused_inference(backend, o.device.type, o, gate, weight):
        from .gated_norm.triton_gated_norm import gated_rms_norm_triton

        return gated_rms_norm_triton(o, gate, weight, eps)
    return gated_norm_reference.gated_rms_norm(o, gate, weight, eps)


def attn_res(candidates, query_weight, norm_weight, eps):
    """AttnRes mix: the fused Triton kernel on CUDA when Triton is installed, else the torch reference (which is
    also the CPU path). Same inputs and outputs either way: a list of `[..., d]` candidates -> `[..., d]`."""
    from .attnres import reference as attnres_reference

    if candidates[0].device.type == "cuda":
        if _triton_available():
            from .attnres.triton_attnres import attn_res_triton

            return attn_res_triton(candidates, query_weight, norm_weight, eps)
        _warn_once("attnres-auto", "transformers-k3: Triton is not installed; AttnRes uses the torch reference on CUDA.")
    return attnres_reference.attn_res(candidates, query_weight, norm_weight, eps)
