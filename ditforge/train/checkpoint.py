"""Checkpoints: a folder per step with safetensors files and a JSON manifest; nothing needs pickle to load.

Layout of ``RUN/checkpoints/step-0000100/``:
    model.safetensors      the trained weights (official DiT key names)
    ema.safetensors        the EMA weights
    optimizer.safetensors  optimizer state tensors; its hyper-parameters in the file's metadata
    meta.json              step, the resolved config, grad-scaler state, format version

The folder is written under a temporary name and renamed when complete, so a crash mid-save never leaves
a checkpoint that looks whole. Randomness in training is counter-based (derived from the seed and the
step), so (seed, step) is the whole RNG state.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ditforge.errors import UserError

FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}


def optimizer_to_flat(opt_state: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Split ``optimizer.state_dict()`` into safetensors tensors (``state.<param>.<name>``) and JSON metadata."""
    tensors, scalars = {}, {}
    for pid, state in opt_state["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"state.{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{name}"] = value
    return tensors, {"param_groups": json.dumps(opt_state["param_groups"]), "scalars": json.dumps(scalars)}


def optimizer_from_flat(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict:
    """Inverse of ``optimizer_to_flat``: a dict ``optimizer.load_state_dict`` accepts."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = value
    for key, value in json.loads(metadata.get("scalars", "{}")).items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    return {"state": state, "param_groups": json.loads(metadata["param_groups"])}


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: dict[str, torch.Tensor],
    ema: dict[str, torch.Tensor],
    optimizer: dict,
    meta: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write ``run_dir/checkpoints/step-<step>`` atomically and delete all but the newest ``keep_last``.

    Args:
        model, ema: state dicts; optimizer: ``optimizer.state_dict()``; meta: JSON-able extras (config, ...).

    Returns:
        The checkpoint folder.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:07d}"
    for stale in root.glob(".tmp-step-*"):  # left by a save that crashed; one writer per run
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step:07d}-{os.getpid()}"
    tmp.mkdir()
    save_file(_tensors(model), tmp / "model.safetensors")
    save_file(_tensors(ema), tmp / "ema.safetensors")
    opt_tensors, opt_meta = optimizer_to_flat(optimizer)
    save_file(opt_tensors, tmp / "optimizer.safetensors", metadata=opt_meta)
    (tmp / "meta.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "step": step, **meta}, indent=1))
    if final.exists():  # the same step saved again (Ctrl-C right after a periodic save): same state, keep it
        shutil.rmtree(tmp)
        return final
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


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


def read_optimizer(ckpt: Path) -> dict:
    """The optimizer state dict saved in a checkpoint folder."""
    from safetensors import safe_open

    path = Path(ckpt) / "optimizer.safetensors"
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError) as e:
        raise UserError(f"{path}: unreadable safetensors file ({e})") from None
    return optimizer_from_flat(tensors, metadata)


def load_weights(path: str | Path, use_ema: bool = True) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Model weights for sampling or export, and the saved run config when there is one.

    Accepts a run folder (its newest checkpoint), a checkpoint folder, a ``.safetensors`` file (written by
    ``ditforge train`` or ``export``), or an official DiT ``.pt`` state dict (read with
    ``torch.load(weights_only=True)``: no code runs; a DiT ``train.py`` checkpoint gives its ``ema``).

    Returns:
        (state_dict, config dict or None). The config is ``RunConfig.to_dict()`` of the run that saved it.

    Raises:
        UserError: missing or unreadable file, or a file that holds no state dict.
    """
    p = Path(path)
    if p.is_dir():
        ckpt = resolve_checkpoint(p)
        name = "ema.safetensors" if use_ema else "model.safetensors"
        return read_tensors(ckpt / name), read_meta(ckpt).get("config")
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
