"""Rectified flow / flow matching: the straight path between data and noise, a velocity target, logit-normal or
uniform training times with an optional shift, and the Euler sampler.

Path and target (Liu et al. 2023, "Flow Straight and Fast"; Lipman et al. 2023, "Flow Matching"; in the
convention of Esser et al. 2024, "Scaling Rectified Flow Transformers", eq. 3 and sec. 3.1):
``x_t = (1 - t) x_0 + t eps`` for t in [0, 1] (t = 1 is pure noise), velocity ``v = dx_t/dt = eps - x_0``, loss
``|| v_theta(x_t, t) - v ||^2``. The model is called with ``1000 t``, as diffusers' flow-matching
transformers receive ``FlowMatchEulerDiscreteScheduler``'s timesteps (sigma x 1000).

Training times (Esser et al. 2024 sec. 3.1 and eq. 23): ``logit_normal``: u = sigmoid(m + s n), n ~ N(0, 1);
``uniform``: u ~ U(0, 1); then the resolution shift of Esser et al. 2024 eq. 23 / Open-Sora 1.2,
t = shift u / (1 + (shift - 1) u), the same map diffusers' ``FlowMatchEulerDiscreteScheduler(shift=...)`` applies to
its sampling sigmas.
"""

from __future__ import annotations

import math

import torch

from ditforge.config.sections import WEIGHTING_SCHEMES
from ditforge.diffusion.gaussian import ModelFn, mean_flat


def shift_times(t: torch.Tensor, shift: float) -> torch.Tensor:
    """t -> shift t / (1 + (shift - 1) t) (Esser et al. 2024 eq. 23; diffusers' ``FlowMatchEulerDiscreteScheduler``);
    identity at 1."""
    return shift * t / (1 + (shift - 1) * t)


class RectifiedFlow:
    """The flow-matching objective and its sampling schedule.

    Args:
        shift: timestep shift (Esser et al. 2024: 3.0 at 1024px; 1.0: none).
        weighting_scheme: how training times are drawn: ``logit_normal`` (Esser et al. 2024's default) or
            ``uniform`` (the name follows diffusers' flow-matching training scripts, where it selects the density of
            the times).
        logit_mean, logit_std: m and s of the logit-normal density.
        learn_sigma: the model returns 2C channels (as a DiT with learned sigma); the extra C are ignored.
        num_train_timesteps: the model's timestep scale (times are passed as ``num_train_timesteps * t``).
        t_range: (lo, hi): training times are drawn from their density restricted to [lo, hi) (the shifted
            logit-normal or uniform, truncated: the two experts of a pipeline each train on their side of the boundary).
        given_frames: the first latent frames (dim 2 of a video) that are conditioning, not learned: the loss averages
            over the others (an image-to-video family whose model sees its first frame clean, the adapter's
            ``given_frames``).

    Timesteps are float (B,) in [0, 1].
    """

    prediction_type = "flow"

    def __init__(self, shift: float = 1.0, weighting_scheme: str = "logit_normal", logit_mean: float = 0.0,
                 logit_std: float = 1.0, learn_sigma: bool = False, num_train_timesteps: int = 1000,
                 t_range: tuple[float, float] = (0.0, 1.0), given_frames: int = 0):
        if weighting_scheme not in WEIGHTING_SCHEMES:
            raise ValueError(f"weighting_scheme must be one of {WEIGHTING_SCHEMES}, got {weighting_scheme!r}")
        if not shift > 0:
            raise ValueError(f"shift must be positive, got {shift}")
        self.shift, self.weighting_scheme = float(shift), weighting_scheme
        self.logit_mean, self.logit_std = float(logit_mean), float(logit_std)
        self.learn_sigma = learn_sigma
        self.num_timesteps = num_train_timesteps
        if not 0.0 <= t_range[0] < t_range[1] <= 1.0:
            raise ValueError(f"t_range must satisfy 0 <= lo < hi <= 1, got {t_range}")
        self.t_range = (float(t_range[0]), float(t_range[1]))
        self.given_frames = int(given_frames)

    def sample_timesteps(self, n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
        """Training times (n,) float32 in (0, 1), drawn by ``weighting_scheme`` and shifted; within ``t_range`` when
        it is not the whole interval, by inverting the distribution function: the shift is monotone, so
        [lo, hi) maps back to an interval of u, and for the logit-normal to one of the normal draw, whose
        probabilities bound one uniform draw per sample."""
        if self.t_range != (0.0, 1.0):
            return self._sample_in_range(n, generator, device)
        if self.weighting_scheme == "logit_normal":
            u = torch.sigmoid(self.logit_mean + self.logit_std * torch.randn(n, generator=generator, device=device))
        else:
            u = torch.rand(n, generator=generator, device=device)
        return shift_times(u, self.shift)

    def _sample_in_range(self, n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
        def inverse_shift(t: float) -> float:
            return t / (self.shift - (self.shift - 1) * t)

        def normal_cdf(u: float) -> float:  # P(m + s n <= logit(u)): 0 at u = 0, 1 at u = 1
            if u <= 0.0 or u >= 1.0:
                return float(u >= 1.0)
            return 0.5 * (1 + math.erf((math.log(u / (1 - u)) - self.logit_mean) / (self.logit_std * math.sqrt(2))))

        u_lo, u_hi = (inverse_shift(t) for t in self.t_range)
        v = torch.rand(n, generator=generator, device=device, dtype=torch.float64)
        if self.weighting_scheme == "uniform":
            u = u_lo + (u_hi - u_lo) * v
        else:
            c_lo, c_hi = normal_cdf(u_lo), normal_cdf(u_hi)
            u = torch.sigmoid(self.logit_mean + self.logit_std * torch.special.ndtri(c_lo + (c_hi - c_lo) * v))
        return shift_times(u, self.shift).clamp(*self.t_range).float()

    def model_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """What the model is called with: ``num_train_timesteps * t`` (float)."""
        return t * self.num_timesteps

    def noisy(self, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = (1 - t) x_0 + t eps, in float64 then ``x_start``'s dtype."""
        tt = t.double().reshape(-1, *[1] * (x_start.ndim - 1))
        return ((1 - tt) * x_start.double() + tt * noise.double()).to(x_start.dtype)

    def training_losses(self, model_fn: ModelFn, x_start: torch.Tensor, t: torch.Tensor,
                        noise: torch.Tensor) -> dict[str, torch.Tensor]:
        """Flow-matching loss: mean over elements of (v_theta(x_t, t) - (eps - x_0))^2 (over the frames after the
        ``given_frames`` first).

        Args:
            model_fn: (x_t, 1000 t) -> (B, C or 2C, ...) velocity (the first C channels are used).
            x_start: (B, C, ...) clean data; t: (B,) float in [0, 1]; noise: like ``x_start``.

        Returns:
            dict of (B,) float64 tensors ``loss`` and ``mse`` (equal).
        """
        out = model_fn(self.noisy(x_start, t, noise), self.model_timesteps(t))
        v = out[:, : x_start.shape[1]]
        error = (noise.double() - x_start.double() - v.double()) ** 2
        mse = mean_flat(error[:, :, self.given_frames:] if self.given_frames else error)
        return {"loss": mse, "mse": mse}

    def sampling_times(self, num_steps: int) -> torch.Tensor:
        """float64 (num_steps + 1,) times from 1 down to 0, the sigmas of diffusers'
        ``FlowMatchEulerDiscreteScheduler(shift).set_timesteps(num_steps)`` (static shift), so a model trained for
        a flow-matching pipeline samples as that pipeline does: ``num_steps`` times linear from 1 to the scheduler's
        ``sigma_min`` (the shifted time of timestep 1, ``shift_times(1 / T)``), shifted, then a final 0."""
        sigma_min = float(shift_times(torch.tensor(1.0 / self.num_timesteps, dtype=torch.float64), self.shift))
        times = shift_times(torch.linspace(1.0, sigma_min, num_steps, dtype=torch.float64), self.shift)
        return torch.cat([times, times.new_zeros(1)])


@torch.no_grad()
def euler_loop(flow: RectifiedFlow, model_fn: ModelFn, noise: torch.Tensor, num_steps: int,
               on_step=None) -> torch.Tensor:
    """Integrate dx/dt = v_theta(x, t) from t = 1 (``noise``) to t = 0 with Euler steps on
    ``flow.sampling_times(num_steps)``: x <- x + (t_{i+1} - t_i) v (Esser et al. 2024's sampler;
    diffusers' ``FlowMatchEulerDiscreteScheduler.step``).

    Args:
        model_fn: (x (B, C, ...), 1000 t (B,) float) -> (B, C or 2C, ...); the first C channels are the velocity.
            One with a ``plan`` method gets the loop's timesteps first (``GuidedModel.plan``).
        noise: (B, C, ...) N(0, I).
        on_step: called with each step's timestep on the 0..999 scale (host int) before its model call
            (default: ``model_fn.step`` when it has one: the guidance interval).

    Returns:
        (B, C, ...) samples in ``noise``'s dtype.
    """
    times = flow.sampling_times(num_steps).tolist()
    on_step = on_step if on_step is not None else getattr(model_fn, "step", None)
    x, c = noise.double(), noise.shape[1]
    if hasattr(model_fn, "plan"):  # each step's value exactly as below, filled on the device (capturable)
        model_fn.plan(torch.stack([torch.full((), t * flow.num_timesteps, device=x.device, dtype=noise.dtype)
                                   for t in times[:-1]]))
    for t, t_next in zip(times[:-1], times[1:]):
        if on_step is not None:
            on_step(min(round(t * flow.num_timesteps), flow.num_timesteps - 1))
        tt = torch.full((x.shape[0],), t * flow.num_timesteps, device=x.device, dtype=noise.dtype)
        v = model_fn(x.to(noise.dtype), tt)[:, :c]
        x = x + (t_next - t) * v.double()
    return x.to(noise.dtype)
