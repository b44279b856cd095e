"""OCP MXFP4 (compressed-tensors ``mxfp4-pack-quantized``) reference quantise / dequantise."""

from .reference import E2M1_VALUES, GROUP_SIZE, dequantize_mxfp4, e8m0_to_float32, quantize_mxfp4

__all__ = ["E2M1_VALUES", "GROUP_SIZE", "dequantize_mxfp4", "e8m0_to_float32", "quantize_mxfp4"]
