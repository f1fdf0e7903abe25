"""Long runs and their accidents, through the real CLI: damaged checkpoints, divergence, a full disk, two runs on
one folder, a run folder some rank cannot see."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from ditforge import cli
from ditforge.train import checkpoint as ckpt_io
from ditforge.train import step as step_module
from ditforge.weights import read as weights_io

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def main(tiny_argv):
    """``ditforge train`` in this process with the tiny settings; returns the exit code."""
    return lambda outputs, *extra: cli.main(tiny_argv(outputs, *extra))


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory, main):
    """A 6-step run with checkpoints at 2, 4 and 6, and the same run's 8 uninterrupted steps (the reference)."""
    root = tmp_path_factory.mktemp("six")
    with_ckpts, reference = root / "run", root / "reference"
    assert main(with_ckpts, "--max_steps", "6", "--ckpt_every", "2", "--keep_last", "3") == 0
    assert main(reference, "--max_steps", "8", "--ckpt_every", "100") == 0
    return with_ckpts, reference


def test_recorded_checksums_are_the_files(six_steps):
    """meta.json holds each file's size and CRC-32 as computed while writing; they equal the files read back."""
    ckpt = six_steps[0] / "checkpoints" / "step-0000006"
    files = json.loads((ckpt / "meta.json").read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp"]
    for name, want in files.items():
        data = (ckpt / name).read_bytes()
        assert want == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert weights_io.damage(ckpt) is None


@pytest.mark.parametrize("harm", ["truncate", "flip"])
def test_resume_auto_falls_back_past_a_damaged_checkpoint(six_steps, tmp_path, caplog, harm, main):
    """One file of the newest checkpoint truncated, or one byte flipped: --resume auto names it in a warning, moves
    it aside, resumes from step 4, and the losses after it equal the uninterrupted run's."""
    run = tmp_path / "run"
    shutil.copytree(six_steps[0], run)
    newest = run / "checkpoints" / "step-0000006"
    victim = newest / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    if harm == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 3] ^= 0x10
        victim.write_bytes(data)
    assert main(run, "--max_steps", "8", "--resume", "auto", "--ckpt_every", "100") == 0
    why = "has" if harm == "truncate" else "fails its CRC-32 check"
    assert any(f"step-0000006 is damaged: __0_0.distcp {why}" in r.getMessage() for r in caplog.records)
    assert [p.name for p in weights_io.list_checkpoints(run)][-1] == "step-0000008"
    assert len(list((run / "checkpoints").glob("damaged-step-0000006-*"))) == 1
    got, want = _losses(run), _losses(six_steps[1])
    assert sorted(got) == list(range(1, 9))
    for step in (5, 6, 7, 8):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0)


def test_damaged_checkpoint_named_explicitly_is_one_line(six_steps, tmp_path, capsys, tiny_argv):
    """--resume naming a damaged checkpoint, and ditforge sample / export of it: exit 2, one line saying which
    file is damaged (not "does not fit the model")."""
    run = tmp_path / "run"
    shutil.copytree(six_steps[0], run)
    ckpt = run / "checkpoints" / "step-0000006"
    meta = ckpt / ".metadata"
    meta.write_bytes(meta.read_bytes()[:-7])
    capsys.readouterr()
    for argv in (tiny_argv(run, "--max_steps", "8", "--resume", str(ckpt)),
                 ["sample", "--ckpt", str(ckpt), "--out", str(tmp_path / "s.png")],
                 ["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "w.safetensors")]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"{ckpt} is damaged: .metadata has" in err, err


def test_divergence_ends_in_one_line_without_a_bad_checkpoint(tmp_path, tiny_argv, ckpt_weights):
    """--lr 1e6 diverges: one line, exit code 1, no traceback, and every checkpoint it left holds finite values
    only. A subprocess, as a user runs it."""
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run([sys.executable, "-m", "ditforge", *tiny_argv(run, "--lr", "1e6", "--max_steps", "200",
                                                                            "--ckpt_every", "1", "--keep_last", "200",
                                                                            "--max_nonfinite_steps", "3")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("ditforge train: stopped: step ") and "3 steps in a row had a non-finite loss" in last
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["skipped_steps"] for r in records)
    ckpts = weights_io.list_checkpoints(run)
    assert ckpts
    for ckpt in ckpts:
        for use_ema in (True, False):
            assert all(torch.isfinite(v).all() for v in ckpt_weights(ckpt, use_ema).values()), ckpt


def test_nan_gradient_skips_exactly_that_step(tmp_path, monkeypatch, main, ckpt_weights):
    """A NaN injected into one parameter's gradient at step 2 (the 3rd): that step changes nothing (the step-3
    checkpoint's data file is byte for byte the step-2 one: weights, AdamW state, EMA), and the weights at step
    5 equal those of a run that never saw step 2's update (step 2's checkpoint resumed as if it were step 3)."""
    real, calls = step_module.clip_grad_norm_, []

    def poisoned(model, max_norm, d):
        calls.append(1)
        if len(calls) == 3:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[5] = float("nan")
        return real(model, max_norm, d)

    monkeypatch.setattr(step_module, "clip_grad_norm_", poisoned)
    run = tmp_path / "run"
    assert main(run, "--max_steps", "5", "--ckpt_every", "1", "--keep_last", "10") == 0
    monkeypatch.setattr(step_module, "clip_grad_norm_", real)
    files = {s: json.loads((run / "checkpoints" / f"step-{s:07d}" / "meta.json").read_text())["files"]["__0_0.distcp"]
             for s in (2, 3, 4)}
    assert files[2] == files[3] != files[4]
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert records[3]["skipped_steps"] == 1 and records[3]["loss"] is None
    assert [records[s]["skipped_steps"] for s in (1, 2, 4, 5)] == [0, 0, 0, 0]

    reference = tmp_path / "reference"
    (reference / "checkpoints").mkdir(parents=True)
    as_step_3 = reference / "checkpoints" / "step-0000003"
    shutil.copytree(run / "checkpoints" / "step-0000002", as_step_3)
    meta = json.loads((as_step_3 / "meta.json").read_text())
    (as_step_3 / "meta.json").write_text(json.dumps(meta | {"step": 3}))
    assert main(reference, "--max_steps", "5", "--resume", "auto", "--ckpt_every", "100") == 0
    for use_ema in (True, False):
        got = ckpt_weights(run / "checkpoints" / "step-0000005", use_ema)
        want = ckpt_weights(reference / "checkpoints" / "step-0000005", use_ema)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


def test_full_disk_is_one_line_and_leaves_the_last_good_checkpoint(tmp_path, monkeypatch, capsys, main):
    """The write path runs out of space in the middle of step 4's checkpoint: exit 1, one line naming the folder,
    the space and the last good checkpoint, no temporary folder left, and step 2 still resumes."""
    real = ckpt_io._Checksummed.write

    def full(self, data):
        if "step-0000004" in str(self.f.name):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(ckpt_io._Checksummed, "write", full)
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(run, "--max_steps", "6", "--ckpt_every", "2") == 1
    err = capsys.readouterr().err.strip()
    root = run / "checkpoints"
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"ditforge train: stopped: checkpoint step-0000004 not written: no space left on device in "
                          f"{root} (about ")
    assert err.endswith(f"GiB free); the last good checkpoint is {root / 'step-0000002'}")
    assert [p.name for p in root.iterdir()] == ["step-0000002"]
    monkeypatch.setattr(ckpt_io._Checksummed, "write", real)
    assert main(run, "--max_steps", "3", "--resume", "auto") == 0


def test_full_disk_while_logging_metrics(tmp_path, monkeypatch, capsys, main):
    """metrics.jsonl cannot be appended: one line, exit 1."""
    from ditforge.train.logging import MetricsLog

    def full(self, record):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(MetricsLog, "write", full)
    capsys.readouterr()
    assert main(tmp_path / "run", "--max_steps", "2") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "metrics.jsonl not written: no space left on device in" in err, err


def test_one_run_per_folder(tmp_path, subprocess_env, tiny_argv, capsys, caplog):
    """A second run on a folder another run (a subprocess) is using exits with code 2 and one line naming the
    holder; the first run's metrics.jsonl is intact. A lock left by a dead process is taken over with a warning."""
    run = tmp_path / "run"
    argv = tiny_argv(run, "--max_steps", "100000", "--ckpt_every", "100000")
    first = subprocess.Popen([sys.executable, "-m", "ditforge", *argv], env=subprocess_env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
            assert first.poll() is None and time.time() < deadline, first.stderr.read()
            time.sleep(0.2)
        capsys.readouterr()
        assert cli.main(argv) == 2
        holder = json.loads((run / ".lock").read_text())
        assert capsys.readouterr().err.strip() == (
            f"ditforge train: error: --outputs {run}: another ditforge run is using this folder (host "
            f"{holder['host']}, PID {first.pid}, started {holder['started']}); wait for it to end, or choose another "
            "folder")
    finally:
        first.send_signal(signal.SIGTERM)  # finishes its step, saves and stops
        first.wait(timeout=120)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))
    assert (run / ".lock").read_text() == ""  # released

    (run / ".lock").write_text(json.dumps({"host": "gone", "pid": 2**22 + 1, "started": "yesterday"}))
    assert cli.main(tiny_argv(run, "--max_steps", str(len(steps) + 1), "--resume", "auto")) == 0
    assert any("taking over the lock of a run that ended without releasing it (host gone, PID 4194305"
               in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_device_side_skip_of_a_fused_optimizer_and_the_ema(device):
    """The path GPUs take (no host sync): a fused AdamW (on the CPU too, which honours ``found_inf`` alike) gets
    the skip flag as its ``found_inf``; a step with a NaN input changes no weight and no optimizer state, the
    EMA's device-side skip leaves it as it is, and the next good step equals a run that never had the bad one."""
    from ditforge.diffusion import create_diffusion
    from ditforge.models import create_model
    from ditforge.parallel.ema import EMA
    from ditforge.parallel.mesh import Dist
    from ditforge.train.randomness import StepRandomness
    from ditforge.train.step import train_step

    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    diffusion, d = create_diffusion(None), Dist(device=torch.device(device))

    def batch():
        return [(torch.randn(4, 1, 8, 8, device=device), {"y": torch.randint(0, 10, (4,), device=device)},
                 StepRandomness(torch.randn(4, 1, 8, 8, device=device), torch.randint(0, 1000, (4,), device=device),
                                torch.zeros(4, dtype=torch.bool, device=device),
                                torch.zeros(4, dtype=torch.bool, device=device)))]

    good1, bad, good2 = batch(), batch(), batch()
    bad[0][0][1, 0, 2, 3] = float("nan")
    runs = []
    for batches in ([good1, bad, good2], [good1, good2]):
        torch.manual_seed(0)
        model = create_model("DiT-T/2", 8, 1, 10).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        ema = EMA(model)
        skipped = []
        for mb in batches:
            before = [p.detach().clone() for p in model.parameters()]
            ema_before = {k: v.clone() for k, v in ema.shadow.items()}
            out = train_step(model, diffusion, opt, None, mb, torch.float32, 1.0, d)
            ema.update(model, 0.9, skip=out["skipped"])
            skipped.append(bool(out["skipped"]))
            if out["skipped"]:
                assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
                assert all(torch.equal(ema_before[k], v) for k, v in ema.shadow.items())
                assert opt.state and all(int(s["step"]) == 1 for s in opt.state.values())
        runs.append((skipped, model.state_dict(), ema.shadow))
    assert runs[0][0] == [False, True, False] and runs[1][0] == [False, False]
    for k, v in runs[1][1].items():
        assert torch.equal(runs[0][1][k], v), k
        assert torch.equal(runs[0][2][k], runs[1][2][k]), k
