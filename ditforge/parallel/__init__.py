"""Apply parallelism, activation checkpointing and compile to a model from outside (as torchtitan does)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def parallelize(model: nn.Module, grad_checkpoint: bool = False) -> nn.Module:
    """Prepare ``model`` for training without touching its code.

    Args:
        model: a model with a ``blocks`` ModuleList (every DiT).
        grad_checkpoint: recompute each transformer block's activations in the backward pass
            (Chen et al. 2016), trading about one extra forward for activation memory of one block.

    Returns:
        The same model, modified in place. State-dict keys are unchanged (the wrapper strips its prefix).
    """
    if grad_checkpoint:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    return model
