"""Backend choice for the K3 ops, in one place.

`auto` picks the fastest available path for the tensors' device and falls back to the torch reference with
one warning; an explicitly requested backend that is unavailable raises with an install hint. Only the torch
reference exists in this release of the package: the Triton kernels come with their own issue, and fla is
used only where it is installed and asked for.
"""

from __future__ import annotations

import importlib.util
import logging

from .kda import reference as kda_reference
from .short_conv import reference as conv_reference

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def kda_ops(backend: str, device_type: str):
    """Return `(chunk_kda, fused_recurrent_kda)` for `backend` in {"auto", "torch", "triton", "fla"}."""
    if backend == "torch":
        return kda_reference.chunk_kda, kda_reference.fused_recurrent_kda
    if backend == "triton":
        raise RuntimeError(
            "kda_backend='triton' was requested but this build of transformers-k3 has no Triton KDA kernels yet; "
            "use kda_backend='torch' (or 'fla' with `pip install fla-core`)."
        )
    if backend == "fla":
        if importlib.util.find_spec("fla") is None or device_type != "cuda":
            raise RuntimeError("kda_backend='fla' needs CUDA tensors and `pip install fla-core`.")
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        return chunk_kda, fused_recurrent_kda
    if backend != "auto":
        raise ValueError(f"kda_backend must be one of auto, torch, triton, fla; got {backend!r}")
    if device_type == "cuda":
        _warn_once("kda-auto", "transformers-k3: no Triton KDA kernels in this build; using the torch reference.")
    return kda_reference.chunk_kda, kda_reference.fused_recurrent_kda


def causal_conv1d(*args, **kwargs):
    return conv_reference.causal_conv1d(*args, **kwargs)
