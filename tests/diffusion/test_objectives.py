"""The objective seam (``ditforge.diffusion.objective``, ``flow``, the v-prediction path of ``gaussian``, and the
``objective`` plumbing of ``generate``) against independent references.

References, all written here:
  * beta schedules: diffusers' ``DDPMScheduler(beta_schedule=...).betas`` (float32 there) and float64 closed forms
    in python ``math`` (no linspace, no cumprod);
  * v-prediction: diffusers' ``DDPMScheduler.get_velocity`` on Stable Diffusion's scaled_linear schedule, and the
    algebra of Salimans & Ho 2022 written out here (v = sqrt(abar) eps - sqrt(1 - abar) x_0 and its inverse);
    a v-model's variational bound and its samples against an epsilon model fed the equivalent eps;
  * rectified flow: the path / target / timestep scale of SD3 eq. 3 written here; the training-time densities
    by Kolmogorov-Smirnov against their CDFs (DKW bound) and by moment checks; the shift through its odds form
    (odds(t) = shift * odds(u)) and diffusers' ``FlowMatchEulerDiscreteScheduler`` sigmas; Euler against that
    scheduler driven by hand, and against a velocity field whose Euler solution is exact (one data point);
  * ``generate``: the loops it should reduce to (``euler_loop`` / ``sample_loop`` / ``solver_loop`` over a
    ``GuidedModel``) with a tiny DiT whose parameters are all perturbed (adaLN-Zero would make it output zeros).
Inputs are fresh random draws (a new seed per run, shown in failure messages where a statistic is tested), never
zeros. Statistical checks fail with probability < 1e-4 when the implementation is right.
"""

from __future__ import annotations

import json
import math
import secrets

import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import (DDIMScheduler, DDPMScheduler, FlowMatchEulerDiscreteScheduler,  # noqa: E402
                       FlowMatchHeunDiscreteScheduler, PNDMScheduler)

from ditforge.diffusion import create_diffusion, generate  # noqa: E402
from ditforge.diffusion.flow import RectifiedFlow, euler_loop, shift_times  # noqa: E402
from ditforge.diffusion.gaussian import GaussianDiffusion, betas_from_schedule, linear_betas  # noqa: E402
from ditforge.diffusion.objective import create_objective, objective_of_scheduler  # noqa: E402
from ditforge.diffusion.samplers import GuidedModel, sample_loop, solver_loop  # noqa: E402
from ditforge.errors import UserError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

EPS32 = torch.finfo(torch.float32).eps
SD = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)  # Stable Diffusion 1.x / 2.x
# scheduler_config.json of real pipelines (as shipped: SD 1.5 has no prediction_type, i.e. epsilon)
SD15_PNDM = {"_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0", "beta_end": 0.012,
             "beta_schedule": "scaled_linear", "beta_start": 0.00085, "num_train_timesteps": 1000,
             "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None,
             "clip_sample": False}
SD2_768_V = {"_class_name": "DDIMScheduler", "_diffusers_version": "0.8.0", "beta_end": 0.012,
             "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False, "num_train_timesteps": 1000,
             "prediction_type": "v_prediction", "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
             "trained_betas": None}
SD3_FLOW = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.29.0.dev0",
            "num_train_timesteps": 1000, "shift": 3.0}
FLUX_FLOW = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.30.0.dev0",
             "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
             "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True}


def _json_config(scheduler) -> dict:
    """A scheduler's config as its scheduler_config.json holds it (with ``_class_name``), which is what ditforge
    reads from a pipeline folder (``scheduler.config`` itself has no ``_class_name``)."""
    return json.loads(scheduler.to_json_string())


def _seed() -> int:
    """A fresh seed per call (OS entropy; the global RNGs are left alone)."""
    return secrets.randbits(31)


# ----------------------------------------------------------------------------------------------------------
# Independent references
# ----------------------------------------------------------------------------------------------------------
def ref_betas(schedule: str, T: int, start: float, end: float) -> torch.Tensor:
    """Closed forms in python floats: linear start + (end - start) i / (T - 1); scaled_linear the square of the
    linear ramp between the square roots; squaredcos_cap_v2 min(1 - f((i+1)/T) / f(i/T), 0.999) with
    f(s) = cos^2((s + 0.008) / 1.008 * pi / 2) (Improved DDPM eq. 17)."""
    if schedule == "linear":
        out = [start + (end - start) * i / (T - 1) for i in range(T)]
    elif schedule == "scaled_linear":
        a, b = math.sqrt(start), math.sqrt(end)
        out = [(a + (b - a) * i / (T - 1)) ** 2 for i in range(T)]
    else:
        f = lambda s: math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
        out = [min(1 - f((i + 1) / T) / f(i / T), 0.999) for i in range(T)]
    return torch.tensor(out, dtype=torch.float64)


def ref_abar(betas: torch.Tensor) -> torch.Tensor:
    """Running product of 1 - beta with a python loop."""
    out, acc = [], 1.0
    for b in betas.tolist():
        acc *= 1.0 - b
        out.append(acc)
    return torch.tensor(out, dtype=torch.float64)


def bcast(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.reshape(-1, *[1] * (ndim - 1))


def ref_velocity(abar_t: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """v = sqrt(abar) eps - sqrt(1 - abar) x_0 (Salimans & Ho 2022, sec. 4), float64."""
    a = bcast(abar_t, x0.ndim)
    return a.sqrt() * eps.double() - (1 - a).sqrt() * x0.double()


def v_to_eps(abar_t: torch.Tensor, x_t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """eps = sqrt(1 - abar) x_t + sqrt(abar) v (invert x_t = sqrt(abar) x_0 + sqrt(1 - abar) eps and v), float64."""
    a = bcast(abar_t, x_t.ndim)
    return (1 - a).sqrt() * x_t.double() + a.sqrt() * v.double()


def normal_cdf(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(z / math.sqrt(2)))


def ks_statistic(samples: torch.Tensor, cdf) -> float:
    """sup |F_n - F| of float64 samples against the CDF ``cdf`` (a function of a sorted float64 tensor)."""
    x, _ = samples.double().sort()
    n = x.numel()
    f = cdf(x)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - f, f - (i - 1) / n).max())


# DKW: P(sqrt(n) D_n > lam) <= 2 exp(-2 lam^2); lam = 2.5 -> 7.5e-6.
KS_LAMBDA = 2.5


def unshift(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Inverse of t = shift u / (1 + (shift - 1) u), from the odds form odds(t) = shift odds(u)."""
    t = t.double()
    odds = t / (1 - t) / shift
    return odds / (1 + odds)


# ----------------------------------------------------------------------------------------------------------
# 1. Beta schedules
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1000, 50])
@pytest.mark.parametrize("schedule,start,end", [("linear", 1e-4, 0.02), ("scaled_linear", 0.00085, 0.012),
                                                ("squaredcos_cap_v2", 1e-4, 0.02)])
def test_betas_from_schedule_match_diffusers_and_closed_form(schedule, start, end, T):
    ours = betas_from_schedule(schedule, T, start, end)
    assert ours.dtype == torch.float64 and ours.shape == (T,)
    # closed form: a few float64 ulps; the cosine schedule's 1 - f(t+1)/f(t) cancels (beta ~ 4e-5 at t = 0),
    # so ~1e-13 relative there.
    torch.testing.assert_close(ours, ref_betas(schedule, T, start, end), rtol=1e-12 if "cos" in schedule else 1e-14,
                               atol=0)
    # diffusers builds them in float32: linspace is within ~1 float32 ulp, squaring (scaled_linear) doubles it;
    # 3 ulps covers all three (measured: <= 2.2e-7 relative).
    theirs = DDPMScheduler(num_train_timesteps=T, beta_schedule=schedule, beta_start=start, beta_end=end).betas
    assert theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs.double(), rtol=3 * EPS32, atol=0)


def test_betas_from_schedule_unknown_name():
    with pytest.raises(ValueError, match="sigmoid"):
        betas_from_schedule("sigmoid", 1000)


# ----------------------------------------------------------------------------------------------------------
# 2. v-prediction
# ----------------------------------------------------------------------------------------------------------
def _sd_v_diffusion(learn_sigma=False, respacing=None) -> GaussianDiffusion:
    return create_diffusion(respacing, learn_sigma, betas=betas_from_schedule("scaled_linear", 1000, 0.00085, 0.012),
                            prediction_type="v_prediction")


def test_velocity_matches_diffusers_get_velocity():
    g = torch.Generator().manual_seed(_seed())
    sched = DDPMScheduler(prediction_type="v_prediction", **SD)
    d = _sd_v_diffusion()
    B = 6
    x0, noise = torch.randn(B, 3, 4, 4, generator=g), torch.randn(B, 3, 4, 4, generator=g)
    t = torch.cat([torch.tensor([0, 999]), torch.randint(1, 999, (B - 2,), generator=g)])
    v = d.velocity(x0, t, noise)
    assert v.dtype == torch.float64
    # diffusers' float32 table: alphas_cumprod within 1e-6 relative of the float64 one (a float32 cumprod over
    # 1000 steps), |v| <~ 4: 1e-5.
    torch.testing.assert_close(v.float(), sched.get_velocity(x0, noise, t), rtol=1e-5, atol=1e-5)
    # the same formula exactly: give diffusers the float64 table (checked against the python product first)
    abar = ref_abar(ref_betas("scaled_linear", 1000, 0.00085, 0.012))
    torch.testing.assert_close(d.alphas_cumprod, abar, rtol=1e-13, atol=0)
    sched.alphas_cumprod = abar
    torch.testing.assert_close(v, sched.get_velocity(x0.double(), noise.double(), t), rtol=0, atol=1e-14)
    torch.testing.assert_close(v, ref_velocity(abar[t], x0, noise), rtol=0, atol=1e-14)
    assert (v - noise.double()).abs().max() > 0.1  # not eps (would be at t = 0 only)


def test_velocity_of_respaced_process_uses_original_timesteps():
    # a respaced v-process at index i is the original process at timestep_map[i]: same abar, same v
    g = torch.Generator().manual_seed(_seed())
    d = _sd_v_diffusion(respacing="25")
    abar = ref_abar(ref_betas("scaled_linear", 1000, 0.00085, 0.012))
    x0, noise = torch.randn(5, 2, 3, 3, generator=g), torch.randn(5, 2, 3, 3, generator=g)
    i = torch.randint(0, 25, (5,), generator=g)
    orig = d.model_timesteps(i)
    assert d.num_timesteps == 25 and int(orig.max()) <= 999
    torch.testing.assert_close(d.velocity(x0, i, noise), ref_velocity(abar[orig], x0, noise), rtol=0, atol=1e-13)


def test_eps_and_x0_from_true_velocity():
    g = torch.Generator().manual_seed(_seed())
    d = _sd_v_diffusion()
    abar = ref_abar(ref_betas("scaled_linear", 1000, 0.00085, 0.012))
    x0 = torch.randn(5, 3, 4, 4, generator=g, dtype=torch.float64)
    noise = torch.randn(5, 3, 4, 4, generator=g, dtype=torch.float64)
    t = torch.cat([torch.tensor([0, 999]), torch.randint(1, 999, (3,), generator=g)])
    a = bcast(abar[t], 4)
    x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
    v = ref_velocity(abar[t], x0, noise)
    torch.testing.assert_close(d.eps_from_output(x_t, t, v), noise, rtol=0, atol=1e-12)
    # the reverse step built on it predicts x_0 (float64: 1/sqrt(abar_999) ~ 15 amplifies rounding)
    torch.testing.assert_close(d.p_mean_variance(v, x_t, t).pred_xstart, x0, rtol=0, atol=1e-11)
    # an epsilon process reads the same output as eps
    eps_d = create_diffusion(None, False, betas=d.betas)
    torch.testing.assert_close(eps_d.eps_from_output(x_t, t, v), v, rtol=0, atol=0)


def test_v_training_losses():
    g = torch.Generator().manual_seed(_seed())
    d = _sd_v_diffusion()
    abar = ref_abar(ref_betas("scaled_linear", 1000, 0.00085, 0.012))
    x0, noise = torch.randn(4, 3, 4, 4, generator=g), torch.randn(4, 3, 4, 4, generator=g)
    t = torch.randint(0, 1000, (4,), generator=g)
    a = bcast(abar[t], 4)
    v_true = ref_velocity(abar[t], x0, noise)
    seen = {}

    def true_v(x, tt):
        seen["x"], seen["t"] = x, tt
        return v_true

    terms = d.training_losses(true_v, x0, t, noise)
    assert set(terms) == {"loss", "mse"}
    assert float(terms["loss"].max()) < 1e-20
    torch.testing.assert_close(seen["x"].double(), a.sqrt() * x0.double() + (1 - a).sqrt() * noise.double(),
                               rtol=0, atol=1e-6)  # x_t in x_0's dtype (float32)
    assert seen["x"].dtype == torch.float32 and torch.equal(seen["t"], t)
    out = torch.randn(4, 3, 4, 4, generator=g, dtype=torch.float64)
    terms = d.training_losses(lambda x, tt: out, x0, t, noise)
    torch.testing.assert_close(terms["mse"], ((out - v_true) ** 2).mean(dim=(1, 2, 3)), rtol=1e-12, atol=0)
    torch.testing.assert_close(terms["loss"], terms["mse"], rtol=0, atol=0)
    # the same output under epsilon is scored against the noise: the two must differ
    eps_terms = create_diffusion(None, False, betas=d.betas).training_losses(lambda x, tt: out, x0, t, noise)
    torch.testing.assert_close(eps_terms["mse"], ((out - noise.double()) ** 2).mean(dim=(1, 2, 3)), rtol=1e-12, atol=0)
    assert not torch.allclose(eps_terms["mse"], terms["mse"])


def test_v_learned_sigma_vb_equals_epsilon_model_with_equivalent_eps():
    """A v-model's vb term (and its reverse step) equals an epsilon model's whose eps output is the v output
    converted here: the variance part and the mean through eps agree; only the mse target differs."""
    g = torch.Generator().manual_seed(_seed())
    betas = betas_from_schedule("scaled_linear", 1000, 0.00085, 0.012)
    dv = GaussianDiffusion(betas, learn_sigma=True, prediction_type="v_prediction")
    de = GaussianDiffusion(betas, learn_sigma=True, prediction_type="epsilon")
    abar = ref_abar(ref_betas("scaled_linear", 1000, 0.00085, 0.012))
    B, C = 6, 3
    x0 = torch.rand(B, C, 4, 4, generator=g, dtype=torch.float64) * 2 - 1  # in [-1, 1]: the t = 0 decoder NLL
    noise = torch.randn(B, C, 4, 4, generator=g, dtype=torch.float64)
    t = torch.cat([torch.tensor([0, 1, 999]), torch.randint(2, 999, (B - 3,), generator=g)])
    v_pred = ref_velocity(abar[t], x0, noise) + 0.3 * torch.randn(B, C, 4, 4, generator=g, dtype=torch.float64)
    var = torch.rand(B, C, 4, 4, generator=g, dtype=torch.float64) * 2 - 1

    def v_model(x, tt):
        return torch.cat([v_pred, var], 1)

    def eps_model(x, tt):  # the same prediction, converted to eps on the x_t the model is given
        return torch.cat([v_to_eps(abar[tt], x, v_pred), var], 1)

    tv, te = dv.training_losses(v_model, x0, t, noise), de.training_losses(eps_model, x0, t, noise)
    assert set(tv) == {"loss", "mse", "vb"}
    torch.testing.assert_close(tv["vb"], te["vb"], rtol=1e-10, atol=1e-12)
    assert bool((tv["vb"] > 0).all())
    torch.testing.assert_close(tv["mse"], ((v_pred - ref_velocity(abar[t], x0, noise)) ** 2).mean(dim=(1, 2, 3)),
                               rtol=1e-12, atol=0)
    torch.testing.assert_close(tv["loss"], tv["mse"] + tv["vb"], rtol=1e-14, atol=0)
    # the reverse steps agree in mean, variance and x_0
    a = bcast(abar[t], 4)
    x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
    pv, pe = dv.p_mean_variance(v_model(x_t, t), x_t, t), de.p_mean_variance(eps_model(x_t, t), x_t, t)
    for name in ("mean", "variance", "log_variance", "pred_xstart", "eps"):
        torch.testing.assert_close(getattr(pv, name), getattr(pe, name), rtol=1e-10, atol=1e-11, msg=name)
    # fed the raw v as eps, the epsilon model's vb differs (the test can tell the conversion is applied)
    assert not torch.allclose(de.training_losses(v_model, x0, t, noise)["vb"], tv["vb"], rtol=1e-3)


# ----------------------------------------------------------------------------------------------------------
# 3. create_objective / objective_of_scheduler
# ----------------------------------------------------------------------------------------------------------
SD_BETAS = ref_betas("scaled_linear", 1000, 0.00085, 0.012)


@pytest.mark.parametrize("learn_sigma", [False, True])
@pytest.mark.parametrize("config", [SD15_PNDM, _json_config(DDPMScheduler(**SD)), _json_config(PNDMScheduler(**SD))],
                         ids=["sd15-json", "DDPMScheduler", "PNDMScheduler"])
def test_auto_epsilon_scheduler_gives_sd_gaussian(config, learn_sigma):
    d = create_objective("auto", learn_sigma, config)
    assert isinstance(d, GaussianDiffusion)
    assert d.prediction_type == "epsilon" and d.learn_sigma is learn_sigma and d.num_timesteps == 1000
    assert d.original_timesteps == list(range(1000))
    torch.testing.assert_close(d.betas, SD_BETAS, rtol=1e-14, atol=0)
    assert objective_of_scheduler(config) == "ddpm"


def test_auto_v_scheduler_gives_v_gaussian():
    for config in (SD2_768_V, _json_config(DDPMScheduler(prediction_type="v_prediction", **SD))):
        d = create_objective("auto", False, config)
        assert isinstance(d, GaussianDiffusion) and d.prediction_type == "v_prediction"
        torch.testing.assert_close(d.betas, SD_BETAS, rtol=1e-14, atol=0)
        assert objective_of_scheduler(config) == "v"
    # respaced for sampling: the kept steps have the scheduler's abar
    d = create_objective("auto", True, SD2_768_V, timestep_respacing="25")
    assert d.num_timesteps == 25 and d.prediction_type == "v_prediction" and d.learn_sigma
    keep = d.original_timesteps
    assert keep[0] == 0 and keep[-1] == 999 and len(keep) == 25
    torch.testing.assert_close(d.alphas_cumprod, ref_abar(SD_BETAS)[keep], rtol=1e-12, atol=0)
    # an explicit objective wins over the scheduler's prediction type (its betas are still used)
    d = create_objective("ddpm", False, SD2_768_V)
    assert d.prediction_type == "epsilon"
    torch.testing.assert_close(d.betas, SD_BETAS, rtol=1e-14, atol=0)


def test_create_objective_other_gaussian_sources():
    g = torch.Generator().manual_seed(_seed())
    # no scheduler: DiT's 1000 linear betas (1e-4 .. 0.02)
    for obj, pred in (("auto", "epsilon"), ("ddpm", "epsilon"), ("v", "v_prediction")):
        d = create_objective(obj, True)
        assert isinstance(d, GaussianDiffusion) and d.prediction_type == pred
        torch.testing.assert_close(d.betas, ref_betas("linear", 1000, 1e-4, 0.02), rtol=1e-14, atol=0)
    assert create_objective("auto", False, {}).prediction_type == "epsilon"
    # DiT's own pipeline (facebook/DiT-XL-2-256 scheduler_config.json): exactly DiT's table
    dit = {"_class_name": "DDIMScheduler", "beta_end": 0.02, "beta_schedule": "linear", "beta_start": 0.0001,
           "clip_sample": False, "num_train_timesteps": 1000, "prediction_type": "epsilon"}
    assert torch.equal(create_objective("auto", True, dit).betas, linear_betas(1000))
    # trained_betas are taken as given; num_train_timesteps and the other schedule keys are read
    trained = (torch.rand(100, generator=g, dtype=torch.float64) * 0.02 + 1e-4).tolist()
    d = create_objective("auto", False, {"_class_name": "DDPMScheduler", "trained_betas": trained,
                                         "beta_schedule": "linear"})
    assert d.betas.tolist() == trained and d.num_timesteps == 100
    d = create_objective("auto", False, {"_class_name": "DDPMScheduler", "num_train_timesteps": 200,
                                         "beta_schedule": "squaredcos_cap_v2"})
    torch.testing.assert_close(d.betas, ref_betas("squaredcos_cap_v2", 200, 0, 0), rtol=1e-12, atol=0)
    d = create_objective("auto", False, {"_class_name": "DDPMScheduler", "beta_start": 2e-4, "beta_end": 0.03})
    torch.testing.assert_close(d.betas, ref_betas("linear", 1000, 2e-4, 0.03), rtol=1e-14, atol=0)


def test_auto_flow_scheduler_gives_rectified_flow():
    for config in (SD3_FLOW, _json_config(FlowMatchEulerDiscreteScheduler(shift=3.0)),
                   _json_config(FlowMatchHeunDiscreteScheduler(shift=3.0))):
        assert objective_of_scheduler(config) == "flow"
        f = create_objective("auto", False, config)
        assert isinstance(f, RectifiedFlow)
        assert f.shift == 3.0 and f.num_timesteps == 1000 and not f.learn_sigma
        assert f.weighting_scheme == "logit_normal" and (f.logit_mean, f.logit_std) == (0.0, 1.0)
    f = create_objective("auto", True, SD3_FLOW, flow_shift=1.5, weighting_scheme="uniform", logit_mean=0.3,
                         logit_std=0.7)
    assert f.shift == 1.5 and f.learn_sigma and f.weighting_scheme == "uniform"
    assert (f.logit_mean, f.logit_std) == (0.3, 0.7)
    assert create_objective("flow", False).shift == 1.0  # no scheduler, no flow_shift
    assert create_objective("flow", False, flow_shift=2.5).shift == 2.5
    assert create_objective("flow", False, {"shift": 4.0, "num_train_timesteps": 500}).num_timesteps == 500


def test_zero_terminal_snr_and_snr_shift_equal_the_schedulers_tables():
    """``rescale_betas_zero_snr`` (any DDPM-family scheduler) and CogVideoX's ``snr_shift_scale``: the objective's
    float64 abar equals the scheduler's own ``alphas_cumprod`` (CogVideoX's are float64: 1e-12; DDIMScheduler's
    float32 betas: 2e-6 absolute), the last is exactly 0 (the last beta 1), and the v-loss at that step is the MSE
    against -x_0 (v = sqrt(abar) eps - sqrt(1 - abar) x_0). The shift alone divides the SNR by s."""
    from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler

    cog = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, prediction_type="v_prediction",
               rescale_betas_zero_snr=True, timestep_spacing="trailing")
    for sched, tol in ((CogVideoXDDIMScheduler(**cog, snr_shift_scale=3.0), 1e-12),
                       (CogVideoXDPMScheduler(**cog, snr_shift_scale=1.0), 1e-12),
                       (DDIMScheduler(**SD, prediction_type="v_prediction", rescale_betas_zero_snr=True), 2e-6)):
        d = create_objective("auto", False, _json_config(sched))
        assert isinstance(d, GaussianDiffusion) and d.prediction_type == "v_prediction"
        torch.testing.assert_close(d.alphas_cumprod, sched.alphas_cumprod.double(), rtol=0, atol=tol)
        assert d.alphas_cumprod[-1] == 0 and d.betas[-1] == 1
    g = torch.Generator().manual_seed(_seed())
    x0, noise = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    out = torch.randn(2, 3, 4, 4, generator=g)
    t = torch.full((2,), 999)
    loss = d.training_losses(lambda x_t, ts: out, x0, t, noise)["loss"]
    torch.testing.assert_close(loss, ((out.double() + x0.double()) ** 2).mean((1, 2, 3)), rtol=1e-12, atol=0)
    shifted = create_objective("auto", False, {**_json_config(CogVideoXDDIMScheduler(**cog)),
                                               "rescale_betas_zero_snr": False, "snr_shift_scale": 3.0})
    plain, a = ref_abar(ref_betas("scaled_linear", 1000, 0.00085, 0.012)), shifted.alphas_cumprod
    torch.testing.assert_close(a / (1 - a), plain / (1 - plain) / 3, rtol=1e-10, atol=0)


@pytest.mark.parametrize("config,match", [
    ({**SD15_PNDM, "prediction_type": "sample"}, "prediction_type 'sample'"),
    (FLUX_FLOW, "use_dynamic_shifting"),
    ({**SD15_PNDM, "beta_schedule": "sigmoid"}, "beta_schedule 'sigmoid'"),
])
def test_create_objective_rejects_unsupported_schedulers(config, match):
    where = "--init_from some/pipeline: scheduler"
    with pytest.raises(UserError, match=match) as e:
        create_objective("auto", False, config, where=where)
    assert where in str(e.value)


def test_create_objective_rejects_bad_arguments():
    with pytest.raises(UserError, match="--objective"):
        create_objective("eps", False)
    with pytest.raises(UserError, match="--weighting_scheme"):
        create_objective("flow", False, weighting_scheme="mode")
    with pytest.raises(UserError, match="x/scheduler.*'sample'"):
        objective_of_scheduler({"_class_name": "DDIMScheduler", "prediction_type": "sample"}, "x/scheduler")
    assert objective_of_scheduler({"_class_name": "DDIMScheduler"}) == "ddpm"  # default epsilon
    assert objective_of_scheduler(_json_config(DDIMScheduler(prediction_type="v_prediction"))) == "v"


# ----------------------------------------------------------------------------------------------------------
# 4. Rectified flow: training times, path, loss
# ----------------------------------------------------------------------------------------------------------
N_DRAWS = 8192


def test_shift_times_closed_form_and_diffusers_sigmas():
    g = torch.Generator().manual_seed(_seed())
    u = torch.rand(1000, generator=g, dtype=torch.float64) * 0.998 + 0.001
    for s in (1.0, 3.0, 0.5, 7.3):
        t = shift_times(u, s)
        odds, want = t / (1 - t), s * u / (1 - u)  # odds scale by s
        # float64, unit roundoff r = 2^-53: t carries <= 5 roundings, which 1 - t turns into 5 r t / (1 - t)
        # relative near t = 1 (odds up to 7,300 here); with the other roundings (10 + 5 odds) r. A fixed 1e-12 was
        # exceeded by some draws (1.12x of it, worst of 3,000 seeds).
        assert ((odds - want).abs() <= (10 + 5 * odds) * 2.0**-53 * want).all(), s
        ends = shift_times(torch.tensor([0.0, 1.0], dtype=torch.float64), s)
        assert ends.tolist() == [0.0, 1.0]
        assert bool((shift_times(u.sort().values, s).diff() > 0).all())  # increasing
        # diffusers' FlowMatchEulerDiscreteScheduler(shift) training sigmas: shifted (T..1)/T
        sched = FlowMatchEulerDiscreteScheduler(shift=s)
        grid = torch.arange(1000, 0, -1, dtype=torch.float64) / 1000
        torch.testing.assert_close(shift_times(grid, s), sched.sigmas.double(), rtol=2 * EPS32, atol=0)
    torch.testing.assert_close(shift_times(u, 1.0), u, rtol=0, atol=0)
    assert bool((shift_times(u, 3.0) > u).all())  # shift > 1 moves times towards noise


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_uniform_training_times(shift):
    seed = _seed()
    f = RectifiedFlow(shift=shift, weighting_scheme="uniform")
    t = f.sample_timesteps(N_DRAWS, torch.Generator().manual_seed(seed), torch.device("cpu"))
    assert t.shape == (N_DRAWS,) and t.dtype == torch.float32
    # [0, 1], not (0, 1): rand draws multiples of 2^-24 from [0, 1) (0 included), and the float32 shift rounds
    # u = 1 - 3 * 2^-24 to exactly 1.0 at shift 3 (about one draw in 4 million)
    assert 0 <= float(t.min()) and float(t.max()) <= 1
    # CDF of shift(U): P(t <= x) = P(U <= unshift(x))
    d = ks_statistic(t, lambda x: unshift(x, shift))
    assert d < KS_LAMBDA / math.sqrt(N_DRAWS), f"seed {seed}: KS {d}"
    u = unshift(t, shift)
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / N_DRAWS), f"seed {seed}"
    # same generator state, same times
    assert torch.equal(t, f.sample_timesteps(N_DRAWS, torch.Generator().manual_seed(seed), torch.device("cpu")))


@pytest.mark.parametrize("shift,m,s", [(1.0, 0.0, 1.0), (3.0, 0.5, 0.8), (3.0, -0.4, 1.3)])
def test_logit_normal_training_times(shift, m, s):
    seed = _seed()
    f = RectifiedFlow(shift=shift, weighting_scheme="logit_normal", logit_mean=m, logit_std=s)
    t = f.sample_timesteps(N_DRAWS, torch.Generator().manual_seed(seed), torch.device("cpu"))
    assert t.shape == (N_DRAWS,) and t.dtype == torch.float32
    assert 0 < float(t.min()) and float(t.max()) < 1
    u = unshift(t, shift)
    logit = torch.log(u / (1 - u))  # ~ N(m, s^2)
    # 5 sigma: the mean's standard error s / sqrt(n), the sample std's ~ s / sqrt(2n)
    assert abs(float(logit.mean()) - m) < 5 * s / math.sqrt(N_DRAWS), f"seed {seed}: {float(logit.mean())}"
    assert abs(float(logit.std()) - s) < 5 * s / math.sqrt(2 * N_DRAWS), f"seed {seed}: {float(logit.std())}"
    # the whole distribution: KS of t against Phi((logit(unshift(x)) - m) / s)
    def cdf(x):
        ux = unshift(x, shift)
        return normal_cdf((torch.log(ux / (1 - ux)) - m) / s)

    d = ks_statistic(t, cdf)
    assert d < KS_LAMBDA / math.sqrt(N_DRAWS), f"seed {seed}: KS {d}"


def test_training_time_statistics_can_fail():
    """The KS acceptance bound above rejects the distributions a wrong implementation would draw: unshifted
    times (true KS distance ~0.27), uniform for logit-normal (~0.12), logit std 1 for 0.8 (~0.053, against the
    bound 2.5 / sqrt(8192) = 0.028: missed with probability < 1e-4 by DKW)."""
    seed = _seed()
    bound = KS_LAMBDA / math.sqrt(N_DRAWS)
    t = RectifiedFlow(shift=3.0, weighting_scheme="uniform").sample_timesteps(
        N_DRAWS, torch.Generator().manual_seed(seed), torch.device("cpu"))
    assert ks_statistic(t, lambda x: x) > bound, f"seed {seed}"
    t = RectifiedFlow(weighting_scheme="logit_normal").sample_timesteps(
        N_DRAWS, torch.Generator().manual_seed(seed), torch.device("cpu"))
    assert ks_statistic(t, lambda x: x) > bound, f"seed {seed}"
    assert ks_statistic(t, lambda x: normal_cdf(torch.log(x / (1 - x)) / 0.8)) > bound, f"seed {seed}"


def test_flow_path_and_loss_closed_form():
    g = torch.Generator().manual_seed(_seed())
    f = RectifiedFlow(shift=3.0)
    B, C = 4, 3
    x0, noise = torch.randn(B, C, 4, 4, generator=g), torch.randn(B, C, 4, 4, generator=g)
    t = torch.rand(B, generator=g) * 0.98 + 0.01
    s = bcast(t.double(), 4)
    path = (1 - s) * x0.double() + s * noise.double()
    xt = f.noisy(x0, t, noise)
    assert xt.dtype == torch.float32
    torch.testing.assert_close(xt.double(), path, rtol=0, atol=4 * EPS32 * float(path.abs().max()))
    torch.testing.assert_close(f.noisy(x0.double(), t.double(), noise.double()), path, rtol=0, atol=1e-15)
    # ends: t = 0 is the data, t = 1 the noise
    ends = torch.tensor([0.0, 1.0, 0.0, 1.0])
    torch.testing.assert_close(f.noisy(x0, ends, noise)[[0, 2]], x0[[0, 2]], rtol=0, atol=0)
    torch.testing.assert_close(f.noisy(x0, ends, noise)[[1, 3]], noise[[1, 3]], rtol=0, atol=0)

    seen = {}
    out = torch.randn(B, C, 4, 4, generator=g)

    def model(x, tt):
        seen["x"], seen["t"] = x, tt
        return out

    terms = f.training_losses(model, x0, t, noise)
    assert set(terms) == {"loss", "mse"} and terms["loss"].dtype == torch.float64
    target = noise.double() - x0.double()  # v = d x_t / dt
    torch.testing.assert_close(terms["loss"], ((out.double() - target) ** 2).mean(dim=(1, 2, 3)), rtol=1e-12, atol=0)
    torch.testing.assert_close(terms["mse"], terms["loss"], rtol=0, atol=0)
    torch.testing.assert_close(seen["x"].double(), path, rtol=0, atol=4 * EPS32 * float(path.abs().max()))
    assert seen["t"].shape == (B,) and seen["t"].is_floating_point()
    torch.testing.assert_close(seen["t"].double(), 1000 * t.double(), rtol=1e-6, atol=0)  # the model's scale: 1000 t
    # the true velocity scores 0
    assert float(f.training_losses(lambda x, tt: target, x0, t, noise)["loss"].max()) < 1e-20


def test_flow_loss_learned_sigma_channels_and_timestep_scale():
    g = torch.Generator().manual_seed(_seed())
    B, C = 3, 2
    x0, noise = torch.randn(B, C, 5, generator=g), torch.randn(B, C, 5, generator=g)
    t = torch.rand(B, generator=g) * 0.98 + 0.01
    v, extra1, extra2 = (torch.randn(B, C, 5, generator=g) for _ in range(3))
    f = RectifiedFlow(learn_sigma=True, num_train_timesteps=500)
    seen = []

    def model(extra):
        def fn(x, tt):
            seen.append(tt)
            return torch.cat([v, extra], 1)
        return fn

    a = f.training_losses(model(extra1), x0, t, noise)["loss"]
    b = f.training_losses(model(extra2), x0, t, noise)["loss"]
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # the extra C channels are ignored
    torch.testing.assert_close(a, ((v.double() - (noise.double() - x0.double())) ** 2).mean(dim=(1, 2)), rtol=1e-12,
                               atol=0)
    torch.testing.assert_close(seen[0].double(), 500 * t.double(), rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------------------
# 5. Euler sampler
# ----------------------------------------------------------------------------------------------------------
class LinearField:
    """v(x, t) = A x + sin(t / 300) b + (t / 1000)^2 c per channel (a fixed random linear map of x plus a function
    of t, float64 inside); records every call's (x, t)."""

    def __init__(self, C: int, g: torch.Generator):
        self.A = torch.randn(C, C, generator=g, dtype=torch.float64) * (0.8 / C**0.5)
        self.b = torch.randn(C, generator=g, dtype=torch.float64)
        self.c = torch.randn(C, generator=g, dtype=torch.float64)
        self.calls = []

    def __call__(self, x, t):
        self.calls.append((x.clone(), t.clone()))
        tt = t.double().reshape(-1, 1, 1, 1)
        v = (torch.einsum("oc,bchw->bohw", self.A, x.double()) + torch.sin(tt / 300) * self.b.view(1, -1, 1, 1)
             + (tt / 1000) ** 2 * self.c.view(1, -1, 1, 1))
        return v.to(x.dtype)


@pytest.mark.parametrize("steps", [5, 20])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_euler_loop_equals_flow_match_euler_scheduler(shift, steps):
    """Step for step: the x and timestep of every model call, and the result. diffusers steps in float32, ours in
    float64: 1e-5."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    B, C = 2, 4
    noise = torch.randn(B, C, 3, 3, generator=g)
    ours_field = LinearField(C, torch.Generator().manual_seed(seed + 1))
    ref_field = LinearField(C, torch.Generator().manual_seed(seed + 1))
    flow = RectifiedFlow(shift=shift)
    out = euler_loop(flow, ours_field, noise, steps)
    assert out.dtype == torch.float32 and out.shape == noise.shape

    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(steps)
    torch.testing.assert_close(flow.sampling_times(steps), sched.sigmas.double(), rtol=2 * EPS32, atol=0)
    x = noise.clone()
    for t in sched.timesteps:
        v = ref_field(x, t.expand(B))
        x = sched.step(v, t, x).prev_sample
    assert len(ours_field.calls) == len(ref_field.calls) == steps
    for i, ((xa, ta), (xb, tb)) in enumerate(zip(ours_field.calls, ref_field.calls)):
        assert ta.shape == (B,) and ta.dtype == torch.float32
        torch.testing.assert_close(ta, tb, rtol=1e-6, atol=1e-4, msg=f"step {i}: timestep")
        torch.testing.assert_close(xa, xb, rtol=1e-5, atol=1e-5, msg=f"step {i}: x")
    torch.testing.assert_close(out, x, rtol=1e-5, atol=1e-5)
    assert float(ours_field.calls[0][1][0]) == 1000.0  # starts at pure noise
    assert (out - noise).abs().max() > 0.3  # the field moved the samples: errors would show


@pytest.mark.parametrize("steps", [2, 7, 30])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_euler_is_exact_for_one_data_point(shift, steps):
    """Data = one point x*: the exact velocity is v(x, t) = (x - x*) / t (constant along the straight path
    x_t = (1 - t) x* + t eps), and an Euler step from x_t lands on the path: x + (t' - t)(x - x*)/t = (1 - t') x*
    + t' eps. So every model call sees the path point of its t, and the result is x* (float64: 1e-12)."""
    g = torch.Generator().manual_seed(_seed())
    target = torch.randn(2, 3, 2, 2, generator=g, dtype=torch.float64)
    noise = torch.randn(2, 3, 2, 2, generator=g, dtype=torch.float64)
    calls = []

    def field(x, t):
        calls.append((x.clone(), t.clone()))
        return (x - target) / bcast(t / 1000, 4)

    out = euler_loop(RectifiedFlow(shift=shift), field, noise, steps)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, target, rtol=0, atol=1e-12)
    assert len(calls) == steps
    for x, t in calls:
        s = bcast(t / 1000, 4)
        torch.testing.assert_close(x, (1 - s) * target + s * noise, rtol=0, atol=1e-12)
    # a constant field moves by exactly -v over the whole [1, 0]
    c = torch.randn(1, 3, 1, 1, generator=g, dtype=torch.float64)
    out = euler_loop(RectifiedFlow(shift=shift), lambda x, t: c.expand_as(x), noise, steps)
    torch.testing.assert_close(out, noise - c, rtol=0, atol=1e-14)


def test_euler_loop_uses_first_c_channels_and_announces_steps():
    g = torch.Generator().manual_seed(_seed())
    noise = torch.randn(2, 3, 2, 2, generator=g)
    field = LinearField(3, torch.Generator().manual_seed(1))
    flow = RectifiedFlow(shift=3.0)
    ref = euler_loop(flow, field, noise, 6)
    junk = torch.randn(2, 3, 2, 2, generator=g)
    announced = []
    out = euler_loop(flow, lambda x, t: torch.cat([field(x, t), junk], 1), noise, 6, on_step=announced.append)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    times = flow.sampling_times(6)[:-1]
    assert announced == [min(round(float(t) * 1000), 999) for t in times]
    assert announced[0] == 999 and all(isinstance(a, int) for a in announced)


# ----------------------------------------------------------------------------------------------------------
# 6. generate() plumbing and v sampling
# ----------------------------------------------------------------------------------------------------------
def _tiny_dit(learn_sigma: bool, seed: int):
    from ditforge.models import create_model

    torch.manual_seed(seed)
    model = create_model("DiT-T/2", 8, 4, 10, learn_sigma=learn_sigma)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # adaLN-Zero and the zero final layer would make the output 0
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("learn_sigma", [False, True])
def test_generate_flow_is_euler_over_guided_model(learn_sigma):
    seed = _seed()
    model = _tiny_dit(learn_sigma, seed)
    y = torch.tensor([1, 7])
    kw = dict(cfg_scale=2.0, num_steps=4, sampler="euler", learn_sigma=learn_sigma, objective="flow")
    out = generate(model, y, (4, 8, 8), flow_shift=3.0, generator=torch.Generator().manual_seed(seed), **kw)
    noise = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(seed))
    ref = euler_loop(RectifiedFlow(shift=3.0), GuidedModel(model, y, 2.0), noise, 4)
    assert out.shape == (2, 4, 8, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert (ref - noise).abs().max() > 0.1  # the model moved the samples
    # the shift reaches the loop
    other = generate(model, y, (4, 8, 8), flow_shift=1.0, generator=torch.Generator().manual_seed(seed), **kw)
    assert not torch.allclose(other, out, atol=1e-4)


@pytest.mark.parametrize("sampler", ["ddpm", "ddim", "dpm++"])
def test_generate_flow_rejects_other_samplers(sampler):
    model = _tiny_dit(False, 0)
    with pytest.raises(ValueError, match="euler"):
        generate(model, torch.tensor([1, 2]), (4, 8, 8), num_steps=4, sampler=sampler, learn_sigma=False,
                 objective="flow")


def test_generate_v_plumbing():
    seed = _seed()
    model = _tiny_dit(True, seed)
    y = torch.tensor([3, 0])
    shape, n = (4, 8, 8), 5

    def gen(**kw):
        return generate(model, y, shape, cfg_scale=2.5, num_steps=n, learn_sigma=True, clip_denoised=False,
                        generator=torch.Generator().manual_seed(seed), **kw)

    # DDIM on the respaced v-process
    out = gen(sampler="ddim", objective="v")
    noise = torch.randn((2, *shape), generator=torch.Generator().manual_seed(seed))
    ref = sample_loop(create_diffusion(str(n), True, prediction_type="v_prediction"), GuidedModel(model, y, 2.5), noise,
                      "ddim")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert not torch.allclose(out, gen(sampler="ddim", objective="ddpm"), atol=1e-3)  # v is not read as eps
    # ancestral DDPM: the generator continues after the starting noise
    out = gen(sampler="ddpm", objective="v")
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((2, *shape), generator=g)
    ref = sample_loop(create_diffusion(str(n), True, prediction_type="v_prediction"), GuidedModel(model, y, 2.5), noise,
                      "ddpm", generator=g)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # DPM-Solver++ with the scheduler set to v_prediction
    out = gen(sampler="dpm++", objective="v")
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((2, *shape), generator=g)
    ref = solver_loop(GuidedModel(model, y, 2.5), noise, "dpm++", n, g, prediction_type="v_prediction")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert not torch.allclose(out, gen(sampler="dpm++", objective="ddpm"), atol=1e-3)


class ToyV(torch.nn.Module):
    """``model(x, t, y, force_drop_ids=None)`` -> [v, var]: v = 0.3 A x + 0.5 sin(t / 150) b + E[y], var = tanh(V x),
    float64; dropped rows take the null label."""

    def __init__(self, C: int, seed: int, num_classes: int = 5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.C, self.num_classes = C, num_classes
        self.A = torch.randn(C, C, generator=g, dtype=torch.float64) / C**0.5
        self.V = torch.randn(C, C, generator=g, dtype=torch.float64)
        self.b = torch.randn(C, generator=g, dtype=torch.float64)
        self.E = torch.randn(num_classes + 1, C, generator=g, dtype=torch.float64)

    def forward(self, x, t, y, force_drop_ids=None):
        if force_drop_ids is not None:
            y = torch.where(force_drop_ids, self.num_classes, y)
        xd, shape = x.double(), (-1, self.C, 1, 1)
        v = (0.3 * torch.einsum("oc,bchw->bohw", self.A, xd) + 0.5 * torch.sin(t.double() / 150).view(-1, 1, 1, 1)
             * self.b.view(shape) + self.E[y].view(shape))
        return torch.cat([v, torch.tanh(torch.einsum("oc,bchw->bohw", self.V, xd))], 1)


class AsEps(torch.nn.Module):
    """A v-model read as an epsilon model: eps = sqrt(1 - abar_t) x + sqrt(abar_t) v at the original timestep t (DiT's
    linear 1000-step abar from the python product); variance channels passed through."""

    def __init__(self, model: ToyV):
        super().__init__()
        self.model, self.abar = model, ref_abar(ref_betas("linear", 1000, 1e-4, 0.02))

    def forward(self, x, t, y, force_drop_ids=None):
        out = self.model(x, t, y, force_drop_ids)
        c = self.model.C
        return torch.cat([v_to_eps(self.abar[t], x, out[:, :c]), out[:, c:]], 1)


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_v_sample_loop_equals_epsilon_loop_on_converted_model(sampler):
    """Our samplers on a v-model = the same samplers on the epsilon model it implies (conversion written here).
    Guidance is linear, so guiding v then converting = converting then guiding eps. float64: 1e-10."""
    seed = _seed()
    y = torch.tensor([0, 4, 2])
    noise = torch.randn((3, 2, 3, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    model = ToyV(2, seed)
    dv = create_diffusion("10", True, prediction_type="v_prediction")
    de = create_diffusion("10", True)
    a = sample_loop(dv, GuidedModel(model, y, 3.0), noise, sampler, generator=torch.Generator().manual_seed(seed + 1))
    b = sample_loop(de, GuidedModel(AsEps(model), y, 3.0), noise, sampler,
                    generator=torch.Generator().manual_seed(seed + 1))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    c = sample_loop(de, GuidedModel(model, y, 3.0), noise, sampler, generator=torch.Generator().manual_seed(seed + 1))
    assert not torch.allclose(a, c, atol=1e-3)


@pytest.mark.parametrize("sampler", ["dpm++", "euler"])
def test_v_solver_loop_equals_epsilon_solver_on_converted_model(sampler):
    """diffusers' solvers set to v_prediction = the same solvers (epsilon) on the converted model. diffusers converts
    with its float32 abar table, we with float64: 1e-5."""
    seed = _seed()
    y = torch.tensor([1, 3])
    noise = torch.randn((2, 2, 3, 3), generator=torch.Generator().manual_seed(seed))
    model = ToyV(2, seed)
    a = solver_loop(GuidedModel(model, y, 2.0), noise, sampler, 8, prediction_type="v_prediction")
    b = solver_loop(GuidedModel(AsEps(model), y, 2.0), noise, sampler, 8)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    c = solver_loop(GuidedModel(model, y, 2.0), noise, sampler, 8)
    assert not torch.allclose(a, c, atol=1e-2)


@pytest.mark.parametrize("objective", ["flow", "v"])
def test_own_dit_trains_and_samples_with_objective(objective, tmp_path, train_run):
    """``ditforge train --objective flow|v`` on the digits, then ``ditforge sample``: the run records the
    objective, and sampling picks its sampler (Euler for flow) from it."""
    import numpy as np

    from ditforge import cli
    from ditforge.train.logging import read_metrics

    shift = ["--flow_shift", "2"] if objective == "flow" else []
    run = train_run(tmp_path / "run", "--max_steps", "3", "--objective", objective, *shift)
    config = __import__("yaml").safe_load((run / "config.yaml").read_text())["model"]
    assert config["objective"] == objective and config["flow_shift"] == (2.0 if objective == "flow" else None)
    assert all(np.isfinite(r["loss"]) for r in read_metrics(run / "metrics.jsonl"))
    npz = tmp_path / "s.npz"
    assert cli.main(["sample", "--ckpt", str(run), "--class_labels", "3,5", "--num_sampling_steps", "3",
                     "--device", "cpu", "--out", str(tmp_path / "s.png"), "--save_npz", str(npz)]) == 0
    assert np.load(npz)["samples"].shape == (2, 8, 8, 1)


class _HostCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts copies from host memory to another device. On a GPU each is PyTorch's blocking copy from pageable
    memory, a stream synchronisation; the meta device stands in for the GPU here (same dispatch, no values)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if src.device.type == "cpu" and out.device.type != "cpu":
                self.count += 1
        return out


@pytest.mark.parametrize("objective", ["ddpm", "v", "flow"])
def test_training_losses_on_the_device_copy_nothing_from_the_host(objective):
    """``create_objective(device=)`` (what the trainer passes): one training loss makes no host-to-device copy;
    the same objective left on the host makes one per table it reads (so the count can fail)."""
    b, c = 4, 3

    def losses(diffusion):
        x0 = torch.empty(b, c, 8, 8, device="meta")
        t = (torch.empty(b, dtype=torch.int64, device="meta") if objective != "flow"
             else torch.empty(b, device="meta"))
        with _HostCopies() as copies:
            terms = diffusion.training_losses(lambda xt, tt: torch.empty(b, 2 * c, 8, 8, device="meta"), x0, t,
                                              torch.empty_like(x0))
        assert terms["loss"].shape == (b,)
        return copies.count

    assert losses(create_objective(objective, True, device="meta")) == 0
    if objective != "flow":
        assert losses(create_objective(objective, True)) > 5


def test_given_frames_leave_the_first_latent_frames_out_of_the_flow_loss():
    """``given_frames`` 1 (image-to-video's given first frame): a model exact on frames 1: and wrong on frame 0 has
    loss 0, and its loss over a wrong frame 1 is that frame's MSE over the 2 of 3 frames counted; a Gaussian
    objective refuses it in one line."""
    from ditforge.diffusion.objective import create_objective
    from ditforge.errors import UserError

    g = torch.Generator().manual_seed(0)
    x0, noise = (torch.randn(2, 4, 3, 2, 2, generator=g, dtype=torch.float64) for _ in range(2))
    t = torch.rand(2, generator=g)
    flow = create_objective("flow", False, None, given_frames=1)
    target = noise - x0
    wrong_first = target.clone()
    wrong_first[:, :, 0] += 5.0
    loss = flow.training_losses(lambda xt, tt: wrong_first, x0, t, noise)["loss"]
    assert torch.equal(loss, torch.zeros(2, dtype=torch.float64))
    wrong_second = target.clone()
    wrong_second[:, :, 1] += 3.0
    torch.testing.assert_close(flow.training_losses(lambda xt, tt: wrong_second, x0, t, noise)["loss"],
                               torch.full((2,), 9.0 / 2, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    with pytest.raises(UserError, match="given first frame"):
        create_objective("ddpm", False, None, given_frames=1)
