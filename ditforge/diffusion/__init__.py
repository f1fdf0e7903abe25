"""Gaussian diffusion (schedules, q_sample, posterior, losses), the DDPM / DDIM samplers and diffusers'
DPM-Solver++ / Euler solvers."""

from ditforge.diffusion.gaussian import GaussianDiffusion, create_diffusion
from ditforge.diffusion.samplers import (DIFFUSERS_SAMPLERS, OWN_SAMPLERS, SAMPLERS, diffusers_scheduler, generate,
                                         GuidedModel, sample_loop, solver_loop)

__all__ = ["GaussianDiffusion", "create_diffusion", "generate", "GuidedModel", "sample_loop", "solver_loop",
           "diffusers_scheduler", "SAMPLERS", "OWN_SAMPLERS", "DIFFUSERS_SAMPLERS"]
