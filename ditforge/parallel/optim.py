"""Memory of training: the GPU memory cap, and the optimizer's placement and precision: fp32 or Kahan-compensated bf16 weights, fp32 or 8-bit AdamW states.

``build_optimizer`` picks one of:
  * ``--optimizer adamw --master_weights fp32`` (the default): ``torch.optim.AdamW`` (fused on CUDA) over fp32
    parameters; 16 bytes per trainable parameter (weights, gradients, two moments) before the EMA.
  * ``CompensatedAdamW`` for everything else: AdamW with the moments in fp32 or as bitsandbytes' 8-bit blockwise
    codes (``--optimizer adamw8bit``: Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization";
    blocks of 256, the dynamic signed map for the first moment and the unsigned one for the second, tensors under
    4,096 elements kept in fp32 as bitsandbytes does), over fp32 parameters or bf16 parameters with a bf16 Kahan
    compensation buffer (``--master_weights bf16``). bf16 weights + compensation + bf16 gradients + 8-bit moments
    take 8 bytes per parameter instead of 16.

Kahan-compensated bf16 weights (Kahan 1965; for training, Zamirai et al. 2021, "Revisiting BFloat16 Training",
section 4): each bf16 parameter ``p`` carries ``c`` (bf16), the part of the fp32 master weight that rounding to
bf16 dropped, so the master is ``w = p + c`` to 2^-17 relative per split (``p`` rounds to 2^-8 of ``w``, and ``c``
holds that residual to 2^-8 of itself). A step rebuilds ``w``
in fp32 for a chunk of parameters at a time (at most ``chunk_numel`` elements: transient memory 8 bytes per
element of the chunk), applies the AdamW update to ``w`` with the gradient in fp32, and splits it again:
``p = bf16(w)`` (round to nearest), ``c = bf16(w - p)``. Updates far below bf16's resolution (lr 1e-5 on weights
of size 1 is 1/400 of a bf16 ulp) accumulate in ``c`` instead of being rounded away.

The update is the library's: ``torch.optim.adam.adam`` (the fused kernel on CUDA, foreach on the CPU) for fp32
moments, ``bitsandbytes.functional.optimizer_update_8bit_blockwise`` for 8-bit ones; this module only holds the
compensation and the chunking. The state is per parameter (``step``; ``exp_avg``/``exp_avg_sq`` or bitsandbytes'
``state1``/``state2``/``absmax1``/``absmax2``; ``compensation``), so ``torch.distributed.checkpoint`` saves and
resumes it like any optimizer's.
"""

from __future__ import annotations

import math

import torch
from torch.optim.adam import adam as adam_functional
from torch import nn

from ditforge.config import OPTIMIZERS
from ditforge.errors import UserError

BLOCKSIZE = 256  # bitsandbytes' block of the 8-bit blockwise optimizers
MIN_8BIT_SIZE = 4096  # bitsandbytes' default: smaller tensors keep fp32 moments


def bitsandbytes_functional():
    """``bitsandbytes.functional``, or a UserError naming the extra to install."""
    try:
        import bitsandbytes.functional as F
    except ImportError:
        raise UserError("--optimizer adamw8bit needs bitsandbytes: pip install 'ditforge[lowmem]'") from None
    return F


class CompensatedAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter 2019; decoupled weight decay ``w -= lr * wd * w``) with fp32 or 8-bit moments
    over fp32 parameters or Kahan-compensated bf16 parameters (module docstring).

    Args:
        params: parameters (fp32 or bf16; one dtype per tensor, any mix), or parameter groups.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        states: ``"fp32"`` or ``"8bit"`` (bitsandbytes' blockwise codes; tensors under 4,096 elements stay fp32).
        chunk_numel: parameters rebuilt in fp32 at once (a parameter larger than it is a chunk of its own).

    Raises:
        UserError: ``states="8bit"`` without bitsandbytes. ValueError: a parameter that is neither fp32 nor bf16.
    """

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, states: str = "fp32", chunk_numel: int = 1 << 25):
        if states not in ("fp32", "8bit"):
            raise ValueError(f"states: expected fp32 or 8bit, got {states}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(f"CompensatedAdamW: parameters must be fp32 or bf16, got {p.dtype}")
        self.states, self.chunk_numel = states, chunk_numel
        self._F = bitsandbytes_functional() if states == "8bit" else None
        self._qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but the states keep their own dtypes (torch casts floating
        states to the parameter's: the fp32 moments of a bf16 weight would lose their precision)."""
        super().load_state_dict(state_dict)
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for pid, p in zip(saved_group["params"], group["params"]):
                for key, value in state_dict["state"].get(pid, {}).items():
                    if torch.is_tensor(value):
                        self.state[p][key] = value.to(device=p.device, copy=True)

    def _eightbit(self, p: torch.Tensor) -> bool:
        return self.states == "8bit" and p.numel() >= MIN_8BIT_SIZE

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if self._eightbit(p):  # bitsandbytes takes the step as a number: a host int, never a device sync
            state["step"] = 0
            blocks = -(-p.numel() // BLOCKSIZE)
            state["state1"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
            state["state2"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)
            state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
            state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        else:  # torch's fused AdamW takes device step counters
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if p.dtype == torch.bfloat16:
            state["compensation"] = torch.zeros_like(p)
        return state

    def _qmap(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._qmaps:
            F = self._F
            self._qmaps[device] = (F.create_dynamic_map(signed=True).to(device),
                                   F.create_dynamic_map(signed=False).to(device))
        return self._qmaps[device]

    def _chunks(self, params: list[torch.Tensor]):
        chunk, size = [], 0
        for p in params:
            if chunk and size + p.numel() > self.chunk_numel:
                yield chunk
                chunk, size = [], 0
            chunk.append(p)
            size += p.numel()
        if chunk:
            yield chunk

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step for every parameter with a gradient (``closure``: as ``torch.optim``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for chunk in self._chunks(params):
                self._step_chunk(group, chunk)
        return loss

    def _step_chunk(self, group: dict, chunk: list[torch.Tensor]) -> None:
        states = [self.state[p] if self.state[p] else self._init_state(p) for p in chunk]
        half = [i for i, p in enumerate(chunk) if p.dtype == torch.bfloat16]
        # fp32 master weights and gradients of the chunk: the parameters themselves where fp32, else rebuilt
        # as p + c in one transient buffer.
        w = [p.view(-1) for p in chunk]
        g = [p.grad.view(-1) for p in chunk]
        if half:
            n = sum(chunk[i].numel() for i in half)
            buf = torch.empty(2 * n, dtype=torch.float32, device=chunk[0].device)
            sizes = [chunk[i].numel() for i in half]
            w32, g32 = buf[:n].split(sizes), buf[n:].split(sizes)
            torch._foreach_copy_(w32, [w[i] for i in half])
            torch._foreach_add_(w32, [states[i]["compensation"].view(-1) for i in half])
            torch._foreach_copy_(g32, [g[i] for i in half])
            for k, i in enumerate(half):
                w[i], g[i] = w32[k], g32[k]
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        dense = [i for i, p in enumerate(chunk) if not self._eightbit(p)]
        if dense:
            self._adamw([w[i] for i in dense], [g[i] for i in dense], [states[i] for i in dense],
                        lr, beta1, beta2, eps, wd)
        for i, p in enumerate(chunk):
            if self._eightbit(p):
                s = states[i]
                s["step"] += 1
                qmap1, qmap2 = self._qmap(p.device)
                self._F.optimizer_update_8bit_blockwise(
                    "adam", g[i], w[i], s["state1"].view(-1), s["state2"].view(-1), beta1, beta2, 0.0, 0.0, eps,
                    s["step"], lr, qmap1, qmap2, s["absmax1"], s["absmax2"], wd)
        if half:  # split the master again: p = bf16(w) (nearest), c = bf16(w - p)
            ps = [chunk[i].view(-1) for i in half]
            torch._foreach_copy_(ps, w32)
            torch._foreach_sub_(w32, ps)
            torch._foreach_copy_([states[i]["compensation"].view(-1) for i in half], w32)

    @staticmethod
    def _adamw(w, g, states, lr, beta1, beta2, eps, wd) -> None:
        """torch's AdamW over the fp32 views (fused kernel on CUDA; it advances the step counters)."""
        fused = w[0].is_cuda
        adam_functional(w, g, [s["exp_avg"].view(-1) for s in states],
                        [s["exp_avg_sq"].view(-1) for s in states], [], [s["step"] for s in states],
                        foreach=not fused, fused=fused, decoupled_weight_decay=True, amsgrad=False,
                        beta1=beta1, beta2=beta2, lr=lr, weight_decay=wd, eps=eps, maximize=False)


def build_optimizer(params: list[nn.Parameter], optimizer: str, lr: float, weight_decay: float,
                    device: torch.device) -> torch.optim.Optimizer:
    """The optimizer for ``--optimizer`` over ``params`` (their dtype says whether the weights are bf16 with
    Kahan compensation): ``torch.optim.AdamW`` (fused on CUDA) for ``adamw`` over fp32 weights, else
    ``CompensatedAdamW``. betas (0.9, 0.999), eps 1e-8 (DiT's and diffusers' training scripts').

    Raises:
        UserError: an unknown ``optimizer``, or ``adamw8bit`` without bitsandbytes.
    """
    if optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer: expected one of {', '.join(OPTIMIZERS)}, got {optimizer}")
    if optimizer == "adamw" and all(p.dtype == torch.float32 for p in params):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999),
                                 fused=device.type == "cuda")
    return CompensatedAdamW(params, lr=lr, weight_decay=weight_decay,
                            states="8bit" if optimizer == "adamw8bit" else "fp32")


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
                     "--optimizer adamw8bit, --master_weights bf16, --ema_decay 0, --grad_checkpoint, "
                     "--lora_rank or a smaller --batch_size")


# Placements from fastest to smallest: (--optimizer, --master_weights). Bytes per trainable parameter on the GPU:
# weights + gradients + moments (+ the bf16 compensation), as CompensatedAdamW and torch's AdamW allocate them.
PLACEMENTS = (("adamw", "fp32"), ("adamw8bit", "fp32"), ("adamw8bit", "bf16"))
STATE_BYTES = {("adamw", "fp32"): 16, ("adamw8bit", "fp32"): 10, ("adamw", "bf16"): 14, ("adamw8bit", "bf16"): 8}
ACTIVATION_RESERVE = 2**30  # kept free for activations, workspaces and the step's transient buffers


def state_bytes(trainable: int, frozen_bytes: int, optimizer: str, master_weights: str, ema: bool) -> int:
    """GPU bytes of the training state: ``trainable`` parameters under the placement (``STATE_BYTES``), the fp32
    EMA (4 bytes each) when kept, and ``frozen_bytes`` of frozen weights. Activations not included."""
    return trainable * (STATE_BYTES[optimizer, master_weights] + 4 * ema) + frozen_bytes


def plan_placement(budget: int, trainable: int, frozen_bytes: int, ema: bool, optimizer: str, master_weights: str,
                   bf16: bool, lowmem: bool = True) -> tuple[str, str]:
    """The placement for ``--gpu_memory_budget``: the given one if its state (``state_bytes``) plus 1 GiB for
    activations fits ``budget``; otherwise, when the flags were left at ``adamw`` / ``fp32``, the fastest of
    ``PLACEMENTS`` that fits (bf16 weights only with ``bf16`` compute; ``lowmem``: CompensatedAdamW's placements
    allowed, i.e. plugin none or ddp). Activations beyond the reserve are the user's (``--grad_checkpoint``,
    ``--batch_size``); an out-of-memory during training says so. The count is one process's whole state (DDP's
    gradient buckets and sample grids not included).

    Raises:
        UserError: nothing fits; the line names the smallest budget that would hold the state.
    """
    gib = 2**30
    chosen = [(optimizer, master_weights)]
    if (optimizer, master_weights) == ("adamw", "fp32"):
        chosen = [p for p in PLACEMENTS if (bf16 or p[1] == "fp32") and (lowmem or p == PLACEMENTS[0])]
    for opt, master in chosen:
        if state_bytes(trainable, frozen_bytes, opt, master, ema) + ACTIVATION_RESERVE <= budget:
            return opt, master
    opt, master = chosen[-1]
    need = state_bytes(trainable, frozen_bytes, opt, master, ema) + ACTIVATION_RESERVE
    hint = "; --ema_decay 0 drops the EMA's 4 bytes per parameter" if ema else ""
    raise UserError(f"--gpu_memory_budget {budget / gib:.2f} GiB: {trainable / 1e6:.0f}M trainable parameters "
                    f"with --optimizer {opt} --master_weights {master}{' and an EMA' if ema else ''} need "
                    f"{math.ceil(need / gib * 100) / 100:.2f} GiB (state + 1 GiB for activations); give at least "
                    f"that{hint}")
