"""The loss-curve verdict and mode runner of ``benchmarks/quality_curves.py``.

Standard errors against the closed form for AR(1) steps (x_t = rho x_{t-1} + e_t, stationary sd s): the variance of
the mean of n steps is s^2 / n * (1 + 2 sum_{k<n} (1 - k/n) rho^k). At rho = 0.5 that is ~3x the naive s^2 / n,
which a per-step standard error would miss; batch means of 25 steps recover it up to their edge terms (-5%).
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest


def _script(name: str):
    """``benchmarks/<name>.py`` imported by its path. benchmarks/ goes last on ``sys.path`` (for its sibling
    ``timing``), never first: every pytest-xdist worker collects this file, and a script's name there would shadow an
    installed package for the rest of the run (benchmarks/kernels.py, since renamed, did shadow ``kernels``, which
    transformers >= 5 imports)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


quality_curves = _script("quality_curves")
report, run_modes = quality_curves.report, quality_curves.run_modes

N, RHO = 500, 0.5


def ar1(rng: np.random.Generator, sd: float, n: int = N) -> np.ndarray:
    e = rng.standard_normal(n) * sd * math.sqrt(1 - RHO**2)
    x = np.empty(n)
    x[0] = rng.standard_normal() * sd
    for t in range(1, n):
        x[t] = RHO * x[t - 1] + e[t]
    return x


def var_of_mean(sd: float, n: int = N) -> float:
    k = np.arange(1, n)
    return sd**2 / n * (1 + 2 * np.sum((1 - k / n) * RHO**k))


def test_standard_errors_follow_correlated_steps(tmp_path, capsys):
    """Over 200 synthetic experiments: the mean squared ``noise`` and ``shift_se`` against the closed forms (within
    12%: the batch means' -5% edge bias and ~2% Monte Carlo error), far above the naive per-step value."""
    rng = np.random.default_rng(0)
    noise2, shift2 = [], []
    out = tmp_path / "v.json"
    for _ in range(200):
        ref, seed, jitter = 0.1 + ar1(rng, 0.01), 0.1 + ar1(rng, 0.02), ar1(rng, 1e-4)
        curves = {"ref": ref.tolist(), "ref_seed1": seed.tolist(), "mode": (ref + 0.001 + jitter).tolist()}
        verdict = report(curves, "ref", "ref_seed1", N, "t", str(out), None)
        noise2.append(json.loads(out.read_text())["noise"] ** 2)
        shift2.append(verdict["mode"]["shift_se"] ** 2)
    capsys.readouterr()
    assert np.mean(noise2) == pytest.approx(var_of_mean(0.01) + var_of_mean(0.02), rel=0.12)
    assert np.mean(shift2) == pytest.approx(var_of_mean(1e-4), rel=0.12)
    assert np.mean(noise2) > 2.5 * (0.01**2 + 0.02**2) / N  # the naive per-step estimate is 3x too small


@pytest.mark.parametrize("offset_in_se", [0.5, 5.0])
def test_within_noise_is_two_standard_errors(tmp_path, offset_in_se, capsys):
    """Only the last ``window`` steps count (earlier steps, far off, are ignored); the verdict is |diff| <= 2 noise;
    the paired shift recovers the offset; the seed gets no shift; the JSON holds the seed's own difference."""
    w = 4000
    rng = np.random.default_rng(int(offset_in_se * 10))
    ref, seed = 0.1 + ar1(rng, 0.01, w), 0.1 + ar1(rng, 0.02, w)
    se = math.sqrt(var_of_mean(0.01, w) + var_of_mean(0.02, w))
    mode = ref + offset_in_se * se + ar1(rng, 1e-5, w)
    early = [5.0] * 300  # a first part that the window must leave out
    curves = {"ref": early + ref.tolist(), "ref_seed1": early + seed.tolist(), "mode": [0.0] * 300 + mode.tolist()}
    out = tmp_path / "v.json"
    verdict = report(curves, "ref", "ref_seed1", w, "t", str(out), None)
    stored = json.loads(out.read_text())
    assert stored["noise"] == pytest.approx(se, rel=0.4)  # one estimate from 20 batch means: ~16% sd
    assert verdict["mode"]["within_noise"] is (abs(verdict["mode"]["diff_vs_reference"]) <= 2 * stored["noise"])
    assert verdict["mode"]["within_noise"] is (offset_in_se < 2)
    assert verdict["mode"]["shift"] == pytest.approx(offset_in_se * se, rel=0.01)
    assert "shift" not in verdict["ref_seed1"]
    assert stored["seed_diff"] == pytest.approx(np.mean(seed) - np.mean(ref))
    assert "within noise: " in capsys.readouterr().out


def test_run_modes_skips_finished_runs_and_names_every_failure(tmp_path, monkeypatch, capsys):
    """Finished modes are not trained again; with --jobs 3 every failing mode is reported, not only the first."""
    trained = []

    def fake_train(*argv):
        out = Path(argv[argv.index("--outputs") + 1])
        trained.append(out.name)
        if out.name.startswith("bad"):
            raise RuntimeError(f"{out.name} broke")
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps({"loss": 0.5}) + "\n" for _ in range(4)))

    monkeypatch.setattr(quality_curves, "train", fake_train)
    monkeypatch.setattr(quality_curves, "finished", lambda run, steps: (run / "metrics.jsonl").exists())
    modes = {"a": [], "b": [], "bad1": [], "bad2": []}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text(json.dumps({"loss": 0.25}) + "\n")
    with pytest.raises(RuntimeError, match="modes failed: bad1, bad2|modes failed: bad2, bad1"):
        run_modes(modes, set(modes), tmp_path, 2, 4, jobs=3)
    assert sorted(trained) == ["b", "bad1", "bad2"]
    err = capsys.readouterr().err
    assert "mode bad1: bad1 broke" in err and "mode bad2: bad2 broke" in err
    assert run_modes({"a": [], "b": []}, {"a", "b"}, tmp_path, 2, 4) == {"a": [0.25], "b": [0.5] * 4}
