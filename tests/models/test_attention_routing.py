"""``models.adapters.dispatch.route_self_attention`` on a transformer whose attention processor calls PyTorch's SDPA
itself, past diffusers' dispatcher (CogVideoX's joint text-video attention): its calls reach the routed kernel, eager
and compiled whole, the transformer's output is diffusers' own where the kernel is exact, and calls the kernel does
not take (a mask) go to PyTorch as made. Reference: the unrouted diffusers model on the same inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

diffusers = pytest.importorskip("diffusers")

from ditforge.models.adapters import dispatch  # noqa: E402

LAYERS, HEADS, WIDTH, TEXT = 2, 2, 16, 226


def _transformer(width: int = WIDTH):
    """The tests' tiny CogVideoX 1.0 transformer (``tiny_pipelines.make_cogvideox``'s config; heads ``width`` wide),
    fresh random weights."""
    torch.manual_seed(torch.randint(1 << 30, ()).item())
    return diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=width, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=32, num_layers=LAYERS, sample_width=4, sample_height=4, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=TEXT, use_rotary_positional_embeddings=False).eval()


def _inputs():
    x = torch.randn(1, 3, 4, 4, 4)  # (B, T', C, h, w): 3 latent frames of 2 x 2 patches, 12 video tokens
    return x, torch.randn(1, TEXT, 32), torch.tensor([torch.randint(1000, ()).item()])


def _exact(calls: list):
    def fn(q, k, v, scale=None):  # (B, S, H, D), as the dispatcher passes them
        calls.append(tuple(q.shape))
        return F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v)),
                                              scale=scale).transpose(1, 2).to(q.dtype)

    return fn


def test_sdpa_calling_processors_route_and_equal_diffusers():
    transformer = _transformer()
    x, text, t = _inputs()
    with torch.no_grad():
        plain = transformer(x, text, t, return_dict=False)[0]
    calls: list = []
    assert dispatch.route_self_attention(transformer, _exact(calls), (WIDTH,)) == LAYERS
    with torch.no_grad():
        routed = transformer(x, text, t, return_dict=False)[0]
    assert calls == [(1, TEXT + 12, HEADS, WIDTH)] * LAYERS  # one joint [text; video] call a block
    torch.testing.assert_close(routed, plain, rtol=0, atol=1e-5)  # float64 attention against PyTorch's float32
    processors = [b.attn1.processor for b in transformer.transformer_blocks]
    assert len({type(p) for p in processors}) == 1  # one class: the blocks stay one compiled graph
    # routed again (another kernel): the processors' own class is the base, not the earlier routed one
    assert dispatch.route_self_attention(transformer, _exact([]), (WIDTH + 8,)) == LAYERS
    with torch.no_grad():  # a head width the route does not take: PyTorch's SDPA, as before routing
        torch.testing.assert_close(transformer(x, text, t, return_dict=False)[0], plain, rtol=0, atol=0)
    # a split sequence attends through intercept_sdpa: the routing is undone first
    dispatch.intercept_sdpa(transformer, lambda q, k, v, mask, attend: attend(q, k, v, mask))
    assert all(type(p) is diffusers.models.attention_processor.CogVideoXAttnProcessor2_0 for p in processors)


def test_routed_block_compiles_whole_and_masked_calls_go_to_pytorch():
    transformer = _transformer()
    x, text, t = _inputs()

    def negated(q, k, v, scale=None):  # a kernel unlike PyTorch's, so the routing shows in the output
        return -F.scaled_dot_product_attention(*(a.transpose(1, 2) for a in (q, k, v)), scale=scale).transpose(1, 2)

    block = transformer.transformer_blocks[0]
    h, enc, temb = torch.randn(1, 12, 32), torch.randn(1, TEXT, 32), torch.randn(1, 8)
    with torch.no_grad():
        plain = block(h, enc, temb)
        dispatch.route_self_attention(transformer, negated, (WIDTH,))
        eager = block(h, enc, temb)
        compiled = torch.compile(block, backend="eager", fullgraph=True)(h, enc, temb)
    assert (eager[0] - plain[0]).abs().max() > 1e-2
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # a masked call (and a cross-attention's, keys unlike queries) goes to PyTorch's SDPA as called
    sdpa = dispatch._sdpa_router(dispatch._Route(negated, (WIDTH,)))
    q, k, v = (torch.randn(1, HEADS, 7, WIDTH) for _ in range(3))
    mask = torch.rand(1, 1, 7, 7) > 0.3
    mask[..., 0] = True
    torch.testing.assert_close(sdpa(q, k, v, attn_mask=mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    kv = torch.randn(1, HEADS, 5, WIDTH)
    torch.testing.assert_close(sdpa(q, kv, kv), F.scaled_dot_product_attention(q, kv, kv))
    torch.testing.assert_close(sdpa(q, k, v), -F.scaled_dot_product_attention(q, k, v))


def test_quantized_attention_reaches_a_processor_that_calls_sdpa():
    """``--quantized_attention``'s kernel (Triton; on the CPU its interpreter) in CogVideoX's joint attention: every
    block's call reaches it, and the output stays within the kernel's 8-bit error of diffusers' own."""
    from ditforge.ops import quant_attention

    transformer = _transformer(32)  # the kernel's narrowest heads
    x, text, t = _inputs()
    with torch.no_grad():
        plain = transformer(x, text, t, return_dict=False)[0]
    calls: list = []

    def kernel(q, k, v, scale=None):
        calls.append(tuple(q.shape))
        return quant_attention.quantized_attention(q, k, v, scale)

    assert dispatch.route_self_attention(transformer, kernel, quant_attention.HEAD_DIMS) == LAYERS
    with torch.no_grad():
        routed = transformer(x, text, t, return_dict=False)[0]
    assert calls == [(1, TEXT + 12, HEADS, 32)] * LAYERS
    err = ((routed - plain).norm() / plain.norm()).item()
    assert 0 < err < 5e-3  # measured 5.5e-4 (torch 2.13 CPU, Triton's interpreter); exact would be 0
