"""Gaussian diffusion as in DiT / ADM: linear betas, q(x_t | x_0), the posterior, learned-range variance,
and the hybrid training loss L_simple + L_vlb; epsilon or v-prediction (Stable Diffusion 2's 768px models).

Sources: Ho et al. 2020 ("DDPM", eqs. 4, 6, 7, 12); Nichol & Dhariwal 2021 ("Improved DDPM", eqs. 15, 16 and
the discretised decoder); ``gaussian_diffusion.py`` of openai/guided-diffusion as used by facebookresearch/DiT;
Salimans & Ho 2022 ("Progressive Distillation", sec. 4: v = sqrt(abar) eps - sqrt(1 - abar) x_0); the beta
schedules of diffusers' ``DDPMScheduler`` (``linear``, ``scaled_linear``, ``squaredcos_cap_v2``).
All schedule tables are float64, and so is the arithmetic on the tensors (cheap next to the model), so the
formulas match their closed forms to float64 precision; results are cast back to the input dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

ModelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def linear_betas(num_timesteps: int = 1000) -> torch.Tensor:
    """Linear schedule of Ho et al. 2020, rescaled for other step counts as ADM does. float64 (T,)."""
    scale = 1000 / num_timesteps
    return torch.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=torch.float64)


BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
PREDICTION_TYPES = ("epsilon", "v_prediction")


def betas_from_schedule(schedule: str = "linear", num_timesteps: int = 1000, beta_start: float = 1e-4,
                        beta_end: float = 0.02) -> torch.Tensor:
    """float64 (T,) betas of a diffusers ``beta_schedule``, recomputed in float64 (diffusers builds them in float32):

    - ``linear``: linspace(beta_start, beta_end, T) (DDPM; DiT and the DDPM-trained image families);
    - ``scaled_linear``: linspace(sqrt(beta_start), sqrt(beta_end), T)^2 (Latent Diffusion / Stable Diffusion);
    - ``squaredcos_cap_v2``: the cosine schedule, beta_t = min(1 - abar(t+1)/abar(t), 0.999) with
      abar(t) = cos^2((t/T + 0.008) / 1.008 * pi/2) (Nichol & Dhariwal 2021, eq. 17).

    Raises:
        ValueError: another schedule name.
    """
    if schedule == "linear":
        return torch.linspace(beta_start, beta_end, num_timesteps, dtype=torch.float64)
    if schedule == "scaled_linear":
        return torch.linspace(beta_start**0.5, beta_end**0.5, num_timesteps, dtype=torch.float64) ** 2
    if schedule == "squaredcos_cap_v2":
        t = torch.arange(num_timesteps + 1, dtype=torch.float64) / num_timesteps
        abar = torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
        return (1 - abar[1:] / abar[:-1]).clamp(max=0.999)
    raise ValueError(f"unknown beta schedule {schedule!r}; expected one of {BETA_SCHEDULES}")


def space_timesteps(num_timesteps: int, section_counts: str | int) -> list[int]:
    """Timesteps kept when respacing, e.g. ``"250"`` (evenly strided) or ``"10,15,20"`` (per equal section).

    Source: ``space_timesteps`` in guided-diffusion's respace.py (the ``ddimN`` form is not needed here).

    Returns:
        Sorted original timestep indices.

    Raises:
        ValueError: a section asks for more steps than it has.
    """
    counts = [int(x) for x in str(section_counts).split(",")]
    size_per, extra = divmod(num_timesteps, len(counts))
    start, steps = 0, []
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        if count < 1 or size < count:
            raise ValueError(f"cannot take {count} steps from a section of {size} diffusion steps")
        stride = 1 if count <= 1 else (size - 1) / (count - 1)
        cur = 0.0
        for _ in range(count):  # accumulated, not stride * j: ties round as in guided-diffusion
            steps.append(start + round(cur))
            cur += stride
        start += size
    return sorted(set(steps))


def normal_kl(mean1, logvar1, mean2, logvar2) -> torch.Tensor:
    """KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)) elementwise, in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """Tanh approximation of the standard normal CDF (Page 1977), as used by ADM's decoder likelihood."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def discretized_gaussian_log_likelihood(x: torch.Tensor, means: torch.Tensor, log_scales: torch.Tensor) -> torch.Tensor:
    """log-likelihood of data in [-1, 1] quantised to 256 bins under N(means, e^(2 log_scales)); nats, elementwise.

    Source: Ho et al. 2020 eq. 13 (the discrete decoder), implemented as in guided-diffusion's losses.py.
    """
    centered = x - means
    inv_stdv = torch.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_stdv * (centered + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_stdv * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_cdf_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta))


def mean_flat(x: torch.Tensor) -> torch.Tensor:
    """Mean over all dimensions but the first: (B, ...) -> (B,)."""
    return x.mean(dim=tuple(range(1, x.ndim)))


@dataclass
class Prediction:
    """The model's reverse step p(x_{t-1} | x_t): mean, variance, log-variance and predicted x_0."""

    mean: torch.Tensor
    variance: torch.Tensor
    log_variance: torch.Tensor
    pred_xstart: torch.Tensor
    eps: torch.Tensor


class GaussianDiffusion:
    """Discrete-time Gaussian diffusion with epsilon or v-prediction and (optionally) learned-range variance.

    Args:
        betas: float64 (T,) noise schedule.
        learn_sigma: the model returns 2C channels, the last C interpolating log-variance between beta_t and
            the posterior variance (Improved DDPM eq. 15). Otherwise the variance is fixed to beta_t
            ("fixed large", DiT's choice when it does not learn sigma).
        timestep_map: for a respaced process, the original timestep of each kept step; the model is called
            with original timesteps.
        prediction_type: what the model's first C channels predict: ``epsilon`` (the noise) or
            ``v_prediction`` (v = sqrt(abar_t) eps - sqrt(1 - abar_t) x_0, Salimans & Ho 2022); diffusers' names.

    Timesteps passed to methods are int64 (B,) indices into this process's own steps.
    """

    def __init__(self, betas: torch.Tensor, learn_sigma: bool = True, timestep_map: list[int] | None = None,
                 prediction_type: str = "epsilon"):
        betas = betas.to(torch.float64)
        if betas.ndim != 1 or not bool(((betas > 0) & (betas <= 1)).all()):
            raise ValueError("betas must be a 1-D tensor in (0, 1]")
        if prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")
        self.num_timesteps = len(betas)
        self.learn_sigma = learn_sigma
        self.prediction_type = prediction_type
        self.timestep_map = torch.tensor(timestep_map if timestep_map is not None else range(len(betas)))
        self.original_timesteps: list[int] = self.timestep_map.tolist()  # host copy: loops read it without syncs
        self.betas = betas
        alphas = 1.0 - betas
        self.alphas_cumprod = torch.cumprod(alphas, 0)
        self.alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64), self.alphas_cumprod[:-1]])
        self.sqrt_alphas_cumprod = self.alphas_cumprod.sqrt()
        self.sqrt_one_minus_alphas_cumprod = (1.0 - self.alphas_cumprod).sqrt()
        self.sqrt_recip_alphas_cumprod = (1.0 / self.alphas_cumprod).sqrt()
        self.sqrt_recipm1_alphas_cumprod = (1.0 / self.alphas_cumprod - 1.0).sqrt()
        # Posterior q(x_{t-1} | x_t, x_0) (DDPM eqs. 6-7).
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        # The posterior variance is 0 at t = 0; its log is clipped to the value at t = 1.
        self.posterior_log_variance_clipped = torch.log(
            torch.cat([self.posterior_variance[1:2], self.posterior_variance[1:]])
        )
        self.posterior_mean_coef1 = betas * self.alphas_cumprod_prev.sqrt() / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - self.alphas_cumprod_prev) * alphas.sqrt() / (1.0 - self.alphas_cumprod)

    def to(self, device: torch.device | str) -> "GaussianDiffusion":
        """Move the schedule tables to ``device`` (in place; returns self). Sampling loops do this once, so
        that no step copies a table from host memory (a pageable host-to-device copy synchronises the stream)."""
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    @staticmethod
    def _extract(table: torch.Tensor, t: torch.Tensor, ndim: int) -> torch.Tensor:
        """table[t] as float64, shaped (B, 1, ..., 1) to broadcast against an ndim-dimensional tensor."""
        out = table.to(t.device)[t]
        return out.reshape(out.shape + (1,) * (ndim - 1))

    def sample_timesteps(self, n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
        """Training timesteps: (n,) int64 uniform in 0..T-1 (DDPM's Algorithm 1)."""
        return torch.randint(0, self.num_timesteps, (n,), generator=generator, device=device)

    def model_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """The original (un-respaced) timesteps the model is conditioned on, int64 (B,)."""
        return self.timestep_map.to(t.device)[t]

    def q_sample(self, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps (DDPM eq. 4). Same shape and dtype as ``x_start``."""
        n = x_start.ndim
        x_t = self._extract(self.sqrt_alphas_cumprod, t, n) * x_start.double()
        x_t = x_t + self._extract(self.sqrt_one_minus_alphas_cumprod, t, n) * noise.double()
        return x_t.to(x_start.dtype)

    def q_posterior_mean_variance(self, x_start: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor):
        """Mean, variance and clipped log-variance of q(x_{t-1} | x_t, x_0) (DDPM eq. 7), float64."""
        n = x_t.ndim
        mean = self._extract(self.posterior_mean_coef1, t, n) * x_start.double()
        mean = mean + self._extract(self.posterior_mean_coef2, t, n) * x_t.double()
        return (
            mean,
            self._extract(self.posterior_variance, t, n).expand_as(mean),
            self._extract(self.posterior_log_variance_clipped, t, n).expand_as(mean),
        )

    def predict_xstart_from_eps(self, x_t: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """x_0 = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t), float64."""
        n = x_t.ndim
        return self._extract(self.sqrt_recip_alphas_cumprod, t, n) * x_t.double() - self._extract(
            self.sqrt_recipm1_alphas_cumprod, t, n
        ) * eps.double()

    def eps_from_output(self, x_t: torch.Tensor, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The noise the model's prediction ``out`` implies, float64: ``out`` itself for epsilon; for v,
        eps = sqrt(1 - abar_t) x_t + sqrt(abar_t) v (invert x_t = sqrt(abar) x_0 + sqrt(1 - abar) eps and v)."""
        if self.prediction_type == "epsilon":
            return out.double()
        n = x_t.ndim
        return (self._extract(self.sqrt_one_minus_alphas_cumprod, t, n) * x_t.double()
                + self._extract(self.sqrt_alphas_cumprod, t, n) * out.double())

    def predict_xstart_from_v(self, x_t: torch.Tensor, t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """x_0 = sqrt(abar_t) x_t - sqrt(1 - abar_t) v (invert x_t and v; Salimans & Ho 2022), float64: finite at a
        zero terminal SNR (abar_T = 0, x_0 = -v), where the route through eps divides by sqrt(abar_T)."""
        n = x_t.ndim
        return (self._extract(self.sqrt_alphas_cumprod, t, n) * x_t.double()
                - self._extract(self.sqrt_one_minus_alphas_cumprod, t, n) * v.double())

    def velocity(self, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """v = sqrt(abar_t) eps - sqrt(1 - abar_t) x_0 (Salimans & Ho 2022, sec. 4; diffusers' ``get_velocity``),
        float64."""
        n = x_start.ndim
        return (self._extract(self.sqrt_alphas_cumprod, t, n) * noise.double()
                - self._extract(self.sqrt_one_minus_alphas_cumprod, t, n) * x_start.double())

    def predict_eps_from_xstart(self, x_t: torch.Tensor, t: torch.Tensor, pred_xstart: torch.Tensor) -> torch.Tensor:
        """Inverse of ``predict_xstart_from_eps``, float64."""
        n = x_t.ndim
        return (self._extract(self.sqrt_recip_alphas_cumprod, t, n) * x_t.double() - pred_xstart.double()) / (
            self._extract(self.sqrt_recipm1_alphas_cumprod, t, n)
        )

    def p_mean_variance(
        self, model_output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, clip_denoised: bool = False
    ) -> Prediction:
        """Turn a model output into p(x_{t-1} | x_t).

        Args:
            model_output: (B, 2C, ...) when ``learn_sigma`` (eps or v, then variance values in [-1, 1]), else
                (B, C, ...).
            x_t: (B, C, ...) current sample.
            clip_denoised: clamp the predicted x_0 to [-1, 1] (pixel-space data).

        With learned range, log sigma^2 = f log beta_t + (1 - f) log beta~_t, f = (v + 1) / 2
        (Improved DDPM eq. 15).
        """
        C, n = x_t.shape[1], x_t.ndim
        if self.learn_sigma:
            if model_output.shape[1] != 2 * C:
                raise ValueError(f"learned sigma needs {2 * C} output channels, got {model_output.shape[1]}")
            pred, var_values = model_output.double().split(C, dim=1)
            eps = self.eps_from_output(x_t, t, pred)
            min_log = self._extract(self.posterior_log_variance_clipped, t, n)
            max_log = self._extract(torch.log(self.betas), t, n)
            frac = (var_values + 1) / 2
            log_variance = frac * max_log + (1 - frac) * min_log
            variance = torch.exp(log_variance)
        else:
            eps = self.eps_from_output(x_t, t, model_output)
            # Fixed large variance: beta_t, with beta~_1 at t = 0 (as guided-diffusion's FIXED_LARGE).
            large = torch.cat([self.posterior_variance[1:2], self.betas[1:]])
            variance = self._extract(large, t, n)
            log_variance = torch.log(variance).expand_as(eps)  # log before expanding: B logs, not B*C*H*W
            variance = variance.expand_as(eps)
        pred_xstart = self.predict_xstart_from_eps(x_t, t, eps)
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1, 1)
        mean, _, _ = self.q_posterior_mean_variance(pred_xstart, x_t, t)
        return Prediction(mean, variance, log_variance, pred_xstart, eps)

    def vb_terms_bpd(self, model_output: torch.Tensor, x_start: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor):
        """Variational-bound term L_{t-1} in bits per dimension, (B,) float64.

        KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t)) for t > 0, the discretised decoder NLL at t = 0
        (DDPM eq. 5 and 13).
        """
        true_mean, _, true_log_var = self.q_posterior_mean_variance(x_start, x_t, t)
        out = self.p_mean_variance(model_output, x_t, t)
        kl = mean_flat(normal_kl(true_mean, true_log_var, out.mean, out.log_variance)) / math.log(2.0)
        nll = -discretized_gaussian_log_likelihood(x_start.double(), out.mean, 0.5 * out.log_variance)
        nll = mean_flat(nll) / math.log(2.0)
        return torch.where(t == 0, nll, kl)

    def training_losses(
        self, model_fn: ModelFn, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The hybrid loss of Improved DDPM / DiT: L_simple (MSE on eps, or on v for v-prediction) + L_vlb
        (learned variance only).

        The vb term sees the eps prediction detached, so it trains only the variance (Improved DDPM sec. 3.1).
        With ``learn_sigma`` off this is exactly diffusers' training scripts' loss: MSE between the model output
        and ``noise`` (epsilon) or ``scheduler.get_velocity(x_0, noise, t)`` (v_prediction), on
        ``scheduler.add_noise(x_0, noise, t)``.

        Args:
            model_fn: (x_t, model_timesteps) -> model output; the timesteps it gets are original ones.
            x_start: (B, C, ...) clean data; t: (B,) int64; noise: like ``x_start``.

        Returns:
            dict of (B,) float64 tensors: ``loss``, ``mse`` and, with learned sigma, ``vb``.
        """
        x_t = self.q_sample(x_start, t, noise)
        model_output = model_fn(x_t, self.model_timesteps(t))
        C = x_t.shape[1]
        terms = {}
        if self.learn_sigma:
            pred, var_values = model_output.split(C, dim=1)
            frozen = torch.cat([pred.detach(), var_values], dim=1)
            terms["vb"] = self.vb_terms_bpd(frozen, x_start, x_t, t)
        else:
            pred = model_output
        target = noise.double() if self.prediction_type == "epsilon" else self.velocity(x_start, t, noise)
        terms["mse"] = mean_flat((target - pred.double()) ** 2)
        terms["loss"] = terms["mse"] + terms["vb"] if self.learn_sigma else terms["mse"]
        return terms


def create_diffusion(
    timestep_respacing: str | int | None = None, learn_sigma: bool = True, diffusion_steps: int = 1000,
    betas: torch.Tensor | None = None, prediction_type: str = "epsilon",
) -> GaussianDiffusion:
    """DiT's diffusion: ``diffusion_steps`` linear-beta steps (or the given float64 ``betas``), optionally respaced
    for sampling (e.g. ``"250"``).

    Respacing keeps the chosen steps and recomputes betas so that the kept steps have the same abar_t
    (Improved DDPM sec. 4): beta'_i = 1 - abar_{s_i} / abar_{s_{i-1}}.
    """
    betas = linear_betas(diffusion_steps) if betas is None else betas.to(torch.float64)
    if not timestep_respacing:
        return GaussianDiffusion(betas, learn_sigma, prediction_type=prediction_type)
    keep = space_timesteps(len(betas), timestep_respacing)
    abar = torch.cumprod(1.0 - betas, 0)[keep]
    prev = torch.cat([torch.ones(1, dtype=torch.float64), abar[:-1]])
    return GaussianDiffusion(1.0 - abar / prev, learn_sigma, timestep_map=keep, prediction_type=prediction_type)
