"""``ditforge distill --eval_every`` of a pipeline teacher (``train/distill_eval.py``) on the tiny random Wan 2.1
folder and a tiny random CLIP (``test_clip_score.tiny_clip``): the CLIP scores logged for the student at each
evaluation equal ``clip_score`` of the videos ``ditforge sample --ckpt`` draws from that step's checkpoint, and the
teacher's equal ``clip_score`` of ``WanPipeline.__call__``'s own videos from the same seeds; the refusals."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from ditforge import cli
from ditforge.data.sampler import derive_seed
from families import assert_one_line_error
from test_clip_score import tiny_clip
from test_distill_video import SCALE, SEED, distill_argv, prompt_file

__all__ = ["prompt_file", "tiny_clip"]  # fixtures of test_distill_video's and test_clip_score's, used here
EVAL_PROMPTS = ["a red ball rolls on the grass", "a dog runs to the sea"]
# Tolerance of the student's score: the run samples its LoRA live, ``sample --ckpt`` merged into the weights, which
# moves a frame's pixel by at most one level of 255 (test_distill_video's export test); the teacher's: the same call.
STUDENT_TOL, TEACHER_TOL = 2e-2, 1e-4


def scored_run(folder, prompt_file, clip, root, *extra: str) -> tuple:
    """A run of ``folder`` with a CLIP evaluation every iteration on ``EVAL_PROMPTS`` into ``root / "run"``;
    (run folder, the log's messages, the videos each ``clip_score`` call of the run scored: the teacher's first,
    then the student's at each evaluation)."""
    from ditforge.eval import clip_score as module

    lines = root / "validation.txt"
    lines.write_text("# the evaluation's prompts\n" + "\n".join(EVAL_PROMPTS) + "\n")
    out = root / "run"
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger, scored = logging.getLogger("ditforge"), []
    level, score = logger.level, module.clip_score

    def recorded(images, *args, **kwargs):
        scored.append(images.copy())
        return score(images, *args, **kwargs)

    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(module, "clip_score", recorded)
            assert cli.main(distill_argv(folder, prompt_file, out, "--eval_every", "1", "--validation_prompts",
                                         str(lines), "--clip", str(clip), *extra)) == 0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return out, messages, scored


def pipeline_videos(pipe, seed: int = SEED, **call) -> np.ndarray:
    """The pipeline's own videos of ``EVAL_PROMPTS`` (N, 5, 16, 16, 3) uint8, prompt i from ``derive_seed(seed,
    i)`` (the run's ``--seed``): its call's default 50 steps, guided as ``call`` says against ""."""
    videos = []
    for i, prompt in enumerate(EVAL_PROMPTS):
        frames = pipe(prompt=prompt, height=16, width=16, num_frames=5, output_type="np",
                      generator=torch.Generator().manual_seed(derive_seed(seed, i)), **call).frames
        videos.append(np.round(np.asarray(frames[0]) * 255).astype(np.uint8))
    return np.stack(videos)


@pytest.fixture(scope="module")
def eval_run(wan_pipeline, prompt_file, tiny_clip, tmp_path_factory, one_thread_module):
    """2 iterations, an evaluation after each (the first between two log lines, the second with the log line of
    step 2), a checkpoint after each (``scored_run``)."""
    return scored_run(wan_pipeline, prompt_file, tiny_clip, tmp_path_factory.mktemp("distill_eval"), "--max_steps",
                      "2", "--log_every", "2")


def test_scores_equal_sample_ckpt_and_the_pipelines_call(eval_run, wan_pipeline, tiny_clip, tmp_path):
    from diffusers import WanPipeline

    from ditforge.eval.clip_score import clip_score

    run, _, scored_videos = eval_run
    assert len(scored_videos) == 3
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = {r["step"]: r for r in records if "clip_score_student" in r}
    assert sorted(scored) == [1, 2] and "critic_loss" not in scored[1] and "critic_loss" in scored[2]
    videos = pipeline_videos(WanPipeline.from_pretrained(str(wan_pipeline), local_files_only=True),
                             guidance_scale=SCALE)
    # the videos the run scored: the pipeline's own, and ``sample --ckpt``'s of that step (one level of 255: the
    # merged LoRA), which differ from the teacher's
    np.testing.assert_array_equal(scored_videos[0], videos)
    teacher = clip_score(videos, EVAL_PROMPTS, tiny_clip)
    students = []
    for step in (1, 2):
        npz = tmp_path / f"student{step}.npz"
        assert cli.main(["sample", "--ckpt", str(run / "checkpoints" / f"step-{step:07d}"), "--seed", str(SEED),
                         *[a for p in EVAL_PROMPTS for a in ("--prompt", p)], "--device", "cpu", "--out",
                         str(tmp_path / f"student{step}"), "--save_npz", str(npz)]) == 0
        samples = np.load(npz)["samples"]
        assert samples.shape == (2, 5, 16, 16, 3)
        assert np.abs(scored_videos[step].astype(int) - samples).max() <= 1
        assert np.abs(scored_videos[step].astype(int) - scored_videos[0]).max() > 16
        students.append(clip_score(samples, EVAL_PROMPTS, tiny_clip))
    for step, student in zip((1, 2), students):
        assert scored[step]["clip_score_teacher"] == pytest.approx(teacher, abs=TEACHER_TOL)
        assert scored[step]["clip_score_student"] == pytest.approx(student, abs=STUDENT_TOL)
    assert min(students + [teacher]) > 0  # not all clamped to 0


def test_scores_in_the_log(eval_run):
    _, messages, _ = eval_run
    assert any(m.startswith("CLIP evaluation: 2 prompts") for m in messages)
    assert any(m.startswith("step 1: CLIP score of the student") for m in messages)
    assert any(m.startswith("step 2/2") and "CLIP student" in m for m in messages)


def test_bad_input_one_line(wan_pipeline, prompt_file, tiny_clip, tmp_path, capsys):
    lines = tmp_path / "validation.txt"
    lines.write_text("a cat --w 32\n")
    out = str(tmp_path / "bad")
    assert_one_line_error(capsys, distill_argv(wan_pipeline, prompt_file, out, "--eval_every", "1",
                                               "--validation_prompts", str(lines)), "--clip", "give all three")
    assert_one_line_error(capsys, distill_argv(wan_pipeline, prompt_file, out, "--clip", str(tiny_clip)),
                          "--eval_every", "give all three")
    assert_one_line_error(capsys, distill_argv(wan_pipeline, prompt_file, out, "--eval_every", "1",
                                               "--validation_prompts", str(lines), "--clip", str(tiny_clip)),
                          f"{lines}:1", "--width", "at most --seed")
    lines.write_text("a cat\n")
    assert_one_line_error(capsys, distill_argv(wan_pipeline, prompt_file, out, "--eval_every", "1",
                                               "--validation_prompts", str(lines), "--clip", str(tiny_clip),
                                               "--plugin", "fsdp"), "--eval_every", "--plugin fsdp")
