"""One DMD2 iteration of ``ditforge distill`` (a ditforge DiT's, ``distill.py``, and a pipeline's,
``distill_pipeline.py``): two time scales (DMD2 sec. 4.2: every ``critic_steps``-th iteration a generator step
first, then a critic step in every one); the losses are ``diffusion.dmd.DMD2``'s, with the optional GAN terms of a
run on real data (``GANTerms``, DMD2 secs. 4.3-4.4).

The generator's GAN loss reaches the student's sample x through the critic's forward. Its gradient in x is taken
first, by ``torch.autograd.grad`` on a detached copy of x with the critic active (``before_backward("critic")``),
then added to the DMD surrogate as (x * that gradient).sum(), and the one backward into the student runs with the
student active. One backward through both networks would recompute the critic's checkpointed blocks (gradient
checkpointing recomputes a block in the backward under whatever is active then) with the student's adapter of a
LoRA distillation (both adapters on one base), a wrong gradient; this way each backward runs under its forward's
network, and the critic's parameters get no gradient from the generator's loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ditforge.diffusion.dmd import DMD2, Net, gan_critic_loss, gan_generator_loss


@dataclass
class GANTerms:
    """The GAN head's part of one iteration (DMD2's ``--gan_classifier`` / ``--cls_on_clean_image``): ``real``
    (B, ...) real samples x_0 in the model's input space; ``classify_real`` / ``classify_fake``: (x_t, model
    timesteps) -> realism logits (B,), the critic's intermediate features and its head under the real samples' and
    the student's conditions; ``gen_cls_loss_weight`` weighs the generator's GAN loss against its DMD loss,
    ``guidance_cls_loss_weight`` the critic's against its denoising loss (DMD2's names)."""

    real: torch.Tensor
    classify_real: Net
    classify_fake: Net
    gen_cls_loss_weight: float
    guidance_cls_loss_weight: float


def dmd2_iteration(dmd: DMD2, step: int, critic_steps: int, student: Net, teacher: Net, critic: Net,
                   noise: torch.Tensor, generator: torch.Generator, opt_g, opt_c, params_g: list, params_c: list,
                   max_grad_norm: float, before_backward: Callable[[str], None] = lambda name: None,
                   reduce: Callable[[list], None] = lambda params: None, gan: GANTerms | None = None,
                   clip: Callable[[list, float], torch.Tensor] = torch.nn.utils.clip_grad_norm_) -> dict[str, float]:
    """Iteration ``step`` (1-based): with ``step % critic_steps == 1 % critic_steps`` the student's sample (backward
    simulation, ``DMD2.generate``) takes a generator step on ``dmd_loss`` (``opt_g`` on ``params_g``, their gradient
    norm clipped to ``max_grad_norm``); else the sample is drawn without gradients. Then the critic takes a step on
    its denoising loss of the detached sample (``opt_c`` on ``params_c``). ``before_backward("student" |
    "critic")`` runs before each backward (a LoRA distillation switches its adapter there), ``reduce(params)`` after
    it, before the clipping (data parallelism averages the gradients of ``params`` there); ``clip(params,
    max_grad_norm)`` clips and returns their norm before (torch's ``clip_grad_norm_``; sharded gradients: the global
    norm, ``parallel.clip_grad_norm_``). With ``gan`` the
    generator's loss adds ``gen_cls_loss_weight`` x ``gan_generator_loss`` of its sample's logits (through the
    critic's features; its gradient in the sample taken under ``before_backward("critic")``, module docstring), and
    the critic's ``guidance_cls_loss_weight`` x ``gan_critic_loss`` of the real samples' and the detached sample's
    logits.
    Randomness: ``generator`` alone, in that order (the GAN's noise after each loss's own draws, real before fake).
    Returns {generator_loss, dmd_grad_norm (the per-sample mean), generator_grad_norm (the student's parameters'
    gradient norm before clipping)} of a generator step and critic_loss, critic_grad_norm, host floats;
    with ``gan`` also gen_cls_loss, guidance_cls_loss, pred_realism_on_real / _fake (the mean sigmoid of the critic
    step's logits, DMD2's names)."""
    out: dict[str, float] = {}
    if step % critic_steps == 1 % critic_steps:
        x = dmd.generate(student, noise, generator)
        loss, grad_norm = dmd.generator_loss(x, teacher, critic, generator)
        out = {"generator_loss": float(loss.detach()), "dmd_grad_norm": float(grad_norm.mean())}
        if gan is not None:  # its gradient in x first, through the critic's forward under the critic (module doc)
            probe = x.detach().requires_grad_(True)
            gen_cls = gan_generator_loss(dmd.gan_logits(gan.classify_fake, probe, generator))
            before_backward("critic")
            (grad,) = torch.autograd.grad(gan.gen_cls_loss_weight * gen_cls, probe)
            loss = loss + (x * grad.to(x.dtype)).sum()  # the surrogate whose gradient in x is that gradient
            out["gen_cls_loss"] = float(gen_cls.detach())
        before_backward("student")
        opt_g.zero_grad(set_to_none=True)
        loss.backward()
        reduce(params_g)
        out["generator_grad_norm"] = float(clip(params_g, max_grad_norm))
        opt_g.step()
        x = x.detach()
    else:
        with torch.no_grad():
            x = dmd.generate(student, noise, generator)
    closs = dmd.critic_loss(x, critic, generator)
    out["critic_loss"] = float(closs.detach())
    if gan is not None:
        real = dmd.gan_logits(gan.classify_real, gan.real.detach(), generator)
        fake = dmd.gan_logits(gan.classify_fake, x, generator)
        cls = gan_critic_loss(real, fake)
        closs = closs + gan.guidance_cls_loss_weight * cls
        out |= {"guidance_cls_loss": float(cls.detach()), "pred_realism_on_real": float(real.detach().sigmoid().mean()),
                "pred_realism_on_fake": float(fake.detach().sigmoid().mean())}
    before_backward("critic")
    opt_c.zero_grad(set_to_none=True)
    closs.backward()
    reduce(params_c)
    out["critic_grad_norm"] = float(clip(params_c, max_grad_norm))
    opt_c.step()
    return out
