"""Row-wise float8 quantization (``ditforge.ops.fp8.quantize_rows``, a Triton kernel) and the float8 linear layer
of sampling, against PyTorch references and closed forms.

Oracles:
- ``quantize_rows_reference``: PyTorch's own float32 arithmetic and its float32 -> e4m3 cast (round to nearest,
  ties to even). Without GELU the kernel must equal it bit for bit: same float32 operations, correctly rounded
  division. With GELU its h / (1 + exp(-2u)) differs from PyTorch's 0.5 h (1 + tanh(u)) by float32 rounding,
  which moves a value lying within that rounding of an e4m3 rounding boundary by one e4m3 step: allowed in at
  most 1 in 1,000 elements, never more than one step, on rows whose maximum is not small against values below
  -3 (there PyTorch's 1 + tanh(u) cancels, and float64 GELU is the oracle instead).
- e4m3 rounding itself (on a GPU the hardware cast; under Triton's interpreter, which casts wrongly when
  rounding carries into the exponent, the kernel's own rounding in float32 arithmetic): rows built from exact
  ties, values just below powers of two and subnormals, with the row maximum 448 (scale exactly 1), against
  PyTorch's cast.
- The dequantized values against float64 GELU: within half an e4m3 step, 2^-4 relative, or 2^-10 * s for the
  subnormals.
- ``RowwiseFloat8Linear``: equal to a float64 product of the dequantized operands up to its bf16 output rounding
  (2^-7 of the output's largest magnitude: cuBLAS's float8 GEMM was measured up to 0.42% off on an H100); its
  error against the exact product has the closed-form relative rms of two e4m3-rounded operands
  (``tests/parallel/test_fp8.py``: 0.0375), within 15%.
On a machine without CUDA the kernel runs under TRITON_INTERPRET=1 (conftest.py); with CUDA on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ditforge.ops.fp8 import RowwiseFloat8Linear, quantize_rows, quantize_rows_reference, to_rowwise_float8
from ditforge.ops.linear import gelu_mlp

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cuda" and torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("float8 GEMMs need compute capability >= 8.9", allow_module_level=True)
PRODUCT = math.hypot(*[2.0**-3 / math.sqrt(12) * math.sqrt(3 / (8 * math.log(2)))] * 2)  # 0.0375


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 steps apart a and b are (float8_e4m3fn tensors, values of the same sign): the difference
    of their bit patterns as integers; 0 where they are equal as numbers (-0 == +0)."""
    a, b = a.cpu(), b.cpu()
    return torch.where(a.float() == b.float(), 0, (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs())


def _assert_same(q: torch.Tensor, q_ref: torch.Tensor, x: torch.Tensor) -> None:
    """q equals q_ref bit for bit; on failure, the first differing inputs and both results."""
    q, q_ref, x = q.cpu().flatten(), q_ref.cpu().flatten(), x.cpu().flatten()
    nan = q_ref.float().isnan()
    if DEV == "cuda":  # Triton's CPU interpreter casts NaN to e4m3 as 384 (Triton 3.9): there the NaN check is
        assert torch.equal(q.float().isnan(), nan), "NaNs in different places"  # the scale's (a NaN / inf row)
    bad = ((q.view(torch.uint8) != q_ref.view(torch.uint8)) & ~nan).nonzero()[:5, 0]
    assert bad.numel() == 0, [(x[i].item(), q[i].item(), q_ref[i].item()) for i in bad]


def _assert_within_half_step(q: torch.Tensor, s: torch.Tensor, exact: torch.Tensor, floor: float) -> None:
    """The dequantized q * s is within half an e4m3 step of the float64 ``exact``: 2^-4 relative (with 1e-5 for
    the kernel's float32 GELU), 2^-10 * s for the subnormals, plus ``floor``."""
    err = (q.cpu().double() * s.cpu().double() - exact).abs()
    assert (err <= exact.abs() * 2**-4 * (1 + 1e-5) + s.cpu().double() * 2**-10 + floor).all(), err.max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
# D: two tiles 128 + 128 (56 of them masked), 128 + 64, 1024 + 128, 4096 + 512; one tile (1024, 16); ROWS 8
# (ragged) to 1
@pytest.mark.parametrize("M, D", [(37, 200), (11, 192), (9, 1152), (3, 4608), (5, 1024), (19, 16)])
def test_quantize_rows_equals_the_reference_exactly(M, D, dtype):
    g = _gen(M * D)
    x = (torch.randn(M, D, generator=g) * torch.rand(M, 1, generator=g) * 10 + 0.5).to(dtype)
    x[1] = 0  # an all-zero row: scale 1e-12 / 448, all zeros
    x[0, 5], x[2, D - 1] = float("nan"), float("inf")  # NaN: NaN scale and values; inf (in the last tile): scale inf
    wide = torch.randn(2, M, D + 8, generator=g).to(dtype)[1, :, 4:-4]  # rows with a stride other than D
    for inp in (x.to(DEV), wide.to(DEV)):
        q, s = quantize_rows(inp)
        q_ref, s_ref = quantize_rows_reference(inp)
        assert q.dtype == torch.float8_e4m3fn and q.shape == inp.shape and s.shape == (M, 1)
        torch.testing.assert_close(s, s_ref, rtol=0, atol=0, equal_nan=True)
        _assert_same(q, q_ref, inp)


def test_launch_configuration_for_every_width():
    """``_config`` for D = 1 .. 32768: Triton needs powers of two (tile widths, rows, warps); the two tiles
    cover the row (A <= D <= A + B, B <= A); at most 64 elements a thread (more spill registers)."""
    from ditforge.ops.fp8 import _config

    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    for D in range(1, 32769):
        a, b, rows, warps = _config(D)
        assert pow2(a) and (b == 0 or pow2(b)) and pow2(rows) and pow2(warps), (D, a, b, rows, warps)
        assert a <= D <= a + b, (D, a, b)
        assert b <= a and 1 <= rows <= 8 and 1 <= warps <= 16, (D, a, b, rows, warps)
        assert rows * (a + b) <= 64 * 32 * warps, (D, a, b, rows, warps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [200, 1152, 4608])
def test_nan_and_inf_in_either_tile(D, dtype):
    """A NaN (either sign) or an inf in the first tile (columns < the largest power of two <= D) or only in the
    second: NaN and inf handled as the reference, whichever tile holds them."""
    x = torch.randn(5, D, generator=_gen(D)).to(dtype)
    x[0, D - 1] = float("nan")  # only in the second tile
    bits = x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    bits[1, 0] = -64 if dtype == torch.bfloat16 else -(1 << 22)  # a NaN with its sign bit set (0xFFC0...)
    assert x[1, 0].isnan() and x[1, 0].float().view(torch.int32).item() < 0
    x[2, 3], x[3, D - 2] = float("inf"), -float("inf")
    q, s = quantize_rows(x.to(DEV))
    q_ref, s_ref = quantize_rows_reference(x)
    assert s[:2].isnan().all() and s[2:4].isinf().all() and s[4].isfinite()
    torch.testing.assert_close(s.cpu(), s_ref, rtol=0, atol=0, equal_nan=True)
    _assert_same(q, q_ref, x)


def test_e4m3_rounding_of_ties_carries_and_subnormals():
    """The row maximum is 448, so the scale is exactly 1 and the kernel's rounding is PyTorch's cast of the
    values themselves."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, every value
    mid = (grid[:-1] + grid[1:]) / 2  # exact ties: half go up, half down (to the even mantissa)
    below = grid[grid > 0] * (1 - 2**-10)  # just below an e4m3 value, many of them powers of two
    vals = torch.cat([grid, mid, below, torch.tensor([127.7636, 7.9671, 2**-9 * 0.5, 2**-9 * 1.5, 2**-7 * 0.49])])
    row = torch.cat([vals, -vals, torch.tensor([448.0])])
    row = torch.cat([row, torch.zeros(-row.numel() % 16)]).view(1, -1)
    q, s = quantize_rows(row.to(DEV))
    assert s.item() == 1.0
    _assert_same(q, row.to(torch.float8_e4m3fn), row)


@pytest.mark.parametrize("D", [200, 4608])
def test_quantize_rows_gelu(D):
    g = _gen(D)
    x = (torch.randn(64, D, generator=g) * 3).bfloat16()
    q, s = quantize_rows(x.to(DEV), gelu=True)
    q_ref, s_ref = quantize_rows_reference(x, gelu=True)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-6, atol=0)
    off = _steps(q, q_ref)
    assert off.max() <= 1 and (off > 0).float().mean() <= 1e-3, (off.max(), (off > 0).sum())
    _assert_within_half_step(q, s, F.gelu(x.double(), approximate="tanh"), 1e-12)


def test_quantize_rows_gelu_where_the_reference_cancels():
    """Rows whose maximum is small against values below -3, where PyTorch's float32 1 + tanh(u) cancels (and is 0
    below about -9): the kernel's dequantized values stay within half an e4m3 step of float64 GELU. The oracle
    is h * sigmoid(2u) (= 0.5 h (1 + tanh(u))) in float64 with torch.sigmoid: float64's 1 + tanh(u) cancels too,
    to 0 below about -7."""
    g = _gen(5)
    x = torch.zeros(4, 256)
    x[0, 0], x[0, 1] = -5.0, 1e-3
    x[1] = -3 - 7 * torch.rand(256, generator=g)  # all in (-10, -3]: GELU from -4e-3 down to -1e-30
    x[2] = -6 - 3.5 * torch.rand(256, generator=g)  # all GELU values below 1e-10 in magnitude
    x[3] = -3 - 7 * torch.rand(256, generator=g)
    x[3, :8] = 1e-2 * torch.rand(8, generator=g)  # small positive values against the negative tail
    q, s = quantize_rows(x.to(DEV), gelu=True)
    h = x.double()
    exact = h * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (h + 0.044715 * h**3))
    _assert_within_half_step(q, s, exact, 1e-30)
    assert (s.cpu().double().squeeze(1) <= exact.abs().amax(1) / 448 * (1 + 1e-5)).all()


def _adaln_inputs(B: int, N: int, D: int, dtype: torch.dtype, seed: int):
    """x, y (B, N, D) and shift, scale, gate (B, D) views of one (B, 6D) adaLN output (row stride 6D, as the
    block's chunks), each sample its own; x with an offset and spread per row, so the LayerNorm has work."""
    g = _gen(seed)
    spread, offset = 0.5 + 3 * torch.rand(B, N, 1, generator=g), torch.randn(B, N, 1, generator=g)
    x = torch.randn(B, N, D, generator=g) * spread + offset
    y = torch.randn(B, N, D, generator=g) * 2
    mods = torch.randn(B, 6 * D, generator=g) * 0.7
    shift, scale, gate = mods[:, :D], mods[:, D:2 * D], mods[:, 3 * D:4 * D]
    return [v.to(dtype).to(DEV) for v in (x, y, shift, scale, gate)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("residual", [True, False])
# D: 1024 + 128 (DiT-XL); 128 + 128 and 512 + 512 with 56 and 24 columns of the second tile masked; rows: the
# one a program of the launch, and 4 rows over N not a multiple of 4 (the kernel's row mask; the benchmark's
# sweep launches such)
@pytest.mark.parametrize("B, N, D, rows", [(3, 5, 1152, 1), (2, 13, 200, 1), (2, 9, 1000, 4)])
def test_layernorm_modulate_e4m3_is_the_unfused_ops(B, N, D, rows, residual, dtype, monkeypatch):
    """The fused pass against its three unfused steps: the gated residual against float64 (one rounding to the
    storage dtype, to nearest: within half a unit in the last place, plus the float32 product and sum's own
    rounding); q, s against ``quantize_rows_reference`` of ``layernorm_modulate_reference`` of the
    kernel's own residual in float32 (scales to 1e-5, summation order; values at most one e4m3 step off in
    1 in 1,000); and the dequantized rows within half an e4m3 step of float64 LayerNorm + modulate."""
    from ditforge.ops.fp8 import layernorm_modulate_e4m3
    from ditforge.ops.modulate import layernorm_modulate_reference

    import ditforge.ops.fp8 as fp8_module

    block_a, block_b, _, warps = fp8_module._layernorm_config(D)
    monkeypatch.setattr(fp8_module, "_layernorm_config", lambda D: (block_a, block_b, rows, warps))
    x, y, shift, scale, gate = _adaln_inputs(B, N, D, dtype, seed=B * N * D + residual)
    with torch.no_grad():
        stream, rows = layernorm_modulate_e4m3(x, shift, scale, 1e-6, *((y, gate) if residual else ()))
    assert rows.q.shape == (B, N, D) and rows.q.dtype == torch.float8_e4m3fn and rows.s.shape == (B, N, 1)
    if residual:
        gy = gate.cpu().double()[:, None] * y.cpu().double()
        exact = x.cpu().double() + gy
        ulp = torch.finfo(dtype).eps * 2.0 ** torch.floor(torch.log2(exact.abs().clamp_min(1e-30)))
        fp32 = 2.0**-23 * (x.cpu().double().abs() + gy.abs())  # the float32 product and sum before the store
        assert stream.dtype == dtype and ((stream.cpu().double() - exact).abs() <= ulp / 2 + fp32).all()
    else:
        assert stream is x
    h = stream.cpu().double()
    want = layernorm_modulate_reference(h, shift.cpu().double(), scale.cpu().double(), 1e-6)
    q_ref, s_ref = quantize_rows_reference(layernorm_modulate_reference(h.float(), shift.cpu().float(),
                                                                        scale.cpu().float(), 1e-6))
    torch.testing.assert_close(rows.s.cpu(), s_ref, rtol=1e-5, atol=0)
    off = _steps(rows.q, q_ref)
    assert off.max() <= 1 and (off > 0).float().mean() <= 1e-3, (off.max(), (off > 0).sum())
    _assert_within_half_step(rows.q, rows.s, want, 1e-6 * want.abs().amax(-1, keepdim=True))


def test_layernorm_modulate_e4m3_keeps_a_nan_in_its_row():
    """A NaN in one row of one sample: a NaN scale there only, and (on a GPU; Triton's interpreter casts NaN to
    e4m3 as 384) NaN values in that row only."""
    from ditforge.ops.fp8 import layernorm_modulate_e4m3

    x, y, shift, scale, gate = _adaln_inputs(2, 3, 1152, torch.bfloat16, seed=1)
    y[1, 2, 1100] = float("nan")  # in the second tile of one row of the second sample
    with torch.no_grad():
        stream, rows = layernorm_modulate_e4m3(x, shift, scale, 1e-6, y, gate)
    nan = rows.s.cpu().isnan().view(2, 3)
    assert nan[1, 2] and nan.sum() == 1 and stream[1, 2].isnan().sum() == 1
    if DEV == "cuda":
        q_nan = rows.q.cpu().float().isnan()
        assert q_nan[1, 2].all() and q_nan.sum() == 1152


def test_seam_hands_a_float8_layer_its_quantized_rows(monkeypatch):
    """``layernorm_modulate`` / ``residual_layernorm_modulate`` with ``into`` a float8 layer: the fused pass for
    per-sample modulation (the layer takes the rows without quantizing again), ``quantize_rows`` after the
    installed ops where the fused pass does not apply (per-token modulation of packed rows, a (1, D) shift that
    broadcasts, a branch output in float32 that promotes the stream), and the plain ops for any other layer."""
    import importlib

    from ditforge.ops.fp8 import Float8Rows

    mod = importlib.import_module("ditforge.ops.modulate")  # the package's ``modulate`` is the function

    g = _gen(2)
    fc = _linear(192, 64, g)
    f8 = RowwiseFloat8Linear.from_linear(fc)
    x, y, shift, scale, gate = _adaln_inputs(2, 7, 192, torch.bfloat16, seed=3)
    fused = []
    real = mod.layernorm_modulate_e4m3
    monkeypatch.setattr(mod, "layernorm_modulate_e4m3", lambda *a: fused.append(1) or real(*a))
    with torch.no_grad():
        rows = mod.layernorm_modulate(x, shift, scale, 1e-6, into=f8)
        stream, rows2 = mod.residual_layernorm_modulate(mod.GatedSum(x, y, gate), shift, scale, 1e-6, into=f8)
        assert isinstance(rows, Float8Rows) and isinstance(rows2, Float8Rows) and len(fused) == 2
        with monkeypatch.context() as m:
            m.setattr(importlib.import_module("ditforge.ops.fp8"), "quantize_rows", None)  # not called again
            assert f8(rows).shape == (2, 7, 64)
        plain_stream, plain = mod.residual_layernorm_modulate(mod.GatedSum(x, y, gate), shift, scale, 1e-6, into=fc)
        assert torch.equal(plain_stream, mod.gated_residual_reference(x, y, gate))
        assert torch.equal(plain, mod.layernorm_modulate_reference(plain_stream, shift, scale, 1e-6))
        per_token = [v[:, None].expand(2, 7, 192) for v in (shift, scale, gate)]
        s3, r3 = mod.residual_layernorm_modulate(mod.GatedSum(x, y, per_token[2]), *per_token[:2], 1e-6, into=f8)
        s4, r4 = mod.residual_layernorm_modulate(mod.GatedSum(x, y.float(), gate), shift[:1], scale[:1], 1e-6,
                                                  into=f8)
    assert len(fused) == 2  # none of these took the fused pass
    q_ref, s_ref = quantize_rows_reference(mod.layernorm_modulate_reference(s3, *per_token[:2], 1e-6))
    torch.testing.assert_close(r3.s.cpu(), s_ref.cpu(), rtol=0, atol=0)
    assert torch.equal(r3.q.cpu().view(torch.uint8), q_ref.cpu().view(torch.uint8))
    assert s4.dtype == torch.float32 and torch.equal(s4, mod.gated_residual_reference(x, y.float(), gate))
    q_ref, s_ref = quantize_rows_reference(mod.layernorm_modulate_reference(s4, shift[:1], scale[:1], 1e-6))
    torch.testing.assert_close(r4.s.cpu(), s_ref.cpu(), rtol=0, atol=0)


def _float8_dit_s2(image_size: int, batch: int, depth: int = 12, seed: int = 0):
    """A DiT-S/2 (4 channels, 10 classes; ``depth`` blocks, 12 as registered) with its zero-initialised layers
    perturbed (``seed``), before any cast, and a fresh batch (x, t, y) on DEV: the model the float8 model tests
    convert."""
    from ditforge.models.dit import DiT

    torch.manual_seed(seed)
    model = DiT(image_size, 2, 4, hidden_size=384, depth=depth, num_heads=6, num_classes=10)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    x = torch.randn(batch, 4, image_size, image_size, device=DEV)
    return model, (x, torch.randint(0, 1000, (batch,), device=DEV), torch.arange(batch, device=DEV))


def test_float8_dit_blocks_quantize_in_their_layernorm_passes(monkeypatch):
    """A float8 DiT-S/2 (4 of its 12 blocks: the interpreter runs the passes row by row): each block's two
    LayerNorms run the fused pass, all but the first summing a gated residual before it (the attention's; the
    previous block's MLP's, handed on as a ``GatedSum``), and the model is as accurate against its float64 self
    as the same float8 model whose layers quantize their own bf16 inputs: within 10% of that one's relative
    error (4 blocks: fused 0.87-1.04%, own 0.87-1.03%, ratio 0.99-1.01 at seeds 0-2; 12 blocks: fused
    1.45-1.61%, own 1.40-1.59%; bf16 alone 1.3%). The two differ from each other by about as much (1.1% at 12
    blocks): other values round to other e4m3 steps."""
    import copy
    import importlib

    import ditforge.ops.fp8 as fp8_module
    from ditforge.parallel import fp8_layer

    model, (x, t, y) = _float8_dit_s2(8, 2, depth=4)
    exact = copy.deepcopy(model).to(DEV, torch.float64).eval()
    model = model.to(DEV, torch.bfloat16).eval()
    to_rowwise_float8(model, fp8_layer)
    calls, launch = [], fp8_module._launch_layernorm_modulate_e4m3
    monkeypatch.setattr(fp8_module, "_launch_layernorm_modulate_e4m3", lambda *a: calls.append(a[1] is not None)
                        or launch(*a))
    with torch.no_grad():
        want = exact(x.double(), t, y)
        fused = model(x, t, y).double()
        monkeypatch.setattr(importlib.import_module("ditforge.ops.modulate"), "RowwiseFloat8Linear", type("No", (), {}))
        own = model(x, t, y).double()
    assert calls == [False] + [True] * 7
    err = lambda a: ((a - want).norm() / want.norm()).item()  # noqa: E731
    assert err(fused) < 1.1 * err(own) < 0.05, (err(fused), err(own))


def _linear(d_in: int, d_out: int, g: torch.Generator, bias: bool = True) -> nn.Linear:
    fc = nn.Linear(d_in, d_out, bias=bias)
    with torch.no_grad():
        fc.weight.copy_(torch.randn(d_out, d_in, generator=g) / math.sqrt(d_in))
        if bias:
            fc.bias.copy_(torch.randn(d_out, generator=g))
    return fc.bfloat16().to(DEV)


@pytest.mark.parametrize("bias", [True, False])
def test_float8_linear_is_the_dequantized_product(bias):
    g = _gen(7 + bias)
    fc = _linear(384, 1536, g, bias)
    f8 = RowwiseFloat8Linear.from_linear(fc)
    assert f8.weight.dtype == torch.float8_e4m3fn and f8.weight_scale.shape == (1, 1536)
    x = (torch.randn(3, 41, 384, generator=g) * 2).bfloat16().to(DEV)
    with torch.no_grad():
        out = f8(x)
    assert out.shape == (3, 41, 1536) and out.dtype == torch.bfloat16
    qx, sx = quantize_rows_reference(x)
    qw, sw = quantize_rows_reference(fc.weight)
    emulated = (qx.double() * sx.double()) @ (qw.double() * sw.double()).t()
    exact = x.double() @ fc.weight.double().t()
    if bias:
        emulated, exact = emulated + fc.bias.double(), exact + fc.bias.double()
    assert (out.double() - emulated).abs().max() <= 2**-7 * emulated.abs().max()  # bf16 output: 2^-9 on the
    # CPU; cuBLAS's float8 GEMM errs up to 0.42% (H100, 2026-11-27), so two bf16 steps of the largest value
    if not bias:
        rel = ((out.double() - exact).norm() / exact.norm()).item()
        assert abs(rel / PRODUCT - 1) < 0.15, rel


def test_gelu_mlp_hands_quantized_gelu_rows_to_fc2():
    g = _gen(3)
    fc1, fc2 = _linear(384, 1536, g), _linear(1536, 384, g)
    x = torch.randn(2, 33, 384, generator=g).bfloat16().to(DEV)
    f1, f2 = RowwiseFloat8Linear.from_linear(fc1), RowwiseFloat8Linear.from_linear(fc2)
    with torch.no_grad():
        got = gelu_mlp(x, f1, f2)
        h = f1(x)
        want = f2.forward_quantized(*quantize_rows_reference(h, gelu=True))
        bf16 = gelu_mlp(x, fc1, fc2)  # the plain path: fc2(GELU(fc1(x)))
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    rel = ((got.double() - bf16.double()).norm() / bf16.double().norm()).item()
    assert 0.01 < rel < 0.1, rel  # float8 rounding of two GEMMs: a few percent, never the bf16 result itself


def test_to_rowwise_float8_replaces_the_chosen_layers_only():
    g = _gen(5)
    model = nn.Sequential(_linear(64, 32, g), nn.GELU(), _linear(32, 48, g), _linear(48, 16, g))
    n = to_rowwise_float8(model, lambda m, fqn: fqn != "3")
    assert n == 2 and [type(m).__name__ for m in model] == ["RowwiseFloat8Linear", "GELU", "RowwiseFloat8Linear",
                                                           "Linear"]
    with pytest.raises(ValueError, match="must be bfloat16"):
        RowwiseFloat8Linear.from_linear(nn.Linear(32, 32))
    with pytest.raises(ValueError, match="multiples of 16"):
        RowwiseFloat8Linear.from_linear(nn.Linear(20, 32).bfloat16())


@pytest.mark.skipif(DEV != "cuda", reason="torch.compile traces into the Triton ops on a GPU only")
def test_compiled_float8_model_matches_eager():
    """torch.compile (fullgraph) traces through quantize_rows and _scaled_mm: a float8 DiT-S/2 gives the eager
    float8 model's output up to bf16 rounding (inductor may fuse the bf16 operations around them differently)."""
    from ditforge.parallel import fp8_layer

    model, (x, t, y) = _float8_dit_s2(16, 4)
    model = model.to(DEV, torch.bfloat16).eval()
    assert to_rowwise_float8(model, fp8_layer) == 48
    with torch.no_grad():
        eager = model(x, t, y).float()
        compiled = torch.compile(model, fullgraph=True, dynamic=False)(x, t, y).float()
    assert ((compiled - eager).norm() / eager.norm()).item() < 2e-2


@pytest.mark.skipif(DEV != "cuda", reason="torch.compile traces into the Triton ops on a GPU only")
def test_compiled_float8_linear_runs_the_triton_pass(monkeypatch):
    """Under torch.compile the layer quantizes with the same Triton op as eagerly (inductor keeps the kernel in
    its graph, instead of fusing the quantization into the producer): the compiled layer equals the eager one
    bit for bit, and with the op made to fail, compiling fails."""
    import ditforge.ops.fp8 as fp8_module

    g = _gen(11)
    f8 = RowwiseFloat8Linear.from_linear(_linear(64, 48, g))
    x = torch.randn(2, 5, 64, generator=g).bfloat16().to(DEV)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = f8(x)
        assert torch.equal(torch.compile(f8, fullgraph=True, dynamic=False)(x), eager)

        def fail(*args, **kwargs):
            raise AssertionError("the Triton op ran")

        monkeypatch.setattr(fp8_module, "quantize_rows", fail)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="Triton op ran"):
            torch.compile(f8, fullgraph=True, dynamic=False)(x)
