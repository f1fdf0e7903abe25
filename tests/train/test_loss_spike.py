"""Loss-spike rollback (--loss_spike_factor): batches corrupted at chosen data positions make the loss jump; the run
rolls back to the checkpoint before the spike, skips those batches, and finishes exactly as a resume does."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from ditforge import cli
from ditforge.train import trainer
from ditforge.weights import read as weights_io

pytestmark = pytest.mark.usefixtures("one_thread")

# W = 2 steps, checked at every step (--log_every 1 in the tiny settings)
SPIKE = ["--loss_spike_factor", "3", "--loss_spike_window", "2", "--ckpt_every", "2", "--keep_last", "20"]


@pytest.fixture
def corrupt(monkeypatch):
    """``corrupt(positions)``: the rows of those data positions (step + the batches skipped) weigh 1000 in the loss
    (``train_step``'s per-row loss weights), so their loss is 1000 times the others'."""
    real = trainer.make_micro_batches

    def set_bad(positions):
        def micro_batches(run, batch, position):
            micro, rows, samples = real(run, batch, position)
            if position in positions:
                micro = [(x, cond, rnd, torch.full((len(x),), 1000.0)) for x, cond, rnd in micro]
            return micro, rows, samples

        monkeypatch.setattr(trainer, "make_micro_batches", micro_batches)

    return set_bad


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_spike_rolls_back_skips_and_resumes_exactly(tmp_path, tiny_argv, corrupt, caplog):
    """Data position 4 corrupted: the check after step 5 (window: steps 4-5) finds the spike and rolls back to
    step 2's checkpoint (the newest before the window), dropping step 4's; steps 3 on read positions 6 on. The run
    finishes, metrics.jsonl holds each step once with ``rollbacks`` counting, and a resume from a checkpoint
    saved after the rollback gives the uninterrupted run's later records bit for bit."""
    corrupt({4})
    run = tmp_path / "run"
    assert cli.main(tiny_argv(run, "--max_steps", "6", *SPIKE)) == 0
    warned = [r.getMessage() for r in caplog.records if "rolled back" in r.getMessage()]
    assert len(warned) == 1 and len(warned[0].splitlines()) == 1, warned
    assert warned[0].startswith("step 5: mean loss ") and "more than 3 x the median" in warned[0]
    assert "rolled back to step-0000002, skipping the batches of steps 3-5 (rollback 1 in a row, 1 in all)" \
        in warned[0]
    records = _records(run)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert [r["rollbacks"] for r in records] == [0, 0, 1, 1, 1, 1]
    assert max(r["loss"] for r in records) < 10  # the spike's records went with its steps
    assert [p.name for p in weights_io.list_checkpoints(run)] == ["step-0000002", "step-0000004", "step-0000006"]
    meta = weights_io.read_meta(run / "checkpoints" / "step-0000004")
    assert meta["data_offset"] == 3 and meta["loss_spike"]["rollbacks"] == 1

    resumed = tmp_path / "resumed"
    assert cli.main(tiny_argv(resumed, "--max_steps", "6", *SPIKE, "--resume",
                              str(run / "checkpoints" / "step-0000004"))) == 0
    timing = ("samples_per_sec", "data_wait_fraction")
    got = [{k: v for k, v in r.items() if k not in timing} for r in _records(resumed)]
    assert got == [{k: v for k, v in r.items() if k not in timing} for r in records[4:]]


def test_spikes_in_a_row_stop_the_run_in_one_line(tmp_path, tiny_argv, corrupt, capsys):
    """Every batch from position 4 on corrupted, --max_loss_spike_rollbacks 1: one rollback (at step 5, to step 2),
    then the spike again (at step 3): exit 1, one line naming the last checkpoint."""
    corrupt(set(range(4, 100)))
    run = tmp_path / "run"
    assert cli.main(tiny_argv(run, "--max_steps", "8", *SPIKE, "--max_loss_spike_rollbacks", "1")) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("ditforge train: stopped: step 3: mean loss ") and "after 1 rollbacks in a row" in err
    assert "(--max_loss_spike_rollbacks); the last checkpoint is " in err


@pytest.mark.parametrize("flags, expected", [
    (["--loss_spike_factor", "1"], "--loss_spike_factor: expected a number > 1, got 1.0"),
    (["--loss_spike_factor", "2", "--loss_spike_window", "0"], "--loss_spike_window: expected a positive integer"),
    (["--max_loss_spike_rollbacks", "-1"], "--max_loss_spike_rollbacks: expected an integer >= 0"),
])
def test_bad_settings_are_refused(tmp_path, tiny_argv, capsys, flags, expected):
    assert cli.main(tiny_argv(tmp_path / "run", *flags)) == 2
    assert expected in capsys.readouterr().err


def test_a_spike_with_no_checkpoint_before_it_stops_in_one_line(tmp_path, tiny_argv, corrupt, capsys):
    """Data position 2 corrupted, no checkpoint saved yet (--ckpt_every 100): the spike found after step 3 stops
    the run with one line saying what to change."""
    corrupt({2})
    assert cli.main(tiny_argv(tmp_path / "run", "--max_steps", "4", *SPIKE, "--ckpt_every", "100")) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("ditforge train: stopped: step 3: mean loss ") and err.endswith(
        "and no checkpoint was saved before step 2 to roll back to; save more often (--ckpt_every) or keep more "
        "checkpoints (--keep_last)"), err
