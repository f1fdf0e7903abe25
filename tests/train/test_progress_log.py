"""The trainer's progress where nobody watches a terminal (``ditforge train > log`` under nohup, a Slurm job):
without a TTY on stderr tqdm's bar is off and one line per ``--log_every`` steps is logged instead
(``logging.progress_line``), parsed here against the run's ``metrics.jsonl``; in a terminal the bar is drawn and no
such line is logged."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest

from ditforge.train.logging import progress_line, read_metrics

LINE = re.compile(r"step (\d+)/(\d+) \| loss (\d+\.\d{4}) \| (\d+\.\d\d) steps/s \| ETA (\d+):(\d\d):(\d\d)"
                  r"(?: \| peak (\d+\.\d\d) GiB)?$")


def _progress(caplog) -> list[re.Match]:
    return [m for r in caplog.records if r.name == "ditforge.train.trainer" and (m := LINE.match(r.getMessage()))]


def test_progress_line_format():
    """ETA = steps left / rate in H:MM:SS; the peak memory only when given."""
    m = LINE.match(progress_line(100, 1000, 0.123456, 2.0, 12.345))
    assert m.groups() == ("100", "1000", "0.1235", "2.00", "0", "07", "30", "12.35")
    assert LINE.match(progress_line(7, 7, 1.5, 0.25, None)).groups()[-4:] == ("0", "00", "00", None)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [False, True])
def test_log_lines_without_a_terminal(train_run, tmp_path, caplog, monkeypatch, terminal):
    """4 steps, --log_every 2. No terminal (a non-TTY stream as stderr): lines for steps 2 and 4 of 4 with the
    losses of metrics.jsonl, a positive rate and an ETA of 0 at the end, no peak on the CPU, and no bar. A
    terminal: tqdm's bar on it, no such line."""
    stream = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    caplog.set_level(logging.INFO, logger="ditforge")
    run = train_run(tmp_path / "run", "--max_steps", "4", "--log_every", "2", "--batch_size", "2", "--ckpt_every",
                    "1000", "--ema_decay", "0")
    lines = _progress(caplog)
    if terminal:
        assert lines == [] and "train: 100%" in stream.getvalue()
        return
    assert "train:" not in stream.getvalue()
    records = read_metrics(run / "metrics.jsonl")
    assert [(int(m[1]), int(m[2])) for m in lines] == [(2, 4), (4, 4)]
    assert [float(m[3]) for m in lines] == [round(r["loss"], 4) for r in records]
    assert all(float(m[4]) > 0 and m[8] is None for m in lines) and lines[-1].groups()[4:7] == ("0", "00", "00")
