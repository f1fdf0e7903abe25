"""Tensor parallelism (Megatron-LM's, Shoeybi et al. 2019, section 3) on PyTorch's DTensor, applied from outside.

In every DiT block, each MLP is split by its hidden units (``fc1`` column-wise, ``fc2`` row-wise) and each attention
by its heads (the q, k, v projections column-wise, ``proj`` row-wise), with ``parallelize_module`` and torch's
``ColwiseParallel`` / ``RowwiseParallel``: one all-reduce after each attention and each MLP in the forward, one
before each in the backward. Tokens, adaLN tables and everything outside the blocks stay replicated on the ``tp``
mesh dimension (FSDP2 shards them over ``dp``). The model code is unchanged: its attention reshapes by its
``head_dim``, so a process that holds H / tp heads attends over those.

The fused projections (``qkv``: q, k, v stacked along the output, as timm and the official DiT weights hold them;
cross-attention's ``kv_linear``: k, v) are kept in memory *blocked*: rows reordered so that process r's contiguous
``Shard(0)`` slice holds q, k and v of its own heads. The order depends on the tensor-parallel size, so whatever
leaves the process (checkpoints, the EMA's full weights, the initial weights) is translated to and from the
canonical order here (``checkpoint_layout``, ``restore_from``, ``full_tensor``, ``local_part``), and a checkpoint
resumes under any other tensor-parallel size, or none.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from ditforge.errors import UserError
from ditforge.models.layers import Attention, CrossAttention, Mlp

# a fused projection's parameter name -> how many projections are stacked along its rows
_FUSED = re.compile(r"(^|\.)(qkv|kv_linear)\.(weight|bias)($|\.)")
_PIECES = {"qkv": 3, "kv_linear": 2}


def tensor_parallel_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """``parallelize_module``'s plan for one block: every ``Attention``, ``CrossAttention`` (and their qk-norms) and
    ``Mlp`` in it."""
    plan: dict[str, ParallelStyle] = {}
    for name, m in block.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, Attention):
            plan.update({f"{prefix}qkv": ColwiseParallel(), f"{prefix}proj": RowwiseParallel()})
        elif isinstance(m, CrossAttention):
            plan.update({f"{prefix}q_linear": ColwiseParallel(), f"{prefix}kv_linear": ColwiseParallel(),
                         f"{prefix}proj": RowwiseParallel()})
        if isinstance(m, (Attention, CrossAttention)) and isinstance(m.q_norm, nn.LayerNorm):
            # qk-norm: one LayerNorm shared by all heads, applied to the heads this process holds, (B, h, N, Dh):
            # its weights stay whole, their gradients are summed over the processes (DTensor's Partial -> FSDP2)
            plan.update({f"{prefix}q_norm": SequenceParallel(sequence_dim=1, use_local_output=True),
                         f"{prefix}k_norm": SequenceParallel(sequence_dim=1, use_local_output=True)})
        elif isinstance(m, Mlp):
            plan.update({f"{prefix}fc1": ColwiseParallel(), f"{prefix}fc2": RowwiseParallel()})
    return plan


def check_tensor_parallel(model: nn.Module, size: int) -> None:
    """Raises UserError unless every block's heads and MLP width divide among ``size`` processes."""
    for m in model.modules():
        if isinstance(m, (Attention, CrossAttention)) and m.num_heads % size:
            raise UserError(f"--tensor_parallel {size}: the model's {m.num_heads} attention heads do not divide "
                            f"among {size} processes")
        if isinstance(m, Mlp) and m.fc1.out_features % size:
            raise UserError(f"--tensor_parallel {size}: the MLP's {m.fc1.out_features} hidden units do not "
                            f"divide among {size} processes")


def apply_tensor_parallel(model: nn.Module, blocks: list[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Split every block's attention and MLP over ``tp_mesh`` (1-D, dim ``tp``), in place. A materialised model's
    fused projections are blocked first (a meta model is blocked by ``init_sharded``, through ``local_part``).

    Raises:
        UserError: heads or MLP width that do not divide by the mesh size.
    """
    size = tp_mesh.size()
    check_tensor_parallel(model, size)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _pieces(name) and not p.is_meta:
                p.copy_(_block(p, _pieces(name), size))
    for block in blocks:
        parallelize_module(block, tp_mesh, tensor_parallel_plan(block))


def _pieces(name: str) -> int:
    """How many projections a parameter (or a state entry named after it) stacks, or 0."""
    match = _FUSED.search(name)
    return _PIECES[match.group(2)] if match else 0


def _block(full: torch.Tensor, pieces: int, size: int) -> torch.Tensor:
    """Canonical rows (piece, process, row) -> blocked rows (process, piece, row)."""
    return full.unflatten(0, (pieces, size, -1)).transpose(0, 1).flatten(0, 2)


def _unblock(full: torch.Tensor, pieces: int, size: int) -> torch.Tensor:
    return full.unflatten(0, (size, pieces, -1)).transpose(0, 1).flatten(0, 2)


def _tp_size(t: DTensor) -> int:
    """The size of the ``tp`` mesh dimension a DTensor is sharded over along its rows, or 1."""
    names = t.device_mesh.mesh_dim_names or ()
    return next((t.device_mesh.size(i) for i, (n, p) in enumerate(zip(names, t.placements))
                 if n == "tp" and p.is_shard(0)), 1)


def local_part(name: str, full: torch.Tensor, target: DTensor) -> torch.Tensor:
    """This process's local tensor of ``target`` (a DTensor over one or more mesh dimensions) cut from ``full``,
    the whole tensor in canonical layout: blocked first if ``name`` is a fused projection split over ``tp``, then
    the mesh dimensions applied from the last to the first (tensor-parallel slice first, then FSDP2's
    ``torch.chunk`` of it, empty for the ranks left over), as ``fully_shard`` shards a tensor-parallel parameter."""
    size = _tp_size(target)
    return _cut(_block(full, _pieces(name), size) if size > 1 and _pieces(name) else full, target)


def _cut(full: torch.Tensor, target: DTensor) -> torch.Tensor:
    """This process's slice of ``full`` for ``target``'s mesh and placements (``local_part`` without blocking)."""
    mesh, coordinate = target.device_mesh, target.device_mesh.get_coordinate()
    for i in reversed(range(mesh.ndim)):
        placement = target.placements[i]
        if placement.is_shard() or type(placement).__name__ == "_StridedShard":
            chunks = full.chunk(mesh.size(i), dim=placement.dim)
            full = chunks[coordinate[i]] if coordinate[i] < len(chunks) else full.narrow(placement.dim, 0, 0)
    return full


def full_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` whole (a collective if it is a DTensor) in canonical layout."""
    return canonical_rows(name, t, gather(t)) if isinstance(t, DTensor) else t


class _TwoStepGathers(logging.Filter):
    """DTensor logs, for every FSDP2 shard of a tensor-parallel slice (placements ``_StridedShard(0)``,
    ``Shard(0)``) gathered whole, that it takes two all-gathers; here that is the intended cost of a checkpoint
    or an EMA export, not a finding."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_gather operations will be performed" not in str(record.msg)


def gather(t: DTensor) -> torch.Tensor:
    """``t.full_tensor()`` (a collective), without DTensor's log line about its two steps."""
    logger, quiet = logging.getLogger("torch.distributed.tensor._redistribute"), _TwoStepGathers()
    logger.addFilter(quiet)
    try:
        return t.full_tensor()
    finally:
        logger.removeFilter(quiet)


def canonical_rows(name: str, t: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full``, the gathered ``t``, in canonical row order (unblocked if ``t`` is a fused projection that tensor
    parallelism split)."""
    size = _tp_size(t) if isinstance(t, DTensor) else 1
    return _unblock(full, _pieces(name), size) if size > 1 and _pieces(name) else full


def checkpoint_layout(state: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, DTensor, DTensor]]]:
    """``state`` (model, optimizer and EMA state dicts, nested) with every blocked fused projection (and its
    optimizer states, EMA copy) replaced by a new DTensor of the same placements holding the canonical rows, so
    that DCP saves the layout of a model without tensor parallelism. Returns the new state and the (name, original,
    canonical) triples that ``restore_from`` copies back after a load into the new state."""
    moved: list[tuple[str, DTensor, DTensor]] = []

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, DTensor) and _tp_size(value) > 1 and _pieces(path):
            local = _cut(full_tensor(path, value), value).contiguous()
            canonical = DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape,
                                           stride=value.stride(), run_check=False)
            moved.append((path, value, canonical))
            return canonical
        return value

    return walk(state, ""), moved


@torch.no_grad()
def restore_from(moved: list[tuple[str, DTensor, DTensor]]) -> None:
    """Copy the canonical tensors a checkpoint was loaded into back into the blocked originals."""
    for name, original, canonical in moved:
        original.to_local().copy_(local_part(name, gather(canonical), original))
