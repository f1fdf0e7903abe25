"""Turn a folder of videos into a video CSV (``path,text,num_frames,fps,height,width``) for ``VideoDataset``.

``preprocess_ucf101``: UCF101's layout, ``ROOT/<ActionClass>/<video>.avi``; the caption is the class name in
words (``ApplyEyeMakeup`` -> ``apply eye makeup``). ``preprocess_folder``: any tree of videos; the caption is a
sidecar ``<stem>.txt`` beside the video, else the file name in words. Each video is probed (stream metadata,
no decoding); a file that cannot be probed is reported and left out.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from pathlib import Path

from ditforge.data.images import error_text
from ditforge.data.video import (DECODE_ERRORS, META_COLUMNS, REQUIRED_COLUMNS, VIDEO_EXTENSIONS, probe_video,
                                 write_video_csv)
from ditforge.errors import UserError

log = logging.getLogger(__name__)

# A word of a CamelCase name: digits with a following acronym ("3D" of "Playing3DGame"), an acronym not
# followed by a lower-case letter ("HTML" of "HTMLParser"), or an optionally capitalised word ("Yo").
_WORD = re.compile(r"\d+[A-Z]*(?![a-z])|[A-Z]+(?![a-z])|[A-Z]?[a-z]+")


def camel_case_words(name: str) -> str:
    """A CamelCase class name in lower-case words: ``ApplyEyeMakeup`` -> ``apply eye makeup``, ``YoYo`` ->
    ``yo yo``, ``HTMLParser`` -> ``html parser``, ``Playing3DGame`` -> ``playing 3d game``, ``Rings2`` ->
    ``rings 2``; other characters (``_``, ``-``, spaces) separate words. Non-ASCII names: separators only."""
    words = _WORD.findall(name) if name.isascii() else re.split(r"[\W_]+", name)
    return " ".join(w.lower() for w in words if w) or name


def stem_words(stem: str) -> str:
    """A file stem with its separators (``_``, ``-``, ``.``, runs of spaces) turned into single spaces."""
    return " ".join(re.split(r"[\s_.\-]+", stem)).strip() or stem


@dataclasses.dataclass
class PreprocessSummary:
    """What ``preprocess_*`` wrote: the CSV, its row count, and the files left out as ``(path, reason)``."""

    out_csv: Path
    rows: int
    bad: list[tuple[str, str]]

    def __str__(self) -> str:
        bad = f"; {len(self.bad)} unreadable file{'s' * (len(self.bad) != 1)} left out" if self.bad else ""
        return f"wrote {self.rows} rows to {self.out_csv}{bad}"


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _videos_under(folder: Path) -> list[Path]:
    """Video files under ``folder``, sorted; hidden ones (``.name``, e.g. macOS ``._x.avi``) are skipped."""
    return sorted(f for f in folder.rglob("*")
                  if f.suffix.lower() in VIDEO_EXTENSIONS and not _hidden(f, folder) and f.is_file())


def _csv_path(video: Path, csv_dir: Path) -> str:
    """``video`` relative to the CSV's folder when it lies under it, else absolute."""
    video = video.resolve()
    try:
        return video.relative_to(csv_dir).as_posix()
    except ValueError:
        return str(video)


def _write(out_csv: str | Path, items: list[tuple[Path, Callable[[], str]]]) -> PreprocessSummary:
    """Probe each ``(video, caption function)`` and write the CSV of the good ones."""
    out_csv = Path(out_csv)
    csv_dir = out_csv.absolute().parent.resolve()
    rows, bad = [], []
    for video, caption in items:
        try:
            meta = probe_video(video)
        except DECODE_ERRORS as e:
            bad.append((str(video), error_text(e)))
            log.warning("left out unreadable video %s: %s", video, error_text(e))
            continue
        rows.append({"path": _csv_path(video, csv_dir), "text": caption(), **meta})
    write_video_csv(rows, out_csv, REQUIRED_COLUMNS + META_COLUMNS)
    return PreprocessSummary(out_csv, len(rows), bad)


def _check_root(root: str | Path, layout: str) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"ROOT {root} is not a folder (expected {layout})")
    return root


def preprocess_ucf101(root: str | Path, out_csv: str | Path) -> PreprocessSummary:
    """Write the video CSV of a UCF101-style tree ``root/<ActionClass>/<video>`` (videos may be nested below
    the class folder; extensions ``VIDEO_EXTENSIONS``), caption ``camel_case_words(<ActionClass>)``, columns
    ``path,text,num_frames,fps,height,width`` (paths relative to the CSV's folder when under it). Files that
    cannot be probed are logged and left out. Sorted, so the same tree gives the same file. Atomic write.

    Returns:
        PreprocessSummary (rows written, files left out with their reasons).
    Raises:
        UserError: ``root`` is not a folder, or holds no class folder with videos.
    """
    layout = "UCF101's ROOT/<ActionClass>/<video>.avi"
    root = _check_root(root, layout)
    items = [(video, lambda c=cls.name: camel_case_words(c))
             for cls in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
             for video in _videos_under(cls)]
    if not items:
        raise UserError(f"ROOT {root} has no videos ({', '.join(VIDEO_EXTENSIONS)}) in class folders "
                        f"(expected {layout})")
    return _write(out_csv, items)


def _sidecar_caption(video: Path) -> str:
    sidecar = video.with_suffix(".txt")
    if sidecar.is_file():
        text = " ".join(sidecar.read_text(encoding="utf-8", errors="replace").split())
        if text:
            return text
    return stem_words(video.stem)


def preprocess_folder(root: str | Path, out_csv: str | Path) -> PreprocessSummary:
    """Write the video CSV of every video under ``root`` (any depth; extensions ``VIDEO_EXTENSIONS``), caption
    from a sidecar ``<stem>.txt`` beside it when present and not empty (whitespace collapsed to single spaces),
    else ``stem_words(<stem>)``; columns and bad files as ``preprocess_ucf101``. Atomic write.

    Returns:
        PreprocessSummary.
    Raises:
        UserError: ``root`` is not a folder or holds no videos.
    """
    layout = f"a folder of videos ({', '.join(VIDEO_EXTENSIONS)})"
    root = _check_root(root, layout)
    videos = _videos_under(root)
    if not videos:
        raise UserError(f"ROOT {root} has no videos (expected {layout})")
    return _write(out_csv, [(v, lambda v=v: _sidecar_caption(v)) for v in videos])


