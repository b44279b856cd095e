"""Latent-MoE expert kernels: a torch reference and Triton grouped matmuls for bf16 and MXFP4-packed experts."""
