"""Gaussian diffusion (schedules, q_sample, posterior, losses) and the DDPM / DDIM samplers."""

from ditforge.diffusion.gaussian import GaussianDiffusion, create_diffusion
from ditforge.diffusion.samplers import SAMPLERS, generate, guided_model, sample_loop

__all__ = ["GaussianDiffusion", "create_diffusion", "generate", "guided_model", "sample_loop", "SAMPLERS"]
