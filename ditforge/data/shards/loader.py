"""The streams and the loader: this rank's streams as an iterable data set, the loader that keeps their states for the
checkpoint, and ``ShardData``, a shard set or blend as ``build_dataset`` returns it."""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ditforge.data.images import error_text, report_bad_samples
from ditforge.data.prefetch import copy_bytes
from ditforge.data.shards.decode import DroppedByBucket, LatentDecoder, RawDecoder
from ditforge.data.shards.order import SetStream, blend_choices, check_streams, stream_block
from ditforge.data.shards.sets import ShardSet, resolve_sets
from ditforge.data.shards.tar import ShardFile, open_shard
from ditforge.errors import UserError

if TYPE_CHECKING:
    from ditforge.data.buckets import Buckets

HISTORY = 8  # loader states kept, by step: a prefetcher may read up to HISTORY - 1 batches ahead
DECODE_ERRORS = (OSError, ValueError, KeyError, IndexError, SyntaxError, UnicodeDecodeError)


class _Reader:
    """Opens shards (a small LRU of mmapped ``ShardFile``s per process), decodes members and reports bad ones."""

    def __init__(self, sets: list[ShardSet], decode: Callable, retries: int, bad_samples_path: str | Path | None,
                 capacity: int = 64):
        self.sets, self.decode, self.retries, self.bad = sets, decode, retries, bad_samples_path
        self.capacity = capacity  # shards kept open: at least twice every stream's window
        self.open: OrderedDict[str, ShardFile | None] = OrderedDict()

    def report(self, path: str, error: str) -> None:
        report_bad_samples(self.bad, [{"path": path, "error": error}], "bad shard data")

    def shard(self, url: str) -> ShardFile | None:
        if url in self.open:
            self.open.move_to_end(url)
            return self.open[url]
        shard = self.open[url] = open_shard(url, self.retries, self.report)
        if len(self.open) > self.capacity:
            self.open.popitem(last=False)
        return shard

    def read(self, set_index: int, shard_index: int, member: int) -> tuple | None:
        """The decoded sample and its key, or None when it is bad (reported unless its shard was)."""
        url = self.sets[set_index].urls[shard_index]
        shard = self.shard(url)
        if shard is None or member >= len(shard):  # the shard, or its damage, was reported when opened
            return None
        try:
            return self.decode(shard, member), f"{url}#{shard.keys[member]}"
        except DroppedByBucket:
            return None
        except DECODE_ERRORS as e:
            self.report(f"{url}#{shard.keys[member]}", error_text(e))
            return None


class Stream:
    """Virtual stream ``stream``: a blend of ``SetStream``s; ``state = {"position": p, "sets": [SetStream states]}``.
    ``read(n)`` returns the next n good samples and their keys, in position order."""

    def __init__(self, stream: int, sets: list[ShardSet], streams: int, seed: int, window: int,
                 state: dict | None = None):
        self.stream, self.seed = stream, seed
        weights = np.array([s.weight for s in sets], dtype=np.float64)
        self.cumulative = np.cumsum(weights / weights.sum())
        state = state or {"position": 0, "sets": [None] * len(sets)}
        self.position = int(state["position"])
        self.sets = [SetStream(s.counts, streams, stream, j, seed, window, st)
                     for j, (s, st) in enumerate(zip(sets, state["sets"]))]
        self.limit = [sum(s.counts) + 16 for s in sets]  # bad samples in a row that mean a set has no good one

    @property
    def state(self) -> dict:
        return {"position": self.position, "sets": [s.state for s in self.sets]}

    def read(self, n: int, reader: _Reader) -> list[tuple]:
        choice = (blend_choices(self.seed, self.stream, self.position, n, self.cumulative) if len(self.sets) > 1
                  else np.zeros(n, dtype=np.int64))
        self.position += n
        out: list[tuple | None] = [None] * n
        for j, s in enumerate(self.sets):
            slots = np.flatnonzero(choice == j).tolist()
            good, bad_in_a_row = [], 0
            while len(good) < len(slots):
                for shard, member in s.take(len(slots) - len(good)):
                    item = reader.read(j, shard, member)
                    if item is None:
                        s.state[3] += 1
                        bad_in_a_row += 1
                        if bad_in_a_row > self.limit[j]:
                            raise UserError(f"--data: no readable sample in {reader.sets[j].path} (see "
                                            f"{reader.bad})")
                    else:
                        good.append(item)
                        bad_in_a_row = 0
            for slot, item in zip(slots, good):
                out[slot] = item
        return out


class ShardStreams(IterableDataset):
    """This rank's streams as an iterable data set: each data-loader worker (or the main process) takes its
    contiguous block of the rank's streams and yields, forever, one collated batch per step: ``per_stream``
    samples of each of its streams, streams in order, plus ``"key"`` (each sample's ``<shard>#<key>``) and
    ``"_streams"`` ({stream: state after this batch})."""

    def __init__(self, sets: list[ShardSet], decoder, streams: range, num_streams: int, per_stream: int, seed: int,
                 window: int, retries: int, states: dict[int, dict], bad_samples_path: str | Path | None):
        self.sets, self.decoder, self.streams, self.num_streams = sets, decoder, streams, num_streams
        self.per_stream, self.seed, self.window, self.retries = per_stream, seed, window, retries
        self.states, self.bad = states, bad_samples_path

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        mine = self.streams
        if info is not None:
            block = stream_block(len(mine), info.num_workers, info.id)
            mine = mine[block.start:block.stop]
        reader = _Reader(self.sets, self.decoder, self.retries, self.bad, max(64, 2 * len(mine) * self.window))
        streams = [Stream(s, self.sets, self.num_streams, self.seed, self.window, self.states.get(s)) for s in mine]
        while True:
            items = [it for st in streams for it in st.read(self.per_stream, reader)]
            batch = self.decoder.collate([it[0] for it in items])
            batch["key"] = [it[1] for it in items]
            batch["_streams"] = {st.stream: st.state for st in streams}
            yield batch


def _merge(parts: list[dict]) -> dict:
    """The workers' batches as one: tensors concatenated along the batch (by ``copy_bytes``: they are in shared
    memory), lists joined."""
    out = {}
    for k in parts[0]:
        values = [p[k] for p in parts]
        if not isinstance(values[0], torch.Tensor):
            out[k] = [v for p in values for v in p]
        elif len(values) == 1:
            out[k] = values[0]
        else:
            out[k] = torch.empty((sum(len(v) for v in values), *values[0].shape[1:]), dtype=values[0].dtype)
            start = 0
            for v in values:
                copy_bytes(out[k][start:start + len(v)], v)
                start += len(v)
    return out


class ShardLoader:
    """Yields this rank's step batches: the concatenation of its workers' consecutive batches (``DataLoader``
    yields the workers' batches round-robin, in order). Keeps the stream states of the batches consumed
    (not those merely prefetched), by step, for ``state_dict``.

    With ``$DITFORGE_SHARD_KEYS`` set, appends ``{"step", "rank", "keys"}`` per step batch to that file (the
    resume tests compare the sample ids of runs).
    """

    def __init__(self, dataset: ShardStreams, num_workers: int, start_step: int, rank: int, pin_memory: bool,
                 worker_init_fn: Callable | None, fingerprint: str = ""):
        self.dataset, self.rank, self.step, self.fingerprint = dataset, rank, start_step, fingerprint
        self.group = max(num_workers, 1)
        self.loader = DataLoader(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                                 worker_init_fn=worker_init_fn)
        self.states = {s: dataset.states.get(s) for s in dataset.streams}
        self.history = {start_step: dict(self.states)}
        self.keys_file = os.environ.get("DITFORGE_SHARD_KEYS")
        self._it: Iterator | None = None

    def __iter__(self) -> ShardLoader:
        self._it = iter(self.loader)
        return self

    def __next__(self) -> dict:
        try:
            parts = [next(self._it) for _ in range(self.group)]
        except UserError as e:  # from a worker, re-raised with the worker's traceback in its message: one line
            raise UserError(str(e).strip().splitlines()[-1].split("UserError: ", 1)[-1]) from None
        for p in parts:
            self.states.update(p.pop("_streams"))
        batch = _merge(parts)
        self.step += 1
        self.history[self.step] = dict(self.states)  # the consumer may be a few batches behind (prefetching)
        self.history.pop(self.step - HISTORY, None)
        if self.keys_file:
            with open(self.keys_file, "a") as f:
                f.write(json.dumps({"step": self.step - 1, "rank": self.rank, "keys": batch["key"]}) + "\n")
        return batch

    def state_dict(self, step: int, group=None) -> dict:
        """All K stream states after step ``step`` (gathered from every rank over ``group`` when distributed):
        ``{"streams": K, "shuffle_shards": S, "states": {"<stream>": state}}``; JSON-serialisable."""
        import torch.distributed as dist

        mine = self.history.get(step)
        if mine is None:
            raise RuntimeError(f"no loader state of step {step} (the loader is at step {self.step})")
        parts = [mine]
        if dist.is_available() and dist.is_initialized():
            parts = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, mine, group=group)
        states = {str(s): st for part in parts for s, st in part.items()}
        return {"streams": self.dataset.num_streams, "shuffle_shards": self.dataset.window,
                "fingerprint": self.fingerprint, "states": states}


# ----------------------------------------------------------------------------------------------------------
# The builder


class ShardData:
    """A shard set or blend as ``build_dataset`` returns it: what the trainer and the batch encoder read of a data
    set (``manifest`` for latents, ``image_size``, ``num_frames``, ``in_channels``, ``num_classes``,
    ``class_captions``, ``texts``, ``random_flip``, ``len``), plus the ``sets`` and the ``decoder``.

    Raises:
        UserError: see ``resolve_sets``; raw images or videos without ``--image_size``; a blend of image and video
            shards without ``buckets``; ``buckets`` with latent shards.
    """

    def __init__(self, data: str, image_size: int | None, bad_samples_path: str | Path | None,
                 resize_mode: str = "center_crop", retries: int = 3, num_frames: int = 16, frame_interval: int = 3,
                 seed: int = 0, buckets: Buckets | None = None):
        self.data, self.bad_samples_path, self.retries = data, bad_samples_path, retries
        report = lambda path, error: report_bad_samples(bad_samples_path, [{"path": path, "error": error}],  # noqa
                                                        "bad shard")
        self.sets = resolve_sets(data, retries, report)
        first = self.sets[0].manifest or {}
        self.texts = first.get("texts")
        self.class_captions = first.get("class_captions")
        self.num_classes = max(s.manifest.get("num_classes") or 0 if s.manifest else 0 for s in self.sets)
        self.random_flip = first.get("random_flip", True)
        if first.get("kind") == "latent":
            if buckets is not None:
                raise UserError(f"--buckets: --data {data} holds latents of one size; bucket the raw shards "
                                "(`ditforge shard`)")
            self.manifest = first
            self.image_size, self.num_frames, self.in_channels = first["image_size"], first["num_frames"], \
                first["in_channels"]
            self.stochastic = first["stochastic"]
            self.decoder = LatentDecoder(first)
            return
        media = {(st.manifest or {}).get("media", "image") for st in self.sets}
        if buckets is not None:  # images and videos, each at its bucket; the model is built at the largest
            self.buckets, self.image_size, self.num_frames, self.in_channels = buckets, buckets.image_size, \
                buckets.num_frames, 3
            labels, captions = self._fields()
            if not labels:
                self.num_classes = 0
            self.decoder = RawDecoder(self.image_size, resize_mode, labels, captions, self.num_frames, frame_interval,
                                      seed, buckets)
            return
        if len(media) > 1:
            raise UserError(f"--data {data}: a blend of image and video shards trains with --buckets (each sample at "
                            "its own bucket) and --pack_tokens")
        video = media == {"video"}
        if image_size is None:
            raise UserError(f"--image_size is required for raw {'video' if video else 'image'} shards {data} "
                            "(e.g. --image_size 256)")
        self.image_size, self.num_frames, self.in_channels = image_size, num_frames if video else None, 3
        labels, captions = self._fields()
        if not labels:
            self.num_classes = 0
        self.decoder = RawDecoder(image_size, resize_mode, labels, captions, self.num_frames, frame_interval, seed)

    def _fields(self) -> tuple[bool, bool]:
        """Whether the raw samples carry ``cls`` and ``txt`` (from the first readable sample)."""
        for s in self.sets:
            for url in s.urls:
                shard = open_shard(url, self.retries)
                if shard is not None and len(shard):
                    fields = shard.members[0]
                    if self.texts is None and "txt" in fields:
                        self.texts = [str(shard.member(i, "txt"), "utf-8") for i in range(min(len(shard), 8))]
                    return "cls" in fields, "txt" in fields
        return False, False

    def __len__(self) -> int:
        return sum(sum(s.counts) for s in self.sets)


def build_shard_loader(dataset: ShardData, batch_size: int, streams: int, shuffle_shards: int, seed: int,
                       rank: int, world_size: int, num_workers: int, start_step: int, state: dict | None,
                       pin_memory: bool = False, worker_init_fn: Callable | None = None) -> ShardLoader:
    """This rank's ``ShardLoader`` over ``dataset`` (see the package docstring), at ``start_step`` with the saved
    ``state`` (``ShardLoader.state_dict``; None: the start of the run).

    Raises:
        UserError: --data_streams does not divide --batch_size, or world size x --num_workers does not divide
            --data_streams; a set too small for the streams; a state saved with other --data_streams or
            --shuffle_shards, or over other shards, counts, weights or seed; a resume past step 0 without a state.
    """
    for flag, value in (("--data_streams", streams), ("--shuffle_shards", shuffle_shards)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{flag}: expected a positive integer, got {value!r}")
    if batch_size % streams:
        raise UserError(f"--batch_size {batch_size} is not divisible by --data_streams {streams}")
    parts = world_size * max(num_workers, 1)
    if streams % parts:
        raise UserError(f"--data_streams {streams} is not divisible by {world_size} processes x --num_workers "
                        f"{max(num_workers, 1)}; choose --num_workers (or --data_streams) so that it is")
    for s in dataset.sets:
        check_streams(s.counts, streams, s.path)
    # what the saved positions refer to: each set's shard names and counts, its weight, and the seed
    order = [[[u.rsplit("/", 1)[-1] for u in s.urls], s.counts, s.weight] for s in dataset.sets]
    fingerprint = hashlib.sha1(json.dumps([order, seed]).encode()).hexdigest()[:16]
    states: dict[int, dict] = {}
    if state is not None:
        saved = (state.get("streams"), state.get("shuffle_shards"))
        if saved != (streams, shuffle_shards):
            raise UserError(f"--data_streams {streams} --shuffle_shards {shuffle_shards}: the checkpoint's loader "
                            f"was saved with --data_streams {saved[0]} --shuffle_shards {saved[1]}; resume with those")
        states = {int(k): v for k, v in state["states"].items()}
        if any(len(v["sets"]) != len(dataset.sets) for v in states.values()):
            raise UserError(f"--data {dataset.data}: the checkpoint's loader read {len(next(iter(states.values()))['sets'])} "
                            f"data sets, this blend has {len(dataset.sets)}")
        if state.get("fingerprint", fingerprint) != fingerprint:
            raise UserError(f"--data {dataset.data}: not the shards, counts, blend weights or --seed the checkpoint's "
                            "loader read; resume with those (the saved positions mean nothing in another order)")
    elif start_step:
        raise UserError(f"--data {dataset.data}: the checkpoint holds no shard loader state; resume with the data it "
                        "was trained on")
    mine = stream_block(streams, world_size, rank)
    streams_ds = ShardStreams(dataset.sets, dataset.decoder, mine, streams, batch_size // streams, seed,
                              shuffle_shards, dataset.retries, states, dataset.bad_samples_path)
    return ShardLoader(streams_ds, num_workers, start_step, rank, pin_memory, worker_init_fn, fingerprint)
