"""Triton kernel for row-wise float8 (e4m3) quantization of GEMM inputs, optionally after the MLP's GELU.

Only ``@triton.jit`` functions live here; launching and the ``torch.library`` op are in ``ditforge.ops.fp8``.

Layout: the input is M contiguous rows of D elements; a program owns ROWS consecutive rows (the tile
ROWS x BLOCK_D, BLOCK_D = next power of two >= D, columns >= D masked). Arithmetic is float32.

Math (sources):
- Row-wise scaling as torchao's ``Float8DynamicActivationFloat8WeightConfig(PerRow())`` does it: per row,
  a = max(amax, 1e-12), s = a / 448 (448: e4m3's largest finite value; Micikevicius et al. 2022, "FP8 Formats
  for Deep Learning", table 1), q = e4m3(clamp(h * (448 / a), -448, 448)); then h ~= q * s.
- GELU with the tanh approximation, as DiT's MLP: 0.5 h (1 + tanh(sqrt(2 / pi) (h + 0.044715 h^3)))
  (Hendrycks & Gimpel 2016, section 2), with 1 + tanh(u) = 2 / (1 + t) for u >= 0 and 2 t / (1 + t) for
  u < 0, t = exp(-2 |u|): no overflow, and no cancellation for negative u.
"""

import triton
import triton.language as tl

from ditforge.ops import fp8

E4M3_MAX = tl.constexpr(fp8.E4M3_MAX)
AMAX_EPS = tl.constexpr(fp8.AMAX_EPS)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _round_to_e4m3(v):
    """The e4m3 value nearest to float32 v (|v| <= 448; ties to even), as a float32.

    Rounding is done here, in float32 arithmetic, so the final cast only converts exactly representable
    values: Triton's CPU interpreter rounds float32 -> e4m3 wrongly when rounding up carries into the exponent
    (127.76 -> 64 instead of 128, Triton 3.9). e4m3's spacing at |v| in [2^e, 2^(e+1)) is 2^(e-3), and 2^-9 for
    its subnormals (e < -6); adding and subtracting 2^(e+20), whose float32 ulp is that spacing, rounds |v| to
    it with the FPU's round-to-nearest-even.
    """
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) - 127).to(tl.int32)
    e = tl.maximum(e, -6)
    magic = ((e + (20 + 127)) << 23).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    return tl.where(v.to(tl.int32, bitcast=True) < 0, r * -1.0, r)  # the sign bit; Triton's -r is 0 - r, +0 for r = 0


@triton.jit
def rowwise_e4m3_kernel(
    X,  # (M, D), row stride stride_x, unit column stride; any float dtype
    Q,  # (M, D) contiguous float8_e4m3fn
    S,  # (M,) float32 scales
    M,
    D,
    stride_x,
    GELU: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """q, s of h = GELU_tanh(x) (or x): one read of x, one write of q (1 byte per element) and 4 bytes per row."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < D)[None, :]
    h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if GELU:
        u = SQRT_2_OVER_PI * (h + 0.044715 * h * h * h)
        t = tl.exp(-2.0 * tl.abs(u))  # in (0, 1]: no overflow; 1 + tanh(u) = 2 / (1 + t) or 2 t / (1 + t)
        h = tl.where(u >= 0, h, h * t) / (1.0 + t)
    # NaN propagates as in PyTorch (tl.max and tl.maximum drop it by default): a NaN or inf input gives a NaN
    # scale or NaN values, not a plausible-looking +-448. (A counted NaN, not a NaN-propagating tl.reduce: the
    # interpreter runs a custom combine function element by element, 10x slower in the CPU tests.)
    amax = tl.max(tl.abs(h), axis=1)
    amax = tl.where(tl.sum((h != h).to(tl.int32), axis=1) > 0, float("nan"), tl.maximum(amax, AMAX_EPS))
    s = tl.math.div_rn(amax, E4M3_MAX)
    v = h * tl.math.div_rn(E4M3_MAX, amax)[:, None]  # one correctly rounded division per row, not per element
    v = tl.minimum(tl.maximum(v, -E4M3_MAX, propagate_nan=tl.PropagateNan.ALL), E4M3_MAX,
                   propagate_nan=tl.PropagateNan.ALL)
    q = _round_to_e4m3(v)
    tl.store(Q + rows[:, None] * D + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rows, s, mask=row_mask)
