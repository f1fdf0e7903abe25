"""Checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards, any world size and
any plugin can load them (DCP reshards), saves can run in the background, and a crash never corrupts the
last good checkpoint.

Layout of ``RUN/checkpoints/step-0000100/``:
    .metadata, __<rank>_0.distcp   DCP: ``model``, ``optimizer`` and ``ema`` state, keyed by the plain model's
                                   parameter names (the official DiT names), sharded as they were in training
    meta.json                      step, the resolved config, grad-scaler state, world size and plugin

The folder is written under a temporary name and renamed by rank 0 once every rank's data and DCP's
metadata are on disk. Randomness in training is counter-based (derived from the seed and the step), so
(seed, step) is the whole RNG state, and the data position is the step.

DCP's ``.metadata`` is a pickle; it is read here with an unpickler that admits only DCP's metadata classes
and torch dtypes, and the optimizer's non-tensor entries with ``torch.load(weights_only=True)``, so loading
a checkpoint runs no code. ``ditforge export`` writes one safetensors file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
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

# DCP says so whenever it runs without a process group, which is how one process saves and loads on purpose.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

FORMAT_VERSION = 2
_STEP_DIR = re.compile(r"^step-(\d+)$")


_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "_MEM_FORMAT_ENCODING", "MetadataIndex", "StorageMeta")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits exactly the classes DCP's metadata holds (and torch dtypes); anything else, code included,
    is refused. Dotted names are refused too: they would reach attributes of an admitted module."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _METADATA_CLASSES:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries (optimizer hyper-parameters) with
    ``torch.load(weights_only=True)`` instead of a full unpickle."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with the restricted metadata unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp.Metadata:
        try:
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        except (OSError, pickle.UnpicklingError, EOFError) as e:
            raise UserError(f"{self.path}: unreadable checkpoint metadata ({e})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA,
                   adapters_only: bool = False) -> dict[str, Any]:
    """The state DCP saves and loads in place: model and optimizer by plain parameter names, and the EMA.
    ``adapters_only`` (LoRA): the model's trainable parameters alone; the frozen base comes from ``--init_from``."""
    options = StateDictOptions(ignore_frozen_params=adapters_only)
    return {
        "model": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
        "ema": ema.state_dict(),
    }


class Checkpointer:
    """Saves ``RUN/checkpoints/step-*`` collectively, synchronously or in the background, atomically.

    Args:
        run_dir: the run folder. keep_last: how many complete checkpoints to keep.
        last_step: the step of the checkpoint the run resumed from (saving that step again is a no-op).
        async_save: return as soon as the state is staged in host memory and write it in a background
            thread (``dcp.async_save``); the next save, or ``wait()``, completes the previous one.
        d: this process's ``Dist``; a separate gloo group carries the background save's collectives so they
            never interleave with training's.
    """

    def __init__(self, run_dir: Path, keep_last: int, async_save: bool, d: Dist, last_step: int | None = None):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last, self.async_save, self.dist, self.last_step = keep_last, async_save, d, last_step
        self.group = dist.new_group(backend="gloo") if d.mesh is not None else None
        self.pending: tuple[Future, Path, Path, dict] | None = None
        # On GPUs an async save copies the state into pinned host buffers (allocated once, reused by every
        # save) on a side stream while the next forward/backward runs; ``wait_for_staging`` (an optimizer
        # pre-step hook) holds back only the next weight update, then starts the background write.
        self.host_state: dict[str, Any] | None = None
        self.stream = torch.cuda.Stream(d.device) if async_save and d.device.type == "cuda" else None
        self.staged: tuple[torch.cuda.Event, dict, Path, Path, dict] | None = None

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Save ``state`` (see ``training_state``) and ``meta`` as step ``step``; returns the final folder."""
        self.wait()
        final = self.root / f"step-{step:07d}"
        if step == self.last_step:  # saved already (Ctrl-C right after a periodic save): the same state
            return final
        tmp = self.root / f".tmp-step-{step:07d}"
        if self.dist.is_main:
            for stale in [*self.root.glob(".tmp-step-*"), *self.root.glob(".tmp-delete-*")]:  # left by a crash
                shutil.rmtree(stale, ignore_errors=True)
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
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group,
                                    no_dist=self.group is None)
            self.pending = (future, tmp, final, meta)
        else:
            with _interrupts_unwrapped():
                dcp.save(state, checkpoint_id=str(tmp), process_group=self.group, no_dist=self.group is None)
            self._finish(tmp, final, meta)
        self.last_step = step  # (a background save that fails later clears it again in ``wait``)
        return final

    def wait_for_staging(self) -> None:
        """Block until the state being saved is copied off the device (call before it is next modified),
        then start writing the host copy in the background."""
        if self.staged is not None:
            copied, staged, tmp, final, meta = self.staged
            self.staged = None
            copied.synchronize()
            future = dcp.async_save(staged, checkpoint_id=str(tmp), process_group=self.group,
                                    no_dist=self.group is None, async_stager=_AlreadyStaged())
            self.pending = (future, tmp, final, meta)

    def wait(self) -> None:
        """Complete a background save: wait for its writes, then publish it."""
        self.wait_for_staging()
        if self.pending is not None:
            future, tmp, final, meta = self.pending
            self.pending = None
            try:
                with _interrupts_unwrapped():
                    future.result()
            except BaseException:
                self.last_step = None  # not published: saving this step again must really save
                raise
            self._finish(tmp, final, meta)

    def _finish(self, tmp: Path, final: Path, meta: dict) -> None:
        # On rank 0, DCP returns once every rank's data and the global metadata are written.
        if self.dist.is_main:
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            os.replace(tmp, final)
            for old in list_checkpoints(self.root.parent)[: -self.keep_last]:
                doomed = old.with_name(f".tmp-delete-{old.name}")  # out of the listing before it is half gone
                os.replace(old, doomed)
                shutil.rmtree(doomed, ignore_errors=True)


def _rank_failures(e: CheckpointException) -> list[BaseException]:
    """The exceptions DCP collected from the ranks; each arrives as (exception, traceback frames) or as a
    wrapper holding ``.exception``."""
    return [f[0] if isinstance(f, tuple) else getattr(f, "exception", f) for f in e.failures.values()]


@contextlib.contextmanager
def _interrupts_unwrapped():
    """DCP wraps every exception of a save, Ctrl-C included, in CheckpointException (a BaseException);
    let a KeyboardInterrupt be one again, so the trainer and the CLI treat it as Ctrl-C."""
    try:
        yield
    except CheckpointException as e:
        if any(isinstance(x, KeyboardInterrupt) for x in _rank_failures(e)):
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
    state = training_state(model, optimizer, ema, adapters_only)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=_SafeLoadPlanner(),
                 no_dist=not dist.is_initialized())
    except (CheckpointException, RuntimeError, ValueError, KeyError) as e:  # DCP's mismatch errors vary
        raise UserError(f"--resume: {ckpt} does not fit the configured model ({_describe(e)})") from None
    options = StateDictOptions(ignore_frozen_params=adapters_only, strict=not adapters_only)
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    return meta


def _describe(e: BaseException) -> str:
    """One line for a load error; DCP wraps each rank's exception (and its traceback) in CheckpointException."""
    if isinstance(e, CheckpointException) and e.failures:
        e = _rank_failures(e)[0]
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def find_resume(resume: str | None, outputs: str | None) -> tuple[Path | None, str | None]:
    """The checkpoint ``--resume`` names (``auto``: the newest in ``outputs``, if any) and the run folder to
    write to (``outputs``, or the resumed checkpoint's run folder).

    Raises:
        UserError: nothing to resume at the path, or ``outputs`` holds checkpoints newer than the one named
            (two histories would mix).
    """
    if resume is None:
        return None, outputs
    if resume == "auto":
        found = list_checkpoints(Path(outputs)) if outputs else []
        return (found[-1] if found else None), outputs
    ckpt = resolve_checkpoint(resume)
    outputs = outputs or str(ckpt.parent.parent)
    step = int(read_meta(ckpt)["step"])
    newer = [p.name for p in list_checkpoints(Path(outputs)) if int(p.name.split("-")[1]) > step]
    if newer:
        raise UserError(f"--resume {ckpt}: {outputs} holds newer checkpoints ({', '.join(newer)}); resume into "
                        "another --outputs folder so the two histories do not mix")
    return ckpt, outputs


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a run folder (its newest checkpoint) or a checkpoint folder.

    Raises:
        UserError: nothing there, or a run folder without checkpoints.
    """
    p = Path(path)
    if (p / "meta.json").is_file():
        return p
    if p.is_dir():
        found = list_checkpoints(p)
        if found:
            return found[-1]
        raise UserError(f"{path}: no checkpoint in this folder (expected checkpoints/step-*/ or meta.json)")
    raise UserError(f"{path}: no such checkpoint folder")


def read_meta(ckpt: Path) -> dict:
    """The manifest of a checkpoint folder. Raises UserError if missing or not JSON."""
    try:
        return json.loads((Path(ckpt) / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{ckpt}: unreadable checkpoint manifest meta.json ({e})") from None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file to CPU. Raises UserError naming the file if it is missing or corrupt."""
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise UserError(f"{path}: unreadable safetensors file ({e})") from None


def read_checkpoint_weights(ckpt: Path, skeleton: dict[str, torch.Tensor], use_ema: bool = True) -> dict:
    """Full (unsharded) EMA or model weights of a DCP checkpoint, read in one process into ``skeleton``
    (a plain model's state dict, whose tensors are overwritten and returned)."""
    key = "ema" if use_ema else "model"
    state = {key: skeleton}
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=_SafeLoadPlanner(), no_dist=True)
    except (CheckpointException, RuntimeError, ValueError, KeyError) as e:
        raise UserError(f"--ckpt: {ckpt} does not fit the model ({_describe(e)})") from None
    return state[key]


def load_weights(path: str | Path, use_ema: bool = True) -> tuple[dict[str, torch.Tensor] | Path, dict | None]:
    """Weights for sampling or export, and the saved run config when there is one.

    Accepts a run folder (its newest checkpoint), a checkpoint folder, a ``.safetensors`` file (written by
    ``ditforge export``), a diffusers DiT folder (``ditforge.interop.load_diffusers``: a ``DiTPipeline`` folder or
    its ``transformer/``), or an official DiT ``.pt`` state dict (read with ``torch.load(weights_only=True)``:
    no code runs; a DiT ``train.py`` checkpoint gives its ``ema``).

    Returns:
        (state_dict, config dict or None), or for a DCP checkpoint (its folder, config): its tensors are read
        with ``read_checkpoint_weights`` once the model they fit is built.

    Raises:
        UserError: missing or unreadable file, or a file that holds no state dict.
    """
    p = Path(path)
    if p.is_dir():
        from ditforge.interop import is_diffusers_folder, load_diffusers

        if is_diffusers_folder(p):  # written by `ditforge export --format diffusers`, or a diffusers DiT
            return load_diffusers(p)
        ckpt = resolve_checkpoint(p)
        return ckpt, read_meta(ckpt).get("config")
    if not p.is_file():
        raise UserError(f"--ckpt: {path} does not exist")
    if p.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(p), framework="pt") as f:
                config = json.loads(f.metadata().get("config", "null")) if f.metadata() else None
        except (OSError, SafetensorError, json.JSONDecodeError) as e:
            raise UserError(f"--ckpt: {path}: unreadable safetensors file ({e})") from None
        return read_tensors(p), config
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for bad or unsafe pickles; all mean "not a state dict"
        detail = " ".join(str(e).split())[:200]
        raise UserError(f"--ckpt: {path} is not a readable PyTorch state dict ({type(e).__name__}: {detail})") from None
    if isinstance(obj, dict) and "ema" in obj and isinstance(obj["ema"], dict):
        obj = obj["ema"] if use_ema else obj.get("model", obj["ema"])
    if not isinstance(obj, dict) or not all(torch.is_tensor(v) for v in obj.values()):
        raise UserError(f"--ckpt: {path} does not hold a state dict of tensors")
    return obj, None


def export_safetensors(state: dict[str, torch.Tensor], config: dict | None, out: Path) -> None:
    """Write one consolidated safetensors file (the run config in its metadata), atomically."""
    from safetensors.torch import save_file

    with atomic_path(out) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"config": json.dumps(config)})
