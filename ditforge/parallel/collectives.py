"""Collectives the parallel code shares: the autograd-correct all-to-all (Ulysses, the STDiT frame exchange) and
all-gather (the sequence gather, a joint attention's text heads, the GAN head's token logits), the gradient mean of
a tensor every process of a group holds alike (the GAN head's input under context parallelism), single-tensor
all-gather / reduce-scatter under their PyTorch >= 2.13 names with the older ones as fallback (FastSeq, the sequence
gather, CFG parallelism), and the means over all processes of logged values and of replicated parameters' gradients
(the trainer's metrics, data-parallel distillation)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ditforge.parallel.mesh import Dist


def mean_over_processes(values: dict[str, torch.Tensor | float], d: Dist) -> dict[str, float]:
    """Average 0-dim tensors (or numbers) over all processes (one all-reduce) and read them on the host."""
    keys = sorted(values)
    stacked = torch.stack([torch.as_tensor(values[k], dtype=torch.float64) for k in keys])
    if d.mesh is not None:
        stacked = stacked.to(d.device)
        dist.all_reduce(stacked)
        stacked /= d.world_size
    return dict(zip(keys, stacked.tolist()))


def sum_over_processes(counts: list[int], d: Dist) -> list[int]:
    """Integers summed over all processes (one all-reduce, read on the host): a two-expert batch's rows per expert
    (``adapters.by_expert``'s ``agree``)."""
    total = torch.tensor(counts, dtype=torch.int64, device=d.device)
    if d.mesh is not None:
        dist.all_reduce(total)
    return total.tolist()


def average_gradients(params: list[torch.Tensor], d: Dist) -> None:
    """Replace the gradients of ``params`` (replicated on every process, each gradient of its process's samples) by
    their mean over all processes, in one all-reduce of their concatenation (gloo has no average: a sum, then / n):
    with equal shares of the global batch, the gradient of the global batch's mean loss. Parameters without a
    gradient are left out (the same ones on every process). A no-op in one process."""
    grads = [p.grad for p in params if p.grad is not None]
    if d.mesh is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= d.world_size
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0: ``x`` is (P, ...); slice i goes to group rank i, and slice i of the
    result came from group rank i. The operation is a permutation of blocks across ranks and its own
    adjoint, so the backward is the same all-to-all of the gradient (Jacobs et al. 2023, section 3)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


# Eager inside compiled blocks (a graph break on each side). Traced by torch.compile on CUDA (torch 2.11, NCCL), the
# collectives inside these autograd Functions gave the right forward but no gradient: the qkv gradient of a compiled
# Ulysses block was exactly 0 on 4 H200s, while eager it equals one GPU's to bf16 rounding (2026-11-28; gloo on the
# CPU traced them correctly). The attention around them is one SDPA kernel either way.
@torch.compiler.disable
def all_to_all(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Autograd-aware equal-split all-to-all over dim 0 of ``x`` (size P = group size), see ``_AllToAll``."""
    return _AllToAll.apply(x, group)


def all_gather_single(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """``all_gather_single`` (PyTorch >= 2.13) or its older name ``all_gather_into_tensor``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, x, group=group, async_op=async_op)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group: ProcessGroup) -> None:
    """``reduce_scatter_single`` (PyTorch >= 2.13) or its older name ``reduce_scatter_tensor`` (sum)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, group=group)


class _GatherDim1(torch.autograd.Function):
    """(B, n, ...) slices of the group -> (B, P n, ...) in rank order; backward: the gradient summed over the group,
    this rank's slice (a reduce-scatter: each rank's copy of the gathered tensor feeds its own part of the loss).
    The collectives work on dim 1 moved to the front, with the single-tensor all-gather / reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        local = x.transpose(0, 1).contiguous()  # (n, B, ...)
        out = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
        all_gather_single(out, local, group)
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        full = grad.transpose(0, 1).contiguous()  # (P n, B, ...)
        out = full.new_empty((full.shape[0] // dist.get_world_size(ctx.group), *full.shape[1:]))
        reduce_scatter_single(out, full, ctx.group)
        return out.transpose(0, 1), None


@torch.compiler.disable  # eager inside compiled blocks, as all_to_all
def gather_dim1(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Autograd-aware all-gather of ``x`` (B, n, ...) along dim 1 over ``group``, see ``_GatherDim1``."""
    return _GatherDim1.apply(x, group)


class MapGradient(torch.autograd.Function):
    """Identity forward; backward: ``fn(gradient)`` (``MapGradient.apply(x, fn)``: ``mean_gradient``'s, and
    ``parallel.context.scale_gradient``'s gradient times the group size)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn) -> torch.Tensor:
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.fn(grad), None


def _group_mean(grad: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    grad = grad.contiguous()
    dist.all_reduce(grad, group=group)  # gloo has no average: a sum, then / P
    return grad / dist.get_world_size(group)


@torch.compiler.disable  # eager, as all_to_all
def mean_gradient(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``x`` (any shape), which every process of ``group`` holds alike, with its gradient averaged over the group.
    Where such a tensor enters a computation split over the group whose collectives' backwards are their adjoints
    (``all_to_all``, ``gather_dim1``'s reduce-scatter) and every process computes the same loss from the result, each
    process's gradient of ``x`` is the gradient of the group's P losses through its part of the computation, and
    their sum P times the gradient of one loss; the mean is that gradient, the same on every process, as a tensor
    every process holds alike needs (the gradient of the generator's GAN loss in its sample, ``distill_real``)."""
    return MapGradient.apply(x, lambda grad: _group_mean(grad, group))
