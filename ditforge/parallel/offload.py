"""Optimizer states in pinned host memory, streamed through a ring buffer on the GPU: ``--cpu_offload optimizer``.

ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", section 4) keeps the
fp32 master and the moments on the host and steps them there: the gradients go down and the bf16 weights come
back over PCIe, 4 bytes per parameter each step, and the CPU's Adam is the bottleneck that its one-step delayed
update hides. Here the weights stay on the GPU and so does the step (``CompensatedAdamW``'s one-pass Triton
kernel); what travels is the optimizer's state, per update chunk: up to the GPU before its step, back after. With
8-bit moments and stochastically rounded bf16 weights that is 2 bytes per parameter each way (plus 8 bytes of
absmax per 256), the same traffic as ZeRO-Offload's and no CPU step; GPU memory keeps the weights (and the
gradients of one block with ``--fused_backward_pass``) plus the ring.

A chunk's states live in one pinned host buffer laid out as its region of the ring, so a chunk moves in one copy
each way (per tensor, SD-1.5's ~700 parameters would take ~2,800 small copies each way per step, each with its
launch and copy-engine latency). The pipeline of one chunk (CUDA; three streams):
  1. upload: the copy stream copies its states host -> a region of the ring (issued ahead of time: the order of
     the chunks is learned from the previous step, and while a chunk is stepped the next ones are uploaded);
  2. step: the compute stream waits for the upload and runs the kernel on the ring's views;
  3. download: the write-back stream waits for the kernel and copies the ring -> host.
Regions are reused in ring order; the upload into a region waits (on the GPU, not the host) for the
download of its previous occupant, and a chunk's upload waits for its own previous download. So GPU memory is the
ring's fixed size, and nothing blocks the host. The scheduling is ours: torch's FSDP2 ``CPUOffloadPolicy``
steps on the CPU, and torchao's ``CPUOffloadOptimizer`` also steps on the host.
"""

from __future__ import annotations

import torch

ALIGN = 256  # bytes: every view in the ring starts at a multiple (the kernel needs 16)
RING_BYTES = 256 * 2**20  # the ring's default size
STAGED = "staged"  # a region uploaded (or uploading) for a chunk not yet stepped


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ALIGN: a tensor's room in the ring."""
    return -(-nbytes // ALIGN) * ALIGN


class StreamedStates:
    """The ring of one device through which chunks of host-resident optimizer state pass for their step.

    Args:
        device: the GPU (or, in tests, the CPU: the same logic without streams, every copy synchronous).
        ring_bytes: the ring's size in bytes; ``chunk_bytes`` (a quarter of it) bounds one chunk's state, so
            one chunk can be stepped while the next ones upload and the previous ones download.

    Use (``CompensatedAdamW(offload=True)``): ``pack`` a chunk's state tensors once (the caller keeps the returned
    views as its state); per step ``begin_step``, then per chunk ``fetch`` (its device views, uploaded now if not
    ahead of time) and ``release`` after its kernel; ``flush`` before the host states are read (checkpoints),
    ``reset`` when they are replaced (a load).
    """

    def __init__(self, device: torch.device, ring_bytes: int = RING_BYTES):
        self.device = torch.device(device)
        self.ring = torch.empty(ring_bytes, dtype=torch.uint8, device=self.device)
        cuda = self.device.type == "cuda"
        self.upload = torch.cuda.Stream(self.device) if cuda else None
        self.download = torch.cuda.Stream(self.device) if cuda else None
        self.chunk_bytes = ring_bytes // 4
        self.written: dict[tuple, torch.cuda.Event] = {}  # chunk -> its last download
        self.reset()

    def reset(self) -> None:
        """Forget the chunks and the learned order (the host states were replaced)."""
        self.flush()
        # chunk -> (its pinned buffer, the (shape, dtype, offset) of each of its tensors in it)
        self.layouts: dict[tuple, tuple[torch.Tensor, list[tuple[torch.Size, torch.dtype, int]]]] = {}
        self.order: list[tuple] = []  # this step's chunks, in the order they were stepped
        self.previous: list[tuple] = []
        self.staged: dict[tuple, tuple[int, torch.cuda.Event | None]] = {}  # chunk -> (ring offset, its upload)
        # regions of the ring in use: (start, end, STAGED, or the download that frees it: an event, None on a CPU)
        self.regions: list[tuple[int, int, object]] = []
        self.written = {}
        self.head = 0

    def packed(self, key: tuple) -> bool:
        return key in self.layouts

    def pack(self, key: tuple, host: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copy chunk ``key``'s state tensors ``host`` into one pinned buffer (pinned when the device is a GPU) and
        return their views in it, which replace them as the state. A chunk that shared an element of ``key`` (the
        chunking changed) is forgotten: its buffer no longer holds the state.

        Raises:
            ValueError: the chunk's state exceeds ``chunk_bytes``.
        """
        shapes, size = [], 0
        for t in host:
            shapes.append((t.shape, t.dtype, size))
            size += aligned(t.numel() * t.element_size())
        if size > self.chunk_bytes:
            raise ValueError(f"StreamedStates: a chunk of {size} bytes exceeds the ring's quarter "
                             f"({self.chunk_bytes} bytes)")
        self.flush()  # the tensors may be views of a buffer that a download is still writing (rare: first step)
        members = set(key)
        for other in [k for k in self.layouts if members.intersection(k)]:
            self.written.pop(other, None)
            del self.layouts[other]
        flat = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        views = self._views(flat, shapes)
        torch._foreach_copy_(views, host)
        self.layouts[key] = (flat, shapes)
        return views

    def begin_step(self) -> None:
        """A new optimizer step: its chunks will follow the order of the step just ended."""
        if self.order:
            self.previous, self.order = self.order, []
        self.head = 0  # each step lays its chunks out from the start: the same order gives the same offsets
        self._drop_staged()

    def fetch(self, key: tuple) -> tuple[int, list[torch.Tensor]]:
        """The device copies of packed chunk ``key``'s tensors, ready on the current stream; uploads the chunks
        that followed it last step. Returns the ring offset (a chunk at the same offset has the same addresses:
        kernels' address tables can be cached by it) and the views, in the order ``pack`` was given."""
        position = len(self.order)
        self.order.append(key)
        if key not in self.staged:  # not uploaded ahead: the order changed, and what was uploaded is not needed
            self._drop_staged()
            self._stage(key)
        if position < len(self.previous) and self.previous[position] == key:  # the order holds: upload ahead
            # at most half the ring uploaded and not yet stepped: with the < chunk_bytes left unused at a wrap,
            # a new region never reaches one of them
            ahead = sum(len(self.layouts[k][0]) for k in self.staged)
            for k in self.previous[position + 1:]:
                if k in self.staged:
                    continue
                if k not in self.layouts or ahead + len(self.layouts[k][0]) > len(self.ring) // 2:
                    break
                self._stage(k)
                ahead += len(self.layouts[k][0])
        offset, uploaded = self.staged.pop(key)
        if uploaded is not None:
            torch.cuda.current_stream(self.device).wait_event(uploaded)
        flat, shapes = self.layouts[key]
        return offset, self._views(self.ring[offset:offset + len(flat)], shapes)

    def release(self, key: tuple, offset: int) -> None:
        """Chunk ``key`` was stepped at ``offset`` (its kernels are enqueued on the current stream): download it."""
        flat = self.layouts[key][0]
        region = self.ring[offset:offset + len(flat)]
        done = None
        if self.download is not None:
            self.download.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.download):
                flat.copy_(region, non_blocking=True)
            done = self.written[key] = self.download.record_event()
        else:
            flat.copy_(region)
        end = offset + len(flat)
        self.regions = [(s, e, done) if (s, e, state) == (offset, end, STAGED) else (s, e, state)
                        for s, e, state in self.regions]

    def flush(self) -> None:
        """Wait until every download has reached the host."""
        for event in self.written.values():
            event.synchronize()

    @staticmethod
    def _views(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
        return [flat[o:o + shape.numel() * dtype.itemsize].view(dtype).view(shape) for shape, dtype, o in shapes]

    def _drop_staged(self) -> None:
        """Forget uploads not stepped (their regions are free: later uploads into them follow on the same stream)."""
        self.regions = [r for r in self.regions if r[2] is not STAGED]
        self.staged.clear()

    def _stage(self, key: tuple) -> None:
        flat = self.layouts[key][0]
        size = len(flat)
        if self.head + size > len(self.ring):
            self.head = 0
        start, end = self.head, self.head + size
        self.head = end
        overlap = [r for r in self.regions if r[0] < end and start < r[1]]
        if any(state is STAGED for _, _, state in overlap):  # the ahead limit (half the ring) prevents this
            raise RuntimeError("StreamedStates: the ring wrapped onto a chunk not yet stepped")
        waits = [state for _, _, state in overlap if state is not None]  # their downloads must end first
        self.regions = [r for r in self.regions if r not in overlap] + [(start, end, STAGED)]
        region = self.ring[start:end]
        uploaded = None
        if self.upload is not None:
            for event in waits + ([self.written[key]] if key in self.written else []):
                self.upload.wait_event(event)
            with torch.cuda.stream(self.upload):
                region.copy_(flat, non_blocking=True)
            uploaded = self.upload.record_event()
        else:
            region.copy_(flat)
        self.staged[key] = (start, uploaded)
