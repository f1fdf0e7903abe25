"""A step whose loss or gradients are not finite, skipped on the device without a host read of its flag
(``found_inf``, torch's fused optimizers' protocol): ``SkipUndo`` selects back what it wrote, ``LateFlag`` reads the
flag one step late for the counters kept on the host, and ``step_skipping_on_device`` does it for the libraries'
optimizers, which take no flag."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class LateFlag:
    """A 0-dim flag on the device, to be read on the host later without waiting for the work queued after it:
    copied at once, without blocking, into pinned host memory behind a CUDA event; ``read`` waits for that event
    only, which has passed by the next step unless the GPU runs more than a step behind. On the CPU: the flag."""

    def __init__(self, flag: torch.Tensor):
        self.event = None
        if flag.is_cuda:
            self.flag = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
            self.flag.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.flag = flag

    def read(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.flag)


class SkipUndo:
    """Takes back what a skipped step wrote, without a host read of its flag. Device tensors are selected back at
    once (``torch.where``). Step counters kept on the host (0-dim CPU tensors: torchao's, torch's Adafactor's,
    bitsandbytes' counts, which their kernels read as numbers; callers pass weights flat, so no weight is taken for
    one) keep the count until the flag is read one step late (``LateFlag``); ``settle`` puts them back then. The
    optimizer settles at its next step; ``settle_skip`` before its state is saved."""

    def __init__(self):
        self.flag: LateFlag | None = None
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def select_back(self, written: list[torch.Tensor], before: list[torch.Tensor], found_inf: torch.Tensor) -> None:
        """Where ``found_inf`` (0-dim, on the device) is non-zero, each tensor of ``written`` takes back its value
        in ``before``."""
        flag = (found_inf != 0).reshape(())
        for t, old in zip(written, before):
            if t.device.type == "cpu" and t.dim() == 0:
                self.saved.append((t, old))
            else:
                t.copy_(torch.where(flag.to(t.device), old, t))
        if self.saved and self.flag is None:
            self.flag = LateFlag(flag)

    def settle(self) -> None:
        if self.flag is not None and self.flag.read():
            for t, old in reversed(self.saved):  # a counter saved twice in a step (a parameter cut in pieces):
                t.copy_(old)  # its first value wins
        self.flag, self.saved = None, []


def settle_skip(optimizer: torch.optim.Optimizer) -> None:
    """Read the last step's skip flag and put back the host step counters it skipped (``SkipUndo``): before the
    optimizer's state is saved (its ``state_dict``, which DCP calls, does it) or loaded."""
    undo = getattr(optimizer, "skip_undo", None)
    if undo is not None:
        undo.settle()


def _held(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s values: ``t``, a DTensor's local shard, or the inner tensors of a tensor
    subclass (torchao's quantized optimizer states, through ``__tensor_flatten__``)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if isinstance(t, nn.Parameter):
        t = t.detach()
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for name in names for x in _held(getattr(t, name))]
    return [t]


SKIP_CHUNK_NUMEL = 1 << 24  # step_skipping_on_device: weights copied at a time (64 MiB in fp32), with their states


@torch.no_grad()
def step_skipping_on_device(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()`` for a library optimizer that takes no ``found_inf`` (torchao's ``AdamW4bit`` /
    ``AdamWFp8``, torch's ``Adafactor``), undone where ``found_inf`` (0-dim float on the parameters' device) is
    non-zero, without reading it on the host. The parameters step in chunks of at least one parameter and about
    ``SKIP_CHUNK_NUMEL`` elements (their group's ``params`` narrowed to the chunk): the chunk's weights and state
    tensors are copied, stepped and selected back (``SkipUndo``), so the extra memory is one chunk's. A step that
    creates a state (a parameter's first) reads the flag on the host instead: a state cannot be selected back to
    not existing."""
    if "skip_undo" not in optimizer.__dict__:
        optimizer.skip_undo = SkipUndo()
        optimizer.register_state_dict_pre_hook(settle_skip)  # a saved state never holds an unsettled count
    undo = optimizer.skip_undo
    undo.settle()
    stepping = [[p for p in group["params"] if p.grad is not None] for group in optimizer.param_groups]
    if any(not optimizer.state.get(p) for ps in stepping for p in ps):
        if not found_inf.item():
            optimizer.step()
        return
    kept = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = []
        for group, ps in zip(optimizer.param_groups, stepping):
            chunks, size = [], SKIP_CHUNK_NUMEL
            for p in ps:
                if size >= SKIP_CHUNK_NUMEL:
                    chunks.append([])
                    size = 0
                chunks[-1].append(p)
                size += p.numel()
            for chunk in chunks:
                group["params"] = chunk
                # the weights (a 0-dim one as 1-dim: it is no host counter) and every tensor of their states
                written = [x if x.dim() else x.view(1) for p in chunk for x in _held(p)]
                written += [x for p in chunk for t in optimizer.state[p].values() if torch.is_tensor(t)
                            for x in _held(t)]
                before = [t.clone() for t in written]
                optimizer.step()
                undo.select_back(written, before, found_inf)
            group["params"] = []
    finally:
        for group, ps in zip(optimizer.param_groups, kept):
            group["params"] = ps
