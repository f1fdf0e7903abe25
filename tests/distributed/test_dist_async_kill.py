"""Interrupted multi-process runs. Background (async) checkpoints survive a hard kill: SIGKILL of a 2-process
FSDP run while a save is in flight leaves only complete, loadable ``step-*`` folders, and ``--resume auto``
continues from the newest. Ctrl-C reaching only one rank stops every rank at the same step with a checkpoint.

The in-process, deterministic counterpart (a storage writer that fails in the background) is in
tests/train/test_trainer.py (test_async_save_failure_in_training_publishes_nothing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from ditforge.models import create_model
from ditforge.weights.read import list_checkpoints, read_checkpoint_weights
from ditforge.train.logging import read_metrics
from dist_helpers import (LOSS_RTOL, TINY, assert_same_losses, dist_env, kill_all, rank_pid, read_run, run_single,
                          torchrun_cmd)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers through /proc")
def test_sigkill_during_async_save(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        torchrun_cmd(2, run, *TINY, "--plugin", "fsdp", "--async_checkpoint", "--ckpt_every", "1",
                     "--max_steps", "200"),
        env=dist_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, killed as a whole (with the workers' own groups)
    )
    root = run / "checkpoints"
    in_flight = published = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            names = [p.name for p in root.iterdir()] if root.is_dir() else []
            published = sorted(n for n in names if n.startswith("step-"))
            in_flight = sorted(n for n in names if n.startswith(".tmp-step-"))
            if published and in_flight:
                break
            time.sleep(0.02)
        alive = proc.poll() is None
    finally:
        kill_all(proc)
        _, err = proc.communicate(timeout=60)
    assert alive, f"the run ended before a save was caught in flight:\n{err[-4000:]}"
    assert published and in_flight, f"no save seen in flight within 180 s:\n{err[-4000:]}"

    # every published checkpoint is complete: manifest, DCP metadata and all shards readable
    ckpts = list_checkpoints(run)
    assert ckpts and all(c.name.startswith("step-") for c in ckpts)
    for ckpt in ckpts:
        meta = json.loads((ckpt / "meta.json").read_text())
        assert ckpt.name == f"step-{meta['step']:07d}" and meta["world_size"] == 2 and meta["plugin"] == "fsdp"
        for use_ema in (True, False):
            read_checkpoint_weights(ckpt, create_model("DiT-T/2", 8, 1, 10).state_dict(), use_ema)
    assert list(root.glob(".tmp-step-*"))  # the interrupted save was not published
    last = json.loads((ckpts[-1] / "meta.json").read_text())["step"]
    before = {r["step"]: r for r in read_metrics(run / "metrics.jsonl")}
    print(f"killed with {published} published, {in_flight} in flight, metrics up to step {max(before)}")

    # resume the killed run in one process for one more step
    run_single(run, *TINY, "--resume", "auto", "--max_steps", str(last + 1), "--ckpt_every", "1000")
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, last + 2))  # records after the checkpoint were dropped
    assert list_checkpoints(run)[-1].name == f"step-{last + 1:07d}"
    assert not list(root.glob(".tmp-step-*"))  # the stale temporary folder was cleaned up
    if last + 1 in before:  # the killed run had logged this step: the resumed one repeats it exactly
        assert records[-1]["loss"] == pytest.approx(before[last + 1]["loss"], rel=LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers through /proc")
def test_ctrl_c_on_one_rank_stops_all_with_a_checkpoint(tmp_path, tiny_reference):
    """SIGINT to rank 1 only (as when only one host's processes are signalled): both ranks finish the step,
    agree to stop, save one consistent checkpoint together and exit."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        torchrun_cmd(2, run, *TINY, "--plugin", "fsdp", "--ckpt_every", "1000", "--max_steps", "200"),
        env=dist_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        deadline, target = time.monotonic() + 180, None
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = run / "metrics.jsonl"
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                target = rank_pid(proc.pid, 1)
                if target is not None:
                    os.kill(target, signal.SIGINT)
                    break
            time.sleep(0.05)
        assert target is not None, "rank 1 not found, or the run ended early"
        _, err = proc.communicate(timeout=120)
    finally:
        kill_all(proc)
        if proc.poll() is None:
            proc.communicate(timeout=60)
    # both ranks stopped through the Ctrl-C path (torchrun then reports their exit code 130 as a failure)
    assert err.count("ditforge train: interrupted") == 2, err[-4000:]
    assert "interrupted at step" in err and "exitcode  : 130" in err, err[-4000:]
    ckpts = list_checkpoints(run)
    assert len(ckpts) == 1, err[-4000:]
    got = read_run(run, "DiT-T/2")
    k = got.meta["step"]
    assert k >= 2 and got.meta["world_size"] == 2
    # the checkpoint holds the state after exactly k steps: the metrics stop there, and the run is the
    # uninterrupted one (the single-process reference covers steps 1-5)
    assert [r["step"] for r in got.records] == list(range(1, k + 1))
    _, ref = tiny_reference
    common = min(k, 5)
    assert_same_losses(got.records[:common], ref.records, steps=list(range(1, common + 1)))
