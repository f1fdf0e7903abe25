"""A ``ditforge distill`` student of a diffusers video pipeline, sampled in its K steps without guidance: the one
loop of ``ditforge sample --ckpt RUN`` (``video.VideoSampler``, ``--sampler student``) and of the distillation's
``--eval_every`` (``student_videos``, which ``cli`` hands to ``train.distill_pipeline``: the training layer does not
import the sampling one, pyproject's import contracts); for a pipeline whose own call samples (a driven one's
segment loop), that loop as the call's scheduler (``student_scheduler``)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ditforge.data.images import to_uint8
from ditforge.encoders.vae import VAE
from ditforge.sample.video_vae import decode

# (x_t, model timesteps, the image conditioning drawn) -> the student's output (B, C, T', h, w) float32
Student = Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor]


def student_latents(pre, denoiser, student: Student, image_cond, shape: tuple[int, ...], seed: int, steps: int,
                    device: torch.device) -> torch.Tensor:
    """A K-step (``steps``) student's latents (1, C, T', h, w) float32, no guidance: DMD2's multi-step sampler
    (Yin et al. 2024 sec. 4.5; ``dmd.student_loop``, what ``ditforge distill`` trains through) on
    ``dmd.pipeline_student_times``, the objective the pipeline's scheduler config gives (``create_objective``).
    x = noise; at step k the student's output at t_k gives x0, re-noised with fresh noise to t_{k+1}; the last
    x0 is the sample. Flow matching: x0 = x - sigma_k v, x = (1 - sigma_{k+1}) x0 + sigma_{k+1} eps, sigma_k =
    shift s / (1 + (shift - 1) s), s = 1 - k / K, the scheduler's ``flow_shift`` / ``shift`` (Self-Forcing's
    ``warp_denoising_step``, LightX2V's 4-step list [1000, 750, 500, 250]), the model at t = 1000 sigma_k. DDPM
    (v-prediction): t_k = T-1 - k T / K (DMD2's [999, 749, 499, 249]), x0 = sqrt(abar) x - sqrt(1 - abar) v,
    x = sqrt(abar) x0 + sqrt(1 - abar) eps; latents (B, C, T', h, w) in any layout (a frames-first adapter
    transposes). ``pre``: the pipeline (``Pretrained``), ``denoiser`` its adapter (``start``, ``finish``: an
    image-to-video family's given frames); ``image_cond``: the image conditioning tensors, or a function of the
    generator giving them (``image_from_generator``), or None. Its image draws, the noise, then each eps from
    ``torch.Generator(device).manual_seed(seed)``.

    Raises UserError: a scheduler of no objective ditforge trains (``create_objective``'s)."""
    from ditforge.diffusion.dmd import student_loop  # ditforge distill's, too

    objective, times = _schedule(pre, denoiser, shape, steps, device)
    generator = torch.Generator(device).manual_seed(seed)
    given = dict((image_cond(generator=generator) if callable(image_cond) else image_cond) or {})
    draw = _draws(generator, device)
    with torch.no_grad():
        x0 = student_loop(objective, lambda x, t: student(x, t, given), denoiser.start(draw(torch.empty(shape)), given),
                          times, draw)
    return denoiser.finish(x0, given)


def _schedule(pre, denoiser, shape: tuple[int, ...], steps: int, device: torch.device):
    """(the objective of the pipeline's scheduler config, the student's K ``dmd.pipeline_student_times``) for
    latents of ``shape`` (1, C, T', h, w). Raises UserError: ``create_objective``'s."""
    from ditforge.diffusion.dmd import pipeline_student_times
    from ditforge.diffusion.objective import create_objective

    config = dict(pre.scheduler_config)
    objective = create_objective("auto", denoiser.learn_sigma, config, device=device,
                                 where=f"--sampler student: {pre.pipeline_class}'s scheduler",
                                 **denoiser.objective_args(pre.pipe, None, *shape[2:]))
    return objective, pipeline_student_times(objective, config, steps, device)


def _draws(generator: torch.Generator, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> N(0, I) float32 shaped like x from ``generator`` (diffusers' ``randn_tensor``, the pipelines' draw)."""
    from diffusers.utils.torch_utils import randn_tensor

    return lambda x: randn_tensor(x.shape, generator=generator, device=device, dtype=torch.float32)


def student_scheduler(pre, denoiser, size: tuple[int, int], frames: int, steps: int, device: torch.device
                      ) -> Callable[[torch.Generator], object]:
    """A pipeline whose own call samples (a driven one's segment loop, ``generate_with_pipeline``'s ``scheduler``):
    a function of the call's generator giving ``dmd.StudentScheduler``, the K-step (``steps``) student's sampler of
    ``student_latents`` (its objective and timesteps for segments of ``frames`` frames of ``size`` (H, W) pixels,
    the pipeline's padding frames included, ``denoiser.padding_frames``), re-noising from that generator after the
    call's own noise draw (``randn_tensor``, as ``student_latents`` draws). Raises UserError: ``_schedule``'s."""
    from ditforge.diffusion.dmd import StudentScheduler

    vae = VAE(pre.pipe.vae, frame_factor=denoiser.vae_frame_factor, folds_pixels=denoiser.vae_folds_pixels)
    latent = vae.latent_frames(frames)
    shape = (1, denoiser.in_channels, latent + denoiser.padding_frames(latent), size[0] // vae.downsample,
             size[1] // vae.downsample)
    objective, times = _schedule(pre, denoiser, shape, steps, device)
    return lambda generator: StudentScheduler(objective, times, _draws(generator, device))


def student_videos(pre, student_of: Callable[[dict], Callable], prompts: list[str], seeds: list[int],
                   shape: tuple[int, ...], steps: int, prepended: int) -> np.ndarray:
    """A text-to-video student's videos (N, T, H, W, 3) uint8, video i of ``prompts[i]`` from ``seeds[i]``, as
    ``ditforge sample --ckpt RUN`` draws them: ``student_latents`` (``shape``: (1, C, T', h, w), its ``prepended``
    leading latent frames, the pipeline's padding, cut before decoding), the VAE decode of the sampling command
    (``video_vae.decode``, one process) and the frames the pipeline returns (the adapter's ``decoded_frames``).
    ``student_of(cond)``: (x_t, model timesteps) -> the student's output under the conditioning ``cond`` of one
    prompt (``pre.encode_prompt``'s)."""
    den = pre.denoiser
    vae = VAE(pre.pipe.vae, frame_factor=den.vae_frame_factor, folds_pixels=den.vae_folds_pixels)
    videos = []
    for prompt, seed in zip(prompts, seeds):
        with torch.no_grad():
            student = student_of(pre.encode_prompt([prompt]))
        latents = student_latents(pre, den, lambda x, t, given: student(x, t), None, shape, seed, steps, pre.device)
        pixels = decode(vae, pre.pipe.vae, latents[:, :, prepended:], None, None,
                        (den.vae_halo_modules, den.vae_whole_modules), True)
        videos.append(to_uint8(den.decoded_frames(pre.pipe, pixels))[0])  # (T, H, W, 3), as sample writes it
    return np.stack(videos)
