"""The diffusers solvers (``"dpm++"``, ``"euler"``) and our DDIM against diffusers' schedulers, step by step.

References are hand-written loops that call the diffusers schedulers directly (``set_timesteps``,
``scale_model_input``, ``step``) with classifier-free guidance computed from two separate model calls (cond, then
uncond with every row dropped), so our wrapper's 2B batching, channel dropping, noise scaling and timestep
handling are all checked. The toy epsilon model is a fixed random linear map of x, t and the label (float64),
honouring ``force_drop_ids``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler  # noqa: E402

from ditforge.diffusion import DIFFUSERS_SAMPLERS, GaussianDiffusion, diffusers_scheduler, generate  # noqa: E402
from ditforge.diffusion import sample_loop, solver_loop  # noqa: E402
from ditforge.diffusion.gaussian import linear_betas  # noqa: E402
from ditforge.diffusion.samplers import GuidedModel  # noqa: E402
from ditforge.errors import UserError  # noqa: E402

NUM_CLASSES = 6


class ToyEps(torch.nn.Module):
    """``model(x, t, y, force_drop_ids=None)``: out[:, :C] = 0.3 A x + 0.5 sin(t / 150) b + E[y] (per row), the
    variance channels out[:, C:] = tanh of another map (ignored by the solvers). Dropped rows use the null label
    ``NUM_CLASSES``. float64; records every call's (x, t)."""

    def __init__(self, C: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.C = C
        self.A = torch.randn(C, C, generator=g, dtype=torch.float64) / C**0.5
        self.V = torch.randn(C, C, generator=g, dtype=torch.float64)
        self.b = torch.randn(C, generator=g, dtype=torch.float64)
        self.E = torch.randn(NUM_CLASSES + 1, C, generator=g, dtype=torch.float64)
        self.calls = []

    def forward(self, x, t, y, force_drop_ids=None):
        if force_drop_ids is not None:
            y = torch.where(force_drop_ids, NUM_CLASSES, y)
        self.calls.append((x.clone(), t.clone()))
        xd = x.double()
        shape = (-1, self.C) + (1,) * (x.ndim - 2)
        eps = 0.3 * torch.einsum("oc,bc...->bo...", self.A, xd) + 0.5 * torch.sin(t.double() / 150).view(
            -1, *[1] * (x.ndim - 1)) * self.b.view(shape) + self.E[y].view(shape)
        var = torch.tanh(torch.einsum("oc,bc...->bo...", self.V, xd))
        return torch.cat([eps, var], 1)


def _guided_eps(model, x, t, y, s):
    """eps_u + s (eps_c - eps_u) from two separate calls (the reference of the 2B batch)."""
    c = model.C
    cond = model(x, t, y)[:, :c]
    uncond = model(x, t, y, force_drop_ids=torch.ones_like(y, dtype=torch.bool))[:, :c]
    return uncond + s * (cond - uncond)


def _reference(sampler, model, noise, y, s, steps):
    """Hand-written diffusers loop; returns the list of x after every step (the last is the sample)."""
    common = dict(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear",
                  prediction_type="epsilon", timestep_spacing="trailing")
    sched = (DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2, **common)
             if sampler == "dpm++" else EulerDiscreteScheduler(**common))
    sched.set_timesteps(steps)
    x = noise * sched.init_noise_sigma
    xs = []
    for t in sched.timesteps:
        inp = sched.scale_model_input(x, t)
        eps = _guided_eps(model, inp, torch.full((x.shape[0],), int(t)), y, s)
        x = sched.step(eps, t, x).prev_sample
        xs.append(x)
    return xs


@pytest.mark.parametrize("sampler", DIFFUSERS_SAMPLERS)
@pytest.mark.parametrize("steps,cfg", [(20, 4.0), (7, 1.5)])
def test_solver_matches_diffusers_step_by_step(sampler, steps, cfg):
    # tolerance: atol 1e-6, rtol 1e-6 on float32 states (same scheduler arithmetic; only the guidance combination
    # is computed separately, in float64, before the scheduler casts it).
    seed = int(np.random.default_rng().integers(0, 2**31))
    B, C = 3, 4
    y = torch.from_numpy(np.random.default_rng(seed).integers(0, NUM_CLASSES, size=B))
    noise = torch.randn((B, C, 3, 3), generator=torch.Generator().manual_seed(seed))
    ours_model, ref_model = ToyEps(C, seed), ToyEps(C, seed)
    got = []
    out = solver_loop(GuidedModel(ours_model, y, cfg), noise, sampler, steps, callback=lambda i, t, x: got.append(x))
    ref = _reference(sampler, ref_model, noise, y, cfg, steps)
    assert len(got) == len(ref) == steps
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, ref[-1].float(), atol=1e-6, rtol=1e-6)
    # the model saw the scaled inputs and integer timesteps of the reference (2B rows: cond then uncond)
    assert len(ours_model.calls) == steps and len(ref_model.calls) == 2 * steps
    for (x2, t2), (x1, t1) in zip(ours_model.calls, ref_model.calls[::2]):
        assert t2.dtype == torch.int64 and torch.equal(t2[:B], t1) and torch.equal(t2[B:], t1)
        torch.testing.assert_close(x2[:B], x1, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("sampler", DIFFUSERS_SAMPLERS)
def test_solver_point_oracle_lands_on_x0(sampler):
    # Data = one point x0: the exact eps is (x_t - sqrt(abar) x0) / sqrt(1 - abar); an exact solver ends on x0.
    # tolerance: 1e-4 (float32 scheduler arithmetic).
    abar = torch.cumprod(1 - linear_betas(1000), 0)
    x0 = torch.rand(2, 3, 4, 4, dtype=torch.float64) * 2 - 1

    def oracle(x, t):
        a = abar[t].view(-1, 1, 1, 1)
        return (x.double() - a.sqrt() * x0) / (1 - a).sqrt()

    out = solver_loop(oracle, torch.randn(2, 3, 4, 4), sampler, 10)
    torch.testing.assert_close(out.double(), x0, atol=1e-4, rtol=0)


@pytest.mark.parametrize("sampler", DIFFUSERS_SAMPLERS)
def test_generate_with_solver_seeds(sampler):
    B, C = 4, 2
    y = torch.tensor([0, 3, 5, 1])
    kw = dict(cfg_scale=3.0, num_steps=6, sampler=sampler, learn_sigma=True)

    def run(seeds, batch_size=None, rows=slice(None)):
        return generate(ToyEps(C, 7), y[rows], (C, 2, 2), seeds=seeds, batch_size=batch_size, **kw)

    a = run([1, 2, 3, 4])
    assert torch.equal(a, run([1, 2, 3, 4], batch_size=3))  # batch-size independent (rows do not mix)
    assert torch.equal(a[2:], run([3, 4], rows=slice(2, None)))
    b = run([1, 2, 3, 5])
    assert torch.equal(a[:3], b[:3]) and not torch.allclose(a[3], b[3])
    # generator convention: all starting noise first, then solver_loop on the guided model
    g = torch.Generator().manual_seed(11)
    got = generate(ToyEps(C, 7), y, (C, 2, 2), generator=torch.Generator().manual_seed(11), **kw)
    noise = torch.randn((B, C, 2, 2), generator=g)
    ref = solver_loop(GuidedModel(ToyEps(C, 7), y, 3.0), noise, sampler, 6, g)
    assert torch.equal(got, ref)


def test_missing_diffusers_names_sampler(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "diffusers", None)  # import fails
    with pytest.raises(UserError, match="--sampler euler"):
        diffusers_scheduler("euler")


# ----------------------------------------------------------------------------------------------------------
# Our DDIM against diffusers' DDIMScheduler
# ----------------------------------------------------------------------------------------------------------
# diffusers' DDIM steps from t to t - T // N (a constant stride), so it matches our respaced DDIM when our process
# keeps exactly those timesteps: timestep_spacing="leading" with steps_offset=0 keeps {0, T/N, 2T/N, ...}, and
# set_alpha_to_one=True makes the last step's abar_prev 1 (ours: alphas_cumprod_prev[0] = 1). DiT's own
# respacing ``"N"`` (guided-diffusion's space_timesteps: 0 .. 999 with a rounded stride (T - 1) / (N - 1)) has no
# diffusers DDIM counterpart: its "linspace" spacing keeps the same timesteps but steps to t - T // N.


def _leading_process(n):
    keep = list(range(0, 1000, 1000 // n))
    abar = torch.cumprod(1 - linear_betas(1000), 0)[keep]
    prev = torch.cat([torch.ones(1, dtype=torch.float64), abar[:-1]])
    return GaussianDiffusion(1 - abar / prev, learn_sigma=True, timestep_map=keep)


@pytest.mark.parametrize("eta", [0.0, 0.5])
@pytest.mark.parametrize("n", [10, 25])
def test_our_ddim_matches_diffusers_ddim(n, eta):
    # tolerance: atol 1e-10 on float64 states. diffusers keeps its schedule in float32 (betas made by
    # torch.linspace in float32, relative error ~1e-7); to compare the update rules tightly, its alphas_cumprod
    # table is replaced by the same float64 table as ours (the float32 table agrees to rtol 1e-6, also checked).
    seed = int(np.random.default_rng().integers(0, 2**31))
    B, C, cfg = 3, 4, 2.5
    y = torch.from_numpy(np.random.default_rng(seed).integers(0, NUM_CLASSES, size=B))
    noise = torch.randn((B, C, 3, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ours_model = ToyEps(C, seed)
    out = sample_loop(_leading_process(n), GuidedModel(ours_model, y, cfg), noise, "ddim", eta=eta,
                      generator=torch.Generator().manual_seed(seed + 1))
    sched = DDIMScheduler(num_train_timesteps=1000, beta_start=1e-4, beta_end=0.02, beta_schedule="linear",
                          prediction_type="epsilon", timestep_spacing="leading", steps_offset=0,
                          set_alpha_to_one=True, clip_sample=False)
    abar64 = torch.cumprod(1 - linear_betas(1000), 0)
    torch.testing.assert_close(sched.alphas_cumprod.double(), abar64, rtol=1e-6, atol=0)
    sched.alphas_cumprod = abar64
    sched.set_timesteps(n)
    g = torch.Generator().manual_seed(seed + 1)
    ref_model = ToyEps(C, seed)
    x, xs = noise, [noise]
    for t in sched.timesteps:
        eps = _guided_eps(ref_model, x, torch.full((B,), int(t)), y, cfg)
        # our loop draws its per-step noise after the model call, one randn like x per step, when eta > 0
        z = torch.randn(x.shape, generator=g, dtype=x.dtype) if eta > 0 else None
        x = sched.step(eps, t, x, eta=eta, variance_noise=z).prev_sample
        xs.append(x)
    seen = [c[0][:B] for c in ours_model.calls] + [out]  # x_t at every model call, then x_0
    assert len(seen) == len(xs) == n + 1
    assert [int(c[1][0]) for c in ours_model.calls] == [int(t) for t in sched.timesteps]
    for a, b in zip(seen, xs):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
