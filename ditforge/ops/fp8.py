"""Row-wise scaled float8 GEMMs for sampling (``--mixed_precision fp8``), with the input quantization in one pass.

Each chosen ``nn.Linear`` (D_in -> D_out) becomes a ``RowwiseFloat8Linear``: its bf16 weight is stored once as
e4m3 with one float32 scale per output channel; at run time every input row is quantized to e4m3 with its own
scale (``quantize_rows``), and ``torch._scaled_mm`` multiplies the two, accumulates in fp32, applies both
scales and the bias, and returns bf16. The scaling is torchao's ``Float8DynamicActivationFloat8WeightConfig(
PerRow())`` (which ``apply_fp8`` used before); what differs is where the activation quantization runs.

Why our own: at DiT-XL's width (D = 1152, MLP 4608) the GEMMs are short, and the quantization of their inputs
decides whether float8 pays. Under ``torch.compile`` torchao's path left the MLP's GELU, the row maximum and
the cast to inductor, which made one kernel of them that took 117 ms of a 436 ms batch-8 sampling loop (84 us
a call, 3-5x what its bytes need; H100, 2026-11-23, ``benchmarks/results/sampling/h100_images_fp8_kernels.txt``),
more than the float8 GEMMs saved. Here the MLP (``gelu_mlp``) hands fc1's output to one Triton pass
(``ditforge.ops.triton.quant``) that applies the GELU, takes each row's maximum and writes 1 byte per element
plus a scale per row. The other inputs are quantized by inductor inside the kernels that produce them (under
``torch.compile``), or by the same Triton pass (eagerly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.library import triton_op, wrap_triton

__all__ = ["RowwiseFloat8Linear", "quantize_rows", "quantize_rows_reference", "to_rowwise_float8"]

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448, its largest finite value (the kernel's too)
AMAX_EPS = 1e-12  # floor of a row's absolute maximum (an all-zero row gets scale 1e-12 / 448, not 0)


def quantize_rows_reference(x: torch.Tensor, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 quantization in PyTorch: the reference of ``quantize_rows``.

    h = GELU_tanh(x) if ``gelu`` else x (float32); a = max(amax_row(|h|), 1e-12); s = a / 448;
    q = e4m3(clamp(h * (448 / a), -448, 448)) rounded to nearest, ties to even; h ~= q * s. (torchao's row-wise float8
    scaling; 448 is e4m3's largest finite value, Micikevicius et al. 2022, table 1.)

    Args:
        x: (..., D) float tensor.
        gelu: apply GELU with the tanh approximation first (DiT's MLP activation).

    Returns:
        (q (..., D) float8_e4m3fn, s (..., 1) float32).
    """
    h = x.float()
    if gelu:
        h = F.gelu(h, approximate="tanh")
    amax = h.abs().amax(-1, keepdim=True).clamp_min(AMAX_EPS)
    top = torch.full_like(amax, E4M3_MAX)  # tensors: CUDA divides by a Python number through its reciprocal
    return (h * (top / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), amax / top


def _config(D: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps): a tile of about 4096 elements (one row when D > 4096), 16 elements per
    thread, 4 to 16 warps."""
    from ditforge.ops.fused import row_tile_config  # lazily: see _quantize_rows_op

    return row_tile_config(D, tile=4096, per_thread=16, min_warps=4)


@triton_op("ditforge::quantize_rows", mutates_args=())
def _quantize_rows_op(x: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, D) with unit column stride -> (q (M, D) e4m3, s (M, 1) float32)."""
    # imported here, not at the top: the model code imports this module, and Triton's interpreter must be
    # chosen (TRITON_INTERPRET) before the kernels are built; check_triton raises where they cannot run
    from ditforge.ops.fused import check_triton

    check_triton(x.device)
    from ditforge.ops.triton import quant as _k

    M, D = x.shape
    q = torch.empty((M, D), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    block_d, rows, num_warps = _config(D)
    wrap_triton(_k.rowwise_e4m3_kernel)[(-(-M // rows),)](
        x, q, s, M, D, x.stride(0), GELU=gelu, ROWS=rows, BLOCK_D=block_d, num_warps=num_warps,
    )
    return q, s


def quantize_rows(x: torch.Tensor, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 quantization of a GEMM input in one Triton pass (GELU first when ``gelu``): one read of x,
    1 byte per element and 4 per row written. Math as ``quantize_rows_reference``; equal to it exactly without
    ``gelu`` (float32 arithmetic with correctly rounded division; a NaN or inf in a row makes NaNs, as there),
    and with it up to the float32 rounding of the
    GELU (tanh through exp), which can move a value that sits on a rounding boundary by one e4m3 step.
    Inference only: the op has no backward.

    Args:
        x: (..., D) float32 / bfloat16 / float16; any leading strides (copied if the last dim is not unit-stride).

    Returns:
        (q (..., D) float8_e4m3fn, s (..., 1) float32).

    Raises:
        RuntimeError: Triton cannot run here (no CUDA GPU for the tensors and no ``TRITON_INTERPRET=1``).
    """
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    q, s = _quantize_rows_op(rows, gelu)
    return q.view(x.shape), s.view(*x.shape[:-1], 1)


class RowwiseFloat8Linear(nn.Module):
    """An inference linear layer (D_in -> D_out) as a row-wise scaled float8 GEMM.

    Buffers: ``weight`` (D_out, D_in) float8_e4m3fn and ``weight_scale`` (1, D_out) float32, from a bf16 weight
    by ``quantize_rows_reference`` per output channel; ``bias`` (D_out,) bf16 or None. ``forward`` quantizes its
    input rows (see ``forward``) and calls ``torch._scaled_mm`` (fp32 accumulation with fast accumulation, as
    torchao's inference default; scales and bias in the epilogue; bf16 out). D_in and D_out must be multiples of
    16 (the float8 GEMMs' requirement). Build it from a model already in its final dtype and device: ``.to(dtype)``
    would cast the float8 buffers too (PyTorch counts float8 as floating point).
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> RowwiseFloat8Linear:
        """The float8 version of a bf16 ``linear`` (its weight quantized once, row-wise per output channel).

        Raises:
            ValueError: the weight is not bf16, or a side is not a multiple of 16.
        """
        w = linear.weight.detach()
        if w.dtype != torch.bfloat16:
            raise ValueError(f"RowwiseFloat8Linear: the weight must be bfloat16, got {w.dtype}")
        if w.shape[0] % 16 or w.shape[1] % 16:
            raise ValueError(f"RowwiseFloat8Linear: both sides must be multiples of 16, got {tuple(w.shape)}")
        q, s = quantize_rows_reference(w)
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        return cls(q, s.t().contiguous(), bias)

    def forward_quantized(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """The GEMM on already quantized inputs: q (..., D_in) e4m3, s (..., 1) float32 -> (..., D_out) bf16."""
        out = torch._scaled_mm(q.reshape(-1, self.in_features), self.weight.t(), scale_a=s.reshape(-1, 1),
                               scale_b=self.weight_scale, bias=self.bias, out_dtype=torch.bfloat16,
                               use_fast_accum=True)
        return out.view(*q.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D_in) float -> (..., D_out) bf16. Eagerly the input is quantized by one Triton pass
        (``quantize_rows``); under ``torch.compile`` by the same arithmetic in PyTorch
        (``quantize_rows_reference``), which inductor fuses into the kernel that produces x (the
        LayerNorm-modulate before qkv and fc1, the attention output's copy before proj): there the row maximum
        and the cast cost about 5 us a call on top of that kernel (21.6 against 17 us; H100, batch 8,
        2026-11-23, ``benchmarks/results/sampling/h100_images_fp8_kernels.txt``), less than a separate pass, which must
        read the bf16 tensor back."""
        q, s = quantize_rows_reference(x) if torch.compiler.is_compiling() else quantize_rows(x)
        return self.forward_quantized(q, s)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def to_rowwise_float8(model: nn.Module, keep) -> int:
    """Replace every ``nn.Linear`` of ``model`` for which ``keep(module, qualified_name)`` is true by its
    ``RowwiseFloat8Linear``. Returns the number replaced."""
    chosen = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and keep(m, fqn)]
    for fqn in chosen:
        parent, _, name = fqn.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, name, RowwiseFloat8Linear.from_linear(getattr(owner, name)))
    return len(chosen)
