"""A folder of clips as users keep it: videos and images, each with its caption in a ``<stem>.txt`` beside it
(``clip.mp4`` + ``clip.txt``, ``still.png`` + ``still.txt``), searched recursively; the layout musubi-tuner,
diffusion-pipe, finetrainers and ai-toolkit read. Or a blend file of such folders, a YAML list of ``{path: FOLDER,
weight: N}`` (the shard blends' file, ``data.shards.sets.read_blend``), where the whole number N is how many times
the folder's samples are listed per epoch (musubi-tuner's ``num_repeats``, diffusion-pipe's per-directory
``num_repeats``); relative folders resolve against the file's folder.

Such data is read in buckets (``data.buckets.BucketDataset``): those of ``--buckets``, or, fine-tuning a video
pipeline, buckets made from the data (``buckets.data_buckets``). Videos are ``VIDEO_EXTENSIONS``, images
``IMAGE_EXTENSIONS`` (1-frame clips); files and folders whose names start with ``.`` are skipped.

A medium without a caption file is listed (one warning line per file, and a record in the run's
``bad_samples.jsonl``) and skipped; ``--caption_missing filename`` captions it with its file name in words instead
(``red_car-2.mp4`` -> ``red car 2``, ``preprocess.stem_words``).

A video's reference images for reference-image training (the adapters' ``takes_references``) are the
``<stem>.ref*.png`` beside it (``clip.ref.png``, ``clip.ref1.png``, ...; sorted by name), which are then no samples
of their own.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
from pathlib import Path

from ditforge.config.sections import CAPTION_MISSING
from ditforge.data.captions import CAPTION_SUFFIX, list_images
from ditforge.data.images import IMAGE_EXTENSIONS, error_text, report_bad_samples
from ditforge.data.preprocess import stem_words
from ditforge.data.video import VIDEO_EXTENSIONS
from ditforge.errors import UserError

MEDIA_EXTENSIONS = frozenset(IMAGE_EXTENSIONS | set(VIDEO_EXTENSIONS))
log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=64)
def holds_videos(folder: str) -> bool:
    """Whether a video file (``VIDEO_EXTENSIONS``) lies anywhere under ``folder`` (hidden names skipped). The walk
    stops at the first; the answer is kept for the process (``source_of`` asks it several times a run, and a large
    image folder holds none)."""
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        if any(not f.startswith(".") and Path(f).suffix.lower() in VIDEO_EXTENSIONS for f in filenames):
            return True
    return False


def folder_repeats(data: str) -> list[tuple[Path, int]]:
    """The ``(folder, repeats)`` of ``--data``: a blend file's entries (``weight`` a whole number >= 1), or the one
    folder, repeated once.

    Raises:
        UserError: a blend entry whose weight is not a whole number, or whose folder does not exist (naming the
            file and the entry); see ``read_blend``.
    """
    from ditforge.data.shards.sets import read_blend

    if not data.lower().endswith((".yaml", ".yml")):
        return [(Path(data), 1)]
    out = []
    for i, (path, weight) in enumerate(read_blend(data)):
        if weight != int(weight):
            raise UserError(f"--data {data}: entry {i} ({path}): weight {weight:g} of a folder of clips is its "
                            "repeats per epoch, a whole number >= 1 (musubi-tuner's num_repeats)")
        if not Path(path).is_dir():
            raise UserError(f"--data {data}: entry {i}: {path} is not a folder")
        out.append((Path(path), int(weight)))
    return out


def folder_rows(data: str, caption_missing: str = "skip", bad_samples_path: str | Path | None = None) -> list[dict]:
    """The samples of a folder of clips or a blend of them (see the module docstring): dicts ``{"path": str,
    "text": str}`` (and ``"reference_image"``: the paths of a video's ``<stem>.ref*.png``, where it has some),
    sorted by path within each folder, each folder's listed ``repeats`` times in a row. A medium
    without its caption file is recorded in ``bad_samples_path`` and left out, or with ``caption_missing``
    ``"filename"`` captioned with its name in words; an unreadable caption file leaves its medium out.

    Raises:
        UserError: a folder without images or videos, an unknown ``caption_missing``; see ``folder_repeats``.
    """
    if caption_missing not in CAPTION_MISSING:
        raise UserError(f"--caption_missing: expected one of {', '.join(CAPTION_MISSING)}, got {caption_missing}")
    rows, dropped = [], []
    for folder, repeats in folder_repeats(data):
        media = list_images(folder, MEDIA_EXTENSIONS)
        if not media:
            raise UserError(f"--data: {folder} holds no videos or images ({', '.join(sorted(MEDIA_EXTENSIONS))})")
        references = {m: sorted(m.parent.glob(f"{glob.escape(m.stem)}.ref*.png")) for m in media
                      if m.suffix.lower() in VIDEO_EXTENSIONS}
        taken = {r for refs in references.values() for r in refs}
        found = []
        for medium in (m for m in media if m not in taken):
            caption = medium.with_suffix(CAPTION_SUFFIX)
            refs = {"reference_image": [str(r) for r in references[medium]]} if references.get(medium) else {}
            if caption.is_file():
                try:
                    found.append({"path": str(medium), "text": caption.read_text(encoding="utf-8-sig").strip(),
                                  **refs})
                except (OSError, UnicodeDecodeError) as e:
                    dropped.append({"path": str(medium), "error": f"unreadable caption {caption.name}: "
                                                                  f"{error_text(e)}"})
            elif caption_missing == "filename":
                found.append({"path": str(medium), "text": stem_words(medium.stem), **refs})
            else:
                dropped.append({"path": str(medium), "error": f"no caption file {caption.name} beside it "
                                                              "(--caption_missing filename captions it by its name)"})
        rows += found * repeats
    if dropped:
        report_bad_samples(bad_samples_path, dropped, "uncaptioned medium")
        log.warning("--data %s: %d media left out for want of a caption%s", data, len(dropped),
                    f" (listed in {bad_samples_path})" if bad_samples_path is not None else "")
    return rows


def instance_rows(folder: str, prompt: str) -> list[dict]:
    """DreamBooth's instance media for a video pipeline (``--instance_data``): every image and video under
    ``folder`` (recursive, hidden names skipped; images are 1-frame clips), sorted by path, each captioned
    ``prompt`` (``--instance_prompt``; no ``.txt`` files read), as ``folder_rows``' dicts ``{"path", "text"}``
    for ``BucketDataset``.

    Raises:
        UserError: ``folder`` is not a folder or holds no image or video.
    """
    if not Path(folder).is_dir():
        raise UserError(f"--instance_data {folder}: not a folder")
    media = list_images(folder, MEDIA_EXTENSIONS)
    if not media:
        raise UserError(f"--instance_data {folder}: holds no videos or images ({', '.join(sorted(MEDIA_EXTENSIONS))})")
    return [{"path": str(medium), "text": prompt} for medium in media]
