"""The attention seam against an explicit float64 softmax(q k^T / sqrt(d)) v, with and without
--enable_flashattn and the math baseline (on the CPU the backend order falls through to the kernels the CPU has)."""

import math

import pytest
import torch

from ditforge.ops.attention import attention, fast_backends, set_attention_backend


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


@pytest.mark.parametrize("capability, cudnn, first", [
    ((9, 0), 91501, "CUDNN_ATTENTION"),   # H100 / H200 with a cuDNN past the out-of-bounds bug
    ((10, 0), 92000, "CUDNN_ATTENTION"),  # B200
    ((9, 0), 91500, "FLASH_ATTENTION"),   # cuDNN 9.15.0 and older (pytorch/pytorch#169849)
    ((8, 0), 92000, "FLASH_ATTENTION"),   # A100: PyTorch does not prefer cuDNN there either
    ((12, 0), 92000, "FLASH_ATTENTION"),  # consumer Blackwell
])
def test_fast_order_puts_cudnn_first_only_where_pytorch_prefers_it(monkeypatch, capability, cudnn, first):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)
    order = [b.name for b in fast_backends(torch.device("cuda", 0))]
    assert order[0] == first and order[-1] == "MATH" and len(set(order)) == 4
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)  # switched off by the user
    assert fast_backends(torch.device("cuda", 0))[0].name == "FLASH_ATTENTION"
    assert fast_backends(torch.device("cpu"))[0].name == "FLASH_ATTENTION"


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="flash2"):
        set_attention_backend("flash2")


@pytest.mark.parametrize("qk_norm", [False, True])
def test_projection_of_a_head_group_is_that_slice_of_all_heads(qk_norm):
    """``Attention.project(x, heads)`` (FastSeq's head-group projection, from rows of the fused qkv weight)
    equals the same heads of the whole projection; the layer's output is the float64 explicit formula.

    float64 layer and tokens: the head group is a product with fewer weight rows than the whole one, which the BLAS
    may block differently (in float32, MKL's AVX2 kernels moved it by up to 7e-7, its AVX-512 ones by 0). A
    reordered float64 sum over D = 48 terms of size ~1 stays near 1e-14, far under 1e-12, while a wrong head's
    rows or a dropped bias moves outputs of size ~1 by ~1e-1."""
    from ditforge.models.layers import Attention

    seed = int(torch.randint(0, 2**31, ()))
    g = torch.Generator().manual_seed(seed)
    layer = Attention(48, 6, qk_norm=qk_norm).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5))
    x = torch.randn(2, 7, 48, generator=g, dtype=torch.float64)
    whole = layer.project(x)
    assert [t.shape for t in whole] == [(2, 6, 7, 8)] * 3
    for heads in (slice(0, 2), slice(2, 4), slice(3, 6)):
        for part, full in zip(layer.project(x, heads), whole):
            torch.testing.assert_close(part, full[:, heads], rtol=1e-12, atol=1e-12, msg=f"seed {seed}")
    q, k, v = (x @ layer.qkv.weight.T + layer.qkv.bias).reshape(2, 7, 3, 6, 8).permute(2, 0, 3, 1, 4)
    if qk_norm:
        q, k = (torch.nn.functional.layer_norm(t, (8,), n.weight, n.bias, 1e-6)
                for t, n in ((q, layer.q_norm), (k, layer.k_norm)))
    o = (torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1) @ v).transpose(1, 2).reshape(2, 7, 48)
    ref = o @ layer.proj.weight.T + layer.proj.bias
    torch.testing.assert_close(layer(x), ref, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")
