"""KDA's gated output RMSNorm (reference; the Triton kernel beside it is imported lazily by the dispatch)."""

from .reference import gated_rms_norm

__all__ = ["gated_rms_norm"]
