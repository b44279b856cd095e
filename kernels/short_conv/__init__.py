"""Depthwise causal short-convolution reference kernels."""

from .reference import causal_conv1d

__all__ = ["causal_conv1d"]
