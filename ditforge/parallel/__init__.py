"""Apply data parallelism and activation checkpointing to a model from outside (as torchtitan does):
the model code knows nothing of them."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ditforge.ops.attention import set_attention_backend
from ditforge.parallel.mesh import Dist

log = logging.getLogger(__name__)


def resolve_plugin(plugin: str, world_size: int) -> str:
    """The plugin that runs: ``none`` in one process whatever was asked (there is nothing to distribute);
    with several processes ``auto`` or ``none`` become ``zero2`` (OpenDiT's default)."""
    if world_size == 1:
        return "none"
    return "zero2" if plugin in ("auto", "none") else plugin


def parallelize(
    model: nn.Module,
    dist: Dist,
    plugin: str = "none",
    grad_checkpoint: bool = False,
    compile: bool = False,
    enable_flashattn: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Prepare ``model`` for (distributed) training without touching its code.

    Args:
        model: a model with a ``blocks`` ModuleList (every DiT), fp32, on ``dist.device``.
        plugin: ``none`` (one process), ``ddp`` (DistributedDataParallel: all replicated, gradients
            all-reduced), ``zero2`` (FSDP2 ``fully_shard`` with ``reshard_after_forward=False``: gradients
            and optimizer states sharded, parameters gathered once per step and kept through the backward),
            ``fsdp`` (ZeRO-3: parameters resharded after the forward and gathered again for the backward).
        grad_checkpoint: recompute each block's activations in the backward (Chen et al. 2016).
        enable_flashattn: route attention through the fastest exact SDPA backend (``ops.attention``).
        compile: ``torch.compile`` each block in place (after checkpointing, before sharding, as torchtitan
            orders them); every block has the same code, so it compiles once.
        param_dtype: dtype of the gathered parameters under zero2/fsdp (the compute dtype); the sharded fp32
            parameters stay the optimizer's master weights.
        reduce_dtype: dtype of the gradient reduction (fp32 by default; bf16 halves its traffic).

    Returns:
        The model to train: the same module (fully_shard works in place) or a DDP wrapper around it.
        State-dict keys of the plain model are reachable through torch.distributed.checkpoint.state_dict.
    """
    log.info("attention: %s", set_attention_backend(enable_flashattn))
    if grad_checkpoint:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    if compile:
        for block in model.blocks:
            block.compile()
    if plugin == "ddp":
        ddp = DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)
        if reduce_dtype == torch.bfloat16:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            ddp.register_comm_hook(None, bf16_compress_hook)
        return ddp
    if plugin in ("zero2", "fsdp"):
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        reshard = plugin == "fsdp"
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            # The last block is the first one the backward needs: resharding it would only gather it again.
            fully_shard(block, mesh=dist.mesh, reshard_after_forward=reshard and i < len(blocks) - 1, mp_policy=mp)
        if reshard:  # gather two blocks ahead in the backward, so each gather hides behind more compute
            for i, block in enumerate(blocks):
                block.set_modules_to_backward_prefetch(blocks[max(0, i - 2) : i][::-1])
        # The root's own parameters (embedders, final layer) are used last in the forward: keep them.
        fully_shard(model, mesh=dist.mesh, reshard_after_forward=False, mp_policy=mp)
    return model


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, dist: Dist) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most ``max_norm``; returns the norm before.

    Under zero2/fsdp every gradient is a DTensor shard: the squared norms of the local shards are summed and
    all-reduced once, instead of one reduction per parameter as a DTensor-generic clip does (torchtitan
    does the same). Under DDP or one process the gradients are whole and identical on every rank.
    ``max_norm`` <= 0 only measures.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    squares = torch.stack(torch._foreach_norm(local, 2.0)).float().pow(2).sum()
    if grads and isinstance(grads[0], DTensor):
        torch.distributed.all_reduce(squares, group=dist.mesh.get_group())
    total = squares.sqrt()
    if max_norm > 0:
        torch._foreach_mul_(local, (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 modules are the model itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient reduction on all but the last micro-batch of an accumulated step."""
    if enabled:
        return contextlib.nullcontext()
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if isinstance(model, FSDPModule):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
