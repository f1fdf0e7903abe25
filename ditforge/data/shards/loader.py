"""The shard data sets, their order and their loader (the format and the order: the package docstring)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import mmap
import os
import shutil
import tarfile
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ditforge.atomic import atomic_path
from ditforge.data.images import IMAGE_EXTENSIONS, error_text, report_bad_samples
from ditforge.data.prefetch import copy_bytes
from ditforge.data.sampler import derive_seed
from ditforge.errors import UserError

if TYPE_CHECKING:
    from ditforge.data.buckets import Buckets

log = logging.getLogger(__name__)

SHARDS_MANIFEST = "shards.json"
SHARDS_FORMAT = "ditforge-shards"
SHARDS_VERSION = 1
SHARD_PATTERN = "shard-{:05d}.tar"
BLEND_KEY = 0x626C656E  # separates the blend draws' seeds from the order's
BLEND_BLOCK = 4096
IMAGE_FIELDS = tuple(e.lstrip(".") for e in sorted(IMAGE_EXTENSIONS))
VIDEO_FIELDS = ("mp4", "avi", "mov", "mkv", "webm")  # video.VIDEO_EXTENSIONS; that module needs PyAV
SAME_LATENTS = ("condition", "vae", "text_encoder", "text_max_length", "text_dim", "in_channels", "input_size",
                "num_frames", "image_size", "stochastic")  # what every set of a latent blend must share
NUM_TEXTS = 64  # captions kept in the manifest for the sample grids
HISTORY = 8  # loader states kept, by step: a prefetcher may read up to HISTORY - 1 batches ahead
INCOMPLETE_MARKER = ".ditforge-writing"  # a shard folder ditforge is writing (or was, when interrupted)


# ----------------------------------------------------------------------------------------------------------
# Writing


class ShardWriter:
    """Writes samples into ``out/shard-NNNNN.tar``, ``shard_size`` samples each, with ``webdataset.TarWriter``;
    every shard is written under a temporary name and renamed when full, ``close`` writes ``shards.json`` last.

    A sample is a dict ``{"__key__": str without dots, "<field>": bytes | str | int | np.ndarray}`` (TarWriter's
    encoders: ``npy`` via ``np.save``, ``cls`` as ASCII digits, ``txt`` as UTF-8, bytes as they are).

    Raises:
        UserError: ``out`` is a file, holds a shard set already or .tar files ditforge did not write;
            ``shard_size`` < 1.
    """

    def __init__(self, out: str | Path, shard_size: int):
        self.out = Path(out)
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"--out {out} is a file; expected a folder for the shards")
        if (self.out / SHARDS_MANIFEST).exists():
            raise UserError(f"--out {out} already holds shards ({SHARDS_MANIFEST}); choose another folder or delete "
                            "it first")
        if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
            raise UserError(f"--shard_size: expected a positive integer, got {shard_size!r}")
        marker = self.out / INCOMPLETE_MARKER  # present while ditforge writes here: its shards may be deleted
        if self.out.is_dir() and any(self.out.glob("*.tar")) and not marker.exists():
            raise UserError(f"--out {out} holds .tar files that ditforge did not write; choose another folder")
        self.out.mkdir(parents=True, exist_ok=True)
        marker.touch()
        for stale in self.out.glob("shard-*.tar"):  # from a run of ours that was interrupted: no manifest
            stale.unlink()
        self.shard_size = shard_size
        self.shards: list[dict] = []
        self._writer = self._file = self._tmp = None
        self._count = 0
        self.total = 0  # samples written

    def write(self, sample: dict) -> None:
        from webdataset import TarWriter

        if self._writer is None:
            self._tmp = self.out / f".{SHARD_PATTERN.format(len(self.shards))}.tmp"
            self._file = open(self._tmp, "wb")
            self._writer = TarWriter(self._file, mtime=0)  # fixed times: the same input gives the same bytes
        self._writer.write(sample)
        self._count += 1
        self.total += 1
        if self._count == self.shard_size:
            self.finish_shard()

    def finish_shard(self) -> None:
        """Close the current shard now (full or not); the next sample starts a new one."""
        self._writer.close()
        self._file.close()
        name = SHARD_PATTERN.format(len(self.shards))
        os.replace(self._tmp, self.out / name)
        self.shards.append({"file": name, "num_samples": self._count})
        self._writer = self._file = self._tmp = None
        self._count = 0

    def close(self, manifest: dict) -> dict:
        """Finish the last shard and write ``shards.json``: ``manifest`` plus format, version, ``shards`` (file,
        num_samples each) and ``num_samples``; returns what was written."""
        if self._writer is not None:
            self.finish_shard()
        full = {"format": SHARDS_FORMAT, "version": SHARDS_VERSION, **manifest, "shards": self.shards,
                "num_samples": sum(s["num_samples"] for s in self.shards)}
        with atomic_path(self.out / SHARDS_MANIFEST) as tmp:
            tmp.write_text(json.dumps(full, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        (self.out / INCOMPLETE_MARKER).unlink(missing_ok=True)
        log.info("wrote %d samples in %d shards to %s", full["num_samples"], len(self.shards), self.out)
        return full


# ----------------------------------------------------------------------------------------------------------
# Finding and opening shards


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


class _Unusual(Exception):
    """A tar header the fast reader leaves to ``tarfile``."""


def _ustar_entries(data: mmap.mmap, size: int) -> Iterator[tuple[str, int, int]]:
    """``(name, data offset, size)`` of the regular files of a plain ustar archive (what ``TarWriter`` writes),
    reading the 512-byte headers directly (POSIX.1-1988 ustar layout: name 0:100, size 124:136 octal, checksum
    148:156, type 156, magic 257:263, prefix 345:500): ~50x faster than ``tarfile``, which builds an object
    per member. Raises _Unusual at anything else (GNU long names, pax headers, base-256 sizes), and
    ``tarfile.ReadError`` at a bad checksum or a member running past the end of the file."""
    pos = 0
    while pos + 512 <= size:
        h = data[pos:pos + 512]
        if not any(h):  # the end-of-archive blocks
            return
        if h[257:262] != b"ustar" or h[156:157] in (b"L", b"K", b"x", b"g") or h[124] & 0x80:
            raise _Unusual
        try:
            checksum, length = int(h[148:156].strip(b"\0 ") or b"0", 8), int(h[124:136].strip(b"\0 ") or b"0", 8)
        except ValueError:
            raise tarfile.ReadError(f"bad header at byte {pos}") from None
        if checksum != sum(h[:148]) + 256 + sum(h[156:]):  # the checksum field counts as 8 spaces
            raise tarfile.ReadError(f"bad header checksum at byte {pos}")
        start = pos + 512
        if start + length > size:
            raise tarfile.ReadError(f"member at byte {pos} runs past the end of the file")
        if h[156:157] in (b"0", b"\0"):
            name = h[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            prefix = h[345:500].split(b"\0", 1)[0] if h[257:263] == b"ustar\0" else b""
            yield (f"{prefix.decode('utf-8', 'surrogateescape')}/{name}" if prefix else name), start, length
        pos = start + (length + 511) // 512 * 512
    raise tarfile.ReadError("the file ends without the end-of-archive blocks (truncated)")


def _tarfile_entries(f, size: int) -> Iterator[tuple[str, int, int]]:
    """As ``_ustar_entries``, through stdlib ``tarfile`` (every tar variant)."""
    with tarfile.open(fileobj=f, mode="r:") as tar:
        while (info := tar.next()) is not None:
            if not info.isfile():
                continue
            if info.offset_data + info.size > size:
                raise tarfile.ReadError(f"member {info.name} runs past the end of the file")
            yield info.name, info.offset_data, info.size


class ShardFile:
    """One tar shard, mmapped, with the offsets of its members (from the tar headers, stdlib ``tarfile``).

    Attributes: ``keys`` (sample keys in tar order), ``members`` (per sample: ``{field: (offset, size)}``),
    ``damage`` (why the index stops early, or None), ``data`` (the mmap; ``bytes(data[off:off+size])`` is a
    member). Members are grouped into samples by consecutive equal keys (``webdataset.tariterators.base_plus_ext``).

    Raises:
        OSError: the file cannot be opened (missing, unreadable, empty).
    """

    def __init__(self, url: str):
        self.url = url
        path = local_copy(url)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise OSError(f"{url} is empty")
            self.data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.keys: list[str] = []
            self.members: list[dict[str, tuple[int, int]]] = []
            self.damage: str | None = None
            try:
                try:
                    for entry in _ustar_entries(self.data, size):
                        self._add(*entry)
                except _Unusual:  # long names, pax headers, huge sizes: tarfile reads every variant
                    self.keys, self.members = [], []
                    f.seek(0)
                    for entry in _tarfile_entries(f, size):
                        self._add(*entry)
            except (tarfile.TarError, EOFError) as e:
                del self.keys[-1:], self.members[-1:]  # the sample at the damage may have lost members
                self.damage = f"truncated or corrupt tar after {len(self.keys)} samples ({error_text(e)})"

    def _add(self, name: str, offset: int, length: int) -> None:
        from webdataset.tariterators import base_plus_ext

        key, field = base_plus_ext(name)
        if key is None:
            return
        if not self.keys or self.keys[-1] != key:
            self.keys.append(key)
            self.members.append({})
        self.members[-1][field] = (offset, length)

    def __len__(self) -> int:
        return len(self.keys)

    def member(self, index: int, field: str) -> memoryview:
        off, size = self.members[index][field]
        return memoryview(self.data)[off:off + size]


def open_shard(url: str, retries: int, report: Callable[[str, str], None] | None = None,
               backoff: float = 0.1) -> ShardFile | None:
    """``ShardFile(url)``, tried ``retries`` more times (sleeping ``backoff``, doubling) while it fails or its
    index stops at damage (a copy in progress, a flaky mount); then the damaged index is used as it is (the
    members before the damage), or None when it never opened. ``report(url, error)`` is called for either."""
    error = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            shard = ShardFile(url)
        except (OSError, ValueError) as e:
            error, shard = error_text(e), None
            continue
        if shard.damage is None:
            return shard
        error = shard.damage
    if report is not None:
        report(url, error)
    return shard


# ----------------------------------------------------------------------------------------------------------
# Shard sets and blends


@dataclass
class ShardSet:
    """One data set of shards: ``path`` as given, ``weight`` in a blend, ``urls`` and ``counts`` (samples per
    shard: from ``shards.json``, else from a scan), ``manifest`` (``shards.json``'s dict, or None)."""

    path: str
    weight: float
    urls: list[str]
    counts: list[int]
    manifest: dict | None


def _read_manifest(urls: list[str]) -> dict | None:
    """``shards.json`` of the folder of the first shard, if there is one (checked: format and version)."""
    folder = urls[0].rsplit("/", 1)[0] if "/" in urls[0] else "."
    fs, path = _fs(f"{folder}/{SHARDS_MANIFEST}")
    try:
        if not fs.isfile(path):
            return None
        manifest = json.loads(fs.cat_file(path).decode("utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"--data: {folder}/{SHARDS_MANIFEST} is unreadable ({error_text(e)})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != SHARDS_FORMAT:
        raise UserError(f"--data: {folder}/{SHARDS_MANIFEST} is not a manifest of `ditforge shard` or "
                        "`ditforge extract-features --format wds`")
    if manifest.get("version") != SHARDS_VERSION:
        raise UserError(f"--data: {folder}/{SHARDS_MANIFEST} has version {manifest.get('version')!r}; this ditforge "
                        f"reads version {SHARDS_VERSION}: write the shards again")
    return manifest


def _exists(url: str) -> bool:
    fs, path = _fs(url)
    return fs.isfile(path)


def read_blend(path: str) -> list[tuple[str, float]]:
    """The ``(path, weight)`` entries of a blend file: a YAML list of ``{path: ..., weight: ...}`` (weight > 0,
    default 1); relative local paths are relative to the file's folder.

    Raises:
        UserError naming the file: unreadable, not such a list, a bad entry.
    """
    import yaml

    where = f"--data {path}"
    try:
        fs, p = _fs(path)
        entries = yaml.safe_load(fs.cat_file(p).decode("utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise UserError(f"{where}: unreadable blend file ({error_text(e).splitlines()[0]})") from None
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{where}: expected a YAML list of {{path: ..., weight: ...}}")
    out = []
    base = path.rsplit("/", 1)[0] if "/" in path else "."
    for i, e in enumerate(entries):
        weight = e.get("weight", 1.0) if isinstance(e, dict) else None
        if (not isinstance(e, dict) or not isinstance(e.get("path"), str) or isinstance(weight, bool)
                or not isinstance(weight, (int, float)) or not weight > 0 or not math.isfinite(weight)):
            raise UserError(f"{where}: entry {i} must be {{path: <shards>, weight: <number > 0>}}, got {e!r}")
        p = e["path"]
        if _is_local(p) and not os.path.isabs(p) and _is_local(path):
            p = os.path.join(base, p)
        out.append((p, float(weight)))
    return out


def resolve_sets(data: str, retries: int = 3, report: Callable[[str, str], None] | None = None) -> list[ShardSet]:
    """The shard sets of ``--data``: a blend file's entries, or the one set of a folder, glob, brace list, file or
    URL. Sample counts come from ``shards.json``; shards it does not list are opened and counted now
    (``open_shard``: an unreadable one counts 0 and is reported).

    Raises:
        UserError (one line, naming the path): a set with no shard file at all (all missing or no match); a
            set's manifest unreadable; sets of different kinds in one blend (see ``SAME_LATENTS``).
    """
    entries = read_blend(data) if data.lower().endswith((".yaml", ".yml")) else [(data, 1.0)]
    sets = []
    for path, weight in entries:
        urls = [u for u in expand_urls(path) if _exists(u)]
        if not urls:
            raise UserError(f"--data {data}: no shard file found at {path}")
        manifest = _read_manifest(urls)
        listed = {s["file"]: s["num_samples"] for s in manifest["shards"]} if manifest else {}
        counts = []
        for u in urls:
            name = u.rsplit("/", 1)[-1]
            if name in listed:
                counts.append(int(listed[name]))
            else:
                shard = open_shard(u, retries, report)
                counts.append(len(shard) if shard is not None else 0)
        if not sum(counts):
            raise UserError(f"--data {data}: the shards at {path} hold no readable sample")
        sets.append(ShardSet(path, weight, urls, counts, manifest))
    kinds = {_kind(s) for s in sets}
    if len(kinds) > 1:
        raise UserError(f"--data {data}: every set of a blend must hold the same kind of samples; found "
                        f"{', '.join(sorted(str(k) for k in kinds))}")
    return sets


def _kind(s: ShardSet) -> tuple:
    m = s.manifest or {"kind": "raw"}
    if m.get("kind") == "latent":
        return ("latent", *(m.get(k) for k in SAME_LATENTS))
    return ("raw",)  # images and videos may blend (with --buckets; ShardData says so otherwise)


# ----------------------------------------------------------------------------------------------------------
# The order


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
    samples passed over so far). ``take(n)`` returns the next n ``(shard, member)`` of the order (see the module
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


# ----------------------------------------------------------------------------------------------------------
# Decoding


_NPY_HEADERS: dict[bytes, tuple[np.dtype, tuple[int, ...], int]] = {}


def decode_npy(buf: memoryview) -> np.ndarray:
    """An ``.npy`` member as an array viewing ``buf`` (the header parsed by ``numpy.lib.format`` once per distinct
    header, then cached: a batch of same-shaped members costs one slice each).

    Raises:
        ValueError: not an npy file, a Fortran-order or object array, or a size that does not match the header.
    """
    if bytes(buf[:6]) != b"\x93NUMPY":
        raise ValueError("not an npy member")
    major = buf[6]
    start = 10 if major == 1 else 12
    if len(buf) < start:
        raise ValueError("truncated npy header")
    hlen = int.from_bytes(buf[8:start], "little")
    header = bytes(buf[:start + hlen])
    known = _NPY_HEADERS.get(header)
    if known is None:
        f = io.BytesIO(header)
        fmt = np.lib.format
        read = fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read(f)
        if fortran or dtype.hasobject:
            raise ValueError("npy member is Fortran-ordered or holds objects")
        known = _NPY_HEADERS[header] = (dtype, shape, start + hlen)
    dtype, shape, offset = known
    count = math.prod(shape)
    if len(buf) - offset != count * dtype.itemsize:
        raise ValueError(f"npy member holds {len(buf) - offset} bytes, its header says {count * dtype.itemsize}")
    return np.frombuffer(buf, dtype, count, offset).reshape(shape)


class LatentDecoder:
    """Latent samples -> ``FeatureDataset``'s item layout, collated: ``mean`` (B, C, [T,] h, w) in the stored
    dtype (``BatchEncoder.moments`` casts to float32), ``std`` (stochastic features), ``label`` (B,) int64, and
    for the text condition ``text_states`` (B, text_max_length, D) float32 zero-padded, ``text_mask`` (B, L) bool,
    ``text`` (list of str)."""

    def __init__(self, manifest: dict):
        self.stochastic = bool(manifest.get("stochastic"))
        self.text = manifest.get("condition") == "text"
        self.length, self.dim = manifest.get("text_max_length"), manifest.get("text_dim")

    def __call__(self, shard: ShardFile, i: int) -> tuple:
        mean = decode_npy(shard.member(i, "latent.npy"))
        std = decode_npy(shard.member(i, "std.npy")) if self.stochastic else None
        label = int(bytes(shard.member(i, "cls"))) if "cls" in shard.members[i] else 0
        if not self.text:
            return mean, std, label, None, None
        states = decode_npy(shard.member(i, "text.npy"))
        if states.ndim != 2 or states.shape[1] != self.dim or not 1 <= len(states) <= self.length:
            raise ValueError(f"text.npy of shape {states.shape}, expected (1..{self.length}, {self.dim})")
        return mean, std, label, states, str(shard.member(i, "txt"), "utf-8")

    def collate(self, items: list[tuple]) -> dict:
        batch: dict[str, Any] = {"mean": torch.from_numpy(np.stack([it[0] for it in items])),
                                 "label": torch.tensor([it[2] for it in items], dtype=torch.int64)}
        if self.stochastic:
            batch["std"] = torch.from_numpy(np.stack([it[1] for it in items]))
        if self.text:
            states = torch.zeros(len(items), self.length, self.dim)
            mask = torch.zeros(len(items), self.length, dtype=torch.bool)
            for k, it in enumerate(items):
                states[k, :len(it[3])] = torch.from_numpy(it[3].astype(np.float32))
                mask[k, :len(it[3])] = True
            batch |= {"text_states": states, "text_mask": mask, "text": [it[4] for it in items]}
        return batch


class RawDecoder:
    """Raw samples -> the image and video data sets' layout, collated: ``x`` (B, 3, S, S) for images
    (``captions.load_image``: EXIF orientation, ``resize_mode``) or (B, 3, T, S, S) for videos (``num_frames``
    given: ``video.read_clip`` from the member's bytes, frames ``frame_interval`` apart from a start drawn from
    ``derive_seed(seed, crc32(key))``, each frame centre-cropped as ``VideoDataset`` does), float32 in [-1, 1];
    ``label`` (B,) int64 where samples have ``cls``, ``text`` (list of str) where they have ``txt``."""

    def __init__(self, image_size: int, resize_mode: str, labels: bool, captions: bool, num_frames: int | None = None,
                 frame_interval: int = 3, seed: int = 0, buckets: Buckets | None = None):
        self.image_size, self.resize_mode, self.labels, self.captions = image_size, resize_mode, labels, captions
        self.num_frames, self.frame_interval, self.seed, self.buckets = num_frames, frame_interval, seed, buckets
        self.fields = (IMAGE_FIELDS + VIDEO_FIELDS if buckets is not None else
                       IMAGE_FIELDS if num_frames is None else VIDEO_FIELDS)

    def __call__(self, shard: ShardFile, i: int) -> tuple:
        members = shard.members[i]
        field = next((f for f in members if f.lower() in self.fields), None)
        if field is None:
            raise ValueError(f"no {'image' if self.num_frames is None else 'video'} member (one of "
                             f"{', '.join(self.fields)}) in {', '.join(members)}")
        data, key = bytes(shard.member(i, field)), shard.keys[i]
        video = field.lower() in VIDEO_FIELDS
        if self.buckets is None and not video:
            from ditforge.data.captions import load_image

            x = load_image(io.BytesIO(data), self.image_size, self.resize_mode)
        else:
            x = self._clip(data, video, key)
        label = int(bytes(shard.member(i, "cls"))) if self.labels else 0
        text = str(shard.member(i, "txt"), "utf-8") if self.captions else None
        return x, label, text

    def _clip(self, data: bytes, video: bool, key: str) -> torch.Tensor:
        """``read_at_bucket`` of a video at (``num_frames``, ``image_size``, ``image_size``), or with --buckets of
        any sample at the bucket ``Buckets.assign_bucket`` gives it from its size and a draw seeded by (seed, key):
        the same in every epoch and at every world size (``DroppedByBucket`` when no keep draw keeps it)."""
        from ditforge.data.buckets import Bucket, probe_size, read_at_bucket
        from ditforge.data.video import DECODE_ERRORS as VIDEO_ERRORS

        seed = derive_seed(self.seed, zlib.crc32(key.encode()))
        try:
            if self.buckets is None:
                bucket = Bucket(resolution=str(self.image_size), num_frames=self.num_frames, height=self.image_size,
                                width=self.image_size, batch_size=0, keep_prob=1.0)
            else:
                bucket = self.buckets.assign_bucket(*probe_size(data, video), seed)
            x = None if bucket is None else read_at_bucket(data, bucket, self.frame_interval, seed)
        except VIDEO_ERRORS as e:  # FFmpeg's errors are not all OSErrors: one kind for the reader to skip
            raise ValueError(error_text(e)) from e
        if x is None:
            raise DroppedByBucket(key)
        return x if self.num_frames is not None else x[:, 0]

    def collate(self, items: list[tuple]) -> dict:
        xs = [it[0] for it in items]  # --buckets: shapes differ, the trainer packs them (train.mixed)
        batch: dict[str, Any] = {"x": xs if self.buckets is not None else torch.stack(xs)}
        if self.labels:
            batch["label"] = torch.tensor([it[1] for it in items], dtype=torch.int64)
        if self.captions:
            batch["text"] = [it[2] for it in items]
        return batch


# ----------------------------------------------------------------------------------------------------------
# Streams, the iterable data set, the loader


DECODE_ERRORS = (OSError, ValueError, KeyError, IndexError, SyntaxError, UnicodeDecodeError)


class DroppedByBucket(ValueError):
    """A sample that no keep draw of ``--buckets`` keeps: skipped, as Open-Sora drops it, but not reported."""


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


def stream_block(streams: int, parts: int, part: int) -> range:
    """The contiguous streams of part ``part`` of ``parts`` (a rank of the world, a worker of a rank)."""
    n = streams // parts
    return range(part * n, (part + 1) * n)


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
    """This rank's ``ShardLoader`` over ``dataset`` (see the module docstring), at ``start_step`` with the saved
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
