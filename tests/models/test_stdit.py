"""STDiT (ditforge.models.video.STDiT, Open-Sora v1.0's spatial-temporal DiT) against independent references.

* Inflation: an STDiT loaded with ``inflate_image_state_dict`` of a randomised image DiT (class- and
  text-conditioned) equals that DiT applied frame by frame (frames folded into the batch).
* ``STDiTBlock`` against an unfused reference written here with explicit loops (per frame: spatial attention;
  per position: temporal attention; per head: softmax(q k^T / sqrt(d)) v), LayerNorm, modulate and tanh-GELU
  written out, float64, temporal output projection random (non-zero); the model's forward against the same
  reference blocks (temporal position embedding in the first block only).
* Fixed tables against closed forms in numpy; initialisation (zero temporal projections, zero output).
* Temporal mixing: frame 0 reaches the last frame only through the temporal attention.
* Registry: names, errors naming the flag, the STDiT-XL/2 parameter count and FLOPs in closed form, FLOPs
  against PyTorch's FlopCounterMode, activation checkpointing, and a ``ditforge bench`` training step.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ditforge import cli
from ditforge.errors import UserError
from ditforge.models import (
    MODEL_NAMES,
    STDIT_MODEL_PATTERN,
    VIDEO_MODEL_PATTERN,
    DiT,
    STDiT,
    create_model,
    inflate_image_state_dict,
    infer_dit_config,
    is_video_model,
    model_spec,
)
from ditforge.models.video import STDiTBlock
from ditforge.ops.attention import set_attention_backend
from ditforge.parallel import apply_grad_checkpoint

IN_CHANNELS = 4
NUM_CLASSES = 10
TEXT_DIM = 24


pytestmark = pytest.mark.usefixtures("one_thread_module")


@torch.no_grad()
def _randomise_(model: torch.nn.Module, seed: int, keep: tuple[str, ...] = (), zero_temporal_proj: bool = False):
    """Every parameter (adaLN-Zero, final layer, temporal attention included) ~ N(0, 1/fan_in) for weights,
    N(0, 0.1^2) for vectors, N(0, 0.5^2) for position tables, so no zero initialisation makes a comparison
    trivial; names in ``keep`` stay; ``zero_temporal_proj`` zeroes every ``attn_temp.proj``."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name in keep:
            continue
        std = 0.5 if name.startswith("pos_embed") else (1.0 / math.sqrt(p[0].numel()) if p.dim() >= 2 else 0.1)
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)
        if zero_temporal_proj and ".attn_temp.proj." in name:
            p.zero_()


def _conditions(batch: int, gen: torch.Generator, text: bool, dtype=torch.float64):
    """(t, y, extra forward kwargs): class labels with the null label last, or caption states with padding."""
    t = torch.randint(0, 1000, (batch,), generator=gen, dtype=torch.int64)
    if not text:
        y = torch.randint(0, NUM_CLASSES, (batch,), generator=gen, dtype=torch.int64)
        y[-1] = NUM_CLASSES
        return t, y, {}
    y = torch.randn(batch, 5, TEXT_DIM, generator=gen, dtype=dtype)
    mask = torch.ones(batch, 5, dtype=torch.bool)
    mask[0, 3:] = False
    return t, y, {"y_mask": mask}


def _assert_close_rel(actual, expected, rel):
    """|a - e| <= rel * |e| + rel * max|e|, on a non-trivial reference."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = expected.abs().max().item()
    assert scale > 1e-2, "reference output is (near) zero: the comparison would be trivial"
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


# ---------------------------------------------------------------------------------------------------------------
# Inflation from an image DiT
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [False, True], ids=["class", "text"])
@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.float64, 1e-10)], ids=["fp32", "fp64"])
def test_inflated_stdit_equals_image_dit_frame_by_frame(text, dtype, rel):
    """STDiT-T/2 with inflated DiT-T/2 weights on (B, C, T, H, W) == DiT-T/2 on the B T frames (B T, C, H, W).

    The image DiT is randomised except its pos_embed (inflation recomputes the sin-cos table, so a random one
    could not carry over); the STDiT is randomised entirely first, so inflation must overwrite every tensor
    but the temporal qkv, which stays random: the zero temporal projection alone must switch the branch off.
    Tolerance relative to the output's maximum: 1e-5 fp32, 1e-10 float64 (Conv3d vs Conv2d summation order)."""
    size, T, B = 8, 3, 2
    kw = {"text_dim": TEXT_DIM} if text else {}
    dit = create_model("DiT-T/2", size, IN_CHANNELS, NUM_CLASSES, **kw).to(dtype).eval()
    _randomise_(dit, seed=11 + text, keep=("pos_embed",))
    stdit = create_model("STDiT-T/2", size, IN_CHANNELS, NUM_CLASSES, num_frames=T, **kw).to(dtype).eval()
    _randomise_(stdit, seed=13 + text)
    image_sd = {k: v.clone() for k, v in dit.state_dict().items()}
    stdit.load_state_dict(inflate_image_state_dict(image_sd, stdit), strict=True)
    for k, v in dit.state_dict().items():
        assert torch.equal(v, image_sd[k])  # the image state dict is not modified
    for block in stdit.blocks:
        assert torch.count_nonzero(block.attn_temp.proj.weight) == 0
        assert torch.count_nonzero(block.attn_temp.proj.bias) == 0
        assert torch.count_nonzero(block.attn_temp.qkv.weight) == block.attn_temp.qkv.weight.numel()
    assert stdit.x_embedder.proj.weight.shape == (192, IN_CHANNELS, 1, 2, 2)

    gen = torch.Generator().manual_seed(17 + text)
    x = torch.randn(B, IN_CHANNELS, T, size, size, generator=gen, dtype=dtype)
    t, y, kwargs = _conditions(B, gen, text, dtype)
    with torch.no_grad():
        actual = stdit(x, t, y, **kwargs)
        frames = x.transpose(1, 2).reshape(B * T, IN_CHANNELS, size, size)
        frame_kwargs = {k: v.repeat_interleave(T, dim=0) for k, v in kwargs.items()}
        expected = dit(frames, t.repeat_interleave(T), y.repeat_interleave(T, dim=0), **frame_kwargs)
    expected = expected.reshape(B, T, dit.out_channels, size, size).transpose(1, 2)
    assert actual.shape == (B, 2 * IN_CHANNELS, T, size, size)
    _assert_close_rel(actual, expected, rel)


def test_inflation_recomputes_positions_and_refuses_other_models():
    stdit = create_model("STDiT-T/2", 8, IN_CHANNELS, NUM_CLASSES, num_frames=2)
    # another resolution: everything but pos_embed has the same shape; pos_embed is recomputed for the STDiT
    sd = inflate_image_state_dict(create_model("DiT-T/2", 16, IN_CHANNELS, NUM_CLASSES).state_dict(), stdit)
    assert sd["pos_embed"].shape == (1, 2 * 16, 192)
    torch.testing.assert_close(sd["pos_embed"], stdit.pos_embed.detach(), rtol=0, atol=0)
    torch.testing.assert_close(sd["pos_embed_temporal"], stdit.pos_embed_temporal.detach(), rtol=0, atol=0)
    image = create_model("DiT-T/2", 8, IN_CHANNELS, NUM_CLASSES).state_dict()
    shallow = STDiT(input_size=8, num_frames=2, patch_size=2, depth=2, hidden_size=192, num_heads=3,
                    in_channels=IN_CHANNELS, num_classes=NUM_CLASSES)
    with pytest.raises(ValueError, match=r"unexpected \['blocks.2."):  # 6 image blocks for 2
        inflate_image_state_dict(image, shallow)
    text_model = create_model("STDiT-T/2", 8, IN_CHANNELS, NUM_CLASSES, num_frames=2, text_dim=TEXT_DIM)
    with pytest.raises(ValueError, match="missing .*y_embedder"):  # class-conditioned weights for a text model
        inflate_image_state_dict(image, text_model)
    with pytest.raises(ValueError, match="x_embedder.proj.weight has shape"):  # patch 4 into patch 2
        inflate_image_state_dict(create_model("DiT-T/4", 8, IN_CHANNELS, NUM_CLASSES).state_dict(), stdit)
    with pytest.raises(ValueError, match=r"\(1, p, p\)"):
        inflate_image_state_dict({}, STDiT(input_size=4, num_frames=4, patch_size=(2, 2, 2), depth=1,
                                           hidden_size=32, num_heads=2, num_classes=NUM_CLASSES))


# ---------------------------------------------------------------------------------------------------------------
# The block against an explicit reference
# ---------------------------------------------------------------------------------------------------------------


def _ln(x, eps=1e-6):
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps)


def _linear(layer, x):
    return x @ layer.weight.T + layer.bias


def _heads_attention(q, k, v, heads, q_norm=None, k_norm=None, mask=None):
    """q (Nq, D), k, v (Nk, D) -> (Nq, D): per head softmax(q k^T / sqrt(d)) v, heads in column blocks of d."""
    d = q.shape[1] // heads
    out = []
    for h in range(heads):
        qh, kh, vh = (z[:, h * d:(h + 1) * d] for z in (q, k, v))
        if q_norm is not None:  # qk_norm: LayerNorm with affine parameters over the head's channels
            qh, kh = _ln(qh) * q_norm.weight + q_norm.bias, _ln(kh) * k_norm.weight + k_norm.bias
        scores = qh @ kh.T / math.sqrt(d)
        if mask is not None:
            scores = scores.masked_fill(~mask[None, :], float("-inf"))
        out.append(torch.softmax(scores, dim=-1) @ vh)
    return torch.cat(out, dim=1)


def _self_attention(attn, x, heads):
    """timm-layout self-attention written out: qkv columns [q | k | v], each D wide."""
    D = x.shape[1]
    qkv = _linear(attn.qkv, x)
    norms = (attn.q_norm, attn.k_norm) if isinstance(attn.q_norm, torch.nn.LayerNorm) else (None, None)
    return _linear(attn.proj, _heads_attention(qkv[:, :D], qkv[:, D:2 * D], qkv[:, 2 * D:], heads, *norms))


def _cross_attention(layer, x, ctx, mask, heads):
    D = x.shape[1]
    kv = _linear(layer.kv_linear, ctx)
    norms = (layer.q_norm, layer.k_norm) if isinstance(layer.q_norm, torch.nn.LayerNorm) else (None, None)
    out = _heads_attention(_linear(layer.q_linear, x), kv[:, :D], kv[:, D:], heads, *norms, mask=mask)
    return _linear(layer.proj, out)


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _reference_block(block, x, c, context, tpe, heads, T, S):
    """Open-Sora v1.0's STDiTBlock with DiT's adaLN-Zero, one sample, one frame and one position at a time."""
    out = torch.empty_like(x)
    mod = _linear(block.adaLN_modulation[1], c * torch.sigmoid(c))  # SiLU then the regression
    for b in range(x.shape[0]):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod[b].chunk(6)
        h = _ln(x[b]) * (1 + scale_msa) + shift_msa
        spatial = torch.empty_like(h)
        for f in range(T):  # frame f: tokens f S .. f S + S - 1
            spatial[f * S:(f + 1) * S] = _self_attention(block.attn, h[f * S:(f + 1) * S], heads)
        xb = x[b] + gate_msa * spatial
        temporal = torch.empty_like(h)
        for s in range(S):  # position s in every frame: tokens s, S + s, 2 S + s, ...
            seq = xb[s::S] + (tpe[0] if tpe is not None else 0)
            temporal[s::S] = _self_attention(block.attn_temp, seq, heads)
        xb = xb + gate_msa * temporal
        if context is not None:
            xb = xb + _cross_attention(block.cross_attn, xb, context[0][b], context[1][b], heads)
        h = _ln(xb) * (1 + scale_mlp) + shift_mlp
        out[b] = xb + gate_mlp * _linear(block.mlp.fc2, _gelu_tanh(_linear(block.mlp.fc1, h)))
    return out


@pytest.mark.parametrize("cross,qk_norm,with_tpe", [(False, False, True), (True, True, False), (True, False, True)])
def test_block_equals_explicit_reference(cross, qk_norm, with_tpe):
    """float64, every weight random (temporal output projection and adaLN included); rtol = atol = 1e-10."""
    D, heads, T, S, B = 24, 3, 3, 4, 2
    block = STDiTBlock(D, heads, T, S, cross_attention=cross, qk_norm=qk_norm).double()
    _randomise_(block, seed=21 + 2 * cross + qk_norm)
    assert torch.count_nonzero(block.attn_temp.proj.weight) > 0
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(B, T * S, D, generator=gen, dtype=torch.float64)
    c = torch.randn(B, D, generator=gen, dtype=torch.float64)
    tpe = torch.randn(1, T, D, generator=gen, dtype=torch.float64) if with_tpe else None
    context = None
    if cross:
        context = (torch.randn(B, 5, D, generator=gen, dtype=torch.float64),
                   torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))
    with torch.no_grad():
        actual = block(x, c, context, tpe)
        expected = _reference_block(block, x, c, context, tpe, heads, T, S)
    _assert_close_rel(actual, expected, 1e-10)
    with pytest.raises(ValueError, match="4 tokens per frame got 11 tokens"):
        block(x[:, :11], c, context)


def test_model_forward_equals_reference_blocks():
    """STDiT.forward == patch embedding + tiled 2-D table, then the reference blocks with the temporal table in
    the first block only, then DiT's final layer and unpatchify (float64, 1e-10). Giving the temporal table to
    every block, or to none, differs."""
    T, size, B = 3, 4, 2
    model = STDiT(input_size=size, num_frames=T, patch_size=2, depth=2, hidden_size=32, num_heads=2,
                  in_channels=IN_CHANNELS, num_classes=NUM_CLASSES).double().eval()
    _randomise_(model, seed=31)
    gen = torch.Generator().manual_seed(32)
    x = torch.randn(B, IN_CHANNELS, T, size, size, generator=gen, dtype=torch.float64)
    t, y, _ = _conditions(B, gen, text=False)
    with torch.no_grad():
        actual = model(x, t, y)
        c, _ = model.embed_conditions(t, y)

        def reference(tpes):
            h = model.x_embedder(x) + model.pos_embed
            for block, tpe in zip(model.blocks, tpes):
                h = _reference_block(block, h, c, None, tpe, 2, T, 4)
            return model.unpatchify(model.final_layer(h, c))

        tpe = model.pos_embed_temporal
        expected = reference([tpe, None])
        _assert_close_rel(actual, expected, 1e-10)
        for wrong in ([tpe, tpe], [None, None]):
            assert (reference(wrong) - expected).abs().max() > 1e-6 * expected.abs().max()


# ---------------------------------------------------------------------------------------------------------------
# Fixed tables, initialisation, temporal mixing
# ---------------------------------------------------------------------------------------------------------------


def _sincos_closed_form(dim: int, pos: np.ndarray) -> np.ndarray:
    """(M, dim) float64: channel c < dim/2 is sin(pos 10000^(-2c/dim)), channel c >= dim/2 the cosine of the
    same frequency (MAE / DiT 1-D sin-cos)."""
    c = np.arange(dim)
    freq = 10000.0 ** (-2.0 * (c % (dim // 2)) / dim)
    return np.where(c < dim // 2, np.sin(pos[:, None] * freq), np.cos(pos[:, None] * freq))


def test_fresh_model_tables_and_initialisation():
    torch.manual_seed(0)
    T, size, D = 3, 8, 192
    model = create_model("STDiT-T/2", size, IN_CHANNELS, NUM_CLASSES, num_frames=T)
    assert isinstance(model, STDiT) and isinstance(model, DiT)
    assert not model.pos_embed.requires_grad and not model.pos_embed_temporal.requires_grad
    assert {"pos_embed", "pos_embed_temporal"} <= set(model.state_dict())
    # spatial: token (f, j, k) (frame, row, column) gets [sincos(D/2, k) | sincos(D/2, j)], the same in every frame
    grid = size // 2
    rows, cols = np.divmod(np.arange(grid * grid), grid)
    table = np.concatenate([_sincos_closed_form(D // 2, cols), _sincos_closed_form(D // 2, rows)], axis=1)
    expected = torch.from_numpy(np.tile(table, (T, 1))).float()
    assert model.pos_embed.shape == (1, T * grid * grid, D)
    torch.testing.assert_close(model.pos_embed[0].detach(), expected, rtol=0, atol=1e-6)
    temporal = torch.from_numpy(_sincos_closed_form(D, np.arange(T, dtype=np.float64))).float()
    assert model.pos_embed_temporal.shape == (1, T, D)
    torch.testing.assert_close(model.pos_embed_temporal[0].detach(), temporal, rtol=0, atol=1e-6)
    for block in model.blocks:
        assert isinstance(block, STDiTBlock) and (block.num_frames, block.num_spatial) == (T, grid * grid)
        assert torch.count_nonzero(block.attn_temp.proj.weight) == 0
        assert torch.count_nonzero(block.attn_temp.proj.bias) == 0
        bound = math.sqrt(6 / (D + 3 * D))  # xavier-uniform qkv, as DiT's
        assert 0.9 * bound < block.attn_temp.qkv.weight.abs().max().item() <= bound
        assert torch.count_nonzero(block.adaLN_modulation[-1].weight) == 0
    x = torch.randn(2, IN_CHANNELS, T, size, size)
    with torch.no_grad():
        out = model(x, torch.tensor([0, 999]), torch.tensor([1, NUM_CLASSES]))
    assert out.shape == (2, 2 * IN_CHANNELS, T, size, size) and out.dtype == torch.float32
    assert torch.count_nonzero(out) == 0  # adaLN-Zero + zero output layer


def test_only_the_temporal_attention_carries_frame_0_to_the_last_frame():
    """Changing frame 0 changes the last frame's output with a random temporal projection, and leaves it
    bit-identical with a zero one (spatial attention, MLP, adaLN and the final layer act per frame)."""
    model = create_model("STDiT-T/2", 4, IN_CHANNELS, NUM_CLASSES, num_frames=4).double().eval()
    _randomise_(model, seed=41)
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(2, IN_CHANNELS, 4, 4, 4, generator=gen, dtype=torch.float64)
    t, y, _ = _conditions(2, gen, text=False)
    x2 = x.clone()
    x2[:, :, 0] += torch.randn(x2[:, :, 0].shape, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        last, last2 = model(x, t, y)[:, :, -1], model(x2, t, y)[:, :, -1]
        assert last.abs().max().item() > 1e-2
        assert (last2 - last).abs().max().item() > 1e-3 * last.abs().max().item()
        for block in model.blocks:
            block.attn_temp.proj.weight.zero_()
            block.attn_temp.proj.bias.zero_()
        out, out2 = model(x, t, y), model(x2, t, y)
    assert torch.equal(out[:, :, 1:], out2[:, :, 1:])
    assert not torch.allclose(out[:, :, 0], out2[:, :, 0])


def test_activation_checkpointing_keeps_forward_and_gradients():
    """parallelize's checkpoint wrappers pass the temporal table through to the first block: the same output and
    gradients as the plain model (full and op-level policies; float64, 1e-12)."""
    def run(policy):
        torch.manual_seed(51)
        model = create_model("STDiT-T/2", 4, IN_CHANNELS, NUM_CLASSES, num_frames=3).double()
        _randomise_(model, seed=52, keep=("pos_embed", "pos_embed_temporal"))
        apply_grad_checkpoint(model, policy)
        gen = torch.Generator().manual_seed(53)
        x = torch.randn(2, IN_CHANNELS, 3, 4, 4, generator=gen, dtype=torch.float64)
        t, y, _ = _conditions(2, gen, text=False)
        out = model(x, t, y)
        out.square().mean().backward()
        return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    out, grads = run("none")
    assert grads["blocks.0.attn_temp.proj.weight"].abs().max() > 0
    for policy in ("full", "op"):
        out_p, grads_p = run(policy)
        torch.testing.assert_close(out_p, out, rtol=1e-12, atol=1e-12)
        assert len(grads_p) == len(grads)
        for (name, g), g_p in zip(grads.items(), grads_p.values()):
            torch.testing.assert_close(g_p, g, rtol=1e-12, atol=1e-12, msg=name)


# ---------------------------------------------------------------------------------------------------------------
# Registry, parameter count, FLOPs, bench
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["T", "S", "B", "L", "XL"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_model_spec_matches_dit_sizes(size, p):
    assert model_spec(f"STDiT-{size}/{p}") == {**model_spec(f"DiT-{size}/{p}"), "patch_size": (1, p, p)}
    assert is_video_model(f"STDiT-{size}/{p}")


@pytest.mark.parametrize("name", ["STDiT-XL/3", "STDiT-XL/22", "STDiT-XL/122", "STDiT-XXL/2", "stdit-XL/2",
                                  "STDIT-XL/2", "STDiT/2", "STDiT-XL/", "STDiT-XL/16", " STDiT-XL/2"])
def test_unknown_names_raise_user_error(name):
    with pytest.raises(UserError) as info:
        create_model(name, 32, 4, 10, num_frames=16)
    message = str(info.value)
    assert message.startswith("--model") and repr(name) in message
    assert STDIT_MODEL_PATTERN in message and VIDEO_MODEL_PATTERN in message and MODEL_NAMES[0] in message
    with pytest.raises(UserError):
        is_video_model(name)


@pytest.mark.parametrize("num_frames", [None, 0, -3])
def test_bad_num_frames_raise_user_error(num_frames):
    with torch.device("meta"), pytest.raises(UserError) as info:
        create_model("STDiT-S/2", 8, 4, 10, num_frames=num_frames)
    assert str(info.value).startswith("--num_frames") and "STDiT-S/2" in str(info.value)


def test_any_positive_frame_count_and_other_errors():
    with torch.device("meta"):
        for frames in (1, 5, 7):  # temporal patch 1: any count
            model = create_model("STDiT-S/4", 8, 4, 10, num_frames=frames)
            assert model.x_embedder.grid_shape == (frames, 2, 2) and model.pos_embed_temporal.shape == (1, frames, 384)
    with pytest.raises(UserError, match="--image_size: input size 18 is not divisible by the patch size of STDiT-B/4"):
        create_model("STDiT-B/4", 18, 4, 10, num_frames=4)
    with pytest.raises(UserError, match="--num_frames: DiT-S/2 is an image model") as info:
        create_model("DiT-S/2", 8, 4, 10, num_frames=16)
    assert STDIT_MODEL_PATTERN in str(info.value)


def test_infer_dit_config_rejects_stdit_state_dict():
    with torch.device("meta"):
        state = create_model("STDiT-T/2", 8, 4, 10, num_frames=4).state_dict()
    with pytest.raises(UserError, match=r"--ckpt: a video \(STDiT\) state dict"):
        infer_dit_config(state)


def test_stdit_xl_2_parameter_count_on_meta_device():
    """DiT-XL/2 (4 channels, 1000 classes, 32x32 latents, learned sigma) in closed form, checked against the
    built DiT; STDiT-XL/2 adds 28 temporal attentions (qkv 3D^2 + 3D, proj D^2 + D) of trainable parameters and
    the larger frozen tables."""
    D, L, C, p, C_out, T, S = 1152, 28, 4, 2, 8, 16, 256
    dit_trainable = ((D * C * p * p + D) + (256 * D + D + D * D + D) + 1001 * D  # patch, timestep, label embedders
                     + L * ((3 * D * D + 3 * D) + (D * D + D) + (D * 4 * D + 4 * D) + (4 * D * D + D)
                            + (D * 6 * D + 6 * D))  # attention, MLP, adaLN
                     + (D * p * p * C_out + p * p * C_out) + (D * 2 * D + 2 * D))  # final layer
    with torch.device("meta"):
        dit = create_model("DiT-XL/2", 32, C, 1000)
        model = create_model("STDiT-XL/2", 32, C, 1000, num_frames=T)

    def count(m, trainable):
        return sum(q.numel() for q in m.parameters() if q.requires_grad == trainable)

    assert count(dit, True) == dit_trainable
    assert count(model, True) == dit_trainable + L * (4 * D * D + 4 * D) == 823_599_392
    assert count(model, False) == T * S * D + T * D  # pos_embed, pos_embed_temporal
    assert model.x_embedder.proj.weight.shape == (D, C, 1, p, p) and model.pos_embed.shape == (1, T * S, D)
    x = torch.empty(2, C, T, 32, 32, device="meta")
    t = torch.empty(2, dtype=torch.int64, device="meta")
    assert model.eval()(x, t, t).shape == (2, C_out, T, 32, 32)


def test_flops_stdit_xl_2_closed_form():
    with torch.device("meta"):
        model = create_model("STDiT-XL/2", 32, 4, 1000, num_frames=16)
    D, L, C, C_out, P, T, S = 1152, 28, 4, 8, 4, 16, 256
    N = T * S
    per_block = (24 * N * D**2  # qkv, proj, MLP
                 + 8 * N * D**2  # temporal qkv and proj
                 + 4 * T * S**2 * D + 4 * S * T**2 * D  # spatial and temporal q k^T and attention x v
                 + 12 * D**2)  # adaLN
    expected = L * per_block + 2 * N * P * C * D + 2 * (256 * D + D**2) + 2 * N * D * P * C_out + 4 * D**2
    assert model.flops_per_sample() == expected == 5_015_147_544_576  # the value in the docstring


@pytest.mark.parametrize("text", [False, True], ids=["class", "text"])
def test_flops_equal_pytorch_flop_counter(text):
    """FlopCounterMode sees the matrix products, the convolution and (math backend) attention as batched
    matrix products; a multiply-add counts 2. Non-square attention counts: T = 3 frames of S = 16 tokens."""
    kw = {"text_dim": TEXT_DIM} if text else {}
    model = create_model("STDiT-T/2", 8, IN_CHANNELS, NUM_CLASSES, num_frames=3, **kw)
    gen = torch.Generator().manual_seed(61)
    x = torch.randn(2, IN_CHANNELS, 3, 8, 8, generator=gen)
    t, y, kwargs = _conditions(2, gen, text, torch.float32)
    try:
        set_attention_backend("math")
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(x, t, y, **kwargs)
    finally:
        set_attention_backend()
    assert counter.get_total_flops() == 2 * model.flops_per_sample(text_tokens=5 if text else 0)


def test_bench_trains_stdit_on_cpu(tmp_path, capsys):
    argv = ["bench", "--model", "STDiT-T/2", "--device", "cpu", "--image_size", "16", "--vae_downsample", "1",
            "--in_channels", "3", "--num_frames", "4", "--batch_size", "2", "--steps", "1", "--warmup", "0",
            "--rows", "a", "--outputs", str(tmp_path)]
    assert cli.main(argv) == 0
    [path] = tmp_path.glob("bench-STDiT-T-2-*.json")
    [row] = json.loads(path.read_text())["rows"]
    assert row["status"] == "ok" and all(math.isfinite(v) for v in row["losses"])
    assert row["tokens_per_sec"] == pytest.approx(4 * 8 * 8 * row["images_per_sec"])  # 4 frames x 8 x 8 tokens
    assert "| a |" in capsys.readouterr().out
