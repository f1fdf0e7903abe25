"""adaLN operators: LayerNorm + modulate, and the gated residual.

Each has a plain PyTorch reference; fused Triton kernels with the same signature replace them when
``parallelize`` calls ``set_kernels`` (``--enable_modulate_kernel``, ``--enable_layernorm_kernel``), so model
code never branches on them. The layer a LayerNorm's output goes to may be named (``into``): a float8 layer
(sampling with ``--mixed_precision fp8``) then gets its input already quantized, from the same pass; and a
gated residual may be handed on unsummed (``GatedSum``), for that pass to sum first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ditforge.ops.fp8 import Float8Rows, RowwiseFloat8Linear, layernorm_modulate_e4m3, quantize_rows


def per_token(v: torch.Tensor) -> torch.Tensor:
    """A modulation vector against (B, N, D) tokens: (B, D) per sample -> (B, 1, D), broadcast over the tokens;
    (B, N, D) per token (packed sequences, where each token carries its own sample's values) as it is."""
    return v.unsqueeze(1) if v.dim() == 2 else v


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN modulation ``x * (1 + scale) + shift`` with per-sample shift and scale broadcast over tokens.

    Source: Peebles & Xie 2023, section 3.2 (adaLN), and ``modulate`` in facebookresearch/DiT models.py.

    Args:
        x: (B, N, D) normalised tokens.
        shift, scale: (B, D) per-sample modulation from the conditioning vector, or (B, N, D) per token (packed
            sequences: each token its own sample's row).

    Returns:
        (B, N, D), dtype of the inputs' type promotion.
    """
    return x * (1 + per_token(scale)) + per_token(shift)


def layernorm_modulate_reference(
    x: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor | None, eps: float = 1e-6
) -> torch.Tensor:
    """LayerNorm without affine parameters over the last dim, then ``modulate`` (plain LayerNorm when
    ``shift`` and ``scale`` are None).

    Source: ``modulate(self.norm1(x), shift, scale)`` in facebookresearch/DiT models.py (Ba et al. 2016 for
    LayerNorm: ``(x - mean) / sqrt(var + eps)``, biased variance).

    Args:
        x: (B, N, D) tokens.
        shift, scale: (B, D), (B, N, D) (per token), or both None.
        eps: added to the variance.

    Returns:
        (B, N, D), dtype as PyTorch's ``layer_norm`` then ``modulate`` give (fp32 statistics under autocast).
    """
    h = F.layer_norm(x, x.shape[-1:], eps=eps)
    return h if shift is None else modulate(h, shift, scale)


def gated_residual_reference(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """adaLN-Zero's gated residual ``x + gate * y``, gate broadcast over tokens (DiT paper section 3.2).

    Args:
        x: (B, N, D) residual stream; y: (B, N, D) branch output; gate: (B, D), or (B, N, D) per token.

    Returns:
        (B, N, D) in the promoted dtype of the inputs.
    """
    return x + per_token(gate) * y


def layernorm_then_modulate(
    layernorm: Callable[[torch.Tensor, float], torch.Tensor], x: torch.Tensor, shift: torch.Tensor | None,
    scale: torch.Tensor | None, eps: float = 1e-6,
) -> torch.Tensor:
    """``layernorm(x, eps)`` then ``modulate`` in PyTorch: with the Triton LayerNorm (``ops.fused.layernorm``: no
    affine, fp32 statistics; output in x.dtype), what ``--enable_layernorm_kernel`` alone runs. Shapes and math
    as ``layernorm_modulate_reference``; the result dtype is that of PyTorch's ``modulate`` on x.dtype, shift,
    scale (x.dtype without shift/scale).

    Raises:
        ValueError: only one of shift and scale given; or what ``layernorm`` raises.
    """
    if (shift is None) != (scale is None):
        raise ValueError("layernorm_then_modulate: give both shift and scale, or neither")
    h = layernorm(x, eps)
    return h if shift is None else modulate(h, shift, scale)


_layernorm_modulate = layernorm_modulate_reference
_gated_residual = gated_residual_reference


def set_kernels(enable_modulate_kernel: bool = False, enable_layernorm_kernel: bool = False) -> str:
    """Choose the implementations behind ``layernorm_modulate`` and ``gated_residual``.

    ``enable_layernorm_kernel``: LayerNorm runs as one Triton kernel (fp32 statistics), modulate in PyTorch.
    ``enable_modulate_kernel``: LayerNorm and modulate run as one Triton pass, and so does the gated residual.
    Neither: the PyTorch references. Returns a description for the log. The kernels raise RuntimeError on
    their first call if Triton cannot run (``ditforge.ops.triton.check_triton`` checks up front).
    """
    global _layernorm_modulate, _gated_residual
    if not (enable_modulate_kernel or enable_layernorm_kernel):
        _layernorm_modulate, _gated_residual = layernorm_modulate_reference, gated_residual_reference
        return "PyTorch LayerNorm and modulate"
    from ditforge.ops import fused  # here, not at the top: importing it builds the kernels (after TRITON_INTERPRET)

    if enable_modulate_kernel:
        _layernorm_modulate, _gated_residual = fused.layernorm_modulate, fused.gated_residual
        return "Triton: fused LayerNorm + modulate, fused gated residual"
    _layernorm_modulate = functools.partial(layernorm_then_modulate, fused.layernorm)
    _gated_residual = gated_residual_reference
    return "Triton: LayerNorm; PyTorch modulate"


def layernorm_modulate(
    x: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor | None, eps: float = 1e-6,
    into: nn.Module | None = None,
) -> torch.Tensor | Float8Rows:
    """LayerNorm (no affine) then adaLN modulate; see ``layernorm_modulate_reference`` for shapes and math.
    Runs the implementation chosen by ``set_kernels``.

    ``into``: the linear layer that takes the result, or None. A ``RowwiseFloat8Linear`` gets ``Float8Rows``
    (e4m3 rows and their scales) instead of a tensor: from one Triton pass (``ops.fp8.layernorm_modulate_e4m3``)
    where the modulation is per sample, else from ``quantize_rows`` after this op.
    """
    return residual_layernorm_modulate(x, shift, scale, eps, into)[1]


class GatedSum(NamedTuple):
    """adaLN-Zero's gated residual ``x + gate * y`` not summed yet: what a ``DiTBlock`` returns at inference
    (no autograd graph recorded), so that the next LayerNorm's pass sums it (``residual_layernorm_modulate``):
    with a float8 layer after that LayerNorm, one Triton pass instead of two. Shapes as
    ``gated_residual_reference``."""

    x: torch.Tensor
    y: torch.Tensor
    gate: torch.Tensor


def residual_layernorm_modulate(
    x: torch.Tensor | GatedSum, shift: torch.Tensor | None, scale: torch.Tensor | None, eps: float = 1e-6,
    into: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor | Float8Rows]:
    """The stream's LayerNorm + modulate after summing its pending gated residual (a ``GatedSum`` x):
    ``x = gated_residual(*x)`` and ``layernorm_modulate(x, shift, scale, eps, into)``; returns (x, that). For a float8
    ``into`` with per-sample modulation the two are one pass, which writes x and the e4m3 rows
    (``layernorm_modulate_e4m3``); its x + gate * y is rounded to x's dtype once, where bf16 PyTorch rounds the
    product too (one bf16 step apart in about a quarter of the values). Shapes as ``gated_residual_reference``
    and ``layernorm_modulate_reference``."""
    x, y, gate = x if isinstance(x, GatedSum) else (x, None, None)
    float8 = isinstance(into, RowwiseFloat8Linear)
    if float8 and _fused_pass_applies(x, y, gate, shift, scale):
        return layernorm_modulate_e4m3(x, shift, scale, eps, y, gate)
    if y is not None:
        x = _gated_residual(x, y, gate)
    h = _layernorm_modulate(x, shift, scale, eps)
    return x, Float8Rows(*quantize_rows(h)) if float8 else h


def _fused_pass_applies(x, y, gate, shift, scale) -> bool:
    """Whether ``layernorm_modulate_e4m3`` takes these: tokens (B, N, D); shift, scale and gate (B, D), one row
    per sample; y and gate in x's dtype, so that the stream keeps it. Otherwise the installed ops run, then
    ``quantize_rows``."""
    per_sample = lambda v: v.dim() == 2 and v.shape[0] == x.shape[0]  # noqa: E731
    return (x.dim() == 3 and shift is not None and per_sample(shift) and per_sample(scale)
            and (y is None or (per_sample(gate) and y.dtype == gate.dtype == x.dtype)))


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x + gate * y``; see ``gated_residual_reference``. Runs the implementation chosen by ``set_kernels``."""
    return _gated_residual(x, y, gate)
