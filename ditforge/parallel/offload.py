"""CPU offload: optimizer states in pinned host memory streamed through a ring buffer on the GPU (``--cpu_offload
optimizer``, ``StreamedStates``), and the one-step delayed update of the host step (``--cpu_offload all
--delayed_update``, ``DelayedAdamW``).

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

import logging
import threading

import torch
from torch.optim.adamw import adamw

from ditforge.errors import UserError
from ditforge.models import is_block
from ditforge.parallel import unwrap
from ditforge.parallel.ema import local_shard
from ditforge.parallel.mesh import Dist

log = logging.getLogger(__name__)

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


class DelayedAdamW(torch.optim.AdamW):
    """torch's fused AdamW on host weights with ZeRO-Offload's one-step delayed parameter update (DPU; Ren et al.
    2021, "ZeRO-Offload", section 5.2), for ``--cpu_offload all --delayed_update``.

    ``step()`` after the backward of step t publishes the weights that the step of gradients g_{t-1} computed,
    then starts the step of g_t in a thread and returns: that step runs on the CPU while the forward and backward
    of step t+1 run on the GPU, with the weights published. So the weights lag one update: the forward of step
    t+1 uses w_t = AdamW(w_{t-1}, g_{t-1}), where g_{t-1} was computed at w_{t-2}, instead of
    w_{t+1} = AdamW(w_t, g_t) computed at w_t. The update itself is ``torch.optim.adamw.adamw`` (fused), the same
    arithmetic as ``torch.optim.AdamW(fused=True)``.

    The step works on a copy of each weight, ``state["master"]`` (fp32, placed as the weight: a DTensor shard under
    FSDP2), published by one copy; moments, step counts and masters are the optimizer's state, saved and loaded
    with it. ``state_dict`` and ``load_state_dict`` first wait for the step in flight, so a checkpoint holds the
    weights of its last forward and the masters one update ahead, and a run resumed from it continues exactly.
    So the last update of a run stays in the masters: its final weights are those of its last forward.
    The arguments are ``torch.optim.AdamW``'s (``fused`` is always on; the weights must be on the CPU or a GPU of
    torch's fused AdamW).
    """

    def __init__(self, params, **kwargs):
        if kwargs.get("amsgrad") or kwargs.get("maximize"):
            raise ValueError("DelayedAdamW: no amsgrad or maximize")
        kwargs["fused"] = True
        super().__init__(params, **kwargs)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def wait(self) -> None:
        """Wait for the step in flight (if any); an exception in it is raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("DelayedAdamW: no closure (the step runs in a thread)")
        self.wait()
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        # publish the previous update (of every weight stepped before, with a gradient now or not)
        stepped = [p for group in self.param_groups for p in group["params"] if self.state.get(p)]
        if stepped:
            torch._foreach_copy_([local_shard(p) for p in stepped], [local_shard(self.state[p]["master"]) for p in stepped])
        work = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:  # torch.optim.AdamW's fused state, plus the master
                    state["step"] = torch.zeros((), dtype=torch.float32, device=local_shard(p).device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["master"] = p.detach().clone()
            states = [self.state[p] for p in params]
            # hand the thread this step's gradients (zero_grad drops the parameters' references; the next
            # backward makes new ones)
            work.append(([local_shard(s["master"]) for s in states], [local_shard(p.grad) for p in params],
                         [local_shard(s["exp_avg"]) for s in states], [local_shard(s["exp_avg_sq"]) for s in states],
                         [s["step"] for s in states], dict(group)))
        self._thread = threading.Thread(target=self._update, args=(work, found_inf, grad_scale), daemon=True)
        self._thread.start()

    def _update(self, work: list, found_inf: torch.Tensor | None, grad_scale: torch.Tensor | None) -> None:
        try:
            for masters, grads, exp_avgs, exp_avg_sqs, steps, group in work:
                adamw(
                    masters, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, found_inf=found_inf,
                    grad_scale=grad_scale, amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1],
                    lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        except BaseException as e:  # raised in the training thread at the next wait
            self._error = e

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:  # zeroing in place would change the gradients the thread reads
            self.wait()
        super().zero_grad(set_to_none)

    def state_dict(self):
        self.wait()
        return super().state_dict()

    def load_state_dict(self, state_dict):
        self.wait()
        super().load_state_dict(state_dict)


class BlockSwap:
    """``--blocks_to_swap N``: the frozen weights of the last ``N`` repeated blocks live in (pinned) host memory and
    visit the GPU one block at a time, as diffusion-pipe's ``blocks_to_swap`` and musubi-tuner's block swap do for
    LoRA on models whose frozen base does not fit (a 14B video transformer's on 24 GB cards).

    A forward pre-hook of each swapped block points its frozen parameters at device copies, and its forward hook
    points them back at the host tensors, so the device copy is freed as soon as nothing else holds it (the
    backward of a block that kept it; under ``--grad_checkpoint`` the block recomputes in the backward and its
    pre-hook runs again, the copy living until that block's backward is done; a recomputation stops as soon as it
    has what the backward needs, before the forward hook, so the next block's pre-hook points the parameters of
    any other block back at the host). On CUDA each copy is issued on a side
    stream one block ahead, in the order the blocks ran last (forward, or the reverse for the recomputation of the
    backward), and the compute stream waits on its event: two swapped blocks' weights are on the GPU at most.
    Trainable parameters (LoRA's adapters) and buffers stay where they are.

    Args:
        blocks: the swapped blocks, in forward order.
        device: the compute device.
    """

    def __init__(self, blocks: list[torch.nn.Module], device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.params = [[p for p in b.parameters() if not p.requires_grad] for b in blocks]
        self.host = []
        for params in self.params:
            host = [p.data.to("cpu", copy=True) for p in params]
            self.host.append([h.pin_memory() for h in host] if self.cuda else host)
            for p, h in zip(params, self.host[-1]):
                p.data = h
        self.staged: dict[int, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}
        self.resident: set[int] = set()  # blocks whose parameters point at device copies
        self.last = -1
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda module, args, i=i: self._enter(i))
            block.register_forward_hook(lambda module, args, out, i=i: self._leave(i))

    @property
    def host_bytes(self) -> int:
        """Bytes of frozen weights held in host memory instead of the device."""
        return sum(h.numel() * h.element_size() for host in self.host for h in host)

    def _stage(self, i: int) -> None:
        """Issue block ``i``'s copy to the device (on the side stream on CUDA)."""
        if i in self.staged or not 0 <= i < len(self.host):
            return
        if not self.cuda:
            self.staged[i] = ([h.to(self.device, copy=True) for h in self.host[i]], None)  # a copy, as on CUDA
            return
        # the copy's buffers come from the caching allocator: what the compute stream freed must be done with
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copies = [h.to(self.device, non_blocking=True) for h in self.host[i]]
            event = torch.cuda.Event()
            event.record(self.stream)
        self.staged[i] = (copies, event)

    def _enter(self, i: int) -> None:
        step = -1 if i < self.last else 1  # the backward's recomputation runs the blocks in reverse
        for j in self.resident - {i}:  # a recomputation stops early, before its forward hook: released here
            self._leave(j)
        self._stage(i)
        copies, event = self.staged.pop(i)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            for c in copies:  # made on the side stream, used and freed on the compute stream
                c.record_stream(torch.cuda.current_stream(self.device))
        for p, c in zip(self.params[i], copies):
            p.data = c
        self.resident.add(i)
        self.last = i
        self._stage(i + step)

    def _leave(self, i: int) -> None:
        for p, h in zip(self.params[i], self.host[i]):
            p.data = h
        self.resident.discard(i)


def swap_blocks(model: torch.nn.Module, n: int, pre, d: Dist) -> list[BlockSwap]:
    """--blocks_to_swap: the last ``n`` repeated blocks' frozen weights (those not requiring gradients now) of the
    pipeline ``pre``'s denoiser ``model`` (of each expert of two) to host memory, computed on ``d.device``: a
    ``BlockSwap`` an expert (in ``expert_models``' order), returned (their hooks hold them too).

    Raises:
        UserError: a model that is no diffusers pipeline's (``pre`` None), or fewer blocks than asked.
    """
    if pre is None:
        raise UserError("--blocks_to_swap: swaps the blocks of a diffusers pipeline's transformer (--init_from)")
    experts = [[m for m in inner.modules() if is_block(m, pre.denoiser.swap_classes)]
               for inner in unwrap(model).expert_models()]  # two experts: each one's last n, in a swap of its own
    if n > (fewest := min(len(blocks) for blocks in experts)):
        raise UserError(f"--blocks_to_swap {n}: {pre.pipeline_class}'s transformer has {fewest} blocks")
    swaps = [BlockSwap(blocks[len(blocks) - n:], d.device) for blocks in experts]
    if d.is_main:
        log.info("--blocks_to_swap %d: %.2f GiB of frozen weights in host memory", n,
                 sum(swap.host_bytes for swap in swaps) / 2**30)
    return swaps
