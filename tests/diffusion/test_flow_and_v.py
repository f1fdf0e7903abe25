"""The objective seam against independent references: diffusers' schedulers (betas, ``get_velocity``,
``FlowMatchEulerDiscreteScheduler`` stepping) and closed forms written here in float64."""

from __future__ import annotations

import math

import pytest
import torch

from ditforge.diffusion import create_diffusion, generate
from ditforge.diffusion.flow import RectifiedFlow, euler_loop, shift_times
from ditforge.diffusion.gaussian import betas_from_schedule
from ditforge.diffusion.objective import create_objective, objective_of_scheduler
from ditforge.errors import UserError


def _seed() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))


@pytest.mark.parametrize("schedule,start,end", [("linear", 1e-4, 0.02), ("scaled_linear", 0.00085, 0.012),
                                                ("squaredcos_cap_v2", 1e-4, 0.02)])
def test_betas_match_diffusers(schedule, start, end):
    from diffusers import DDPMScheduler

    ours = betas_from_schedule(schedule, 1000, start, end)
    theirs = DDPMScheduler(beta_schedule=schedule, beta_start=start, beta_end=end).betas.double()
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)  # diffusers builds them in float32
    if schedule == "scaled_linear":  # closed form
        t = torch.arange(1000, dtype=torch.float64) / 999
        torch.testing.assert_close(ours, (math.sqrt(start) + t * (math.sqrt(end) - math.sqrt(start))) ** 2,
                                   rtol=1e-12, atol=0)


def test_velocity_matches_diffusers_and_inverts():
    from diffusers import DDPMScheduler

    g = _seed()
    sched = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                          prediction_type="v_prediction")
    d = create_objective("auto", False, dict(sched.config))
    assert d.prediction_type == "v_prediction"
    x0, noise = torch.randn(4, 3, 5, 5, generator=g), torch.randn(4, 3, 5, 5, generator=g)
    t = torch.randint(0, 1000, (4,), generator=g)
    v = d.velocity(x0, t, noise)
    torch.testing.assert_close(v.float(), sched.get_velocity(x0, noise, t), rtol=1e-5, atol=1e-6)
    x_t = d.q_sample(x0.double(), t, noise.double())
    torch.testing.assert_close(d.eps_from_output(x_t, t, v), noise.double(), rtol=0, atol=1e-12)
    # training loss: zero for the true v, else the MSE against v computed here
    assert float(d.training_losses(lambda xt, tt: v, x0.double(), t, noise.double())["loss"].max()) < 1e-20
    out = torch.randn(4, 3, 5, 5, generator=g, dtype=torch.float64)
    abar = torch.cumprod(1 - betas_from_schedule("scaled_linear", 1000, 0.00085, 0.012), 0)[t].view(-1, 1, 1, 1)
    target = abar.sqrt() * noise.double() - (1 - abar).sqrt() * x0.double()
    torch.testing.assert_close(d.training_losses(lambda xt, tt: out, x0.double(), t, noise.double())["mse"],
                               ((out - target) ** 2).mean(dim=(1, 2, 3)), rtol=1e-12, atol=0)


def test_objective_from_scheduler_configs():
    assert objective_of_scheduler({"_class_name": "PNDMScheduler", "prediction_type": "epsilon"}) == "ddpm"
    assert objective_of_scheduler({"_class_name": "DDIMScheduler", "prediction_type": "v_prediction"}) == "v"
    flow = create_objective("auto", False, {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0})
    assert isinstance(flow, RectifiedFlow) and flow.shift == 3.0
    assert create_objective("flow", False, {"shift": 3.0}, flow_shift=1.5).shift == 1.5
    assert create_objective("auto", True).prediction_type == "epsilon"  # no config: DiT's
    for bad in ({"prediction_type": "sample"}, {"_class_name": "FlowMatchEulerDiscreteScheduler",
                                                "use_dynamic_shifting": True},
                {"beta_schedule": "exotic"}, {"rescale_betas_zero_snr": True}):
        with pytest.raises(UserError):
            create_objective("auto", False, bad)


def test_flow_times_and_loss_closed_form():
    g = _seed()
    flow = RectifiedFlow(shift=3.0, weighting_scheme="logit_normal", logit_mean=0.5, logit_std=0.8)
    t = flow.sample_timesteps(8192, g, torch.device("cpu"))
    assert 0 < float(t.min()) and float(t.max()) < 1
    u = t / (3.0 - 2.0 * t)  # the inverse of the shift t = 3u / (1 + 2u)
    torch.testing.assert_close(shift_times(u, 3.0), t, rtol=1e-5, atol=1e-6)
    logit = torch.log(u / (1 - u))  # N(0.5, 0.8^2): 5 sigma bounds on mean and std for 8192 draws
    assert abs(float(logit.mean()) - 0.5) < 5 * 0.8 / math.sqrt(8192)
    assert abs(float(logit.std()) - 0.8) < 5 * 0.8 / math.sqrt(2 * 8192)
    x0, noise = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    tt = torch.rand(3, generator=g)
    seen = {}

    def model(x, timestep):
        seen["x"], seen["t"] = x, timestep
        return torch.ones_like(x)

    mse = flow.training_losses(model, x0, tt, noise)["mse"]
    s = tt.double().view(-1, 1, 1, 1)
    torch.testing.assert_close(seen["x"].double(), (1 - s) * x0.double() + s * noise.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(seen["t"], tt * 1000)
    torch.testing.assert_close(mse, ((1 - (noise.double() - x0.double())) ** 2).mean(dim=(1, 2, 3)), rtol=1e-12,
                               atol=0)


@pytest.mark.parametrize("shift,steps", [(1.0, 5), (3.0, 20)])
def test_euler_equals_diffusers_flow_match_euler(shift, steps):
    """ditforge's Euler loop against diffusers' FlowMatchEulerDiscreteScheduler stepped as the SD3 pipeline does, for a
    velocity field that depends on x and t (float32 there, float64 here: 1e-5)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    g = _seed()
    weight = torch.randn(4, 4, generator=g) * 0.3

    def model(x, t):
        return torch.einsum("ij,bjhw->bihw", weight, x) + (t / 1000).view(-1, 1, 1, 1) ** 2

    noise = torch.randn(2, 4, 3, 3, generator=g)
    ours = euler_loop(RectifiedFlow(shift=shift), model, noise, steps)
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(steps)
    x = noise.clone()
    for t in sched.timesteps:
        x = sched.step(model(x, t.expand(2)), t, x).prev_sample
    torch.testing.assert_close(ours, x, rtol=1e-5, atol=1e-5)
    assert (ours - noise).abs().max() > 0.1  # the field moved the samples


def test_euler_transports_to_the_data_point():
    """For data that is one point x*, the exact velocity is v(x, t) = (x - x*) / t; Euler on it lands on x*."""
    g = _seed()
    target = torch.randn(1, 3, 2, 2, generator=g, dtype=torch.float64)
    out = euler_loop(RectifiedFlow(shift=3.0), lambda x, t: (x - target) / (t / 1000).view(-1, 1, 1, 1),
                     torch.randn(1, 3, 2, 2, generator=g, dtype=torch.float64), 7)
    torch.testing.assert_close(out, target, rtol=0, atol=1e-12)


def test_generate_flow_and_v_plumbing():
    """generate() of a ditforge DiT: flow -> Euler on the guided model; v -> DDIM on the v-prediction process."""
    from ditforge.diffusion.samplers import GuidedModel, sample_loop
    from ditforge.models import create_model

    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    model = create_model("DiT-T/2", 8, 4, 10, learn_sigma=False).eval()
    y = torch.tensor([1, 7])
    seed = int(torch.randint(0, 2**31, ()))
    out = generate(model, y, (4, 8, 8), cfg_scale=2.0, num_steps=4, sampler="euler", learn_sigma=False,
                   objective="flow", flow_shift=3.0, generator=torch.Generator().manual_seed(seed))
    noise = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(seed))
    ref = euler_loop(RectifiedFlow(shift=3.0), GuidedModel(model, y, 2.0), noise, 4)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    with pytest.raises(ValueError):
        generate(model, y, (4, 8, 8), num_steps=4, sampler="ddpm", learn_sigma=False, objective="flow")
    out = generate(model, y, (4, 8, 8), cfg_scale=2.0, num_steps=4, sampler="ddim", learn_sigma=False,
                   objective="v", generator=torch.Generator().manual_seed(seed), clip_denoised=False)
    ref = sample_loop(create_diffusion("4", False, prediction_type="v_prediction"), GuidedModel(model, y, 2.0), noise,
                      "ddim")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


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
