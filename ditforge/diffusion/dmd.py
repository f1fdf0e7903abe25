"""Distribution Matching Distillation (DMD2): a few-step student (the generator) trained so that its samples'
distribution matches the teacher's, with a critic (the fake score) that follows the student's distribution.

Sources: Yin et al. 2024, "One-step Diffusion with Distribution Matching Distillation" (DMD, CVPR 2024; eqs. 7-8:
the distribution-matching gradient and its normalisation); Yin et al. 2024, "Improved Distribution Matching
Distillation for Fast Image Synthesis" (DMD2, arXiv 2405.14867: two-time-scale updates (sec. 4.2), the multi-step
student on fixed timesteps with backward simulation (sec. 4.5), the GAN head on the critic's features trained on
real samples (secs. 4.3-4.4)); the reference implementation tianweiy/DMD2,
``main/sd_guidance.py`` (``compute_distribution_matching_loss``, ``compute_loss_fake``) and
``main/sd_unified_model.py`` (the 4-step schedule [999, 749, 499, 249] and the backward simulation),
``main/edm/edm_guidance.py`` (``cls_pred_branch``, ``compute_cls_logits``, the GAN losses).

The math is objective-agnostic: any ``Objective`` (``diffusion/objective.py``: DDPM epsilon / v, rectified flow)
and any denoiser with ditforge's call ``forward(x, t, **cond)`` (``models/``: ``DiT``; ``models/adapters``: a
diffusers transformer as ``DiffusersDenoiser``). The three networks enter as callables:

- ``student(x_t, t) -> output`` and ``critic(x_t, t) -> output``: the conditional call for this batch (t on the
  model's scale, ``objective.model_timesteps``); gradients flow through them;
- ``teacher(x_t, t) -> output``: the frozen teacher with classifier-free guidance at its scale (e.g.
  ``samplers.GuidedModel(teacher, y, cfg_scale)``), called under ``no_grad``.

A LoRA student plugs in unchanged: one base module carries peft adapters ``student`` and ``critic``
(``model.add_adapter``), and the three callables switch them (``model.set_adapter("student")``; the teacher call
runs inside ``model.disable_adapter()``), so teacher, critic and student share one copy of the base weights; each
optimizer then holds only its adapter's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ditforge.diffusion.flow import RectifiedFlow, shift_times
from ditforge.diffusion.gaussian import GaussianDiffusion

Objective = GaussianDiffusion | RectifiedFlow
Net = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def predicted_x0(objective: Objective, x_t: torch.Tensor, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The clean sample a model output implies at (x_t, t), in ``x_t``'s dtype (differentiable in ``out``).

    DDPM epsilon: x_0 = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t); DDPM v: x_0 = sqrt(abar_t) x_t - sqrt(1 -
    abar_t) v (finite at a zero terminal SNR, abar_T = 0: x_0 = -v); flow: x_0 = x_t - t v (x_t = (1 - t)
    x_0 + t eps, v = eps - x_0). ``out``: (B, C or 2C, ...), its first C channels are the prediction; ``t``: the
    objective's own timesteps (int64 indices, or float in [0, 1])."""
    out = out[:, : x_t.shape[1]]
    if isinstance(objective, RectifiedFlow):
        tt = t.double().reshape(-1, *[1] * (x_t.ndim - 1))
        return (x_t.double() - tt * out.double()).to(x_t.dtype)
    if objective.prediction_type == "v_prediction":
        return objective.predict_xstart_from_v(x_t, t, out).to(x_t.dtype)
    return objective.predict_xstart_from_eps(x_t, t, out).to(x_t.dtype)


def noised(objective: Objective, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """x_t of the forward process at the objective's timesteps ``t`` (DDPM eq. 4, or (1 - t) x_0 + t eps)."""
    if isinstance(objective, RectifiedFlow):
        return objective.noisy(x0, t, noise)
    return objective.q_sample(x0, t, noise)


def times_at(objective: Objective, u: torch.Tensor) -> torch.Tensor:
    """The objective's timesteps at noise fractions ``u`` in [0, 1] (1: pure noise): DDPM the indices
    floor(u (T - 1) + 0.5) (int64), flow the shifted times ``shift_times(u, shift)`` (float32)."""
    if isinstance(objective, RectifiedFlow):
        return shift_times(u.double(), objective.shift).float()
    return (u.double() * (objective.num_timesteps - 1)).round().long()


def student_times(objective: Objective, steps: int, device=None) -> torch.Tensor:
    """The K timesteps a K-step student runs at, noisiest first: DDPM T-1 - k T / K (DMD2's 4-step [999, 749, 499,
    249] at T = 1000, ``sd_unified_model.py``); flow the same fractions 1 - k / K, shifted (1, 0.75, 0.5, 0.25 at
    shift 1: FastVideo's DMD2 denoising steps for flow models).

    Raises:
        ValueError: ``steps`` < 1 or more than the objective's timesteps.
    """
    if not 1 <= steps <= objective.num_timesteps:
        raise ValueError(f"student steps must be in 1..{objective.num_timesteps}, got {steps}")
    k = torch.arange(steps, device=device)
    if isinstance(objective, RectifiedFlow):
        return flow_student_sigmas(objective.shift, steps).float().to(device)
    return objective.num_timesteps - 1 - k * (objective.num_timesteps // steps)


def flow_student_sigmas(shift: float, steps: int) -> torch.Tensor:
    """A K-step (``steps``) flow student's sigmas, noisiest first, float64 (K,) on the CPU: shift s / (1 + (shift - 1)
    s) at s = 1 - k / K (the uniform fractions through the shifted schedule: Self-Forcing's ``warp_denoising_step``,
    LightX2V's 4-step list [1000, 750, 500, 250] with the sample shift). The one rule of ``ditforge distill``'s
    pipeline students and ``ditforge sample --sampler student`` (``VideoSampler._student``)."""
    return shift_times(1.0 - torch.arange(steps, dtype=torch.float64) / steps, float(shift))


def flow_student_shift(scheduler_config: dict) -> float:
    """The shift a flow pipeline's student runs at: its scheduler config's ``flow_shift`` (a multistep solver on flow
    sigmas), else its ``shift`` (``FlowMatchEulerDiscreteScheduler``), else 1."""
    return float(scheduler_config.get("flow_shift") or scheduler_config.get("shift") or 1.0)


def pipeline_student_times(objective: Objective, scheduler_config: dict, steps: int, device=None) -> torch.Tensor:
    """The K (``steps``) timesteps of a pipeline's student, noisiest first, on the objective's scale: a flow
    pipeline's ``flow_student_sigmas`` of ``flow_student_shift(scheduler_config)`` (float32; the scheduler's own shift,
    not a dynamic one's), a DDPM pipeline's ``student_times`` (int64 T-1 - k T / K: [999, 749, 499, 249] at K = 4).
    The one rule of ``ditforge distill``'s pipeline students and ``ditforge sample --sampler student``.

    Raises:
        ValueError: ``student_times``'.
    """
    if isinstance(objective, RectifiedFlow):
        return flow_student_sigmas(flow_student_shift(scheduler_config), steps).float().to(device)
    return student_times(objective, steps, device)


def student_loop(objective: Objective, student: Net, noise: torch.Tensor, times: torch.Tensor,
                 draw: Callable[[torch.Tensor], torch.Tensor], stop: int | None = None) -> torch.Tensor:
    """A multi-step student's sample (DMD2 sec. 4.5): x = noise; at each step k the student predicts x_0 from
    (x, times[k]); before the next step x_0 is noised afresh to times[k + 1] (the forward process, new noise).

    Args:
        student: (x_t, model timesteps) -> output; noise: (B, C, ...) N(0, I); times: ``student_times``.
        draw: x -> fresh N(0, I) noise shaped like x (the re-noising draws; ``samplers.randn_like_rows``).
        stop: return the input of step ``stop`` (x at times[stop]) instead of the last step's x_0: the backward
            simulation of training, which produces the student's own input for step ``stop``.

    Returns:
        (B, C, ...) in ``noise``'s dtype: x_0 of the last step, or x at times[stop].
    """
    x = noise
    for k in range(len(times) if stop is None else stop):
        x = student_step(objective, times, k, x, student(x, objective.model_timesteps(times[k].expand(x.shape[0]))),
                         draw)
    return x


def student_step(objective: Objective, times: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor,
                 draw: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Step k of ``student_loop``: x_0 predicted from the student's output ``out`` at (x, times[k]); the last step
    (k = K - 1) returns that x_0, the others x_0 noised afresh (``draw(x)``) to times[k + 1]. x: (B, C, ...); returns
    (B, C, ...) in x's dtype."""
    x0 = predicted_x0(objective, x, times[k].expand(x.shape[0]), out)
    if k + 1 == len(times):
        return x0
    return noised(objective, x0, times[k + 1].expand(x.shape[0]), draw(x))


class StudentScheduler:
    """``student_loop`` as a diffusers scheduler, for a pipeline whose own call runs the denoising loop (a driven
    pipeline's segment loop, ``models/adapters``' ``driving_videos``): ``set_timesteps(K)`` sets ``timesteps`` to the
    student's model timesteps (``objective.model_timesteps(times)``: a flow student's 1000 sigma_k, float32) and
    restarts the count k (the pipeline calls it again before each segment); ``step(out, t, x)`` is
    ``student_step`` k. Such a call's ``scheduler.set_timesteps(num_inference_steps)`` takes no sigmas or
    timesteps, and its multistep solver is no DMD2 sampler, so this object stands in for its scheduler for the
    call; from the same x and draws it gives ``student_loop``'s x_0.

    Args:
        objective: the teacher's (``create_objective`` of the pipeline's scheduler config); times: the K
            ``pipeline_student_times``; draw: x -> fresh N(0, I) noise shaped like x (the re-noising draws).

    Raises:
        ValueError: ``set_timesteps`` of another step count than K.
    """

    order = 1  # one model call a step (the pipelines' progress-bar arithmetic)

    def __init__(self, objective: Objective, times: torch.Tensor, draw: Callable[[torch.Tensor], torch.Tensor]):
        self.objective, self.times, self.draw = objective, times, draw
        self.timesteps, self.k = objective.model_timesteps(times), 0

    def set_timesteps(self, num_inference_steps: int, device=None) -> None:
        if num_inference_steps != len(self.times):
            raise ValueError(f"a {len(self.times)}-step student's scheduler, asked for {num_inference_steps} steps")
        self.timesteps, self.k = self.objective.model_timesteps(self.times).to(device), 0

    def step(self, model_output: torch.Tensor, timestep, sample: torch.Tensor, return_dict: bool = False):
        # the pipelines' call, scheduler.step(noise_pred, t, latents, return_dict=False)[0]: k, not t, says the step
        x = student_step(self.objective, self.times.to(sample.device), self.k, sample, model_output, self.draw)
        self.k += 1
        return (x,)


def dmd_gradient(x: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor) -> torch.Tensor:
    """The distribution-matching gradient of the generator's samples ``x``, (B, ...) float like ``x``.

    DMD eq. 7: grad_x KL = -(s_real(x_t) - s_fake(x_t)), with the scores through the denoisers' x_0 predictions;
    eq. 8 normalises by the per-sample mean |x - x0_real| so that the step size does not depend on the noise level:
    grad = (x0_fake - x0_real) / mean_{C,H,W} |x - x0_real| (``sd_guidance.py``: ``grad = (p_real - p_fake) /
    |p_real|.mean``, p = x - x0_pred). A zero denominator gives a zero gradient (``torch.nan_to_num``)."""
    dims = tuple(range(1, x.ndim))
    weight = (x - x0_real).abs().mean(dim=dims, keepdim=True)
    return torch.nan_to_num((x0_fake - x0_real) / weight)


def dmd_loss(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The surrogate whose gradient in ``x`` is ``grad / x.numel()``: 0.5 ||x - stopgrad(x - grad)||^2 averaged
    over elements (``sd_guidance.py``: ``0.5 * F.mse_loss(x, (x - grad).detach())``). Scalar, in at least float32."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    return 0.5 * torch.nn.functional.mse_loss(x.to(dtype), (x - grad).detach().to(dtype))


@dataclass
class DMD2:
    """DMD2's losses for one batch. ``t_range``: the noise fractions the distribution-matching loss draws its t
    from, uniformly (DMD2's ``min_step``, ``max_step`` = 0.02 T, 0.98 T); ``times``: ``student_times``;
    ``given_frames``: the first latent frames (dim 2 of a video) that the conditioning gives clean (an
    image-to-video family's first frame, the objective's ``given_frames``): left out of the distribution-matching
    loss and its normalisation, as the objective's loss leaves them out of the critic's. ``shard``: (this process's
    index r, the processes n) of a data-parallel run whose processes each hold B of the global batch's n B rows: every
    per-sample draw is made for the n B rows and this process keeps rows r B .. (r + 1) B - 1, so the processes
    together draw what one process of the global batch draws (the per-batch draws, the backward simulation's step,
    are the same in all)."""

    objective: Objective
    times: torch.Tensor
    t_range: tuple[float, float] = (0.02, 0.98)
    given_frames: int = 0
    shard: tuple[int, int] = (0, 1)

    def generate(self, student: Net, noise: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The student's training sample with backward simulation (DMD2 sec. 4.5): a step k uniform in 0..K-1
        (one per batch, from ``generator``); its input is made by the current student from ``noise`` without
        gradients (``student_loop(stop=k)``), then step k's x_0 is predicted with gradients. (B, ...) like
        ``noise``."""
        k = int(torch.randint(len(self.times), (), generator=generator,
                              device=generator.device if generator is not None else None))
        with torch.no_grad():
            x_t = student_loop(self.objective, student, noise, self.times, lambda x: self._randn(x, generator),
                               stop=k)
        t = self.times[k].expand(noise.shape[0])
        return predicted_x0(self.objective, x_t, t, student(x_t, self.objective.model_timesteps(t)))

    def generator_loss(self, x: torch.Tensor, teacher: Net, critic: Net,
                       generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(``dmd_loss`` of ``x`` (scalar), the per-sample DMD gradient's norm (B,)): x noised to t drawn in
        ``t_range``, the guided teacher's (real) and the critic's (fake) x_0 predictions at (x_t, t), without
        gradients, then ``dmd_gradient``; both on the frames after ``given_frames``."""
        with torch.no_grad():
            x_t, t = self._noise(x.detach(), generator)
            mt = self.objective.model_timesteps(t)
            x0_real = predicted_x0(self.objective, x_t, t, teacher(x_t, mt))
            x0_fake = predicted_x0(self.objective, x_t, t, critic(x_t, mt))
            grad = dmd_gradient(*(self._learned(v) for v in (x.detach(), x0_real, x0_fake)))
        return dmd_loss(self._learned(x), grad), grad.flatten(1).norm(dim=1)

    def _learned(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, self.given_frames:] if self.given_frames else x

    def critic_loss(self, x: torch.Tensor, critic: Net, generator: torch.Generator | None) -> torch.Tensor:
        """The fake score's denoising loss on the student's detached samples ``x`` (DMD eq. 6; ``compute_loss_fake``):
        the objective's own training loss (``training_losses``: its timestep density, epsilon / v / velocity
        target, DDPM's learned-variance term). Scalar."""
        x = x.detach()
        t = self._mine(self.objective.sample_timesteps(self._rows(x), generator, x.device))
        return self.objective.training_losses(critic, x, t, self._randn(x, generator))["loss"].mean()

    def gan_logits(self, classify: Net, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Realism logits (B,) of samples ``x`` (B, ...), as DMD2's diffusion GAN takes them (``compute_cls_logits``
        with ``--diffusion_gan``, ``--diffusion_gan_max_timestep 1000``): x noised by the forward process at t of a
        noise fraction uniform in [0, 1) (``times_at``), then ``classify(x_t, model timesteps)`` (the critic's
        features and its head). Differentiable in ``x`` and in ``classify``'s parameters."""
        u = torch.rand(self._rows(x), generator=generator, device=x.device, dtype=torch.float64)
        t = times_at(self.objective, self._mine(u))
        return classify(noised(self.objective, x, t, self._randn(x, generator)), self.objective.model_timesteps(t))

    def _noise(self, x: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.t_range
        u = lo + (hi - lo) * torch.rand(self._rows(x), generator=generator, device=x.device, dtype=torch.float64)
        t = times_at(self.objective, self._mine(u))
        return noised(self.objective, x, t, self._randn(x, generator)), t

    def _rows(self, x: torch.Tensor) -> int:
        """The global batch's rows: n times ``x``'s."""
        return self.shard[1] * x.shape[0]

    def _mine(self, draw: torch.Tensor) -> torch.Tensor:
        """This process's rows of a draw for the global batch."""
        b = draw.shape[0] // self.shard[1]
        return draw[self.shard[0] * b:(self.shard[0] + 1) * b]

    def _randn(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """N(0, I) noise shaped like ``x``: this process's rows of the global batch's draw."""
        return self._mine(torch.randn((self._rows(x), *x.shape[1:]), generator=generator, device=x.device,
                                      dtype=x.dtype))


class GANHead(torch.nn.Module):
    """DMD2's classifier head on the critic's intermediate features (``cls_pred_branch``, Yin et al. 2024 sec. 4.3):
    (B, N, D) tokens -> (B,) realism logits. Each token goes through LayerNorm -> Linear(D, D) -> SiLU -> Linear(D,
    1), and the logits are averaged over the tokens (DMD2's convolutional head reduces its 8 x 8 feature map to one
    logit; tokens have no grid to convolve here, so each token is classified and the mean taken). Float32
    parameters, computed in the features' dtype promoted to float32. ``gather``: where each process holds a slice
    of every sample's tokens (context parallelism), (B, n) per-token logits -> the (B, N) of the whole sample
    (``parallel.collectives.gather_dim1``), so that the mean is over all N tokens."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.LayerNorm(hidden_size), torch.nn.Linear(hidden_size, hidden_size),
                                       torch.nn.SiLU(), torch.nn.Linear(hidden_size, 1))

    def forward(self, tokens: torch.Tensor,
                gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        logits = self.net(tokens.float()).squeeze(-1)
        return (logits if gather is None else gather(logits)).mean(dim=1)


def gan_critic_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    """The discriminator's non-saturating GAN loss (Goodfellow et al. 2014) on realism logits (B,) of real and of
    generated samples: mean softplus(-real) + mean softplus(fake) = -log D(real) - log(1 - D(fake)), D = sigmoid
    (DMD2 sec. 4.3; ``edm_guidance.py``: ``compute_guidance_clean_cls_loss``). Scalar, in the logits' dtype."""
    return torch.nn.functional.softplus(-real_logits).mean() + torch.nn.functional.softplus(fake_logits).mean()


def gan_generator_loss(fake_logits: torch.Tensor) -> torch.Tensor:
    """The generator's non-saturating GAN loss on the realism logits (B,) of its samples: mean softplus(-fake) =
    -log D(G(z)) (``edm_guidance.py``: ``compute_generator_clean_cls_loss``). Scalar."""
    return torch.nn.functional.softplus(-fake_logits).mean()
