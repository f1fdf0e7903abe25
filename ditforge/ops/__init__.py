"""Operators every model calls through: one seam for attention, reference versions of fused kernels."""

from ditforge.ops.attention import attention
from ditforge.ops.modulate import modulate

__all__ = ["attention", "modulate"]
