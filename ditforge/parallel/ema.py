"""EMA of the model weights that lives where the weights live: under ZeRO-2 / FSDP each rank keeps and
updates only its shard (the parameters are DTensors and so is the EMA), under DDP or one process a full copy.

OpenDiT's sharded EMA does the same on Colossal-AI: each GPU computes and stores its part of the EMA.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ditforge.parallel.tensor import canonical_rows, gather

_WRAPPER_SEGMENTS = {"_orig_mod", "_checkpoint_wrapped_module"}  # torch.compile, activation checkpointing


def canonical_name(name: str) -> str:
    """The parameter name of the plain model: DDP's leading ``module.`` and the path segments that compile
    and checkpoint wrappers insert removed."""
    name = name.removeprefix("module.")
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (a view, no copy), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class EMA:
    """Polyak average ``ema <- decay * ema + (1 - decay) * weights`` of every trainable parameter.

    Holds a copy of every parameter (frozen ones too, so the EMA state dict is a whole model state dict;
    with ``trainable_only``, as for LoRA, the trainable ones alone) with the same placement as the model's:
    DTensor shards under ``fully_shard``, plain tensors otherwise; trainable ones in fp32 whatever the weights'
    dtype (``--master_weights bf16``). ``alias`` (``--ema_decay 0``, no EMA) holds the parameters themselves, at
    no memory cost, and ``update`` does nothing. ``state_dict()`` returns those tensors (for
    torch.distributed.checkpoint); ``full_state_dict()`` gathers them into plain CPU tensors (a collective: every
    rank must call it).
    """

    def __init__(self, model: nn.Module, trainable_only: bool = False, alias: bool = False):
        self.shadow: dict[str, torch.Tensor] = {}
        self.trainable: list[str] = []
        self.alias = alias
        self.fused = False  # the optimizer updates the shadows inside its step (fuse_into)
        self._pairs: tuple[nn.Module, list[torch.Tensor], list[torch.Tensor]] | None = None
        for name, p in model.named_parameters():
            key = canonical_name(name)
            if trainable_only and not p.requires_grad:
                continue
            if alias:
                self.shadow[key] = p.detach()
            elif p.requires_grad:  # fp32 whatever the weights' dtype: (1 - decay) w is far below a bf16 ulp
                self.shadow[key] = p.detach().to(torch.float32, copy=True)
            else:
                self.shadow[key] = p.detach().clone()
            if p.requires_grad:
                self.trainable.append(key)

    def fuse_into(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Hand the trainable shadows to a fused ``CompensatedAdamW`` (``attach_ema``), which then updates them in
        its own pass over the weights, with its ``ema_decay`` (the caller sets it before each step) and skipped
        with the step; ``update`` then does nothing. Returns whether it did (not for an alias, an unfused
        optimizer). Sharded shadows (FSDP2) are updated shard by shard, as the weights."""
        if self.alias or not getattr(optimizer, "fused", False):
            return False
        params = {canonical_name(n): p for n, p in model.named_parameters()}
        optimizer.attach_ema({params[k]: self.shadow[k] for k in self.trainable})
        self.fused = True
        return True

    @torch.no_grad()
    def update(self, model: nn.Module, decay: float, skip: torch.Tensor | None = None) -> None:
        """``ema <- ema + (1 - decay) (weights - ema)``; where ``skip`` (0-dim bool, on the weights' device) is
        true the weight of the update is 0 and the EMA stays as it is, decided on the device without a host sync.
        Nothing to do for an alias or when the optimizer does it (``fuse_into``)."""
        if self.alias or self.fused:
            return
        if self._pairs is None or self._pairs[0] is not model:  # name matching once, not every step
            params = {canonical_name(n): p for n, p in model.named_parameters()}
            self._pairs = (model, [local_shard(self.shadow[k]) for k in self.trainable],
                           [local_shard(params[k].detach()) for k in self.trainable])
        _, ema, weights = self._pairs
        # on the weights' device: the CPU under --cpu_offload all
        rate = 1.0 - decay if skip is None else (1.0 - decay) * (~skip).float().to(ema[0].device)
        same = [i for i, (e, w) in enumerate(zip(ema, weights)) if e.dtype == w.dtype]
        if same:
            torch._foreach_lerp_([ema[i] for i in same], [weights[i] for i in same],
                                 rate if skip is None else [rate] * len(same))
        if len(same) < len(ema):  # bf16 weights: one fp32 copy at a time, not a second model
            for e, w in zip(ema, weights):
                if e.dtype != w.dtype:
                    e.lerp_(w.to(e.dtype), rate)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: canonical_rows(k, v, _full(v)).detach().cpu() for k, v in self.shadow.items()}


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective), or ``t`` itself. Host shards of a GPU mesh (``--cpu_offload all``)
    gather on the GPU: NCCL takes no host tensors."""
    if not isinstance(t, DTensor):
        return t
    local, mesh = t.to_local(), t.device_mesh
    if local.device.type != mesh.device_type:
        t = DTensor.from_local(local.to(mesh.device_type), mesh, t.placements, shape=t.shape, stride=t.stride())
    return gather(t)
