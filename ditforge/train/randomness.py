"""What is random in one training step, as one record: drawn by ``step.step_randomness`` for batches of one
shape and by ``mixed.mixed_step_inputs`` for batches of several, and consumed by ``step.train_step``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepRandomness:
    """Everything random in one training step, for this process's slice of the global batch."""

    noise: torch.Tensor | list[torch.Tensor]  # like x (a list of samples of several shapes: train.mixed)
    t: torch.Tensor  # (B,) int64 timesteps
    drop: torch.Tensor  # (B,) bool, labels (captions) replaced by the null label (caption)
    flip: torch.Tensor  # (B,) bool, horizontal flips
    eps: torch.Tensor | None = None  # like x: the VAE posterior's noise (latents = mean + std * eps), or None
