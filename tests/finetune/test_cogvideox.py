"""CogVideoX's own fine-tuning tests (``ditforge train --init_from COGVIDEOX_FOLDER --data clips``, ``ditforge
sample``), end to end on the CPU with the tiny random pipelines of ``tiny_pipelines.make_cogvideox`` (32 px, 9 frames:
latents 4 x 3 x 4 x 4): the one-line errors (the 8k + 1 frame rule, CogVideoX 1.5 folders), and image to video
(``CogVideoXImageToVideoPipeline``) with the clean first frame (``--no-noised_image_input``). What every video family
shares (first loss, resume, export, LoRA file, features) is in test_video_families.py, what every image-to-video
family shares (first loss, sampling like the pipeline) in test_i2v_families.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ditforge import cli
from ditforge.train.logging import read_metrics
from families import VIDEO, assert_one_line_error  # tests/finetune is on sys.path
from references import cogvideox_i2v_first_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def _argv(folder: Path, out: Path, *extra: str) -> list[str]:
    return VIDEO["cogvideox"].argv(folder, out, *extra)


def test_bad_input_lines(cogvideox_pipeline, tmp_path, capsys):
    """One line, exit 2, nothing written: a frame count CogVideoX's VAE does not decode back (8k + 1: 5 frames
    give 2 latent frames, which decode to 8), naming the nearest valid counts; a CogVideoX 1.5 folder
    (``patch_size_t``)."""
    assert_one_line_error(capsys, _argv(cogvideox_pipeline, tmp_path / "r", "--max_steps", "1", "--num_frames", "5"),
                          "--num_frames 5", "8k + 1", "1 and 9")
    assert not (tmp_path / "r").exists()
    from diffusers import CogVideoXTransformer3DModel

    folder = tmp_path / "cog15"
    shutil.copytree(cogvideox_pipeline, folder)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    shutil.rmtree(folder / "transformer")
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    CogVideoXTransformer3DModel(**{**config, "patch_size_t": 2}).save_pretrained(folder / "transformer")
    assert_one_line_error(capsys, _argv(folder, tmp_path / "r", "--max_steps", "1"), "--init_from",
                          "CogVideoX 1.5", "patch_size_t")
    assert not (tmp_path / "r").exists() or not (tmp_path / "r" / "checkpoints").exists()


def test_i2v_clean_image_input_first_loss(cogvideox_i2v_pipeline, i2v_runs, tmp_path):
    """Image-to-video with ``--no-noised_image_input`` (the clean first frame's posterior mode): the first loss
    equals ``references.cogvideox_i2v_first_loss``'s clean form within 1e-5 relative, and differs from the default
    run's (``i2v_runs``: CogVideoX's training noise on the frame, its first loss held to the noised form in
    test_i2v_families.py): the noise reaches the loss."""
    clean = tmp_path / "clean"
    assert cli.main(_argv(cogvideox_i2v_pipeline, clean, "--max_steps", "1", "--no-noised_image_input")) == 0
    plain = cogvideox_i2v_first_loss(cogvideox_i2v_pipeline, noised_image_input=False)
    assert read_metrics(clean / "metrics.jsonl")[0]["loss"] == pytest.approx(plain, rel=1e-5)
    noised = read_metrics(i2v_runs("cogvideox_i2v") / "metrics.jsonl")[0]["loss"]
    assert abs(noised - plain) > 1e-3 * plain
