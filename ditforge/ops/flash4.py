"""FlashAttention-4's exact attention kernels behind the attention seam, and the per-shape choice between them and
PyTorch's SDPA (``exact_attention``).

FlashAttention-4 is the ``flash-attn-4`` wheel (Dao-AILab/flash-attention, ``flash_attn/cute``: kernels written in
NVIDIA's CuTe DSL, compiled on first use; forward and backward for Hopper, SM90, and Blackwell, SM100). It is an
optional extra (``pip install "ditforge[fa4]"``); without it, on the CPU, or for an input it does not take
(``fa4_unavailable``), everything runs PyTorch's SDPA as before.

Measured at a 1.3B video transformer's 480 x 832 x 81 self-attention (B = 2, 32,760 tokens, 12 heads of 128,
bf16) on one H200, 2026-12-03 (torch 2.11.0+cu130, cuDNN 9.19, flash-attn-4 4.0.0b40, nvidia-cutlass-dsl 4.8.1;
``benchmarks/kernel_speed.py exact-attention``): forward 19.60 ms (673 TFLOPS) against cuDNN SDPA's 23.05 ms (572) and
FlashAttention-2's 36.43 ms (362); forward + backward 72.41 ms (637) against 85.66 ms (539) and 140.16 ms (329); the
output's relative RMS error against float32 attention 2.3e-3 for all three. Which kernel is fastest depends on the
shape (short sequences, other head widths), so ``exact_attention`` measures both on the first call of each shape
(``fastest_exact_kernel``) and keeps the answer for the process.

The kernels enter as ``torch.library`` custom ops (``ditforge::flash4_forward`` / ``flash4_backward``), opaque to
``torch.compile`` (the CuTe DSL's launcher is not traceable) with their shapes declared, and joined by
``register_autograd``: the forward saves the output and the log-sum-exp, which the backward takes (FlashAttention's
backward, Dao 2023, "FlashAttention-2", algorithm 2), as the library's own ``FlashAttnFunc`` does.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import statistics
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["exact_attention", "fa4_installed", "fa4_unavailable", "fastest_exact_kernel", "flash4_attention"]

log = logging.getLogger(__name__)
FA4_DTYPES = (torch.float16, torch.bfloat16)
_OPS: SimpleNamespace | None = None
_CHOICES: dict[tuple, str] = {}  # fastest_exact_kernel's answers, for the process
_TIMES: dict[tuple, dict[str, float]] = {}  # fastest_exact_kernel's measured medians (ms), by its key


@functools.cache
def fa4_installed() -> bool:
    """Whether ``flash_attn.cute`` (the ``flash-attn-4`` wheel) imports."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:  # a wheel set that does not import (another CUDA's DSL libraries) is "not installed"
        return False
    return True


@torch._dynamo.assume_constant_result  # host facts, not traced (dynamo refuses importlib): constants of a graph
def _device_facts(device: int) -> tuple[int, bool]:
    """(compute capability major of CUDA device ``device``, whether FlashAttention-4 is installed)."""
    return torch.cuda.get_device_capability(device)[0], fa4_installed()


def fa4_unavailable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
                    ) -> str | None:
    """Why FlashAttention-4 cannot run ``attention(q, k, v, mask)`` ((B, S, H, D) each), or None when it can: a mask,
    keys of another length or width, a CPU tensor, a dtype other than fp16 / bf16, a GPU other than Hopper (SM90)
    or Blackwell (SM100), a head width the library's SM90 / SM100 kernels do not take (its ``_validate_head_dims``:
    multiples of 8, 8-256 on SM90, 8-128 or 256 on SM100), or the library not installed."""
    d = q.shape[-1]
    if mask is not None:
        return "a mask"
    if k.shape != q.shape or v.shape != q.shape:
        return "keys or values of another shape"
    if not q.is_cuda:
        return "not a CUDA tensor"
    if q.dtype not in FA4_DTYPES:
        return f"dtype {q.dtype}"
    major, installed = _device_facts(q.device.index)
    widths_ok = {9: 8 <= d <= 256, 10: 8 <= d <= 128 or d == 256}.get(major)
    if widths_ok is None:
        return f"compute capability {major}.x"
    if d % 8 or not widths_ok:
        return f"head width {d}"
    if not installed:
        return "flash-attn-4 not installed"
    return None


def ops() -> SimpleNamespace:
    """The custom ops (registered once, on first use): ``flash4_forward(q, k, v, scale) -> (out (B, S, H, D) in q's
    dtype, lse (B, H, S) float32)`` and ``flash4_backward(q, k, v, out, lse, dout, scale) -> (dq, dk, dv)``, with
    autograd joining them."""
    global _OPS
    if _OPS is not None:
        return _OPS

    @torch.library.custom_op("ditforge::flash4_forward", mutates_args=())
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        from flash_attn.cute.interface import _flash_attn_fwd

        out, lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, return_lse=True)[:2]
        return out.contiguous(), lse.contiguous()  # the layouts the fake declares, whatever the inputs' strides

    @forward.register_fake
    def _(q, k, v, scale):
        B, S, H, _ = q.shape
        return q.new_empty(q.shape), q.new_empty((B, H, S), dtype=torch.float32)

    @torch.library.custom_op("ditforge::flash4_backward", mutates_args=())
    def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 dout: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from flash_attn.cute.interface import _flash_attn_bwd

        dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, softmax_scale=scale)[:3]
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    @backward.register_fake
    def _(q, k, v, out, lse, dout, scale):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        q, k, v, scale = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.scale = scale

    def grad(ctx, dout, dlse):  # the lse is an internal output: nothing flows back through it
        q, k, v, out, lse = ctx.saved_tensors
        return (*backward(q, k, v, out, lse, dout, ctx.scale), None)

    forward.register_autograd(grad, setup_context=setup_context)
    _OPS = SimpleNamespace(forward=forward, backward=backward)
    return _OPS


def flash4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v (Vaswani et al. 2017, eq. 1; scale default 1 / sqrt(D)) by FlashAttention-4.

    Args:
        q, k, v: (B, S, H, D), fp16 or bf16, on a GPU ``fa4_unavailable`` accepts.

    Returns:
        (B, S, H, D) in q's dtype; differentiable in q, k and v.
    """
    return ops().forward(q, k, v, q.shape[-1] ** -0.5 if scale is None else float(scale))[0]


def _sdpa(q, k, v, scale=None, backends: tuple[str, ...] | None = None):
    """SDPA in the (B, S, H, D) layout, its kernels in the order ``backends`` (``SDPBackend`` names; None:
    PyTorch's)."""
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    if backends is None:
        return F.scaled_dot_product_attention(*args, scale=scale).transpose(1, 2)
    with sdpa_kernel([getattr(SDPBackend, b) for b in backends], set_priority=True):
        return F.scaled_dot_product_attention(*args, scale=scale).transpose(1, 2)


def _median_ms(fn, calls: int = 5) -> float:
    """Median CUDA-event milliseconds of ``fn()`` over ``calls`` calls after two untimed ones (FlashAttention-4's
    first call compiles its kernel)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


@torch._dynamo.assume_constant_result  # run at trace time: the choice is a constant of the compiled graph
def fastest_exact_kernel(shape: tuple[int, int, int, int], dtype: torch.dtype, device: int, backward: bool,
                         backends: tuple[str, ...] | None) -> str:
    """``"fa4"`` or ``"sdpa"``: the faster exact attention of (B, S, H, D) inputs of ``dtype`` on CUDA device
    ``device``, measured once a process per argument set on fresh Gaussian inputs:
    the forward, or with ``backward`` forward + backward; SDPA under ``backends`` (``SDPBackend`` names in order, the
    ``--enable_flashattn`` order; None: PyTorch's). A one-line log of both times."""
    key = (shape, dtype, device, backward, backends)
    if key not in _CHOICES:
        _CHOICES[key] = _measure(*key)
    return _CHOICES[key]


def measured_choices() -> list[dict]:
    """What ``fastest_exact_kernel`` measured in this process, one dict a shape: ``shape`` (B, S, H, D), ``dtype``,
    ``backward``, ``kernel`` (``"fa4"`` | ``"sdpa"``), ``fa4_ms`` and ``sdpa_ms`` (medians); for a benchmark's
    record of which kernel ran."""
    return [dict(shape=list(key[0]), dtype=str(key[1]), backward=key[3], kernel=_CHOICES[key],
                 fa4_ms=round(t["fa4"], 3), sdpa_ms=round(t["sdpa"], 3)) for key, t in _TIMES.items()]


def _measure(shape, dtype, device, backward, backends) -> str:
    """``fastest_exact_kernel``'s measurement."""
    gen = torch.Generator(f"cuda:{device}").manual_seed(0)
    q, k, v = (torch.randn(shape, dtype=dtype, device=f"cuda:{device}", generator=gen,
                           requires_grad=backward) for _ in range(3))
    times = {}
    for name, fn in (("sdpa", lambda: _sdpa(q, k, v, backends=backends)), ("fa4", lambda: flash4_attention(q, k, v))):
        run = (lambda fn=fn: fn().sum().backward()) if backward else fn
        with torch.no_grad() if not backward else torch.enable_grad():
            times[name] = _median_ms(run)
    best = min(times, key=times.get)
    _TIMES[(shape, dtype, device, backward, backends)] = times
    log.info("exact attention at (B, S, H, D) = %s %s%s: %s (FlashAttention-4 %.2f ms, SDPA %.2f ms)", shape, dtype,
             " forward + backward" if backward else "", best, times["fa4"], times["sdpa"])
    return best


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    backends: tuple[str, ...] | None = None) -> torch.Tensor:
    """Exact softmax attention of (B, S, H, D) inputs (no mask) by the faster of FlashAttention-4 and SDPA at this
    shape (``fastest_exact_kernel``; SDPA alone where ``fa4_unavailable``, and at a shape with a dynamic dimension).
    ``backends``: SDPA's kernel order by ``SDPBackend`` name (None: PyTorch's). Returns (B, S, H, D) in q's dtype."""
    # a dynamic dimension (a compiled graph's symbolic size) has no shape to measure at: SDPA takes it
    if fa4_unavailable(q, k, v) is None and all(isinstance(n, int) for n in q.shape):
        backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        kernel = fastest_exact_kernel(tuple(q.shape), q.dtype, q.device.index, backward, backends)
        if kernel == "fa4":
            return flash4_attention(q, k, v, scale)
    return _sdpa(q, k, v, scale, backends)
