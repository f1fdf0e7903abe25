"""DMD2 distillation (``diffusion/dmd.py``, ``train/distill.py``, ``ditforge distill``).

The 2-D tests take a Gaussian mixture whose exact denoiser is known in closed form (float64): the posterior mean
E[x_0 | x_t] of each component, weighted by its responsibility. The run tests write a tiny DiT checkpoint directly
(``Checkpointer``), so no training run is needed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from ditforge.cli import main
from ditforge.diffusion.dmd import DMD2, dmd_gradient, dmd_loss, noised, predicted_x0, student_loop, student_times
from ditforge.diffusion.flow import RectifiedFlow
from ditforge.diffusion.gaussian import create_diffusion

DT = torch.float64


def mixture_x0(x_t, a, s, means, covs, weights):
    """E[x_0 | x_t] for x_0 ~ sum_k w_k N(mu_k, S_k), x_t = a x_0 + s eps (a, s: (B,)): per component
    x_t ~ N(a mu_k, a^2 S_k + s^2 I) and E[x_0 | x_t, k] = mu_k + a S_k (a^2 S_k + s^2 I)^-1 (x_t - a mu_k)."""
    a4, s4 = a.reshape(-1, 1, 1, 1), s.reshape(-1, 1, 1, 1)
    a = a.reshape(-1, 1, 1)
    cov_t = a4**2 * covs[None] + s4**2 * torch.eye(2, dtype=DT)  # (B, K, 2, 2)
    diff = x_t[:, None] - a * means[None]  # (B, K, 2)
    sol = torch.linalg.solve(cov_t, diff.unsqueeze(-1)).squeeze(-1)
    logp = (-0.5 * (diff * sol).sum(-1) - 0.5 * torch.logdet(cov_t) + torch.log(weights)[None])
    r = torch.softmax(logp, dim=1)  # responsibilities (B, K)
    post = means[None] + a * (covs[None] @ sol.unsqueeze(-1)).squeeze(-1)
    return (r.unsqueeze(-1) * post).sum(1)


def coefficients(objective, t):
    """(a, s) of x_t = a x_0 + s eps, recomputed independently: DDPM from the linear betas, flow (1 - t, t)."""
    if isinstance(objective, RectifiedFlow):
        return 1 - t.double(), t.double()
    abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000, dtype=DT), 0)[t]
    return abar.sqrt(), (1 - abar).sqrt()


def exact_net(objective, means, covs, weights):
    """The model output (epsilon, or the flow velocity) of the exact denoiser: (x_t, model timesteps) -> (B, 2)."""
    def net(x_t, mt):
        t = mt / objective.num_timesteps if isinstance(objective, RectifiedFlow) else mt
        a, s = coefficients(objective, t)
        x0 = mixture_x0(x_t, a, s, means, covs, weights)
        if isinstance(objective, RectifiedFlow):
            return (x_t - x0) / t[:, None]
        return (x_t - a[:, None] * x0) / s[:, None]
    return net


OBJECTIVES = {"ddpm": lambda: create_diffusion(None, learn_sigma=False),
              "flow": lambda: RectifiedFlow(shift=1.0, weighting_scheme="uniform")}


@pytest.mark.parametrize("kind", sorted(OBJECTIVES))
def test_dmd_gradient_of_one_step_is_its_closed_form(kind):
    """The DMD gradient and the surrogate loss's gradient for the exact mixture teacher (real) and a known fake
    Gaussian, against (E_fake[x_0|x_t] - E_real[x_0|x_t]) / mean|x - E_real[x_0|x_t]| written out. Tolerance 1e-9
    (float64)."""
    objective = OBJECTIVES[kind]()
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    means = torch.randn(3, 2, generator=g, dtype=DT) * 2
    root = torch.randn(3, 2, 2, generator=g, dtype=DT) * 0.5
    covs = root @ root.transpose(1, 2) + 0.1 * torch.eye(2, dtype=DT)
    weights = torch.tensor([0.5, 0.3, 0.2], dtype=DT)
    fake_mean, fake_cov = torch.randn(1, 2, generator=g, dtype=DT), torch.eye(2, dtype=DT)[None] * 0.7
    x = torch.randn(16, 2, generator=g, dtype=DT, requires_grad=True)
    t = (torch.randint(20, 980, (16,), generator=g) if kind == "ddpm"
         else torch.rand(16, generator=g, dtype=DT) * 0.96 + 0.02)
    eps = torch.randn(16, 2, generator=g, dtype=DT)
    x_t = noised(objective, x.detach(), t, eps)
    mt = objective.model_timesteps(t)
    real = predicted_x0(objective, x_t, t, exact_net(objective, means, covs, weights)(x_t, mt))
    fake = predicted_x0(objective, x_t, t, exact_net(objective, fake_mean, fake_cov, torch.ones(1, dtype=DT))(x_t, mt))
    grad = dmd_gradient(x.detach(), real, fake)

    a, s = coefficients(objective, t)
    torch.testing.assert_close(x_t, a[:, None] * x.detach() + s[:, None] * eps, rtol=0, atol=1e-12)
    e_real = mixture_x0(x_t, a, s, means, covs, weights)
    e_fake = fake_mean + (a[:, None] * 0.7 / (a[:, None] ** 2 * 0.7 + s[:, None] ** 2)) * (x_t - a[:, None] * fake_mean)
    expected = (e_fake - e_real) / (x.detach() - e_real).abs().mean(1, keepdim=True)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-9)
    dmd_loss(x, grad).backward()
    torch.testing.assert_close(x.grad, expected / x.numel(), rtol=1e-9, atol=1e-12)


def test_given_frames_are_out_of_the_dmd_loss():
    """``DMD2.given_frames`` 1 on video latents (B, C, T', h, w), flow: with real and fake denoisers of fixed random
    velocities, the loss is 0.5 mean(grad^2) over frames 1.. only, grad = (x0_fake - x0_real) / mean|x - x0_real|
    there (x0 = x_t - t v at the t and eps drawn in ``_noise``'s order), and x's gradient is grad / numel on those
    frames and exactly 0 on frame 0 (float64, 1e-12)."""
    objective = RectifiedFlow(shift=1.0, weighting_scheme="uniform")
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    shape = (3, 2, 4, 2, 2)
    v_real, v_fake = torch.randn(2, *shape, generator=g, dtype=DT)
    x = torch.randn(shape, generator=g, dtype=DT, requires_grad=True)
    seed = int(torch.randint(2**31, (), generator=g))
    dmd = DMD2(objective, torch.tensor([1.0, 0.5]), given_frames=1)
    loss, norm = dmd.generator_loss(x, lambda x_t, mt: v_real, lambda x_t, mt: v_fake, torch.Generator().manual_seed(
        seed))
    loss.backward()
    draws = torch.Generator().manual_seed(seed)
    u = 0.02 + 0.96 * torch.rand(3, generator=draws, dtype=DT)
    t = u.view(-1, 1, 1, 1, 1)
    x_t = (1 - t) * x.detach() + t * torch.randn(shape, generator=draws, dtype=DT)
    real, fake = x_t - t * v_real, x_t - t * v_fake
    grad = ((fake - real) / (x.detach() - real)[:, :, 1:].abs().mean(dim=(1, 2, 3, 4), keepdim=True))[:, :, 1:]
    torch.testing.assert_close(loss, 0.5 * (grad**2).mean(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(norm, grad.flatten(1).norm(dim=1), rtol=1e-12, atol=1e-12)
    assert torch.equal(x.grad[:, :, 0], torch.zeros_like(x.grad[:, :, 0]))
    torch.testing.assert_close(x.grad[:, :, 1:], grad / grad.numel(), rtol=1e-12, atol=1e-15)


class GaussianCritic(torch.nn.Module):
    """A fake score in the Gaussian family, one N(m_c, L_c L_c^T) per class, trained by the denoising loss: its
    exact flow velocity from the closed form (the optimum of that loss on Gaussian data is the data's moments)."""

    def __init__(self, classes):
        super().__init__()
        self.mean = torch.nn.Parameter(torch.zeros(classes, 2, dtype=DT))
        self.root = torch.nn.Parameter(torch.eye(2, dtype=DT).repeat(classes, 1, 1))

    def forward(self, x_t, mt, y):
        t = (mt / 1000).reshape(-1, 1, 1)
        m, root = self.mean[y], self.root[y]
        cov = root @ root.transpose(1, 2) + 1e-4 * torch.eye(2, dtype=DT)
        diff = x_t - (1 - t[:, 0]) * m
        cov_t = (1 - t) ** 2 * cov + t**2 * torch.eye(2, dtype=DT)
        x0 = m + (1 - t[:, 0]) * (cov @ torch.linalg.solve(cov_t, diff.unsqueeze(-1))).squeeze(-1)
        return (x_t - x0) / t[:, 0]


class AffineStudent(torch.nn.Module):
    """x_0 = A_{c,k} x_t + b_{c,k} at each of the student's K steps (as a velocity: (x_t - x_0) / t)."""

    def __init__(self, classes, steps, times):
        super().__init__()
        self.times = times
        self.A = torch.nn.Parameter(torch.eye(2, dtype=DT).repeat(classes, steps, 1, 1))
        self.b = torch.nn.Parameter(torch.zeros(classes, steps, 2, dtype=DT))

    def forward(self, x_t, mt, y):
        k = (self.times[None] - mt[:, None] / 1000).abs().argmin(1)
        x0 = (self.A[y, k] @ x_t.unsqueeze(-1)).squeeze(-1) + self.b[y, k]
        return (x_t - x0) / (mt / 1000)[:, None]


def test_distilled_generator_matches_the_mixture():
    """A one-step class-conditional student of a 2-component mixture (class = component), distilled with the whole
    algorithm: the DMD loss against the exact teacher, a critic trained by the denoising loss on the student's
    samples, 5 critic steps per generator step (100 generator steps). Its samples' per-class means match the
    components' within 0.1 and covariances within 0.25 (absolute; the components' variances are 0.4..1), from 4096
    samples each. (Backward simulation, K > 1, runs in the resume test.)"""
    torch.manual_seed(0)
    flow = RectifiedFlow(shift=1.0, weighting_scheme="uniform")
    means = torch.tensor([[2.0, -1.0], [-1.5, 1.0]], dtype=DT)
    covs = torch.tensor([[[1.0, 0.3], [0.3, 0.5]], [[0.4, -0.2], [-0.2, 0.8]]], dtype=DT)
    times = student_times(flow, 1).double()
    dmd = DMD2(flow, times)
    student, critic = AffineStudent(2, 1, times), GaussianCritic(2)
    opt_g = torch.optim.Adam(student.parameters(), lr=5e-2, betas=(0.0, 0.999))
    opt_c = torch.optim.Adam(critic.parameters(), lr=2e-1, betas=(0.0, 0.999))
    g = torch.Generator().manual_seed(1)
    nets = [exact_net(flow, means[c : c + 1], covs[c : c + 1], torch.ones(1, dtype=DT)) for c in range(2)]
    for step in range(500):
        y = torch.randint(2, (256,), generator=g)
        noise = torch.randn(256, 2, generator=g, dtype=DT)
        teacher = lambda x, mt: torch.where(y[:, None] == 0, nets[0](x, mt), nets[1](x, mt))  # noqa: E731
        gen, fake = (lambda x, mt: student(x, mt, y)), (lambda x, mt: critic(x, mt, y))
        if step % 5 == 0:
            x = dmd.generate(gen, noise, g)
            loss, _ = dmd.generator_loss(x, teacher, fake, g)
            opt_g.zero_grad()
            loss.backward()
            opt_g.step()
        else:
            with torch.no_grad():
                x = dmd.generate(gen, noise, g)
        opt_c.zero_grad()
        dmd.critic_loss(x, fake, g).backward()
        opt_c.step()
    with torch.no_grad():
        for c in range(2):
            y = torch.full((4096,), c)
            x = student_loop(flow, lambda x, mt: student(x, mt, y), torch.randn(4096, 2, generator=g, dtype=DT), times,
                             lambda z: torch.randn(z.shape, generator=g, dtype=DT))
            torch.testing.assert_close(x.mean(0), means[c], rtol=0, atol=0.1)
            torch.testing.assert_close(torch.cov(x.T), covs[c], rtol=0, atol=0.25)


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """Two tiny DiT-T/4 (depth 1, 8x8 pixels, 3 classes) checkpoints: with label dropout and without."""
    from ditforge.models import create_model_from_spec
    from ditforge.parallel.mesh import Dist
    from ditforge.train.checkpoint import Checkpointer

    root = tmp_path_factory.mktemp("teachers")
    out = {}
    for name, dropout in (("guided", 0.1), ("unguided", 0.0)):
        spec = dict(model="DiT-T/4", input_size=8, in_channels=1, num_classes=3, learn_sigma=True,
                    class_dropout_prob=dropout, depth=1, num_frames=None, text_dim=None, condition="class")
        torch.manual_seed(0)
        model = create_model_from_spec(spec)
        for p in model.parameters():  # DiT zero-initialises its output layers: give the teacher something to say
            p.data.add_(0.02 * torch.randn_like(p))
        sd = model.state_dict()
        Checkpointer(root / name, 1, False, Dist()).save(1, {"model": sd, "ema": sd}, {"config": {"model": spec}})
        out[name] = root / name
    return out


def _distill(teacher, outputs, *extra):
    return main(["distill", "--teacher", str(teacher), "--outputs", str(outputs), "--batch_size", "4",
                 "--critic_steps", "2", "--log_every", "1", "--device", "cpu", *extra])


@pytest.mark.parametrize("flags, says", [
    (("--student_steps", "0"), "--student_steps"),
    (("--lora_rank", "4", "--lora_target_modules", "to_q"), "--lora_target_modules"),
    (("--fp8_base",), "--fp8_base: for a pipeline teacher"),
    (("--optimizer", "adamw8bit"), "--optimizer: for a pipeline teacher"),
    (("--critic_lora_rank", "4"), "--critic_lora_rank: for a pipeline teacher"),
    (("--cfg_scale_2", "3"), "--cfg_scale_2: for a pipeline teacher"),
    (("--clip", "clip"), "--clip: for a pipeline teacher"),
    (("--blocks_to_swap", "-1"), "--blocks_to_swap: expected >= 0"),
    (("--plugin", "fsdp"), "--plugin: for a pipeline teacher"),
    (("--sequence_parallel_size", "0"), "--sequence_parallel_size: expected a positive integer"),
])
def test_bad_flags_get_one_line_and_exit_2(teachers, tmp_path, capsys, flags, says):
    assert _distill(teachers["guided"], tmp_path / "run", "--max_steps", "1", *flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err


def test_teacher_without_guidance_information_is_refused(teachers, tmp_path, capsys):
    assert _distill(teachers["unguided"], tmp_path / "run", "--max_steps", "1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no guidance information" in err and "--cfg_scale 1" in err


def test_resume_is_exact_and_the_student_samples_in_its_steps(teachers, tmp_path):
    """Run 4 iterations straight, and 2 + resume 2 more (a generator step on each side of the checkpoint): the
    metrics and the student's and critic's weights are equal (exactly: same ops, same randomness). Then
    ``ditforge sample`` of the student reads its 2 steps and no guidance."""
    from ditforge.weights.read import SafeFileSystemReader, list_checkpoints

    assert _distill(teachers["guided"], tmp_path / "a", "--max_steps", "4", "--student_steps", "2") == 0
    assert _distill(teachers["guided"], tmp_path / "b", "--max_steps", "2", "--student_steps", "2") == 0
    assert _distill(teachers["guided"], tmp_path / "b", "--max_steps", "4", "--student_steps", "2",
                    "--resume", "auto") == 0
    rows = [[{k: v for k, v in json.loads(line).items() if k != "steps_per_sec"}
             for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()] for run in "ab"]
    assert rows[0] == rows[1] and len(rows[0]) == 4 and "generator_loss" in rows[0][0] and "dmd_grad_norm" in rows[0][2]
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    states = []
    for run in "ab":
        state: dict = {}
        dcp.state_dict_loader._load_state_dict(state, SafeFileSystemReader(str(list_checkpoints(tmp_path / run)[-1])),
                                               planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        states.append(state)
    for key in ("model", "critic"):
        for name, value in states[0][key].items():
            assert torch.equal(value, states[1][key][name]), (key, name)
    meta = json.loads((list_checkpoints(tmp_path / "a")[-1] / "meta.json").read_text())
    assert meta["config"]["distill"]["timesteps"] == [999, 499] and meta["config"]["distill"]["sampler"] == "student"
    sample = ["sample", "--ckpt", str(tmp_path / "a"), "--num_samples", "3", "--device", "cpu"]
    assert main([*sample, "--out", str(tmp_path / "d.png"), "--save_npz", str(tmp_path / "d.npz")]) == 0
    assert main([*sample, "--out", str(tmp_path / "e.png"), "--save_npz", str(tmp_path / "e.npz"), "--sampler",
                 "student", "--num_sampling_steps", "2", "--cfg_scale", "1"]) == 0
    assert main([*sample, "--out", str(tmp_path / "f.png"), "--save_npz", str(tmp_path / "f.npz"),
                 "--num_sampling_steps", "3"]) == 0
    import numpy as np

    default, explicit, other = (np.load(tmp_path / f"{n}.npz")["samples"] for n in "def")
    assert np.array_equal(default, explicit) and not np.array_equal(default, other)
    assert math.isfinite(rows[0][-1]["critic_loss"])
