"""What keeps a long run safe from its accidents: one run per folder (a lock), a run folder every rank sees,
non-finite steps skipped and counted, loss spikes found (the trainer rolls them back), and a full disk reported
in one line.

The checkpoint side (checksums, falling back past a damaged checkpoint, a failed save) is in
``ditforge.train.checkpoint``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ditforge.errors import RunError, UserError
from ditforge.optim.skip import LateFlag
from ditforge.parallel.mesh import Dist
from ditforge.weights.read import rank_failures

log = logging.getLogger(__name__)


class RunLock:
    """An exclusive ``fcntl.flock`` on ``RUN/.lock``, which holds the holder's host, PID and start time while it
    runs and is emptied on release.

    The kernel drops a flock when its process dies, so a lock left by a crashed run is free; its file still
    names the dead holder, and taking it over says so in a warning. On a file system without flock (some network
    mounts) the run goes on unlocked, with a warning.

    Raises:
        UserError: another live process holds the lock (the message names it).
    """

    def __init__(self, run_dir: Path):
        # the folders made here (deepest first), removed again on release if the run wrote nothing else there
        self.created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / ".lock"
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = _describe_holder(self.file.read())
            self.file.close()
            raise UserError(f"--outputs {run_dir}: another ditforge run is using this folder ({holder}); wait for "
                            "it to end, or choose another folder") from None
        except OSError as e:  # ENOLCK / EOPNOTSUPP: no locks on this file system
            log.warning("%s: cannot lock (%s); make sure no other run uses this folder", self.path, e.strerror)
            self.file.close()
            self.file = None
            return
        self.file.seek(0)
        previous = self.file.read()
        if previous.strip():
            log.warning("%s: taking over the lock of a run that ended without releasing it (%s)", run_dir,
                        _describe_holder(previous))
        self.file.seek(0)
        self.file.truncate()
        self.file.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                    "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
        self.file.flush()

    def release(self) -> None:
        """Empty the lock file and drop the lock; the folders the lock created, where the run wrote nothing else
        (it stopped on an error at start), are removed."""
        if self.file is not None and not self.file.closed:
            self.file.seek(0)
            self.file.truncate()
            if self.created and [p.name for p in self.path.parent.iterdir()] == [".lock"]:
                self.path.unlink()
                for folder in self.created:
                    try:
                        folder.rmdir()
                    except OSError:  # another run has put something there meanwhile
                        break
            self.file.close()  # closing drops the flock


def _describe_holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"host {h['host']}, PID {h['pid']}, started {h['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


def claim_run_folder(run_dir: Path, d: Dist) -> RunLock | None:
    """Lock the run folder (rank 0 holds the lock) and check that every rank sees it: rank 0 writes a random token
    into ``RUN/.shared-check``, every rank reads it back. Multi-host runs need the run folder on a file system
    every host mounts at the same path; without this check a rank that writes elsewhere hangs at the first
    checkpoint. A collective: every rank calls it. Returns rank 0's lock (None elsewhere).

    Raises:
        UserError: the folder is locked by another run, or some rank cannot see what rank 0 wrote (naming the ranks
            and hosts).
    """
    lock = error = token = None
    check = run_dir / ".shared-check"
    if d.is_main:
        try:
            lock = RunLock(run_dir)
        except UserError as e:
            error = str(e)
        else:
            token = secrets.token_hex(16)
            if d.mesh is not None:
                check.write_text(token)
    if d.mesh is None:
        if error:
            raise UserError(error)
        return lock
    box = [error, token, socket.gethostname()]
    dist.broadcast_object_list(box, src=0)
    error, token, host0 = box
    if error:
        raise UserError(error)
    try:
        seen = check.read_text() == token
    except OSError:
        seen = False
    views = [None] * d.world_size
    dist.all_gather_object(views, (seen, socket.gethostname()))
    if d.is_main:
        check.unlink(missing_ok=True)
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        if lock is not None:
            lock.release()
        raise UserError(f"--outputs {run_dir}: {', '.join(blind)} cannot see the folder that rank 0 on {host0} "
                        "writes; every host must reach the run folder at the same path on a shared file system")
    return lock


class NonfiniteGuard:
    """Counts the steps whose loss or global gradient norm was not finite (their optimizer and EMA updates were
    skipped, on the device, see ``step.train_step``) and stops the run after ``max_in_row`` of them in a row.

    A step's flag is read on the host one step late (``push`` of step k reads step k-1's, copied without blocking
    when it was pushed: ``LateFlag``), so checking never stalls the GPU's queue; ``flush`` reads the last one
    (before a save).
    """

    def __init__(self, max_in_row: int, last_good: Callable[[], Path | None]):
        self.max_in_row, self.last_good = max_in_row, last_good
        self.pending: tuple[int, LateFlag, torch.Tensor, torch.Tensor] | None = None
        self.in_row = self.total = 0

    def push(self, step: int, bad: torch.Tensor, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """The flag (0-dim bool) and values (0-dim, for the message) of step ``step``, counted from 1 as in
        metrics.jsonl."""
        self.flush()
        self.pending = (step, LateFlag(bad), loss, grad_norm)

    def flush(self) -> None:
        """Read the pending flag.

        Raises:
            RunError: ``max_in_row`` steps in a row were not finite.
        """
        if self.pending is None:
            return
        step, bad, loss, grad_norm = self.pending
        self.pending = None
        if not bad.read():
            self.in_row = 0
            return
        self.in_row += 1
        self.total += 1
        log.warning("step %d: loss %s, gradient norm %s; update skipped (%d in a row, %d in all)", step,
                    f"{loss.item():.4g}", f"{grad_norm.item():.4g}", self.in_row, self.total)
        if self.in_row >= self.max_in_row:
            good = self.last_good()
            last = f"the last checkpoint is {good}" if good else "no checkpoint was saved"
            raise RunError(f"step {step}: {self.in_row} steps in a row had a non-finite loss or gradient norm "
                           f"(--max_nonfinite_steps); the weights are those after step {step - self.in_row}, "
                           f"{last}; lower --lr, add --warmup_steps or keep --max_grad_norm")


class LossSpikeGuard:
    """Finds loss spikes for ``--loss_spike_factor F --loss_spike_window W``, which the trainer answers by rolling
    back to a checkpoint before the spike and skipping the batches in between (PaLM, Chowdhery et al. 2022, sec.
    5.1: restart about 100 steps before the spike, skip 200-500 batches; ``trainer._roll_back``).

    The test. Each step's loss (this process's, as optimised; a skipped non-finite step's left out) goes into a
    ring of the last W steps on the device. At each check (the trainer's metrics records, every ``--log_every``
    steps and at the end), once W steps have run, the window mean ``m`` is read: the mean over those W steps'
    good steps and over all processes. Its reference ``r`` is the median of ``history``, the latest ``HISTORY``
    window means that were not spikes. A spike is ``m > F * r`` (no check before ``history`` holds a mean); a
    spike's mean never enters ``history``. A spike after ``max_in_row`` rollbacks with no spike-free check between
    them stops the run.

    The cost: a step writes its loss into the ring on the device (no host sync); the ring is read at the metrics
    records' cadence, where the trainer reads the loss on the host anyway (one all-reduce of 2W numbers). Checking
    at every step would add a sync per step; checking only at records delays a rollback by at most
    ``--log_every`` steps, whose batches are skipped with the rest.

    What a resume needs to decide alike (the ring, ``history``, the counts) is ``state_dict``'s, saved in each
    checkpoint's meta: a resumed run makes the same checks, with the same numbers, as an uninterrupted one.
    """

    HISTORY = 100

    def __init__(self, factor: float, window: int, max_in_row: int, device: torch.device,
                 last_good: Callable[[], Path | None]):
        self.factor, self.window, self.max_in_row, self.device = factor, window, max_in_row, device
        self.last_good = last_good
        self.in_row = self.rollbacks = 0
        self._reset()

    def _reset(self) -> None:
        self.ring = torch.zeros(2, self.window, device=self.device)  # losses, good-step flags; step k at k % W
        self.filled, self.history = 0, []

    def push(self, step: int, loss: torch.Tensor, skipped: torch.Tensor) -> None:
        """The loss (0-dim) and skipped flag (0-dim bool) of step ``step`` (counted from 0); no host sync."""
        loss = loss.float()  # (where takes the flag from either device, as in ``trainer._Window``)
        self.ring[:, step % self.window] = torch.stack([torch.where(skipped, 0.0, loss),
                                                        torch.where(skipped, 0.0, torch.ones_like(loss))])
        self.filled = min(self.filled + 1, self.window)

    def check(self, step: int, d: Dist) -> tuple[float, float] | None:
        """The test above after step ``step`` (counted from 1), a collective: every rank calls it and gets the same
        answer. Returns the spike's window mean and reference median, or None.

        Raises:
            RunError: a spike after ``max_in_row`` rollbacks in a row (the message names the last checkpoint).
        """
        if self.filled < self.window:
            return None
        losses, good = _summed_over_processes(self.ring, d)
        if not sum(good):  # every step of the window was skipped: the non-finite guard's business
            return None
        mean = sum(losses) / sum(good)
        if not self.history or not mean > self.factor * statistics.median(self.history):
            self.history, self.in_row = [*self.history, mean][-self.HISTORY:], 0
            return None
        median = statistics.median(self.history)
        if self.in_row >= self.max_in_row:
            ckpt = self.last_good()
            last = f"the last checkpoint is {ckpt}" if ckpt else "no checkpoint was saved"
            raise RunError(f"step {step}: mean loss {mean:.4g} over the last {self.window} steps is more than "
                           f"{self.factor:g} x the median {median:.4g}, after {self.in_row} rollbacks in a row "
                           f"(--max_loss_spike_rollbacks); {last}; lower --lr, add --warmup_steps, or look at the "
                           "data")
        return mean, median

    def state_dict(self, d: Dist) -> dict:
        """The guard's state, JSON-serialisable, for a checkpoint's meta; a collective (the ring summed over
        processes)."""
        ring = _summed_over_processes(self.ring, d)
        return {"window": self.window, "filled": self.filled, "ring": ring, "history": self.history,
                "in_row": self.in_row, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict | None, d: Dist) -> None:
        """Continue from ``state_dict``'s ``state`` (None: a checkpoint saved without the guard)."""
        if state is not None:
            self.in_row, self.rollbacks = state["in_row"], state["rollbacks"]
        self._restore(state, d)

    def rolled_back(self, state: dict | None, d: Dist) -> None:
        """The run went back to the checkpoint holding ``state``: its ring and history, the counts one up."""
        self._restore(state, d)
        self.in_row, self.rollbacks = self.in_row + 1, self.rollbacks + 1

    def _restore(self, state: dict | None, d: Dist) -> None:
        self._reset()
        if state is None or state["window"] != self.window:  # another window: its ring and means do not apply
            return
        self.filled, self.history = state["filled"], list(state["history"])
        if d.is_main:  # the sums over processes, on one rank: summing them again adds zeros, exactly
            self.ring = torch.tensor(state["ring"], device=self.device)


def _summed_over_processes(t: torch.Tensor, d: Dist) -> list:
    """``t`` summed over all processes (one all-reduce), as (nested) Python floats."""
    t = t.clone()
    if d.mesh is not None:
        dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def all_finite(tensors: list[torch.Tensor], d: Dist) -> bool:
    """Whether every element of ``tensors`` (this rank's shards) is finite on every rank (a host sync; one
    all-reduce across processes)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    local = [t for t in local if t.numel()]
    ok = torch.ones((), device=d.device)
    if local:
        ok = torch.stack(torch._foreach_norm(local, float("inf"))).isfinite().all().float().to(d.device)
    if d.mesh is not None:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


# PyTorch's zip writer (torch.save, DCP's tensor files) reports a short write as a RuntimeError without an errno:
# "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598" (writing to a Python stream) or
# "... file write failed" (writing to a path).
_ZIP_WRITE_FAILED = re.compile(r"unexpected pos \d+ vs \d+|file write failed")
NEARLY_FULL = 1 << 20  # bytes: a file system with less free is out of space (a failed write leaves ~0)


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged user may still write on the file system holding ``folder`` (or its nearest existing
    parent), from ``os.statvfs``."""
    folder = Path(folder).absolute()
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def space_error(e: BaseException, folder: Path) -> OSError | None:
    """The lack of space behind ``e``, whatever layer raised it, or None when ``e`` has another cause.

    Lack of space is an ``OSError`` with errno ENOSPC or EDQUOT anywhere in ``e``'s chain (``__cause__``,
    ``__context__``) or among a DCP ``CheckpointException``'s per-rank failures; or PyTorch's zip writer's
    RuntimeError (``_ZIP_WRITE_FAILED``), which carries no errno, while the file system holding ``folder`` (the
    folder being written) has less than ``NEARLY_FULL`` bytes free. Call it before removing what the failed write
    left there.

    Returns:
        the OSError found, or for the zip writer's error a new ``OSError(ENOSPC)``.
    """
    todo, seen, zip_failed = [e], set(), False
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return x
        zip_failed |= isinstance(x, RuntimeError) and _ZIP_WRITE_FAILED.search(str(x)) is not None
        if isinstance(x, CheckpointException):
            todo += rank_failures(x)
        todo += [x.__cause__, x.__context__]
    if zip_failed and free_bytes(folder) < NEARLY_FULL:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def write_failure(what: str, folder: Path, e: OSError, last_good: Path | None, needed: int | None = None) -> str:
    """One line for an error writing ``what`` into ``folder``: for a full disk (ENOSPC) or an exceeded quota
    (EDQUOT) the space needed (``needed`` bytes, when known) and free; and the last good checkpoint."""
    last = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint saved yet"
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return f"{what} not written to {folder}: {e.strerror or e}; {last}"
    why = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
    free = shutil.disk_usage(folder).free if folder.is_dir() else 0
    space = f"about {needed / 2**30:.2f} GiB needed, " if needed else ""
    return f"{what} not written: {why} in {folder} ({space}{free / 2**30:.2f} GiB free); {last}"


class WriteFailed(RunError):
    """A file of the run could not be written; the message is ``write_failure``'s one line."""


@contextlib.contextmanager
def disk_errors(what: str, folder: Path, go_on: bool, last_good: Callable[[], Path | None]) -> Iterator[None]:
    """Turn a lack of space while writing ``what`` (metrics, a sample grid) into one line (``write_failure``),
    whatever layer raised it (``space_error``), and a checkpoint's ``WriteFailed`` (``checkpoint.SaveError``)
    likewise: raised, or with ``go_on`` (``--continue_on_save_error``) a warning. Other errors pass unchanged."""
    try:
        yield
    except WriteFailed as e:
        if not go_on:
            raise
        log.warning("%s; going on (--continue_on_save_error)", e)
    except Exception as e:
        space = space_error(e, folder)
        if space is None:
            raise
        message = write_failure(what, folder, space, last_good())
        if not go_on:
            raise WriteFailed(message) from None
        log.warning("%s; going on (--continue_on_save_error)", message)
