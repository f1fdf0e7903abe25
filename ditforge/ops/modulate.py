"""adaLN modulation (reference PyTorch version; fused kernels share this signature)."""

from __future__ import annotations

import torch


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN modulation ``x * (1 + scale) + shift`` with per-sample shift and scale broadcast over tokens.

    Source: Peebles & Xie 2023, section 3.2 (adaLN), and ``modulate`` in facebookresearch/DiT models.py.

    Args:
        x: (B, N, D) normalised tokens.
        shift, scale: (B, D) per-sample modulation from the conditioning vector.

    Returns:
        (B, N, D), dtype of the inputs' type promotion.
    """
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
