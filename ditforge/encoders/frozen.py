"""What the frozen encoders (text encoder, VAE) share: a wrapped ``self.model`` whose device and dtype they report."""

from __future__ import annotations

import torch


class FrozenModel:
    """Base of the encoder wrappers: ``self.model`` is an eval-mode module with ``requires_grad_(False)``."""

    model: torch.nn.Module

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def to(self, device=None, dtype: torch.dtype | None = None):
        """Moves (and casts) the weights in place; returns self."""
        self.model.to(device=device, dtype=dtype)
        return self
