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
more than the float8 GEMMs saved. Here every input goes through one Triton pass (``ditforge.ops.triton.quant``)
that takes each row's maximum and writes 1 byte per element plus a scale per row; the MLP (``gelu_mlp``)
hands it fc1's output, and it applies the GELU first. The inputs of qkv and fc1 come out of the block's
LayerNorm pass already quantized (``layernorm_modulate_e4m3``, as ``Float8Rows``), never written in bf16.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.library import triton_op, wrap_triton

from ditforge.ops.triton import AMAX_EPS, E4M3_MAX, check_triton, interpreting, row_major

__all__ = ["Float8Rows", "RowwiseFloat8Linear", "layernorm_modulate_e4m3", "quantize_rows", "quantize_rows_reference",
           "to_rowwise_float8"]


class Float8Rows(NamedTuple):
    """Activations quantized row-wise for a ``RowwiseFloat8Linear``: q (..., D) float8_e4m3fn and s (..., 1)
    float32, one scale per row (h ~= q * s). ``shape`` is q's, so that code which only reads a token tensor's
    shape before handing it to the layer (``Attention.project``) takes either."""

    q: torch.Tensor
    s: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_rows_reference(x: torch.Tensor, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 quantization in PyTorch: the reference of ``quantize_rows``.

    h = GELU_tanh(x) if ``gelu`` else x (float32); a = max(amax_row(|h|), 1e-12); s = a / 448;
    q = e4m3(clamp(h * (448 / a), -448, 448)) rounded to nearest, ties to even; h ~= q * s. (torchao's row-wise float8
    scaling; 448 is e4m3's largest finite value, Micikevicius et al. 2022, table 1.) A row holding a NaN gets a
    NaN scale and NaN values; one holding an inf, scale inf and NaN there: a broken activation shows, not a
    plausible +-448.

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


def _tiles(D: int) -> tuple[int, int]:
    """(BLOCK_A, BLOCK_B) of both kernels: a row as a tile of the largest power of two <= D plus one of the next
    power of two >= the rest (0 if none)."""
    block_a = 1 << (D.bit_length() - 1)
    return block_a, 0 if D == block_a else 1 << (D - block_a - 1).bit_length()


def _warps(elements: int) -> int:
    """Warps for a program of ``elements`` values: about 32 a thread, a power of two from 1 to 16."""
    per_program = min(16, max(1, elements // 1024))
    return 1 << (per_program.bit_length() - 1)


def _config(D: int) -> tuple[int, int, int, int]:
    """(BLOCK_A, BLOCK_B, ROWS, num_warps) of ``rowwise_e4m3_kernel``: the row's two tiles (``_tiles``); ROWS (a
    power of two, 1 to 8) for at least 2048 elements a program, and about 32 elements a thread (``_warps``).
    Chosen by ``benchmarks/kernel_speed.py fp8`` (H100, 2026-11-27, ``results/sampling/quant_kernel_h100.json``): at
    4096 rows, D = 1152 took 3.9 us with (2 rows, 2 warps) against 4.6 with (1, 1) and 6.6 with (2, 8); D = 4608
    with the GELU 41 us with (1, 4) against 47 with (1, 16) (``quant_kernel_h100_two_tiles_before_config.json``)."""
    block_a, block_b = _tiles(D)
    rows = 1
    while rows < 8 and rows * (block_a + block_b) < 2048:
        rows *= 2
    return block_a, block_b, rows, _warps(rows * (block_a + block_b))


def _layernorm_config(D: int) -> tuple[int, int, int, int]:
    """(BLOCK_A, BLOCK_B, ROWS, num_warps) of ``layernorm_modulate_e4m3_kernel``: the row's two tiles, one row a
    program, and a warp per 1024 columns (``_warps``). From ``benchmarks/kernel_speed.py fp8`` (H100, 2026-11-27,
    ``results/sampling/quant_kernel_h100.json``): at 16 x 256 x 1152 (batch 8 under guidance) a warp a row, as
    (1, 1), (2, 2), (4, 4), led: 11.0 us with the residual and 7.8 without, against 12.1 and 8.4 with (2, 2),
    which ``_config`` gives; the same at 2 x 256 rows."""
    block_a, block_b = _tiles(D)
    return block_a, block_b, 1, _warps(block_a + block_b)


def _quantize_rows_op(x: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, D) with unit column stride -> (q (M, D) e4m3, s (M, 1) float32)."""
    check_triton(x.device)
    # imported here, not at the top: the model code imports this module, and Triton's interpreter must be
    # chosen (TRITON_INTERPRET) before the kernels are built; check_triton raised where they cannot run
    from ditforge.ops.triton import quant as _k

    M, D = x.shape
    q = torch.empty((M, D), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    block_a, block_b, rows, num_warps = _config(D)
    wrap_triton(_k.rowwise_e4m3_kernel)[(-(-M // rows),)](
        x, q, s, M, D, x.stride(0), GELU=gelu, ROWS=rows, BLOCK_A=block_a, BLOCK_B=block_b,
        INTERPRETED=interpreting(), num_warps=num_warps,
    )
    return q, s


def quantize_rows(x: torch.Tensor, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 quantization of a GEMM input in one Triton pass (GELU first when ``gelu``): one read of x,
    1 byte per element and 4 per row written. Math as ``quantize_rows_reference``; equal to it exactly without
    ``gelu`` (float32 arithmetic with correctly rounded division; NaN and inf as there, except that Triton's CPU
    interpreter writes a NaN as 384), and with it up to the float32 rounding of the GELU, which can move a value
    that sits on a rounding boundary by one e4m3 step. The kernel's GELU, h / (1 + exp(-2u)), is the more
    accurate of the two where h is below about -3: the reference's float32 1 + tanh(u) cancels there (0 below
    about -9). In a row whose maximum is small against such values the two then differ by several e4m3 steps,
    and the kernel's are the ones near float64 GELU.
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
    q, s = _ops().quantize_rows(rows, gelu)
    return q.view(x.shape), s.view(*x.shape[:-1], 1)


def _launch_layernorm_modulate_e4m3(x, y, gate, shift, scale, eps):
    """The kernel over x (B, N, D) (and y, gate): (x + gate * y or None, q, s); see ``layernorm_modulate_e4m3``."""
    check_triton(x.device)
    from ditforge.ops.triton import quant as _k  # not at the top: see _quantize_rows_op

    B, N, D = x.shape
    q = torch.empty((B, N, D), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((B, N, 1), dtype=torch.float32, device=x.device)
    x_out = None if y is None else torch.empty_like(x)
    if B * N == 0:
        return x_out, q, s
    block_a, block_b, rows, num_warps = _layernorm_config(D)
    residual = y is not None
    wrap_triton(_k.layernorm_modulate_e4m3_kernel)[(-(-N // rows), B)](
        x, y if residual else x, gate if residual else shift, x_out if residual else x, shift, scale, q, s, N, D,
        gate.stride(0) if residual else 0, shift.stride(0), scale.stride(0), eps, RESIDUAL=residual, ROWS=rows,
        BLOCK_A=block_a, BLOCK_B=block_b, INTERPRETED=interpreting(), num_warps=num_warps,
    )
    return x_out, q, s


def _layernorm_modulate_e4m3_op(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, N, D) contiguous, shift / scale (B, D) with unit column stride -> (q (B, N, D) e4m3, s (B, N, 1))."""
    return _launch_layernorm_modulate_e4m3(x, None, None, shift, scale, eps)[1:]


def _residual_layernorm_modulate_e4m3_op(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor,
                                         scale: torch.Tensor, eps: float
                                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As ``_layernorm_modulate_e4m3_op`` after x <- x + gate * y (y like x, gate (B, D)); returns that x too."""
    return _launch_layernorm_modulate_e4m3(x, y, gate, shift, scale, eps)


_OPS: SimpleNamespace | None = None


def _ops() -> SimpleNamespace:
    """The three launchers above as ``torch.library.triton_op``s (``ditforge::``), registered on first use rather
    than at import: registering one imports ``torch._inductor`` (it reads the launcher's source for its kernels),
    1.5-2 s of every process's start that never quantizes. ``to_rowwise_float8`` registers them, so a model is
    compiled after they exist."""
    global _OPS
    if _OPS is None:
        _OPS = SimpleNamespace(**{name: triton_op(f"ditforge::{name}", fn, mutates_args=()) for name, fn in (
            ("quantize_rows", _quantize_rows_op), ("layernorm_modulate_e4m3", _layernorm_modulate_e4m3_op),
            ("residual_layernorm_modulate_e4m3", _residual_layernorm_modulate_e4m3_op))})
    return _OPS


def layernorm_modulate_e4m3(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
                            y: torch.Tensor | None = None, gate: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, Float8Rows]:
    """adaLN's LayerNorm + modulate with its output quantized for a float8 linear layer, in one Triton pass; with
    ``y`` and ``gate``, the adaLN-Zero gated residual before it, in the same pass.

    x <- x + gate * y (computed in float32, stored in x's dtype; the LayerNorm reads the stored value); h =
    LayerNorm(x) * (1 + scale) + shift (no affine, biased variance, float32 statistics); then q, s of h as
    ``quantize_rows``. Sources: Peebles & Xie 2023, section 3.2 (adaLN-Zero, modulate); Ba et al. 2016
    (LayerNorm); the scaling as ``quantize_rows_reference``. Equal to ``gated_residual_reference``, then
    ``layernorm_modulate_reference`` in float32 and ``quantize_rows_reference``, up to float32 rounding (the
    residual is rounded once instead of after the product too, and the statistics are summed in another order):
    a value on an e4m3 rounding boundary may move by one step. Inference only: the op has no backward.

    Why: under ``torch.compile`` inductor's LayerNorm-modulate kernel wrote h in bf16 and the quantization pass
    read it back, two launches; here h reaches memory as 1 byte per element. At 16 x 256 x 1152 (batch-8
    sampling) 11.0 us with the residual and 7.8 without, against 17.1 and 12.5 for the two (H100, 2026-11-27,
    ``benchmarks/results/sampling/quant_kernel_h100.json``); the batch-8 loop went from 0.382 to 0.364 s.

    Args:
        x: (B, N, D) float32 / bfloat16 / float16 residual stream.
        shift, scale: (B, D) per-sample modulation, one row per sample (no broadcasting), any row stride.
        eps: added to the variance.
        y: (B, N, D) branch output, x's dtype, or None (no residual).
        gate: (B, D) like shift, x's dtype, or None (with y).

    Returns:
        (x + gate * y, or x (made contiguous) without ``y``; ``Float8Rows`` of h: q (B, N, D) e4m3, s (B, N, 1)
        float32).

    Raises:
        RuntimeError: Triton cannot run here (no CUDA GPU for the tensors and no ``TRITON_INTERPRET=1``).
    """
    x = x.contiguous()
    shift, scale = row_major(shift), row_major(scale)
    if y is None:
        return x, Float8Rows(*_ops().layernorm_modulate_e4m3(x, shift, scale, eps))
    x, q, s = _ops().residual_layernorm_modulate_e4m3(x, y.contiguous(), row_major(gate), shift, scale, eps)
    return x, Float8Rows(q, s)


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

    def forward(self, x: torch.Tensor | Float8Rows) -> torch.Tensor:
        """x (..., D_in) float -> (..., D_out) bf16: the input quantized by ``quantize_rows``, eagerly and under
        ``torch.compile`` alike (a ``triton_op``: inductor keeps the kernel in its graph); ``Float8Rows`` already
        quantized by their producer (``ops.layernorm_modulate(..., into=this layer)``) go straight to the GEMM.

        Rather than leaving the quantization to inductor, which fuses it into the kernel that produces x: at
        D = 1152, 4096 rows, the pass takes 4-5 us; inductor's LayerNorm-modulate kernels took 19-21 us with the
        quantization fused against 12-15 us without it, and its quantization of the attention output (proj's
        input) 13 us (H100, batch-8 DiT-XL/2 sampling loop, 2026-11-27, multi-kernel reductions on). Over a
        whole loop that saved 9 ms in one job and was a wash in another, where one of inductor's LayerNorm
        kernels ran slower (``benchmarks/results/sampling/``: ``h100_images_fp8_multikernel_b8_job1.log``,
        ``h100_images_fp8_sigmoid_gelu_b8.log``)."""
        return self.forward_quantized(*(x if isinstance(x, Float8Rows) else quantize_rows(x)))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def to_rowwise_float8(model: nn.Module, keep) -> int:
    """Replace every ``nn.Linear`` of ``model`` for which ``keep(module, qualified_name)`` is true by its
    ``RowwiseFloat8Linear``. Returns the number replaced."""
    _ops()
    chosen = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and keep(m, fqn)]
    for fqn in chosen:
        parent, _, name = fqn.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, name, RowwiseFloat8Linear.from_linear(getattr(owner, name)))
    return len(chosen)
