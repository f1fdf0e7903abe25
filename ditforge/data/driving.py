"""A driven pipeline's conditioning without target clips: CSV rows of a character image and its driving videos
(``ditforge distill --driving_csv``; the columns of a fine-tuning video CSV, ``video.DRIVING_COLUMNS``), and a row's
image and first frames read as the pipeline's call takes them (PIL)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from PIL import Image

from ditforge.data.images import error_text, open_rgb, read_csv_rows
from ditforge.data.video import DECODE_ERRORS, read_clip, resolve_cell
from ditforge.errors import UserError


def read_driving_csv(path: str | Path, videos: Sequence[str], flag: str) -> list[dict[str, str]]:
    """The rows of a CSV of character images and their driving videos, a driven pipeline's conditioning without
    target clips (``ditforge distill --driving_csv``): the columns of a fine-tuning video CSV (``data/video.py``'s
    docstring) ``image`` and each of ``videos`` (``DRIVING_COLUMNS``; every cell a file, resolved as
    ``VideoDataset`` resolves them), optionally ``text`` (the row's caption); other columns (``path``, ...) are
    ignored, so a fine-tuning CSV serves. Returns one dict a row: ``image`` and each video column -> the file
    (str), ``text`` (str; only with a text column), ``_line`` (its line in the file).

    Raises:
        UserError (one line, naming ``flag``, the file and the line): no such file, an empty one, a header without
            ``image`` or one of ``videos``, no rows, a row with an empty such cell or one naming a missing file.
    """
    columns = ("image", *videos)
    expected = f"expected a CSV file with a header row and the columns {','.join(columns)}[,text]"
    header, rows = read_csv_rows(path, flag, expected)
    missing = [c for c in columns if c not in header]
    if missing or not rows:
        raise UserError(f"{flag} {path}: " + (f"no column {missing[0]} in its header row ({','.join(header)[:80]})"
                                              if missing else "no rows") + f"; {expected}")
    out = []
    for line, row in rows:
        entry = {"_line": str(line)}
        for c in columns:
            if not (row.get(c) or "").strip():
                raise UserError(f"{flag} {path}, line {line}: no {c} (every row names an image and its "
                                f"{' and '.join(videos)})")
            file = resolve_cell(Path(path).parent, row[c])
            if not file.is_file():
                raise UserError(f"{flag} {path}, line {line}: {c} {file}: no such file")
            entry[c] = str(file)
        if "text" in header:
            entry["text"] = row.get("text") or ""
        out.append(entry)
    return out


def read_driving_row(row: Mapping[str, str], videos: Sequence[str], num_frames: int, flag: str
                     ) -> tuple[Image.Image, dict[str, list[Image.Image]]]:
    """A ``read_driving_csv`` row's character image (PIL RGB, ``open_rgb``) and the first ``num_frames`` frames of each
    of its ``videos`` (``read_clip`` at stride 1 from frame 0: what a driven pipeline's first segment takes), PIL RGB
    at the files' own size (the pipeline resizes them).

    Raises:
        UserError (one line, naming ``flag``, the row's line and the file): an unreadable image or video, a video of
            fewer than ``num_frames`` frames.
    """
    where = f"{flag} line {row['_line']}"
    image = open_rgb(row["image"], f"{where}: image {row['image']}")
    frames = {}
    for c in videos:
        try:
            clip, _ = read_clip(row[c], num_frames, 1, lambda _: 0)
        except DECODE_ERRORS as e:
            raise UserError(f"{where}: {c} {row[c]}: {error_text(e)} (a video of at least {num_frames} frames, the "
                            "clip's, is expected)") from None
        frames[c] = [Image.fromarray(f) for f in clip]
    return image, frames
