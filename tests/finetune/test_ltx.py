"""LTX-Video's own fine-tuning tests (``ditforge train --init_from LTX_FOLDER --data clips``, ``ditforge sample``),
end to end on the CPU with the tiny random pipelines of ``tiny_pipelines.make_ltx`` (32 px, 5 frames: latents
8 x 2 x 8 x 8): image to video (``LTXImageToVideoPipeline``) against ``references.ltx_first_loss`` and the pipeline's
own call; the frame rule. What every video family shares (first loss, resume, export, LoRA file) is in
test_video_families.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ditforge import cli
from ditforge.train.logging import read_metrics
from families import VIDEO, assert_image_to_video_run_samples_like_its_export, assert_one_line_error  # on sys.path
from references import ltx_first_loss
from tiny_pipelines import BUILDERS

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE, FRAMES = VIDEO["ltx"].size, VIDEO["ltx"].frames  # 32 px, 5 = 4 x 1 + 1 frames: 2 latent frames of 8 x 8


def _argv(folder: Path, out: Path, *extra: str) -> list[str]:
    return VIDEO["ltx"].argv(folder, out, *extra)


def test_image_to_video_first_loss_and_sample(tmp_path):
    """``LTXImageToVideoPipeline``: a full run's first loss equals ``references.ltx_first_loss``'s image-to-video form
    (1e-5 relative), and ``ditforge sample --image`` of the run draws what the exported pipeline's own call draws
    from the same seed (its first latent frame a draw from the image's posterior, before the noise), frames within
    one uint8 level."""
    folder = BUILDERS["ltx_i2v"](tmp_path / "pipe")
    run = tmp_path / "run"
    assert cli.main(_argv(folder, run, "--max_steps", "1", "--lr", "1e-3")) == 0
    ref, _ = ltx_first_loss(folder, image_to_video=True)
    assert read_metrics(run / "metrics.jsonl")[0]["loss"] == pytest.approx(ref, rel=1e-5)
    assert_image_to_video_run_samples_like_its_export(run, tmp_path, "LTXImageToVideoPipeline", SIZE, FRAMES, 3.0)


def test_num_frames_the_vae_cannot_take(ltx_pipeline, tmp_path, capsys):
    """6 frames: one line naming the nearest valid counts of the tiny VAE's 4k + 1 (the real one's: 8k + 1)."""
    assert_one_line_error(capsys, _argv(ltx_pipeline, tmp_path / "r", "--max_steps", "1", "--num_frames", "6"),
                          "--num_frames 6", "4k + 1", "5 and 9")
