"""``ditforge train --eval_every``: the built-in digits extractor measures the EMA weights during training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ditforge import cli

REPO = Path(__file__).resolve().parents[2]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.usefixtures("one_thread")
def test_eval_records_land_at_their_steps(tmp_path, tiny_argv):
    """An evaluation between two log steps is a record of its own; one at a log step (and the end) joins it."""
    run = tmp_path / "run"
    assert cli.main(tiny_argv(run, "--max_steps", "4", "--log_every", "2", "--eval_every", "3",
                              "--eval_samples", "20")) == 0
    records = {r["step"]: r for r in _records(run)}
    assert sorted(records) == [2, 3, 4]
    keys = {"digits_fid", "digits_precision", "digits_recall", "digits_accuracy"}
    assert set(records[3]) == {"step"} | keys
    assert keys <= set(records[4]) and "loss" in records[4] and not keys & set(records[2])
    assert records[4]["digits_fid"] > 0 and 0 <= records[4]["digits_accuracy"] <= 1


def test_eval_every_needs_digits(tmp_path, tiny_argv, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    argv = tiny_argv(tmp_path / "run", "--data", str(folder), "--eval_every", "5")
    assert cli.main(argv) == 2
    assert "--eval_every: the built-in extractor measures DiT runs on --data digits" in capsys.readouterr().err


@pytest.mark.slow
def test_undertrained_run_has_a_clearly_worse_fid(tmp_path):
    """25 steps of the default recipe (batch 64, lr 1e-3) against the default 1,000-step run, both evaluated
    with DDIM 25 at guidance 4: the default run's figures are the ones benchmarks/digits_quality.py measured and
    recorded with 1,000 EMA samples (2026-11-24: digits-FID 174, accuracy 99.3%); here 150 (FID's upward bias at
    fewer samples is small against the margin: 100 steps measured 852 at 1,000 samples, 882 at 500; the 64-d
    features keep the 150-sample covariance full rank). 25 steps at 150 samples measured digits-FID 1,039 and
    accuracy 11.3% (2026-11-28). All of its worker's threads (under pytest-xdist another worker shares the
    cores)."""
    default = json.loads((REPO / "benchmarks/results/digits_quality.json").read_text())["eval_at_end"]
    run = tmp_path / "run"
    assert cli.main(["train", "--outputs", str(run), "--max_steps", "25", "--eval_every", "25", "--eval_samples", "150",
                     "--sample_every", "0", "--device", "cpu", "--num_workers", "0"]) == 0
    short = _records(run)[-1]
    assert short["step"] == 25
    assert short["digits_fid"] > 3 * default["digits_fid"], (short, default)
    assert short["digits_accuracy"] < default["digits_accuracy"] - 0.3, (short, default)
