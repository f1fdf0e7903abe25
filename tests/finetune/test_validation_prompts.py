"""``ditforge train --validation_prompts FILE`` (``ditforge.train.validation``): the file's lines (musubi-tuner's
syntax) parsed and refused one line each; the samples written as PNG / MP4 of the asked sizes and frame counts (read
back with Pillow and PyAV) for an image pipeline (SD), two video families (Wan text-to-video, Wan image-to-video
with ``--i``) and a text DiT; a sample at step N against ``ditforge sample`` of that step's checkpoint (same prompt,
seed, steps, guidance and negative prompt) to one uint8 level; and the training itself unchanged by the rendering
(the losses of a run without them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ditforge import cli
from ditforge.data.video import display_scale
from ditforge.errors import UserError
from ditforge.train.logging import read_metrics
from ditforge.train.validation import ValidationSample, read_validation_prompts
from families import VIDEO, assert_one_line_error  # tests/finetune is on sys.path

pytestmark = pytest.mark.usefixtures("one_thread")


def _frames(path: Path) -> np.ndarray:
    """The decoded frames (T, H, W, 3) uint8 of a video file."""
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_read_validation_prompts(tmp_path):
    """musubi-tuner's lines: blank lines and # comments skipped, options after `` --`` in any case and order,
    ``--d`` as ``--seed``, a negative prompt with its spaces and commas; the line numbers are the file's."""
    path = tmp_path / "v.txt"
    path.write_text("# samples\n\na corgi, running --W 48 --h 32 --f 9 --s 7 --g 4.5 --d 3 --n blurry, low quality\n"
                    "   # indented comment\nsecond prompt --seed 11 --i first.png\nthird\n", encoding="utf-8")
    assert read_validation_prompts(str(path)) == [
        ValidationSample(3, "a corgi, running", 48, 32, 9, 7, 4.5, 3, "blurry, low quality"),
        ValidationSample(5, "second prompt", seed=11, image="first.png"),
        ValidationSample(6, "third")]


@pytest.mark.parametrize("line, needle", [
    ("a dog --w 0", "--w '0': expected a positive integer"),
    ("a dog --h 3.5", "--h '3.5': expected a positive integer"),
    ("a dog --g -1", "--g '-1': expected a number >= 0"),
    ("a dog --seed x", "--seed 'x': expected an integer >= 0"),
    ("a dog --l 4", "--l: unknown option"),
    ("a dog --s 3 --s 4", "--s: given twice"),
    ("a dog --n", "--n '': expected a non-empty text"),
    ("--w 32 a dog", "expected the prompt first"),
])
def test_bad_lines(tmp_path, line, needle):
    path = tmp_path / "v.txt"
    path.write_text(f"# first\nok\n{line}\n")
    with pytest.raises(UserError) as e:
        read_validation_prompts(str(path))
    assert f"--validation_prompts {path}:3: " in str(e.value) and needle in str(e.value), e.value


def _wan_argv(folder, out, prompts, *extra):
    return VIDEO["wan"].argv(folder, out, "--validation_prompts", str(prompts), "--sample_every", "1", *extra)


def test_bad_line_is_one_line_before_training(wan_pipeline, wan_i2v_pipeline, sd_pipeline, tmp_path, capsys):
    """Exit 2 with one line naming the file, the line and the option, before any step (no metrics, no checkpoint):
    the syntax before the pipeline loads, then what the pipeline decides (its side multiple, the VAE's frame rule,
    an image-to-video pipeline's --i, an image pipeline's frames); and one line for sharded weights."""
    prompts = tmp_path / "v.txt"
    cases = [(wan_pipeline, "a cat --x 1", ":1: --x: unknown option"),
             (wan_pipeline, "a cat --w 24", ":1: --w 24: WanPipeline takes sides that are multiples of 16"),
             (wan_pipeline, "a cat\na dog --f 4", ":2: --f 4: WanPipeline's VAE takes 4 k + 1 frames"),
             (wan_i2v_pipeline, "a cat", ":1: --i: WanImageToVideoPipeline is image-to-video"),
             (wan_i2v_pipeline, f"a cat --i {tmp_path / 'none.png'}", ":1: --i "),
             (sd_pipeline, "a cat --f 5", ":1: --f 5: StableDiffusionPipeline makes images")]
    for k, (folder, text, needle) in enumerate(cases):
        prompts.write_text(text + "\n")
        out = tmp_path / f"run{k}"
        argv = (_sd_argv(folder, _captioned(tmp_path), out, prompts) if folder == sd_pipeline
                else _wan_argv(folder, out, prompts))
        assert_one_line_error(capsys, argv, f"--validation_prompts {prompts}{needle}")
        assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    # sharded weights (FSDP2 offloads even in one process): process 0 alone cannot run the model
    prompts.write_text("a cat\n")
    assert_one_line_error(capsys, _wan_argv(wan_pipeline, tmp_path / "fsdp", prompts, "--plugin", "fsdp",
                                            "--cpu_offload", "all"), "--validation_prompts: process 0 renders",
                          "--plugin fsdp splits")


def _sd_argv(folder, data, out, prompts, *extra):
    return ["train", "--init_from", str(folder), "--data", str(data), "--image_size", "32", "--batch_size", "2",
            "--log_every", "1", "--sample_every", "1", "--mixed_precision", "fp32", "--device", "cpu",
            "--num_workers", "0", "--validation_prompts", str(prompts), "--outputs", str(out), *extra]


def _captioned(tmp_path: Path) -> Path:
    """A folder of 4 random 32 px images, each with its caption beside it."""
    folder = tmp_path / "captioned"
    if not folder.exists():
        folder.mkdir()
        rng = np.random.default_rng(0)
        for i in range(4):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
            (folder / f"{i}.txt").write_text(f"a photo number {i}")
    return folder


def test_wan_samples_sizes_frames_and_like_ditforge_sample(wan_pipeline, tmp_path, monkeypatch):
    """A LoRA run of the tiny Wan (16 px, 5 frames): line 1 an image of 32 x 16 in 2 steps with a negative prompt,
    line 2 a 9-frame clip of 16 x 32 in 3 steps; at steps 1 and 2 a PNG of 16 x 32 and an MP4 of 9 frames (of the
    asked size, times ``display_scale``). The step-1 image equals ``ditforge sample`` of the step-1 checkpoint
    (``derive_seed(0, 0)`` both) to one uint8 level. The pipeline's call got the one denoiser of the run at both
    steps (no copy), in eval mode without gradients, and drew other pixels at step 2 than at step 1 (the tiny VAE
    decodes nearly flat frames, which uint8 files cannot tell apart: the floats are compared); the losses equal a
    run's without validation samples (the rendering leaves the training as it was)."""
    import torch

    from ditforge.train import validation

    calls = []

    def spy(pre, denoiser, *args, **kwargs):
        pixels = real(pre, denoiser, *args, **kwargs)
        calls.append((denoiser, denoiser.training, torch.is_grad_enabled(), pixels))
        return pixels

    real = validation.generate_with_pipeline
    monkeypatch.setattr(validation, "generate_with_pipeline", spy)
    prompts = tmp_path / "v.txt"
    prompts.write_text("a red car --w 32 --h 16 --f 1 --s 2 --n blurry\na cat jumps --w 16 --h 32 --f 9 --s 3 --g 3\n")
    run, plain = tmp_path / "run", tmp_path / "plain"
    common = ("--max_steps", "2", "--ckpt_every", "1", "--ema_decay", "0", "--lora_rank", "4", "--lr", "1e-2")
    assert cli.main(_wan_argv(wan_pipeline, run, prompts, *common)) == 0
    assert len(calls) == 4 and all(c[0] is calls[0][0] and not c[1] and not c[2] for c in calls)
    assert calls[0][3].shape == (1, 3, 1, 16, 32) and not torch.equal(calls[0][3], calls[2][3])
    for step in (1, 2):
        folder = run / "samples" / f"step-{step:07d}"
        assert sorted(p.name for p in folder.iterdir()) == ["001-a-red-car.png", "002-a-cat-jumps.mp4"]
        assert np.asarray(Image.open(folder / "001-a-red-car.png")).shape == (16, 32, 3)
        k = display_scale(32, 16)
        assert _frames(folder / "002-a-cat-jumps.mp4").shape == (9, 32 * k, 16 * k, 3)
    npz = tmp_path / "s.npz"
    assert cli.main(["sample", "--ckpt", str(run / "checkpoints" / "step-0000001"), "--prompt", "a red car",
                     "--negative_prompt", "blurry", "--height", "16", "--width", "32", "--num_frames", "1",
                     "--num_sampling_steps", "2", "--cfg_scale", "5", "--out", str(tmp_path / "s"), "--save_npz",
                     str(npz), "--device", "cpu", "--mixed_precision", "fp32"]) == 0
    first = np.asarray(Image.open(run / "samples" / "step-0000001" / "001-a-red-car.png")).astype(np.int16)
    assert np.abs(np.load(npz)["samples"][0, 0].astype(np.int16) - first).max() <= 1
    assert cli.main(VIDEO["wan"].argv(wan_pipeline, plain, *common)) == 0
    assert [r["loss"] for r in read_metrics(run / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(plain / "metrics.jsonl")]


def test_wan_i2v_samples_from_their_first_frames(wan_i2v_pipeline, tmp_path, monkeypatch):
    """Wan image-to-video with ``--i``: an image of 16 x 32 from one first frame and a 9-frame clip of 32 x 16
    from another, at the end of a 1-step run; the pipeline's call got each line's image, as read from its file."""
    from ditforge.train import validation

    given = []

    def spy(*args, images=None, **kwargs):
        given.append(np.asarray(images[0]))
        return real(*args, images=images, **kwargs)

    real = validation.generate_with_pipeline
    monkeypatch.setattr(validation, "generate_with_pipeline", spy)
    rng = np.random.default_rng(4)
    first = {name: rng.integers(0, 256, (24, 40, 3), dtype=np.uint8) for name in ("a.png", "b.png")}
    for name, pixels in first.items():
        Image.fromarray(pixels).save(tmp_path / name)
    prompts = tmp_path / "v.txt"
    prompts.write_text(f"a boat --i {tmp_path / 'a.png'} --w 32 --h 16 --f 1 --s 2\n"
                       f"a boat sails --i {tmp_path / 'b.png'} --w 16 --h 32 --f 9 --s 2\n")
    run = tmp_path / "run"
    assert cli.main(_wan_argv(wan_i2v_pipeline, run, prompts, "--max_steps", "1")) == 0
    assert len(given) == 2 and np.array_equal(given[0], first["a.png"]) and np.array_equal(given[1], first["b.png"])
    folder = run / "samples" / "step-0000001"
    assert np.asarray(Image.open(folder / "001-a-boat.png")).shape == (16, 32, 3)
    k = display_scale(32, 16)
    assert _frames(folder / "002-a-boat-sails.mp4").shape == (9, 32 * k, 16 * k, 3)


def test_sd_samples_like_ditforge_sample(sd_pipeline, tmp_path):
    """An image pipeline (SD, trained at 32 px): a 48 x 32 image in 2 steps and a 32 px one in 3 steps at guidance
    3; the second equals ``ditforge sample --image_size 32`` of the run's checkpoint at ``--seed`` 5 (the line's
    ``--seed derive_seed(5, 0)``) to one uint8 level."""
    from ditforge.data.sampler import derive_seed

    prompts = tmp_path / "v.txt"
    prompts.write_text("a photo number 1 --w 48 --h 32 --s 2\n"
                       f"a photo number 2 --s 3 --g 3 --seed {derive_seed(5, 0)}\n")
    run = tmp_path / "run"
    assert cli.main(_sd_argv(sd_pipeline, _captioned(tmp_path), run, prompts, "--max_steps", "1", "--lora_rank", "4",
                             "--lr", "1e-2", "--ema_decay", "0")) == 0
    folder = run / "samples" / "step-0000001"
    assert np.asarray(Image.open(folder / "001-a-photo-number-1.png")).shape == (32, 48, 3)
    npz = tmp_path / "s.npz"
    assert cli.main(["sample", "--ckpt", str(run), "--prompt", "a photo number 2", "--image_size", "32",
                     "--num_sampling_steps", "3", "--cfg_scale", "3", "--seed", "5", "--out", str(tmp_path / "s.png"),
                     "--save_npz", str(npz), "--device", "cpu"]) == 0
    mine = np.asarray(Image.open(folder / "002-a-photo-number-2.png")).astype(np.int16)
    assert np.abs(np.load(npz)["samples"][0].astype(np.int16) - mine).max() <= 1


def test_text_dit_samples_like_ditforge_sample(tmp_path):
    """A text DiT (DiT-T/2 on 8 px captioned images, pixel space, the shipped MiniLM): its sample of a line with
    --s 3 --g 2 --seed 5 equals ``ditforge sample --seed 5 --sampler ddpm`` of the run exactly as uint8 (the same
    guided DDPM loop on the same weights)."""
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(f"a photo number {i}")
    prompts, run, npz = tmp_path / "v.txt", tmp_path / "run", tmp_path / "s.npz"
    prompts.write_text("a photo number 1 --s 3 --g 2 --seed 5\n")
    assert cli.main(["train", "--model", "DiT-T/2", "--data", str(data), "--condition", "text", "--image_size", "8",
                     "--vae", "none", "--text_max_length", "32", "--batch_size", "2", "--max_steps", "1",
                     "--log_every", "1", "--sample_every", "1", "--ema_decay", "0", "--mixed_precision", "fp32",
                     "--device", "cpu", "--num_workers", "0", "--validation_prompts", str(prompts), "--outputs",
                     str(run)]) == 0
    assert cli.main(["sample", "--ckpt", str(run), "--prompt", "a photo number 1", "--num_sampling_steps", "3",
                     "--cfg_scale", "2", "--seed", "5", "--sampler", "ddpm", "--out", str(tmp_path / "s.png"),
                     "--save_npz", str(npz), "--device", "cpu"]) == 0
    mine = np.asarray(Image.open(run / "samples" / "step-0000001" / "001-a-photo-number-1.png"))
    assert np.array_equal(np.load(npz)["samples"][0], mine)
