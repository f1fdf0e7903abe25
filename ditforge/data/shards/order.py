"""The deterministic order (the package docstring): each set's shards dealt to the streams per epoch, shuffled in
windows, the blend's draws, and the blocks of streams of ranks and workers."""

from __future__ import annotations

import numpy as np

from ditforge.data.sampler import derive_seed
from ditforge.errors import UserError

BLEND_KEY = 0x626C656E  # separates the blend draws' seeds from the order's
BLEND_BLOCK = 4096


def deal(counts: list[int], streams: int, seed: int, set_index: int, epoch: int) -> list[list[tuple[int, int, int]]]:
    """Epoch ``epoch``'s pieces ``(shard, first member, end member)`` of every stream: the shards (cut into
    ``ceil(streams / len(counts))`` member ranges when there are fewer than ``streams``; empty pieces dropped) in
    a permutation seeded by ``derive_seed(seed, set_index, epoch)``, dealt round-robin."""
    cuts = max(1, -(-streams // len(counts)))
    pieces = [(i, n * k // cuts, n * (k + 1) // cuts) for i, n in enumerate(counts) for k in range(cuts)]
    pieces = [p for p in pieces if p[2] > p[1]]
    order = np.random.default_rng(derive_seed(seed, set_index, epoch)).permutation(len(pieces))
    return [[pieces[j] for j in order[s::streams]] for s in range(streams)]


def check_streams(counts: list[int], streams: int, where: str) -> None:
    """Raises UserError when some stream of a set would get no sample in an epoch (fewer non-empty pieces than
    streams)."""
    cuts = max(1, -(-streams // len(counts)))
    pieces = sum(1 for n in counts for k in range(cuts) if n * (k + 1) // cuts > n * k // cuts)
    if pieces < streams:
        raise UserError(f"--data_streams {streams}: {where} has {sum(counts)} samples in {len(counts)} shards, too "
                        "few for every stream to get one; lower --data_streams")


class SetStream:
    """One stream's position in one shard set: ``state = [epoch, window, offset, skipped]`` (``skipped``: bad
    samples passed over so far). ``take(n)`` returns the next n ``(shard, member)`` of the order (see the package
    docstring) and advances."""

    def __init__(self, counts: list[int], streams: int, stream: int, set_index: int, seed: int, window: int,
                 state: list[int] | None = None):
        self.counts, self.streams, self.stream, self.set_index = counts, streams, stream, set_index
        self.seed, self.window = seed, window
        self.state = list(state) if state is not None else [0, 0, 0, 0]
        self._pieces: tuple[int, list] | None = None
        self._plan: tuple[tuple[int, int], np.ndarray, np.ndarray] | None = None

    def _window_plan(self, epoch: int, window: int) -> tuple[np.ndarray, np.ndarray] | None:
        if self._plan is not None and self._plan[0] == (epoch, window):
            return self._plan[1], self._plan[2]
        if self._pieces is None or self._pieces[0] != epoch:
            self._pieces = (epoch, deal(self.counts, self.streams, self.seed, self.set_index, epoch)[self.stream])
        pieces = self._pieces[1][window * self.window:(window + 1) * self.window]
        if not pieces:
            return None
        shards = np.concatenate([np.full(hi - lo, i, dtype=np.int64) for i, lo, hi in pieces])
        members = np.concatenate([np.arange(lo, hi, dtype=np.int64) for i, lo, hi in pieces])
        perm = np.random.default_rng(derive_seed(self.seed, self.set_index, epoch, self.stream, window)).permutation(
            len(shards))
        self._plan = ((epoch, window), shards[perm], members[perm])
        return self._plan[1], self._plan[2]

    def take(self, n: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        epoch, window, offset, skipped = self.state
        while len(out) < n:
            plan = self._window_plan(epoch, window)
            if plan is None:
                epoch, window, offset = epoch + 1, 0, 0
                continue
            shards, members = plan
            if offset >= len(shards):
                window, offset = window + 1, 0
                continue
            end = min(len(shards), offset + n - len(out))
            out += zip(shards[offset:end].tolist(), members[offset:end].tolist())
            offset = end
        self.state = [epoch, window, offset, skipped]
        return out


def blend_choices(seed: int, stream: int, position: int, n: int, cumulative: np.ndarray) -> np.ndarray:
    """The set index (n,) int64 of stream positions ``position .. position + n - 1``: a uniform draw per position
    (counter-based: block ``p // BLEND_BLOCK`` seeded by ``derive_seed(seed, BLEND_KEY, stream, block)``) against
    ``cumulative`` (the normalised cumulative weights)."""
    out = []
    p, end = position, position + n
    while p < end:
        block, r = divmod(p, BLEND_BLOCK)
        u = np.random.default_rng(derive_seed(seed, BLEND_KEY, stream, block)).random(BLEND_BLOCK)
        k = min(BLEND_BLOCK - r, end - p)
        out.append(u[r:r + k])
        p += k
    return np.minimum(np.searchsorted(cumulative, np.concatenate(out), side="right"), len(cumulative) - 1)


def stream_block(streams: int, parts: int, part: int) -> range:
    """The contiguous streams of part ``part`` of ``parts`` (a rank of the world, a worker of a rank)."""
    n = streams // parts
    return range(part * n, (part + 1) * n)
