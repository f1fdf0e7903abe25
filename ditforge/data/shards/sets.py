"""The shard sets of ``--data``: one set (a folder, glob, brace list, file or URL) or a blend file of weighted sets,
each with its manifest (``shards.json``) and sample counts."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Callable

from ditforge.data.images import error_text
from ditforge.data.shards.tar import open_shard
from ditforge.data.shards.urls import _fs, _is_local, expand_urls
from ditforge.data.shards.write import SHARDS_FORMAT, SHARDS_MANIFEST, SHARDS_VERSION
from ditforge.errors import UserError

SAME_LATENTS = ("condition", "vae", "text_encoder", "text_max_length", "text_dim", "in_channels", "input_size",
                "num_frames", "image_size", "stochastic")  # what every set of a latent blend must share


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
