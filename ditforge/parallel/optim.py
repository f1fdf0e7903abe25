"""Memory of training: the GPU memory cap, and the optimizer's placement and precision: fp32, Kahan-compensated or
stochastically rounded bf16 weights, fp32 or 8-bit AdamW states, and the optimizer step fused into the backward.

``build_optimizer`` picks one of:
  * ``--optimizer adamw --master_weights fp32`` (the default): ``torch.optim.AdamW`` (fused: CUDA and CPU) over fp32
    parameters; 16 bytes per trainable parameter (weights, gradients, two moments) before the EMA.
  * ``CompensatedAdamW`` for everything else: AdamW with the moments in fp32 or as bitsandbytes' 8-bit blockwise
    codes (``--optimizer adamw8bit``: Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization";
    blocks of 256, the dynamic signed map for the first moment and the unsigned one for the second, tensors under
    4,096 elements kept in fp32 as bitsandbytes does), over fp32 parameters or bf16 parameters with a bf16 Kahan
    compensation buffer (``--master_weights bf16``). bf16 weights + compensation + bf16 gradients + 8-bit moments
    take 8 bytes per parameter instead of 16; ``--master_weights bf16_sr`` (stochastic rounding, no compensation)
    6; with ``--fused_backward_pass`` (``StepInBackward``) the gradients live one block at a time: 4.

Kahan-compensated bf16 weights (Kahan 1965; for training, Zamirai et al. 2021, "Revisiting BFloat16 Training",
section 4): each bf16 parameter ``p`` carries ``c`` (bf16), the part of the fp32 master weight that rounding to
bf16 dropped, so the master is ``w = p + c`` to 2^-17 relative per split (``p`` rounds to 2^-8 of ``w``, and ``c``
holds that residual to 2^-8 of itself). A step rebuilds ``w``
in fp32 for a chunk of parameters at a time (at most ``chunk_numel`` elements: transient memory 8 bytes (12 with
stochastic rounding) per
element of the chunk), applies the AdamW update to ``w`` with the gradient in fp32, and splits it again:
``p = bf16(w)`` (round to nearest), ``c = bf16(w - p)``. Updates far below bf16's resolution (lr 1e-5 on weights
of size 1 is 1/400 of a bf16 ulp) accumulate in ``c`` instead of being rounded away.

Stochastic rounding (``rounding="stochastic"``; Gupta et al. 2015, "Deep Learning with Limited Numerical
Precision", eq. 2; for bf16 training, Zamirai et al. 2021, section 4): ``p = bf16(w)`` rounded up or down with
probabilities proportional to the distances, so that E[p] = w and small updates survive on average, without the
compensation buffer. Done on the fp32 bit pattern: add a uniform random 16-bit integer to the low half and
truncate it (bf16 is the high half of fp32). The random stream is a function of the optimizer's step count and
the parameter's index (seeded per chunk), so a resumed run rounds as the uninterrupted one.

Two implementations of one update:
  * fused (``fused=True``, the default where Triton runs: parameters on a GPU): ``ditforge.ops.fused_adamw``, one
    Triton pass per kind of parameter that reads weight, gradient, moments (and the EMA, ``attach_ema``) once
    and writes them once, with the clipping coefficient (``clip_coef``) and the skip flag (``found_inf``) read on
    the device. Ours: nothing maintained fuses 8-bit moments, Kahan bf16 and an EMA into one pass.
  * the libraries' (CPU, or no Triton): ``torch.optim.adam.adam`` for fp32 moments,
    ``bitsandbytes.functional.optimizer_update_8bit_blockwise`` for 8-bit ones; this module only holds the
    compensation, the chunking and the skip (``found_inf``: each chunk's old values selected back on the device).
They agree to fp32 rounding (tests/parallel/test_fused_adamw.py states the bounds; 8-bit codes can differ by one
where a value sits at a midpoint of the map). The state is per parameter (``step``, a 0-dim fp32 tensor;
``exp_avg``/``exp_avg_sq`` or bitsandbytes' ``state1``/``state2``/``absmax1``/``absmax2``; ``compensation``), the
same for both, so ``torch.distributed.checkpoint`` saves and resumes it like any optimizer's.

Under FSDP2 (``--plugin zero2 | fsdp``) the parameters are DTensors sharded on their first dimension; both
implementations step each process's local shard. The states are made as DTensors like their parameter (the
moments, codes and compensation with its shape and placements; the 8-bit blocks' absmax as a 1-D tensor of the
parameter's blocks in order, sharded the same way), so DCP saves them once and reshards them at another world size.
A parameter is 8-bit when it is at least 4,096 elements and every shard holds whole blocks (first dimension
divisible by the shard count, shard a multiple of 256 elements): each process's blocks are then the whole tensor's
blocks, and the update equals one process's. Other placements (tensor parallelism) are refused.

``--optimizer adamw4bit | adamw_fp8 | adafactor`` are the libraries' optimizers, whole (``library_optimizer``),
stepped after the backward: nothing of ours but the choice. adamw4bit and adamw_fp8 are torchao's ``AdamW4bit``
(Li et al. 2023, "Memory Efficient Optimizers with 4-bit States": both moments as 4-bit codes in blocks of 128,
1 byte per parameter with the scales) and ``AdamWFp8`` (both moments as float8 e4m3 in blocks of 256: 2 bytes);
bitsandbytes has neither. adafactor is torch's ``Adafactor`` (Shazeer & Stern 2018, "Adafactor: Adaptive Learning
Rates with Sublinear Memory Cost", Algorithm 4 without momentum: a matrix keeps one row and one column of second
moments, so its state is O(rows + columns), not O(rows x columns)); ``--lr`` is then its maximum relative step size.
"""

from __future__ import annotations

import functools

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as adam_functional

from ditforge.config.sections import LIBRARY_OPTIMIZERS, OPTIMIZERS
from ditforge.errors import UserError
from ditforge.ops.fused_adamw import Kind, OnePassAdamW, on_gpu_with_triton
from ditforge.parallel import clip_coefficient
from ditforge.parallel.ema import local_shard
from ditforge.parallel.offload import RING_BYTES, DelayedAdamW, StreamedStates, aligned

BLOCKSIZE = 256  # bitsandbytes' block of the 8-bit blockwise optimizers
MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller tensors keep fp32 moments


def _shards(p: torch.Tensor) -> int:
    """Into how many pieces a parameter's first dimension is split (1: a plain tensor or replicated)."""
    if not isinstance(p, DTensor):
        return 1
    return math.prod(n for n, place in zip(p.device_mesh.shape, p.placements) if place.is_shard(0))


def _sharded_by_rows(p: torch.Tensor) -> bool:
    """A plain tensor, or a DTensor replicated or sharded on its first dimension only (FSDP2's, HSDP's): what
    ``CompensatedAdamW`` steps shard by shard. Tensor parallelism shards other dimensions."""
    return not isinstance(p, DTensor) or all(place.is_replicate() or place.is_shard(0) for place in p.placements)


def _like(p: torch.Tensor, local: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A state tensor ``local`` (this process's part) as a DTensor placed like parameter ``p``, of global ``shape``;
    ``local`` itself for a plain ``p``."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def bitsandbytes_functional():
    """``bitsandbytes.functional``, or a UserError naming the extra to install."""
    try:
        import bitsandbytes.functional as F
    except ImportError:
        raise UserError("--optimizer adamw8bit needs bitsandbytes: pip install 'ditforge[lowmem]'") from None
    return F


def library_optimizer(params: list[nn.Parameter], optimizer: str, lr: float,
                      weight_decay: float) -> torch.optim.Optimizer:
    """The maintained library's optimizer for ``--optimizer adamw4bit | adamw_fp8 | adafactor`` (module
    docstring), over fp32 parameters: torchao's ``AdamW4bit`` / ``AdamWFp8`` (betas (0.9, 0.999), eps 1e-8) or
    ``torch.optim.Adafactor`` (its defaults: beta2 decay -0.8, eps (dtype eps, 1e-3), update clipping d = 1).
    torchao keeps each group's lr as a 0-dim tensor (``set_lr``). torchao's own bf16 stochastic rounding is not
    offered (``config.validate``): it draws from the global generator, and its unquantized small tensors would
    keep bf16 moments.

    Raises:
        UserError: torchao is not installed.
    """
    if optimizer == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay)
    try:
        from torchao.optim import AdamW4bit, AdamWFp8
    except ImportError:
        raise UserError(f"--optimizer {optimizer} needs torchao: pip install 'ditforge[lowmem]'") from None
    kind = AdamW4bit if optimizer == "adamw4bit" else AdamWFp8
    return kind(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate to ``lr``: in place where a group keeps it as a tensor (torchao's low-bit
    AdamW, whose compiled step would otherwise recompile for each new value), else as a number."""
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


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


def rounding_seed(step: int, index: int, start: int = 0) -> int:
    """The stochastic rounding's seed for optimizer step ``step``, parameter ``index`` (its position over all
    groups) and first element ``start``: mixed by odd multipliers, so a stream repeats only after 2^32 steps."""
    return step * 0x9E3779B1 + index * 0x85EBCA77 + start * 0xC2B2AE3D


class CompensatedAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter 2019; decoupled weight decay ``w -= lr * wd * w``) with fp32 or 8-bit moments
    over fp32 parameters or bf16 parameters updated through an fp32 rebuild (module docstring).

    Args:
        params: parameters (fp32 or bf16; one dtype per tensor, any mix), or parameter groups.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        states: ``"fp32"`` or ``"8bit"`` (bitsandbytes' blockwise codes; tensors under 4,096 elements stay fp32).
        rounding: how bf16 parameters take the fp32 update: ``"kahan"`` (a bf16 compensation per parameter) or
            ``"stochastic"``.
        chunk_numel: elements rebuilt in fp32 at once (a larger parameter is updated in pieces of this size).
        fused: the one-pass Triton update (module docstring); None: where Triton runs on the parameters' device.
        offload: keep the states (moments, compensation; not the step counters) in pinned host memory and stream
            them through a ring on the device for each step (``ditforge.parallel.offload``; fused only).
        ring_bytes: the ring's size with ``offload`` (at least 4x the largest parameter's state).

    Attributes set by the caller for one ``step`` (0-dim tensors on the device, read there: no host sync):
        found_inf: non-zero skips the step (torch's fused optimizers' protocol, ``_step_supports_amp_scaling``):
            weights, states, step counters and the attached EMA stay as they were, bit for bit. The one-pass step
            masks its kernel; the libraries' path steps each chunk and selects its old values back with
            ``torch.where`` (a copy of the chunk's weights and states meanwhile). bitsandbytes takes the step
            count as a Python int: its 8-bit tensors' counters stay on the host and are put back one step late
            (``SkipUndo``). ``rounding_step`` (the stochastic rounding's stream) counts the skipped step too: a
            host int, advanced before the flag is known.
        clip_coef: multiplier of the gradients, min(1, max_norm / (norm + 1e-6)) (``folds_clipping``); the
            libraries' path multiplies the gradients by it in place, as ``clip_grad_norm_`` would.
        ema_decay: the decay of the attached EMA for this step (fused only).

    Raises:
        UserError: ``states="8bit"`` without bitsandbytes. ValueError: a parameter that is neither fp32 nor bf16;
            ``offload`` without ``fused``.
    """

    # Per-step inputs of the fused step (class defaults: GradScaler deletes the instance attributes after a step)
    found_inf: torch.Tensor | None = None
    clip_coef: torch.Tensor | None = None
    grad_scale: torch.Tensor | None = None

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, states: str = "fp32", rounding: str = "kahan", chunk_numel: int = 1 << 24,
                 fused: bool | None = None, offload: bool = False, ring_bytes: int = RING_BYTES):
        if states not in ("fp32", "8bit"):
            raise ValueError(f"states: expected fp32 or 8bit, got {states}")
        if rounding not in ("kahan", "stochastic"):
            raise ValueError(f"rounding: expected kahan or stochastic, got {rounding}")
        # rounding_step: the optimizer steps taken, a group entry so that checkpoints carry it (stochastic seeds)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rounding_step=0))
        self._index = {}  # parameter -> (its group's index, its position over all groups): chunk seeds
        for k, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(f"CompensatedAdamW: parameters must be fp32 or bf16, got {p.dtype}")
                if not _sharded_by_rows(p):
                    raise ValueError(f"CompensatedAdamW: a DTensor parameter sharded only on its first dimension "
                                     f"(FSDP2), got {p.placements}")
                self._index[p] = (k, len(self._index))
        self.states, self.rounding, self.chunk_numel = states, rounding, chunk_numel
        self._F = bitsandbytes_functional() if states == "8bit" else None
        self._qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self.skip_undo = SkipUndo()
        if fused is None:
            fused = on_gpu_with_triton(next(p.device for g in self.param_groups for p in g["params"]))
        self.fused = fused
        self._stream = None
        self._resident: set[torch.Tensor] = set()  # offload: parameters whose states stay on the device (keep_on_device)
        if offload:
            if not fused:
                raise ValueError("CompensatedAdamW: offload needs the fused step")
            largest = max(self._state_bytes(p) for g in self.param_groups for p in g["params"])
            device = next(p.device for g in self.param_groups for p in g["params"])
            self._stream = StreamedStates(device, max(ring_bytes, 4 * largest))
        # torch's protocol for optimizers that skip on the device (GradScaler, the trainer's divergence guard)
        self._step_supports_amp_scaling = self.folds_clipping = True
        self.ema_decay = 1.0  # until the caller sets it: a step (e.g. DCP's state initialisation) leaves the EMA
        self._ema: dict[torch.Tensor, torch.Tensor] = {}
        self._launches: dict[tuple, list] = {}  # fused: per list of parameters, its kernel launches
        self._chunks_of: dict[tuple, list] = {}  # offload: per list of parameters, its chunks

    def attach_ema(self, shadows: dict[torch.Tensor, torch.Tensor]) -> None:
        """Update these fp32 EMA tensors (parameter -> its shadow) inside the fused step, with ``ema_decay``:
        e += (1 - decay) (w - e) with the new fp32 master w, skipped with the step. Fused only."""
        if not self.fused:
            raise ValueError("attach_ema needs the fused step")
        self._ema = shadows
        self._launches.clear()

    def state_dict(self) -> dict:
        self.skip_undo.settle()
        if self._stream is not None:  # the host copies are current once the last step's downloads end
            self._stream.flush()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but the states keep their own dtypes (torch casts floating
        states to the parameter's: the fp32 moments of a bf16 weight would lose their precision), and offloaded
        ones stay in pinned host memory."""
        if self._stream is not None:
            self._stream.reset()
        super().load_state_dict(state_dict)
        self._launches.clear()  # new state tensors: new addresses
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for pid, p in zip(saved_group["params"], group["params"]):
                for key, value in state_dict["state"].get(pid, {}).items():
                    if not torch.is_tensor(value):
                        if key == "step":  # 8-bit states of checkpoints before the fused step: a host int
                            self.state[p][key] = torch.tensor(float(value))
                    elif self._stream is not None and key != "step" and p not in self._resident:  # packed at first use
                        self.state[p][key] = value.to("cpu", copy=True)
                    else:
                        self.state[p][key] = value.to(device=p.device, copy=True)

    def _streamed(self, p: torch.Tensor) -> bool:
        return self._stream is not None and p not in self._resident

    @torch.no_grad()
    def keep_on_device(self, nbytes: int) -> int:
        """Measured placement under offload (Gemini's idea: keep on the GPU what the budget leaves; Fang et al.
        2022, "Parallel Training of Pre-trained Models via Chunk-based Dynamic Memory Management"): move the states
        of parameters, in their order, from the host to their device while they total at most ``nbytes``
        (``_state_bytes``); those are stepped in place from then on, the others still stream through the ring.
        Once every state is on the device the ring is freed and the optimizer steps as a resident one. The update
        is the same either way (tested bit for bit). Returns the bytes moved; 0 without offload."""
        if self._stream is None:
            return 0
        self._stream.flush()  # the host copies are current
        moved = 0
        for p in (p for group in self.param_groups for p in group["params"]):
            if p in self._resident:
                continue
            need = self._state_bytes(p)
            if moved + need > nbytes:
                break
            for name, value in self.state[p].items():
                if name != "step":
                    self.state[p][name] = value.to(p.device, copy=True)
            self._resident.add(p)
            moved += need
        if moved:  # new chunks without the resident parameters, packed again at their next step
            self._stream.reset()
            self._launches.clear()
            self._chunks_of.clear()
        if all(p in self._resident for group in self.param_groups for p in group["params"]):
            self._stream = None  # nothing streams any more: the ring's memory goes back
        return moved

    def _eightbit(self, p: torch.Tensor) -> bool:
        shards = _shards(p)  # a sharded parameter: whole blocks in every shard (module docstring)
        return (self.states == "8bit" and p.numel() >= MIN_8BIT_SIZE and p.shape[0] % shards == 0
                and p.numel() // shards % BLOCKSIZE == 0)

    def _state_shapes(self, p: torch.Tensor, local: bool = True) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """The state tensors of ``p`` besides its step counter: name -> (shape, dtype), of this process's part
        (``local``) or whole."""
        shape = local_shard(p).shape if local else p.shape
        if self._eightbit(p):
            blocks = torch.Size([-(-shape.numel() // BLOCKSIZE)])
            shapes = {"state1": (shape, torch.uint8), "state2": (shape, torch.uint8),
                      "absmax1": (blocks, torch.float32), "absmax2": (blocks, torch.float32)}
        else:
            shapes = {"exp_avg": (shape, torch.float32), "exp_avg_sq": (shape, torch.float32)}
        if p.dtype == torch.bfloat16 and self.rounding == "kahan":
            shapes["compensation"] = (shape, torch.bfloat16)
        return shapes

    def _state_bytes(self, p: torch.Tensor) -> int:
        """Bytes of ``p``'s state in an offload ring (``offload.aligned`` per tensor)."""
        return sum(aligned(shape.numel() * dtype.itemsize) for shape, dtype in self._state_shapes(p).values())

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        # torch's fused AdamW's format; bitsandbytes' kernel takes the step as a number: on the host for it
        host = self._eightbit(p) and not self.fused
        state["step"] = torch.zeros((), dtype=torch.float32, device="cpu" if host else p.device)
        whole = self._state_shapes(p, local=False)
        for name, (shape, dtype) in self._state_shapes(p).items():
            # offloaded: on the host, packed into its chunk's pinned buffer at the first step
            zeros = torch.zeros(shape, dtype=dtype, device="cpu" if self._streamed(p) else p.device)
            state[name] = _like(p, zeros, whole[name][0])
        return state

    def _qmap(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._qmaps:
            F = self._F
            self._qmaps[device] = (F.create_dynamic_map(signed=True).to(device),
                                   F.create_dynamic_map(signed=False).to(device))
        return self._qmaps[device]

    def _chunks(self, params: list[torch.Tensor]):
        """Lists of pieces ``(parameter, start, end)`` (flat element ranges) of at most ``chunk_numel`` elements
        together; a parameter larger than that is cut at multiples of bitsandbytes' 256-element block, so the
        pieces of its 8-bit codes have their own scales."""
        piece = max(BLOCKSIZE, self.chunk_numel // BLOCKSIZE * BLOCKSIZE)
        chunk, size = [], 0
        for p in params:
            numel = local_shard(p).numel()
            for a in range(0, numel, piece):
                b = min(numel, a + piece)
                if chunk and size + b - a > self.chunk_numel:
                    yield chunk
                    chunk, size = [], 0
                chunk.append((p, a, b))
                size += b - a
        if chunk:
            yield chunk

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step for every parameter with a gradient (``closure``: as ``torch.optim``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.advance()
        self.update([p for group in self.param_groups for p in group["params"] if p.grad is not None])
        idle = [p for p in self._ema if p.grad is None]
        if idle:  # the EMA follows every weight, stepped or not (as EMA.update does)
            rate = 1.0 - self.ema_decay
            if self.found_inf is not None:  # a tensor weight: one per tensor (foreach takes no 0-dim "scalar")
                rate = [rate * (1 - self.found_inf.float().reshape(()))] * len(idle)
            torch._foreach_lerp_([local_shard(self._ema[p]) for p in idle],
                                 [local_shard(p).detach().float() for p in idle], rate)
        return loss

    def advance(self) -> None:
        """Count one optimizer step (``step`` does; ``StepInBackward`` calls it before a step's first ``update``)."""
        self.skip_undo.settle()
        for group in self.param_groups:
            group["rounding_step"] += 1
        if self._stream is not None:
            self._stream.begin_step()

    @torch.no_grad()
    def update(self, params: list[torch.Tensor]) -> None:
        """Apply this step's update to ``params`` (each with its ``grad``, all of this optimizer) and to nothing
        else: ``step`` passes every parameter, ``StepInBackward`` one block's."""
        for k, group in enumerate(self.param_groups):  # (load_state_dict replaces the group dicts: by index)
            mine = [p for p in params if self._index[p][0] == k]
            if self.fused:
                self._fused_update(group, mine)
                continue
            scale = self._grad_factor()
            if scale is not None and mine:
                torch._foreach_mul_([p.grad for p in mine], scale.to(mine[0].grad.device))
            for p in mine:
                if not self.state[p]:
                    self._init_state(p)
                elif self._eightbit(p) and self.state[p]["step"].device.type != "cpu":
                    # states saved by the fused step: bitsandbytes takes the count as a number, kept on the host
                    self.state[p]["step"] = self.state[p]["step"].cpu()
            for chunk in self._chunks(mine):
                if self.found_inf is None:
                    self._step_chunk(group, chunk)
                else:
                    self._step_chunk_or_skip(group, chunk)

    def _grad_factor(self) -> torch.Tensor | None:
        """This step's multiplier of the gradients (0-dim): the clipping coefficient over GradScaler's loss scale
        when it did not unscale first; None for 1."""
        scale = self.clip_coef
        if self.grad_scale is not None:
            scale = (1.0 if scale is None else scale) / self.grad_scale
        return scale

    def _fused_update(self, group: dict, params: list[torch.Tensor]) -> None:
        """One ``OnePassAdamW`` launch per kind of parameter (dtype, 8-bit or not, EMA or not); the launches are
        built once per list of parameters (their state's addresses go to the device then). Offloaded: per
        chunk of at most the ring's ``chunk_bytes`` of state, on the chunk's device copies."""
        for p in params:
            if not self.state[p]:
                self._init_state(p)
            elif self.state[p]["step"].device != p.device:  # states saved by the libraries' path
                self.state[p]["step"] = self.state[p]["step"].to(p.device)
        resident = params if self._stream is None else [p for p in params if p in self._resident]
        if resident:
            self._launch(group, tuple(resident), resident, self.state)
        params = [p for p in params if self._streamed(p)]
        if not params:
            return
        chunks = self._chunks_of.get(tuple(params))
        if chunks is None:  # greedy, in order: (key, its (parameter, state name) pairs)
            chunks, chunk, size = [], [], 0
            for p in [*params, None]:  # None: the end
                if chunk and (p is None or size + self._state_bytes(p) > self._stream.chunk_bytes):
                    names = [(q, name) for q in chunk for name in self.state[q] if name != "step"]
                    chunks.append((tuple(chunk), names))
                    chunk, size = [], 0
                if p is not None:
                    chunk.append(p)
                    size += self._state_bytes(p)
            self._chunks_of[tuple(params)] = chunks
        for key, names in chunks:
            if not self._stream.packed(key):  # the chunk's states move into one pinned buffer, as views
                packed = self._stream.pack(key, [self.state[q][name] for q, name in names])
                for (q, name), view in zip(names, packed):
                    self.state[q][name] = view
            offset, views = self._stream.fetch(key)
            states = None
            if (key, offset) not in self._launches:
                states = {q: {"step": self.state[q]["step"]} for q in key}
                for (q, name), view in zip(names, views):
                    states[q][name] = view
            self._launch(group, (key, offset), list(key), states)
            self._stream.release(key, offset)

    def _launch(self, group: dict, key: tuple, params: list[torch.Tensor], states) -> None:
        """The update of ``params`` with their ``states`` (parameter -> state dict; used when the launches are not
        cached yet under ``key``)."""
        launches = self._launches.get(key)
        if launches is None:
            kinds: dict[Kind, list[torch.Tensor]] = {}
            for p in params:
                kind = Kind(p.dtype, p.grad.dtype, self._eightbit(p),
                            self.rounding if p.dtype == torch.bfloat16 else None, p in self._ema)
                kinds.setdefault(kind, []).append(p)
            launches = self._launches[key] = [
                (ps, OnePassAdamW([local_shard(p).detach() for p in ps],
                                  [{name: local_shard(t) for name, t in states[p].items()} for p in ps], kind,
                                  [local_shard(self._ema[p]) for p in ps] if kind.ema else None,
                                  [self._index[p][1] for p in ps])) for kind, ps in kinds.items()]
        scale = self._grad_factor()
        beta1, beta2 = group["betas"]
        for ps, launch in launches:
            launch([local_shard(p.grad).contiguous() for p in ps], lr=group["lr"],
                   beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], scale=scale,
                   skip=self.found_inf, ema_rate=1.0 - self.ema_decay,
                   codes=self._qmap(ps[0].device) if launch.kind.eightbit else None,
                   seed=rounding_seed(group["rounding_step"], 0))

    def _step_chunk_or_skip(self, group: dict, chunk: list[tuple[torch.Tensor, int, int]]) -> None:
        """``_step_chunk``, then every tensor it wrote (each piece's weight, moments or 8-bit codes and their
        blocks' absmax, compensation, step counter) selected back to its old value where ``found_inf`` is
        non-zero (``SkipUndo``: on the device, bitsandbytes' host step counters one step late), so a step not
        skipped is bit for bit ``_step_chunk``'s."""
        written = []
        for p, a, b in chunk:
            state = self.state[p]
            written += [local_shard(p).detach().view(-1)[a:b], state["step"]]
            for name in self._state_shapes(p):
                lo, hi = (a // BLOCKSIZE, -(-b // BLOCKSIZE)) if name.startswith("absmax") else (a, b)
                written.append(local_shard(state[name]).view(-1)[lo:hi])
        before = [t.clone() for t in written]
        self._step_chunk(group, chunk)
        self.skip_undo.select_back(written, before, self.found_inf)

    def _step_chunk(self, group: dict, chunk: list[tuple[torch.Tensor, int, int]]) -> None:
        states = [self.state[p] for p, _, _ in chunk]
        flat = [lambda t, a=a, b=b: local_shard(t).view(-1)[a:b] for _, a, b in chunk]  # a piece's slice of a tensor
        half = [i for i, (p, _, _) in enumerate(chunk) if p.dtype == torch.bfloat16]
        # fp32 master weights and gradients of the chunk: the parameters themselves where fp32, else rebuilt
        # as p + c in one transient buffer.
        w = [flat[i](p) for i, (p, _, _) in enumerate(chunk)]
        g = [flat[i](p.grad) for i, (p, _, _) in enumerate(chunk)]
        if half:
            sizes = [w[i].numel() for i in half]
            n = sum(sizes)
            buf = torch.empty(2 * n, dtype=torch.float32, device=w[0].device)
            w32, g32 = buf[:n].split(sizes), buf[n:].split(sizes)
            torch._foreach_copy_(w32, [w[i] for i in half])
            if self.rounding == "kahan":
                torch._foreach_add_(w32, [flat[i](states[i]["compensation"]) for i in half])
            torch._foreach_copy_(g32, [g[i] for i in half])
            ps = [w[i] for i in half]
            for k, i in enumerate(half):
                w[i], g[i] = w32[k], g32[k]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        dense = [i for i, (p, _, _) in enumerate(chunk) if not self._eightbit(p)]
        if dense:
            whole = [chunk[i][2] - chunk[i][1] == local_shard(chunk[i][0]).numel() for i in dense]
            # a piece of a cut parameter takes the step count as it was; the count advances after its last piece
            steps = [states[i]["step"] if all_of_it else states[i]["step"].clone() for i, all_of_it in zip(dense, whole)]
            self._adamw([w[i] for i in dense], [g[i] for i in dense], [flat[i](states[i]["exp_avg"]) for i in dense],
                        [flat[i](states[i]["exp_avg_sq"]) for i in dense], steps, lr, beta1, beta2, eps, wd)
            for i, all_of_it in zip(dense, whole):
                if not all_of_it and chunk[i][2] == local_shard(chunk[i][0]).numel():
                    states[i]["step"] += 1
        for i, (p, a, b) in enumerate(chunk):
            if self._eightbit(p):
                s = states[i]
                if a == 0:
                    s["step"] += 1
                qmap1, qmap2 = self._qmap(p.device)
                blocks = slice(a // BLOCKSIZE, -(-b // BLOCKSIZE))
                self._F.optimizer_update_8bit_blockwise(  # it takes the step as a number: kept on the host
                    "adam", g[i], w[i], flat[i](s["state1"]), flat[i](s["state2"]), beta1, beta2, 0.0, 0.0, eps,
                    int(s["step"]), lr, qmap1, qmap2, local_shard(s["absmax1"])[blocks],
                    local_shard(s["absmax2"])[blocks], wd)
        if not half:
            return
        if self.rounding == "kahan":  # split the master again: p = bf16(w) (nearest), c = bf16(w - p)
            torch._foreach_copy_(ps, w32)
            torch._foreach_sub_(w32, ps)
            torch._foreach_copy_([flat[i](states[i]["compensation"]) for i in half], w32)
        else:  # stochastic: add uniform noise below bf16's last bit, truncate, and the cast is then exact
            bits = buf[:n].view(torch.int32)
            first, a, _ = chunk[half[0]]
            gen = self._generator(bits.device, group["rounding_step"], self._index[first][1], a)
            bits.add_(torch.randint(0, 1 << 16, (n,), dtype=torch.int32, device=bits.device, generator=gen))
            bits.bitwise_and_(-(1 << 16))
            torch._foreach_copy_(ps, w32)

    def _generator(self, device: torch.device, step: int, index: int, start: int) -> torch.Generator:
        """The generator for the chunk that starts at element ``start`` of parameter ``index`` at optimizer step
        ``step``. The seed is mixed into 32 bits (the CPU's Mersenne Twister keeps only the low 32 bits of a seed)
        by odd multipliers, so a chunk's stream repeats only after 2^32 steps."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device)
        return self._generators[device].manual_seed(rounding_seed(step, index, start) % 2**32)

    @staticmethod
    def _adamw(w, g, exp_avg, exp_avg_sq, steps, lr, beta1, beta2, eps, wd) -> None:
        """torch's AdamW over the fp32 views (fused kernel on CUDA; it advances the step counters)."""
        fused = w[0].is_cuda
        adam_functional(w, g, exp_avg, exp_avg_sq, [], steps,
                        foreach=not fused, fused=fused, decoupled_weight_decay=True, amsgrad=False,
                        beta1=beta1, beta2=beta2, lr=lr, weight_decay=wd, eps=eps, maximize=False)


class StepInBackward:
    """The optimizer step fused into the backward, a block at a time: as soon as the last gradient of a block
    (``ditforge.models.block_paths``) has accumulated,
    that block takes its AdamW step (``CompensatedAdamW.update``: one multi-tensor pass over the block) and its
    gradients are freed; the parameters outside the blocks (a UNet's projections and samplers, a DiT's final
    layer) step with the block before them in module order, the embedders before the first block as one last
    group. Gradients then never exist for the whole model at once. The technique of PyTorch's
    tutorial "How to save memory by fusing the optimizer step into the backward pass" and kohya-ss'
    ``--fused_backward_pass``, which step each parameter from its own hook; here a block is one step.

    Clipping (``max_grad_norm`` > 0): a block steps before the later blocks' gradients, hence the global norm,
    exist, so step k's gradients are scaled by min(1, max_grad_norm / (n_{k-1} + 1e-6)), n_{k-1} the global
    norm of step k-1's gradients before clipping; step 0 is not clipped. ``finish`` returns step k's norm.

    Skipping (``arm(found_inf)``): each block's update takes the device flag as the optimizer's ``found_inf``,
    so a step whose loss is already known to be non-finite when the backward starts changes nothing (weights,
    states, step counters, the clipping norm carried to the next step) with no host sync. A gradient that turns
    non-finite during the backward of a finite loss is found only in ``finish``'s norm, after the blocks before
    it (in the backward's order) have stepped: the flag must exist before the first hook runs, and a block's
    update cannot be taken back once later blocks' gradients show the fault without keeping a copy of every
    block's weights and states, the memory this pass exists to save.

    Use: ``arm()`` before the backward of a step's last micro-batch (earlier micro-batches accumulate as
    usual), ``finish()`` after it. One process only: DDP and FSDP reduce gradients after the hooks would step.

    Args:
        model: the model (its trainable parameters are all the optimizer's).
        optimizer: the ``CompensatedAdamW`` over them.
        max_grad_norm: the clipping threshold (<= 0: no clipping).
        before_update: called once per step before the first block's update (an async checkpoint's staging
            must finish before the weights change, as an optimizer step pre-hook does for ``step``).
    """

    def __init__(self, model: nn.Module, optimizer: CompensatedAdamW, max_grad_norm: float,
                 before_update=None):
        from ditforge.models import block_paths

        seen: set[nn.Parameter] = set()
        self.groups: list[list[nn.Parameter]] = []
        index = {}
        for path in block_paths(model):
            group = [p for p in model.get_submodule(path).parameters() if p.requires_grad and p not in seen]
            seen.update(group)
            index[path] = len(self.groups)
            self.groups.append(group)
        # Outside the blocks, a module's own parameters join the block before it in module (forward) order, which
        # the backward reaches next: their gradients wait one block, and a step has one update per block, not
        # one per projection or norm (each update costs the host ~1 ms of launches). Before the first block
        # (embedders, a UNet's conv_in), whose gradients come last: one more group.
        current, first = None, []
        for name, module in model.named_modules():
            if name in index:
                current = index[name]
                continue
            own = [p for p in module.parameters(recurse=False) if p.requires_grad and p not in seen]
            seen.update(own)
            (first if current is None else self.groups[current]).extend(own)
        self.groups = [g for g in [*self.groups, first] if g]
        self.optimizer, self.max_grad_norm, self.before_update = optimizer, max_grad_norm, before_update
        self.prev_norm: torch.Tensor | None = None
        self.armed = False
        for k, group in enumerate(self.groups):
            for p in group:
                p.register_post_accumulate_grad_hook(lambda p, k=k: self._arrived(k))

    def state_dict(self) -> dict:
        """The previous step's gradient norm (it clips the next step): a float, for a checkpoint's meta."""
        return {"prev_grad_norm": None if self.prev_norm is None else float(self.prev_norm)}

    def load_state_dict(self, state: dict) -> None:
        norm = state.get("prev_grad_norm")
        self.prev_norm = None if norm is None else torch.tensor(norm)

    def arm(self, found_inf: torch.Tensor | None = None) -> None:
        """The next backward completes a step: update each block as its gradients arrive, skipped where
        ``found_inf`` (0-dim float on the device) is non-zero."""
        self.armed, self.started, self.found_inf = True, False, found_inf
        self.arrived = [0] * len(self.groups)
        self.norms: list[torch.Tensor] = []  # per gradient its L2 norm (0-dim, the gradient's dtype)
        self.scale = None
        if self.max_grad_norm > 0 and self.prev_norm is not None:
            self.scale = clip_coefficient(self.prev_norm, self.max_grad_norm)

    def _arrived(self, k: int) -> None:
        if not self.armed:
            return
        self.arrived[k] += 1
        if self.arrived[k] == len(self.groups[k]):
            self._update(self.groups[k])

    @torch.no_grad()
    def _update(self, group: list[nn.Parameter]) -> None:
        params = [p for p in group if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        if not self.started:
            self.started = True
            if self.before_update is not None:
                self.before_update()
            self.optimizer.advance()
            if self.scale is not None:
                self.scale = self.scale.to(grads[0].device)
            self.optimizer.clip_coef, self.optimizer.found_inf = self.scale, self.found_inf  # read on the device
        self.norms.extend(torch._foreach_norm(grads, 2.0))  # one launch per block; summed in finish
        self.optimizer.update(params)
        for p in params:
            p.grad = None

    def finish(self) -> torch.Tensor:
        """Update what no hook completed (a block with a parameter that got no gradient this step) and return
        the step's global gradient norm before clipping (0-dim fp32)."""
        for group in self.groups:
            self._update(group)
        self.armed = False
        self.optimizer.clip_coef = self.optimizer.found_inf = None
        norm = torch.stack(self.norms).float().pow(2).sum().sqrt() if self.norms else torch.zeros(())
        if self.found_inf is None:
            self.prev_norm = norm
        else:  # a skipped step keeps the norm that clips the next one (none yet: 0, which clips by exactly 1)
            prev = torch.zeros((), device=norm.device) if self.prev_norm is None else self.prev_norm.to(norm.device)
            self.prev_norm = torch.where(self.found_inf.to(norm.device) != 0, prev, norm)
        return norm


def build_optimizer(params: list[nn.Parameter], optimizer: str, lr: float, weight_decay: float,
                    device: torch.device, master_weights: str = "fp32",
                    in_backward: bool = False, fused: bool = True, offload: str = "none",
                    delayed_update: bool = False) -> torch.optim.Optimizer:
    """The optimizer for ``--optimizer`` over ``params`` (bf16 ones take their updates as ``master_weights``
    says: ``bf16`` Kahan-compensated, ``bf16_sr`` stochastically rounded): ``CompensatedAdamW`` with the one-pass
    Triton step where ``fused`` (``--fused_optimizer auto``) and it runs (a CUDA device; fully_shard's DTensors
    stepped shard by shard, not tensor parallelism's); otherwise ``torch.optim.AdamW`` (fused, CUDA and CPU) for ``adamw`` over fp32
    weights stepped after the backward, else ``CompensatedAdamW`` with the libraries' kernels;
    ``LIBRARY_OPTIMIZERS``: the library's own (``library_optimizer``; ``config.validate`` keeps them to the step
    after the backward). betas (0.9, 0.999), eps 1e-8 (DiT's and diffusers' training scripts'). ``offload``
    ``optimizer`` (``--cpu_offload optimizer``): the states in pinned host memory; ``all``: the parameters are
    FSDP2's host shards, stepped by torch's fused AdamW on the CPU (``DelayedAdamW`` with ``delayed_update``).

    Raises:
        UserError: an unknown ``optimizer``, ``adamw8bit`` without bitsandbytes, adamw4bit / adamw_fp8 without
            torchao, or ``offload`` where the one-pass
            step does not run.
    """
    if optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer: expected one of {', '.join(OPTIMIZERS)}, got {optimizer}")
    if optimizer in LIBRARY_OPTIMIZERS:
        return library_optimizer(params, optimizer, lr, weight_decay)
    if offload == "all":  # ZeRO-Offload's CPU step, with torch's fused (vectorised, multi-threaded) CPU kernel
        kind = DelayedAdamW if delayed_update else functools.partial(torch.optim.AdamW, fused=True)
        return kind(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999))
    fused = fused and on_gpu_with_triton(device) and all(_sharded_by_rows(p) for p in params)
    if offload == "optimizer" and not fused:
        raise UserError(f"--cpu_offload optimizer: needs the one-pass optimizer step (a CUDA GPU with Triton, "
                        f"--fused_optimizer auto, --plugin none or ddp); here the device is {device}")
    if not fused and optimizer == "adamw" and not in_backward and all(p.dtype == torch.float32 for p in params):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999),
                                 fused=device.type in ("cuda", "cpu"))
    return CompensatedAdamW(params, lr=lr, weight_decay=weight_decay,
                            states="8bit" if optimizer == "adamw8bit" else "fp32",
                            rounding="stochastic" if master_weights == "bf16_sr" else "kahan", fused=fused,
                            offload=offload == "optimizer")


RESIDENCY_MARGIN = 2**28  # bytes under the budget left free beyond the measured peak (at least; or 5% of it)


def keep_states_within(optimizer: torch.optim.Optimizer, budget: int, device: torch.device) -> tuple[int, int]:
    """Measured placement for ``--gpu_memory_budget`` with ``--cpu_offload optimizer``, called after the first
    steps (their compilation, CUDA graph pools and every transient included): the GPU memory the caching
    allocator has reserved at its peak so far is measured, and the optimizer states that fit in what the budget
    leaves, less ``max(RESIDENCY_MARGIN, budget / 20)``, move to the GPU (``CompensatedAdamW.keep_on_device``);
    the rest keep streaming. Returns (bytes moved, the measured peak in bytes)."""
    peak = torch.cuda.max_memory_reserved(device)
    spare = budget - peak - max(RESIDENCY_MARGIN, budget // 20)
    return (optimizer.keep_on_device(spare) if spare > 0 else 0), peak


def cap_gpu_memory(budget: int | None, device: torch.device) -> None:
    """Cap this process's GPU memory at ``budget`` bytes, as a GPU of that size would
    (``torch.cuda.set_per_process_memory_fraction``; allocations beyond it raise ``torch.OutOfMemoryError``); None
    lifts the cap. The CUDA context (about 0.5 GiB) is outside the cap, as it is outside a smaller card's free
    memory."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if budget is None else min(1.0, budget / total), index)


def out_of_memory(step: int, budget: str | None, device: torch.device) -> UserError:
    """The one-line error for an out-of-memory at ``step``: the cap, the peak, and the flags that save memory."""
    where = f"--gpu_memory_budget {budget}" if budget else "the GPU's memory"
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return UserError(f"out of memory at step {step}: {where} (peak {peak:.2f} GiB allocated); save memory with "
                     "--optimizer adamw8bit, --master_weights bf16_sr, --fused_backward_pass, --cpu_offload "
                     "optimizer, --ema_decay 0, --grad_checkpoint, --offload_activations, --lora_rank or a smaller "
                     "--batch_size")


# Placements from fastest to smallest: (--optimizer, --master_weights, --fused_backward_pass, --cpu_offload).
PLACEMENTS = (("adamw", "fp32", False, "none"), ("adamw8bit", "fp32", False, "none"),
              ("adamw8bit", "bf16", False, "none"), ("adamw8bit", "bf16_sr", False, "none"),
              ("adamw8bit", "bf16_sr", True, "none"), ("adamw8bit", "bf16_sr", True, "optimizer"))
STATE_BYTES = {"adamw": 8, "adamw8bit": 2, "adamw4bit": 1, "adamw_fp8": 2, "adafactor": 0}  # moments per parameter
ACTIVATION_RESERVE = 2**29  # 0.5 GiB kept free for activations, workspaces and the step's transient buffers


def bytes_per_parameter(optimizer: str, master_weights: str, fused_backward_pass: bool, cpu_offload: str) -> int:
    """GPU bytes per trainable parameter, as CompensatedAdamW and torch's AdamW allocate them: the weight (4 fp32,
    2 bf16), its gradient (as the weight; none with the fused backward pass, where only one block's gradients
    exist at a time), the moments (``STATE_BYTES``: 8 fp32, 2 as 8-bit codes or fp8, 1 as 4-bit codes, about 0 for
    Adafactor's factored second moments; scales not counted) and Kahan's bf16 compensation (2), these two on the
    host with ``cpu_offload`` "optimizer" (the ring is a fixed ``RING_BYTES``); none with "all", where all of them
    live on the host and each block's weights visit the GPU for its forward and backward."""
    if cpu_offload == "all":
        return 0
    weight = 4 if master_weights == "fp32" else 2
    states = STATE_BYTES[optimizer] + (2 if master_weights == "bf16" else 0)
    return weight + (0 if fused_backward_pass else weight) + (0 if cpu_offload == "optimizer" else states)


def state_bytes(trainable: int, frozen_bytes: int, placement: tuple[str, str, bool, str], ema: bool) -> int:
    """GPU bytes of the training state: ``trainable`` parameters under ``placement`` (``bytes_per_parameter``), the
    fp32 EMA (4 bytes each) when kept, ``frozen_bytes`` of frozen weights and the offload ring. Activations not
    included. With ``--cpu_offload all`` the EMA and the frozen weights are host shards too."""
    if placement[3] == "all":
        return 0
    ring = RING_BYTES if placement[3] == "optimizer" else 0
    return trainable * (bytes_per_parameter(*placement) + 4 * ema) + frozen_bytes + ring


def plan_placement(budget: int, trainable: int, frozen_bytes: int, ema: bool, placement: tuple[str, str, bool, str],
                   bf16: bool, lowmem: bool = True, fused_ok: bool = True, offload_ok: bool = True
                   ) -> tuple[str, str, bool, str]:
    """The placement (--optimizer, --master_weights, --fused_backward_pass, --cpu_offload) for
    ``--gpu_memory_budget``: the given one if its state (``state_bytes``) plus 0.5 GiB for activations fits
    ``budget``; otherwise, when the flags were left at their defaults, the fastest of ``PLACEMENTS`` that fits
    (bf16 weights only with ``bf16`` compute; ``lowmem``: CompensatedAdamW's placements allowed, i.e. plugin none
    or ddp; ``fused_ok``: the fused backward pass allowed, i.e. one process without fp16; ``offload_ok``: the
    one-pass optimizer step runs, which offload needs). Activations beyond the reserve are the user's
    (``--grad_checkpoint``, ``--batch_size``); an out-of-memory during training says so. The count is one
    process's whole state (DDP's gradient buckets and sample grids not included).

    Raises:
        UserError: nothing fits; the line names the smallest budget that would hold the state.
    """
    gib = 2**30
    chosen = [placement]
    if placement == PLACEMENTS[0]:
        chosen = [p for p in PLACEMENTS if (bf16 or p[1] == "fp32") and (lowmem or p == PLACEMENTS[0])
                  and (fused_ok or not p[2]) and (offload_ok or p[3] == "none")]
    for p in chosen:
        if state_bytes(trainable, frozen_bytes, p, ema) + ACTIVATION_RESERVE <= budget:
            return p
    opt, master, fused, offload = chosen[-1]
    need = state_bytes(trainable, frozen_bytes, chosen[-1], ema) + ACTIVATION_RESERVE
    ema = ema and offload != "all"  # on the host too
    hint = "" if offload == "all" else ("; --ema_decay 0 drops the EMA's 4 bytes per parameter" if ema else "") + \
        "; --cpu_offload all keeps all of it in host memory"
    raise UserError(f"--gpu_memory_budget {budget / gib:.2f} GiB: {trainable / 1e6:.0f}M trainable parameters "
                    f"with --optimizer {opt} --master_weights {master}{' --fused_backward_pass' if fused else ''}"
                    f"{' --cpu_offload ' + offload if offload != 'none' else ''}{' and an EMA' if ema else ''} need "
                    f"{math.ceil(need / gib * 100) / 100:.2f} GiB (state + 0.5 GiB for activations); give at least "
                    f"that{hint}")
