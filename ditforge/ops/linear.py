"""The transformer MLP's products: fc1 and its GELU in one GEMM for sampling, and the float8 path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ditforge.ops.fp8 import RowwiseFloat8Linear, quantize_rows


def linear_gelu_tanh(x: torch.Tensor, fc: nn.Linear) -> torch.Tensor:
    """GELU with the tanh approximation (as DiT's MLP) of ``fc(x)``: (..., D_in) -> (..., D_out), dtype of x.

    On CUDA, without autograd, with x in the weight's dtype (sampling: weights cast to bf16/fp16) this is one
    cuBLASLt GEMM with the bias and the GELU in its epilogue (``torch._addmm_activation(use_gelu=True)``,
    which on CUDA is the tanh approximation): the (rows, D_out) hidden activation is written once, instead of
    being written by the GEMM and read and written again by a separate GELU kernel; the GELU is also applied
    to the float32 accumulator rather than to the rounded product. Measured on DiT-XL/2 sampling at batch 8
    (H100, benchmarks/sampling.py --top): the separate GELU was 9% of the GPU time. Everywhere else (CPU,
    where ``_addmm_activation`` is the exact GELU; training; autocast; float8 layers or weights) the plain
    ``F.gelu(fc(x), approximate="tanh")``.
    """
    if (type(fc) is nn.Linear and x.is_cuda and type(fc.weight) in (torch.Tensor, nn.Parameter)
            and fc.bias is not None and x.dtype == fc.weight.dtype
            and not (torch.is_grad_enabled() and (x.requires_grad or fc.weight.requires_grad))):
        out = torch._addmm_activation(fc.bias, x.reshape(-1, x.shape[-1]), fc.weight.t(), use_gelu=True)
        return out.view(*x.shape[:-1], fc.out_features)
    return F.gelu(fc(x), approximate="tanh")


def gelu_mlp(x: torch.Tensor, fc1: nn.Module, fc2: nn.Module) -> torch.Tensor:
    """The transformer MLP ``fc2(GELU_tanh(fc1(x)))``: (..., D_in) -> (..., D_out).

    With a float8 ``fc2`` (``RowwiseFloat8Linear``, sampling with ``--mixed_precision fp8``) fc1's bf16 output
    goes through one Triton pass that applies the GELU and quantizes each row to e4m3 for fc2
    (``quantize_rows(gelu=True)``): the hidden activation is read once and written as 1 byte per element.
    Otherwise ``fc2(linear_gelu_tanh(x, fc1))``.
    """
    if isinstance(fc2, RowwiseFloat8Linear):
        return fc2.forward_quantized(*quantize_rows(fc1(x), gelu=True))
    return fc2(linear_gelu_tanh(x, fc1))
