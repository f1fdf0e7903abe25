"""Chaos: one training run killed with SIGKILL at random moments, with background (async) checkpoints every 2 steps,
and continued with ``--resume auto`` in the same folder after each kill, must end exactly as the same run
uninterrupted: every step's metrics record (loss, mse, vb, grad_norm, lr) and the final checkpoint's tensors (weights,
EMA, Adam moments) equal bit for bit. With 2 processes under torchrun (gloo, CPU) one rank is killed; the other must
end within ``HANG_TIMEOUT`` seconds.

Each launch is killed at a seeded random moment: a uniform delay after it logged its first step, of up to the
reference run's time after its first step over the number of kills, so the kills land in steps, metrics writes and
saves (not in the start-up: imports, loading the checkpoint, building the loader), and the run still advances.
Just before each kill the driver notes what is on disk: a ``.tmp-step-*`` folder means a save is in flight (its
writer still writing if DCP's ``.metadata`` is not there yet; written but not yet published otherwise: a
background save is published by the next save).

CI runs 3 kills of a short run per process count. The long form, whose report is in
benchmarks/results/chaos_cpu.json and docs/troubleshooting.md:

    CHAOS_KILLS=20 CHAOS_STEPS=250 CHAOS_JSON=benchmarks/results/chaos_cpu.json \\
        python -m pytest -s -p no:cacheprovider tests/train/test_chaos.py -k one_process

and with ``... -k two_processes`` (the same 20 kills over 250 steps; ``CHAOS_SEED`` seeds the kill moments,
default 0). The kill driver lives here rather than in benchmarks/, which holds at most 15 scripts.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from dist_helpers import (COMMON, REPO, TINY, descendants, dist_env, kill_all, rank_pid, run_single,  # noqa: E402
                          torchrun_cmd, torchrun_many)

from ditforge.weights.read import list_checkpoints  # noqa: E402
from ditforge.train.logging import read_metrics  # noqa: E402

# seconds the surviving rank (and torchrun) may take to end after the other rank is killed: about 1 s; 30 s (until
# torchrun's SIGKILL) when a survivor read the peers' beats after torchrun's SIGTERM (Heartbeat.stopped_by)
HANG_TIMEOUT = 20.0
RUN_TIMEOUT = 900.0  # seconds one launch may take to finish or to reach its kill
CKPT_EVERY = 2
TIMING_KEYS = {"samples_per_sec", "data_wait_fraction", "peak_memory_gib"}  # differ between any two runs


@dataclass
class Kill:
    """One SIGKILL: when (seconds after the launch's first step), which rank, and what was on disk just before it."""
    after_s: float
    rank: int
    steps_logged: int  # the last step in metrics.jsonl
    newest_checkpoint: int  # the newest published checkpoint's step (0: none)
    in_save: bool  # a .tmp-step-* folder existed
    writing: bool  # ... without DCP's .metadata: its writer was still writing
    resumed_from: int = 0  # the step the next launch resumed from
    survivor_exit_s: float | None = None  # 2 processes: seconds until torchrun and the other rank had ended


def _args(steps: int) -> list[str]:
    return [*TINY, "--max_steps", str(steps), "--ckpt_every", str(CKPT_EVERY), "--keep_last", "2",
            "--async_checkpoint", "--resume", "auto", "--report_to", "none"]


def _launch(run: Path, procs: int, steps: int, log: Path) -> subprocess.Popen:
    args = _args(steps)
    cmd = (torchrun_cmd(procs, run, *args) if procs > 1
           else [sys.executable, "-m", "ditforge", "train", *COMMON, "--outputs", str(run), *args])
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, env=dist_env(), cwd=run.parent, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _wait_training(proc: subprocess.Popen, run: Path, since: float, after_step: int) -> float | None:
    """Seconds until the launch logged a step after ``after_step`` (it has resumed and trains), or None if it
    ended first."""
    metrics = run / "metrics.jsonl"
    while proc.poll() is None:
        if metrics.is_file() and metrics.stat().st_mtime >= since and _on_disk(run)[0] > after_step:
            return time.time() - since
        if time.time() - since > RUN_TIMEOUT:
            raise AssertionError(f"{run}: no step logged within {RUN_TIMEOUT:.0f} s")
        time.sleep(0.01)
    return None


def _reference(run: Path, procs: int, steps: int) -> float:
    """The uninterrupted run, without a start-up of processes of its own (only the killed runs need processes that
    can be killed; a torchrun launch's agent and workers each import torch and ditforge anew): in this process (one
    thread, as the launches' OMP_NUM_THREADS=1), or with 2 processes forked from the preloaded forkserver
    (dist_helpers.torchrun_many: torchrun's environment, one thread a process; test_dist_nodes.py finds such a run
    equal to torchrun's bit for bit). Returns its seconds after its first logged step."""
    first, done = [], threading.Event()

    def watch() -> None:
        while not done.is_set() and not first:
            if _on_disk(run)[0] > 0:
                first.append(time.time())
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        if procs == 1:
            run_single(run, *_args(steps))
        else:
            torchrun_many(procs, [(run, _args(steps))], timeout=RUN_TIMEOUT)
    finally:
        done.set()
        watcher.join()
    assert first, f"{run}: the reference logged no step"
    return time.time() - first[0]


def _finish(proc: subprocess.Popen, log: Path) -> None:
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT)
    finally:
        kill_all(proc)
    assert rc == 0, f"launch failed (exit {rc}):\n{log.read_text()[-4000:]}"


def _on_disk(run: Path) -> tuple[int, int, bool, bool]:
    """(last logged step, newest published checkpoint's step, a save in flight, its writer still writing)."""
    metrics = run / "metrics.jsonl"
    logged = 0
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            logged = json.loads(line)["step"]
    published = list_checkpoints(run)
    tmp = list((run / "checkpoints").glob(".tmp-step-*"))
    return (logged, int(published[-1].name.split("-")[1]) if published else 0, bool(tmp),
            any(not (t / ".metadata").exists() for t in tmp))


def _resumed_step(log: Path) -> int:
    found = re.findall(r"resumed from \S+ at step (\d+)", log.read_text())
    return int(found[-1]) if found else 0


def _kill(proc: subprocess.Popen, run: Path, procs: int, rank: int, after_s: float) -> Kill:
    """SIGKILL the run (with 2 processes: rank ``rank`` alone) and wait for everything of it to end."""
    target = proc.pid if procs == 1 else rank_pid(proc.pid, rank)
    assert target is not None, f"rank {rank} not found"
    kill = Kill(after_s, rank, *_on_disk(run))
    os.kill(target, signal.SIGKILL)
    killed = time.time()
    try:
        proc.wait(timeout=HANG_TIMEOUT)
        if procs > 1:
            while descendants(proc.pid) and time.time() - killed < HANG_TIMEOUT:
                time.sleep(0.05)
            kill.survivor_exit_s = time.time() - killed if not descendants(proc.pid) else None
    except subprocess.TimeoutExpired:
        pass  # survivor_exit_s stays None: a hang
    finally:
        kill_all(proc)
        proc.wait()
    return kill


def _tensors(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the final checkpoint (model, EMA, optimizer state) by its flattened name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run.parent / f"{run.name}-final.pt"
    dcp_to_torch_save(str(list_checkpoints(run)[-1]), str(out))
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif torch.is_tensor(obj):
            flat[prefix] = obj

    walk("", torch.load(out, weights_only=True))
    out.unlink()
    return flat


def chaos(folder: Path, procs: int = 1, kills: int = 3, steps: int = 8, seed: int = 0) -> dict:
    """Run the reference, then the killed and resumed run, in ``folder``; returns the report (see
    ``format_report``). The kill moments are drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    started = time.time()
    ref = folder / "reference"
    window = _reference(ref, procs, steps) / kills  # the reference's time after its first step

    run, done = folder / "run", []
    for i in range(kills + 1):
        log, since = folder / f"launch-{i:02d}.log", time.time()
        published = list_checkpoints(run)
        proc = _launch(run, procs, steps, log)
        training = _wait_training(proc, run, since, int(published[-1].name.split("-")[1]) if published else 0)
        if done:
            done[-1].resumed_from = _resumed_step(log)
        if i == kills or training is None:
            _finish(proc, log)
            break
        delay = rng.uniform(0, window)
        while proc.poll() is None and time.time() - since - training < delay:
            time.sleep(0.005)
        if proc.poll() is not None:  # finished before its kill moment
            _finish(proc, log)
            break
        done.append(_kill(proc, run, procs, rng.randrange(procs), time.time() - since - training))

    got, want = read_metrics(run / "metrics.jsonl"), read_metrics(ref / "metrics.jsonl")
    strip = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in (*got, *want)]
    got_records, want_records = strip[: len(got)], strip[len(got):]
    first_diff = next((w["step"] for g, w in zip(got_records, want_records) if g != w), None)
    if first_diff is None and len(got_records) != len(want_records):
        first_diff = min(len(got_records), len(want_records)) + 1
    a, b = _tensors(run), _tensors(ref)
    differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
    return {
        "procs": procs, "steps": steps, "ckpt_every": CKPT_EVERY, "kills_requested": kills, "seed": seed,
        "kills": len(done),
        "kills_inside_a_save": sum(k.in_save for k in done),
        "kills_while_writing": sum(k.writing for k in done),
        "steps_redone": sum(k.steps_logged - k.resumed_from for k in done),
        "steps_lost_beyond_last_checkpoint": sum(max(0, k.newest_checkpoint - k.resumed_from) for k in done),
        "damaged_checkpoints": len(list((run / "checkpoints").glob("damaged-*"))),
        "hangs": sum(k.survivor_exit_s is None for k in done) if procs > 1 else 0,
        "slowest_survivor_exit_s": max((k.survivor_exit_s or 0.0 for k in done), default=None) if procs > 1 else None,
        "records_compared": len(want_records),
        "first_differing_step": first_diff,
        "losses_identical": first_diff is None,
        "tensors_compared": len(b),
        "differing_tensors": differ[:5],
        "final_weights_identical": not differ,
        "wall_s": round(time.time() - started, 1),
        "per_kill": [asdict(k) for k in done],
    }


def format_report(r: dict) -> str:
    """The report in a few lines."""
    procs = "1 process" if r["procs"] == 1 else f"{r['procs']} gloo processes (one rank killed each time)"
    lines = [
        f"chaos, {procs}: {r['steps']} steps, async checkpoints every {r['ckpt_every']}, seed {r['seed']}",
        f"  kills: {r['kills']} of {r['kills_requested']}; inside a save: {r['kills_inside_a_save']} "
        f"({r['kills_while_writing']} while its writer was writing)",
        f"  steps redone after kills: {r['steps_redone']}; lost beyond the last checkpoint: "
        f"{r['steps_lost_beyond_last_checkpoint']}; damaged checkpoints: {r['damaged_checkpoints']}",
    ]
    if r["procs"] > 1:
        lines.append(f"  surviving rank hung: {r['hangs']} times; slowest end after a kill: "
                     f"{r['slowest_survivor_exit_s']:.1f} s (limit {HANG_TIMEOUT:.0f} s)")
    lines.append(f"  every step's metrics identical ({r['records_compared']} records): "
                 f"{'yes' if r['losses_identical'] else 'no, from step %s' % r['first_differing_step']}; "
                 f"final weights identical ({r['tensors_compared']} tensors): "
                 f"{'yes' if r['final_weights_identical'] else 'no: ' + ', '.join(r['differing_tensors'])}; "
                 f"{r['wall_s']:.0f} s")
    return "\n".join(lines)


def _store(path: Path, report: dict) -> None:
    """Merge ``report`` into the JSON file ``path`` under its process count, with the date, machine and versions."""
    import ditforge

    data = json.loads(path.read_text()) if path.is_file() else {}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    data[f"{report['procs']}_process"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "command": f"CHAOS_KILLS={report['kills_requested']} CHAOS_STEPS={report['steps']} CHAOS_SEED={report['seed']} "
                   "python -m pytest -s tests/train/test_chaos.py",
        "machine": f"{cpu}, {len(os.sched_getaffinity(0))} cores, {platform.platform()}",
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "ditforge": getattr(ditforge, "__version__", "?"), "commit": commit.stdout.strip()},
        "report": format_report(report).splitlines(), **report}
    path.write_text(json.dumps(data, indent=1) + "\n")


@pytest.mark.slow
@pytest.mark.timeout(0)  # not pyproject's 600 s: the driver bounds every wait itself, and its long form runs for hours
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers through /proc")
@pytest.mark.parametrize("procs", [1, 2], ids=["one_process", "two_processes"])
def test_kills_lose_nothing(tmp_path, procs):
    report = chaos(tmp_path, procs, int(os.environ.get("CHAOS_KILLS", 3)), int(os.environ.get("CHAOS_STEPS", 8)),
                   int(os.environ.get("CHAOS_SEED", 0)))
    print(format_report(report))
    if os.environ.get("CHAOS_JSON"):
        _store(Path(os.environ["CHAOS_JSON"]), report)
    assert report["kills"] == report["kills_requested"], report
    assert report["hangs"] == 0 and report["damaged_checkpoints"] == 0, report
    assert report["steps_lost_beyond_last_checkpoint"] == 0, report
    assert report["losses_identical"] and report["final_weights_identical"], report
