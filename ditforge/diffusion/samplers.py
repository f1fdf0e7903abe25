"""Ancestral DDPM and DDIM sampling loops with classifier-free guidance.

Sources: Ho et al. 2020 (ancestral sampling, Algorithm 2), Song et al. 2021 ("DDIM", eq. 12 with eta),
Ho & Salimans 2022 (classifier-free guidance); loops as in guided-diffusion's ``p_sample_loop`` and
``ddim_sample_loop``.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ditforge.diffusion.gaussian import GaussianDiffusion, ModelFn

SAMPLERS = ("ddpm", "ddim")


def guided_model(
    model: torch.nn.Module, y: torch.Tensor, cfg_scale: float, null_label: int, guidance_channels: int | None = None
) -> ModelFn:
    """Wrap a class-conditional model as ``(x, t) -> output`` with classifier-free guidance.

    The conditional and unconditional passes run as one batch of 2B. On the epsilon channels,
    ``eps = eps_uncond + cfg_scale * (eps_cond - eps_uncond)`` (Ho & Salimans 2022, eq. 6); the learned-variance
    channels come from the conditional pass. ``cfg_scale == 1`` runs the conditional model alone.

    Args:
        model: ``model(x, t, y)`` -> (B, C_out, H, W).
        y: (B,) int64 labels.
        guidance_channels: guide only the first k channels; ``None`` guides all eps channels. The official
            DiT sampler guides 3 of 4 latent channels; pass 3 to reproduce it.
    """
    if cfg_scale == 1.0:
        return lambda x, t: model(x, t, y)
    y_null = torch.full_like(y, null_label)

    def fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, y_null]))
        cond, uncond = out.chunk(2)
        k = x.shape[1] if guidance_channels is None else guidance_channels
        guided = uncond[:, :k] + cfg_scale * (cond[:, :k] - uncond[:, :k])
        return torch.cat([guided, cond[:, k:]], dim=1)

    return fn


@torch.no_grad()
def sample_loop(
    diffusion: GaussianDiffusion,
    model_fn: ModelFn,
    noise: torch.Tensor,
    sampler: str = "ddpm",
    eta: float = 0.0,
    clip_denoised: bool = False,
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Run the reverse process from x_T = ``noise`` down to x_0.

    Args:
        diffusion: the (usually respaced) process; its steps are the sampling steps.
        model_fn: (x_t, original timesteps) -> model output (see ``guided_model``).
        noise: (B, C, ...) starting noise, float32.
        sampler: ``"ddpm"`` (ancestral, learned or fixed variance) or ``"ddim"`` (``eta`` = 0 is deterministic).
        generator: source of the per-step noise; same generator state, same samples.

    Returns:
        (B, C, ...) float32 samples.

    Raises:
        ValueError: unknown sampler.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; expected one of {SAMPLERS}")
    x = noise
    steps = range(diffusion.num_timesteps - 1, -1, -1)
    for i in tqdm(steps, desc=f"{sampler} sampling", disable=not progress, leave=False):
        t = torch.full((x.shape[0],), i, dtype=torch.long, device=x.device)
        out = diffusion.p_mean_variance(model_fn(x, diffusion.model_timesteps(t)), x, t, clip_denoised)
        z = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype).double()
        if sampler == "ddpm":
            x_prev = out.mean + (i > 0) * torch.exp(0.5 * out.log_variance) * z
        else:
            abar = diffusion.alphas_cumprod[i]
            abar_prev = diffusion.alphas_cumprod_prev[i]
            sigma = eta * ((1 - abar_prev) / (1 - abar)).sqrt() * (1 - abar / abar_prev).sqrt()
            eps = diffusion.predict_eps_from_xstart(x, t, out.pred_xstart)
            x_prev = out.pred_xstart * abar_prev.sqrt() + (1 - abar_prev - sigma**2).sqrt() * eps
            x_prev = x_prev + (i > 0) * sigma * z
        x = x_prev.to(noise.dtype)
    return x
