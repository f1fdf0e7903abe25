"""Experiment tracking (``--report_to``, ``ditforge.train.logging.Tracker``): TensorBoard event files read back
with tensorboard's own ``EventAccumulator`` and compared with the run's ``metrics.jsonl`` and grid files; the
choice of trackers; W&B's calls, through a stand-in module (wandb is not a test dependency)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import types

import pytest

from ditforge import cli
from ditforge.errors import UserError
from ditforge.train.logging import Tracker, read_metrics

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _events(run):
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def test_tensorboard_has_the_metrics_and_grids_and_a_resume_replaces_lost_steps(train_run, fast_grid, tmp_path):
    run = train_run(tmp_path / "run", "--max_steps", "3", "--sample_every", "2", "--ckpt_every", "2")
    acc = _events(run)
    assert {"loss", "mse", "vb", "lr", "grad_norm", "samples_per_sec", "epoch"} <= set(acc.Tags()["scalars"])
    images = acc.Images("samples")
    assert [im.step for im in images] == [2, 3]
    for im in images:  # the grid PNG as written, 8x enlarged 8x8 digits, 8 per row
        png = run / "samples" / f"step-{im.step:07d}.png"
        assert im.encoded_image_string == png.read_bytes() and im.width == 8 * (8 * 9 + 1)

    # a crash after step 3 was logged but before its checkpoint: the resumed run logs step 3 again
    shutil.rmtree(run / "checkpoints" / "step-0000003")
    train_run(run, "--resume", "auto", "--max_steps", "4", "--sample_every", "0", "--ckpt_every", "2")
    records, acc = read_metrics(run / "metrics.jsonl"), _events(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for tag in ("loss", "lr", "grad_norm", "samples_per_sec"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [1, 2, 3, 4], tag  # the lost run's step 3 is purged
        for e, r in zip(events, records):
            assert e.value == pytest.approx(r[tag], rel=1e-6), (tag, e.step)  # stored as float32


def test_choice_of_trackers(tmp_path, monkeypatch, caplog):
    Tracker(tmp_path / "a", "none", {}).log(1, {"loss": 1.0})
    assert not (tmp_path / "a").exists()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with caplog.at_level("INFO"):
        Tracker(tmp_path / "b", "auto", {}).log(1, {"loss": 1.0})
    assert not (tmp_path / "b").exists() and "tensorboard is not installed" in caplog.text
    with pytest.raises(UserError, match=r"^--report_to all: tensorboard is not installed"):
        Tracker(tmp_path / "c", "all", {})


def test_report_to_wandb_not_installed_is_a_user_error(tmp_path, tiny_argv, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert cli.main(tiny_argv(tmp_path / "run", "--report_to", "wandb")) == 2
    assert capsys.readouterr().err.strip() == ("ditforge train: error: --report_to wandb: wandb is not installed "
                                               "(pip install wandb), or use --report_to none")


def test_wandb_calls(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.util.spec_from_loader("wandb", loader=None)
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    fake.Image = lambda path: ("Image", path)
    fake.Video = lambda path: ("Video", path)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    grid = tmp_path / "step-0000002.gif"
    tracker = Tracker(tmp_path, "wandb", {"train": {"lr": 1e-3}})
    tracker.log(2, {"loss": 0.5, "lr": 1e-3, "peak_memory_gib": None, "nan": float("nan")})
    tracker.image(2, grid)
    tracker.close()
    assert calls == [("init", dict(project="ditforge", name=tmp_path.name, dir=str(tmp_path),
                                   config={"train": {"lr": 1e-3}})),
                     ("log", {"loss": 0.5, "lr": 1e-3}, 2), ("log", {"samples": ("Video", str(grid))}, 2),
                     ("finish",)]
    assert not (tmp_path / "tensorboard").exists()
