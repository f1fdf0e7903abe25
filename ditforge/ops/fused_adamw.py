"""One-pass AdamW over many tensors: the launcher of ``ditforge.ops.triton.adamw.adamw_kernel``.

The unfused step of a DiT-XL/2 (675M fp32 parameters) reads and writes the parameters several times: the clip
multiplies the gradients in place, torch's fused AdamW reads weight, gradient and both moments and writes three
of them, and the EMA reads the new weights again. One pass reads each of weight, gradient, moments and EMA once
and writes each once (36 bytes per parameter for fp32 with an EMA; 14 for Kahan bf16 with 8-bit moments, where
bitsandbytes' kernel plus the compensation passes move about 3x that). ``CompensatedAdamW`` calls it when its
parameters are on a GPU (``fused``); the math and its sources are in the kernel's module.

Where it runs: CUDA tensors, or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` before the first
import), as ``ditforge.ops.triton.check_triton`` says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ditforge.ops.triton import check_triton

__all__ = ["Kind", "OnePassAdamW", "on_gpu_with_triton"]

QBLOCK = 256  # bitsandbytes' 8-bit block; every program's element range is a whole number of these
BLOCK = 2048  # elements per program


@dataclass(frozen=True)
class Kind:
    """What one launch serves (the kernel's compile-time options): weight and gradient dtypes, 8-bit moments,
    how bf16 weights are rounded ("kahan" | "stochastic" | None for fp32 weights), and whether an EMA rides along."""

    weight: torch.dtype
    grad: torch.dtype
    eightbit: bool
    rounding: str | None
    ema: bool


def on_gpu_with_triton(device: torch.device) -> bool:
    """Whether the fused step is the default on ``device``: a CUDA device where Triton runs. (Triton's CPU
    interpreter also runs it, for tests, but only when asked: it is far slower than torch's CPU kernels.)"""
    if torch.device(device).type != "cuda":
        return False
    try:
        check_triton(device)
    except RuntimeError:
        return False
    return True


_TL = {}  # torch dtype -> triton dtype, filled on first use (triton imported lazily)
_consts: dict[tuple, torch.Tensor] = {}


def _tl(dtype: torch.dtype):
    if not _TL:
        import triton.language as tl

        _TL.update({torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16})
    return _TL[dtype]


def _const(value: float, device: torch.device) -> torch.Tensor:
    key = (value, device)
    if key not in _consts:
        _consts[key] = torch.full((1,), value, dtype=torch.float32, device=device)
    return _consts[key]


def _log2(beta: float) -> float:
    """log2 of a moment's decay as the kernel takes it (its bias correction is ``1 - exp2(step log2 beta)``): for
    beta 0 (no first moment, DMD2's betas (0, 0.999)) a finite stand-in for -inf, so that beta^step is 0 from step 1
    on and 1 at step 0, as for every other beta."""
    return math.log2(beta) if beta > 0 else -1e4


def _check_aligned(values) -> None:
    """The kernel's loads assume every address is a multiple of 16 bytes. Raises ValueError otherwise."""
    if any(a % 16 for a in values):
        raise ValueError("OnePassAdamW: every tensor must start at a multiple of 16 bytes (not a view into one)")


def _addresses(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of addresses on ``device`` (``_check_aligned``)."""
    _check_aligned(values)
    host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


class OnePassAdamW:
    """One AdamW step over a fixed list of tensors of one ``Kind``, in one kernel launch per call.

    The addresses of the weights and their state (8 per tensor: weight, first and second state, their absmax,
    compensation, EMA, step counter; 0 where the kind has none) go to the device once, at construction; a call
    sends only the gradients' addresses, and only when one changed (gradients freed with ``set_to_none`` mostly
    come back at the same addresses from the caching allocator). So a step costs the host one pass over the
    gradients, not over every state tensor.

    Args:
        weights: parameters of ``kind.weight`` (fp32, or bf16 with ``kind.rounding``), contiguous, one device.
        states: per weight, ``CompensatedAdamW``'s state dict: ``step`` (0-dim fp32 on the device, advanced by 1
            per call unless skipped), ``exp_avg``/``exp_avg_sq`` (fp32) or bitsandbytes' ``state1``/``state2``
            (uint8) and ``absmax1``/``absmax2`` (fp32, one per 256 elements), ``compensation`` (bf16) with Kahan
            rounding. The tensors must stay the same objects (rebuild after ``load_state_dict``).
        kind: the launch's compile-time options (every tensor must match them).
        emas: per weight its fp32 EMA when ``kind.ema``, updated as e += ema_rate * (w - e) with the new master.
        indices: per weight its position among the optimizer's parameters (keys its stochastic rounding's
            stream, with the call's ``seed``); default 0, 1, 2, ...

    Raises:
        RuntimeError: Triton cannot run on these tensors (``check_triton``). ValueError: a tensor that does not
            start at a multiple of 16 bytes.
    """

    def __init__(self, weights: list[torch.Tensor], states: list[dict], kind: Kind,
                 emas: list[torch.Tensor] | None = None, indices: list[int] | None = None):
        device = weights[0].device
        check_triton(device)
        from ditforge.ops.triton.adamw import adamw_kernel  # after the check: Triton is there

        self.kernel = adamw_kernel
        self.device, self.kind, self.steps = device, kind, [s["step"] for s in states]
        rows = []
        for i, (w, s) in enumerate(zip(weights, states)):
            moments = ((s["state1"], s["state2"], s["absmax1"], s["absmax2"]) if kind.eightbit
                       else (s["exp_avg"], s["exp_avg_sq"], None, None))
            rows += [w.data_ptr(), *(0 if t is None else t.data_ptr() for t in moments),
                     s["compensation"].data_ptr() if kind.rounding == "kahan" else 0,
                     emas[i].data_ptr() if kind.ema else 0, s["step"].data_ptr()]
        self.table = _addresses(rows, device)
        numels = [w.numel() for w in weights]
        self.numels = torch.tensor(numels, dtype=torch.int64).to(device)
        indices = range(len(weights)) if indices is None else indices
        self.indices = torch.tensor(indices, dtype=torch.int32).to(device)
        self.chunk_t = torch.cat([torch.full((-(-n // BLOCK),), i, dtype=torch.int32)
                                  for i, n in enumerate(numels)]).to(device)
        self.chunk_start = torch.cat([torch.arange(0, n, BLOCK, dtype=torch.int64) for n in numels]).to(device)
        # the gradients' addresses: the last ones sent, and a pinned host table copied to the device table when
        # they change (no pinned allocation per step; the copy of one step ago has ended before the rewrite)
        self._sent: tuple[int, ...] | None = None
        cuda = device.type == "cuda"
        self._grad_host = torch.empty(len(weights), dtype=torch.int64, pin_memory=cuda)
        self._grad_table = torch.empty(len(weights), dtype=torch.int64, device=device)
        self._copied: torch.cuda.Event | None = None

    def __call__(self, grads: list[torch.Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, scale: torch.Tensor | None = None, skip: torch.Tensor | None = None,
                 ema_rate: float = 0.0, codes: tuple[torch.Tensor, torch.Tensor] | None = None,
                 seed: int = 0) -> None:
        """Step the weights in place.

        Args:
            grads: the weights' gradients (``kind.grad``), same shapes, contiguous.
            lr, beta1, beta2, eps, weight_decay: AdamW's hyper-parameters (decoupled weight decay).
            scale: 0-dim or (1,) fp32 multiplier of the gradients on the device (the clipping coefficient).
            skip: 0-dim or (1,) tensor on the device, non-zero to skip the step (nothing changes, the step
                counters included), as torch's ``found_inf``.
            ema_rate: 1 - the EMA's decay.
            codes: bitsandbytes' signed and unsigned dynamic maps (256 fp32 each, sorted) for 8-bit moments.
            seed: the stochastic rounding's stream for this step (with the tensor's ``indices`` entry and the
                element).
        """
        device, kind = self.device, self.kind
        addresses = tuple(g.data_ptr() for g in grads)
        if self._sent != addresses:
            _check_aligned(addresses)
            if self._copied is not None:
                self._copied.synchronize()
            self._grad_host.copy_(torch.tensor(addresses, dtype=torch.int64))
            self._grad_table.copy_(self._grad_host, non_blocking=True)
            if device.type == "cuda":
                self._copied = torch.cuda.current_stream(device).record_event()
            self._sent = addresses
        skip_t = _const(0.0, device) if skip is None else skip.reshape(1).float()
        scale_t = _const(1.0, device) if scale is None else scale.reshape(1).float()
        # before the kernel, which reads them. A list of the one increment: given a 0-dim tensor, Python's
        # overload resolution picks _foreach_add_.Scalar and reads it to the host (.item(), a stream sync per step)
        torch._foreach_add_(self.steps, [1.0 - skip_t.reshape(())] * len(self.steps))
        code1, code2 = codes if kind.eightbit else (scale_t, scale_t)
        self.kernel[(self.chunk_t.numel(),)](
            self.table, self._grad_table, self.numels, self.indices, self.chunk_t, self.chunk_start, scale_t, skip_t,
            code1, code2, lr, beta1, beta2, _log2(beta1), _log2(beta2), eps, weight_decay, ema_rate,
            seed % 2**31,
            W_TYPE=_tl(kind.weight), G_TYPE=_tl(kind.grad), EIGHTBIT=kind.eightbit, KAHAN=kind.rounding == "kahan",
            STOCHASTIC=kind.rounding == "stochastic", EMA=kind.ema, BLOCK=BLOCK, QBLOCK=QBLOCK, num_warps=8,
        )
