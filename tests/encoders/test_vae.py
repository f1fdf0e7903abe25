"""VAE wrapper: a tiny random AutoencoderKL saved and loaded back, checked against diffusers called directly
(scaling, mean vs sample), frame-by-frame video folding, micro-batch invariance, the identity, user errors."""

from __future__ import annotations

import json

import pytest
import torch

from ditforge.encoders import VAE, IdentityVAE, load_vae
from ditforge.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

SF = 0.5


def _tiny_autoencoder(**overrides):
    from diffusers import AutoencoderKL

    kwargs = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                  latent_channels=4, norm_num_groups=32, sample_size=32, scaling_factor=SF)
    kwargs.update(overrides)
    return AutoencoderKL(**kwargs).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, the same AutoencoderKL in memory) for a tiny randomly initialised model."""
    torch.manual_seed(0)
    model = _tiny_autoencoder()
    folder = tmp_path_factory.mktemp("vae")
    model.save_pretrained(str(folder))
    return folder, model


@pytest.fixture(scope="module")
def vae(saved):
    return load_vae(str(saved[0]), micro_batch=3)


def _pixels(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g) * 2 - 1


def test_properties(vae):
    assert isinstance(vae, VAE)
    assert (vae.latent_channels, vae.downsample, vae.scaling_factor, vae.shift_factor) == (4, 2, SF, 0.0)
    assert not vae.model.training and not any(p.requires_grad for p in vae.model.parameters())


def test_encode_mean_and_decode_match_diffusers(saved, vae):
    _, model = saved
    x = _pixels(5, 3, 16, 24, seed=1)
    with torch.no_grad():
        mean = model.encode(x).latent_dist.mean
    z = vae.encode(x, sample=False)
    assert z.shape == (5, 4, 8, 12) and z.dtype == torch.float32
    torch.testing.assert_close(z, SF * mean, atol=1e-6, rtol=1e-5)
    assert float(mean.abs().max()) > 0.05  # not a trivial comparison

    lat = torch.randn(5, 4, 8, 12, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model.decode(lat / SF).sample
    out = vae.decode(lat)
    assert out.shape == (5, 3, 16, 24)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_sample_reproducible_and_equals_diffusers(saved, vae):
    _, model = saved
    x = _pixels(2, 3, 16, 16, seed=3)
    a = vae.encode(x, generator=torch.Generator().manual_seed(7), sample=True, micro_batch=8)
    b = vae.encode(x, generator=torch.Generator().manual_seed(7), sample=True, micro_batch=1)
    c = vae.encode(x, generator=torch.Generator().manual_seed(8), sample=True)
    mean = vae.encode(x, sample=False)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # the noise does not depend on micro_batch
    assert (a - mean).abs().mean() > 0.1 and (a - c).abs().mean() > 0.1
    with torch.no_grad():
        ref = model.encode(x).latent_dist.sample(generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(a, SF * ref, atol=1e-6, rtol=1e-5)  # fast-DiT's latent_dist.sample() * 0.18215


def test_video_is_encoded_frame_by_frame(saved):
    # float64 VAE: convolutions of other batch sizes (frame by frame, chunks of other sizes) sum in another order
    # (oneDNN blocks by batch size and CPU; in float32 that moved the decoded frames by up to 4.5e-6, 0.19 of the
    # old 2e-5); in float64 such reorderings stay near 1e-15, while a frame in the wrong place moves values ~1 by
    # ~1e-1.
    vae = load_vae(str(saved[0]), micro_batch=3, dtype=torch.float64)
    b, t = 2, 5
    video = _pixels(b, 3, t, 16, 16, seed=4)
    z = vae.encode(video, sample=False)  # micro_batch 3: 10 frames in chunks 3, 3, 3, 1
    assert z.shape == (b, 4, t, 8, 8)
    for i in range(t):
        torch.testing.assert_close(z[:, :, i], vae.encode(video[:, :, i], sample=False), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(vae.encode(video, sample=False, micro_batch=10), z, atol=1e-10, rtol=1e-10)

    g = torch.Generator().manual_seed(5)
    sampled = vae.encode(video, generator=g, sample=True)
    g2 = torch.Generator().manual_seed(5)
    again = vae.encode(video, generator=g2, sample=True, micro_batch=4)
    torch.testing.assert_close(sampled, again, atol=1e-10, rtol=1e-10)

    out = vae.decode(z)
    assert out.shape == (b, 3, t, 16, 16)
    for i in range(t):
        torch.testing.assert_close(out[:, :, i], vae.decode(z[:, :, i]), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(vae.decode(z, micro_batch=1), out, atol=1e-10, rtol=1e-10)


def test_shift_factor():
    torch.manual_seed(1)
    model = _tiny_autoencoder(scaling_factor=1.5, shift_factor=0.25)
    wrapped = VAE(model)
    x = _pixels(2, 3, 8, 8, seed=6)
    with torch.no_grad():
        mean = model.encode(x).latent_dist.mean
        lat = torch.randn(2, 4, 4, 4)
        ref = model.decode(lat / 1.5 + 0.25).sample
    torch.testing.assert_close(wrapped.encode(x, sample=False), (mean - 0.25) * 1.5, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(wrapped.decode(lat), ref, atol=1e-6, rtol=1e-5)


def test_latents_feed_a_trained_model(vae):
    z = vae.encode(_pixels(2, 3, 8, 8, seed=7))
    assert not z.requires_grad and not z.is_inference()
    w = torch.randn(4, requires_grad=True)
    (z * w[:, None, None]).square().mean().backward()
    assert torch.isfinite(w.grad).all()


def test_identity():
    ident = load_vae("none")
    assert isinstance(ident, IdentityVAE) and load_vae(None).latent_channels == 3
    assert (ident.latent_channels, ident.downsample, ident.scaling_factor) == (3, 1, 1.0)
    x = _pixels(2, 3, 4, 6, 6, seed=8)
    torch.testing.assert_close(ident.encode(x, generator=torch.Generator(), sample=True), x, atol=0, rtol=0)
    torch.testing.assert_close(ident.decode(x), x, atol=0, rtol=0)
    grey = load_vae("None", pixel_channels=1)
    assert grey.latent_channels == 1 and torch.equal(grey.encode(x[:, :1]), x[:, :1])
    assert load_vae("none", dtype=torch.float64).encode(x).dtype == torch.float64


def test_user_errors(tmp_path, vae):
    with pytest.raises(UserError, match="--vae") as err:
        load_vae(str(tmp_path / "missing"))
    assert str(tmp_path / "missing") in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="--vae.*config.json"):
        load_vae(str(tmp_path))  # an empty folder
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    with pytest.raises(UserError, match="--vae.*UNet2DModel"):
        load_vae(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(UserError, match="--vae"):  # no weights
        load_vae(str(tmp_path))
    with pytest.raises(UserError, match="--image_size"):
        vae.encode(_pixels(1, 3, 15, 16, seed=9))
    with pytest.raises(UserError, match="--image_size"):
        vae.encode(_pixels(1, 3, 2, 16, 17, seed=9))
    with pytest.raises(ValueError):
        vae.encode(_pixels(1, 1, 16, 16, seed=9))  # 1 channel into an RGB autoencoder


def test_pipeline_folder(saved, tmp_path):
    import shutil

    shutil.copytree(saved[0], tmp_path / "vae")
    assert load_vae(str(tmp_path)).latent_channels == 4


def test_pixel_channels_of_patchifying_video_vaes():
    """Wan 2.2's VAE states its input channels after folding 2 x 2 pixels into them (12); LTX-Video's states the
    pixels' (3) beside its patch size (4 in the released model): both take RGB clips."""
    from diffusers import AutoencoderKLLTXVideo, AutoencoderKLWan

    wan22 = AutoencoderKLWan(base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                             dim_mult=[1, 1, 1, 1], num_res_blocks=1, scale_factor_spatial=16,
                             temperal_downsample=[False, True, True])
    ltx = AutoencoderKLLTXVideo(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
                                decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                                decoder_layers_per_block=(1, 1, 1, 1, 1), patch_size=4, patch_size_t=1)
    assert (VAE(wan22, frame_factor=1, folds_pixels=True).in_channels
            == VAE(ltx, frame_factor=1, folds_pixels=False).in_channels == 3)


def test_a_family_rule_left_out_is_refused():
    """The VAE is told the family's frame rule and pixel folding (its adapter's ``vae_frame_factor`` /
    ``vae_folds_pixels``): a 3-D VAE without ``frame_factor``, or one with ``patch_size`` without ``folds_pixels``, is a
    TypeError naming the class and the missing argument, never a guess; given, the rule is ``frame_factor x temporal``."""
    from diffusers import AutoencoderKLLTXVideo

    ltx = AutoencoderKLLTXVideo(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
                                decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                                decoder_layers_per_block=(1, 1, 1, 1, 1), patch_size=4, patch_size_t=1)
    with pytest.raises(TypeError, match="AutoencoderKLLTXVideo.*frame_factor"):
        VAE(ltx, folds_pixels=False)
    with pytest.raises(TypeError, match="AutoencoderKLLTXVideo.*folds_pixels"):
        VAE(ltx, frame_factor=1)
    vae = VAE(ltx, frame_factor=2, folds_pixels=False)
    assert vae.frame_step == 2 * vae.temporal and vae.valid_frames(2 * vae.temporal + 1)
    assert not vae.valid_frames(vae.temporal + 1)
