"""Gaussian diffusion (schedules, q_sample, posterior, losses), the DDPM / DDIM samplers and diffusers'
DPM-Solver++ / Euler solvers,
and whole sampling loops replayed as CUDA graphs."""

from ditforge.diffusion.gaussian import GaussianDiffusion, create_diffusion
from ditforge.diffusion.samplers import (DIFFUSERS_SAMPLERS, OWN_SAMPLERS, SAMPLERS, diffusers_scheduler, generate,
                                         GuidedModel, LoopGraphs, sample_loop, solver_loop)

__all__ = ["GaussianDiffusion", "create_diffusion", "generate", "GuidedModel", "LoopGraphs", "sample_loop",
           "solver_loop", "diffusers_scheduler", "SAMPLERS", "OWN_SAMPLERS", "DIFFUSERS_SAMPLERS"]
