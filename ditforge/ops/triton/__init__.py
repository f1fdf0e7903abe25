"""Triton kernels (``@triton.jit`` functions only, one module per family: ``adaln``, ``quant``, ``adamw``), and what
their launchers (``ditforge.ops.fused``, ``ditforge.ops.fp8``, ``ditforge.ops.fused_adamw``) share: the import
guard, where the kernels can run, and the float8 constants that the kernels and the PyTorch references both use.

This module imports no kernel module at its top: importing one builds its kernels, and Triton's interpreter must
be chosen (``TRITON_INTERPRET``) before that.
"""

from __future__ import annotations

import logging

import torch

try:
    import triton
except ImportError:  # Triton is not installed (e.g. a CPU-only wheel on macOS): the ops raise when called
    triton = None
    # torch's triton_op would log "Triton not available" once per op of the launchers, at every import of theirs
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)

__all__ = ["AMAX_EPS", "E4M3_MAX", "check_triton", "interpreting", "row_major", "triton"]

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448, its largest finite value (the kernel's too)
AMAX_EPS = 1e-12  # floor of a row's absolute maximum (an all-zero row gets scale 1e-12 / 448, not 0)


def interpreting() -> bool:
    """True when the kernels run under Triton's CPU interpreter. ``triton.jit`` reads ``TRITON_INTERPRET``
    once, when the kernels are decorated (when their module is first imported), so what counts is how they
    were built, not the environment now: this asks the adaLN kernels (importing them if no launcher has yet)."""
    if triton is None:
        return False
    from ditforge.ops.triton import adaln  # here, not at the top: importing it builds the kernels (see above)

    return type(adaln.layernorm_modulate_fwd_kernel).__name__ == "InterpretedFunction"


def check_triton(device: torch.device | str) -> None:
    """Raise unless the Triton kernels can run on tensors of ``device`` here: a CUDA device, or any device
    under Triton's interpreter. ``set_kernels`` callers may call it up front; every op calls it.

    Raises:
        RuntimeError: one line: Triton is missing, or neither a CUDA GPU nor ``TRITON_INTERPRET=1``.
    """
    if triton is None:
        raise RuntimeError("Triton kernels need the 'triton' package, which is not installed here")
    device_type = torch.device(device).type
    if device_type == "cuda" or interpreting():
        return
    raise RuntimeError(
        f"Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (Triton's CPU interpreter, set before "
        f"ditforge.ops.fused is first imported); got {device_type} tensors and neither is on"
    )


def row_major(v: torch.Tensor) -> torch.Tensor:
    """A (B, D) tensor with unit column stride (a view of adaLN's chunked output qualifies, no copy)."""
    return v if v.stride(-1) == 1 else v.contiguous()
