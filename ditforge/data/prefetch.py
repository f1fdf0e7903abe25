"""Feeding the GPU: loader batches copied to the device ahead of time, through pinned host buffers that are
reused, on a copy stream of their own.

A plain ``DataLoader(pin_memory=True)`` followed by ``batch.to(device)`` pins each batch in a fresh host block
and copies it synchronously: the host then waits, every step, for the GPU to finish the work queued before the
copy, and cannot run ahead. Here each tensor of batch k + 1 is copied into a pinned buffer of its shape, reused
once its previous copy has finished, and sent with ``non_blocking=True`` on a side stream while step k runs; the
training stream waits for that copy only when it takes the batch. Once every batch shape has been seen no host
memory is allocated (no ``cudaHostAlloc`` during training), as Colossal-AI's cached pinned memory does.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np
import torch


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for CPU tensors of one dtype and shape (``dst`` contiguous), done by this thread alone.

    Why: a loader worker's batch arrives in freshly mapped shared memory, and reading it page-faults; torch's
    copy faults it from every intra-op thread at once, which serialises on the address-space lock. On a 16-core
    H100 host that cost 7 ms a step for a DiT-XL/2 batch of latents, against 0.1 ms on one thread
    (benchmarks/data_loading.py)."""
    np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.contiguous().reshape(-1).view(torch.uint8).numpy())


def default_num_workers(local_world_size: int = 1) -> int:
    """Loader worker processes per training process when ``--num_workers`` is not given: the CPU cores this
    process may use (``os.sched_getaffinity``) shared among the processes of this host, less one for the
    training process itself, at most 8 (beyond that workers only add memory: decoding keeps pace) and at
    least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores // max(local_world_size, 1) - 1))


class DevicePrefetcher:
    """Iterates ``loader``'s batches (tensors, possibly nested in dicts, lists and tuples; other values such as
    caption strings pass through) with their tensors on ``device``, ``depth`` batches ahead.

    On CUDA the tensors of each batch go through reused pinned buffers and a side stream (see the module
    docstring); the consumer's stream waits on the copy's event when the batch is handed out. On other devices
    tensors are moved with ``.to(device)`` as they come. Batch order and values are the loader's.

    Args:
        loader: any iterable of batches (a ``DataLoader`` built with ``pin_memory=False``: pinning happens here).
        device: where the tensors go.
        depth: batches in flight beyond the one being trained on (1 hides one batch's copy behind one step).
    """

    def __init__(self, loader: Iterable, device: torch.device, depth: int = 1):
        self.loader, self.device, self.depth = loader, torch.device(device), depth
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        # per (shape, dtype): pinned buffers, oldest first, each with the event of its last copy to the device
        self._pinned: dict[tuple, deque[tuple[torch.Tensor, torch.cuda.Event]]] = {}

    def __iter__(self) -> Iterator:
        batches = iter(self.loader)
        pending: deque = deque()
        for raw in batches:
            pending.append(self._send(raw))
            if len(pending) > self.depth:
                yield self._take(pending.popleft())
        while pending:
            yield self._take(pending.popleft())

    def _send(self, raw) -> tuple:
        if not self.cuda:
            return _map(raw, lambda t: t.to(self.device)), None
        with torch.cuda.stream(self.stream):
            batch = _map(raw, self._copy)
            done = torch.cuda.Event()
            done.record(self.stream)
        return batch, done

    def _take(self, item: tuple):
        batch, done = item
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
            # the tensors were allocated on the side stream and are now used on the consumer's
            _map(batch, lambda t: t.record_stream(torch.cuda.current_stream(self.device)))
        return batch

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return t.to(self.device, non_blocking=True)
        # The oldest buffer of this shape is reused once its copy has finished; otherwise one more is made. So
        # the pool holds what is in flight (about depth + 1 batches of each shape), whatever the batch's layout
        # (a list of samples of mixed shapes shares the buffers of each shape).
        pool = self._pinned.setdefault((tuple(t.shape), t.dtype), deque())
        if pool and pool[0][1].query():
            buffer = pool.popleft()[0]
        else:
            buffer = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        copy_bytes(buffer, t)
        out = buffer.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        pool.append((buffer, event))
        return out


def _map(value, fn):
    """``value`` with ``fn`` applied to each tensor inside it (dicts, lists and tuples are rebuilt; other values
    pass through)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in value):
        return type(value)(_map(v, fn) for v in value)
    return value
