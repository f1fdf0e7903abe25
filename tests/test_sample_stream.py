"""``ditforge sample --prompt_file``: streaming prompts through fixed-size batches, one file per prompt, resuming.

Models are tiny text DiT / vDiT (8x8 inputs), randomly initialised and exported with ``export_safetensors`` as in
tests/test_sample_text_video.py; the text encoder is the shipped MiniLM. PNGs are read back with Pillow and
compared pixel for pixel (exact: the noise of sample i comes from ``derive_seed(seed, i)`` and its prompt is
encoded alone, so neither the batch size nor the skipped samples change it); also the ``--sampler`` choices
through the CLI.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ditforge import cli
from ditforge.models import create_model
from ditforge.data.captions import slug
from ditforge.export import export_safetensors

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT_DIM = 384  # all-MiniLM-L6-v2
PROMPTS = ["a red car at night", "two dogs", "the sea at dawn", "a bowl of fruit", "snow on the mountains"]


def _export(path, name="DiT-T/2", frames=None):
    model = create_model(name, 8, 3, 5, True, 0.1, num_frames=frames, text_dim=TEXT_DIM)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    config = {"model": dict(model=name, condition="text", text_encoder=None, text_max_length=32, vae="none",
                            qk_norm=False, num_classes=5, learn_sigma=True, class_dropout_prob=0.1, in_channels=3,
                            input_size=8, num_frames=frames, text_dim=TEXT_DIM),
              "data": dict(image_size=8, num_frames=frames, frame_interval=3)}
    export_safetensors(model.state_dict(), config, path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("stream") / "t.safetensors")


@pytest.fixture()
def prompt_file(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(PROMPTS) + "\n")
    return f


def _run(ckpt, prompt_file, out, *extra):
    return cli.main(["sample", "--ckpt", str(ckpt), "--prompt_file", str(prompt_file), "--out", str(out),
                     "--num_sampling_steps", "3", "--device", "cpu", "--seed", "7", *extra])


def _names():
    return [f"{i:03d}-{slug(p)}.png" for i, p in enumerate(PROMPTS)]


def _read(folder):
    out = {}
    for name in _names():
        with Image.open(folder / name) as img:
            out[name] = np.array(img)
    return out


def test_stream_writes_resumes_and_ignores_batch_size(ckpt, prompt_file, tmp_path):
    a = tmp_path / "a"
    assert _run(ckpt, prompt_file, a, "--batch_size", "2") == 0
    assert sorted(p.name for p in a.iterdir()) == sorted(_names())
    first = _read(a)
    assert all(v.shape == (8, 8, 3) and v.dtype == np.uint8 for v in first.values())
    assert len({v.tobytes() for v in first.values()}) == 5  # different prompts and seeds: different samples
    # resume: delete two, re-run; exactly those two are rewritten, pixel-identical; the others are untouched
    stamps = {n: (a / n).stat().st_mtime_ns for n in _names()}
    gone = [_names()[1], _names()[3]]
    for n in gone:
        (a / n).unlink()
    assert _run(ckpt, prompt_file, a, "--batch_size", "2") == 0
    again = _read(a)
    for n in _names():
        assert np.array_equal(again[n], first[n]), n
        if n not in gone:
            assert (a / n).stat().st_mtime_ns == stamps[n], n
    # a complete folder: nothing to draw
    assert _run(ckpt, prompt_file, a, "--batch_size", "2") == 0
    assert all((a / n).stat().st_mtime_ns == stamps[n] for n in _names() if n not in gone)
    # batch size 5 (one batch) gives the same samples as batches of 2
    b = tmp_path / "b"
    assert _run(ckpt, prompt_file, b, "--batch_size", "5") == 0
    second = _read(b)
    for n in _names():
        assert np.array_equal(second[n], first[n]), n
    # another seed: other samples
    c = tmp_path / "c"
    assert cli.main(["sample", "--ckpt", str(ckpt), "--prompt_file", str(prompt_file), "--out", str(c),
                     "--num_sampling_steps", "3", "--device", "cpu", "--seed", "8"]) == 0
    assert not any(np.array_equal(v, first[n]) for n, v in _read(c).items())


@pytest.mark.parametrize("sampler", ["dpm++", "euler", "ddim"])
def test_stream_with_samplers(ckpt, prompt_file, tmp_path, sampler):
    out = tmp_path / sampler
    assert _run(ckpt, prompt_file, out, "--batch_size", "3", "--sampler", sampler) == 0
    imgs = _read(out)
    assert len(imgs) == 5 and all(v.std() > 0 for v in imgs.values())


def test_prompt_file_with_png_out_is_a_grid_and_npz_is_refused(ckpt, prompt_file, tmp_path, capsys):
    png = tmp_path / "grid.png"
    assert _run(ckpt, prompt_file, png, "--batch_size", "2") == 0
    assert png.is_file()
    assert _run(ckpt, prompt_file, tmp_path / "f", "--save_npz", str(tmp_path / "x.npz")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ditforge sample: error: --save_npz") and not (tmp_path / "f").exists()


def test_stream_video_resumes(tmp_path, prompt_file):
    ckpt = _export(tmp_path / "v.safetensors", name="vDiT-T/122", frames=2)
    out = tmp_path / "vids"
    assert _run(ckpt, prompt_file, out, "--batch_size", "4", "--sampler", "dpm++") == 0
    stems = [f"{i:03d}-{slug(p)}" for i, p in enumerate(PROMPTS)]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{s}.{e}" for s in stems for e in ("mp4", "gif"))
    gif = (out / f"{stems[2]}.gif").read_bytes()
    (out / f"{stems[2]}.gif").unlink()  # an incomplete pair is redrawn (the GIF is written last)
    stamp = (out / f"{stems[0]}.mp4").stat().st_mtime_ns
    assert _run(ckpt, prompt_file, out, "--batch_size", "4", "--sampler", "dpm++") == 0
    assert (out / f"{stems[2]}.gif").read_bytes() == gif  # byte-identical GIF (Pillow, deterministic)
    assert (out / f"{stems[0]}.mp4").stat().st_mtime_ns == stamp
