"""vDiT (ditforge.models.video.VideoDiT) and its layers, against independent references.

* ``sincos_3d`` against the closed form written out here in float64 numpy (not through ``sincos_1d``).
* ``PatchEmbed3D`` against an explicit reshape + matmul with the same weights (float64), and ``unpatchify``
  against a token layout built element by element with index arithmetic.
* Equivalence with the image DiT: one frame with (1, p, p) patches and the same weights gives DiT's output. The
  3-D position embedding does NOT reduce to the 2-D one for one frame (its D/4 time channels are
  [sin 0, cos 0] = [0, 1] and the spatial channels use 3D/4 of the width), so the test copies DiT's position
  embedding into the vDiT; the test then checks that blocks, conditioning and unpatchify are shared correctly.
* Temporal mixing: full spatio-temporal attention makes the last frame's output depend on frame 0.
* Registry: names, errors naming the flag, XL on the meta device, FLOPs against the closed form.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from ditforge.errors import UserError
from ditforge.models import (
    MODEL_NAMES,
    VIDEO_MODEL_PATTERN,
    DiT,
    VideoDiT,
    create_model,
    infer_dit_config,
    is_video_model,
    model_spec,
)
from ditforge.models.layers import PatchEmbed3D, sincos_2d, sincos_3d, unpatchify

IN_CHANNELS = 4
NUM_CLASSES = 10


pytestmark = pytest.mark.usefixtures("one_thread_module")


@torch.no_grad()
def _randomise_(model: torch.nn.Module, seed: int) -> None:
    """Every parameter (adaLN-Zero and final layer included) ~ N(0, 1/fan_in) for weights, N(0, 0.1^2) for
    vectors, N(0, 0.5^2) for pos_embed, so the zero initialisation cannot make a comparison trivial."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        std = 0.5 if name == "pos_embed" else (1.0 / math.sqrt(p[0].numel()) if p.dim() >= 2 else 0.1)
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)


def _labels(batch: int, gen: torch.Generator):
    t = torch.randint(0, 1000, (batch,), generator=gen, dtype=torch.int64)
    y = torch.randint(0, NUM_CLASSES, (batch,), generator=gen, dtype=torch.int64)
    y[-1] = NUM_CLASSES  # null label
    return t, y


def _assert_close_rel(actual, expected, rel):
    """|a - e| <= rel * |e| + rel * max|e|, on a non-trivial reference."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = expected.abs().max().item()
    assert scale > 1e-2, "reference output is (near) zero: the comparison would be trivial"
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


# ---------------------------------------------------------------------------------------------------------------
# 3-D sin-cos position embedding
# ---------------------------------------------------------------------------------------------------------------


def _sincos_3d_closed_form(dim: int, grid: tuple[int, int, int]) -> np.ndarray:
    """float64 (T'H'W', D): token (i, j, k) (frame, row, column), channels [time D/4 | width 3D/8 | height 3D/8].

    Within a part of width d at position pos, channel c < d/2 is sin(pos * 10000^(-2c/d)) and channel c >= d/2
    is cos(pos * 10000^(-2(c - d/2)/d)) (MAE / DiT 1-D sin-cos).
    """
    d_t, d_s = dim // 4, 3 * dim // 8
    out = np.empty((math.prod(grid), dim))
    for n, (i, j, k) in enumerate(itertools.product(*(range(g) for g in grid))):
        for offset, d, pos in ((0, d_t, i), (d_t, d_s, k), (d_t + d_s, d_s, j)):
            c = np.arange(d)
            freq = 10000.0 ** (-2.0 * (c % (d // 2)) / d)
            out[n, offset:offset + d] = np.where(c < d // 2, np.sin(pos * freq), np.cos(pos * freq))
    return out


@pytest.mark.parametrize("dim,grid", [(64, (3, 4, 5)), (192, (4, 2, 2)), (1152, (2, 3, 3)), (16, (1, 1, 7)),
                                      (384, (1, 4, 4))])
def test_sincos_3d_matches_closed_form(dim, grid):
    actual = sincos_3d(dim, grid)
    assert actual.shape == (math.prod(grid), dim) and actual.dtype == torch.float32
    expected = torch.from_numpy(_sincos_3d_closed_form(dim, grid)).float()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)  # float64 math rounded to float32 (~6e-8)
    # a spot check with math alone: last token, first height channel = sin(row index * 1)
    assert actual[-1, dim // 4 + 3 * dim // 8].item() == pytest.approx(math.sin(grid[1] - 1), abs=1e-6)


def test_sincos_3d_spatial_part_is_opendit_layout():
    """The 3D/4 spatial channels of a square grid are MAE's 2-D embedding of that width, repeated per frame; the
    D/4 time channels are constant within a frame and differ between frames."""
    dim, grid = 192, (3, 4, 4)
    emb = sincos_3d(dim, grid).reshape(3, 16, dim)
    for i in range(3):
        torch.testing.assert_close(emb[i, :, dim // 4:], sincos_2d(3 * dim // 4, 4), rtol=0, atol=0)
        assert torch.equal(emb[i, :, : dim // 4], emb[i, :1, : dim // 4].expand(16, -1))
    assert not torch.allclose(emb[0, 0, : dim // 4], emb[1, 0, : dim // 4])
    assert torch.unique(emb.reshape(-1, dim), dim=0).shape[0] == 48  # every token distinct


@pytest.mark.parametrize("dim", [8, 24, 100, 1160])
def test_sincos_3d_rejects_widths_not_multiple_of_16(dim):
    with pytest.raises(ValueError, match="multiple of 16"):
        sincos_3d(dim, (2, 2, 2))


def test_sincos_3d_rejects_bad_grid():
    with pytest.raises(ValueError, match="grid"):
        sincos_3d(64, (2, 2))
    with pytest.raises(ValueError, match="grid"):
        sincos_3d(64, (0, 2, 2))


# ---------------------------------------------------------------------------------------------------------------
# Patch embedding and unpatchify
# ---------------------------------------------------------------------------------------------------------------


def _tiny_video_dit(*, num_frames, input_size, patch_size, in_channels=IN_CHANNELS, learn_sigma=True,
                    hidden_size=32, depth=2, num_heads=2):
    return VideoDiT(input_size=input_size, num_frames=num_frames, patch_size=patch_size, in_channels=in_channels,
                    hidden_size=hidden_size, depth=depth, num_heads=num_heads, num_classes=NUM_CLASSES,
                    learn_sigma=learn_sigma)


def _reference_tokens(video: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """(B, C, T, H, W) -> (B, N, t h w C), element by element (see the test below for the layout)."""
    B, C, T, H, W = video.shape
    t, h, w = patch
    Tg, Hg, Wg = T // t, H // h, W // w
    tokens = torch.empty(B, Tg * Hg * Wg, t * h * w * C)
    for i, j, k, dt, dh, dw, c in itertools.product(range(Tg), range(Hg), range(Wg), range(t), range(h), range(w),
                                                     range(C)):
        tokens[:, (i * Hg + j) * Wg + k, ((dt * h + dh) * w + dw) * C + c] = video[:, c, i * t + dt, j * h + dh,
                                                                                   k * w + dw]
    return tokens


@pytest.mark.parametrize("patch", [(2, 2, 3), (1, 2, 2), (4, 1, 2)])
def test_unpatchify_inverts_the_token_layout(patch):
    """Tokens laid out element by element: token (i H' + j) W' + k, value ((dt h + dh) w + dw) C + c holds
    video[c, i t + dt, j h + dh, k w + dw]. layers.unpatchify must give the video back exactly (non-square
    frames here; the model's own unpatchify is tested below)."""
    B, C, T, H, W = 2, 3, 4, 4, 6
    t, h, w = patch
    gen = torch.Generator().manual_seed(sum(patch))
    video = torch.randn(B, C, T, H, W, generator=gen)
    assert torch.equal(unpatchify(_reference_tokens(video, patch), (T // t, H // h, W // w), patch, C), video)


def test_model_unpatchify_inverts_the_token_layout():
    """The same through VideoDiT.unpatchify (square frames, C_out = C without learned sigma)."""
    B, C, T, S, patch = 2, 3, 4, 6, (2, 3, 1)
    model = _tiny_video_dit(num_frames=T, input_size=S, patch_size=patch, in_channels=C, learn_sigma=False)
    video = torch.randn(B, C, T, S, S, generator=torch.Generator().manual_seed(5))
    tokens = _reference_tokens(video, patch)
    assert torch.equal(model.unpatchify(tokens), video)
    with pytest.raises(ValueError, match="do not match"):
        model.unpatchify(tokens[:, :-1])


@pytest.mark.parametrize("patch", [(2, 2, 2), (1, 2, 4), (4, 1, 1)])
def test_patch_embed_3d_equals_reshape_matmul(patch):
    """Conv3d with kernel = stride = patch == explicit patch extraction + matmul, float64, row-major tokens."""
    B, C, D, size = 2, 3, 16, (4, 8, 4)
    embed = PatchEmbed3D(size, patch, C, D).double()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        embed.proj.weight.copy_(torch.randn(embed.proj.weight.shape, generator=gen, dtype=torch.float64))
        embed.proj.bias.copy_(torch.randn(D, generator=gen, dtype=torch.float64))
    x = torch.randn(B, C, *size, generator=gen, dtype=torch.float64)
    (t, h, w), (T, H, W) = patch, size
    Tg, Hg, Wg = T // t, H // h, W // w
    # (B, C, Tg, t, Hg, h, Wg, w) -> (B, Tg, Hg, Wg, C, t, h, w): a patch flattened in the weight's (C, t, h, w) order
    patches = x.reshape(B, C, Tg, t, Hg, h, Wg, w).permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(B, Tg * Hg * Wg, -1)
    expected = patches @ embed.proj.weight.reshape(D, -1).T + embed.proj.bias
    with torch.no_grad():
        actual = embed(x)
    assert embed.grid_shape == (Tg, Hg, Wg) and embed.num_patches == Tg * Hg * Wg
    _assert_close_rel(actual, expected, 1e-12)  # float64, different summation order only


def test_patch_embed_3d_rejects_indivisible_sizes():
    with pytest.raises(ValueError, match="frames 5"):
        PatchEmbed3D((5, 8, 8), (2, 2, 2), 4, 16)
    with pytest.raises(ValueError, match="width 6"):
        PatchEmbed3D((4, 8, 6), (2, 2, 4), 4, 16)


# ---------------------------------------------------------------------------------------------------------------
# Forward: equivalence with DiT, temporal mixing, initialisation, label dropout
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("learn_sigma", [True, False])
def test_one_frame_vdit_equals_dit_with_the_same_weights(learn_sigma):
    """vDiT-T/1pp on T = 1 frame == DiT-T/p with Conv3d weight = Conv2d weight[:, :, None], float64.

    The position embedding is copied from DiT (sincos_3d for one frame is not sincos_2d; see the module
    docstring), so this checks the shared blocks, conditioning, final layer and unpatchify."""
    size = 8
    dit = create_model("DiT-T/2", size, IN_CHANNELS, NUM_CLASSES, learn_sigma=learn_sigma).double().eval()
    vdit = create_model("vDiT-T/122", size, IN_CHANNELS, NUM_CLASSES, learn_sigma=learn_sigma,
                        num_frames=1).double().eval()
    _randomise_(dit, seed=21)
    state = dict(dit.state_dict())
    assert set(state) == set(vdit.state_dict())  # same keys
    state["x_embedder.proj.weight"] = state["x_embedder.proj.weight"][:, :, None]
    vdit.load_state_dict(state, strict=True)  # pos_embed included: copied from DiT
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(3, IN_CHANNELS, size, size, generator=gen, dtype=torch.float64)
    t, y = _labels(3, gen)
    with torch.no_grad():
        expected = dit(x, t, y)
        actual = vdit(x[:, :, None], t, y)
    assert actual.shape == (3, dit.out_channels, 1, size, size)
    _assert_close_rel(actual[:, :, 0], expected, 1e-10)  # float64; Conv3d vs Conv2d summation order only


def test_last_frame_depends_on_first_frame():
    """Full spatio-temporal attention: changing frame 0 changes the output at the last frame (float64, adaLN
    randomised). Frame-local attention would leave the last frame bit-identical."""
    model = create_model("vDiT-T/122", 4, IN_CHANNELS, NUM_CLASSES, num_frames=4).double().eval()
    _randomise_(model, seed=31)
    gen = torch.Generator().manual_seed(32)
    x = torch.randn(2, IN_CHANNELS, 4, 4, 4, generator=gen, dtype=torch.float64)
    t, y = _labels(2, gen)
    x2 = x.clone()
    x2[:, :, 0] += torch.randn(x2[:, :, 0].shape, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        out, out2 = model(x, t, y), model(x2, t, y)
    scale = out[:, :, -1].abs().max().item()
    assert scale > 1e-2
    assert (out2[:, :, -1] - out[:, :, -1]).abs().max().item() > 1e-3 * scale
    # and a temporal patch (t = 2) mixes within and across tubelets too
    model2 = create_model("vDiT-T/222", 4, IN_CHANNELS, NUM_CLASSES, num_frames=4).double().eval()
    _randomise_(model2, seed=33)
    with torch.no_grad():
        last, last2 = model2(x, t, y)[:, :, -1], model2(x2, t, y)[:, :, -1]
    assert (last2 - last).abs().max().item() > 1e-3 * last.abs().max().item()


def test_fresh_model_initialisation():
    torch.manual_seed(0)
    model = create_model("vDiT-T/222", 8, IN_CHANNELS, NUM_CLASSES, num_frames=4)
    assert model.pos_embed.shape == (1, 2 * 4 * 4, 192) and not model.pos_embed.requires_grad
    torch.testing.assert_close(model.pos_embed[0].detach(), sincos_3d(192, (2, 4, 4)), rtol=0, atol=0)
    torch.testing.assert_close(model.pos_embed[0].detach().double(),
                               torch.from_numpy(_sincos_3d_closed_form(192, (2, 4, 4))), rtol=0, atol=1e-6)
    for block in model.blocks:
        assert torch.count_nonzero(block.adaLN_modulation[-1].weight) == 0
    w = model.x_embedder.proj.weight
    assert w.shape == (192, IN_CHANNELS, 2, 2, 2)
    bound = math.sqrt(6 / (IN_CHANNELS * 8 + 192))  # xavier-uniform on the flattened (D, C t h w) matrix
    assert 0.9 * bound < w.abs().max().item() <= bound
    x = torch.randn(2, IN_CHANNELS, 4, 8, 8)
    with torch.no_grad():
        out = model(x, torch.tensor([0, 999]), torch.tensor([1, NUM_CLASSES]))
    assert out.shape == (2, 2 * IN_CHANNELS, 4, 8, 8) and out.dtype == torch.float32
    assert torch.count_nonzero(out) == 0  # adaLN-Zero + zero output layer


def test_force_drop_ids_uses_the_null_label():
    model = create_model("vDiT-T/222", 4, IN_CHANNELS, NUM_CLASSES, num_frames=2).eval()
    _randomise_(model, seed=41)
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(3, IN_CHANNELS, 2, 4, 4, generator=gen)
    t = torch.tensor([5, 500, 900])
    y = torch.tensor([1, 2, 3])
    drop = torch.tensor([True, False, True])
    with torch.no_grad():
        out = model(x, t, y, force_drop_ids=drop)
        assert torch.equal(out, model(x, t, torch.where(drop, NUM_CLASSES, y)))
        assert not torch.allclose(out[0], model(x, t, y)[0])


# ---------------------------------------------------------------------------------------------------------------
# Registry and FLOPs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["T", "S", "B", "L", "XL"])
def test_model_spec_matches_dit_sizes(size):
    spec = model_spec(f"vDiT-{size}/248")
    dit = model_spec(f"DiT-{size}/2")
    assert spec == {**dit, "patch_size": (2, 4, 8)}
    assert is_video_model(f"vDiT-{size}/248") and not is_video_model(f"DiT-{size}/2")


def test_vdit_xl_222_on_meta_device():
    with torch.device("meta"):
        model = create_model("vDiT-XL/222", 32, 4, 1000, num_frames=16)
    assert isinstance(model, VideoDiT) and isinstance(model, DiT)
    assert (len(model.blocks), model.pos_embed.shape[-1], model.num_heads) == (28, 1152, 16)
    assert model.x_embedder.proj.weight.shape == (1152, 4, 2, 2, 2)
    assert model.pos_embed.shape == (1, 2048, 1152)
    assert model.final_layer.linear.out_features == 2 * 2 * 2 * 8
    x = torch.empty(2, 4, 16, 32, 32, device="meta")
    t = torch.empty(2, dtype=torch.int64, device="meta")
    assert model.eval()(x, t, t).shape == (2, 8, 16, 32, 32)


def test_flops_vdit_xl_222_closed_form():
    with torch.device("meta"):
        model = create_model("vDiT-XL/222", 32, 4, 1000, num_frames=16)
    D, L, C, C_out, P = 1152, 28, 4, 8, 2 * 2 * 2
    N = (16 // 2) * (32 // 2) * (32 // 2)
    assert N == 2048
    expected = (L * (24 * N * D**2 + 4 * N**2 * D + 12 * D**2)  # qkv+proj+MLP, attention, adaLN
                + 2 * N * P * C * D + 2 * (256 * D + D**2)  # 3-D patch embedding, timestep MLP
                + 2 * N * D * P * C_out + 4 * D**2)  # final layer and its adaLN
    assert model.flops_per_sample() == expected == 2_368_508_166_144  # the value in the docstrings


@pytest.mark.parametrize("name", ["vDiT-XL/22", "vDiT-XL/2222", "vDiT-XL/322", "vDiT-XXL/222", "vdit-XL/222",
                                  "VDiT-XL/222", "vDiT-XL/2x2x2", "vDiT-XL/1_2_2", "vDiT/222"])
def test_unknown_video_names_raise_user_error(name):
    with pytest.raises(UserError) as info:
        create_model(name, 32, 4, 10, num_frames=16)
    assert repr(name) in str(info.value) and "--model" in str(info.value)
    assert VIDEO_MODEL_PATTERN in str(info.value) and MODEL_NAMES[0] in str(info.value)
    with pytest.raises(UserError):
        is_video_model(name)


@pytest.mark.parametrize("num_frames", [None, 15, 0, -4])
def test_bad_num_frames_raise_user_error(num_frames):
    with torch.device("meta"), pytest.raises(UserError) as info:
        create_model("vDiT-XL/222", 32, 4, 10, num_frames=num_frames)
    assert str(info.value).startswith("--num_frames") and "vDiT-XL/222" in str(info.value)
    if num_frames is not None:
        assert str(num_frames) in str(info.value)


def test_num_frames_must_divide_by_the_temporal_patch_only():
    with torch.device("meta"):
        create_model("vDiT-S/411", 8, 4, 10, num_frames=12)  # 12 % 4 == 0: fine
        create_model("vDiT-S/144", 8, 4, 10, num_frames=3)  # t = 1: any frame count
    with pytest.raises(UserError, match="--num_frames: 6 frames"):
        create_model("vDiT-S/411", 8, 4, 10, num_frames=6)


@pytest.mark.parametrize("name,size", [("vDiT-S/144", 18), ("vDiT-XL/282", 20), ("vDiT-B/228", 12)])
def test_indivisible_image_size_raises_user_error(name, size):
    with torch.device("meta"), pytest.raises(UserError) as info:
        create_model(name, size, 4, 10, num_frames=8)
    assert str(info.value).startswith("--image_size") and str(size) in str(info.value) and name in str(info.value)


def test_image_model_rejects_num_frames():
    with pytest.raises(UserError, match="--num_frames: DiT-S/2 is an image model"):
        create_model("DiT-S/2", 8, 4, 10, num_frames=16)


def test_infer_dit_config_rejects_video_state_dict():
    with torch.device("meta"):
        state = create_model("vDiT-T/222", 8, 4, 10, num_frames=4).state_dict()
    with pytest.raises(UserError, match="--ckpt: a video"):
        infer_dit_config(state)
