"""A real full disk (a small tmpfs the test mounts) while a run writes a checkpoint, a metrics line or a sample grid:
the run stops with one line (exit 1), leaves no temporary file or folder, and resumes from its last good checkpoint
once there is room again. And PyTorch's zip writer's own error on a full disk, which carries no errno, is known for
what it is.

Mounting needs root and a kernel that allows it; elsewhere the tests that need it skip, saying why.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from ditforge import cli
from ditforge.train import checkpoint as ckpt_io
from ditforge.train.guard import NEARLY_FULL, WriteFailed, disk_errors, free_bytes, space_error
from ditforge.train.logging import read_metrics
from ditforge.weights import read as weights_io

pytestmark = pytest.mark.usefixtures("one_thread")

# A DiT-T/2 checkpoint (model, Adam moments, EMA) takes 65 MiB: room for two.
DISK_SIZE = "160m"


def _mount_tmpfs(where: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")


def _unmount(where: Path) -> None:
    if subprocess.run(["umount", str(where)], capture_output=True).returncode:
        subprocess.run(["umount", "--lazy", str(where)], capture_output=True)  # a file still open: detach it


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs of ``DISK_SIZE`` at ``tmp_path/disk``, unmounted afterwards."""
    where = tmp_path / "disk"
    _mount_tmpfs(where, DISK_SIZE)
    try:
        yield where
    finally:
        _unmount(where)


def _fill(disk: Path, leave: int) -> Path:
    """Take all but about ``leave`` bytes (whole pages) of ``disk``'s free space with a ballast file."""
    ballast = disk / "ballast"
    with open(ballast, "ab") as f:
        f.write(b"\0" * max(0, free_bytes(disk) - leave))
    return ballast


def _fill_after_first_save(monkeypatch, disk: Path, leave: int, before_fill=None) -> None:
    """Once step 1's checkpoint is complete (a background save waited for), fill the disk to ``leave`` bytes."""
    real = ckpt_io.Checkpointer.save

    def save(self, step, state, meta):
        out = real(self, step, state, meta)
        if step == 1:
            self.wait()
            if before_fill is not None:
                before_fill()
            _fill(disk, leave)
        return out

    monkeypatch.setattr(ckpt_io.Checkpointer, "save", save)


def _stopped_with_one_line(capsys, rc: int, what: str, folder: Path, run: Path) -> None:
    """Exit 1 and one line on stderr: ``what`` not written, no space left in ``folder``, and run's step 1."""
    err = capsys.readouterr().err.strip()
    assert rc == 1, err
    assert len(err.splitlines()) == 1, err
    good = run / "checkpoints" / "step-0000001"
    assert re.fullmatch(rf"ditforge train: stopped: {re.escape(what)} not written: no space left on device in "
                        rf"{re.escape(str(folder))} \([^)]*GiB free\); the last good checkpoint is "
                        rf"{re.escape(str(good))}", err), err


def _resumes_from_step_1(tiny_argv, run: Path, ballast: Path, *extra: str) -> None:
    """Nothing half-written is left; step 1 is the newest checkpoint, intact; with the ballast gone the run
    resumes from it and ends."""
    assert [p.name for p in weights_io.list_checkpoints(run)] == ["step-0000001"]
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    assert not [p.name for p in run.rglob(".*.tmp*")]
    assert weights_io.damage(run / "checkpoints" / "step-0000001") is None
    read_metrics(run / "metrics.jsonl")  # whole lines only
    ballast.unlink()
    assert cli.main(tiny_argv(run, "--max_steps", "2", "--resume", "auto", *extra)) == 0
    assert [p.name for p in weights_io.list_checkpoints(run)] == ["step-0000001", "step-0000002"]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_checkpoint_on_a_full_disk(tiny_argv, small_disk, monkeypatch, capsys, async_save):
    """Step 2's checkpoint does not fit (64 KiB left): DCP's CheckpointException around the zip writer's
    RuntimeError (or an ENOSPC) ends in SaveError's one line, in the foreground and in the background."""
    run = small_disk / "run"
    extra = ["--report_to", "none", *(["--async_checkpoint"] if async_save else [])]
    _fill_after_first_save(monkeypatch, small_disk, 64 << 10)
    capsys.readouterr()
    rc = cli.main(tiny_argv(run, "--max_steps", "2", "--ckpt_every", "1", "--keep_last", "5", *extra))
    _stopped_with_one_line(capsys, rc, "checkpoint step-0000002", run / "checkpoints", run)
    _resumes_from_step_1(tiny_argv, run, small_disk / "ballast", *extra)


def test_metrics_line_on_a_full_disk(tiny_argv, small_disk, monkeypatch, capsys):
    """metrics.jsonl's next line needs a page the disk no longer has: one line, and the file keeps whole lines."""
    run = small_disk / "run"

    def metrics_page_full():
        # tmpfs hands out whole pages: fill the last one of metrics.jsonl (blank lines, which readers skip), so
        # step 2's line needs a new page
        path = run / "metrics.jsonl"
        with open(path, "ab") as f:
            f.write(b"\n" * (-path.stat().st_size % os.statvfs(path).f_bsize))

    _fill_after_first_save(monkeypatch, small_disk, 0, metrics_page_full)
    capsys.readouterr()
    rc = cli.main(tiny_argv(run, "--max_steps", "2", "--ckpt_every", "1", "--report_to", "none"))
    _stopped_with_one_line(capsys, rc, "metrics.jsonl", run, run)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]
    _resumes_from_step_1(tiny_argv, run, small_disk / "ballast", "--report_to", "none")


def test_sample_grid_on_a_full_disk(tiny_argv, small_disk, monkeypatch, capsys, fast_grid):
    """Step 2's sample grid does not fit (8 KiB left; its metrics line does): one line, no half-written PNG."""
    run = small_disk / "run"
    _fill_after_first_save(monkeypatch, small_disk, 8 << 10)
    capsys.readouterr()
    rc = cli.main(tiny_argv(run, "--max_steps", "3", "--ckpt_every", "1", "--sample_every", "1",
                                  "--report_to", "none"))
    _stopped_with_one_line(capsys, rc, "sample grid of step 2", run, run)
    assert [p.name for p in (run / "samples").iterdir()] == ["step-0000001.png"]
    _resumes_from_step_1(tiny_argv, run, small_disk / "ballast", "--report_to", "none")


def test_zip_writer_error_on_a_full_disk(tmp_path):
    """torch.save onto a nearly full tmpfs raises the zip writer's RuntimeError, with no errno: ``space_error``
    names it a full disk (and inside DCP's CheckpointException too), and ``disk_errors`` turns it into one line.
    The same message where there is room, or another RuntimeError, is not a full disk."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "256k")
    try:
        _fill(disk, 32 << 10)
        with pytest.raises(RuntimeError, match=r"unexpected pos \d+ vs \d+|file write failed") as raised:
            torch.save(torch.zeros(64 << 10), disk / "x.pt")
        zip_error = raised.value
        assert getattr(zip_error, "errno", None) is None
        assert space_error(zip_error, disk).errno == errno.ENOSPC
        wrapped = CheckpointException("save", {1: (zip_error, [])})
        assert space_error(wrapped, disk).errno == errno.ENOSPC
        with pytest.raises(WriteFailed, match=rf"^checkpoint not written: no space left on device in {disk} \("):
            with disk_errors("checkpoint", disk, go_on=False, last_good=lambda: None):
                raise zip_error
    finally:
        _unmount(disk)
    assert free_bytes(tmp_path) >= NEARLY_FULL, "the test's own folder must have room"
    assert space_error(zip_error, tmp_path) is None
    assert space_error(RuntimeError("shape mismatch"), disk) is None
    with pytest.raises(RuntimeError, match="unexpected pos"):
        with disk_errors("checkpoint", tmp_path, go_on=False, last_good=lambda: None):
            raise zip_error
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    try:
        raise RuntimeError("file write failed") from quota
    except RuntimeError as e:
        assert space_error(CheckpointException("save", {0: e}), tmp_path) is quota
