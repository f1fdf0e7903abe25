"""``ditforge sample`` for text-conditioned and video models: MP4 + GIF per prompt, PNG grids of text models,
decoding through a VAE, prompt errors, guidance against independent model calls, seeds; and ``write_video`` /
``write_gif``.

Models are tiny (DiT-T, 8x8 inputs, 4 frames), randomly initialised with every trainable tensor non-zero, and
exported with ``export_safetensors`` under a config shaped like a run's. The text encoder is the shipped MiniLM
(D_text = 384). Files are read back independently: MP4s with PyAV, GIFs and PNGs with Pillow.
"""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch
from PIL import Image

from ditforge import cli
from ditforge.data.images import to_uint8
from ditforge.data.video import display_scale, write_gif, write_video
from ditforge.diffusion import generate, GuidedModel
from ditforge.encoders.vae import load_vae
from ditforge.models import create_model
from ditforge.sample import load_model
from ditforge.data.captions import slug
from ditforge.export import export_safetensors

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT_DIM = 384  # all-MiniLM-L6-v2
STEPS = ["--num_sampling_steps", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def encoder():
    from ditforge.encoders.text import load_text_encoder

    return load_text_encoder()  # the shipped MiniLM (also warms up transformers for the CLI runs)


def _randomise(model, scale=0.05):
    """The init zeroes adaLN, cross-attention outputs and the final layer: fill every trainable tensor with fresh
    random values (the fixed sin-cos position embedding stays)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def _make(name, *, text=False, frames=None, channels=3, size=8, classes=5, vae="none", qk_norm=False):
    model = create_model(name, size, channels, classes, True, 0.1, num_frames=frames,
                         text_dim=TEXT_DIM if text else None, qk_norm=qk_norm)
    config = {
        "model": dict(model=name, condition="text" if text else "class", text_encoder=None, text_max_length=32,
                      vae=vae, qk_norm=qk_norm, num_classes=classes, learn_sigma=True, class_dropout_prob=0.1,
                      in_channels=channels, input_size=size, num_frames=frames, text_dim=TEXT_DIM if text else None),
        "data": dict(image_size=size, num_frames=frames, frame_interval=3),
    }
    return _randomise(model), config


def _export(tmp_path, filename, **kw):
    model, config = _make(**kw)
    path = tmp_path / filename
    export_safetensors(model.state_dict(), config, path)
    return path, model


def _sample(ckpt, *extra):
    return cli.main(["sample", "--ckpt", str(ckpt), *STEPS, *extra])


def _one_line_error(capsys, last=False):
    """The error line of the last command; ``last``: other lines (library warnings) may come before it."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert (last or len(lines) == 1) and "Traceback" not in err, err
    assert lines[-1].startswith("ditforge sample: error:"), err
    return lines[-1]


def _decode_mp4(path):
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
        return frames, stream.average_rate, stream.codec_context.name


def _gif_frames(path):
    with Image.open(path) as img:
        out = []
        for i in range(img.n_frames):
            img.seek(i)
            out.append((np.array(img.convert("RGB")), img.info.get("duration"), img.info.get("loop")))
        return out


def _shrink(big, k):
    """Undo a k x k nearest-neighbour enlargement by averaging each block (lossy codecs blur block edges)."""
    t, h, w, c = big.shape
    return big.reshape(t, h // k, k, w // k, k, c).astype(np.float64).mean((2, 4))


# ----------------------------------------------------------------------------------------------------------
# Video models


def test_text_video_model_writes_mp4_and_gif_per_prompt(tmp_path, encoder):
    ckpt, _ = _export(tmp_path, "v.safetensors", name="vDiT-T/122", text=True, frames=4, qk_norm=True)
    out, npz = tmp_path / "vids", tmp_path / "v.npz"
    prompts = ["A red ball, bouncing!", "two dogs running on the beach"]
    rc = _sample(ckpt, "--prompt", prompts[0], "--prompt", prompts[1], "--out", str(out), "--fps", "6",
                 "--save_npz", str(npz), "--cfg_scale", "3")
    assert rc == 0
    names = ["000-a-red-ball-bouncing", "001-two-dogs-running-on-the-beach"]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.{ext}" for n in names for ext in ("mp4", "gif"))
    with np.load(npz) as f:
        videos, got_prompts = f["samples"], f["prompts"].tolist()
    assert got_prompts == prompts and videos.dtype == np.uint8 and videos.shape == (2, 4, 8, 8, 3)
    assert videos.std() > 10  # not blank
    k = 8  # 8 px frames are enlarged 8x to 64 px (display_scale)
    for name, video in zip(names, videos):
        frames, rate, codec = _decode_mp4(out / f"{name}.mp4")
        assert frames.shape == (4, 64, 64, 3) and rate == 6 and codec in ("h264", "mpeg4")
        # lossy (H.264 CRF 18, yuv420p halves the colour resolution): block means within 12 levels on average
        assert np.abs(_shrink(frames, k) - video).mean() < 12
        gif = _gif_frames(out / f"{name}.gif")
        assert len(gif) == 4
        assert all(g.shape == (64, 64, 3) and loop == 0 and duration in (160, 170) for g, duration, loop in gif)
        # a 256-colour palette per frame: nearly exact
        assert np.abs(_shrink(np.stack([g for g, _, _ in gif]), k) - video).mean() < 4


def test_num_frames_override_and_class_video_with_vae(tmp_path, tiny_vae):
    # A class-conditional latent video model decoded by its run's VAE (downsample 2): 8x8 latents -> 16x16 frames,
    # enlarged 4x to 64 px; --num_frames 6 rebuilds the fixed position embedding for 6 latent frames.
    folder, vae = tiny_vae
    ckpt, _ = _export(tmp_path, "cv.safetensors", name="vDiT-T/122", frames=4, channels=4, vae=str(folder))
    out, npz = tmp_path / "cv", tmp_path / "cv.npz"
    assert _sample(ckpt, "--class_labels", "3,0", "--num_frames", "6", "--out", str(out), "--save_npz", str(npz)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["000-class-3.gif", "000-class-3.mp4", "001-class-0.gif",
                                                     "001-class-0.mp4"]
    with np.load(npz) as f:
        assert f["samples"].shape == (2, 6, 16, 16, 3) and f["labels"].tolist() == [3, 0]
    frames, rate, _ = _decode_mp4(out / "000-class-3.mp4")
    assert frames.shape == (6, 64, 64, 3) and rate == 8
    assert len(_gif_frames(out / "001-class-0.gif")) == 6


def test_video_out_must_be_a_folder(tmp_path, capsys):
    ckpt, _ = _export(tmp_path, "c.safetensors", name="vDiT-T/122", frames=4)
    assert _sample(ckpt, "--num_samples", "1", "--out", str(tmp_path / "x.mp4")) == 2
    assert "--out" in _one_line_error(capsys)


# ----------------------------------------------------------------------------------------------------------
# Text-conditioned image models


def _grid_cells(png, n, nrow, h, upscale, pad=1):
    """Undo save_grid independently: (n, h, h, 3) uint8 cells, after checking the nearest-neighbour upscale."""
    with Image.open(png) as img:
        big = np.array(img)
    grid = big[::upscale, ::upscale]
    assert np.array_equal(big, np.kron(grid, np.ones((upscale, upscale, 1), dtype=np.uint8)))
    return np.stack([grid[pad + (i // nrow) * (h + pad):][:h, pad + (i % nrow) * (h + pad):][:, :h] for i in range(n)])


def test_text_image_model_png_grid_from_prompts_and_file(tmp_path, encoder):
    ckpt, _ = _export(tmp_path, "t.safetensors", name="DiT-T/2", text=True)
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("a cat\n\n  a dog in the snow  \nthe sea at dawn\n")
    png, npz = tmp_path / "grid.png", tmp_path / "t.npz"
    rc = _sample(ckpt, "--prompt", "first", "--prompt_file", str(prompt_file), "--out", str(png),
                 "--save_npz", str(npz))
    assert rc == 0
    with np.load(npz) as f:
        samples, prompts = f["samples"], f["prompts"].tolist()
    assert prompts == ["first", "a cat", "a dog in the snow", "the sea at dawn"]
    assert samples.shape == (4, 8, 8, 3) and samples.std() > 10
    with Image.open(png) as img:
        assert img.format == "PNG" and img.mode == "RGB" and img.size == (8 * (4 * 9 + 1), 8 * (1 * 9 + 1))
    assert np.array_equal(_grid_cells(png, 4, 4, 8, 8), samples)


def test_seeded_sampling_is_deterministic(tmp_path, encoder):
    ckpt, _ = _export(tmp_path, "t.safetensors", name="DiT-T/2", text=True)

    def run(seed, name):
        npz = tmp_path / f"{name}.npz"
        assert _sample(ckpt, "--prompt", "a cat", "--prompt", "a dog", "--seed", str(seed), "--sampler", "ddim",
                       "--eta", "0.5", "--out", str(tmp_path / f"{name}.png"), "--save_npz", str(npz)) == 0
        with np.load(npz) as f:
            return f["samples"]

    a, b, c = run(7, "a"), run(7, "b"), run(8, "c")
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


# ----------------------------------------------------------------------------------------------------------
# User errors


def test_text_model_without_prompt(tmp_path, capsys):
    ckpt, _ = _export(tmp_path, "t.safetensors", name="vDiT-T/122", text=True, frames=4)
    assert _sample(ckpt, "--out", str(tmp_path / "o")) == 2
    assert "--prompt" in _one_line_error(capsys)
    assert _sample(ckpt, "--num_samples", "2", "--out", str(tmp_path / "o")) == 2  # labels mean nothing to it
    assert "--prompt" in _one_line_error(capsys)
    assert not (tmp_path / "o").exists()


def test_class_model_with_prompt(tmp_path, capsys):
    ckpt, _ = _export(tmp_path, "c.safetensors", name="DiT-T/2")
    assert _sample(ckpt, "--prompt", "a cat", "--out", str(tmp_path / "x.png")) == 2
    assert "--prompt" in _one_line_error(capsys)


def test_prompt_file_missing_or_empty(tmp_path, capsys):
    ckpt, _ = _export(tmp_path, "t.safetensors", name="DiT-T/2", text=True)
    missing = tmp_path / "nope.txt"
    assert _sample(ckpt, "--prompt_file", str(missing), "--out", str(tmp_path / "x.png")) == 2
    line = _one_line_error(capsys)
    assert "--prompt_file" in line and str(missing) in line
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n")
    assert _sample(ckpt, "--prompt_file", str(empty), "--out", str(tmp_path / "x.png")) == 2
    assert str(empty) in _one_line_error(capsys)
    assert not (tmp_path / "x.png").exists()


def test_num_frames_for_image_model(tmp_path, capsys):
    ckpt, _ = _export(tmp_path, "c.safetensors", name="DiT-T/2")
    assert _sample(ckpt, "--num_frames", "4", "--out", str(tmp_path / "x.png")) == 2
    assert "--num_frames" in _one_line_error(capsys)


# ----------------------------------------------------------------------------------------------------------
# Latent models and the VAE


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    """A tiny random diffusers AutoencoderKL (4 latent channels, downsample 2) saved with save_pretrained."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    model = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                          up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                          latent_channels=4, norm_num_groups=32, sample_size=32, scaling_factor=0.5)
    folder = tmp_path_factory.mktemp("vae")
    model.save_pretrained(str(folder))
    return folder, load_vae(str(folder))


def test_latent_image_model_decodes_with_the_runs_vae(tmp_path, tiny_vae):
    folder, vae = tiny_vae
    ckpt, _ = _export(tmp_path, "l.safetensors", name="DiT-T/2", channels=4, vae=str(folder))
    png, npz = tmp_path / "l.png", tmp_path / "l.npz"
    assert _sample(ckpt, "--class_labels", "1,4,2", "--seed", "5", "--out", str(png), "--save_npz", str(npz)) == 0
    with np.load(npz) as f:
        samples = f["samples"]
    assert samples.shape == (3, 16, 16, 3)  # 8x8 latents x downsample 2
    with Image.open(png) as img:  # 3 cells of 16 px, 1 px padding, enlarged 64 // 16 = 4 times
        assert img.size == (4 * (3 * 17 + 1), 4 * (1 * 17 + 1))
    # the same recipe by hand: latents sampled without clipping (VAE latents are not in [-1, 1]), then decoded
    model, spec = load_model(str(ckpt))
    latents = generate(model, torch.tensor([1, 4, 2]), (4, 8, 8), cfg_scale=4.0, num_steps=4, learn_sigma=True,
                       generator=torch.Generator().manual_seed(5), clip_denoised=False)
    assert np.array_equal(to_uint8(vae.decode(latents)), samples)


def test_official_pt_needs_and_takes_vae(tmp_path, tiny_vae, capsys):
    model, _ = _make("DiT-T/2", channels=4)
    torch.save(model.state_dict(), tmp_path / "official.pt")  # no config: 4-channel latents, no VAE known
    assert _sample(tmp_path / "official.pt", "--class_labels", "0", "--out", str(tmp_path / "x.png")) == 2
    assert "--vae" in _one_line_error(capsys)
    rc = _sample(tmp_path / "official.pt", "--class_labels", "0,1", "--vae", str(tiny_vae[0]), "--image_size", "16",
                 "--out", str(tmp_path / "x.png"), "--save_npz", str(tmp_path / "x.npz"))
    assert rc == 0
    with np.load(tmp_path / "x.npz") as f:
        assert f["samples"].shape == (2, 16, 16, 3)
    capsys.readouterr()
    assert _sample(tmp_path / "official.pt", "--vae", str(tiny_vae[0]), "--image_size", "15",
                   "--out", str(tmp_path / "y.png")) == 2
    assert "--image_size" in _one_line_error(capsys, last=True)  # diffusers may warn while loading the VAE


# ----------------------------------------------------------------------------------------------------------
# Guidance against two separate model calls


# The guidance tests run in float64: the guided call is one batch of 2B rows and the references are two calls of B
# rows, which the BLAS may block differently (in float32, MKL's AVX2 kernels moved the guided output by up to
# 3.7e-6, 0.37 of the old 1e-5; AVX-512 by 0). Reordered float64 sums stay near 1e-15, amplified by guidance 3.5
# to well under 1e-10, while a row's condition or the variance taken from the wrong pass moves outputs by > 1e-2.


def test_text_guidance_equals_separate_cond_and_uncond_calls(encoder):
    model, _ = _make("DiT-T/2", text=True)
    model.double()
    states, mask = encoder.encode(["a cat", "a long sentence about a dog running on a sunny beach", "sea"])
    states = states.double()
    assert not mask.all()  # captions of different lengths: padding is exercised
    x, t = torch.randn(3, 3, 8, 8, dtype=torch.float64), torch.randint(0, 1000, (3,))
    s = 3.5
    with torch.no_grad():
        got = GuidedModel(model, states, s, y_mask=mask)(x, t)
        cond = model(x, t, states, force_drop_ids=torch.zeros(3, dtype=torch.bool), y_mask=mask)
        uncond = model(x, t, states, force_drop_ids=torch.ones(3, dtype=torch.bool), y_mask=mask)
    assert (cond - uncond).abs().max() > 1e-2  # the caption matters
    torch.testing.assert_close(got[:, :3], uncond[:, :3] + s * (cond[:, :3] - uncond[:, :3]), rtol=0, atol=1e-10)
    torch.testing.assert_close(got[:, 3:], cond[:, 3:], rtol=0, atol=1e-10)  # variance from the conditional pass


def test_label_guidance_equals_explicit_null_label_formula():
    model, _ = _make("vDiT-T/122", frames=4, classes=7)
    model.double()
    x, t = torch.randn(4, 3, 4, 8, 8, dtype=torch.float64), torch.randint(0, 1000, (4,))
    y = torch.tensor([0, 6, 3, 3])
    s = 2.0
    with torch.no_grad():
        got = GuidedModel(model, y, s)(x, t)
        cond, uncond = model(x, t, y), model(x, t, torch.full_like(y, 7))  # 7 = num_classes: the null label
    torch.testing.assert_close(got[:, :3], uncond[:, :3] + s * (cond[:, :3] - uncond[:, :3]), rtol=0, atol=1e-10)
    torch.testing.assert_close(got[:, 3:], cond[:, 3:], rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------------------------------------
# write_video / write_gif


@pytest.mark.parametrize("t,h,w,k,shape", [
    (3, 8, 8, 8, (64, 64)),     # tiny: 8x enlargement
    (5, 13, 9, 8, (104, 72)),   # odd sides, k = ceil(64 / 9) = 8 makes them even
    (2, 65, 33, 2, (130, 66)),  # k = ceil(64 / 33) = 2
    (2, 65, 67, 1, (66, 68)),   # no enlargement; odd sides padded by one edge row / column
])
def test_write_video_size_rule(tmp_path, t, h, w, k, shape):
    frames = np.random.default_rng().integers(0, 256, (t, h, w, 3), dtype=np.uint8)
    frames = np.repeat(np.repeat(frames[:, ::8, ::8], 8, 1), 8, 2)[:, :h, :w]  # 8x8 blocks: they survive the codec
    assert display_scale(h, w) == k
    assert write_video(frames, tmp_path / "v.mp4", fps=5) == tmp_path / "v.mp4"
    decoded, rate, _ = _decode_mp4(tmp_path / "v.mp4")
    assert decoded.shape == (t, *shape, 3) and rate == 5
    assert np.abs(decoded[:, : k * h : k, : k * w : k].astype(int) - frames).mean() < 12
    write_gif(frames, tmp_path / "v.gif", fps=5)
    gif = _gif_frames(tmp_path / "v.gif")
    assert len(gif) == t and all(g.shape == (k * h, k * w, 3) and d == 200 for g, d, _ in gif)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.gif", "v.mp4"]  # no temporary files left


@pytest.mark.parametrize("bad", [np.zeros((2, 8, 8), np.uint8), np.zeros((2, 8, 8, 3), np.float32),
                                 np.zeros((0, 8, 8, 3), np.uint8), np.zeros((2, 8, 8, 4), np.uint8)])
def test_write_video_rejects_bad_frames(tmp_path, bad):
    with pytest.raises(ValueError):
        write_video(bad, tmp_path / "v.mp4")
    with pytest.raises(ValueError):
        write_gif(bad, tmp_path / "v.gif")
    assert not list(tmp_path.iterdir())


def test_slug():
    assert slug("A red car, at night!") == "a-red-car-at-night"
    assert slug("!!!") == "prompt" and len(slug("word " * 40)) <= 48
