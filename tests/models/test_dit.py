"""DiT (ditforge.models) against an independent re-implementation of the official facebookresearch/DiT code.

The oracle is ``tests/models/official_reference.py`` (official ``models.py`` structure and math, timm-named
stand-ins for ``Attention``/``Mlp``/``PatchEmbed``, explicit softmax attention). The contract under test:
state-dict keys, shapes and semantics equal the official layout, so official checkpoints load with
``strict=True`` and give the same outputs.

Big configs (B, L, XL) are checked for keys, shapes and output shapes on the ``meta`` device (no memory, no
math); forward equality runs on the small ones (S and the tiny T), with all parameters re-randomised so that
the zero-initialised adaLN and output layers do not make the comparison trivial.
"""

from __future__ import annotations

import math

import pytest
import torch

from ditforge.errors import UserError
from ditforge.models import MODEL_NAMES, create_model
from ditforge.models.layers import sincos_2d, timestep_embedding
from official_reference import (  # tests/models is on sys.path (rootdir-relative "prepend" import mode)
    OFFICIAL_NAMES,
    TimestepEmbedder as RefTimestepEmbedder,
    get_2d_sincos_pos_embed,
    reference_dit,
)

IN_CHANNELS = 4
NUM_CLASSES = 10
INPUT_SIZE = 16  # meta-device layout tests: grid 8x8 (patch 2), 4x4 (patch 4), 2x2 (patch 8)

# Small configs where a real forward pass is cheap on 2 CPU cores (S: 33M params at most; T: 4M).
SMALL_NAMES = ["DiT-S/2", "DiT-S/4", "DiT-S/8", "DiT-T/1", "DiT-T/2", "DiT-T/4", "DiT-T/8"]


pytestmark = pytest.mark.usefixtures("one_thread_module")


def _input_size(name: str) -> int:
    """Input size for real forward passes: 16 tokens for patch 1, 2, 4 and 4 tokens for patch 8 (speed)."""
    return {1: 4, 2: 8, 4: 16, 8: 16}[int(name.rsplit("/", 1)[1])]


def _pair(name, *, learn_sigma=True, class_dropout_prob=0.1, input_size=None):
    """(ditforge model, reference model) for the same config, each freshly initialised."""
    size = input_size or _input_size(name)
    ours = create_model(name, size, IN_CHANNELS, NUM_CLASSES, learn_sigma=learn_sigma,
                        class_dropout_prob=class_dropout_prob)
    ref = reference_dit(name, input_size=size, in_channels=IN_CHANNELS, num_classes=NUM_CLASSES,
                        learn_sigma=learn_sigma, class_dropout_prob=class_dropout_prob)
    return ours, ref


@torch.no_grad()
def _randomise_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite EVERY parameter (adaLN-Zero and final layer included, and pos_embed) with fresh random values.

    Weights ~ N(0, 1/fan_in) so activations stay O(1) through the depth; biases ~ N(0, 0.1^2);
    pos_embed ~ N(0, 0.5^2); the label table ~ N(0, 1/D).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name == "pos_embed":
            std = 0.5
        elif p.dim() >= 2:
            std = 1.0 / math.sqrt(p[0].numel())
        else:
            std = 0.1
        p.normal_(0.0, std, generator=gen)


def _uninitialised_pair(name, dtype, **kwargs):
    """(ditforge, reference) built on the meta device and materialised uninitialised on the CPU in ``dtype``.

    Skips both initialisations (the caller overwrites every parameter), which dominates the run time for S.
    """
    with torch.device("meta"):
        ours, ref = _pair(name, **kwargs)
    return ours.to(dtype).to_empty(device="cpu"), ref.to(dtype).to_empty(device="cpu")


def _inputs(name, batch=4, seed=0, dtype=torch.float32):
    """x (B, C, H, W), t (B,) int64 incl. 0 and 999, y (B,) int64 incl. the null label NUM_CLASSES."""
    gen = torch.Generator().manual_seed(seed)
    size = _input_size(name)
    x = torch.randn(batch, IN_CHANNELS, size, size, generator=gen, dtype=dtype)
    t = torch.randint(0, 1000, (batch,), generator=gen, dtype=torch.int64)
    t[0], t[1] = 0, 999
    y = torch.randint(0, NUM_CLASSES, (batch,), generator=gen, dtype=torch.int64)
    y[-1] = NUM_CLASSES  # null (unconditional) label
    return x, t, y


def _assert_close_rel(actual, expected, rel):
    """Elementwise |a - e| <= rel * |e| + rel * max|e| (relative, with a floor at rel times the output scale)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = expected.abs().max().item()
    assert scale > 1e-2, "reference output is (near) zero: the comparison would be trivial"
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


@pytest.fixture(scope="module")
def randomised_pair():
    """``get(name, dtype)`` -> (ditforge, reference) in eval mode, in ``dtype``, holding the same random weights.

    The reference is randomised in float64 and its state dict is loaded into ditforge's model with
    ``strict=True``; the float32 pair holds the float64 values rounded to float32 (load_state_dict casts).
    Pairs are cached for the module (an S pair in float64 is ~0.5 GB) and freed at its end.
    """
    cache: dict[tuple, tuple] = {}

    def get(name, dtype):
        key = (name, dtype)
        if key not in cache:
            ours, ref = _uninitialised_pair(name, dtype)
            if dtype == torch.float64:
                _randomise_(ref, seed=sum(map(ord, name)))
            else:
                ref.load_state_dict(get(name, torch.float64)[1].state_dict(), strict=True)
            ours.load_state_dict(ref.state_dict(), strict=True)
            assert all(p.dtype == dtype for p in [*ours.parameters(), *ref.parameters()])
            cache[key] = (ours.eval(), ref.eval())
        return cache[key]

    yield get
    cache.clear()


# ---------------------------------------------------------------------------------------------------------------
# Registry, state-dict layout and output shapes (all 12 paper configs, on the meta device)
# ---------------------------------------------------------------------------------------------------------------


def test_registry_has_all_paper_configs():
    assert set(OFFICIAL_NAMES) <= set(MODEL_NAMES)
    assert len(OFFICIAL_NAMES) == 12


@pytest.mark.parametrize("learn_sigma", [True, False])
@pytest.mark.parametrize("name", OFFICIAL_NAMES + ["DiT-T/2"])
def test_state_dict_layout_and_output_shape(name, learn_sigma):
    with torch.device("meta"):
        ours, ref = _pair(name, learn_sigma=learn_sigma, input_size=INPUT_SIZE)
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert set(ours_sd) == set(ref_sd), (
        f"missing: {sorted(set(ref_sd) - set(ours_sd))}, unexpected: {sorted(set(ours_sd) - set(ref_sd))}"
    )
    for key, value in ref_sd.items():
        assert ours_sd[key].shape == value.shape, key
    assert dict(ours.named_buffers()) == {} == dict(ref.named_buffers())
    assert not ours.pos_embed.requires_grad
    assert {n for n, p in ours.named_parameters() if not p.requires_grad} == {"pos_embed"}
    # Both directions load strictly (shapes are checked by load_state_dict too).
    ours.load_state_dict(ref_sd, strict=True, assign=True)
    ref.load_state_dict(ours_sd, strict=True, assign=True)

    c_out = 2 * IN_CHANNELS if learn_sigma else IN_CHANNELS
    assert ours.out_channels == c_out
    assert ours.final_layer.linear.out_features == ours.patch_size**2 * c_out
    if learn_sigma:  # a meta forward costs ~0.3 s for XL; learn_sigma=False runs for real in the next test
        x = torch.empty(3, IN_CHANNELS, INPUT_SIZE, INPUT_SIZE, device="meta")
        t = torch.empty(3, dtype=torch.int64, device="meta")
        y = torch.empty(3, dtype=torch.int64, device="meta")
        assert ours.eval()(x, t, y).shape == (3, c_out, INPUT_SIZE, INPUT_SIZE)


@pytest.mark.parametrize("learn_sigma", [True, False])
@pytest.mark.parametrize("name", ["DiT-S/8", "DiT-T/2"])
def test_output_shape_real_forward(name, learn_sigma):
    size = _input_size(name)
    ours = create_model(name, size, IN_CHANNELS, NUM_CLASSES, learn_sigma=learn_sigma)
    x, t, y = _inputs(name, batch=2)
    with torch.no_grad():
        out = ours(x, t, y)
    c_out = 2 * IN_CHANNELS if learn_sigma else IN_CHANNELS
    assert out.shape == (2, c_out, size, size) and out.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------
# Output equality with the official model (random weights loaded with strict=True)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SMALL_NAMES)
def test_forward_matches_official_float64(name, randomised_pair):
    ours, ref = randomised_pair(name, torch.float64)
    x, t, y = _inputs(name, dtype=torch.float64)
    with torch.no_grad():
        expected = ref(x, t, y)
        actual = ours(x, t, y)
    # Same math in float64; only summation order (SDPA vs explicit softmax, fused vs unfused ops) differs,
    # ~1e-15 relative per op, so 1e-10 relative leaves a wide margin while catching any semantic change.
    _assert_close_rel(actual, expected, 1e-10)


@pytest.mark.parametrize("name", SMALL_NAMES)
def test_forward_matches_official_float32(name, randomised_pair):
    ours, ref = randomised_pair(name, torch.float32)
    x, t, y = _inputs(name, seed=1)
    with torch.no_grad():
        expected = ref(x, t, y)
        actual = ours(x, t, y)
    # float32 eps is 1.2e-7; 12 blocks of attention/MLP with different kernels accumulate a few 1e-7 relative:
    # 1e-5 relative (to the element, floored at 1e-5 of the output scale).
    _assert_close_rel(actual, expected, 1e-5)


def test_inference_hands_each_mlp_residual_to_the_next_layernorm(randomised_pair):
    """Without autograd a block returns its MLP residual unsummed (``GatedSum``) and the next LayerNorm's op sums
    it (``ops.residual_layernorm_modulate``); under autograd the block sums it itself. Same ops in the same order:
    bitwise-equal outputs."""
    from ditforge.ops.modulate import GatedSum

    ours, _ = randomised_pair(SMALL_NAMES[0], torch.float32)
    x, t, y = _inputs(SMALL_NAMES[0], seed=2)
    tokens = ours.x_embedder(x) + ours.pos_embed
    c, _ = ours.embed_conditions(t, y)
    with torch.no_grad():
        deferred = ours(x, t, y)
        assert isinstance(ours.blocks[0](tokens, c), GatedSum)
    assert ours.blocks[0].mlp.fc1.weight.requires_grad
    summed = ours(x, t, y)
    assert summed.requires_grad and isinstance(ours.blocks[0](tokens, c), torch.Tensor)
    assert deferred.abs().max() > 1e-2 and torch.equal(deferred, summed.detach())


def test_forward_matches_official_learn_sigma_false():
    ours, ref = _pair("DiT-T/2", learn_sigma=False)
    _randomise_(ref, seed=7)
    ours.load_state_dict(ref.state_dict(), strict=True)
    ours, ref = ours.double().eval(), ref.double().eval()
    x, t, y = _inputs("DiT-T/2", dtype=torch.float64)
    with torch.no_grad():
        expected, actual = ref(x, t, y), ours(x, t, y)
    assert actual.shape == (x.shape[0], IN_CHANNELS, _input_size("DiT-T/2"), _input_size("DiT-T/2"))
    _assert_close_rel(actual, expected, 1e-10)  # float64: see test_forward_matches_official_float64


def test_official_state_dict_round_trip_is_lossless(randomised_pair):
    ours, ref = randomised_pair("DiT-T/4", torch.float32)
    back = reference_dit("DiT-T/4", input_size=_input_size("DiT-T/4"), in_channels=IN_CHANNELS,
                         num_classes=NUM_CLASSES)
    back.load_state_dict(ours.state_dict(), strict=True)
    for key, value in ref.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


@pytest.mark.parametrize("guidance_channels", [3, None])
def test_cfg_matches_official_forward_with_cfg(guidance_channels, randomised_pair):
    """ditforge's GuidedModel (cond + uncond in one batch) equals the official forward_with_cfg."""
    from ditforge.diffusion.samplers import GuidedModel

    ours, ref = randomised_pair("DiT-T/2", torch.float64)
    x, t, y = _inputs("DiT-T/2", batch=3, dtype=torch.float64)
    y[-1] = 3  # conditional labels only
    cfg_scale = 4.0
    k = IN_CHANNELS if guidance_channels is None else guidance_channels
    with torch.no_grad():
        expected = ref.forward_with_cfg(
            torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, NUM_CLASSES)]), cfg_scale,
            guidance_channels=k,
        )[: len(x)]
        actual = GuidedModel(ours, y, cfg_scale, guidance_channels=guidance_channels)(x, t)
    _assert_close_rel(actual, expected, 1e-10)  # float64: see test_forward_matches_official_float64


# ---------------------------------------------------------------------------------------------------------------
# Initialisation
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["DiT-S/2", "DiT-T/4", "DiT-T/8"])
def test_fresh_model_initialisation(name):
    torch.manual_seed(0)
    ours = create_model(name, _input_size(name), IN_CHANNELS, NUM_CLASSES)
    for i, block in enumerate(ours.blocks):
        assert torch.count_nonzero(block.adaLN_modulation[-1].weight) == 0, f"block {i} adaLN weight"
        assert torch.count_nonzero(block.adaLN_modulation[-1].bias) == 0, f"block {i} adaLN bias"
    final = ours.final_layer
    for p in (final.adaLN_modulation[-1].weight, final.adaLN_modulation[-1].bias, final.linear.weight,
              final.linear.bias):
        assert torch.count_nonzero(p) == 0

    grid = _input_size(name) // ours.patch_size
    expected = torch.from_numpy(get_2d_sincos_pos_embed(ours.pos_embed.shape[-1], grid)).float().unsqueeze(0)
    assert ours.pos_embed.dtype == torch.float32 and not ours.pos_embed.requires_grad
    torch.testing.assert_close(ours.pos_embed.detach(), expected, rtol=0, atol=1e-6)  # float32 rounding only

    x, t, y = _inputs(name)
    with torch.no_grad():
        out = ours(x, t, y)
    assert torch.count_nonzero(out) == 0  # adaLN-Zero + zero output layer: exactly zero


def test_initialisation_statistics_match_official():
    """Per parameter: zeros where the official init has zeros, same spread (xavier / N(0, 0.02)) elsewhere."""
    torch.manual_seed(0)
    ours, ref = _pair("DiT-T/2")
    ref_sd = ref.state_dict()
    for key, value in ours.state_dict().items():
        expected = ref_sd[key]
        if torch.count_nonzero(expected) == 0:
            assert torch.count_nonzero(value) == 0, key
        elif key == "pos_embed":
            continue  # deterministic, checked exactly in test_fresh_model_initialisation
        else:
            # independent draws of the same distribution; numel >= 2112, so the stds agree within ~5% (3 sigma)
            assert value.std().item() == pytest.approx(expected.std().item(), rel=0.1), key
            # same family: uniform (xavier) has max|w|/std = sqrt(3) ~ 1.73, a normal over >= 2112 draws ~ 3.5
            assert (value.abs().max() / value.std() < 2.5) == (expected.abs().max() / expected.std() < 2.5), key


@pytest.mark.parametrize("dim,grid", [(384, 8), (192, 16), (1152, 4), (8, 3), (64, 1)])
def test_sincos_2d_matches_official_numpy(dim, grid):
    expected = torch.from_numpy(get_2d_sincos_pos_embed(dim, grid)).float()
    actual = sincos_2d(dim, grid)
    assert actual.shape == (grid * grid, dim) and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)  # both float64 math, rounded to float32


@pytest.mark.parametrize("dim", [256, 255, 16])
def test_timestep_embedding_matches_official(dim):
    t = torch.tensor([0, 1, 17, 500, 999], dtype=torch.int64)
    assert torch.equal(timestep_embedding(t, dim), RefTimestepEmbedder.timestep_embedding(t, dim))
    tf = torch.tensor([0.0, 0.5, 123.25, 998.75])
    assert torch.equal(timestep_embedding(tf, dim), RefTimestepEmbedder.timestep_embedding(tf, dim))


# ---------------------------------------------------------------------------------------------------------------
# Label dropout (classifier-free guidance)
# ---------------------------------------------------------------------------------------------------------------


def test_force_drop_ids_replaces_labels_by_null(randomised_pair):
    ours, ref = randomised_pair("DiT-T/2", torch.float32)
    x, t, y = _inputs("DiT-T/2", batch=4)
    y[-1] = 2
    drop = torch.tensor([True, False, True, False])
    y_dropped = torch.where(drop, NUM_CLASSES, y)
    with torch.no_grad():
        emb = ours.y_embedder(y, False, drop)
        assert torch.equal(emb, ours.y_embedder.embedding_table.weight[y_dropped])
        # int 0/1 force_drop_ids, as the official token_drop accepts (force_drop_ids == 1)
        assert torch.equal(ours.y_embedder(y, False, drop.long()), emb)
        assert torch.equal(emb, ref.y_embedder(y, False, drop))
        out = ours(x, t, y, force_drop_ids=drop)
        torch.testing.assert_close(out, ours(x, t, y_dropped), rtol=0, atol=0)
        _assert_close_rel(out, ref(x, t, y_dropped), 1e-5)  # float32: see test_forward_matches_official_float32
        # rows that were not dropped are unchanged; dropped rows differ from the conditional output
        plain = ours(x, t, y)
        assert torch.equal(out[~drop], plain[~drop])
        assert not torch.allclose(out[drop], plain[drop])


def test_no_null_row_without_dropout_and_train_mode_keeps_labels():
    ours, ref = _pair("DiT-T/4", class_dropout_prob=0.0)
    assert ours.y_embedder.embedding_table.weight.shape == (NUM_CLASSES, 192)
    assert ref.y_embedder.embedding_table.weight.shape == (NUM_CLASSES, 192)
    _randomise_(ref, seed=3)
    ours.load_state_dict(ref.state_dict(), strict=True)
    ours.train()
    ref.train()
    x, t, y = _inputs("DiT-T/4", batch=6)
    y = torch.arange(6) % NUM_CLASSES  # no null label exists here
    with torch.no_grad():
        out_train = ours(x, t, y)
        assert torch.equal(ours.y_embedder(y, True), ours.y_embedder.embedding_table.weight[y])
        _assert_close_rel(out_train, ref(x, t, y), 1e-5)  # float32: see test_forward_matches_official_float32
        torch.testing.assert_close(out_train, ours.eval()(x, t, y), rtol=0, atol=0)  # no dropout anywhere


def test_null_row_exists_with_dropout():
    ours, ref = _pair("DiT-T/8", class_dropout_prob=0.1)
    assert ours.y_embedder.embedding_table.weight.shape == ref.y_embedder.embedding_table.weight.shape
    assert ours.y_embedder.embedding_table.weight.shape[0] == NUM_CLASSES + 1


def test_train_mode_dropout_draws_like_official():
    """Same RNG state -> same coin flips (torch.rand(B) < p) as the official token_drop."""
    ours, ref = _pair("DiT-T/8", class_dropout_prob=0.5)
    ref.y_embedder.load_state_dict(ours.y_embedder.state_dict())
    y = torch.arange(64) % NUM_CLASSES
    torch.manual_seed(123)
    a = ours.y_embedder(y, True)
    torch.manual_seed(123)
    b = ref.y_embedder(y, True)
    assert torch.equal(a, b)
    torch.manual_seed(123)
    dropped = ours.y_embedder.token_drop(y)
    assert 0 < (dropped == NUM_CLASSES).sum() < len(y)
    assert torch.equal(dropped[dropped != NUM_CLASSES], y[dropped != NUM_CLASSES])
    with torch.no_grad():  # eval mode never drops
        assert torch.equal(ours.y_embedder(y, False), ours.y_embedder.embedding_table.weight[y])


# ---------------------------------------------------------------------------------------------------------------
# User errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["DiT-XXL/2", "DiT-S/3", "DiT-S/16", "dit-s/2", "DiT-S2", "UNet-S/2", ""])
def test_unknown_model_name_raises_user_error(name):
    with pytest.raises(UserError) as info:
        create_model(name, INPUT_SIZE, IN_CHANNELS, NUM_CLASSES)
    assert repr(name) in str(info.value)


@pytest.mark.parametrize("name,size", [("DiT-S/4", 18), ("DiT-XL/8", 20), ("DiT-B/2", 15)])
def test_input_size_not_divisible_by_patch_raises_user_error(name, size):
    with torch.device("meta"), pytest.raises(UserError) as info:
        create_model(name, size, IN_CHANNELS, NUM_CLASSES)
    assert str(size) in str(info.value) and name in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# Meta-device build (create_model(device=...): to_empty + initialize_weights, one block at a time)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kw", [("DiT-T/2", {}), ("DiT-T/4", dict(text_dim=24, qk_norm=True)),
                                     ("vDiT-T/222", dict(num_frames=4)), ("STDiT-T/2", dict(num_frames=4))])
def test_meta_build_equals_initialising_an_ordinary_model(name, kw):
    """Independent reference: an ordinary (CPU) build re-materialised in place (``to_empty``, which drops every
    value) and initialised after a seed. The meta build, materialised on the CPU after the same seed, must equal it
    bit for bit (same draws in the same order, qk-norm affines, the null caption and STDiT's temporal table
    included) and hold no NaN; ``block_ready``'s cast of each block must hold."""
    torch.manual_seed(0)
    ref = create_model(name, 16, IN_CHANNELS, NUM_CLASSES, **kw)
    torch.manual_seed(7)
    ref.initialize_weights("cpu")
    seen = []

    def cast(block):
        seen.append(block)
        for p in block.parameters():
            p.data = p.data.to(torch.bfloat16)

    torch.manual_seed(7)
    built = create_model(name, 16, IN_CHANNELS, NUM_CLASSES, device="cpu", block_ready=cast, **kw)
    assert len(seen) == len(built.blocks)
    got, want = built.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert not value.isnan().any(), key
        expected = value.to(torch.bfloat16) if key.startswith("blocks.") else value
        assert got[key].dtype == expected.dtype and torch.equal(got[key], expected), key


def test_meta_build_materialises_one_block_at_a_time():
    with torch.device("meta"):
        model = create_model("DiT-T/2", 16, IN_CHANNELS, NUM_CLASSES)
    order = []

    def ready(block):
        i = len(order)
        order.append(block)
        assert not any(p.is_meta for b in model.blocks[: i + 1] for p in b.parameters())
        assert all(p.is_meta for b in model.blocks[i + 1:] for p in b.parameters())
        assert not any(p.is_meta for p in model.final_layer.parameters())  # the small parts come first

    model.initialize_weights("cpu", ready)
    assert order == list(model.blocks) and not any(p.is_meta for p in model.parameters())
