"""The loss-curve verdict of ``benchmarks/quality_curves.py`` against closed forms on synthetic curves of i.i.d.
Gaussian per-step losses (the case its standard errors assume)."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from quality_curves import report  # noqa: E402


@pytest.mark.parametrize("offset_in_se", [0.5, 5.0])
def test_report_noise_and_shift(tmp_path, offset_in_se, capsys):
    w, sd = 4000, 0.01
    rng = np.random.default_rng(int(offset_in_se * 10))
    ref = 0.1 + sd * rng.standard_normal(w)
    seed = 0.1 + 2 * sd * rng.standard_normal(w)
    se = math.sqrt((sd**2 + (2 * sd) ** 2) / w)  # closed form of the independent runs' standard error
    jitter = 1e-4 * rng.standard_normal(w)  # a paired mode: the reference's steps, shifted, plus rounding noise
    curves = {"ref": ref.tolist(), "ref_seed1": seed.tolist(), "mode": (ref + offset_in_se * se + jitter).tolist()}
    out = tmp_path / "v.json"
    verdict = report(curves, "ref", "ref_seed1", w, "t", str(out), None)
    stored = json.loads(out.read_text())
    assert stored["noise"] == pytest.approx(se, rel=0.05)  # sample variances of 4,000 draws: ~2% error
    mode = verdict["mode"]
    assert mode["within_noise"] is (offset_in_se < 2)
    assert mode["diff_vs_reference"] == pytest.approx(offset_in_se * se, abs=5e-6)
    assert mode["shift"] == pytest.approx(offset_in_se * se, abs=5 * 1e-4 / math.sqrt(w))
    assert mode["shift_se"] == pytest.approx(1e-4 / math.sqrt(w), rel=0.05)
    assert "shift" not in verdict["ref_seed1"]
    assert stored["seed_diff"] == pytest.approx(np.mean(seed) - np.mean(ref))
    assert "within noise: " in capsys.readouterr().out
