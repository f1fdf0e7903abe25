"""Text conditioning (PixArt-alpha style cross-attention, caption dropout) and QK-normalisation, against
explicit float64 computations."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ditforge.models import create_model
from ditforge.models.layers import Attention, CrossAttention
from ditforge.ops.attention import set_attention_backend

TEXT_DIM = 24


def _randomise(model):
    """The init zeroes adaLN, cross-attention outputs and the final layer; random values make every path count."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    return model


def _text_model(name="DiT-T/2", size=8, frames=None, **kw):
    return _randomise(create_model(name, size, 4, 10, num_frames=frames, text_dim=TEXT_DIM, **kw).double().eval())


def _explicit_attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d)) v with masked keys at -inf, float64; q (B, H, N, d), k, v (B, H, L, d)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def test_cross_attention_equals_explicit_masked_softmax():
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    layer = CrossAttention(48, 4).double()
    x, ctx = torch.randn(3, 7, 48, dtype=torch.float64), torch.randn(3, 5, 48, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    q = layer.q_linear(x).reshape(3, 7, 4, 12).transpose(1, 2)
    k, v = layer.kv_linear(ctx).reshape(3, 5, 2, 4, 12).permute(2, 0, 3, 1, 4)
    ref = layer.proj(_explicit_attention(q, k, v, mask).transpose(1, 2).reshape(3, 7, 48))
    torch.testing.assert_close(layer(x, ctx, mask), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cls", [Attention, CrossAttention])
def test_qk_norm_normalises_each_heads_queries_and_keys(cls):
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    layer = cls(48, 4, qk_norm=True).double()
    with torch.no_grad():  # non-trivial LayerNorm affine parameters
        for norm in (layer.q_norm, layer.k_norm):
            norm.weight.normal_()
            norm.bias.normal_()
    x = torch.randn(2, 6, 48, dtype=torch.float64) * 3 + 1
    if cls is Attention:
        q, k, v = layer.qkv(x).reshape(2, 6, 3, 4, 12).permute(2, 0, 3, 1, 4)
        out = layer(x)
    else:
        ctx = torch.randn(2, 5, 48, dtype=torch.float64)
        q = layer.q_linear(x).reshape(2, 6, 4, 12).transpose(1, 2)
        k, v = layer.kv_linear(ctx).reshape(2, 5, 2, 4, 12).permute(2, 0, 3, 1, 4)
        out = layer(x, ctx, torch.ones(2, 5, dtype=torch.bool))

    def ln(t, norm):  # LayerNorm over the head dimension, written out
        mu, var = t.mean(-1, keepdim=True), t.var(-1, unbiased=False, keepdim=True)
        return (t - mu) / torch.sqrt(var + 1e-6) * norm.weight + norm.bias

    ref = _explicit_attention(ln(q, layer.q_norm), ln(k, layer.k_norm), v)
    torch.testing.assert_close(out, layer.proj(ref.transpose(1, 2).reshape(2, 6, 48)), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,frames", [("DiT-T/2", None), ("vDiT-T/122", 2)])
def test_caption_padding_is_ignored_and_captions_condition(name, frames):
    model = _text_model(name, frames=frames)
    x = torch.randn(2, 4, *([frames] if frames else []), 8, 8, dtype=torch.float64)
    t = torch.tensor([10, 900])
    states = torch.randn(2, 5, TEXT_DIM, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    out = model(x, t, states, y_mask=mask)
    # other values in the padded positions and extra padding change nothing
    padded = torch.cat([states, torch.randn(2, 3, TEXT_DIM, dtype=torch.float64)], dim=1)
    padded[0, 3:5] = torch.randn(2, TEXT_DIM, dtype=torch.float64)
    out_padded = model(x, t, padded, y_mask=torch.cat([mask, torch.zeros(2, 3, dtype=torch.bool)], dim=1))
    torch.testing.assert_close(out_padded, out, rtol=1e-10, atol=1e-12)
    # another caption for sample 0 changes sample 0 only
    other = states.clone()
    other[0, :3] = torch.randn(3, TEXT_DIM, dtype=torch.float64)
    out_other = model(x, t, other, y_mask=mask)
    assert (out_other[0] - out[0]).abs().max() > 1e-3
    torch.testing.assert_close(out_other[1], out[1], rtol=1e-12, atol=1e-12)


def test_dropped_captions_are_the_null_caption_whatever_the_text():
    model = _text_model()
    x, t = torch.randn(3, 4, 8, 8, dtype=torch.float64), torch.tensor([5, 500, 999])
    drop = torch.tensor([True, False, True])
    a = (torch.randn(3, 4, TEXT_DIM, dtype=torch.float64), torch.tensor([[1, 1, 0, 0]] * 3, dtype=torch.bool))
    b = (torch.randn(3, 6, TEXT_DIM, dtype=torch.float64), torch.ones(3, 6, dtype=torch.bool))
    out_a = model(x, t, a[0], force_drop_ids=drop, y_mask=a[1])
    out_b = model(x, t, b[0], force_drop_ids=drop, y_mask=b[1])
    torch.testing.assert_close(out_a[drop], out_b[drop], rtol=1e-10, atol=1e-12)
    assert (out_a[~drop] - out_b[~drop]).abs().max() > 1e-3
    # training-mode dropout draws its own coins: with probability 1 every caption is the null one
    model.y_embedder.dropout_prob = 1.0
    model.train()
    torch.testing.assert_close(model(x, t, a[0], y_mask=a[1]), model(x, t, b[0], y_mask=b[1]), rtol=1e-10, atol=1e-12)


def test_text_model_starts_with_cross_attention_switched_off():
    model = create_model("DiT-T/2", 8, 4, 10, text_dim=TEXT_DIM)
    assert all(b.cross_attn.proj.weight.abs().sum() == 0 for b in model.blocks)
    with pytest.raises(ValueError, match="y_mask"):
        model(torch.randn(1, 4, 8, 8), torch.tensor([3]), torch.randn(1, 2, TEXT_DIM))


@pytest.mark.parametrize("name,frames", [("DiT-T/2", None), ("vDiT-T/222", 4)])
def test_text_model_flops_equal_pytorch_flop_counter(name, frames):
    model = create_model(name, 8, 4, 10, num_frames=frames, text_dim=TEXT_DIM)
    x = torch.randn(2, 4, *([frames] if frames else []), 8, 8)
    states, mask = torch.randn(2, 7, TEXT_DIM), torch.ones(2, 7, dtype=torch.bool)
    try:
        set_attention_backend("math")  # attention as two batched matmuls, which the counter sees
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(x, torch.tensor([1, 2]), states, y_mask=mask)
    finally:
        set_attention_backend()
    assert counter.get_total_flops() == 2 * model.flops_per_sample(text_tokens=7)
