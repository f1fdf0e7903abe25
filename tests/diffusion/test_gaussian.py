"""Tests of ``ditforge.diffusion.gaussian`` against independent float64 references.

Every reference below is written here in numpy / python ``math`` and computed differently from the
implementation where that is possible:
  * schedules from the closed form ``start + (end - start) i / (T - 1)`` and a running python product;
  * the posterior q(x_{t-1} | x_t, x_0) by Bayes' rule, as the precision-weighted product of the Gaussians
    q(x_t | x_{t-1}) = N(sqrt(alpha_t) x_{t-1}, beta_t) and q(x_{t-1} | x_0) = N(sqrt(abar_{t-1}) x_0, 1 - abar_{t-1});
  * the KL from the textbook form log(s2/s1) + (s1^2 + (m1 - m2)^2) / (2 s2^2) - 1/2 and by Monte Carlo;
  * the decoder likelihood with the exact normal CDF (math.erf), and separately with ADM's tanh CDF;
  * space_timesteps against known outputs of guided-diffusion's respace.py and by hand.
Inputs are fresh random draws (seeded, seeds vary per parametrisation), never zeros.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ditforge.diffusion import create_diffusion
from ditforge.diffusion.gaussian import (
    GaussianDiffusion,
    approx_standard_normal_cdf,
    discretized_gaussian_log_likelihood,
    linear_betas,
    normal_kl,
    space_timesteps,
)

LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------------------------------
# Independent references
# ----------------------------------------------------------------------------------------------------------
def ref_betas(T: int) -> np.ndarray:
    """ADM linear schedule from its closed form (python floats, no linspace)."""
    scale = 1000.0 / T
    lo, hi = scale * 1e-4, scale * 0.02
    return np.array([lo + (hi - lo) * i / (T - 1) for i in range(T)], dtype=np.float64)


def ref_abar(betas: np.ndarray) -> np.ndarray:
    """Running product of (1 - beta) with a python loop (not cumprod)."""
    out, acc = [], 1.0
    for b in betas:
        acc *= 1.0 - float(b)
        out.append(acc)
    return np.array(out)


def ref_posterior(betas: np.ndarray, x0: np.ndarray, xt: np.ndarray, t: np.ndarray):
    """q(x_{t-1} | x_t, x_0) by Bayes: product of N(x_{t-1}; x_t/sqrt(a), beta/a) (as a function of x_{t-1})
    and N(x_{t-1}; sqrt(abar_prev) x0, 1 - abar_prev). Precision-weighted mean; t >= 1 only."""
    abar = ref_abar(betas)
    a_t = 1.0 - betas[t]
    abar_prev = abar[t - 1]
    shape = (-1,) + (1,) * (x0.ndim - 1)
    a_t, beta_t, abar_prev = a_t.reshape(shape), betas[t].reshape(shape), abar_prev.reshape(shape)
    # likelihood term: x_t ~ N(sqrt(a) x_{t-1}, beta)  <=>  in x_{t-1}: precision a / beta, centre x_t / sqrt(a)
    prec1, mu1 = a_t / beta_t, xt / np.sqrt(a_t)
    # prior term: x_{t-1} ~ N(sqrt(abar_prev) x0, 1 - abar_prev)
    prec2, mu2 = 1.0 / (1.0 - abar_prev), np.sqrt(abar_prev) * x0
    var = 1.0 / (prec1 + prec2)
    mean = var * (prec1 * mu1 + prec2 * mu2)
    return mean, np.broadcast_to(var, mean.shape)


def ref_kl(m1, v1, m2, v2):
    """KL(N(m1, v1) || N(m2, v2)) from standard deviations (textbook form), nats."""
    s1, s2 = np.sqrt(v1), np.sqrt(v2)
    return np.log(s2 / s1) + (s1**2 + (m1 - m2) ** 2) / (2 * s2**2) - 0.5


def phi_exact(z):
    return 0.5 * (1.0 + np.vectorize(math.erf)(np.asarray(z) / math.sqrt(2.0)))


def phi_tanh(z):
    """ADM's decoder CDF (Page 1977 tanh approximation): its definition, written in numpy."""
    z = np.asarray(z)
    return 0.5 * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))


def ref_bin_prob(x, mean, std, cdf):
    """P(bin of x) for data quantised to 256 levels on [-1, 1]; the edge bins take the tails."""
    upper = np.where(x > 0.999, 1.0, cdf((x + 1 / 255 - mean) / std))
    lower = np.where(x < -0.999, 0.0, cdf((x - 1 / 255 - mean) / std))
    return upper - lower


def ref_learned_logvar(betas, t, v):
    """Improved DDPM eq. 15: log sigma^2 = f log beta_t + (1 - f) log beta~_t, f = (v + 1)/2, beta~_0 -> beta~_1."""
    abar = ref_abar(betas)
    abar_prev = np.concatenate([[1.0], abar[:-1]])
    post = betas * (1 - abar_prev) / (1 - abar)
    post_clipped = np.where(np.arange(len(betas)) == 0, post[1], post)
    shape = (-1,) + (1,) * (v.ndim - 1)
    f = (v + 1) / 2
    return f * np.log(betas[t]).reshape(shape) + (1 - f) * np.log(post_clipped[t]).reshape(shape)


def ref_model_mean(betas, xt, t, eps):
    """Posterior mean at pred_x0 = (x_t - sqrt(1 - abar) eps) / sqrt(abar); at t = 0 it is pred_x0 itself."""
    abar = ref_abar(betas)
    shape = (-1,) + (1,) * (xt.ndim - 1)
    ab = abar[t].reshape(shape)
    x0_hat = (xt - np.sqrt(1 - ab) * eps) / np.sqrt(ab)
    mean = np.array(x0_hat, copy=True)
    pos = t > 0
    if pos.any():
        mean[pos] = ref_posterior(betas, x0_hat[pos], xt[pos], t[pos])[0]
    return mean, x0_hat


def t64(a) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.float64)


# ----------------------------------------------------------------------------------------------------------
# Schedules
# ----------------------------------------------------------------------------------------------------------
def test_linear_betas_endpoints_1000():
    # tolerance: float64 linspace vs closed form, a few ulp (rtol 1e-13)
    b = linear_betas(1000)
    assert b.dtype == torch.float64 and b.shape == (1000,)
    assert b[0].item() == pytest.approx(1e-4, rel=1e-13, abs=0)
    assert b[-1].item() == pytest.approx(0.02, rel=1e-13, abs=0)
    np.testing.assert_allclose(b.numpy(), ref_betas(1000), rtol=1e-13, atol=0)
    assert linear_betas().shape == (1000,)


@pytest.mark.parametrize("T", [10, 50, 250, 4000])
def test_linear_betas_rescaled(T):
    # ADM scales both endpoints by 1000 / T; tolerance rtol 1e-13 (float64 rounding)
    b = linear_betas(T).numpy()
    assert b.shape == (T,)
    np.testing.assert_allclose(b[[0, -1]], [1e-4 * 1000 / T, 0.02 * 1000 / T], rtol=1e-13)
    np.testing.assert_allclose(b, ref_betas(T), rtol=1e-13, atol=0)


@pytest.mark.parametrize("T", [1000, 100])
def test_schedule_tables(T):
    # tolerance: rtol 1e-12 (float64 cumprod vs python loop accumulate ~T ulp)
    d = GaussianDiffusion(linear_betas(T), learn_sigma=True)
    betas = ref_betas(T)
    abar = ref_abar(betas)
    abar_prev = np.concatenate([[1.0], abar[:-1]])
    assert d.num_timesteps == T
    np.testing.assert_allclose(d.alphas_cumprod.numpy(), abar, rtol=1e-12)
    np.testing.assert_allclose(d.alphas_cumprod.numpy(), np.cumprod(1.0 - betas), rtol=1e-12)
    np.testing.assert_allclose(d.alphas_cumprod_prev.numpy(), abar_prev, rtol=1e-12)
    np.testing.assert_allclose(d.sqrt_alphas_cumprod.numpy(), np.sqrt(abar), rtol=1e-12)
    np.testing.assert_allclose(d.sqrt_one_minus_alphas_cumprod.numpy(), np.sqrt(1 - abar), rtol=1e-12)
    np.testing.assert_allclose(d.posterior_variance.numpy(), betas * (1 - abar_prev) / (1 - abar), rtol=1e-12)
    assert d.posterior_variance[0].item() == 0.0
    assert torch.equal(d.timestep_map, torch.arange(T))


def test_betas_validation():
    with pytest.raises(ValueError):
        GaussianDiffusion(torch.tensor([0.1, 1.5], dtype=torch.float64))
    with pytest.raises(ValueError):
        GaussianDiffusion(torch.tensor([0.0, 0.1], dtype=torch.float64))
    with pytest.raises(ValueError):
        GaussianDiffusion(torch.full((2, 3), 0.1, dtype=torch.float64))


# ----------------------------------------------------------------------------------------------------------
# q(x_t | x_0)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q_sample_exact(seed):
    rng = np.random.default_rng(seed)
    d = GaussianDiffusion(linear_betas(1000))
    abar = ref_abar(ref_betas(1000))
    B = 6
    x0 = rng.uniform(-1, 1, size=(B, 3, 4, 5))
    eps = rng.standard_normal((B, 3, 4, 5))
    t = rng.integers(0, 1000, size=B)
    t[0], t[1] = 0, 999
    ref = np.sqrt(abar[t])[:, None, None, None] * x0 + np.sqrt(1 - abar[t])[:, None, None, None] * eps
    # float64 in: rtol 1e-12 / atol 1e-13
    out = d.q_sample(t64(x0), torch.as_tensor(t), t64(eps))
    assert out.dtype == torch.float64
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-12, atol=1e-13)
    # float32 in -> float32 out, within float32 rounding of inputs and output (atol 2e-6)
    out32 = d.q_sample(t64(x0).float(), torch.as_tensor(t), t64(eps).float())
    assert out32.dtype == torch.float32
    np.testing.assert_allclose(out32.double().numpy(), ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("seed", [3, 4])
def test_q_sample_moments(seed):
    # Over N noise draws, x_t has mean sqrt(abar) x0 and variance 1 - abar.
    # tolerance: 5 standard errors: SE(mean) = sqrt((1-abar)/N), SE(var) = (1-abar) sqrt(2/(N-1)).
    g = torch.Generator().manual_seed(seed)
    d = GaussianDiffusion(linear_betas(1000))
    abar = ref_abar(ref_betas(1000))
    N = 20000
    x0_one = (torch.rand(1, 4, generator=g, dtype=torch.float64) * 2 - 1)
    for tt in (5, 300, 999):
        noise = torch.randn(N, 4, generator=g, dtype=torch.float64)
        xt = d.q_sample(x0_one.expand(N, 4), torch.full((N,), tt), noise).numpy()
        m_ref = math.sqrt(abar[tt]) * x0_one.numpy()[0]
        v_ref = 1 - abar[tt]
        se_m = math.sqrt(v_ref / N)
        se_v = v_ref * math.sqrt(2 / (N - 1))
        assert np.all(np.abs(xt.mean(0) - m_ref) < 5 * se_m)
        assert np.all(np.abs(xt.var(0, ddof=1) - v_ref) < 5 * se_v)


# ----------------------------------------------------------------------------------------------------------
# Posterior
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [10, 11, 12])
@pytest.mark.parametrize("T", [1000, 50])
def test_posterior_matches_bayes(seed, T):
    # tolerance: rtol 1e-10 on mean and variance (float64, different algebra)
    rng = np.random.default_rng(seed)
    d = GaussianDiffusion(linear_betas(T))
    betas = ref_betas(T)
    B = 8
    x0 = rng.uniform(-1, 1, size=(B, 2, 3, 3))
    xt = rng.standard_normal((B, 2, 3, 3))
    t = rng.integers(1, T, size=B)
    t[0], t[1] = 1, T - 1
    mean, var, logvar = d.q_posterior_mean_variance(t64(x0), t64(xt), torch.as_tensor(t))
    mean_ref, var_ref = ref_posterior(betas, x0, xt, t)
    np.testing.assert_allclose(mean.numpy(), mean_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(var.numpy(), var_ref, rtol=1e-10)
    np.testing.assert_allclose(logvar.numpy(), np.log(var_ref), rtol=1e-10, atol=1e-12)
    assert mean.shape == var.shape == logvar.shape == x0.shape


def test_posterior_at_t0():
    # At t = 0 the posterior is a point mass at x_0; its log variance is clipped to log beta~_1.
    rng = np.random.default_rng(13)
    d = GaussianDiffusion(linear_betas(1000))
    betas = ref_betas(1000)
    abar = ref_abar(betas)
    x0 = rng.uniform(-1, 1, size=(3, 2, 4))
    xt = rng.standard_normal((3, 2, 4))
    t = torch.zeros(3, dtype=torch.long)
    mean, var, logvar = d.q_posterior_mean_variance(t64(x0), t64(xt), t)
    np.testing.assert_allclose(mean.numpy(), x0, rtol=1e-12, atol=1e-14)
    assert torch.all(var == 0)
    beta_tilde_1 = betas[1] * (1 - abar[0]) / (1 - abar[1])
    np.testing.assert_allclose(logvar.numpy(), np.full(x0.shape, math.log(beta_tilde_1)), rtol=1e-12)


@pytest.mark.parametrize("seed", [20, 21])
def test_predict_xstart_eps_roundtrip(seed):
    # x_t built from (x0, eps) gives back x0 and eps; tolerance atol 1e-9 (1/sqrt(abar_T) ~ 157 amplifies ulps)
    rng = np.random.default_rng(seed)
    d = GaussianDiffusion(linear_betas(1000))
    B = 7
    x0 = rng.uniform(-1, 1, size=(B, 3, 4, 4))
    eps = rng.standard_normal((B, 3, 4, 4))
    t = rng.integers(0, 1000, size=B)
    t[0], t[1] = 0, 999
    tt = torch.as_tensor(t)
    xt = d.q_sample(t64(x0), tt, t64(eps))
    x0_back = d.predict_xstart_from_eps(xt, tt, t64(eps))
    eps_back = d.predict_eps_from_xstart(xt, tt, t64(x0))
    assert x0_back.dtype == eps_back.dtype == torch.float64
    np.testing.assert_allclose(x0_back.numpy(), x0, rtol=0, atol=1e-9)
    np.testing.assert_allclose(eps_back.numpy(), eps, rtol=0, atol=1e-9)
    # and the two maps invert each other for arbitrary (x_t, eps), not only for q_sample outputs
    xt2 = t64(rng.standard_normal((B, 3, 4, 4)))
    e2 = t64(rng.standard_normal((B, 3, 4, 4)))
    np.testing.assert_allclose(
        d.predict_eps_from_xstart(xt2, tt, d.predict_xstart_from_eps(xt2, tt, e2)).numpy(), e2.numpy(), atol=1e-9
    )


# ----------------------------------------------------------------------------------------------------------
# KL and decoder likelihood
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [30, 31])
def test_normal_kl_closed_form(seed):
    # tolerance: rtol 1e-10 / atol 1e-12 (float64, different algebra)
    rng = np.random.default_rng(seed)
    m1, m2 = rng.standard_normal((2, 5, 6))
    lv1, lv2 = rng.uniform(-4, 2, size=(2, 5, 6))
    kl = normal_kl(t64(m1), t64(lv1), t64(m2), t64(lv2)).numpy()
    np.testing.assert_allclose(kl, ref_kl(m1, np.exp(lv1), m2, np.exp(lv2)), rtol=1e-10, atol=1e-12)
    assert np.all(kl >= 0)
    # identical Gaussians: KL = 0 (atol 1e-15)
    same = normal_kl(t64(m1), t64(lv1), t64(m1), t64(lv1)).numpy()
    np.testing.assert_allclose(same, 0.0, atol=1e-15)
    # broadcasting a scalar log-variance (as vb_terms_bpd does with table lookups)
    kl_b = normal_kl(t64(m1), torch.tensor(0.3, dtype=torch.float64), t64(m2), t64(lv2)).numpy()
    np.testing.assert_allclose(kl_b, ref_kl(m1, math.exp(0.3), m2, np.exp(lv2)), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", [32, 33])
def test_normal_kl_monte_carlo(seed):
    # KL = E_{x~p1}[log p1(x) - log p2(x)]; tolerance 5 Monte-Carlo standard errors (N = 200000)
    rng = np.random.default_rng(seed)
    N = 200_000
    for _ in range(3):
        m1, m2 = rng.standard_normal(2)
        lv1, lv2 = rng.uniform(-1.5, 1.0, size=2)
        s1, s2 = math.exp(lv1 / 2), math.exp(lv2 / 2)
        x = m1 + s1 * rng.standard_normal(N)
        log_ratio = (-np.log(s1) - 0.5 * ((x - m1) / s1) ** 2) - (-np.log(s2) - 0.5 * ((x - m2) / s2) ** 2)
        est, se = log_ratio.mean(), log_ratio.std() / math.sqrt(N)
        kl = normal_kl(*(torch.tensor(v, dtype=torch.float64) for v in (m1, lv1, m2, lv2))).item()
        assert abs(kl - est) < 5 * se + 1e-12


def test_approx_cdf_error_bound():
    # The tanh CDF (Page 1977) is within 1.8e-4 absolute of the exact normal CDF everywhere
    # (max error ~1.79e-4 near |z| = 2.59); this bound sets the tolerances of the decoder tests below.
    z = np.linspace(-8, 8, 20001)
    approx = approx_standard_normal_cdf(t64(z)).numpy()
    assert np.max(np.abs(approx - phi_exact(z))) < 1.8e-4
    np.testing.assert_allclose(approx, phi_tanh(z), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("seed", [40, 41, 42])
def test_discretized_log_likelihood_vs_exact_cdf(seed):
    rng = np.random.default_rng(seed)
    n = 400
    k = rng.integers(0, 256, size=n)
    k[:4] = [0, 255, 0, 255]  # the edge bins, always
    x = 2.0 * k / 255.0 - 1.0
    log_scale = rng.uniform(math.log(0.005), math.log(0.5), size=n)
    # half the means anywhere in [-1, 1], half within about one scale of the data (likely bins)
    mean = np.where(np.arange(n) % 2 == 0, rng.uniform(-1, 1, size=n), x + np.exp(log_scale) * rng.standard_normal(n))
    mean[:4] = [-1.0, 1.0, 0.3, -0.3]
    ll = discretized_gaussian_log_likelihood(t64(x), t64(mean), t64(log_scale)).numpy()
    p_exact = ref_bin_prob(x, mean, np.exp(log_scale), phi_exact)
    # probabilities: a bin probability is a difference of two CDF values, so the tanh approximation is within
    # 2 x 1.8e-4 = 3.6e-4 absolute (the 1e-12 clamp adds at most 1e-12)
    np.testing.assert_allclose(np.exp(ll), p_exact, rtol=0, atol=3.6e-4)
    # where the bin is likely (p > 0.05), the log is within 3.6e-4 / 0.05 ~ 7.2e-3 (use 8e-3)
    big = p_exact > 0.05
    assert big.sum() > 5
    np.testing.assert_allclose(ll[big], np.log(p_exact[big]), rtol=0, atol=8e-3)
    # agreement with ADM's own decoder definition (tanh CDF, same 1e-12 clamp), on the probability scale:
    # a bin probability is a difference of two CDF values near 1, so each side loses ~1e-16 absolute to
    # cancellation -> rtol 1e-9, atol 1e-14
    p_tanh = ref_bin_prob(x, mean, np.exp(log_scale), phi_tanh)
    np.testing.assert_allclose(np.exp(ll), np.maximum(p_tanh, 1e-12), rtol=1e-9, atol=1e-14)
    assert np.all(ll >= math.log(1e-12) - 1e-9)


def test_discretized_log_likelihood_edges_and_normalisation():
    # Edge bins: at x = -1 log P(X < -1 + 1/255); at x = 1 log P(X > 1 - 1/255).
    # Over all 256 bins the (tanh) probabilities telescope to exactly 1: tolerance 256 x 1e-12 (the floor of
    # far-away bins) + 1e-12.
    rng = np.random.default_rng(43)
    grid = 2.0 * np.arange(256) / 255.0 - 1.0
    for m0, s0 in ((-0.97, 0.05), (0.95, 0.03), (0.0, 0.5), (0.4, 0.2)):
        m = m0 + 0.01 * rng.standard_normal()
        ls = math.log(s0) + 0.1 * rng.standard_normal()
        s = math.exp(ls)
        ll = discretized_gaussian_log_likelihood(t64(grid), t64(np.full(256, m)), t64(np.full(256, ls))).numpy()
        # (probability scale, with the implementation's 1e-12 floor; rtol 1e-10, atol 1e-15)
        p_lo = max(float(phi_tanh((-1 + 1 / 255 - m) / s)), 1e-12)
        p_hi = max(float(1 - phi_tanh((1 - 1 / 255 - m) / s)), 1e-12)
        np.testing.assert_allclose(np.exp(ll[[0, -1]]), [p_lo, p_hi], rtol=1e-10, atol=1e-15)
        # vs the exact CDF on the tails (atol 1.8e-4 on each probability)
        assert abs(math.exp(ll[0]) - phi_exact((-1 + 1 / 255 - m) / s)) < 1.8e-4
        assert abs(math.exp(ll[-1]) - (1 - phi_exact((1 - 1 / 255 - m) / s))) < 1.8e-4
        assert abs(np.exp(ll).sum() - 1.0) < 1e-12 * 256 + 1e-12
    # data just inside the edges (|x| < 0.999) uses the interior two-sided bin, not the tail
    x = np.array([-0.998, 0.998])
    ll = discretized_gaussian_log_likelihood(t64(x), t64(np.array([-0.99, 0.99])), t64(np.full(2, math.log(0.1)))).numpy()
    ref = np.log(phi_tanh((x + 1 / 255 - [-0.99, 0.99]) / 0.1) - phi_tanh((x - 1 / 255 - [-0.99, 0.99]) / 0.1))
    np.testing.assert_allclose(ll, ref, rtol=1e-10)


# ----------------------------------------------------------------------------------------------------------
# p(x_{t-1} | x_t): learned range and fixed large variance
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [50, 51])
def test_learned_range_variance(seed):
    rng = np.random.default_rng(seed)
    T = 1000
    d = GaussianDiffusion(linear_betas(T), learn_sigma=True)
    betas = ref_betas(T)
    abar = ref_abar(betas)
    abar_prev = np.concatenate([[1.0], abar[:-1]])
    post = betas * (1 - abar_prev) / (1 - abar)
    B, C = 6, 3
    t = rng.integers(0, T, size=B)
    t[0], t[1] = 0, T - 1
    xt = rng.standard_normal((B, C, 4, 4))
    eps = rng.standard_normal((B, C, 4, 4))
    tt = torch.as_tensor(t)
    # tolerance: rtol 1e-12 (float64)
    for v, expect in ((1.0, np.log(betas[t])), (-1.0, np.log(np.where(t == 0, post[1], post[t])))):
        out = d.p_mean_variance(t64(np.concatenate([eps, np.full_like(eps, v)], 1)), t64(xt), tt)
        np.testing.assert_allclose(out.log_variance.numpy(), np.broadcast_to(expect[:, None, None, None], xt.shape), rtol=1e-12)
        np.testing.assert_allclose(out.variance.numpy(), np.exp(out.log_variance.numpy()), rtol=1e-12)
    # t = 0 with v = -1 is log beta~_1 (the clipped value)
    out0 = d.p_mean_variance(t64(np.concatenate([eps, -np.ones_like(eps)], 1)), t64(xt), tt)
    np.testing.assert_allclose(out0.log_variance[0].numpy(), math.log(post[1]), rtol=1e-12)
    # random v in [-1, 1]: log-linear interpolation
    v = rng.uniform(-1, 1, size=(B, C, 4, 4))
    out = d.p_mean_variance(t64(np.concatenate([eps, v], 1)), t64(xt), tt)
    np.testing.assert_allclose(out.log_variance.numpy(), ref_learned_logvar(betas, t, v), rtol=1e-12)
    # mean, pred_xstart, eps against the Bayes posterior at pred_x0 (rtol 1e-10)
    mean_ref, x0_ref = ref_model_mean(betas, xt, t, eps)
    np.testing.assert_allclose(out.pred_xstart.numpy(), x0_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out.mean.numpy(), mean_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(out.eps.numpy(), eps, rtol=0, atol=0)


def test_fixed_large_variance():
    # learn_sigma=False: variance beta_t, with beta~_1 at t = 0 (guided-diffusion FIXED_LARGE); rtol 1e-12
    rng = np.random.default_rng(52)
    d = GaussianDiffusion(linear_betas(1000), learn_sigma=False)
    betas = ref_betas(1000)
    abar = ref_abar(betas)
    t = np.array([0, 1, 17, 500, 999])
    xt = rng.standard_normal((5, 2, 3, 3))
    eps = rng.standard_normal((5, 2, 3, 3))
    out = d.p_mean_variance(t64(eps), t64(xt), torch.as_tensor(t))
    bt1 = betas[1] * (1 - abar[0]) / (1 - abar[1])
    expect = np.where(t == 0, bt1, betas[t])
    np.testing.assert_allclose(out.variance.numpy(), np.broadcast_to(expect[:, None, None, None], xt.shape), rtol=1e-12)
    np.testing.assert_allclose(out.log_variance.numpy(), np.log(out.variance.numpy()), rtol=1e-12)
    np.testing.assert_allclose(out.mean.numpy(), ref_model_mean(betas, xt, t, eps)[0], rtol=1e-10, atol=1e-10)


def test_clip_denoised_and_channel_check():
    rng = np.random.default_rng(53)
    d = GaussianDiffusion(linear_betas(1000), learn_sigma=True)
    betas = ref_betas(1000)
    t = np.array([900, 400, 3])
    xt = 3 * rng.standard_normal((3, 2, 4, 4))
    eps = rng.standard_normal((3, 2, 4, 4))
    v = rng.uniform(-1, 1, size=(3, 2, 4, 4))
    out = d.p_mean_variance(t64(np.concatenate([eps, v], 1)), t64(xt), torch.as_tensor(t), clip_denoised=True)
    _, x0_hat = ref_model_mean(betas, xt, t, eps)
    assert np.abs(x0_hat).max() > 1  # the clamp matters for this input
    x0_c = np.clip(x0_hat, -1, 1)
    np.testing.assert_allclose(out.pred_xstart.numpy(), x0_c, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out.mean.numpy(), ref_posterior(betas, x0_c, xt, t)[0], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError):
        d.p_mean_variance(t64(eps), t64(xt), torch.as_tensor(t))  # C channels, learned sigma needs 2C


# ----------------------------------------------------------------------------------------------------------
# Variational bound and the training loss
# ----------------------------------------------------------------------------------------------------------
def ref_vb_bpd(betas, x0, xt, t, eps, v):
    """L_{t-1} in bits/dim: KL(q posterior || p) by hand for t > 0, decoder NLL (ADM tanh CDF) for t = 0."""
    mean_p, _ = ref_model_mean(betas, xt, t, eps)
    logvar_p = ref_learned_logvar(betas, t, v)
    out = np.empty(len(t))
    for i in range(len(t)):
        if t[i] > 0:
            mq, vq = ref_posterior(betas, x0[i : i + 1], xt[i : i + 1], t[i : i + 1])
            kl = ref_kl(mq[0], vq[0], mean_p[i], np.exp(logvar_p[i]))
            out[i] = kl.mean() / LN2
        else:
            p = ref_bin_prob(x0[i], mean_p[i], np.exp(0.5 * logvar_p[i]), phi_tanh)
            out[i] = -np.log(np.maximum(p, 1e-12)).mean() / LN2
    return out


@pytest.mark.parametrize("seed", [60, 61, 62])
def test_vb_terms_bpd(seed):
    # tolerance: rtol 1e-9 (float64; KL of two nearby Gaussians loses a few digits to cancellation)
    rng = np.random.default_rng(seed)
    T = 1000
    d = GaussianDiffusion(linear_betas(T), learn_sigma=True)
    betas = ref_betas(T)
    B, C = 8, 3
    t = rng.integers(0, T, size=B)
    t[0], t[1], t[2] = 0, 1, T - 1
    x0 = 2.0 * rng.integers(0, 256, size=(B, C, 4, 4)) / 255.0 - 1.0
    noise = rng.standard_normal((B, C, 4, 4))
    xt = d.q_sample(t64(x0), torch.as_tensor(t), t64(noise)).numpy()
    eps = noise + 0.3 * rng.standard_normal((B, C, 4, 4))  # an imperfect eps prediction
    v = rng.uniform(-1, 1, size=(B, C, 4, 4))
    vb = d.vb_terms_bpd(t64(np.concatenate([eps, v], 1)), t64(x0), t64(xt), torch.as_tensor(t))
    assert vb.shape == (B,) and vb.dtype == torch.float64
    np.testing.assert_allclose(vb.numpy(), ref_vb_bpd(betas, x0, xt, t, eps, v), rtol=1e-9, atol=1e-12)
    assert np.all(vb.numpy()[t > 0] >= 0)


def test_vb_terms_perfect_model_is_zero():
    # With the true eps and the true posterior variance (v = -1, t > 0) the KL term vanishes (atol 1e-10).
    rng = np.random.default_rng(63)
    d = GaussianDiffusion(linear_betas(1000), learn_sigma=True)
    t = torch.as_tensor(rng.integers(1, 1000, size=5))
    x0 = t64(rng.uniform(-1, 1, size=(5, 2, 3, 3)))
    noise = t64(rng.standard_normal((5, 2, 3, 3)))
    xt = d.q_sample(x0, t, noise)
    vb = d.vb_terms_bpd(torch.cat([noise, -torch.ones_like(noise)], 1), x0, xt, t)
    np.testing.assert_allclose(vb.numpy(), 0.0, atol=1e-10)


class LeafModel:
    """model_fn returning a fixed leaf tensor (so gradients can be read per output channel); records calls."""

    def __init__(self, out: torch.Tensor):
        self.out = out
        self.calls = []

    def __call__(self, x, t):
        self.calls.append((x.detach().clone(), t.clone()))
        return self.out


@pytest.mark.parametrize("seed", [70, 71])
def test_training_losses_values(seed):
    # tolerance: rtol 1e-9 for vb (as above), 1e-12 for mse
    rng = np.random.default_rng(seed)
    T = 1000
    d = GaussianDiffusion(linear_betas(T), learn_sigma=True)
    betas = ref_betas(T)
    B, C = 6, 2
    t = rng.integers(0, T, size=B)
    t[0] = 0
    x0 = 2.0 * rng.integers(0, 256, size=(B, C, 4, 4)) / 255.0 - 1.0
    noise = rng.standard_normal((B, C, 4, 4))
    eps = noise + 0.5 * rng.standard_normal((B, C, 4, 4))
    v = rng.uniform(-1, 1, size=(B, C, 4, 4))
    model = LeafModel(t64(np.concatenate([eps, v], 1)))
    terms = d.training_losses(model, t64(x0), torch.as_tensor(t), t64(noise))
    assert set(terms) == {"loss", "mse", "vb"}
    abar = ref_abar(betas)
    xt_ref = np.sqrt(abar[t])[:, None, None, None] * x0 + np.sqrt(1 - abar[t])[:, None, None, None] * noise
    np.testing.assert_allclose(model.calls[0][0].numpy(), xt_ref, rtol=1e-12, atol=1e-13)
    assert torch.equal(model.calls[0][1], torch.as_tensor(t))
    mse_ref = ((noise - eps) ** 2).reshape(B, -1).mean(1)
    np.testing.assert_allclose(terms["mse"].numpy(), mse_ref, rtol=1e-12)
    np.testing.assert_allclose(terms["vb"].numpy(), ref_vb_bpd(betas, x0, xt_ref, t, eps, v), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(terms["loss"].numpy(), mse_ref + terms["vb"].numpy(), rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_training_losses_gradient_routing(dtype):
    # vb must not push gradient into the eps channels (they are detached); mse must not touch the variance
    # channels. d mse_b / d eps = -2 (noise - eps) / D with D = C*H*W (rtol 1e-5 in float32, 1e-12 in float64).
    g = torch.Generator().manual_seed(72)
    d = GaussianDiffusion(linear_betas(1000), learn_sigma=True)
    B, C, H, W = 4, 3, 4, 4
    t = torch.tensor([0, 10, 500, 999])
    x0 = torch.rand(B, C, H, W, generator=g, dtype=torch.float64).mul(2).sub(1).to(dtype)
    noise = torch.randn(B, C, H, W, generator=g, dtype=torch.float64).to(dtype)
    out = torch.cat(
        [torch.randn(B, C, H, W, generator=g, dtype=torch.float64), torch.rand(B, C, H, W, generator=g, dtype=torch.float64) * 2 - 1], 1
    ).to(dtype).requires_grad_(True)

    terms = d.training_losses(LeafModel(out), x0, t, noise)
    (g_vb,) = torch.autograd.grad(terms["vb"].sum(), out)
    assert torch.all(g_vb[:, :C] == 0)
    assert torch.all(g_vb[:, C:].abs().sum(dim=(1, 2, 3)) > 0)

    terms = d.training_losses(LeafModel(out), x0, t, noise)
    (g_mse,) = torch.autograd.grad(terms["mse"].sum(), out)
    assert torch.all(g_mse[:, C:] == 0)
    expect = -2.0 * (noise.double() - out[:, :C].detach().double()) / (C * H * W)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    np.testing.assert_allclose(g_mse[:, :C].double().numpy(), expect.numpy(), rtol=tol, atol=tol * 1e-2)

    # the total loss gradient is the sum of both
    terms = d.training_losses(LeafModel(out), x0, t, noise)
    (g_all,) = torch.autograd.grad(terms["loss"].sum(), out)
    np.testing.assert_allclose(g_all.double().numpy(), (g_vb + g_mse).double().numpy(), rtol=1e-10, atol=1e-12)


def test_training_losses_gradient_routing_linear_model():
    # Same property through a real module: a 1x1 conv whose first C output rows give eps and last C give v.
    # Gradient of vb w.r.t. the eps rows of the weight is exactly zero; gradient of mse w.r.t. the v rows too.
    torch.manual_seed(73)
    d = GaussianDiffusion(linear_betas(1000), learn_sigma=True)
    C = 2
    conv = torch.nn.Conv2d(C, 2 * C, 1).double()
    with torch.no_grad():
        conv.weight.mul_(0.5)
    model_fn = lambda x, t: torch.tanh(conv(x))  # noqa: E731  (v must stay in [-1, 1])
    g = torch.Generator().manual_seed(74)
    x0 = torch.rand(3, C, 4, 4, generator=g, dtype=torch.float64) * 2 - 1
    noise = torch.randn(3, C, 4, 4, generator=g, dtype=torch.float64)
    t = torch.tensor([0, 300, 900])
    terms = d.training_losses(model_fn, x0, t, noise)
    gw_vb, gb_vb = torch.autograd.grad(terms["vb"].mean(), [conv.weight, conv.bias])
    assert torch.all(gw_vb[:C] == 0) and torch.all(gb_vb[:C] == 0)
    assert gw_vb[C:].abs().sum() > 0
    terms = d.training_losses(model_fn, x0, t, noise)
    gw_mse, gb_mse = torch.autograd.grad(terms["mse"].mean(), [conv.weight, conv.bias])
    assert torch.all(gw_mse[C:] == 0) and torch.all(gb_mse[C:] == 0)
    assert gw_mse[:C].abs().sum() > 0


def test_training_losses_fixed_sigma():
    rng = np.random.default_rng(75)
    d = GaussianDiffusion(linear_betas(1000), learn_sigma=False)
    noise = rng.standard_normal((3, 2, 4, 4))
    eps = rng.standard_normal((3, 2, 4, 4))
    x0 = rng.uniform(-1, 1, size=(3, 2, 4, 4))
    terms = d.training_losses(LeafModel(t64(eps)), t64(x0), torch.tensor([0, 5, 999]), t64(noise))
    assert set(terms) == {"loss", "mse"}
    np.testing.assert_allclose(terms["mse"].numpy(), ((noise - eps) ** 2).reshape(3, -1).mean(1), rtol=1e-12)
    assert torch.equal(terms["loss"], terms["mse"])


def test_training_losses_respaced_model_timesteps():
    # A respaced process calls the model with original timesteps timestep_map[t], and its x_t equals the
    # original process's x_t at that timestep (same abar). tolerance 1e-12.
    rng = np.random.default_rng(76)
    d = create_diffusion("50", learn_sigma=True)
    full = create_diffusion(None, learn_sigma=True)
    keep = [round(999 / 49 * j) for j in range(50)]  # "50": stride 999/49, no ties
    t = rng.integers(0, 50, size=6)
    t[0], t[1] = 0, 49
    x0 = t64(rng.uniform(-1, 1, size=(6, 2, 3, 3)))
    noise = t64(rng.standard_normal((6, 2, 3, 3)))
    out = t64(np.concatenate([rng.standard_normal((6, 2, 3, 3)), rng.uniform(-1, 1, (6, 2, 3, 3))], 1))
    model = LeafModel(out)
    d.training_losses(model, x0, torch.as_tensor(t), noise)
    x_seen, t_seen = model.calls[0]
    assert t_seen.dtype == torch.int64
    assert t_seen.tolist() == [keep[i] for i in t]
    np.testing.assert_allclose(x_seen.numpy(), full.q_sample(x0, t_seen, noise).numpy(), rtol=1e-12, atol=1e-13)
    assert torch.equal(d.model_timesteps(torch.as_tensor(t)), torch.as_tensor([keep[i] for i in t]))


# ----------------------------------------------------------------------------------------------------------
# Respacing
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,n", [("10", 10), ("25", 25), ("50", 50), ("100", 100), ("250", 250), ("1000", 1000)])
def test_space_timesteps_common(spec, n):
    # The strings DiT uses; must equal guided-diffusion's output exactly.
    steps = space_timesteps(1000, spec)
    assert len(steps) == n
    assert steps[0] == 0 and steps[-1] == 999
    assert steps == sorted(steps)
    stride = 999 / (n - 1)
    assert all(abs(s - stride * j) <= 0.5 + 1e-9 for j, s in enumerate(steps))
    assert space_timesteps(1000, int(spec)) == steps


def test_space_timesteps_by_hand():
    # "10": stride 999/9 = 111 exactly.
    assert space_timesteps(1000, "10") == [111 * i for i in range(10)]
    assert space_timesteps(1000, "1") == [0]
    assert space_timesteps(1000, "2") == [0, 999]
    # "4" on 10 steps: stride 3 -> 0, 3, 6, 9
    assert space_timesteps(10, "4") == [0, 3, 6, 9]
    # 300 steps, sections "10,15,20" (guided-diffusion's docstring example): three sections of 100 steps,
    # each strided with (size - 1) / (count - 1), offsets 0, 100, 200.
    steps = space_timesteps(300, "10,15,20")
    assert len(steps) == 45
    s1 = [round(99 / 9 * j) for j in range(10)]  # 0, 11, ..., 99
    assert s1 == [11 * j for j in range(10)]
    s3 = [0, 5, 10, 16, 21, 26, 31, 36, 42, 47, 52, 57, 63, 68, 73, 78, 83, 89, 94, 99]  # 99 j / 19, rounded
    s2_no_tie = [0, 7, 14, 21, 28, 35, 42, 57, 64, 71, 78, 85, 92, 99]  # 99 j / 14, j != 7 (j = 7 is 49.5)
    assert steps[:10] == s1
    assert steps[25:] == [200 + s for s in s3]
    assert [s for i, s in enumerate(steps[10:25]) if i != 7] == [100 + s for s in s2_no_tie]
    assert steps[10 + 7] == 149  # the tie 100 + 49.5: guided-diffusion's accumulated index rounds down here
    # uneven sections: 10 steps into 3 sections of sizes 4, 3, 3
    assert space_timesteps(10, "2,1,3") == [0, 3, 4, 7, 8, 9]


# Outputs of guided-diffusion's respace.py at exact .5 ties, where its accumulated float index decides the
# rounding (facts read off that implementation): (300, "10,15,20") takes 149, (1000, "21") 499, (1000, "31") 500.
@pytest.mark.parametrize("T,spec,tie", [(300, "10,15,20", 149), (1000, "21", 499), (1000, "31", 500)])
def test_space_timesteps_ties_as_guided_diffusion(T, spec, tie):
    assert tie in space_timesteps(T, spec)


def test_space_timesteps_errors():
    with pytest.raises(ValueError):
        space_timesteps(100, "101")
    with pytest.raises(ValueError):
        space_timesteps(300, "10,101,5")  # the middle section has only 100 steps
    with pytest.raises(ValueError):
        space_timesteps(10, "2,1,4")  # sections 4, 3, 3: the last asks for 4 of 3


@pytest.mark.parametrize("spec,T", [("50", 1000), ("250", 1000), ("10,15,20", 300), ("7", 1000)])
def test_respaced_alphas_cumprod(spec, T):
    # Kept steps keep their abar: tolerance rtol 1e-12.
    d = create_diffusion(spec, learn_sigma=True, diffusion_steps=T)
    keep = space_timesteps(T, spec)
    abar_full = ref_abar(ref_betas(T))
    assert d.num_timesteps == len(keep)
    assert d.timestep_map.tolist() == keep
    np.testing.assert_allclose(d.alphas_cumprod.numpy(), abar_full[keep], rtol=1e-12)
    b = d.betas.numpy()
    assert np.all((b > 0) & (b < 1))
    # beta'_i = 1 - abar_{s_i} / abar_{s_{i-1}}, first one = beta'_0 = 1 - abar_{s_0}
    prev = np.concatenate([[1.0], abar_full[keep][:-1]])
    np.testing.assert_allclose(b, 1 - abar_full[keep] / prev, rtol=1e-10)


@pytest.mark.parametrize("spec", [None, ""])
def test_create_diffusion_unrespaced(spec):
    d = create_diffusion(spec)
    assert d.num_timesteps == 1000 and d.learn_sigma
    assert torch.equal(d.timestep_map, torch.arange(1000))
    np.testing.assert_allclose(d.betas.numpy(), ref_betas(1000), rtol=1e-13)
    d = create_diffusion(spec, learn_sigma=False, diffusion_steps=200)
    assert d.num_timesteps == 200 and not d.learn_sigma
    np.testing.assert_allclose(d.betas.numpy(), ref_betas(200), rtol=1e-13)
