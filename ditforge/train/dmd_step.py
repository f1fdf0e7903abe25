"""One DMD2 iteration of ``ditforge distill`` (a ditforge DiT's, ``distill.py``, and a pipeline's,
``distill_pipeline.py``): two time scales (DMD2 sec. 4.2: every ``critic_steps``-th iteration a generator step
first, then a critic step in every one); the losses are ``diffusion.dmd.DMD2``'s."""

from __future__ import annotations

from typing import Callable

import torch

from ditforge.diffusion.dmd import DMD2, Net


def dmd2_iteration(dmd: DMD2, step: int, critic_steps: int, student: Net, teacher: Net, critic: Net,
                   noise: torch.Tensor, generator: torch.Generator, opt_g, opt_c, params_g: list, params_c: list,
                   max_grad_norm: float, before_backward: Callable[[str], None] = lambda name: None,
                   reduce: Callable[[list], None] = lambda params: None) -> dict[str, float]:
    """Iteration ``step`` (1-based): with ``step % critic_steps == 1 % critic_steps`` the student's sample (backward
    simulation, ``DMD2.generate``) takes a generator step on ``dmd_loss`` (``opt_g`` on ``params_g``, their gradient
    norm clipped to ``max_grad_norm``); else the sample is drawn without gradients. Then the critic takes a step on
    its denoising loss of the detached sample (``opt_c`` on ``params_c``). ``before_backward("student" |
    "critic")`` runs before each backward (a LoRA distillation switches its adapter there), ``reduce(params)`` after
    it, before the clipping (data parallelism averages the gradients of ``params`` there). Randomness: ``generator``
    alone, in that order. Returns {generator_loss, dmd_grad_norm (the per-sample mean)} of a generator step and
    critic_loss, host floats."""
    out: dict[str, float] = {}
    if step % critic_steps == 1 % critic_steps:
        x = dmd.generate(student, noise, generator)
        loss, grad_norm = dmd.generator_loss(x, teacher, critic, generator)
        before_backward("student")
        opt_g.zero_grad(set_to_none=True)
        loss.backward()
        reduce(params_g)
        torch.nn.utils.clip_grad_norm_(params_g, max_grad_norm)
        opt_g.step()
        out = {"generator_loss": float(loss.detach()), "dmd_grad_norm": float(grad_norm.mean())}
        x = x.detach()
    else:
        with torch.no_grad():
            x = dmd.generate(student, noise, generator)
    closs = dmd.critic_loss(x, critic, generator)
    before_backward("critic")
    opt_c.zero_grad(set_to_none=True)
    closs.backward()
    reduce(params_c)
    torch.nn.utils.clip_grad_norm_(params_c, max_grad_norm)
    opt_c.step()
    return out | {"critic_loss": float(closs.detach())}
