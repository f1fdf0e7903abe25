"""Tests of ``ditforge.diffusion.samplers`` (DDPM / DDIM loops, classifier-free guidance).

References are written here in numpy float64:
  * oracle models: for a single data point x0 the true epsilon is (x_t - sqrt(abar) x0) / sqrt(1 - abar); for
    Gaussian data N(m, s^2) it is E[eps | x_t] = sqrt(1-abar) / (abar s^2 + 1 - abar) (x_t - sqrt(abar) m);
  * a step-by-step numpy re-run of the reverse process (posterior by Bayes' rule as a precision-weighted product
    of Gaussians, DDIM from Song et al. 2021 eq. 12), fed the same per-step noise draws;
  * for Gaussian data, the exact affine map that deterministic DDIM applies to the starting noise.
Inputs are seeded random draws, never zeros.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ditforge.diffusion import OWN_SAMPLERS, SAMPLERS, create_diffusion, generate, GuidedModel, sample_loop
from ditforge.diffusion.samplers import randn_like_rows


@pytest.fixture(autouse=True)
def one_thread():
    """Run intra-op single-threaded: the loops' many tiny steps are dominated by thread hand-off on 2 cores
    (a 1000-step loop took 15 s instead of 1 s with 2 intra-op threads on a busy machine); restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------------------------------------
# Independent references
# ----------------------------------------------------------------------------------------------------------
def ref_abar(T: int = 1000) -> np.ndarray:
    """abar_t of ADM's linear schedule (closed-form betas, running python product)."""
    scale = 1000.0 / T
    lo, hi = scale * 1e-4, scale * 0.02
    out, acc = [], 1.0
    for i in range(T):
        acc *= 1.0 - (lo + (hi - lo) * i / (T - 1))
        out.append(acc)
    return np.array(out)


ABAR = ref_abar(1000)  # indexed by ORIGINAL timesteps (what the model receives)


def col(a: np.ndarray, ndim: int) -> np.ndarray:
    return a.reshape((-1,) + (1,) * (ndim - 1))


def point_oracle(x0: torch.Tensor, channels_out: int | None = None, v: float = 0.0):
    """model_fn giving the exact epsilon for data that is the single point x0 (broadcast over the batch)."""
    x0_np = x0.double().numpy()

    def fn(x, t):
        ab = col(ABAR[t.numpy()], x.ndim)
        eps = (x.double().numpy() - np.sqrt(ab) * x0_np) / np.sqrt(1 - ab)
        if channels_out is not None:  # learned sigma: append variance values v
            eps = np.concatenate([eps, np.full_like(eps, v)], 1)
        return torch.from_numpy(eps).float()

    return fn


def gaussian_oracle(m: np.ndarray, s: np.ndarray):
    """model_fn giving E[eps | x_t] for per-channel data x0 ~ N(m_c, s_c^2); m, s shaped (1, C, 1, 1)."""

    def fn(x, t):
        ab = col(ABAR[t.numpy()], x.ndim)
        a, b = np.sqrt(ab), np.sqrt(1 - ab)
        eps = b / (ab * s**2 + b**2) * (x.double().numpy() - a * m)
        return torch.from_numpy(eps).float()

    return fn


def toy_np(x: np.ndarray, t: np.ndarray, C: int, learn_sigma: bool) -> np.ndarray:
    """A smooth non-trivial 'network' in numpy float64, returned rounded to float32 like a real model."""
    w = np.linspace(0.6, 1.4, C).reshape(1, C, 1, 1)
    tt = col(t.astype(np.float64), x.ndim)
    eps = 0.8 * np.tanh(w * x + 1e-3 * tt) + 0.1 * x
    if learn_sigma:
        v = np.tanh(0.5 * x + np.cos(tt / 100.0))
        eps = np.concatenate([eps, v], 1)
    return eps.astype(np.float32)


def toy_torch(C: int, learn_sigma: bool):
    def fn(x, t):
        w = torch.linspace(0.6, 1.4, C, dtype=torch.float64).view(1, C, 1, 1)
        xd, tt = x.double(), t.double().view(-1, 1, 1, 1)
        eps = 0.8 * torch.tanh(w * xd + 1e-3 * tt) + 0.1 * xd
        if learn_sigma:
            eps = torch.cat([eps, torch.tanh(0.5 * xd + torch.cos(tt / 100.0))], 1)
        return eps.float()

    return fn


def ref_loop(spec, learn_sigma, x_T, sampler, eta, clip, seed):
    """The reverse process in numpy float64 (x cast to float32 after every step, as the implementation does).

    Per-step noise: one float32 standard-normal draw of x's shape from a torch.Generator(seed) per step.
    """
    keep = list(range(1000)) if spec is None else _keep(spec)
    abar = ABAR[keep]
    abar_prev = np.concatenate([[1.0], abar[:-1]])
    alpha = abar / abar_prev  # respaced per-step alpha
    beta = 1 - alpha
    post_var = beta * (1 - abar_prev) / (1 - abar)
    g = torch.Generator().manual_seed(seed)
    x = x_T.numpy().astype(np.float32)
    B, C = x.shape[:2]
    for i in range(len(keep) - 1, -1, -1):
        t_orig = np.full(B, keep[i])
        out = toy_np(x.astype(np.float64), t_orig, C, learn_sigma).astype(np.float64)
        xd = x.astype(np.float64)
        eps = out[:, :C]
        x0_hat = (xd - math.sqrt(1 - abar[i]) * eps) / math.sqrt(abar[i])
        if clip:
            x0_hat = np.clip(x0_hat, -1, 1)
        z = torch.randn(x.shape, generator=g, dtype=torch.float32).double().numpy()
        if sampler == "ddpm":
            if i > 0:
                # Bayes: x_t | x_{t-1} ~ N(sqrt(alpha) x_{t-1}, beta);  x_{t-1} | x0 ~ N(sqrt(abar_prev) x0, 1-abar_prev)
                p1, p2 = alpha[i] / beta[i], 1 / (1 - abar_prev[i])
                mean = (p1 * xd / math.sqrt(alpha[i]) + p2 * math.sqrt(abar_prev[i]) * x0_hat) / (p1 + p2)
                if learn_sigma:
                    f = (out[:, C:] + 1) / 2
                    logvar = f * math.log(beta[i]) + (1 - f) * math.log(post_var[i])
                else:
                    logvar = math.log(beta[i])
                xn = mean + np.exp(0.5 * logvar) * z
            else:
                xn = x0_hat  # at t = 0 the posterior mean is x0_hat and no noise is added
        else:
            eps_used = (xd - math.sqrt(abar[i]) * x0_hat) / math.sqrt(1 - abar[i])
            sigma = eta * math.sqrt((1 - abar_prev[i]) / (1 - abar[i]) * (1 - abar[i] / abar_prev[i]))
            xn = math.sqrt(abar_prev[i]) * x0_hat + math.sqrt(1 - abar_prev[i] - sigma**2) * eps_used
            if i > 0:
                xn = xn + sigma * z
        x = xn.astype(np.float32)
    return x


def _keep(spec: str) -> list[int]:
    """Even respacing of 1000 steps into n (single section): round((999/(n-1)) j), j = 0..n-1."""
    n = int(spec)
    return [round(999 / (n - 1) * j) for j in range(n)]


def randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------
# Oracle tests
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["50", "250", None])
@pytest.mark.parametrize("seed", [0, 1])
def test_ddim_eta0_point_oracle_recovers_x0(spec, seed):
    # With the true eps every pred_x0 is x0 and the last step (abar_prev = 1) returns it exactly;
    # tolerance 1e-5 absolute (float32 state, x0 in [-1, 1]).
    x0 = torch.rand(1, 3, 4, 4, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    d = create_diffusion(spec, learn_sigma=False)
    noise = randn((5, 3, 4, 4), seed + 100) * 1.5
    out = sample_loop(d, point_oracle(x0), noise, "ddim", eta=0.0)
    assert out.shape == noise.shape and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), x0.expand(5, -1, -1, -1).numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("sampler,eta,learn_sigma", [("ddpm", 0.0, False), ("ddpm", 0.0, True), ("ddim", 1.0, False), ("ddim", 0.5, True)])
def test_stochastic_point_oracle_lands_on_x0(sampler, eta, learn_sigma):
    # Stochastic samplers also end exactly on x0: at t = 0 the posterior mean is pred_x0 = x0 (coef2 = 0) and
    # no noise is added. Tolerance 1e-4 absolute (float32 state; intermediate noise amplified by 1/sqrt(abar)).
    g = torch.Generator().manual_seed(7)
    x0 = torch.rand(1, 2, 3, 3, generator=g) * 2 - 1
    d = create_diffusion("100", learn_sigma=learn_sigma)
    v = 0.3 if learn_sigma else 0.0
    fn = point_oracle(x0, channels_out=4 if learn_sigma else None, v=v)
    out = sample_loop(d, fn, randn((4, 2, 3, 3), 8), sampler, eta=eta, generator=g)
    np.testing.assert_allclose(out.numpy(), x0.expand(4, -1, -1, -1).numpy(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("spec", ["20", "50", None])
def test_ddim_gaussian_data_exact_affine_map(spec):
    # For Gaussian data the exact-eps DDIM (eta = 0) step is affine, x_prev = P x + Q; composing the steps in
    # numpy gives the exact output for each starting noise. Tolerance 1e-4 absolute (float32 state).
    # With all 1000 steps the map is close to the ideal probability-flow map x_T -> m + s x_T
    # (discretisation error: |P/s - 1| < 0.02, |Q - m| < 0.01).
    m = np.array([0.3, -0.5, 0.1]).reshape(1, 3, 1, 1)
    s = np.array([0.5, 0.2, 1.0]).reshape(1, 3, 1, 1)
    keep = list(range(1000)) if spec is None else _keep(spec)
    P, Q = np.ones_like(m), np.zeros_like(m)
    for i in range(len(keep) - 1, -1, -1):
        ab = ABAR[keep[i]]
        ab_prev = ABAR[keep[i - 1]] if i > 0 else 1.0
        a, b = math.sqrt(ab), math.sqrt(1 - ab)
        k = b / (ab * s**2 + b**2)  # eps_hat = k (x - a m)
        # x0_hat = (x - b eps_hat) / a ; x_prev = sqrt(ab_prev) x0_hat + sqrt(1 - ab_prev) eps_hat
        p_step = math.sqrt(ab_prev) * (1 - b * k) / a + math.sqrt(1 - ab_prev) * k
        q_step = math.sqrt(ab_prev) * (b * k * a * m) / a - math.sqrt(1 - ab_prev) * k * a * m
        P, Q = p_step * P, p_step * Q + q_step
    if spec is None:
        assert np.all(np.abs(P / s - 1) < 0.02) and np.all(np.abs(Q - m) < 0.01)
    noise = randn((16, 3, 2, 2), 11)
    out = sample_loop(create_diffusion(spec, learn_sigma=False), gaussian_oracle(m, s), noise, "ddim")
    np.testing.assert_allclose(out.double().numpy(), P * noise.double().numpy() + Q, rtol=0, atol=1e-4)


def test_ddpm_gaussian_data_distribution():
    # With the exact eps of data N(m_c, s_c^2) and all 1000 steps, ancestral samples have mean m_c, std s_c.
    # N = 2000 per channel. Tolerances: |mean - m| < 5 SE + 0.01 with SE = s / sqrt(N); |std / s - 1| < 5 SE + 0.02
    # with SE = 1 / sqrt(2N). The constants cover the 1000-step discretisation bias (measured < 0.01 on the
    # mean and < 0.02 on the std ratio with 8000 samples).
    m = np.array([0.3, -0.5, 0.0]).reshape(1, 3, 1, 1)
    s = np.array([0.5, 0.2, 1.0]).reshape(1, 3, 1, 1)
    g = torch.Generator().manual_seed(21)
    noise = torch.randn(2000, 3, 1, 1, generator=g)
    out = sample_loop(create_diffusion(None, learn_sigma=False), gaussian_oracle(m, s), noise, "ddpm", generator=g)
    xs = out.double().transpose(0, 1).reshape(3, -1).numpy()
    N = xs.shape[1]
    assert np.all(np.abs(xs.mean(1) - m.ravel()) < 5 * s.ravel() / math.sqrt(N) + 0.01)
    assert np.all(np.abs(xs.std(1) / s.ravel() - 1) < 5 / math.sqrt(2 * N) + 0.02)


# ----------------------------------------------------------------------------------------------------------
# Step-by-step reference
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sampler,eta,learn_sigma,clip,spec",
    [
        ("ddpm", 0.0, True, False, "10"),
        ("ddpm", 0.0, False, False, "10"),
        ("ddpm", 0.0, True, True, "25"),
        ("ddim", 0.0, True, False, "10"),
        ("ddim", 0.7, True, False, "25"),
        ("ddim", 1.0, False, True, "10"),
    ],
)
def test_loop_matches_numpy_reference(sampler, eta, learn_sigma, clip, spec):
    # tolerance: 2e-5 absolute + 1e-5 relative (float32 state and model output, identical noise draws)
    C, seed = 3, 31
    x_T = randn((4, C, 4, 4), 30)
    d = create_diffusion(spec, learn_sigma=learn_sigma)
    got = sample_loop(d, toy_torch(C, learn_sigma), x_T, sampler, eta=eta, clip_denoised=clip,
                      generator=torch.Generator().manual_seed(seed))
    ref = ref_loop(spec, learn_sigma, x_T, sampler, eta, clip, seed)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=2e-5)
    if clip:
        assert np.all(np.abs(got.numpy()) <= 1 + 1e-6)


def test_ddim_eta1_equals_ddpm_with_posterior_variance():
    # Song et al. 2021: DDIM with eta = 1 is the DDPM ancestral step with variance beta~_t (the posterior's),
    # i.e. learned range with v = -1. Same noise stream -> same samples; tolerance 1e-4 absolute (float32).
    C = 2

    def model(x, t):
        eps = toy_torch(C, False)(x, t)
        return torch.cat([eps, -torch.ones_like(eps)], 1)

    d = create_diffusion("30", learn_sigma=True)
    x_T = randn((3, C, 4, 4), 40)
    a = sample_loop(d, model, x_T, "ddim", eta=1.0, generator=torch.Generator().manual_seed(41))
    b = sample_loop(d, model, x_T, "ddpm", generator=torch.Generator().manual_seed(41))
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------
# Determinism, model timesteps, errors
# ----------------------------------------------------------------------------------------------------------
def test_sample_loop_determinism():
    C = 2
    d = create_diffusion("20", learn_sigma=True)
    fn = toy_torch(C, True)
    x_T = randn((3, C, 4, 4), 50)
    a = sample_loop(d, fn, x_T, "ddpm", generator=torch.Generator().manual_seed(51))
    b = sample_loop(d, fn, x_T, "ddpm", generator=torch.Generator().manual_seed(51))
    c = sample_loop(d, fn, x_T, "ddpm", generator=torch.Generator().manual_seed(52))
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-3
    e1 = sample_loop(d, fn, x_T, "ddim", eta=0.5, generator=torch.Generator().manual_seed(51))
    e2 = sample_loop(d, fn, x_T, "ddim", eta=0.5, generator=torch.Generator().manual_seed(52))
    assert (e1 - e2).abs().max() > 1e-3
    # DDIM with eta = 0 is deterministic: the generator does not matter
    f1 = sample_loop(d, fn, x_T, "ddim", eta=0.0, generator=torch.Generator().manual_seed(51))
    f2 = sample_loop(d, fn, x_T, "ddim", eta=0.0, generator=torch.Generator().manual_seed(52))
    assert torch.equal(f1, f2)
    # the starting noise is not modified in place
    assert torch.equal(x_T, randn((3, C, 4, 4), 50))


@pytest.mark.parametrize("sampler, eta", [("ddpm", 0.0), ("ddim", 0.5)])
def test_step_noise_drawn_first_equals_drawing_in_the_loop(sampler, eta):
    """``step_noise`` (what a CUDA-graphed loop uses): S draws of ``randn_like_rows`` made before the loop, one
    generator or one per row, give exactly the samples of the loop drawing them step by step, and leave the
    generators in the same state."""
    C, S = 2, 20
    d = create_diffusion(str(S), learn_sigma=True)
    fn = toy_torch(C, True)
    x_T = randn((3, C, 4, 4), 60)
    for make in (lambda: torch.Generator().manual_seed(61),
                 lambda: [torch.Generator().manual_seed(62 + r) for r in range(3)]):
        g_loop, g_first = make(), make()
        want = sample_loop(d, fn, x_T, sampler, eta=eta, generator=g_loop)
        z = torch.stack([randn_like_rows(x_T, g_first) for _ in range(S)])
        got = sample_loop(d, fn, x_T, sampler, eta=eta, generator=None, step_noise=z)
        assert torch.equal(got, want)
        after = [g_loop] if isinstance(g_loop, torch.Generator) else g_loop
        first = [g_first] if isinstance(g_first, torch.Generator) else g_first
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(after, first))


def test_sample_loop_model_sees_original_timesteps():
    d = create_diffusion("10", learn_sigma=False)
    seen = []

    def fn(x, t):
        seen.append(t.clone())
        return 0.5 * x

    sample_loop(d, fn, randn((2, 1, 2, 2), 60), "ddim")
    assert [int(t[0]) for t in seen] == _keep("10")[::-1]
    assert all(t.dtype == torch.int64 and t.shape == (2,) and bool((t == t[0]).all()) for t in seen)


def test_unknown_sampler_raises():
    assert set(SAMPLERS) == {"ddpm", "ddim", "dpm++", "euler", "student"}
    d = create_diffusion("5", learn_sigma=False)
    for name in ("euler", "dpm++", "heun"):  # the diffusers solvers run in solver_loop, not sample_loop
        with pytest.raises(ValueError):
            sample_loop(d, lambda x, t: x, randn((1, 1, 2, 2), 61), name)


# ----------------------------------------------------------------------------------------------------------
# Classifier-free guidance
# ----------------------------------------------------------------------------------------------------------
NUM_CLASSES = 10


def toy_cond_np(x, t, y, C_out):
    """Label-dependent toy output in numpy float64: eps channels depend on y, variance channels too."""
    C = x.shape[1]
    yy = col(y.astype(np.float64), x.ndim)
    tt = col(t.astype(np.float64), x.ndim)
    eps = np.tanh(x * (1 + 0.1 * yy) + 0.01 * yy + 1e-3 * tt)
    parts = [eps]
    if C_out > C:
        parts.append(np.tanh(0.3 * x[:, : C_out - C] - 0.05 * yy))
    return np.concatenate(parts, 1)


class ToyCondModel(torch.nn.Module):
    """model(x, t, y, force_drop_ids) in float64 matching ``toy_cond_np``; dropped rows (force_drop_ids True) get
    the null label NUM_CLASSES, as DiT's LabelEmbedder does. Records the batch size, the labels in effect (after
    dropping), t, x and force_drop_ids of every call."""

    def __init__(self, C_out):
        super().__init__()
        self.C_out = C_out
        self.calls = []

    def forward(self, x, t, y, force_drop_ids=None):
        if force_drop_ids is not None:
            y = torch.where(force_drop_ids == 1, NUM_CLASSES, y)
        self.calls.append((x.shape[0], y.clone(), t.clone(), x.clone(), force_drop_ids))
        out = toy_cond_np(x.double().numpy(), t.numpy(), y.numpy(), self.C_out)
        return torch.from_numpy(out)


@pytest.mark.parametrize("cfg_scale", [1.5, 4.0])
@pytest.mark.parametrize("seed", [70, 71])
def test_GuidedModel_combination(cfg_scale, seed):
    # tolerance: rtol 1e-12 (float64 throughout)
    rng = np.random.default_rng(seed)
    B, C = 5, 4
    x = torch.from_numpy(rng.standard_normal((B, C, 3, 3)))
    t = torch.from_numpy(rng.integers(0, 1000, size=B))
    y = torch.from_numpy(rng.integers(0, NUM_CLASSES, size=B))
    model = ToyCondModel(2 * C)
    out = GuidedModel(model, y, cfg_scale)(x, t).numpy()
    # one batched call of 2B: (x, x), (t, t), (y, y) with the second half dropped, i.e. (y, null)
    assert len(model.calls) == 1
    n, ys, ts, xs, drop = model.calls[0]
    assert n == 2 * B
    assert drop.dtype == torch.bool and drop.tolist() == [False] * B + [True] * B
    assert ys.tolist() == y.tolist() + [NUM_CLASSES] * B
    assert torch.equal(ts, torch.cat([t, t])) and torch.equal(xs, torch.cat([x, x]))
    cond = toy_cond_np(x.numpy(), t.numpy(), y.numpy(), 2 * C)
    uncond = toy_cond_np(x.numpy(), t.numpy(), np.full(B, NUM_CLASSES), 2 * C)
    assert out.shape == (B, 2 * C, 3, 3)
    expect_eps = uncond[:, :C] + cfg_scale * (cond[:, :C] - uncond[:, :C])
    np.testing.assert_allclose(out[:, :C], expect_eps, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out[:, C:], cond[:, C:], rtol=1e-12, atol=1e-14)  # variance from the cond pass


@pytest.mark.parametrize("k", [1, 3])
def test_GuidedModel_guidance_channels(k):
    # Only the first k channels are guided (DiT's official sampler: k = 3 of 4); the rest come from cond.
    rng = np.random.default_rng(72 + k)
    B, C, s = 3, 4, 3.0
    x = torch.from_numpy(rng.standard_normal((B, C, 2, 2)))
    t = torch.from_numpy(rng.integers(0, 1000, size=B))
    y = torch.from_numpy(rng.integers(0, NUM_CLASSES, size=B))
    out = GuidedModel(ToyCondModel(2 * C), y, s, guidance_channels=k)(x, t).numpy()
    cond = toy_cond_np(x.numpy(), t.numpy(), y.numpy(), 2 * C)
    uncond = toy_cond_np(x.numpy(), t.numpy(), np.full(B, NUM_CLASSES), 2 * C)
    np.testing.assert_allclose(out[:, :k], uncond[:, :k] + s * (cond[:, :k] - uncond[:, :k]), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out[:, k:], cond[:, k:], rtol=1e-12, atol=1e-14)
    assert np.abs(out[:, k:C] - (uncond[:, k:C] + s * (cond[:, k:C] - uncond[:, k:C]))).max() > 1e-3


def test_GuidedModel_fixed_sigma_guides_all_channels():
    rng = np.random.default_rng(74)
    B, C, s = 3, 2, 2.5
    x = torch.from_numpy(rng.standard_normal((B, C, 2, 2)))
    t = torch.from_numpy(rng.integers(0, 1000, size=B))
    y = torch.from_numpy(rng.integers(0, NUM_CLASSES, size=B))
    out = GuidedModel(ToyCondModel(C), y, s)(x, t).numpy()
    cond = toy_cond_np(x.numpy(), t.numpy(), y.numpy(), C)
    uncond = toy_cond_np(x.numpy(), t.numpy(), np.full(B, NUM_CLASSES), C)
    assert out.shape == (B, C, 2, 2)
    np.testing.assert_allclose(out, uncond + s * (cond - uncond), rtol=1e-12, atol=1e-14)


def test_GuidedModel_scale_one_single_conditional_call():
    rng = np.random.default_rng(75)
    B, C = 4, 3
    x = torch.from_numpy(rng.standard_normal((B, C, 2, 2)))
    t = torch.from_numpy(rng.integers(0, 1000, size=B))
    y = torch.from_numpy(rng.integers(0, NUM_CLASSES, size=B))
    model = ToyCondModel(2 * C)
    fn = GuidedModel(model, y, 1.0)
    out = fn(x, t).numpy()
    assert len(model.calls) == 1 and model.calls[0][0] == B and model.calls[0][4] is None  # nothing dropped
    assert torch.equal(model.calls[0][1], y)
    np.testing.assert_allclose(out, toy_cond_np(x.numpy(), t.numpy(), y.numpy(), 2 * C), rtol=1e-12, atol=1e-14)
    fn(x, t)
    assert [c[0] for c in model.calls] == [B, B]


def test_guided_sampling_end_to_end_with_oracles():
    # The eps of a point oracle is affine in its point, so guiding between a conditional oracle (point a_y)
    # and the unconditional one (point u) is the oracle of u + s (a_y - u); DDIM (eta = 0) must land on it.
    # Tolerance 1e-4 absolute (float32 state).
    rng = np.random.default_rng(76)
    C, s = 2, 3.0
    points = rng.uniform(-0.3, 0.3, size=(NUM_CLASSES + 1, C, 2, 2))  # row NUM_CLASSES is the null label

    class PointOracleModel(torch.nn.Module):
        def forward(self, x, t, y, force_drop_ids=None):
            if force_drop_ids is not None:
                y = torch.where(force_drop_ids, NUM_CLASSES, y)
            ab = col(ABAR[t.numpy()], x.ndim)
            x0 = points[y.numpy()]
            eps = (x.double().numpy() - np.sqrt(ab) * x0) / np.sqrt(1 - ab)
            return torch.from_numpy(eps).float()

    y = torch.tensor([0, 3, 7, 9])
    d = create_diffusion("25", learn_sigma=False)
    out = sample_loop(d, GuidedModel(PointOracleModel(), y, s), randn((4, C, 2, 2), 77), "ddim")
    u = points[NUM_CLASSES]
    expect = u + s * (points[y.numpy()] - u)
    np.testing.assert_allclose(out.double().numpy(), expect, rtol=0, atol=1e-4)


class ToyTextModel(torch.nn.Module):
    """model(x, t, states, force_drop_ids, y_mask) in float64: dropped rows see every token replaced by a fixed
    null token (as DiT's CaptionEmbedder), and the output depends on the masked mean of the tokens."""

    def __init__(self, D):
        super().__init__()
        self.null = np.random.default_rng(90).standard_normal(D)
        self.calls = []

    def forward(self, x, t, y, force_drop_ids=None, y_mask=None):
        self.calls.append((y.clone(), y_mask.clone(), force_drop_ids))
        return torch.from_numpy(toy_text_np(x.numpy(), t.numpy(), y.numpy(), y_mask.numpy(),
                                            None if force_drop_ids is None else force_drop_ids.numpy(), self.null))


def toy_text_np(x, t, states, mask, drop, null):
    states = states.copy()
    if drop is not None:
        states[drop] = null
    m = mask[..., None].astype(np.float64)
    pooled = (states * m).sum(1) / m.sum(1)  # (B, D)
    feat = col(pooled.sum(1), x.ndim)
    return np.tanh(x * (1 + 0.1 * feat) + 1e-3 * col(t.astype(np.float64), x.ndim))


@pytest.mark.parametrize("cfg_scale", [1.0, 3.5])
def test_GuidedModel_text_states(cfg_scale):
    # The unconditional half is the same captions with every row dropped (the null caption), masks doubled.
    rng = np.random.default_rng(91)
    B, L, D, C = 3, 5, 4, 2
    x = torch.from_numpy(rng.standard_normal((B, C, 2, 2)))
    t = torch.from_numpy(rng.integers(0, 1000, size=B))
    states = torch.from_numpy(rng.standard_normal((B, L, D)))
    mask = torch.from_numpy(np.arange(L)[None] < rng.integers(1, L + 1, size=(B, 1)))
    model = ToyTextModel(D)
    out = GuidedModel(model, states, cfg_scale, y_mask=mask)(x, t).numpy()
    cond = toy_text_np(x.numpy(), t.numpy(), states.numpy(), mask.numpy(), None, model.null)
    if cfg_scale == 1.0:
        assert model.calls[0][2] is None and torch.equal(model.calls[0][1], mask)
        np.testing.assert_allclose(out, cond, rtol=1e-12, atol=1e-14)
        return
    ys, masks, drop = model.calls[0]
    assert torch.equal(ys, torch.cat([states, states])) and torch.equal(masks, torch.cat([mask, mask]))
    assert drop.tolist() == [False] * B + [True] * B
    uncond = toy_text_np(x.numpy(), t.numpy(), states.numpy(), mask.numpy(), np.ones(B, bool), model.null)
    np.testing.assert_allclose(out, uncond + cfg_scale * (cond - uncond), rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------------------------------
# generate: noise -> guided, respaced, batched sampling
# ----------------------------------------------------------------------------------------------------------
def _labels(seed, n):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, NUM_CLASSES, size=n))


@pytest.mark.parametrize("sampler", OWN_SAMPLERS)
def test_generate_is_noise_then_sample_loop(sampler):
    # Reference: the explicit recipe (all starting noise first, then one guided sample_loop on the same generator).
    C, n, seed = 2, 5, int(np.random.default_rng().integers(0, 2**31))
    y = _labels(92, n)
    got = generate(ToyCondModel(2 * C), y, (C, 3, 3), cfg_scale=2.5, num_steps=6, sampler=sampler, eta=0.5,
                   learn_sigma=True, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((n, C, 3, 3), generator=g)
    ref = sample_loop(create_diffusion("6", True), GuidedModel(ToyCondModel(2 * C), y, 2.5), noise, sampler, 0.5,
                      True, g)
    assert got.dtype == torch.float32 and got.shape == (n, C, 3, 3)
    assert torch.equal(got, ref)


def test_generate_batches():
    # Batches of 2 + 2 + 1: starting noise drawn for all 5 first, then each batch's loop on the same generator.
    C, n, seed = 1, 5, int(np.random.default_rng().integers(0, 2**31))
    y = _labels(93, n)
    model = ToyCondModel(C)
    got = generate(model, y, (C, 2, 2), cfg_scale=3.0, num_steps=4, learn_sigma=False,
                   generator=torch.Generator().manual_seed(seed), batch_size=2)
    assert {c[0] for c in model.calls} == {4, 2}  # 2B rows per guided call
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((n, C, 2, 2), generator=g)
    d = create_diffusion("4", False)
    ref = torch.cat([sample_loop(d, GuidedModel(ToyCondModel(C), y[i:i + 2], 3.0), noise[i:i + 2], "ddpm", 0.0,
                                 True, g) for i in range(0, n, 2)])
    assert torch.equal(got, ref)


@pytest.mark.parametrize("sampler,eta", [("ddpm", 0.0), ("ddim", 0.5)])
def test_generate_per_sample_seeds(sampler, eta):
    # seeds: row i's starting and per-step noise come from its own generator manual_seed(seeds[i]); the reference
    # runs each row alone with that recipe. Exact (float64 toy model; rows do not mix), whatever batch_size.
    C, n = 2, 5
    y = _labels(95, n)
    seeds = [int(s) for s in np.random.default_rng().integers(0, 2**31, size=n)]
    kw = dict(cfg_scale=2.0, num_steps=5, sampler=sampler, eta=eta, learn_sigma=True)
    got = generate(ToyCondModel(2 * C), y, (C, 2, 2), seeds=seeds, batch_size=2, **kw)
    d = create_diffusion("5", True)
    for i in range(n):
        g = torch.Generator().manual_seed(seeds[i])
        noise = torch.randn((1, C, 2, 2), generator=g)
        ref = sample_loop(d, GuidedModel(ToyCondModel(2 * C), y[i:i + 1], 2.0), noise, sampler, eta, True, g)
        assert torch.equal(got[i:i + 1], ref)
    assert torch.equal(got, generate(ToyCondModel(2 * C), y, (C, 2, 2), seeds=seeds, batch_size=5, **kw))
    sub = generate(ToyCondModel(2 * C), y[[1, 3]], (C, 2, 2), seeds=[seeds[1], seeds[3]], **kw)
    assert torch.equal(sub, got[[1, 3]])  # skipping rows does not change the others


def test_generate_deterministic_and_seed_dependent():
    y = _labels(94, 3)

    def run(seed):
        return generate(ToyCondModel(2), y, (1, 2, 2), num_steps=5, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


@pytest.mark.parametrize("kwargs", [dict(num_steps=1), dict(num_steps=1001), dict(sampler="heun"),
                                    dict(seeds=[1, 2]), dict(seeds=[1, 2, 3], generator=torch.Generator()),
                                    dict(batch_size=0), dict(y_mask=torch.ones(2, 3, dtype=torch.bool))])
def test_generate_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        generate(ToyCondModel(2), _labels(95, 3), (1, 2, 2), **{"num_steps": 4, **kwargs})
