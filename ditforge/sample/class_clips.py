"""DreamBooth's class clips for a video pipeline's prior preservation (``--class_data``, ``ditforge.data.prior``),
drawn by ditforge's own video loop (``sample.video.sample_video_family``) around the run's base denoiser before any
LoRA is added. ``cli`` hands ``draw_class_clips`` to ``train.trainer.train``: the training layer does not import
the sampling one (pyproject's import contracts)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ditforge.atomic import atomic_path
from ditforge.data.captions import slug
from ditforge.data.prior import list_class_clips
from ditforge.errors import UserError
from ditforge.parallel.mesh import Dist
from ditforge.sample.load import SampleConfig
from ditforge.sample.video import sample_video_family

log = logging.getLogger(__name__)


def draw_class_clips(pre, prompt: str, folder: str, count: int, side: int, frames: int, steps: int, seed: int,
                     d: Dist) -> int:
    """Fill ``folder`` up to ``count`` class clips: those already there (videos not named as drawn ones) are
    counted, and the rest drawn as ``NNN-<prompt slug>.mp4`` (``side`` x ``side`` x ``frames``, ``steps`` steps of
    the pipeline's scheduler, its default guidance against the empty prompt, clip i from ``derive_seed(seed, i)``),
    each with ``NNN-<prompt slug>.txt`` holding ``prompt`` beside it. Drawn files that exist are not drawn again, so
    an interrupted run resumes. ``pre`` (a ``models.adapters.pipeline.Pretrained``): the run's base pipeline, its
    denoiser on ``d.device``; it is sampled in the dtype its weights have (no cast), and its text encoders, training
    mode and ``requires_grad`` flags are put back as they were. Every process of ``d`` takes part (the loop's collectives); process 0 writes.

    Returns:
        The clips drawn.
    Raises:
        UserError: the denoiser is not on the run's device (a base staged in host memory: ``--fp8_base``,
            ``--blocks_to_swap``, ``--gpu_memory_budget``); ``sample_video_family``'s.
    """
    name = slug(prompt)
    drawn = {p.name for p in list_class_clips(folder) if p.stem[:3].isdigit() and p.stem[4:] == name}
    wanted = count - (len(list_class_clips(folder)) - len(drawn))
    if wanted <= len(drawn):
        return 0
    weight = next(pre.denoiser.inner.parameters())
    if weight.device != d.device:
        raise UserError(f"--class_data {folder}: {count - len(drawn)} class clips to draw, and the base is held in "
                        f"host memory ({weight.device}) by --fp8_base / --blocks_to_swap / --gpu_memory_budget; draw "
                        "them in a run without those, or with ditforge sample --ckpt BASE --out FOLDER")
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(weight.dtype, "auto")
    cfg = SampleConfig(ckpt=str(pre.folder), prompt=[prompt] * wanted, out=str(folder), seed=seed, height=side,
                       width=side, num_frames=frames, num_sampling_steps=steps, mixed_precision=precision,
                       device=d.device.type)
    denoiser = pre.denoiser  # the loop sets it to eval, without gradients: put back after
    training, grads = denoiser.training, {n: p.requires_grad for n, p in denoiser.named_parameters()}
    homes = {n: next(m.parameters()).device for n, m in pre.pipe.components.items()
             if isinstance(m, torch.nn.Module) and any(True for _ in m.parameters())}
    log.info("%s: %d class clips there, drawing %d ('%s', %d steps)", folder, count - wanted + len(drawn),
             wanted - len(drawn), prompt, steps)
    Path(folder).mkdir(parents=True, exist_ok=True)
    try:
        with torch.no_grad():
            sample_video_family(cfg, cfg.prompt, d, pre, pre.denoiser)
    finally:
        for n, device in homes.items():  # the loop moves the text encoders to the host
            pre.pipe.components[n].to(device)
        denoiser.train(training)
        for n, p in denoiser.named_parameters():
            p.requires_grad_(grads[n])
    if d.is_main:
        digits = max(3, len(str(wanted - 1)))
        for i in range(wanted):
            with atomic_path(Path(folder) / f"{i:0{digits}d}-{name}.txt") as tmp:
                tmp.write_text(prompt)
    d.barrier()
    return wanted - len(drawn)
