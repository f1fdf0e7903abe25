"""What a run shows while it trains: the periodic sample grids (PNG, or GIF for videos) drawn from the EMA
weights, or the ``--validation_prompts`` samples drawn with the weights being trained (``train.validation``), and
the built-in digits evaluation (--eval_every)."""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
from torch import nn

from ditforge.config.sections import RunConfig
from ditforge.data.images import make_grid, save_grid, to_uint8
from ditforge.data.sampler import derive_seed
from ditforge.diffusion import generate
from ditforge.encoders.batch import BatchEncoder
from ditforge.ops.attention import whole_sequences
from ditforge.parallel import unwrap
from ditforge.train import finetune, validation
from ditforge.train.build import Run, create_run_model

log = logging.getLogger(__name__)


@torch.no_grad()
def sample_grid(
    model: nn.Module, cond: dict[str, torch.Tensor], shape: tuple[int, ...], seed: int, cfg_scale: float = 4.0,
    num_steps: int = 100, learn_sigma: bool = True, clip_denoised: bool = True, objective: str = "ddpm",
    flow_shift: float | None = None, sampler: str | None = None,
) -> torch.Tensor:
    """Draw one sample per condition row (``cond`` as ``BatchEncoder.conditioning``) with ``sampler`` (default DDPM,
    Euler for a rectified-flow ``objective``) respaced to ``num_steps`` and guidance; (N, *shape) float32 (pixels
    in [-1, 1] or latents)."""
    y = cond["y"]
    g = torch.Generator(device=y.device).manual_seed(seed)
    return generate(model, y, shape, y_mask=cond.get("y_mask"), cfg_scale=cfg_scale, num_steps=num_steps,
                    sampler=sampler or ("euler" if objective == "flow" else "ddpm"), learn_sigma=learn_sigma, generator=g,
                    clip_denoised=clip_denoised, objective=objective, flow_shift=flow_shift or 1.0)


def _grid_conditioning(cfg: RunConfig, dataset, inputs: BatchEncoder, device: torch.device) -> dict:
    """What the periodic samples show: every class (up to 80 images, 8 each for 10 or fewer classes), or the
    first 8 distinct captions of the data (4 for videos)."""
    m = cfg.model
    if m.condition == "class":
        n = 8 if m.num_classes <= 10 else 1
        return {"y": torch.arange(m.num_classes, device=device).repeat_interleave(n)[:80]}
    captions = list(dict.fromkeys(getattr(dataset, "texts", None) or dataset.class_captions))
    return text_conditioning(cfg, inputs, captions[:4 if m.num_frames else 8], device)


def text_conditioning(cfg: RunConfig, inputs: BatchEncoder, texts: list[str], device: torch.device) -> dict:
    """A text DiT's conditioning of ``texts`` (``BatchEncoder.conditioning``), through the run's text encoder, or
    one loaded for the call when the run reads features (their captions were encoded before)."""
    m = cfg.model
    if inputs.text_encoder is None:
        from ditforge.encoders import load_text_encoder

        inputs = BatchEncoder("text", text_encoder=load_text_encoder(m.text_encoder, device,
                                                                     max_length=m.text_max_length))
    return inputs.conditioning({"text": texts}, device)


def _decode(cfg: RunConfig, inputs: BatchEncoder, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Samples -> pixels through the run's VAE (loaded here when the run reads features)."""
    vae = inputs.vae
    if vae is None:
        from ditforge.encoders import load_vae

        vae = inputs.vae = load_vae(cfg.model.vae, device, pixel_channels=cfg.model.in_channels)
    return vae.decode(x).float()


def write_samples(run: Run, step: int) -> None:
    """--sample_every: the ``--validation_prompts`` samples (``validation.render``), else the grid
    (``draw_samples``), and the tracker's images of them; out of GPU memory, a warning."""
    t = run.cfg.train
    what = "validation samples" if run.validation else "sample grid"
    try:
        with run.written(f"{what} of step {step}"):
            if run.validation:
                for path in validation.render(run, step, functools.partial(_draw_validation, run)):
                    if run.tracker is not None and path.suffix == ".png":  # (a TensorBoard image takes no MP4)
                        run.tracker.image(step, path, tag=f"validation/{path.stem}")
                return
            draw_samples(run, step)
            if run.tracker is not None:  # the grid draw_samples wrote
                suffix = ".gif" if run.video else ".png"
                run.tracker.image(step, run.run_dir / "samples" / f"step-{step:07d}{suffix}")
    except torch.OutOfMemoryError:  # samples are never worth the run (a tight --gpu_memory_budget)
        log.warning("step %d: no %s, out of GPU memory (%s)", step, what,
                    f"--gpu_memory_budget {t.gpu_memory_budget}" if t.gpu_memory_budget else "the GPU's memory")
        torch.cuda.empty_cache()


def _draw_validation(run: Run, sample: validation.ValidationSample) -> torch.Tensor:
    """A text DiT's validation sample, with the run's own model: (1, C, [T,] H, W) pixels in [-1, 1]."""
    cond = text_conditioning(run.cfg, run.inputs, [sample.prompt], run.d.device)
    return draw(run, cond, sample.seed, num_steps=sample.steps, cfg_scale=sample.guidance)


def draw_samples(run: Run, step: int) -> None:
    cfg, device = run.cfg, run.d.device
    weights = run.ema.full_state_dict()  # a collective under zero2/fsdp: every rank takes part
    if not run.d.is_main:
        return
    name = run.run_dir / "samples" / f"step-{step:07d}"
    if run.pre is not None:  # the family's own pipeline and scheduler draw the grid
        # on the run's device: under --cpu_offload all the trained weights are in host memory
        pixels, run.grid_model = finetune.sample_grid(run.pre, cfg, weights, run.dataset, run.grid_model,
                                                       device=device)
        if not run.video:
            save_grid(to_uint8(pixels), name.with_suffix(".png"), nrow=4)
            return
    else:
        if run.grid_cond is None:
            run.grid_cond = _grid_conditioning(cfg, run.dataset, run.inputs, device)
        pixels = draw(run, run.grid_cond, cfg.train.seed, weights)
    if run.video:  # a GIF of grids: frame k of every sample side by side
        from ditforge.data.video import write_gif  # PyAV: ditforge[video]

        frames = to_uint8(pixels)  # (N, T, H, W, C)
        grids = [make_grid(frames[:, k], nrow=min(len(pixels), 4), upscale=max(1, 64 // cfg.data.image_size))
                 for k in range(frames.shape[1])]
        write_gif(np.stack(grids), name.with_suffix(".gif"), fps=8)
    else:
        save_grid(to_uint8(pixels), name.with_suffix(".png"), nrow=8, upscale=max(1, 64 // cfg.data.image_size))


def draw(run: Run, cond: dict[str, torch.Tensor], seed: int, weights: dict[str, torch.Tensor] | None = None,
         **how) -> torch.Tensor:
    """Pixels (N, C, [T,] H, W) in [-1, 1] of samples of a DiT (rank 0): a copy with ``weights`` (the grid's
    model, made on the first call), or without them the run's own model (the caller sets its eval mode); ``how``:
    sampler, steps and guidance (``sample_grid``'s)."""
    cfg, m, device = run.cfg, run.cfg.model, run.d.device
    model = unwrap(run.model)
    if weights is not None:
        if run.grid_model is None:
            run.grid_model = create_run_model(cfg, device).eval()
        run.grid_model.load_state_dict(weights)
        model = run.grid_model
    with whole_sequences():  # rank 0 alone: no sequence-parallel attention
        x = sample_grid(model, cond, run.sample_shape, seed=seed, learn_sigma=m.learn_sigma,
                        clip_denoised=m.vae == "none",  # VAE latents are not bounded to [-1, 1]
                        objective=m.objective, flow_shift=m.flow_shift, **how)
    return _decode(cfg, run.inputs, x, device)


def evaluate(run: Run) -> dict[str, float]:
    """--eval_every: the built-in digits extractor's metrics of ``eval_samples`` EMA samples, labels cycling
    through the classes, drawn with DDIM in 25 steps at guidance 4 (cheap enough to run often on a CPU) in
    batches of 256 (batch k seeded by ``derive_seed(seed, k)``)."""
    from ditforge.eval.digits import evaluate_digits

    t, device = run.cfg.train, run.d.device
    weights = run.ema.full_state_dict()  # a collective under zero2/fsdp: every rank takes part
    if not run.d.is_main:
        return {}
    labels = torch.arange(t.eval_samples, device=device) % run.cfg.model.num_classes
    pixels = torch.cat([draw(run, {"y": y}, derive_seed(t.seed, k), weights, sampler="ddim", num_steps=25)
                        for k, y in enumerate(labels.split(256))])
    result = evaluate_digits(pixels.cpu(), labels.cpu(), device=device)
    return {f"digits_{k}": v for k, v in result.items()}
