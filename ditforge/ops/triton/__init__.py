"""Triton kernels (``@triton.jit`` functions only); the PyTorch-facing ops that launch them live in
``ditforge.ops.fused``."""
