"""The training objective as one seam: DDPM with epsilon or v-prediction (``GaussianDiffusion``) or rectified flow
(``RectifiedFlow``), chosen by ``--objective`` or read from a diffusers pipeline's ``scheduler/scheduler_config.json``.

Both objectives offer ``sample_timesteps(n, generator, device)``, ``training_losses(model_fn, x_0, t, noise)``
(dict of (B,) float64 terms, ``loss`` among them), ``num_timesteps`` and ``learn_sigma``.
"""

from __future__ import annotations

import math

from ditforge.config.sections import OBJECTIVES, WEIGHTING_SCHEMES
from ditforge.diffusion.flow import RectifiedFlow
from ditforge.diffusion.gaussian import BETA_SCHEDULES, GaussianDiffusion, betas_from_schedule, create_diffusion
from ditforge.errors import UserError

Objective = GaussianDiffusion | RectifiedFlow
FLOW_SCHEDULERS = ("FlowMatchEulerDiscreteScheduler", "FlowMatchHeunDiscreteScheduler")


def objective_of_scheduler(config: dict, where: str = "scheduler") -> str:
    """``ddpm`` | ``v`` | ``flow`` for a diffusers scheduler config: flow-matching schedulers are ``flow``, and so is
    a multistep solver on flow sigmas (``prediction_type`` ``flow_prediction`` with ``use_flow_sigmas``: a
    ``UniPCMultistepScheduler`` so configured, whose ``flow_shift`` is the shift); the others by ``prediction_type``
    (epsilon -> ``ddpm``, v_prediction -> ``v``).

    Raises:
        UserError: a prediction type other than epsilon / v_prediction (``sample``, or ``flow_prediction`` without
            flow sigmas), naming ``where``.
    """
    if config.get("_class_name") in FLOW_SCHEDULERS or _flow_sigmas(config):
        return "flow"
    pred = config.get("prediction_type", "epsilon")
    if pred not in ("epsilon", "v_prediction"):
        raise UserError(f"{where}: prediction_type {pred!r} is not supported (expected epsilon or v_prediction)")
    return "ddpm" if pred == "epsilon" else "v"


def _flow_sigmas(config: dict) -> bool:
    """A solver scheduler (UniPC, DPM-Solver) configured for flow matching: its sigmas are the
    shifted flow times (``use_flow_sigmas``, ``flow_shift``), its model output the velocity noise - x0."""
    return config.get("prediction_type") == "flow_prediction" and bool(config.get("use_flow_sigmas"))


def create_objective(objective: str, learn_sigma: bool, scheduler_config: dict | None = None,
                     flow_shift: float | None = None, weighting_scheme: str = "logit_normal",
                     logit_mean: float = 0.0, logit_std: float = 1.0, timestep_respacing: str | None = None,
                     where: str = "scheduler", device=None, seq_len: int | None = None,
                     t_range: tuple[float, float] = (0.0, 1.0), given_frames: int = 0
                     ) -> GaussianDiffusion | RectifiedFlow:
    """The objective ``objective`` (``ddpm`` | ``v`` | ``flow``; ``auto`` = the scheduler's, else ``ddpm``).

    ``device`` (the batches' device): a Gaussian objective's schedule tables are moved there, so that a
    training step indexes them without copying them from host memory. On a GPU each such copy (PyTorch's
    blocking copy from pageable memory) is a stream synchronisation: DiT's loss with learned sigma made 15 per
    step (3 without), and after each the GPU idled while the host launched the work that followed. Flow's loss
    reads no table.

    Gaussian objectives take the scheduler's ``beta_schedule`` / ``beta_start`` / ``beta_end`` /
    ``num_train_timesteps`` / ``trained_betas`` (recomputed in float64) or, without a scheduler config, DiT's
    1000 linear betas; ``timestep_respacing`` respaces them for sampling. Flow takes ``flow_shift``, else the
    scheduler's ``shift`` (``FlowMatchEulerDiscreteScheduler``) or ``flow_shift`` (a solver on flow sigmas, e.g.
    3.0 at 480p, 5.0 at 720p), else 1.

    Some schedulers change the betas' ``alphas_cumprod`` twice (``shift_and_rescale``), and any DDPM-family
    scheduler may rescale them to zero terminal SNR (``rescale_betas_zero_snr``); the objective trains on the
    changed ones.

    ``t_range`` (flow only; one of a pipeline's two experts, from the adapter's ``objective_args``): the training
    times are drawn from their density restricted to [lo, hi) (``RectifiedFlow``). ``given_frames`` (flow only; the
    adapter's, for an image-to-video family whose first frame is given): the first latent frames are conditioning,
    out of the loss.

    A scheduler with dynamic (resolution-dependent) shifting (a ``FlowMatchEulerDiscreteScheduler`` with
    ``use_dynamic_shifting``) shifts by exp(mu), mu interpolated linearly in ``seq_len`` (the latent frames x height
    x width of a training sample) from ``base_shift`` at ``base_image_seq_len`` to ``max_shift`` at
    ``max_image_seq_len``, as its pipeline computes mu for the video it samples (``calculate_shift``); with the
    scheduler's exponential time shift, exp(mu) sigma / (1 + (exp(mu) - 1) sigma), this is the shift map above.

    Raises:
        UserError: a scheduler with dynamic shifting and no ``seq_len`` (or another time shift), an unknown
            beta schedule, or ``given_frames`` with a Gaussian objective, naming ``where``.
    """
    sched = scheduler_config or {}
    if objective not in OBJECTIVES:
        raise UserError(f"--objective: expected one of {', '.join(OBJECTIVES)}, got {objective}")
    if objective == "auto":
        objective = objective_of_scheduler(sched, where) if sched else "ddpm"
    if objective == "flow":
        dynamic = bool(sched.get("use_dynamic_shifting")) and flow_shift is None
        if dynamic and (seq_len is None or sched.get("time_shift_type", "exponential") != "exponential"):
            raise UserError(f"{where}: dynamic timestep shifting (use_dynamic_shifting) is supported for video "
                            "pipelines with the exponential time shift; give --flow_shift")
        if dynamic:
            mu = dynamic_shift_mu(seq_len, sched)
            shift = math.exp(mu)
        else:
            shift = flow_shift if flow_shift is not None else float(
                sched.get("flow_shift", 1.0) if _flow_sigmas(sched) else sched.get("shift", 1.0))
        if weighting_scheme not in WEIGHTING_SCHEMES:
            raise UserError(f"--weighting_scheme: expected one of {', '.join(WEIGHTING_SCHEMES)}, got {weighting_scheme}")
        return RectifiedFlow(shift, weighting_scheme, logit_mean, logit_std, learn_sigma,
                             int(sched.get("num_train_timesteps", 1000)), t_range, given_frames)
    if given_frames:
        raise UserError(f"{where}: a given first frame (image-to-video) is trained with flow matching; its "
                        f"scheduler's objective is {objective}")
    betas = None
    if sched:
        import torch

        if sched.get("trained_betas") is not None:
            betas = torch.tensor(sched["trained_betas"], dtype=torch.float64)
        else:
            schedule = sched.get("beta_schedule", "linear")
            if schedule not in BETA_SCHEDULES:
                raise UserError(f"{where}: beta_schedule {schedule!r} is not supported (expected one of "
                                f"{', '.join(BETA_SCHEDULES)})")
            betas = betas_from_schedule(schedule, int(sched.get("num_train_timesteps", 1000)),
                                        float(sched.get("beta_start", 1e-4)), float(sched.get("beta_end", 0.02)))
        betas = shift_and_rescale(betas, sched.get("snr_shift_scale"), bool(sched.get("rescale_betas_zero_snr")))
    diffusion = create_diffusion(timestep_respacing, learn_sigma, betas=betas,
                                 prediction_type="v_prediction" if objective == "v" else "epsilon")
    return diffusion if device is None else diffusion.to(device)


def shift_and_rescale(betas, snr_shift_scale: float | None, zero_terminal_snr: bool):
    """float64 (T,) betas whose ``alphas_cumprod`` abar are changed as a diffusers scheduler's config asks:

    - ``snr_shift_scale`` s (a scheduler config's key, e.g. 3.0 or 1.0): abar / (s + (1 - s) abar), which divides
      the SNR abar / (1 - abar) by s (the family's DDIM scheduler's ``__init__``, "SNR shift following" Esser et al.
      2024);
    - ``zero_terminal_snr``: sqrt(abar) shifted so that its last value is 0 and scaled so that its first is kept
      (Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are Flawed", Algorithm 1; diffusers'
      ``rescale_zero_terminal_snr``). The last beta becomes 1: x_T is pure noise, and v-prediction's target there
      is -x_0.

    Returns the betas of the changed abar, 1 - abar_t / abar_{t-1} (``betas`` itself when nothing changes).
    """
    import torch

    if snr_shift_scale in (None, 1.0) and not zero_terminal_snr:
        return betas
    abar = torch.cumprod(1.0 - betas, 0)
    if snr_shift_scale is not None:
        abar = abar / (snr_shift_scale + (1 - snr_shift_scale) * abar)
    if zero_terminal_snr:
        root = abar.sqrt()
        root = (root - root[-1]) * root[0] / (root[0] - root[-1])
        abar = root**2
    return 1.0 - abar / torch.cat([abar.new_ones(1), abar[:-1]])


def dynamic_shift_mu(seq_len: int, sched: dict) -> float:
    """mu of a dynamically shifting flow scheduler for ``seq_len`` latent positions: linear from ``base_shift`` at
    ``base_image_seq_len`` to ``max_shift`` at ``max_image_seq_len`` (diffusers' ``calculate_shift``; the defaults
    are ``FlowMatchEulerDiscreteScheduler``'s)."""
    x0, x1 = sched.get("base_image_seq_len", 256), sched.get("max_image_seq_len", 4096)
    y0, y1 = sched.get("base_shift", 0.5), sched.get("max_shift", 1.15)
    return (y1 - y0) / (x1 - x0) * seq_len + y0 - (y1 - y0) / (x1 - x0) * x0
