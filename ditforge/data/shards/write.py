"""Writing a shard set: ``ShardWriter`` and the names of the format (the format: the package docstring)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ditforge.atomic import atomic_path
from ditforge.errors import UserError

log = logging.getLogger(__name__)

SHARDS_MANIFEST = "shards.json"
SHARDS_FORMAT = "ditforge-shards"
SHARDS_VERSION = 1
SHARD_PATTERN = "shard-{:05d}.tar"
NUM_TEXTS = 64  # captions kept in the manifest for the sample grids
INCOMPLETE_MARKER = ".ditforge-writing"  # a shard folder ditforge is writing (or was, when interrupted)


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
