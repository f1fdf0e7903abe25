"""Triton kernels for the adaLN operators of DiT: LayerNorm + modulate and the gated residual.

Only ``@triton.jit`` functions live here; launching, output allocation, the sums of per-program partials and
the autograd wiring are in ``ditforge.ops.fused``.

Layout shared by every kernel: the token tensor is viewed as M = B * N contiguous rows of D elements, row
``b * N + n`` for token n of sample b. A program owns ROWS consecutive rows of ONE sample (the 2-D tile
ROWS x BLOCK_D, BLOCK_D = next power of two >= D, columns >= D masked), so the per-sample vectors
(shift, scale, gate: rows of a (B, D) tensor with row stride ``stride_*`` and unit column stride) are loaded
once per program. Grids are 2-D: axis 0 walks the row blocks of a sample, axis 1 the samples.

All arithmetic is float32 whatever the storage dtypes (fp32, bf16, fp16, mixed); stores convert to the
output pointer's element type. Row offsets are computed in int64, so B * N * D may exceed 2**31.

Math (sources):
- LayerNorm, Ba et al. 2016 "Layer Normalization": mean and biased variance over D,
  xhat = (x - mean) * rstd with rstd = 1 / sqrt(var + eps); no affine parameters (as in DiT).
- adaLN modulate and adaLN-Zero gated residual, Peebles & Xie 2023 "Scalable Diffusion Models with
  Transformers", section 3.2: h = xhat * (1 + scale) + shift; out = x + gate * y.
- Backward of h: dshift = sum_n dh, dscale = sum_n dh * xhat, dxhat = dh * (1 + scale), and, since
  xhat = (x - mean) * rstd with d(mean)/dx = 1/D and d(rstd)/dx = -rstd^3 (x - mean) / D,
  dx = rstd * (dxhat - mean_D(dxhat) - xhat * mean_D(dxhat * xhat)).
"""

import triton
import triton.language as tl


@triton.jit
def layernorm_modulate_fwd_kernel(
    X,  # (M, D) contiguous, any float dtype
    SHIFT,  # (B, D) row stride stride_shift; unused when not HAS_MOD
    SCALE,  # (B, D) row stride stride_scale; unused when not HAS_MOD
    OUT,  # (M, D) contiguous, the output dtype
    MEAN,  # (M,) float32
    RSTD,  # (M,) float32
    N,  # tokens per sample
    D,  # hidden size
    stride_shift,
    stride_scale,
    eps,
    HAS_MOD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out = LayerNorm(x) * (1 + scale[b]) + shift[b] (or LayerNorm(x) when not HAS_MOD); saves mean, rstd.

    Grid: (cdiv(N, ROWS), B). One read of x, one write of out, 8 bytes of statistics per row.
    """
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    n = pid_n * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_mask = n < N
    col_mask = cols < D
    mask = row_mask[:, None] & col_mask[None, :]
    rows = b.to(tl.int64) * N + n  # global row index, int64
    offs = rows[:, None] * D + cols[None, :]

    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / D  # biased variance, as torch.nn.functional.layer_norm
    rstd = (1.0 / tl.sqrt(var + eps)).to(tl.float32)  # inductor passes a Python float (eps) as float64
    h = xc * rstd[:, None]
    if HAS_MOD:
        b64 = b.to(tl.int64)
        shift = tl.load(SHIFT + b64 * stride_shift + cols, mask=col_mask, other=0.0).to(tl.float32)
        scale = tl.load(SCALE + b64 * stride_scale + cols, mask=col_mask, other=0.0).to(tl.float32)
        h = h * (1.0 + scale[None, :]) + shift[None, :]
    tl.store(OUT + offs, h.to(OUT.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def layernorm_modulate_bwd_kernel(
    DOUT,  # (M, D) contiguous upstream gradient, any float dtype
    X,  # (M, D) contiguous forward input
    SCALE,  # (B, D) row stride stride_scale; unused when not HAS_MOD
    MEAN,  # (M,) float32 from the forward
    RSTD,  # (M,) float32 from the forward
    DX,  # (M, D) contiguous, x's dtype
    DSHIFT_PART,  # (B, G, D) float32 partial sums; unused when not HAS_MOD
    DSCALE_PART,  # (B, G, D) float32 partial sums; unused when not HAS_MOD
    N,
    D,
    stride_scale,
    G,  # programs per sample (grid axis 0)
    HAS_MOD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dx for every row; per-program partial sums over rows of dshift = sum dout and dscale = sum dout * xhat.

    Grid: (G, B). Program (g, b) loops over the row blocks g, g + G, g + 2G, ... of sample b, accumulates the
    partials in a float32 ROWS x BLOCK_D tile, reduces it over the rows once at the end and writes row
    (b, g) of the partial buffers; ``fused`` sums them over g with torch (Triton's layer-norm tutorial scheme,
    deterministic: no atomics).
    """
    g = tl.program_id(0)
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    if HAS_MOD:
        one_plus_scale = 1.0 + tl.load(SCALE + b64 * stride_scale + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc_dshift = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        acc_dscale = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for start in range(g * ROWS, N, G * ROWS):
        n = start + tl.arange(0, ROWS)
        row_mask = n < N
        mask = row_mask[:, None] & col_mask[None, :]
        rows = b64 * N + n
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_MOD:
            acc_dshift += dh
            acc_dscale += dh * xhat
            dxhat = dh * one_plus_scale[None, :]
        else:
            dxhat = dh
        c1 = tl.sum(dxhat * xhat, axis=1) / D
        c2 = tl.sum(dxhat, axis=1) / D
        dx = (dxhat - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_MOD:
        part = (b64 * G + g) * D + cols
        tl.store(DSHIFT_PART + part, tl.sum(acc_dshift, axis=0), mask=col_mask)
        tl.store(DSCALE_PART + part, tl.sum(acc_dscale, axis=0), mask=col_mask)


@triton.jit
def gated_residual_fwd_kernel(
    X,  # (M, D) contiguous residual stream
    Y,  # (M, D) contiguous branch output
    GATE,  # (B, D) row stride stride_gate
    OUT,  # (M, D) contiguous, promoted dtype
    N,
    D,
    stride_gate,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out = x + gate[b] * y (adaLN-Zero gated residual). Grid: (cdiv(N, ROWS), B)."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    n = pid_n * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    mask = (n < N)[:, None] & col_mask[None, :]
    rows = b.to(tl.int64) * N + n
    offs = rows[:, None] * D + cols[None, :]
    gate = tl.load(GATE + b.to(tl.int64) * stride_gate + cols, mask=col_mask, other=0.0).to(tl.float32)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (x + gate[None, :] * y).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def gated_residual_bwd_kernel(
    DOUT,  # (M, D) contiguous upstream gradient
    Y,  # (M, D) contiguous branch output from the forward
    GATE,  # (B, D) row stride stride_gate
    DY,  # (M, D) contiguous, y's dtype
    DGATE_PART,  # (B, G, D) float32 partial sums
    N,
    D,
    stride_gate,
    G,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dy = dout * gate[b]; partial sums over rows of dgate = sum_n dout * y (dx = dout needs no kernel).

    Grid: (G, B), the same row-block loop and partial-sum scheme as ``layernorm_modulate_bwd_kernel``.
    """
    g = tl.program_id(0)
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < D
    gate = tl.load(GATE + b64 * stride_gate + cols, mask=col_mask, other=0.0).to(tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for start in range(g * ROWS, N, G * ROWS):
        n = start + tl.arange(0, ROWS)
        mask = (n < N)[:, None] & col_mask[None, :]
        offs = (b64 * N + n)[:, None] * D + cols[None, :]
        dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
        acc += dout * y
        tl.store(DY + offs, (dout * gate[None, :]).to(DY.dtype.element_ty), mask=mask)
    tl.store(DGATE_PART + (b64 * G + g) * D + cols, tl.sum(acc, axis=0), mask=col_mask)
