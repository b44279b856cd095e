"""Kimi Delta Attention (KDA) reference kernels."""

from .reference import chunk_kda, fused_recurrent_kda, kda_gate, l2norm

__all__ = ["chunk_kda", "fused_recurrent_kda", "kda_gate", "l2norm"]
