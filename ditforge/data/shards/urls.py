"""Finding shards: patterns expanded to files or URLs (fsspec: any storage), and the local cache of remote shards."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path

from ditforge.atomic import atomic_path


def _fs(url: str):
    import fsspec

    return fsspec.core.url_to_fs(url)


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def expand_urls(pattern: str) -> list[str]:
    """The shard files of one set: brace lists expanded (``shard-{000..009}.tar``), then each part a folder (its
    ``*.tar``, sorted), a glob, or a file; local paths stay paths, others stay URLs. Missing files are kept
    (``resolve_sets`` decides what a missing file means)."""
    from braceexpand import braceexpand

    urls: list[str] = []
    for part in braceexpand(pattern):
        fs, path = _fs(part)
        local = _is_local(part)
        name = (lambda p: p) if local else fs.unstrip_protocol
        if any(c in path for c in "*?["):
            urls += [name(p) for p in sorted(fs.glob(path))]
        elif fs.isdir(path):
            urls += [name(p) for p in sorted(fs.glob(path.rstrip("/") + "/*.tar"))]
        else:
            urls.append(part if not part.startswith("file://") else path)
    return urls


def shard_cache_dir() -> Path:
    """Where remote shards are copied: ``$DITFORGE_SHARD_CACHE``, else ``~/.cache/ditforge/shards``; at most
    ``$DITFORGE_SHARD_CACHE_GB`` (default 100) GiB, least recently used copies deleted first."""
    return Path(os.environ.get("DITFORGE_SHARD_CACHE") or Path.home() / ".cache" / "ditforge" / "shards")


def local_copy(url: str) -> Path:
    """A local path of shard ``url``: the file itself, or a whole copy in ``shard_cache_dir()`` (named by a hash
    of the URL; copied under a temporary name, then renamed, so a half copy is never used).

    Raises:
        OSError (FileNotFoundError included): the file cannot be read.
    """
    if _is_local(url):
        return Path(_fs(url)[1])
    local = shard_cache_dir() / f"{hashlib.sha1(url.encode()).hexdigest()[:16]}-{url.rsplit('/', 1)[-1]}"
    if local.is_file():
        os.utime(local)  # recently used: evicted last
        return local
    import fsspec

    with fsspec.open(url, "rb") as src, atomic_path(local) as tmp, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 22)
    _evict(local)
    return local


def _evict(keep: Path) -> None:
    """Keep the cache under ``$DITFORGE_SHARD_CACHE_GB`` (default 100) GiB: delete the least recently used copies
    (by modification time, which ``local_copy`` refreshes on every use), never ``keep``. A process that still
    has a deleted copy mmapped keeps reading it (POSIX); one that wants it again copies it again."""
    limit = float(os.environ.get("DITFORGE_SHARD_CACHE_GB") or 100) * 2**30
    files = []
    for f in keep.parent.iterdir():
        with contextlib.suppress(OSError):  # another process may delete it meanwhile
            if f.is_file() and not f.name.startswith("."):
                st = f.stat()
                files.append((st.st_mtime, st.st_size, f))
    total = sum(size for _, size, _ in files)
    for _, size, f in sorted(files):
        if total <= limit:
            break
        if f != keep:
            with contextlib.suppress(OSError):
                f.unlink()
                total -= size
