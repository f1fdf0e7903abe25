"""Triton kernels for row-wise float8 (e4m3) quantization of GEMM inputs: alone, optionally after the MLP's GELU
(``rowwise_e4m3_kernel``), or at the end of adaLN's gated residual + LayerNorm + modulate
(``layernorm_modulate_e4m3_kernel``).

Only ``@triton.jit`` functions live here; launching and the ``torch.library`` ops are in ``ditforge.ops.fp8``.

Layout: the input is M rows of D elements; a program owns ROWS consecutive rows, held as two tiles
ROWS x BLOCK_A and ROWS x BLOCK_B (see ``rowwise_e4m3_kernel``). Arithmetic is float32.

Math (sources):
- Row-wise scaling as torchao's ``Float8DynamicActivationFloat8WeightConfig(PerRow())`` does it: per row,
  a = max(amax, 1e-12), s = a / 448 (448: e4m3's largest finite value; Micikevicius et al. 2022, "FP8 Formats
  for Deep Learning", table 1), q = e4m3(clamp(h * (448 / a), -448, 448)); then h ~= q * s.
- GELU with the tanh approximation, as DiT's MLP: 0.5 h (1 + tanh(sqrt(2 / pi) (h + 0.044715 h^3)))
  (Hendrycks & Gimpel 2016, section 2), computed as h / (1 + exp(-2u)) (0.5 (1 + tanh(u)) is the logistic
  function of 2u): one exponential and one division, no cancellation. The kernel is bound by its instructions
  here, not its bytes; this form took the GELU pass from 41 to 32 us (4096 x 4608, H100, 2026-11-27), and
  exp2 of the folded constants with an approximate division (``fast_dividef``, 2 ulp) from 31.1 to 27.2 us, with
  the same e4m3 codes on that input (the probe ``benchmarks/gelu_forms.py``, last at da2a95e; docs/speed.md; the pass without the GELU: 21.9 us).
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ditforge.ops import triton as common

E4M3_MAX = tl.constexpr(common.E4M3_MAX)
AMAX_EPS = tl.constexpr(common.AMAX_EPS)
GELU_K1 = tl.constexpr(-2.0 * 0.7978845608028654 * 1.4426950408889634)  # -2 sqrt(2 / pi) log2(e)
GELU_K3 = tl.constexpr(-2.0 * 0.7978845608028654 * 1.4426950408889634 * 0.044715)


@triton.jit
def _round_to_e4m3(v):
    """The e4m3 value nearest to float32 v (|v| <= 448 (1 + 2^-23), which rounds to 448; ties to even), as a float32.

    Used under Triton's CPU interpreter only, so that the final cast there converts exactly representable
    values: the interpreter rounds float32 -> e4m3 wrongly when rounding up carries into the exponent (127.76 ->
    64 instead of 128, Triton 3.9). On a GPU the cast itself rounds to nearest even (cvt.rn), and the kernel,
    bound by its instructions, skips these. e4m3's spacing at |v| in [2^e, 2^(e+1)) is 2^(e-3), and 2^-9 for
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
def _round_to_bf16(v):
    """float32 v rounded to the nearest bfloat16 (ties to even), as a float32: the upper 16 bits after adding
    0x7FFF plus the lowest kept bit. Used under Triton's CPU interpreter only, whose float32 -> bf16 cast
    truncates (Triton 3.9): biased toward zero, which over a residual stream of many blocks adds up. The GPU's
    cast rounds to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(v != v, v, rounded)  # a NaN stays one (the add can carry its payload into inf, or overflow)


@triton.jit
def _activation(ptrs, mask, GELU: tl.constexpr, INTERPRETED: tl.constexpr):
    """Load a tile as float32 and apply GELU_tanh when GELU."""
    h = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        # 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)), exp(-2u) = 2^(h (K1 + K3 h^2)); the power overflows to inf
        # below h ~ -10.07, where GELU is under 3e-38 in magnitude (-0 here: h / inf)
        d = 1.0 + tl.exp2(h * (GELU_K1 + GELU_K3 * h * h))
        if INTERPRETED:  # the interpreter lacks libdevice
            h = h / d
        else:  # x / y to 2 ulp (0 for |y| in (2^126, 2^128), where GELU is as small)
            h = libdevice.fast_dividef(h, d)
    return h


@triton.jit
def _row_amax(h):
    """Each row's absolute maximum, NaN if it holds a NaN (as torch.amax; tl.max of floats drops NaN): the
    maximum of h's bit patterns with the sign bit cleared, as integers, in which NaNs lie above inf, and inf
    above every finite value. (The sign is cleared in integers: PTX leaves abs.f32 of a NaN unspecified.)"""
    return tl.max(h.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1).to(tl.float32, bitcast=True)


@triton.jit
def _row_scale(amax):
    """(448 / a as a (ROWS, 1) column, a / 448) for each row's absolute maximum, a = max(amax, AMAX_EPS): the
    factor the row is multiplied by before its e4m3 store, and the scale stored beside it. Both divisions
    correctly rounded, once a row; an inf amax gives factor 0, a NaN one NaN (kept by the floor)."""
    amax = tl.maximum(amax, AMAX_EPS, propagate_nan=tl.PropagateNan.ALL)
    return tl.math.div_rn(E4M3_MAX, amax)[:, None], tl.math.div_rn(amax, E4M3_MAX)


@triton.jit
def _store_e4m3(ptrs, v, mask, INTERPRETED: tl.constexpr):
    """Store float32 v (already scaled) as e4m3, rounded to nearest even (NaN kept).

    No clamp to +-448: v = h * RN(448 / amax) with |h| <= amax is at most 448 (1 + 2^-24)^2, which rounds to 448
    (e4m3's overflow starts at 464); inf never reaches here (an inf amax makes the factor 0, and inf * 0 NaN).
    Dropping the clamp took 1.1 us from the GELU pass at 4096 x 4608 (the probe ``benchmarks/gelu_forms.py``, last at da2a95e)."""
    if INTERPRETED:
        v = _round_to_e4m3(v)
    tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


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
    BLOCK_A: tl.constexpr,  # the largest power of two <= D: columns [0, BLOCK_A), unmasked
    BLOCK_B: tl.constexpr,  # 0, or the next power of two >= D - BLOCK_A: columns [BLOCK_A, D), masked
    INTERPRETED: tl.constexpr,  # Triton's CPU interpreter: see _round_to_e4m3 and _activation
):
    """q, s of h = GELU_tanh(x) (or x): one read of x, one write of q (1 byte per element) and 4 bytes per row.

    A row is held as two power-of-two tiles, BLOCK_A + BLOCK_B columns (D = 4608: 4096 + 512; 1152: 1024 + 128),
    not one tile of the next power of two (8192, 2048), whose masked lanes would still execute the GELU and the
    scaling: the kernel is bound by its instructions, not its bytes, at these widths.
    NaN and inf as ``quantize_rows_reference``: a row holding a NaN gets a NaN scale and values, one holding an
    inf scale inf, 0 for its finite values and NaN for the inf (inf * 0).
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    x_rows, q_rows = X + rows[:, None] * stride_x, Q + rows[:, None] * D
    cols_a = tl.arange(0, BLOCK_A)[None, :]
    h_a = _activation(x_rows + cols_a, row_mask[:, None], GELU, INTERPRETED)
    amax = _row_amax(h_a)
    if BLOCK_B > 0:
        cols_b = BLOCK_A + tl.arange(0, BLOCK_B)[None, :]
        mask_b = row_mask[:, None] & (cols_b < D)
        h_b = _activation(x_rows + cols_b, mask_b, GELU, INTERPRETED)
        amax = tl.maximum(amax, _row_amax(h_b), propagate_nan=tl.PropagateNan.ALL)
    inv, s = _row_scale(amax)
    _store_e4m3(q_rows + cols_a, h_a * inv, row_mask[:, None], INTERPRETED)
    if BLOCK_B > 0:
        _store_e4m3(q_rows + cols_b, h_b * inv, mask_b, INTERPRETED)
    tl.store(S + rows, s, mask=row_mask)


@triton.jit
def _stream_tile(X, Y, GATE, XOUT, offs, cols, mask, col_mask, RESIDUAL: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """A tile of the residual stream as float32: x, or (RESIDUAL) x + gate * y computed in float32 and stored to
    XOUT in its dtype, then returned as stored (rounded): the LayerNorm sees the stream the next residual adds
    to, as the unfused ``gated_residual`` then ``layernorm_modulate`` would."""
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        gate = tl.load(GATE + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
        x = x + gate * y
        if INTERPRETED and XOUT.dtype.element_ty == tl.bfloat16:
            x = _round_to_bf16(x)
        x = x.to(XOUT.dtype.element_ty)
        tl.store(XOUT + offs, x, mask=mask)
        x = x.to(tl.float32)
    return x


@triton.jit
def _modulated(xc, rstd, SHIFT, SCALE, cols, col_mask):
    """(x - mean) * rstd * (1 + scale) + shift for a tile (zero in masked columns, whose xc is zero)."""
    shift = tl.load(SHIFT + cols, mask=col_mask, other=0.0).to(tl.float32)
    scale = tl.load(SCALE + cols, mask=col_mask, other=0.0).to(tl.float32)
    return xc * rstd * (1.0 + scale) + shift


@triton.jit
def layernorm_modulate_e4m3_kernel(
    X,  # (B * N, D) contiguous residual stream, any float dtype
    Y,  # (B * N, D) contiguous branch output (RESIDUAL); unused otherwise
    GATE,  # (B, D) row stride stride_gate, unit column stride (RESIDUAL); unused otherwise
    XOUT,  # (B * N, D) contiguous, x + gate * y in X's dtype (RESIDUAL); unused otherwise
    SHIFT,  # (B, D) row stride stride_shift, unit column stride
    SCALE,  # (B, D) row stride stride_scale, unit column stride
    Q,  # (B * N, D) contiguous float8_e4m3fn
    S,  # (B * N,) float32 scales
    N,  # tokens per sample
    D,
    stride_gate,
    stride_shift,
    stride_scale,
    eps,
    RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_A: tl.constexpr,  # as rowwise_e4m3_kernel: the largest power of two <= D
    BLOCK_B: tl.constexpr,  # 0, or the next power of two >= D - BLOCK_A
    INTERPRETED: tl.constexpr,
):
    """(RESIDUAL: x <- x + gate[b] * y, stored;) h = LayerNorm(x) * (1 + scale[b]) + shift[b]; q, s of h as
    ``rowwise_e4m3_kernel`` writes them. One read of x (and y), one write of q (and x): the normalised tokens
    never reach memory in 16 bits.

    Grid: (cdiv(N, ROWS), B); a program owns ROWS rows of one sample (its shift, scale and gate loaded once),
    each held as the two tiles BLOCK_A + BLOCK_B. LayerNorm without affine parameters, biased variance, float32
    statistics from the mean-centred values (as ``torch.nn.functional.layer_norm``).
    """
    b = tl.program_id(1).to(tl.int64)
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = (n < N)[:, None]
    rows = b * N + n
    base = rows[:, None] * D
    GATE, SHIFT, SCALE = GATE + b * stride_gate, SHIFT + b * stride_shift, SCALE + b * stride_scale
    cols_a = tl.arange(0, BLOCK_A)[None, :]
    full = cols_a < BLOCK_A  # all true: column A tiles need no column mask
    x_a = _stream_tile(X, Y, GATE, XOUT, base + cols_a, cols_a, row_mask, full, RESIDUAL, INTERPRETED)
    total = tl.sum(x_a, axis=1)
    if BLOCK_B > 0:
        cols_b = BLOCK_A + tl.arange(0, BLOCK_B)[None, :]
        col_b = cols_b < D
        mask_b = row_mask & col_b
        x_b = _stream_tile(X, Y, GATE, XOUT, base + cols_b, cols_b, mask_b, col_b, RESIDUAL, INTERPRETED)
        total += tl.sum(x_b, axis=1)
    mean = (total / D)[:, None]
    xc_a = x_a - mean
    var = tl.sum(xc_a * xc_a, axis=1)
    if BLOCK_B > 0:
        xc_b = tl.where(col_b, x_b - mean, 0.0)
        var += tl.sum(xc_b * xc_b, axis=1)
    # .to: inductor passes a Python float argument as float64, which would carry the whole tile into float64
    rstd = (1.0 / tl.sqrt(var / D + eps)).to(tl.float32)[:, None]
    h_a = _modulated(xc_a, rstd, SHIFT, SCALE, cols_a, full)
    amax = _row_amax(h_a)
    if BLOCK_B > 0:
        h_b = _modulated(xc_b, rstd, SHIFT, SCALE, cols_b, col_b)
        amax = tl.maximum(amax, _row_amax(h_b), propagate_nan=tl.PropagateNan.ALL)
    inv, s = _row_scale(amax)
    _store_e4m3(Q + base + cols_a, h_a * inv, row_mask, INTERPRETED)
    if BLOCK_B > 0:
        _store_e4m3(Q + base + cols_b, h_b * inv, mask_b, INTERPRETED)
    tl.store(S + rows, s, mask=n < N)
