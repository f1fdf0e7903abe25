"""Variable shapes: DiT, vDiT and STDiT run on any size the patch divides.

* At the configured size the output is bit-identical to the stored-table path (``x_embedder(x) + pos_embed``,
  the tables as a checkpoint holds them, here randomised so a recomputed sin-cos table would differ).
* A model built for size A run on size B equals a model built for size B with the same weights (all but the
  fixed position tables, which each model makes for its own grid): exactly, float32.
* Rectangular grids take the MAE / DiT sin-cos formula per axis (the official numpy code, fed a (H', W') grid).
* An image in a vDiT with temporal patch t > 1: the frame repeated t times, the mean of the t output frames.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ditforge.models import DiT, STDiT, VideoDiT
from ditforge.models.layers import sincos_2d, unpatchify
from tests.models.official_reference import get_2d_sincos_pos_embed_from_grid

pytestmark = pytest.mark.usefixtures("one_thread_module")

TINY = dict(in_channels=4, hidden_size=64, depth=2, num_heads=4, num_classes=10, learn_sigma=True)
FIXED = ("pos_embed", "pos_embed_temporal")


def _build(kind: str, size: int, frames: int | None = None, patch=None) -> torch.nn.Module:
    if kind == "dit":
        return DiT(input_size=size, patch_size=patch or 2, **TINY)
    cls = VideoDiT if kind == "vdit" else STDiT
    return cls(input_size=size, num_frames=frames, patch_size=patch or ((2, 2, 2) if kind == "vdit" else 2), **TINY)


@torch.no_grad()
def _randomise_(model: torch.nn.Module, seed: int, tables: bool) -> None:
    """Every weight ~ N(0, 1/fan_in) (vectors N(0, 0.1^2)), so adaLN-Zero cannot make outputs trivial; the fixed
    position tables too (N(0, 0.5^2)) when ``tables``, else they keep their sin-cos values."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name in FIXED and not tables:
            continue
        std = 0.5 if name in FIXED else (1.0 / math.sqrt(p[0].numel()) if p.dim() >= 2 else 0.1)
        p.copy_(torch.randn(p.shape, generator=gen) * std)


def _inputs(shape: tuple[int, ...], seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    t = torch.randint(0, 1000, (shape[0],), generator=gen)
    y = torch.randint(0, TINY["num_classes"] + 1, (shape[0],), generator=gen)
    return x, t, y


@torch.no_grad()
def _stored_table_path(model, x, t, y):
    """The forward as it was before variable shapes: the stored tables and the configured grid."""
    h = model.x_embedder(x) + model.pos_embed
    c, context = model.embed_conditions(t, y)
    for i, block in enumerate(model.blocks):
        h = block(h, c, context, model.pos_embed_temporal if i == 0 else None) if isinstance(model, STDiT) \
            else block(h, c, context)
    return model.unpatchify(model.final_layer(h, c))


@pytest.mark.parametrize("kind,size,frames", [("dit", 8, None), ("vdit", 8, 4), ("stdit", 8, 3)])
def test_configured_size_uses_the_stored_tables(kind, size, frames):
    model = _build(kind, size, frames).eval()
    _randomise_(model, 0, tables=True)
    x, t, y = _inputs((3, 4, *([frames] if frames else []), size, size), 1)
    with torch.no_grad():
        out = model(x, t, y)
    assert torch.equal(out, _stored_table_path(model, x, t, y))


@pytest.mark.parametrize("kind,a,b", [
    ("dit", (None, 8), (None, 12)),
    ("dit", (None, 12), (None, 4)),
    ("vdit", (4, 8), (2, 12)),
    ("vdit", (2, 8), (6, 4)),
    ("stdit", (4, 8), (2, 12)),
    ("stdit", (2, 4), (5, 8)),
])
def test_model_for_size_a_on_size_b_equals_model_for_size_b(kind, a, b):
    model_a, model_b = _build(kind, a[1], a[0]).eval(), _build(kind, b[1], b[0]).eval()
    _randomise_(model_a, 2, tables=False)
    state = {k: v for k, v in model_a.state_dict().items() if k not in FIXED}
    assert not model_b.load_state_dict(state, strict=False).unexpected_keys
    x, t, y = _inputs((2, 4, *([b[0]] if b[0] else []), b[1], b[1]), 3)
    with torch.no_grad():
        out_a, out_b = model_a(x, t, y), model_b(x, t, y)
    assert out_a.shape == (2, 8, *x.shape[2:]) and out_b.abs().max() > 0.1
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    assert model_a.flops_per_sample(grid=model_b.x_embedder.grid_shape) == model_b.flops_per_sample()
    # the cached table is reused, not recomputed, on the next call
    with torch.no_grad():
        assert torch.equal(model_a(x, t, y), out_a)
    assert len(model_a._pos_cache) == (2 if kind == "stdit" and a[0] != b[0] else 1)


@pytest.mark.parametrize("grid", [(3, 5), (4, 2), (1, 6)])
def test_rectangular_sincos_is_mae_formula_per_axis(grid):
    h, w = grid
    mesh = np.stack(np.meshgrid(np.arange(w, dtype=np.float64), np.arange(h, dtype=np.float64)), axis=0)  # w first
    expected = torch.from_numpy(get_2d_sincos_pos_embed_from_grid(64, mesh.reshape(2, 1, h, w))).float()
    torch.testing.assert_close(sincos_2d(64, grid), expected, rtol=0, atol=1e-6)


def test_rectangular_dit_uses_its_grid():
    """A (6, 10) input: tokens in row-major (3, 5) order with the (3, 5) sin-cos table, unpatchified to (6, 10)."""
    model = _build("dit", 8).eval()
    _randomise_(model, 4, tables=False)
    x, t, y = _inputs((2, 4, 6, 10), 5)
    with torch.no_grad():
        h = model.x_embedder(x) + sincos_2d(64, (3, 5))
        c, _ = model.embed_conditions(t, y)
        for block in model.blocks:
            h = block(h, c)
        expected = unpatchify(model.final_layer(h, c), (3, 5), (2, 2), 8)
        torch.testing.assert_close(model(x, t, y), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="input width 9 is not divisible by patch size 2"):
        model(x[..., :9], t, y)


def test_image_in_vdit_with_temporal_patch_is_the_mean_of_its_repeated_frame():
    model = _build("vdit", 8, 4).eval()
    _randomise_(model, 6, tables=False)
    x, t, y = _inputs((2, 4, 1, 8, 8), 7)
    with torch.no_grad():
        out = model(x, t, y)
        twice = model(x.repeat(1, 1, 2, 1, 1), t, y)
    assert out.shape == (2, 8, 1, 8, 8)
    torch.testing.assert_close(out, twice.mean(2, keepdim=True), rtol=1e-6, atol=1e-6)
    assert (twice[:, :, 0] - twice[:, :, 1]).abs().max() > 1e-3  # the two copies' outputs differ: the mean matters
    with pytest.raises(ValueError, match="input frames 3 is not divisible by patch size 2"):
        model(x.repeat(1, 1, 3, 1, 1), t, y)
