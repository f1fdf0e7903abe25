"""LTX-Video's own fine-tuning tests (``ditforge train --init_from LTX_FOLDER --data clips``), end to end on the CPU
with the tiny random pipeline of ``tiny_pipelines.make_ltx`` (32 px, 5 frames: latents 8 x 2 x 8 x 8): the frame
rule. What every video family shares (first loss, resume, export, LoRA file) is in test_video_families.py, what
every image-to-video family shares (``LTXImageToVideoPipeline``: first loss, sampling like the pipeline) in
test_i2v_families.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from families import VIDEO, assert_one_line_error  # tests/finetune is on sys.path

pytestmark = pytest.mark.usefixtures("one_thread")


def _argv(folder: Path, out: Path, *extra: str) -> list[str]:
    return VIDEO["ltx"].argv(folder, out, *extra)


def test_num_frames_the_vae_cannot_take(ltx_pipeline, tmp_path, capsys):
    """6 frames: one line naming the nearest valid counts of the tiny VAE's 4k + 1 (the real one's: 8k + 1)."""
    assert_one_line_error(capsys, _argv(ltx_pipeline, tmp_path / "r", "--max_steps", "1", "--num_frames", "6"),
                          "--num_frames 6", "4k + 1", "5 and 9")
