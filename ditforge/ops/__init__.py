"""Operators every model calls through: one seam for attention, the adaLN operators (reference PyTorch
versions, or fused Triton kernels chosen from outside)."""

from ditforge.ops.attention import attention, frames_to_positions, positions_to_frames, self_attention
from ditforge.ops.modulate import (
    GatedSum,
    gated_residual,
    layernorm_modulate,
    modulate,
    residual_layernorm_modulate,
)

__all__ = ["attention", "self_attention", "frames_to_positions", "positions_to_frames", "GatedSum", "gated_residual",
           "layernorm_modulate", "modulate", "residual_layernorm_modulate"]
