"""The attention seam against an explicit float64 softmax(q k^T / sqrt(d)) v, with and without
--enable_flashattn and the math baseline (on the CPU the backend order falls through to the kernels the CPU has)."""

import math

import pytest
import torch

from ditforge.ops.attention import FAST_BACKENDS, attention, set_attention_backend


@pytest.mark.parametrize("backend", ["auto", "fast", "math"])
def test_attention_matches_float64_reference(backend):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q, k, v = (torch.randn(2, 3, 13, 72, generator=g) for _ in range(3))  # DiT's head dim 72, odd length
    try:
        assert "order" in set_attention_backend(backend)
        out = attention(q, k, v)
    finally:
        set_attention_backend()
    qd, kd, vd = q.double(), k.double(), v.double()
    ref = torch.softmax(qd @ kd.transpose(-1, -2) / math.sqrt(72), dim=-1) @ vd
    # float32 kernels against float64: relative error far under 1e-5 (METHOD.md: fp32 lands well below 1e-3).
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


def test_fast_order_prefers_cudnn_then_flash_and_keeps_math():
    assert FAST_BACKENDS[:2] == [torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
                                 torch.nn.attention.SDPBackend.FLASH_ATTENTION]
    assert FAST_BACKENDS[-1] == torch.nn.attention.SDPBackend.MATH


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="flash2"):
        set_attention_backend("flash2")
