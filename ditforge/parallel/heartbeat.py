"""A lost peer, found and named: every process of a run beats in the rendezvous store, so that when a collective
fails or hangs the survivors can tell which processes stopped beating and say so in one line.

A collective on a dead peer fails at once where its socket closes (gloo on a process that died), or hangs until
the process group's timeout (NCCL on a host that is gone; its watchdog then aborts the process with a stack of C++
frames and no rank). Neither names the peer. Here each process adds 1 to its own counter in torchrun's store
(``MASTER_ADDR:MASTER_PORT``: the TCPStore the process group rendezvoused through, hosted by torchrun's agent on
the first node, or by rank 0, which then lingers after finding a loss until the others have read) every
``interval`` seconds from a daemon thread, through its own connection. Counters are read only on trouble, twice
``3 x interval`` apart: the ranks whose counter did not move are lost, unless they marked themselves as stopping on
this loss (a survivor that found it first). Reading costs one store round trip per rank, and beating one per rank
and interval: nothing grows with the square of the world. Time is measured by each reader's own monotonic clock,
so host clocks need not agree.

Trouble is (a) a collective that raised in the training loop (the trainer asks ``lost`` before re-raising), or (b)
no step finished for ``timeout`` seconds (``progress`` not called): then the watcher thread itself reads the
counters and, if a peer is lost, prints the line and ends the process (``os._exit(1)``; the main thread may be
blocked inside a collective that would otherwise wait for the process group's timeout). A slow step whose peers
all still beat (a long checkpoint, a compile) is not trouble: the watcher waits on.

torchrun's elastic agent then restarts the survivors (``--max-restarts``), and ``--resume auto`` continues from the
newest complete checkpoint, at the same or a smaller world size.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ditforge.parallel.mesh import Dist

log = logging.getLogger(__name__)

EXIT_LOST = 1  # a peer was lost: the run stopped on an accident (RunError's exit code)


def beat_interval(timeout: float) -> float:
    """Seconds between two beats for a ``--collective_timeout`` of ``timeout``: timeout / 20 in [0.5, 10]."""
    return min(10.0, max(0.5, timeout / 20))


def group_timeout(timeout: float) -> float:
    """The process groups' own timeout (seconds) for a ``--collective_timeout`` of ``timeout``: later than the
    watcher's verdict (``timeout`` after the last step, then up to one interval, 3 of reading and the store host's
    3 + 2 s of lingering), so that a hung NCCL collective is named in one line before NCCL's watchdog aborts it."""
    return timeout + 7 * beat_interval(timeout) + 30


class Heartbeat:
    """The beats of one process and the reading of all (module docstring).

    Args:
        d: this process's place; ``d.mesh`` must be set (several processes, or a group of one).
        timeout: seconds without a finished step after which the watcher looks for lost peers
            (``--collective_timeout``); the beats come every ``beat_interval(timeout)`` seconds.

    Rank 0 hands out the run's key prefix over the default group, a fresh one per start: a restarted group never
    reads the counters of the one before.
    """

    def __init__(self, d: Dist, timeout: float):
        self.rank, self.world = d.rank, d.world_size
        self.timeout = timeout
        self.interval = beat_interval(timeout)
        self.address = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '0')}"
        token = [secrets.token_hex(8) if d.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        self.prefix = f"ditforge/heartbeat/{token[0]}/"
        host, port = self.address.rsplit(":", 1)
        # its own client: the process group's store may be blocked in a long wait of the main thread
        self.store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=max(5.0, 2 * self.interval)))
        self.store.set(f"{self.prefix}host/{self.rank}", os.uname().nodename)
        self.store.add(self._key(self.rank), 1)
        self._last_step = time.monotonic()
        self._signal: str | None = None  # stopped_by's
        self._stop = threading.Event()
        self._said = threading.Lock()
        self._io = threading.Lock()  # one store operation at a time: the watcher and a main thread's ``lost``
        self._thread = threading.Thread(target=self._run, name="ditforge-heartbeat", daemon=True)
        self._thread.start()

    def stopped_by(self, signal_name: str) -> None:
        """A stop signal (``"SIGTERM"``, ``"SIGINT"``) came while the run was still training: torchrun (on another
        worker's failure) or the scheduler is ending the job, within a grace period (torchrun's: 30 s, then SIGKILL)
        shorter than reading the beats may take (``lost``: 3 beats, up to 30 s). ``describe`` then answers at once:
        the launcher already names the process that failed."""
        self._signal = signal_name

    def _key(self, rank: int) -> str:
        return f"{self.prefix}beat/{rank}"

    def progress(self) -> None:
        """A step finished: the watcher's clock restarts (called by the training loop)."""
        self._last_step = time.monotonic()

    def stop(self) -> None:
        """This process ends (its run finished, or stopped on any error): marked in the store first, so that a peer
        reading the counters meanwhile does not name it lost."""
        self._mark("done")
        self._stop.set()
        self._thread.join(timeout=2 * self.interval + 5)

    def _mark(self, why: str) -> None:
        try:
            with self._io:
                self.store.set(f"{self.prefix}stopped/{self.rank}", why)
        except Exception:
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._beat()
            if time.monotonic() - self._last_step > self.timeout and not self._stop.is_set():
                line = self.describe(beating=True)
                if line is not None and not self._stop.is_set() and self._said.acquire(blocking=False):
                    print(f"ditforge train: stopped: {line}", file=sys.stderr, flush=True)  # as the CLI prints it
                    os._exit(EXIT_LOST)
                self._last_step = time.monotonic()  # all beat: a slow step; look again after another timeout

    def _beat(self) -> None:
        try:
            with self._io:
                self.store.add(self._key(self.rank), 1)
        except Exception:  # the store is gone: reading will say so when there is trouble
            pass

    def _counts(self) -> list[int] | None:
        try:
            with self._io:
                return [self.store.add(self._key(r), 0) for r in range(self.world)]
        except Exception:
            return None

    def lost(self, beating: bool = False) -> list[int] | None:
        """The ranks whose counter did not move over ``3 x interval`` seconds (blocks that long; [] when every
        peer beats), or None when the store itself does not answer (the node hosting it is lost). ``beating``:
        called from the watcher thread, which keeps this process's own beat going meanwhile."""
        first = self._counts()
        if first is None:
            return None
        for _ in range(3):
            time.sleep(self.interval)
            if beating:
                self._beat()
        second = self._counts()
        if second is None:
            return None
        still = [r for r, (a, b) in enumerate(zip(first, second)) if a == b and r != self.rank]
        try:  # a survivor that stopped on this loss before us is not lost
            with self._io:
                return [r for r in still if not self.store.check([f"{self.prefix}stopped/{r}"])]
        except Exception:
            return None

    def describe(self, beating: bool = False) -> str | None:
        """One line naming the lost ranks and their hosts, or None when every peer still beats (``lost``); after
        ``stopped_by``, at once a line saying so."""
        if self._signal is not None:
            self._mark("stopped")
            return (f"rank {self.rank}: {self._signal} came and then a collective failed: the job is being stopped "
                    "(torchrun names the process that failed); --resume auto continues from the newest checkpoint")
        lost = self.lost(beating)
        if lost == []:
            return None
        self._mark("lost peer")
        if self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # the store lives in this process (torchrun's unshared store, or no agent): it must outlast the other
            # survivors' reading, which started about when this one did, or they would find it gone
            time.sleep(3 * self.interval + 2)
        if lost is None:
            return (f"rank {self.rank}: the rendezvous store at {self.address} stopped answering: the process that "
                    "hosts it (torchrun's first agent, or rank 0) stopped or its node is lost; restart the job with "
                    "--resume auto")
        hosts = []
        for r in lost:
            try:
                with self._io:
                    hosts.append(self.store.get(f"{self.prefix}host/{r}").decode())
            except Exception:
                hosts.append("?")
        by_host = {}
        for r, h in zip(lost, hosts):
            by_host.setdefault(h, []).append(str(r))
        where = "; ".join(f"{', '.join(rs)} on {h}" for h, rs in by_host.items())
        return (f"rank {self.rank}: lost contact with rank{'s' if len(lost) > 1 else ''} {where}: no heartbeat "
                f"for {3 * self.interval:.0f} s; the survivors stop (torchrun --max-restarts restarts them; "
                "--resume auto continues from the newest checkpoint, on fewer nodes too)")
