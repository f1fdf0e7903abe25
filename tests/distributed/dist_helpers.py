"""Helpers of the multi-process tests: launches of ``ditforge`` command lines as torchrun would run them (gloo on
CPU), the single-process reference runs they are compared with, reading runs back, and the stated tolerances.

Every run uses fp32 on the CPU, one OpenMP thread per process, no sample grids and a metrics record per step.

The processes of a launch (``torchrun_cli_many``, ``spawn``) are forked from a forkserver that imported torch,
ditforge, diffusers and transformers once per pytest process (``PRELOAD``; ``test_dist_launch.py`` checks it).
torchrun and ``mp.spawn`` start fresh interpreters that import them again: about 5 s of CPU a process for torch and
ditforge, 17 s with diffusers' video pipelines, on the 2-core CI machine, and the torchrun agent 4 s more a launch.
A process gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), which is all ditforge reads of it (``parallel.mesh``). The tests that kill
processes (``tests/train/test_chaos.py``, ``test_dist_async_kill.py``, ``test_dist_nodes.py``) and
``tests/test_sample_npz.py`` launch the real torchrun, as users do.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# What every run shares (model, batch, steps and plugin are per test).
COMMON = ["--data", "digits", "--device", "cpu", "--mixed_precision", "fp32", "--sample_every", "0",
          "--log_every", "1", "--num_workers", "0", "--seed", "0"]


def dist_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # never join a group this pytest process may belong to
    return env


def torchrun_cmd(nproc: int, outputs: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "ditforge", "train", *COMMON, "--outputs", str(outputs), *args]


# What the forkserver imports once (by full name: Python 3.11's forkserver does not take the tests' sys.path, and skips
# a module it cannot import without a word): torch's distributed stack, ditforge's trainer and samplers, and the
# modules of diffusers' pipelines that the tests build (their transformers and text encoders, with transformers).
PRELOAD = ("torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor.parallel", "peft",
           "ditforge.cli", "ditforge.train.trainer", "ditforge.sample.video", "ditforge.models.adapters.pipeline",
           "diffusers.pipelines.wan.pipeline_wan", "diffusers.pipelines.wan.pipeline_wan_i2v",
           "diffusers.pipelines.cogvideo.pipeline_cogvideox",
           "diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video", "diffusers.pipelines.ltx.pipeline_ltx",
           "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion")


def spawn(fn, args: tuple = (), nprocs: int = 2, timeout: float = 600) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with the processes forked from the preloaded forkserver
    (module docstring): ``fn(i, *args)`` in each, a failure in one ends the others and raises here."""
    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(list(PRELOAD))  # read when this pytest process's forkserver starts
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{nprocs} processes of {fn.__name__} still running after {timeout} s")


def torchrun(nproc: int, outputs: Path, *args: str, timeout: float = 300) -> Path:
    """Run ``ditforge train`` as torchrun would with ``nproc`` processes; returns the run folder."""
    return torchrun_many(nproc, [(outputs, list(args))], timeout=timeout)[0]


def _cli_many(local_rank: int, nproc: int, port: int, work: str, runs: list, env: dict) -> None:
    """One process of ``torchrun_cli_many``: the launching test's environment ``env`` (``dist_env``; the
    forkserver's is that of its start) with torchrun's variables, its output in ``work``/out.RANK, then each
    ``(argv, fails)`` of ``runs`` in turn in the same process group. The CLI's shutdown leaves the group
    (destroy_process_group) after each run, which is made a no-op here until the last run is over, so that the next
    run's init_distributed finds the group already joined. Exits non-zero at the first run whose exit status is not
    the one expected."""
    import torch.distributed as dist

    from ditforge.cli import main

    os.chdir(work)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # torch is imported already: OMP_NUM_THREADS of dist_env no longer applies
    out = open(Path(work) / f"out.{local_rank}", "w", buffering=1)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    bad = 0
    for i, (argv, fails) in enumerate(runs):
        print(f"=== torchrun_many run {i} ===", flush=True)
        rc = main([a.replace("{RANK}", str(local_rank)) for a in argv])
        if bool(rc) != fails:
            bad = rc or 1
            print(f"torchrun_many: run {i} exited {rc}", flush=True)
            break
        if dist.is_initialized():
            dist.barrier()  # every process's output of this run is written before any marker of the next
    dist.destroy_process_group = destroy
    if dist.is_initialized():
        destroy()  # after the last run's barrier: every process is done before process 0's store goes
    out.flush()
    sys.exit(bad)


def torchrun_cli_many(nproc: int, work: Path, argvs: list[list[str]], fails: tuple[int, ...] = (),
                      timeout: float = 600) -> list[str]:
    """``ditforge ARGV`` in ``nproc`` processes as torchrun would run it, for each ARGV of ``argvs``, in turn in the
    same processes and process group (one start-up of the processes, module docstring). Each run is the command line
    torchrun would run alone (its own outputs, its own seed); ``{RANK}`` in an argument becomes the process's rank. The runs whose index is in ``fails`` must exit non-zero
    (every process at the same point, a refusal), the others 0. Returns each run's output (every process's, one
    after the other)."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    runs = [([str(a) for a in argv], i in fails) for i, argv in enumerate(argvs)]
    logs = [work / f"out.{rank}" for rank in range(nproc)]
    try:
        spawn(_cli_many, (nproc, free_port(), str(work), runs, dist_env()), nprocs=nproc, timeout=timeout)
    except Exception as e:
        tails = "\n".join(f"--- process {rank}:\n{log.read_text()[-4000:]}" for rank, log in enumerate(logs)
                          if log.exists())
        raise AssertionError(f"{nproc} processes of {len(argvs)} runs failed: {e}\n{tails}") from None
    err = [""] * len(argvs)
    for log in logs:
        for part in log.read_text().split("=== torchrun_many run ")[1:]:  # "I ===\n..."
            i, _, text = part.partition(" ===")
            err[int(i)] += text
    return err


def torchrun_many(nproc: int, runs: list[tuple[Path, list[str]]], timeout: float = 600) -> list[Path]:
    """``ditforge train`` with the tiny settings for each ``(outputs, args)`` of ``runs``, in one launch of ``nproc``
    processes (``torchrun_cli_many``) that runs them in turn; returns the run folders."""
    outs = [Path(o) for o, _ in runs]
    for o in outs:
        o.parent.mkdir(parents=True, exist_ok=True)
    torchrun_cli_many(nproc, outs[0].parent, [["train", *COMMON, "--outputs", str(o), *args]
                                              for o, (_, args) in zip(outs, runs)], timeout=timeout)
    return outs


def finetune_module(name: str):
    """``tests/finetune/<name>.py`` (``tiny_pipelines``: the builders; ``families``: the rows of the shared suite, one a
    family), imported by its path as ``sys.modules[name]`` (where the fine-tuning tests' own import put it, or finds
    it), without tests/finetune on ``sys.path``: the multi-process tests take the fine-tuning suite's tiny pipelines
    and family rows."""
    import importlib.util

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "finetune" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def run_single(outputs: Path, *args: str) -> Path:
    """The same training in this process (no torchrun, one thread): the reference."""
    from ditforge import cli

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = cli.main(["train", *COMMON, "--outputs", str(outputs), *args])
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    return Path(outputs)


@dataclass
class RunResult:
    records: list[dict]  # metrics.jsonl
    model: dict[str, torch.Tensor]  # final raw weights, gathered into a plain model's state dict
    ema: dict[str, torch.Tensor]  # final EMA weights, likewise
    meta: dict  # the final checkpoint's meta.json

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records}


def read_run(run: Path, model_name: str, step: int | None = None, drop_checkpoints: bool = False,
             depth: int | None = None) -> RunResult:
    """Metrics and the (final, or ``step``'s) checkpoint's weights of a run, read into create_model's
    state-dict layout (``depth``: the run's ``--depth``) whatever the world size and plugin that wrote them."""
    from ditforge.models import create_model
    from ditforge.weights.read import list_checkpoints, read_checkpoint_weights, read_meta
    from ditforge.train.logging import read_metrics

    ckpts = list_checkpoints(run)
    ckpt = ckpts[-1] if step is None else run / "checkpoints" / f"step-{step:07d}"
    result = RunResult(
        read_metrics(run / "metrics.jsonl"),
        read_checkpoint_weights(ckpt, create_model(model_name, 8, 1, 10, depth=depth).state_dict(), use_ema=False),
        read_checkpoint_weights(ckpt, create_model(model_name, 8, 1, 10, depth=depth).state_dict(), use_ema=True),
        read_meta(ckpt),
    )
    if drop_checkpoints:  # a DiT-S/2 checkpoint (weights, EMA, Adam moments) is ~0.5 GB: keep the disk free
        shutil.rmtree(run / "checkpoints")
    return result


# fp32 everywhere, so the runs differ only in the order of floating-point reductions (gradient all-reduce or
# reduce-scatter, the loss and grad-norm means over processes, micro-batch sums): differences of a few ulps,
# ~1e-7 relative. Adam divides each update by the running RMS of its gradient, so such differences are not
# amplified over 5 steps (measured by hand: fsdp x2 vs one process, losses equal to 1e-10 relative, EMA to
# 7e-9 absolute). 1e-6 relative on the losses and 1e-5 absolute on weights of size ~0.02-1 leave an order of
# magnitude of margin and still catch any real error (a wrong gradient average or a skipped micro-batch moves
# the losses at the 1e-3 level and the weights by ~lr = 1e-3 or 1e-4 per step).
LOSS_RTOL = 1e-6
WEIGHT_ATOL = 1e-5
# The global gradient norm is a sum of ~10^7 squares reduced in a different order per plugin (DTensor partial
# sums under zero2/fsdp): 1e-5 relative.
GRAD_NORM_RTOL = 1e-5


def assert_same_losses(got: list[dict], ref: list[dict], steps: list[int] | None = None) -> None:
    ref_by_step = {r["step"]: r for r in ref}
    got_steps = [r["step"] for r in got]
    assert got_steps == (steps if steps is not None else sorted(ref_by_step)), got_steps
    for r in got:
        want = ref_by_step[r["step"]]
        for key in ("loss", "mse", "vb"):
            assert r[key] == pytest.approx(want[key], rel=LOSS_RTOL, abs=0), (r["step"], key, r[key], want[key])
        assert r["grad_norm"] == pytest.approx(want["grad_norm"], rel=GRAD_NORM_RTOL), (r["step"], "grad_norm")
        assert r["lr"] == want["lr"]


def assert_same_weights(got: dict, ref: dict, atol: float = WEIGHT_ATOL) -> float:
    assert got.keys() == ref.keys()
    worst = 0.0
    for k in ref:
        assert got[k].shape == ref[k].shape and got[k].dtype == ref[k].dtype == torch.float32, k
        diff = (got[k] - ref[k]).abs().max().item()
        assert diff <= atol, f"{k}: max abs diff {diff:.3g} > {atol}"
        worst = max(worst, diff)
    return worst


# The tiny model of the tests that the issue does not pin to DiT-S/2.
TINY = ["--model", "DiT-T/2", "--batch_size", "16"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the gloo group of processes spawned by a test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc: torchrun starts each worker in a session of its own, so
    killing the launcher's process group alone would leave the workers running)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group and every worker's (as a power cut or the OOM killer would)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def rank_pid(launcher: int, rank: int) -> int | None:
    """The process id of torchrun worker ``rank`` of the launcher ``launcher`` (found by its RANK variable)."""
    for pid in descendants(launcher):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode() and b"ditforge" in cmdline:
            return pid
    return None


@contextlib.contextmanager
def gloo_dp(rank: int, port: int, world: int) -> Iterator:
    """In a process spawned by a test: one OpenMP thread, a gloo group of ``world`` on 127.0.0.1:``port`` and a 1-D
    ``dp`` DeviceMesh over the CPU; yields ditforge's ``Dist`` for it and destroys the group on exit.

    A clean exit waits for every process before the group goes: process 0 serves the group's TCP store, and
    tearing it down under a process still talking to it can crash one of them (a SIGSEGV in process 0 once
    failed CI, 2026-11-27, and did not come back in 60 reruns, 20 of them on fully loaded cores). ``faulthandler``
    prints the Python stacks of a process that crashes anyway."""
    import faulthandler

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ditforge.parallel.mesh import Dist

    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        yield Dist(rank=rank, world_size=world, device=torch.device("cpu"), mesh=mesh)
        dist.barrier()
    finally:
        dist.destroy_process_group()
