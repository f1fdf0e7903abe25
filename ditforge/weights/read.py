"""Reading what ``ditforge train`` and ``ditforge export`` wrote, and the weight files of others: DCP checkpoint
folders, checked for damage first, ``.safetensors`` files, diffusers DiT folders and official DiT ``.pt`` files.

Layout of ``RUN/checkpoints/step-0000100/`` (written by ``ditforge.train.checkpoint``):
    .metadata, __<rank>_0.distcp   DCP: ``model``, ``optimizer`` and ``ema`` state, keyed by the plain model's
                                   parameter names (the official DiT names), sharded as they were in training
    meta.json                      step, the resolved config, grad-scaler state, world size and plugin, and
                                   each file's size and CRC-32 (computed while the file is written)

A resume, ``ditforge sample`` and ``export`` check every file against its size and CRC-32 first (``damage``): a
file damaged later (a bad disk, a truncated copy) is named.

DCP's ``.metadata`` is a pickle; it is read here with an unpickler that admits only DCP's metadata classes
and torch dtypes, and the optimizer's non-tensor entries with ``torch.load(weights_only=True)``, so loading
a checkpoint runs no code.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element

from ditforge.errors import UserError

# DCP says so whenever it runs without a process group, which is how one process saves and loads on purpose.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

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


def rank_failures(e: CheckpointException) -> list[BaseException]:
    """The exceptions DCP collected from the ranks; each arrives as (exception, traceback frames) or as a
    wrapper holding ``.exception``."""
    return [f[0] if isinstance(f, tuple) else getattr(f, "exception", f) for f in e.failures.values()]


def _describe(e: BaseException) -> str:
    """One line for a load error; DCP wraps each rank's exception (and its traceback) in CheckpointException."""
    if isinstance(e, CheckpointException) and e.failures:
        e = rank_failures(e)[0]
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def damage(ckpt: Path) -> str | None:
    """Why a checkpoint folder is damaged ("<file> <why>"), or None when ``meta.json`` reads and every file it
    records has its recorded size and CRC-32. Checkpoints of format 2 and older record none and pass unchecked.
    Reads every file once (about 4 GB/s of CRC-32 on one core, plus the disk)."""
    if (why := damage_of_meta(ckpt)) is not None:
        return why
    meta = read_meta(ckpt)
    for name, want in meta.get("files", {}).items():
        path = Path(ckpt) / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} were written"
        crc = 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
        if f"{crc:08x}" != want["crc32"]:
            return f"{name} fails its CRC-32 check (bytes changed since it was written)"
    return None


def check_intact(ckpt: Path, flag: str) -> None:
    """Raise UserError ``{flag}: <ckpt> is damaged: <file> <why>`` unless ``damage(ckpt)`` finds nothing."""
    why = damage(ckpt)
    if why is not None:
        raise UserError(f"{flag}: {ckpt} is damaged: {why}")


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


def damage_of_meta(ckpt: Path) -> str | None:
    """Why ``meta.json`` of a checkpoint folder does not read, or None."""
    try:
        json.loads((Path(ckpt) / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"meta.json unreadable ({type(e).__name__})"
    return None


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
        check_intact(ckpt, "--ckpt")
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
