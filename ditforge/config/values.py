"""Flag values turned into what the code uses: sizes in bytes, the activation-checkpointing policy, the device,
the compute dtype and the trackers."""

from __future__ import annotations

import re
import typing

from ditforge.config.sections import REPORT_TO
from ditforge.errors import UserError

if typing.TYPE_CHECKING:
    import torch


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str, flag: str) -> int:
    """``"8GiB"`` -> 8 * 2**30 bytes (units B, KiB, MiB, GiB, TiB and their powers of ten KB, MB, GB, TB; case
    does not matter; a bare number is bytes).

    Raises:
        UserError: not a positive size, naming ``flag``.
    """
    s = str(text).strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    try:
        value = float(number) * _UNITS[s[len(number):]]
    except (KeyError, ValueError):
        value = -1
    if not value > 0:
        raise UserError(f"{flag}: expected a size such as 8GiB, got {text!r}")
    return int(value)


CHECKPOINT_POLICIES = "none | full | every-K | op | attn"
_EVERY = re.compile(r"^every-([1-9][0-9]*)$")


def parse_checkpoint_policy(policy: str) -> tuple[str, int]:
    """``--grad_checkpoint`` value -> (kind, k): ``none``, ``full`` (every block), ``every-K`` (blocks
    0, K, 2K, ...: 1/K of the recomputation for 1/K of the saving), ``op`` (every block, but the outputs of
    matrix products and attention are kept and only the cheap element-wise ops are recomputed; torchtitan's
    op-level selective checkpointing), ``attn`` (every block, keeping the attention outputs alone: long video
    sequences, where attention's quadratic cost dominates and the matrix products' outputs are the memory).

    Raises:
        UserError: any other value (names the flag and the choices).
    """
    if policy in ("none", "full", "op", "attn"):
        return policy, 1
    m = _EVERY.match(policy)
    if not m:
        raise UserError(f"--grad_checkpoint: expected one of {CHECKPOINT_POLICIES}, got {policy!r}")
    return "every", int(m.group(1))


def resolve_device(name: str | torch.device) -> torch.device:
    """``--device`` value (or a ``torch.device``) -> ``torch.device``: ``auto`` is cuda when available, else cpu.

    Raises:
        UserError: cuda asked on a machine without a GPU.
    """
    import torch  # deferred: the command line's --help should not pay for importing torch

    name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA GPU is available")
    return torch.device(name)


def resolve_precision(name: str, device: torch.device) -> torch.dtype:
    """``--mixed_precision`` -> compute dtype: fp32 | bf16 | fp16; ``auto`` is bf16 on CUDA (where supported),
    fp32 on CPU; fp8 computes in bf16 around its float8 matrix products."""
    import torch

    if name == "auto":
        name = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}[name]


def report_backends(report_to: str) -> tuple[str, ...]:
    """``--report_to`` -> the trackers to write to, of ``("tensorboard", "wandb")``; ``auto`` is tensorboard
    when the ``tensorboard`` package is installed, else none.

    Raises:
        UserError: an unknown value, or a tracker named (tensorboard, wandb, all) whose package is not installed.
    """
    import importlib.util

    if report_to not in REPORT_TO:
        raise UserError(f"--report_to: expected one of {', '.join(REPORT_TO)}, got {report_to}")
    wanted = {"auto": ("tensorboard",), "all": ("tensorboard", "wandb"), "none": ()}.get(report_to, (report_to,))
    installed = tuple(b for b in wanted if importlib.util.find_spec(b) is not None)
    missing = [b for b in wanted if b not in installed]
    if missing and report_to != "auto":
        hint = "pip install 'ditforge[tensorboard]'" if missing[0] == "tensorboard" else "pip install wandb"
        raise UserError(f"--report_to {report_to}: {missing[0]} is not installed ({hint}), or use --report_to none")
    return installed
