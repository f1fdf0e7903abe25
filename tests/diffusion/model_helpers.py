"""Helpers of the sampling tests in this folder."""

from __future__ import annotations

import torch
from torch import nn


def perturbed(model: nn.Module, seed: int) -> nn.Module:
    """``model`` with N(0, 0.1^2) added to every parameter, in eval mode: adaLN-Zero starts every block as the
    identity and the final layer at zero, which would make the tests' comparisons vacuous."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()
