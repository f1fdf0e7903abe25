"""Operators every model calls through: one seam for attention, the adaLN operators (reference PyTorch
versions, or fused Triton kernels chosen from outside)."""

from ditforge.ops.attention import attention, self_attention
from ditforge.ops.modulate import gated_residual, layernorm_modulate, modulate

__all__ = ["attention", "self_attention", "gated_residual", "layernorm_modulate", "modulate"]
