"""Nothing written is ever left half-written: files are written under a temporary name, then renamed."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (``.NAME.tmp`` + ``suffix``, for writers that insist on an
    extension); when the block succeeds it is renamed onto ``path`` (atomic on POSIX file systems), when it
    fails it is removed. Creates the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
