"""8-bit attention (``ditforge.ops.quant_attention``: int8 Q K^T, e4m3 P V, a Triton kernel) against PyTorch.

Oracles:
- ``quantized_attention_reference``: the kernel's algorithm unfused in PyTorch float32 over the same quantized
  inputs (the online softmax block by block, P rounded by PyTorch's e4m3 cast). The kernel must equal it up to its
  bf16 output: 2^-7 of each value (Triton's CPU interpreter truncates to bf16; a GPU rounds, 2^-8), plus 2^-12 of
  the largest, for the rare P that float32 exp2 puts on the other side of an e4m3 rounding boundary.
- The quantization against closed forms: q and the smoothed k dequantize to within half an int8 step of their
  row / block scale, v to within half an e4m3 step (2^-4 relative, 2^-10 of the channel scale for subnormals).
- Exact float64 attention: e4m3 rounding of P and of V each adds a relative error of rms
  2^-3 / sqrt(12) * sqrt(3 / (8 ln 2)) = 0.0265 for values spread over binades (Gaussian V; P of near-uniform
  attention), int8 Q K^T about 0.011 (measured: 0.0114 at D = 128): together 0.039. Allowed: 0.045.
- Smoothing: with a per-channel key offset shared by all keys, 10 times their spread (as trained models' keys
  have), the error stays within the same bound; without subtracting the mean key the int8 step would grow about
  tenfold, and the Q K^T error with it.
On a machine without CUDA the kernel runs under TRITON_INTERPRET=1 (conftest.py); with CUDA on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ditforge.ops.quant_attention import (E4M3_MAX, KEY_BLOCK, quantize_attention_inputs, quantized_attention,
                                          quantized_attention_reference)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cuda" and torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("float8 products need compute capability >= 8.9", allow_module_level=True)
ONE_E4M3 = 2.0**-3 / math.sqrt(12) * math.sqrt(3 / (8 * math.log(2)))  # 0.0265


def _qkv(S: int, D: int, seed: int, B: int = 2, H: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, S, H, D, generator=g).to(DEV) for _ in range(3))


def _exact(q, k, v) -> torch.Tensor:
    return F.scaled_dot_product_attention(*(x.double().transpose(1, 2) for x in (q, k, v))).transpose(1, 2)


@pytest.mark.parametrize("S, D", [(100, 128), (300, 64), (257, 32)])
def test_kernel_equals_its_unfused_reference(S, D):
    """One key block with padding (100), several with a masked tail (300 = 2 x 128 + 44), heads 32 wide."""
    q, k, v = _qkv(S, D, seed=S)
    parts = quantize_attention_inputs(q, k, v)
    out = quantized_attention(q, k, v)
    ref = quantized_attention_reference(*parts, S)
    assert out.shape == (2, S, 2, D) and out.dtype == torch.bfloat16
    err = (out.float() - ref).abs()
    assert (err <= 2.0**-7 * ref.abs() + 2.0**-12 * ref.abs().max()).all(), err.max()


def test_quantization_is_within_half_a_step():
    S, D = 300, 64
    q, k, v = _qkv(S, D, seed=1)
    q8, k8, vt8, sq, sk, sv = quantize_attention_inputs(q, k, v, scale=1.0)
    log2e = 1.4426950408889634
    q_scale = sq[..., :S, None] / log2e  # (B, H, S, 1): a_q / 127
    assert ((q8[:, :, :S].float() * q_scale - q.transpose(1, 2)).abs() <= q_scale / 2 * (1 + 1e-6)).all()
    assert (q8[:, :, S:] == 0).all() and (sq[..., S:] == 0).all()  # padding
    smooth = (k - k.mean(1, keepdim=True)).transpose(1, 2)
    k_scale = sk.repeat_interleave(KEY_BLOCK, -1)[..., :S, None]
    assert ((k8[:, :, :S].float() * k_scale - smooth).abs() <= k_scale / 2 * (1 + 1e-5)).all()
    v_back = vt8[..., :S].float() * sv[..., None]
    v_want = v.permute(0, 2, 3, 1)
    half = torch.maximum(v_want.abs() * 2.0**-4, sv[..., None] * 2.0**-10)  # sv = a / 448: subnormal steps 2^-9
    assert ((v_back - v_want).abs() <= half * (1 + 1e-5)).all()


def test_error_against_exact_attention_is_that_of_the_8_bit_operands():
    S, D = 600, 128  # 4 key blocks and a masked tail of 88
    q, k, v = _qkv(S, D, seed=2, B=1)
    out = quantized_attention(q, k, v).double()
    exact = _exact(q, k, v)
    rel = ((out - exact).norm() / exact.norm()).item()
    assert rel < 0.045, rel
    assert rel > math.sqrt(2) * ONE_E4M3 * 0.8, rel  # the e4m3 roundings are there (not a bf16 path)
    offset = 10 * torch.randn(1, 1, *k.shape[2:], generator=torch.Generator().manual_seed(3)).to(DEV)
    shifted = quantized_attention(q, k + offset, v).double()
    rel = ((shifted - _exact(q, k + offset, v)).norm() / exact.norm()).item()
    assert rel < 0.045, rel
