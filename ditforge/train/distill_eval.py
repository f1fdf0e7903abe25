"""``ditforge distill --eval_every N`` of a text-to-video pipeline teacher: every N iterations and at the end, the
CLIP score (``eval.clip_score``: every frame against its prompt, averaged) of the student's videos of
``--validation_prompts`` and of the teacher's, as ``clip_score_student`` / ``clip_score_teacher`` in metrics.jsonl
and the log line.

The student draws as ``ditforge sample --ckpt RUN`` draws it (``sample.student.student_videos``, which ``cli``
hands over: its K steps, no guidance, video i from ``derive_seed(--seed, i)`` or its line's ``--seed``), with the
weights being trained (its adapter active, under the run's autocast). The teacher draws through its pipeline's own
call (``generate_with_pipeline``, its adapters disabled) in the call's default steps, guided at the run's scale
(a second expert at its ``--cfg_scale_2``) against the empty prompt, from the same seeds; it does not change, so it
is drawn and scored once, when the run starts. Both at the run's frame size. Process 0 draws and scores alone.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from ditforge.data.images import to_uint8
from ditforge.data.sampler import derive_seed
from ditforge.errors import UserError
from ditforge.train.validation import FLAG, read_validation_prompts

log = logging.getLogger(__name__)


def check_eval_flags(cfg) -> None:
    """``--eval_every`` / ``--validation_prompts`` / ``--clip`` of a pipeline teacher: all three or none, and not
    with ``--plugin fsdp`` or ``--sequence_parallel_size`` (process 0 draws the evaluation's videos alone, which a
    sharded or split network cannot: its calls are collectives). Raises UserError (one line naming the flag)."""
    given = {"--eval_every": bool(cfg.eval_every), FLAG: cfg.validation_prompts is not None,
             "--clip": cfg.clip is not None}
    if any(given.values()) and not all(given.values()):
        missing = next(flag for flag, on in given.items() if not on)
        raise UserError(f"{missing}: a pipeline teacher's --eval_every scores the student's and the teacher's videos "
                        "of --validation_prompts FILE by their CLIP score with --clip FOLDER; give all three, or none")
    if cfg.eval_every and (cfg.plugin == "fsdp" or cfg.sequence_parallel_size > 1):
        raise UserError("--eval_every: process 0 draws the evaluation's videos alone, which a sharded or split "
                        "network cannot (its calls are collectives); leave --eval_every out under --plugin fsdp or "
                        "--sequence_parallel_size")


def eval_prompts(cfg, pre) -> list:
    """``--validation_prompts``' samples (``read_validation_prompts``) for the evaluation, checked on every process
    before any step.

    Raises:
        UserError (one line): an image-to-video or reference-image teacher (its first frames or references are
            not drawn here yet), a line with an option other than ``--seed``, ``read_validation_prompts``' errors.
    """
    den = pre.denoiser
    if den.image_to_video or den.takes_references:
        raise UserError(f"--eval_every: the CLIP evaluation draws text-to-video; --teacher {cfg.teacher} is a "
                        f"{pre.pipeline_class}, whose first frames or references it does not draw yet; give "
                        "--eval_every 0")
    samples = read_validation_prompts(cfg.validation_prompts)
    for s in samples:
        given = [name for name in ("width", "height", "frames", "steps", "guidance", "negative", "image")
                 if getattr(s, name) is not None]
        if given:
            raise UserError(f"{FLAG} {cfg.validation_prompts}:{s.line}: --{given[0]}: the distillation's evaluation "
                            "draws the student in its steps without guidance and the teacher in its call's, both at "
                            "the run's size; give the prompt and at most --seed")
    return samples


class ClipEval:
    """The evaluation of the module docstring for one run, on process 0: ``samples``, ``eval_prompts``' (checked
    on every process); ``student_of(cond)``: (x_t, model timesteps) -> the student's output under one prompt's
    conditioning (``distill_pipeline.nets``' student); ``scales``: the teacher's guidance (a two-expert
    pipeline's low-noise one second, else None); ``sizes``: the latents'
    shape (B, C, T', h, w), height, width, frames; ``draw_student``: ``sample.student.student_videos``; ``use``:
    ``Networks.use`` (None: the teacher, adapters disabled). Raises UserError: ``clip_score``'s errors (the
    teacher's score is computed here, before any step)."""

    def __init__(self, cfg, pre, samples: list, student_of: Callable, scales: tuple, sizes, amp: torch.dtype,
                 draw_student: Callable, use: Callable[[str | None], None]):
        den = pre.denoiser
        self.cfg, self.pre, self.student_of, self.amp = cfg, pre, student_of, amp
        self.draw_student, self.use = draw_student, use
        self.prompts = [s.prompt for s in samples]
        self.seeds = [derive_seed(cfg.seed, k) if s.seed is None else s.seed for k, s in enumerate(samples)]
        shape, self.height, self.width, self.frames = sizes
        from ditforge.encoders import VAE

        vae = VAE(pre.pipe.vae, frame_factor=den.vae_frame_factor, folds_pixels=den.vae_folds_pixels)
        self.shape = (1, *shape[1:])
        self.prepended = shape[2] - vae.latent_frames(self.frames)  # the pipeline's padding frames
        tic = time.perf_counter()
        self.teacher = self._score(self._teacher_videos(*scales))
        log.info("CLIP evaluation: %d prompts of %s; the teacher's CLIP score %.4f (%.1f s)", len(self.prompts),
                 cfg.validation_prompts, self.teacher, time.perf_counter() - tic)

    def _teacher_videos(self, scale: float, scale_2: float | None):
        from ditforge.models.adapters.pipeline import generate_with_pipeline, pipeline_defaults

        self.use(None)
        steps = pipeline_defaults(self.pre.pipe)["num_inference_steps"]
        device = self.pre.device
        with torch.no_grad(), torch.autocast(device.type, dtype=self.amp, enabled=self.amp != torch.float32):
            pixels = generate_with_pipeline(self.pre, self.pre.denoiser, self.prompts, self.seeds,
                                            (self.height, self.width), steps, scale, batch_size=1,
                                            num_frames=self.frames, guidance_scale_2=scale_2)
        return to_uint8(pixels)  # (N, T, H, W, 3)

    def _score(self, videos) -> float:
        from ditforge.eval.clip_score import clip_score

        return clip_score(videos, self.prompts, self.cfg.clip, self.pre.device)

    def __call__(self, step: int) -> dict[str, float]:
        """{clip_score_student, clip_score_teacher} at iteration ``step``."""
        tic = time.perf_counter()
        # (the student's calls run under the run's autocast, distill_pipeline.nets')
        videos = self.draw_student(self.pre, self.student_of, self.prompts, self.seeds, self.shape,
                                   self.cfg.student_steps, self.prepended)
        out = {"clip_score_student": self._score(videos), "clip_score_teacher": self.teacher}
        log.info("step %d: CLIP score of the student %.4f, of the teacher %.4f (%d prompts, %.1f s)", step,
                 out["clip_score_student"], self.teacher, len(self.prompts), time.perf_counter() - tic)
        return out
