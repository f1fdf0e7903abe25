"""FID, IS and precision / recall against independent float64 references on fresh random features: closed forms,
a numpy transcription (here) of the formulas of guided-diffusion's ADM evaluator (evaluations/evaluator.py), and
torch-fidelity's own functions where it is installed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import linalg

from ditforge.eval.fid import feature_statistics, frechet_distance, inception_score, precision_recall


@pytest.fixture
def rng():
    return np.random.default_rng()  # fresh features every run


def _random_spd(rng, d):
    a = rng.normal(size=(d, d))
    return a @ a.T / d + 0.1 * np.eye(d)


def _fid_closed_form(mu1, s1, mu2, s2):
    # Tr((S1 S2)^(1/2)) = Tr((S1^(1/2) S2 S1^(1/2))^(1/2)), both roots of symmetric matrices by eigh.
    w, v = np.linalg.eigh(s1)
    root1 = (v * np.sqrt(w)) @ v.T
    inner = np.linalg.eigvalsh(root1 @ s2 @ root1)
    return (mu1 - mu2) @ (mu1 - mu2) + np.trace(s1) + np.trace(s2) - 2 * np.sqrt(np.clip(inner, 0, None)).sum()


def _adm_fid(f1, f2):
    # ADM: compute_statistics, then FIDStatistics.frechet_distance (no singular product here)
    mu1, s1 = np.mean(f1, axis=0), np.cov(f1, rowvar=False)
    mu2, s2 = np.mean(f2, axis=0), np.cov(f2, rowvar=False)
    covmean = linalg.sqrtm(s1.dot(s2)).real
    return (mu1 - mu2).dot(mu1 - mu2) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean)


def test_fid_of_a_set_with_itself_is_zero(rng):
    f = rng.normal(size=(500, 32)) * rng.uniform(0.5, 2, 32) + rng.normal(size=32)
    mu, sigma = feature_statistics(f)
    assert abs(frechet_distance(mu, sigma, mu, sigma)) < 1e-9 * np.trace(sigma)


def test_fid_of_two_gaussians_matches_the_closed_form(rng):
    d = 24
    mu1, mu2, s1, s2 = rng.normal(size=d), rng.normal(size=d), _random_spd(rng, d), _random_spd(rng, d)
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(_fid_closed_form(mu1, s1, mu2, s2), rel=1e-9)
    # Diagonal covariances: |mu1 - mu2|^2 + sum (sqrt(a) - sqrt(b))^2.
    a, b = rng.uniform(0.1, 3, d), rng.uniform(0.1, 3, d)
    expected = (mu1 - mu2) @ (mu1 - mu2) + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum()
    assert frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-9)


def test_fid_of_features_drawn_from_two_gaussians(rng):
    # Statistics of 40,000 draws: the closed form of the true parameters up to sampling error (~1%).
    d, n = 8, 40_000
    mu1, mu2, s1, s2 = rng.normal(size=d), rng.normal(size=d), _random_spd(rng, d), _random_spd(rng, d)
    f1 = rng.multivariate_normal(mu1, s1, size=n)
    f2 = rng.multivariate_normal(mu2, s2, size=n)
    fid = frechet_distance(*feature_statistics(f1), *feature_statistics(f2))
    assert fid == pytest.approx(_fid_closed_form(mu1, s1, mu2, s2), rel=0.05)
    assert fid == pytest.approx(_adm_fid(f1, f2), rel=1e-9)


def test_fid_matches_torch_fidelity(rng):
    metric_fid = pytest.importorskip("torch_fidelity.metric_fid")
    f1, f2 = rng.normal(size=(300, 16)), rng.normal(size=(200, 16)) * 1.3 + 0.2
    theirs = metric_fid.fid_statistics_to_metric(metric_fid.fid_features_to_statistics(torch.from_numpy(f1)),
                                                 metric_fid.fid_features_to_statistics(torch.from_numpy(f2)), False)
    ours = frechet_distance(*feature_statistics(f1), *feature_statistics(f2))
    assert ours == pytest.approx(theirs[metric_fid.KEY_METRIC_FID], rel=1e-6)


def _adm_inception_score(logits, split_size):
    # ADM: softmax of the logits, then per split exp(mean KL(p(y|x) || p(y))), mean over splits
    preds = np.exp(logits - logits.max(axis=1, keepdims=True))
    preds /= preds.sum(axis=1, keepdims=True)
    scores = []
    for i in range(0, len(preds), split_size):
        part = preds[i : i + split_size]
        kl = part * (np.log(part) - np.log(np.expand_dims(np.mean(part, 0), 0)))
        scores.append(np.exp(np.mean(np.sum(kl, 1))))
    return float(np.mean(scores))


def test_inception_score_matches_adm(rng):
    logits = rng.normal(size=(1100, 50)) * 3
    for split in (5000, 250):  # one split; several with a shorter last one
        assert inception_score(logits, split) == pytest.approx(_adm_inception_score(logits, split), rel=1e-6)


def test_inception_score_matches_torch_fidelity(rng):
    metric_isc = pytest.importorskip("torch_fidelity.metric_isc")
    logits = rng.normal(size=(1000, 40)) * 2
    theirs = metric_isc.isc_features_to_metric(torch.from_numpy(logits), splits=4, shuffle=False)
    assert inception_score(logits, 250) == pytest.approx(theirs[metric_isc.KEY_METRIC_ISC_MEAN], rel=1e-6)


def _adm_precision_recall(ref, samples, k=3):
    # ADM: squared distances, radius = k-th neighbour (np.partition; index 0 is the point itself), then
    # precision = mean over samples of any(d(ref_i, s) <= r_ref_i), recall the other way round
    def dist(a, b):
        return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)

    r_ref = np.partition(dist(ref, ref), k, axis=1)[:, k]
    r_smp = np.partition(dist(samples, samples), k, axis=1)[:, k]
    d = dist(ref, samples)
    return (d <= r_ref[:, None]).any(axis=0).mean(), (d <= r_smp[None, :]).any(axis=1).mean()


def test_precision_recall_match_adm(rng):
    ref = rng.normal(size=(300, 12))
    samples = rng.normal(size=(260, 12)) * 0.9 + 0.4
    expected = _adm_precision_recall(ref, samples)
    assert 0.02 < expected[0] < 0.98 and 0.02 < expected[1] < 0.98  # neither trivially 0 nor 1
    for batch_size in (4096, 64):  # one block; several blocks
        assert precision_recall(ref, samples, batch_size=batch_size) == pytest.approx(expected, abs=1e-6)


def test_precision_recall_match_torch_fidelity(rng):
    metric_prc = pytest.importorskip("torch_fidelity.metric_prc")
    ref, samples = rng.normal(size=(200, 10)), rng.normal(size=(180, 10)) + 0.4
    theirs = metric_prc.calculate_precision_recall_full(torch.from_numpy(samples), torch.from_numpy(ref), 3)
    assert precision_recall(ref, samples) == pytest.approx(theirs, abs=1e-6)
