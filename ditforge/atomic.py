"""Nothing written is ever left half-written: files are written under a temporary name, then renamed."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (``.NAME.<pid>.tmp`` + ``suffix``, for writers that insist on an
    extension); when the block succeeds it is renamed onto ``path`` (atomic on POSIX file systems), when it
    fails it is removed. Creates the parent folder. The process id keeps processes that write the same file at
    once (ranks and loader workers copying one remote shard into the cache) out of each other's temporary file;
    the last rename wins, and every one is whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``path`` (``.NAME.tmp``); when the block succeeds it replaces
    ``path`` (an existing folder is moved aside first and removed after the rename), when it fails it is removed.
    A crash leaves either the old folder or the new one under ``path``, never a half-written one."""
    import shutil

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
