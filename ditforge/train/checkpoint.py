"""Checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards, any world size and
any plugin can load them (DCP reshards), saves can run in the background, and a crash never corrupts the
last good checkpoint.

Layout of ``RUN/checkpoints/step-0000100/``:
    .metadata, __<rank>_0.distcp   DCP: ``model``, ``optimizer`` and ``ema`` state, keyed by the plain model's
                                   parameter names (the official DiT names), sharded as they were in training
    meta.json                      step, the resolved config, grad-scaler state, world size and plugin, and
                                   each file's size and CRC-32 (computed while the file is written)

The folder is written under a temporary name and renamed by rank 0 once every rank's data and DCP's
metadata are on disk. A resume, ``ditforge sample`` and ``export`` check every file against its size and CRC-32
first (``damage``): a file damaged later (a bad disk, a truncated copy) is named, and ``--resume auto`` falls
back to the newest intact checkpoint. Randomness in training is counter-based (derived from the seed and the step), so
(seed, step) is the whole RNG state, and the data position is the step.

DCP's ``.metadata`` is a pickle; it is read here with an unpickler that admits only DCP's metadata classes
and torch dtypes, and the optimizer's non-tensor entries with ``torch.load(weights_only=True)``, so loading
a checkpoint runs no code. That reading (``damage``, ``read_meta``, ``load_weights``) is ``ditforge.weights.read``,
which sampling and export use too; this module writes, resumes and rotates.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ditforge.atomic import atomic_path
from ditforge.errors import UserError
from ditforge.parallel.ema import EMA
from ditforge.parallel.mesh import Dist
from ditforge.parallel.tensor import checkpoint_layout, restore_from
from ditforge.train.guard import WriteFailed, space_error, write_failure
from ditforge.weights.read import (SafeFileSystemReader, _describe, _SafeLoadPlanner, damage, damage_of_meta,
                                   list_checkpoints, rank_failures, read_meta, resolve_checkpoint)

log = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 3: meta.json records each file's size and CRC-32 (older checkpoints load unchecked)


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA,
                   adapters_only: bool = False) -> dict[str, Any]:
    """The state DCP saves: model and optimizer by plain parameter names, and the EMA, each tensor in the layout of
    a model without tensor parallelism (``parallel.tensor.checkpoint_layout``: a copy of the fused projections
    that tensor parallelism keeps blocked; every other tensor is the training object's own, loaded in place).
    ``adapters_only`` (LoRA): the model's trainable parameters alone; the frozen base comes from ``--init_from``."""
    return checkpoint_layout(_own_state(model, optimizer, ema, adapters_only))[0]


def _own_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA, adapters_only: bool) -> dict[str, Any]:
    options = StateDictOptions(ignore_frozen_params=adapters_only)
    return {
        "model": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
        "ema": ema.state_dict(),
    }


class _Checksummed:
    """A binary file that keeps the CRC-32 and the length of what is written through it (DCP writes each file
    front to back, so these are the file's)."""

    def __init__(self, f: io.IOBase):
        self.f, self.crc, self.size = f, 0, 0

    def write(self, data: Any) -> int:
        n = self.f.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        return n

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close: the file's own
        return getattr(self.f, name)


class _ChecksumFileSystem(dcp.filesystem.FileSystem):
    """DCP's local file system, recording ``{file name: (bytes, CRC-32)}`` of every file written (DCP's writer
    threads each write their own files)."""

    def __init__(self) -> None:
        self.sums: dict[str, tuple[int, int]] = {}
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Any:
        with super().create_stream(path, mode) as f:
            if "w" not in mode:
                yield f
                return
            out = _Checksummed(f)
            try:
                yield out
            except RuntimeError as e:
                # The zip writer's short write carries no errno: the rank that saw it names a full disk now,
                # while what it wrote still fills it, and every rank gets that OSError in DCP's exception.
                if (space := space_error(e, Path(path).parent)) is not None:
                    raise space from e
                raise
        with self.lock:
            self.sums[Path(path).name] = (out.size, out.crc)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP's .metadata is written under a temporary name
        with self.lock:
            if Path(path).name in self.sums:
                self.sums[Path(new_path).name] = self.sums.pop(Path(path).name)


def _writer(path: Path) -> dcp.FileSystemWriter:
    writer = dcp.FileSystemWriter(str(path))
    writer.fs = _ChecksumFileSystem()
    return writer


class Checkpointer:
    """Saves ``RUN/checkpoints/step-*`` collectively, synchronously or in the background, atomically.

    Args:
        run_dir: the run folder. keep_last: how many complete checkpoints to keep.
        last_step: the step of the checkpoint the run resumed from (saving that step again is a no-op).
        async_save: return as soon as the state is staged in host memory and write it in a background
            thread (``dcp.async_save``); ``wait()`` publishes it once written (the trainer calls it between steps when
            ``writing()`` is False on every rank), else the next save completes it.
        d: this process's ``Dist``; a separate gloo group carries the background save's collectives so they
            never interleave with training's.

    A save that fails (a full disk, a write error) leaves no temporary folder behind and raises ``SaveError``
    (from ``save``, or for a background save from the next ``save`` or ``wait``), naming the folder and the last
    good checkpoint; the run may go on and save again later.
    """

    def __init__(self, run_dir: Path, keep_last: int, async_save: bool, d: Dist, last_step: int | None = None):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last, self.async_save, self.dist, self.last_step = keep_last, async_save, d, last_step
        self.group = d.gloo_group()
        self.pending: tuple[Future, dcp.FileSystemWriter, Path, Path, dict] | None = None
        # On GPUs an async save copies the state into pinned host buffers (allocated once, reused by every
        # save) on a side stream while the next forward/backward runs; ``wait_for_staging`` (an optimizer
        # pre-step hook) holds back only the next weight update, then starts the background write.
        self.host_state: dict[str, Any] | None = None
        self.stream = torch.cuda.Stream(d.device) if async_save and d.device.type == "cuda" else None
        self.staged: tuple[torch.cuda.Event, dict, Path, Path, dict] | None = None
        self.state_bytes = 0  # of the latest save, all ranks together (the error message's estimate)

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Save ``state`` (see ``training_state``) and ``meta`` as step ``step``; returns the final folder.

        Raises:
            SaveError: this save, or the background save before it, could not be written (this save is made
                all the same: a full disk may have room again).
        """
        earlier: SaveError | None = None
        try:
            self.wait()
        except SaveError as e:
            earlier = e
        final = self.root / f"step-{step:07d}"
        if step == self.last_step:  # saved already (Ctrl-C right after a periodic save): the same state
            return final
        tmp = self.root / f".tmp-step-{step:07d}"
        self.state_bytes = _nbytes(state) * self.dist.world_size
        if self.dist.is_main:
            for stale in [*self.root.glob(".tmp-step-*"), *self.root.glob(".tmp-delete-*")]:  # left by a crash
                shutil.rmtree(stale, ignore_errors=True)
            self._warn_if_short()
        with self._failing_save(tmp):
            if self.dist.is_main:
                tmp.mkdir(parents=True)
            self.dist.barrier()
            meta = {"format_version": FORMAT_VERSION, "step": step, **meta}
            if self.stream is not None:
                if self.host_state is None:
                    self.host_state = _create_cpu_state_dict(state, pin_memory=True)
                self.stream.wait_stream(torch.cuda.current_stream(self.dist.device))
                with torch.cuda.stream(self.stream):
                    # Tensors go into the cached buffers; the returned dict also carries this save's non-tensor
                    # values (e.g. the optimizer's current learning rate).
                    staged = _copy_state_dict(state, self.host_state, non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record()
                self.staged = (copied, staged, tmp, final, meta)
            elif self.async_save:
                writer = _writer(tmp)
                future = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                        no_dist=self.group is None)
                self.pending = (future, writer, tmp, final, meta)
            else:
                writer = _writer(tmp)
                with _interrupts_unwrapped():
                    dcp.save(state, storage_writer=writer, process_group=self.group, no_dist=self.group is None)
                self._finish(writer, tmp, final, meta)
        self.last_step = step  # (a background save that fails later clears it again in ``wait``)
        if earlier is not None:
            raise earlier
        return final

    def wait_for_staging(self) -> None:
        """Block until the state being saved is copied off the device (call before it is next modified),
        then start writing the host copy in the background."""
        if self.staged is not None:
            copied, staged, tmp, final, meta = self.staged
            self.staged = None
            copied.synchronize()
            writer = _writer(tmp)
            future = dcp.async_save(staged, storage_writer=writer, process_group=self.group,
                                    no_dist=self.group is None, async_stager=_AlreadyStaged())
            self.pending = (future, writer, tmp, final, meta)

    def writing(self) -> bool:
        """True while a background save is staged or its writes are under way on this process (``wait`` would
        block); False when none is in flight or its writes have ended (``wait`` then only publishes it)."""
        return self.staged is not None or (self.pending is not None and not self.pending[0].done())

    def wait(self) -> None:
        """Complete a background save: wait for its writes, then publish it.

        Raises:
            SaveError: the background save could not be written.
        """
        self.wait_for_staging()
        if self.pending is not None:
            future, writer, tmp, final, meta = self.pending
            self.pending = None
            try:
                with self._failing_save(tmp):
                    with _interrupts_unwrapped():
                        future.result()
                    self._finish(writer, tmp, final, meta)
            except BaseException:
                self.last_step = None  # not published: saving this step again must really save
                raise

    def _finish(self, writer: dcp.FileSystemWriter, tmp: Path, final: Path, meta: dict) -> None:
        # On rank 0, DCP returns once every rank's data and the global metadata are written; each rank knows the
        # sizes and CRCs of the files it wrote.
        sums = [writer.fs.sums]
        if self.group is not None:
            sums = [None] * self.dist.world_size
            dist.all_gather_object(sums, writer.fs.sums, group=self.group)
        if self.dist.is_main:
            files = {name: {"size": size, "crc32": f"{crc:08x}"}
                     for rank in sums for name, (size, crc) in sorted(rank.items())}
            with atomic_path(tmp / "meta.json") as out:
                out.write_text(json.dumps({**meta, "files": files}, indent=1))
            os.replace(tmp, final)
            for old in list_checkpoints(self.root.parent)[: -self.keep_last]:
                doomed = old.with_name(f".tmp-delete-{old.name}")  # out of the listing before it is half gone
                os.replace(old, doomed)
                shutil.rmtree(doomed, ignore_errors=True)

    @contextlib.contextmanager
    def _failing_save(self, tmp: Path):
        """A save that raises removes its temporary folder; a lack of space (``space_error``: an OSError, the zip
        writer's RuntimeError, either inside DCP's CheckpointException) or another OSError becomes one ``SaveError``
        line; any other error passes unchanged (Ctrl-C stays KeyboardInterrupt)."""
        try:
            yield
        except (Exception, CheckpointException) as e:  # DCP wraps a rank's error in CheckpointException
            self.staged = self.pending = None
            cause = space_error(e, tmp)  # before the temporary folder, which filled the disk, is removed
            if cause is None:
                first = rank_failures(e)[0] if isinstance(e, CheckpointException) and e.failures else e
                cause = first if isinstance(first, OSError) else None
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            if cause is None:
                raise
            raise SaveError(self._describe_failure(tmp, cause)) from None

    def _describe_failure(self, tmp: Path, e: OSError) -> str:
        good = list_checkpoints(self.root.parent)
        return write_failure(f"checkpoint {tmp.name.removeprefix('.tmp-')}", self.root, e,
                             good[-1] if good else None, self.state_bytes)

    def _warn_if_short(self) -> None:
        """Warn (rank 0) when the disk has less free space than the previous checkpoint took."""
        good = list_checkpoints(self.root.parent)
        if not good:
            return
        need = checkpoint_bytes(good[-1])
        free = shutil.disk_usage(self.root).free
        if free < need:
            log.warning("%s: %.2f GiB free, the last checkpoint took %.2f GiB; the next save may fail", self.root,
                        free / 2**30, need / 2**30)


class SaveError(WriteFailed):
    """A checkpoint could not be written (one line: the folder, why, the last good checkpoint)."""


def _nbytes(obj: Any) -> int:
    """Bytes of the tensors (this rank's shards) in a nested state dict."""
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    if torch.is_tensor(obj):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        return t.numel() * t.element_size()
    return 0


def checkpoint_bytes(ckpt: Path) -> int:
    """Bytes a checkpoint folder takes on disk (its files)."""
    return sum(f.stat().st_size for f in Path(ckpt).iterdir() if f.is_file())


def newest_intact(run_dir: Path) -> Path | None:
    """The newest checkpoint of a run that passes ``damage``; each newer damaged one is named in a warning and
    moved aside to ``checkpoints/damaged-step-*`` (kept for a look, out of the way of the steps the run will save
    again). None if the run has no checkpoint.

    Raises:
        UserError: every checkpoint of the run is damaged.
    """
    found = list_checkpoints(run_dir)
    for ckpt in reversed(found):
        why = damage(ckpt)
        if why is None:
            return ckpt
        aside = ckpt.with_name(f"damaged-{ckpt.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        log.warning("%s is damaged: %s; moved to %s, resuming from the checkpoint before it", ckpt.name, why,
                    aside.name)
        os.replace(ckpt, aside)
    if found:
        raise UserError(f"--resume auto: every checkpoint in {Path(run_dir) / 'checkpoints'} is damaged (moved to "
                        "damaged-step-*); start a new run or restore one from a copy")
    return None


@contextlib.contextmanager
def _interrupts_unwrapped():
    """DCP wraps every exception of a save, Ctrl-C included, in CheckpointException (a BaseException);
    let a KeyboardInterrupt be one again, so the trainer and the CLI treat it as Ctrl-C."""
    try:
        yield
    except CheckpointException as e:
        if any(isinstance(x, KeyboardInterrupt) for x in rank_failures(e)):
            raise KeyboardInterrupt from None
        raise


class _AlreadyStaged:
    """An ``AsyncStager`` for a state dict that already lives in host buffers nobody writes to until the
    save completes: DCP writes it as it is, with no second copy."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def load_training_state(ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA,
                        adapters_only: bool = False) -> dict:
    """Load model, optimizer and EMA from a checkpoint folder into the (possibly sharded) training objects,
    whatever world size and plugin saved it. Returns the checkpoint's meta.json.

    Raises:
        UserError: unreadable checkpoint, or one whose tensors do not fit the configured model.
    """
    meta = read_meta(ckpt)
    state = _own_state(model, optimizer, ema, adapters_only)
    dropped = keep_saved_states(state["optimizer"], ckpt)
    saved, moved = checkpoint_layout(state)
    try:
        dcp.load(saved, storage_reader=SafeFileSystemReader(str(ckpt)), planner=_SafeLoadPlanner(),
                 no_dist=not dist.is_initialized())
    except (CheckpointException, RuntimeError, ValueError, KeyError) as e:  # DCP's mismatch errors vary
        raise UserError(f"--resume: {ckpt} does not fit the configured model ({_describe(e)})") from None
    restore_from(moved)  # the fused projections' canonical rows back into the blocked tensors of ``state``
    options = StateDictOptions(ignore_frozen_params=adapters_only, strict=not adapters_only)
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer, state["optimizer"],
                             options=replace(options, strict=False) if dropped else options)
    return meta


def keep_saved_states(optimizer_state: dict, ckpt: Path, part: str = "optimizer") -> bool:
    """Drop from ``optimizer_state`` (``get_optimizer_state_dict``'s, which initialises every parameter's state) the
    parameters whose state ``ckpt`` does not hold: those that had never stepped when it was saved (an expert of two
    that no step had drawn yet, ``train.experts``; a distilled student's or critic's adapter of an expert no step had
    reached yet, ``train.distill_pipeline``). Loaded without them, they start from no state, as they do in the
    uninterrupted run. DCP keys are ``<part>.state.<parameter>.<state name>``. Returns whether any was dropped."""
    keys = SafeFileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    saved = {k.rsplit(".", 1)[0] for k in keys if k.startswith(f"{part}.state.")}
    unsaved = [n for n in optimizer_state["state"] if f"{part}.state.{n}" not in saved]
    for name in unsaved:
        del optimizer_state["state"][name]
    return bool(unsaved)


def find_resume(resume: str | None, outputs: str | None) -> tuple[Path | None, str | None]:
    """The checkpoint ``--resume`` names (``auto``: the newest in ``outputs``, if any) and the run folder to
    write to (``outputs``, or the resumed checkpoint's run folder).

    Raises:
        UserError: nothing to resume at the path, or ``outputs`` holds checkpoints newer than the one named
            (two histories would mix).
    """
    if resume is None:
        return None, outputs
    if resume == "auto":  # the newest whose manifest reads; the trainer checks its files (``newest_intact``)
        found = [p for p in list_checkpoints(Path(outputs)) if damage_of_meta(p) is None] if outputs else []
        return (found[-1] if found else None), outputs
    ckpt = resolve_checkpoint(resume)
    outputs = outputs or str(ckpt.parent.parent)
    step = int(read_meta(ckpt)["step"])
    newer = [p.name for p in list_checkpoints(Path(outputs)) if int(p.name.split("-")[1]) > step]
    if newer:
        raise UserError(f"--resume {ckpt}: {outputs} holds newer checkpoints ({', '.join(newer)}); resume into "
                        "another --outputs folder so the two histories do not mix")
    return ckpt, outputs
