"""Fused Triton adaLN operators as ``torch.library`` Triton ops: LayerNorm + modulate, the gated residual.

Drop-in replacements for ``layernorm_modulate_reference`` and ``gated_residual_reference`` in
``ditforge.ops.modulate`` (same signatures; ``set_kernels`` installs them). Each op is a
``torch.library.triton_op`` in the ``ditforge::`` namespace whose kernels launch through ``wrap_triton``, with
``register_autograd``; its backward is another such op. So ``torch.compile`` traces into them: inductor sees the
Triton kernels and the PyTorch work around them (allocations, the backward's partial-sum reductions and casts)
and schedules and fuses that work with its neighbours, instead of calling an opaque op (DESIGN principle 4).
Eager calls run the same Python body. The kernels are in ``ditforge.ops.triton.adaln``.

Math (sources): LayerNorm without affine parameters, biased variance, float32 statistics (Ba et al. 2016);
adaLN modulate ``xhat * (1 + scale) + shift`` and the adaLN-Zero gated residual ``x + gate * y`` (Peebles &
Xie 2023, section 3.2). Backward of LayerNorm + modulate, from xhat = (x - mean) * rstd:
dshift[b] = sum_n dh, dscale[b] = sum_n dh * xhat, dxhat = dh * (1 + scale),
dx = rstd * (dxhat - mean_D(dxhat) - xhat * mean_D(dxhat * xhat)).

Where the kernels run: CUDA tensors on a GPU, or CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is first imported); otherwise the ops raise ``RuntimeError``.
"""

from __future__ import annotations

import functools

import torch
from torch.library import triton_op, wrap_triton

from ditforge.ops.triton import check_triton, row_major, triton

try:
    from ditforge.ops.triton import adaln as _k
except ImportError:  # Triton is not installed: the ops raise when called (check_triton)
    _k = None

__all__ = ["gated_residual", "layernorm", "layernorm_modulate"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# Launch configuration, swept on an H100 (Triton 3.6, CUDA graphs timing) at D = 384 and 1152, B * N from
# 8K to 131K rows, dtypes as under autocast (x fp32; shift/scale/gate/y bf16). At B, N, D = 64, 2048, 1152:
# layernorm_modulate 325 us forward (2.8 TB/s of 3.0 copy bandwidth) + 594 us backward (2.5 TB/s);
# gated_residual 498 + 475 us (3.0 / 2.5 TB/s). The forward kernels are at their best with a ~4K-element
# tile; the backward ones with one or two rows per loop step (they carry two float32 accumulator tiles: big
# tiles with few warps spill registers and ran 10x slower) and ~16 programs per SM.


def row_tile_config(D: int, tile: int, per_thread: int, min_warps: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps) of a row kernel over rows of D elements: BLOCK_D the next power of two >= D,
    ROWS rows (1 to 8) for a tile of about ``tile`` elements, and warps for ``per_thread`` elements a thread
    (``min_warps`` to 16)."""
    block_d = 1 << (D - 1).bit_length()
    rows = max(1, min(8, tile // block_d))
    return block_d, rows, max(min_warps, min(16, rows * block_d // (32 * per_thread)))


def _fwd_config(D: int) -> tuple[int, int, int]:
    """The forward kernels: a tile of about 4096 elements, 32 elements per thread (4 warps at 4096; more warps
    only for D > 4096)."""
    return row_tile_config(D, tile=4096, per_thread=32, min_warps=4)


def _bwd_config(D: int) -> tuple[int, int, int]:
    """The backward kernels: a tile of about 1024 elements per loop step, 16 elements per thread (at least 2
    warps; D = 1152: 1 row, 4 warps)."""
    return row_tile_config(D, tile=1024, per_thread=16, min_warps=2)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_groups(n_blocks: int, B: int, device: torch.device) -> int:
    """Programs per sample in the backward kernels (grid (G, B)): about 16 programs per SM over the whole
    grid on a GPU, at most one per row block; 2 under the interpreter (exercises the loop and the sum).
    The float32 partial-sum buffers are then (B, G, D): 16 * SMs * D * 4 bytes (9.7 MB on an H100 at
    D = 1152), independent of N."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(n_blocks, -(-16 * _sm_count(index) // B)))
    return max(1, min(n_blocks, 2))


def _check_tokens(name: str, x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"{name}: expected (B, N, D) tokens, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        raise ValueError(f"{name}: dtype must be float32, bfloat16 or float16, got {x.dtype}")


def _check_vector(name: str, v: torch.Tensor, x: torch.Tensor) -> None:
    if v.shape != (x.shape[0], x.shape[2]):
        raise ValueError(f"{name}: expected shape (B, D) = {(x.shape[0], x.shape[2])}, got {tuple(v.shape)}")
    if v.dtype not in _FLOATS:
        raise ValueError(f"{name}: dtype must be float32, bfloat16 or float16, got {v.dtype}")
    if v.device != x.device:
        raise ValueError(f"{name}: on {v.device}, tokens on {x.device}")


# ---------------------------------------------------------------------------------------------------------
# LayerNorm + modulate
# ---------------------------------------------------------------------------------------------------------


@triton_op("ditforge::layernorm_modulate", mutates_args=())
def _ln_mod_op(
    x: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor | None, eps: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (B, N, D) out_dtype, mean (B*N,) fp32, rstd (B*N,) fp32); mean/rstd are saved for backward."""
    check_triton(x.device)
    B, N, D = x.shape
    x = x.contiguous()
    out = torch.empty((B, N, D), dtype=out_dtype, device=x.device)
    mean = torch.empty(B * N, dtype=torch.float32, device=x.device)
    rstd = torch.empty(B * N, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return out, mean, rstd
    has_mod = shift is not None
    if has_mod:
        shift, scale = row_major(shift), row_major(scale)
    block_d, rows, num_warps = _fwd_config(D)
    grid = (triton.cdiv(N, rows), B)
    wrap_triton(_k.layernorm_modulate_fwd_kernel)[grid](
        x, shift if has_mod else x, scale if has_mod else x, out, mean, rstd, N, D,
        shift.stride(0) if has_mod else 0, scale.stride(0) if has_mod else 0, eps,
        HAS_MOD=has_mod, ROWS=rows, BLOCK_D=block_d, num_warps=num_warps,
    )
    return out, mean, rstd


@triton_op("ditforge::layernorm_modulate_backward", mutates_args=())
def _ln_mod_bwd_op(
    dout: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
    shift_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx in x.dtype, dshift (B, D) in shift_dtype, dscale (B, D) in scale.dtype)."""
    check_triton(x.device)
    B, N, D = x.shape
    x, dout = x.contiguous(), dout.contiguous()
    scale = row_major(scale)
    dx = torch.empty_like(x)
    if x.numel() == 0:  # two tensors: an op's outputs may not alias each other
        return (dx, torch.zeros((B, D), dtype=shift_dtype, device=x.device),
                torch.zeros((B, D), dtype=scale.dtype, device=x.device))
    block_d, rows, num_warps = _bwd_config(D)
    G = _num_groups(triton.cdiv(N, rows), B, x.device)
    dshift_part = torch.empty((B, G, D), dtype=torch.float32, device=x.device)
    dscale_part = torch.empty((B, G, D), dtype=torch.float32, device=x.device)
    wrap_triton(_k.layernorm_modulate_bwd_kernel)[(G, B)](
        dout, x, scale, mean, rstd, dx, dshift_part, dscale_part, N, D, scale.stride(0), G,
        HAS_MOD=True, ROWS=rows, BLOCK_D=block_d, num_warps=num_warps,
    )
    return dx, dshift_part.sum(1).to(shift_dtype), dscale_part.sum(1).to(scale.dtype)


@triton_op("ditforge::layernorm_backward", mutates_args=())
def _ln_bwd_op(dout: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """dx in x.dtype for plain LayerNorm (no shift/scale)."""
    check_triton(x.device)
    B, N, D = x.shape
    x, dout = x.contiguous(), dout.contiguous()
    dx = torch.empty_like(x)
    if x.numel() == 0:
        return dx
    block_d, rows, num_warps = _bwd_config(D)
    G = _num_groups(triton.cdiv(N, rows), B, x.device)
    wrap_triton(_k.layernorm_modulate_bwd_kernel)[(G, B)](
        dout, x, x, mean, rstd, dx, mean, mean, N, D, 0, G,
        HAS_MOD=False, ROWS=rows, BLOCK_D=block_d, num_warps=num_warps,
    )
    return dx


def _ln_mod_setup_context(ctx, inputs, output):
    x, shift, scale, eps, out_dtype = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.shift_dtype = None if shift is None else shift.dtype
    ctx.save_for_backward(x, scale, mean, rstd)


def _ln_mod_backward(ctx, dout, _dmean, _drstd):
    x, scale, mean, rstd = ctx.saved_tensors
    if scale is None:
        return _ln_bwd_op(dout, x, mean, rstd), None, None, None, None
    dx, dshift, dscale = _ln_mod_bwd_op(dout, x, scale, mean, rstd, ctx.shift_dtype)
    return dx, dshift, dscale, None, None


_ln_mod_op.register_autograd(_ln_mod_backward, setup_context=_ln_mod_setup_context)


def layernorm_modulate(
    x: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor | None, eps: float = 1e-6
) -> torch.Tensor:
    """Fused LayerNorm (no affine, biased variance, fp32 statistics) then adaLN modulate, one pass over x.

    ``h = (x - mean) / sqrt(var + eps) * (1 + scale[:, None]) + shift[:, None]`` (Ba et al. 2016 LayerNorm;
    DiT, Peebles & Xie 2023, section 3.2); plain LayerNorm when shift and scale are None. Same results as
    ``ditforge.ops.modulate.layernorm_modulate_reference`` (up to float rounding), differentiable in all inputs
    (gradients in each input's dtype).

    Args:
        x: (B, N, D) tokens, float32/bfloat16/float16, any strides (copied to contiguous if needed).
        shift, scale: (B, D), float32/bfloat16/float16 (may differ from x's), any strides; or both None.
        eps: added to the variance.

    Returns:
        (B, N, D). dtype: the autocast dtype if autocast is on for x's device type (the next Linear casts to it
        anyway, so the kernel writes it directly); otherwise the promotion of x, shift, scale (x.dtype without
        shift/scale).

    Raises:
        ValueError: bad shapes/dtypes, or only one of shift and scale given.
        RuntimeError: Triton cannot run here (no CUDA GPU for the tensors and no ``TRITON_INTERPRET=1``).
    """
    _check_tokens("x", x)
    if (shift is None) != (scale is None):
        raise ValueError("layernorm_modulate: give both shift and scale, or neither")
    if shift is not None:
        _check_vector("shift", shift, x)
        _check_vector("scale", scale, x)
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        out_dtype = torch.get_autocast_dtype(dev)
    elif shift is None:
        out_dtype = x.dtype
    else:
        out_dtype = torch.promote_types(x.dtype, torch.promote_types(shift.dtype, scale.dtype))
    return _ln_mod_op(x, shift, scale, float(eps), out_dtype)[0]


def layernorm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Triton LayerNorm (no affine, biased variance, fp32 statistics; output in x.dtype): what
    ``--enable_layernorm_kernel`` runs, before ``modulate`` in PyTorch (``ops.modulate.layernorm_then_modulate``).
    Differentiable in x. Shapes, math and errors as ``layernorm_modulate`` without shift and scale."""
    _check_tokens("x", x)
    return _ln_mod_op(x, None, None, float(eps), x.dtype)[0]


# ---------------------------------------------------------------------------------------------------------
# Gated residual
# ---------------------------------------------------------------------------------------------------------


@triton_op("ditforge::gated_residual", mutates_args=())
def _gated_op(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + gate[:, None, :] * y, (B, N, D) in the promoted dtype."""
    check_triton(x.device)
    B, N, D = x.shape
    x, y, gate = x.contiguous(), y.contiguous(), row_major(gate)
    out_dtype = torch.promote_types(x.dtype, torch.promote_types(y.dtype, gate.dtype))
    out = torch.empty((B, N, D), dtype=out_dtype, device=x.device)
    if x.numel() == 0:
        return out
    block_d, rows, num_warps = _fwd_config(D)
    wrap_triton(_k.gated_residual_fwd_kernel)[(triton.cdiv(N, rows), B)](
        x, y, gate, out, N, D, gate.stride(0), ROWS=rows, BLOCK_D=block_d, num_warps=num_warps,
    )
    return out


@triton_op("ditforge::gated_residual_backward", mutates_args=())
def _gated_bwd_op(dout: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy = dout * gate in y.dtype, dgate = sum_n dout * y (B, D) in gate.dtype)."""
    check_triton(y.device)
    B, N, D = y.shape
    dout, y, gate = dout.contiguous(), y.contiguous(), row_major(gate)
    dy = torch.empty_like(y)
    if y.numel() == 0:
        return dy, torch.zeros((B, D), dtype=gate.dtype, device=y.device)
    block_d, rows, num_warps = _bwd_config(D)
    G = _num_groups(triton.cdiv(N, rows), B, y.device)
    part = torch.empty((B, G, D), dtype=torch.float32, device=y.device)
    wrap_triton(_k.gated_residual_bwd_kernel)[(G, B)](
        dout, y, gate, dy, part, N, D, gate.stride(0), G, ROWS=rows, BLOCK_D=block_d, num_warps=num_warps,
    )
    return dy, part.sum(1).to(gate.dtype)


def _gated_setup_context(ctx, inputs, output):
    x, y, gate = inputs
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(y, gate)


def _gated_backward(ctx, dout):
    y, gate = ctx.saved_tensors
    dy, dgate = _gated_bwd_op(dout, y, gate)
    return dout.to(ctx.x_dtype), dy, dgate


_gated_op.register_autograd(_gated_backward, setup_context=_gated_setup_context)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Fused adaLN-Zero gated residual ``x + gate[:, None, :] * y`` (DiT, Peebles & Xie 2023, section 3.2),
    one pass, float32 arithmetic. Same results as ``ditforge.ops.modulate.gated_residual_reference``.

    Backward: dx = dout, dy = dout * gate, dgate[b] = sum_n dout * y (each in its input's dtype).

    Args:
        x: (B, N, D) residual stream; y: (B, N, D) branch output; gate: (B, D), any strides. Each
            float32/bfloat16/float16, mixed allowed (autocast: x fp32, y and gate bf16).

    Returns:
        (B, N, D) in the promoted dtype of x, y, gate (as PyTorch's ``x + gate * y``, also under autocast).

    Raises:
        ValueError: bad shapes/dtypes or devices.
        RuntimeError: Triton cannot run here (no CUDA GPU for the tensors and no ``TRITON_INTERPRET=1``).
    """
    _check_tokens("x", x)
    _check_tokens("y", y)
    if y.shape != x.shape:
        raise ValueError(f"gated_residual: y has shape {tuple(y.shape)}, x has {tuple(x.shape)}")
    if y.device != x.device:
        raise ValueError(f"gated_residual: y on {y.device}, x on {x.device}")
    _check_vector("gate", gate, x)
    return _gated_op(x, y, gate)
