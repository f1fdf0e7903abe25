"""ImageFolder-style data: ``ROOT/<class name>/<image>``, one sub-folder per class (sorted names -> labels)."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import re
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ditforge.atomic import atomic_path
from ditforge.errors import UserError

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}
log = logging.getLogger(__name__)
T = TypeVar("T")


def center_crop_arr(pil_image: Image.Image, image_size: int | tuple[int, int]) -> np.ndarray:
    """Resize so the image covers ``image_size`` and crop the centre: (S, S, 3) uint8 for an int S, or (h, w, 3)
    for ``(h, w)`` (a multi-resolution bucket's shape).

    Halves the image with a box filter while both sides are at least twice the target's, then resizes with
    bicubic by ``max(h / H, w / W)`` (for a square: the short side to S) and crops the centre (the ADM / DiT
    recipe, ``center_crop_arr`` in facebookresearch/DiT train.py, which is the square case).
    """
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    while pil_image.size[0] >= 2 * w and pil_image.size[1] >= 2 * h:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = max(h / pil_image.size[1], w / pil_image.size[0])
    pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size), resample=Image.BICUBIC)
    arr = np.array(pil_image)
    top, left = (arr.shape[0] - h) // 2, (arr.shape[1] - w) // 2
    return arr[top : top + h, left : left + w]


CSV_EXPECTED = "expected a CSV file with a header row and the columns path,text"


def read_csv_rows(path: str | Path, flag: str = "--data", expected: str = CSV_EXPECTED
                  ) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """A ``--data`` CSV file (or ``flag``'s): its header (column names stripped and lower-cased) and its rows as (line
    number, {column: value}), blank lines skipped; UTF-8, a BOM allowed. The video and captioned-image CSVs share it,
    and ``distill --driving_csv``'s.

    Raises:
        UserError: the file does not exist or is empty (naming ``flag`` and the file, then ``expected``).
    """
    import csv

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{flag}: {path} does not exist ({expected})")
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise UserError(f"{flag}: {path} is empty ({expected})")
        header = [h.strip().lower() for h in header]
        rows = [(reader.line_num, dict(zip(header, values))) for values in reader if any(v.strip() for v in values)]
    return header, rows


def file_source(source: str | Path | bytes) -> str | io.BytesIO:
    """What Pillow and PyAV open: a path as ``str``, or a file's bytes (a shard member) as a file object."""
    return io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else str(source)


def error_text(error: Exception) -> str:
    """``"TypeName: message"``, the ``error`` field of a ``bad_samples.jsonl`` record."""
    return f"{type(error).__name__}: {error}"


def report_bad_samples(bad_samples_path: str | Path | None, records: list[dict], what: str) -> None:
    """Warn about each bad sample and append its record (a JSON object with at least ``path`` and ``error``) to
    ``bad_samples_path`` as one JSON line, unless that file already holds a record of the same ``path``: a bad
    file is recorded once per run, however many epochs, data-loader workers or ranks meet it (an exclusive
    ``flock`` on the file covers the read and the append; the file is append-only, lines are never torn).
    ``what`` names the kind in the warning, e.g. ``"unreadable image"``."""
    for r in records:
        log.warning("skipping %s %s: %s", what, r["path"], r["error"])
    if bad_samples_path is None or not records:
        return
    path = Path(bad_samples_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # workers and ranks meeting one bad file at once record it once
        f.seek(0)
        seen = set()
        for line in f.read().splitlines():
            try:
                seen.add(json.loads(line).get("path"))
            except (ValueError, AttributeError):
                continue
        new = [r for r in records if r["path"] not in seen]
        if new:
            f.write("".join(json.dumps(r) + "\n" for r in new))  # append mode: at the end, whole lines


def load_or_substitute(i: int, n: int, load: Callable[[int], T], report: Callable[[int, Exception], None],
                       errors: tuple[type[BaseException], ...], limit: int, what: str) -> tuple[int, T]:
    """``(j, load(j))`` for the first ``j`` of ``i, i+1, ...`` (mod ``n``) whose ``load`` does not raise one of
    ``errors``; ``report(j, error)`` is called for each one that does. Deterministic: the substitute of a bad
    sample is always the next good one.

    Raises:
        RuntimeError: ``limit`` bad samples in a row (``what`` names them in the message).
    """
    for k in range(limit):
        j = (i + k) % n
        try:
            return j, load(j)
        except errors as e:
            report(j, e)
    raise RuntimeError(f"{limit} {what} in a row from sample {i}")


class ImageFolderDataset(Dataset):
    """Images under ``root/<class>/``, centre-cropped and resized to ``image_size``, scaled to [-1, 1].

    Items are ``(image (3, S, S) float32, label int)``; ``class_captions`` are the folder names with ``_`` and
    ``-`` as spaces (captions for ``--condition text``). An image that cannot be read at training time is
    logged (and recorded once in ``bad_samples_path`` as a JSON line when set, see ``report_bad_samples``) and
    replaced by the next readable one, so one bad file never stops a long run.

    Raises:
        UserError: ``root`` missing or not a folder, no class sub-folders, or no images at all.
    """

    in_channels = 3
    max_substitutions = 16

    def __init__(self, root: str | Path, image_size: int, bad_samples_path: str | Path | None = None):
        self.root = Path(root)
        if not self.root.is_dir():
            raise UserError(f"--data: {root} is not a folder (expected ROOT/<class>/<image> or 'digits')")
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        if not self.classes:
            raise UserError(f"--data: {root} has no class sub-folders (expected ROOT/<class>/<image>)")
        self.samples = [
            (str(f), label)
            for label, name in enumerate(self.classes)
            for f in sorted((self.root / name).rglob("*"))
            if f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file()
        ]
        if not self.samples:
            raise UserError(f"--data: no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) under {root}")
        self.num_classes = len(self.classes)
        self.class_captions = [" ".join(re.split(r"[_\-\s]+", name)).strip() for name in self.classes]
        self.image_size = image_size
        self.bad_samples_path = bad_samples_path

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, i: int) -> torch.Tensor:
        """Read, crop and scale image ``i``: (3, S, S) float32 in [-1, 1]. Raises OSError/ValueError if unreadable."""
        with Image.open(self.samples[i][0]) as img:
            arr = center_crop_arr(img.convert("RGB"), self.image_size)
        return torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1).float().div(127.5).sub(1.0)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        j, image = load_or_substitute(
            i, len(self.samples), self.load, self._report_bad,
            errors=(OSError, ValueError, SyntaxError),  # PIL raises all three on bad files
            limit=self.max_substitutions, what="unreadable images",
        )
        return image, self.samples[j][1]

    def _report_bad(self, j: int, error: Exception) -> None:
        report_bad_samples(self.bad_samples_path, [{"path": self.samples[j][0], "error": error_text(error)}],
                           "unreadable image")


def open_rgb(path: str | Path, where: str) -> Image.Image:
    """The image at ``path`` as a PIL RGB image, read whole (the file may go away after).

    Raises:
        UserError: ``where: no such file`` or ``where: not a readable image (...)``, one line.
    """
    from PIL import UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except FileNotFoundError:
        raise UserError(f"{where}: no such file") from None
    except (OSError, UnidentifiedImageError) as e:
        raise UserError(f"{where}: not a readable image ({type(e).__name__})") from None


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Images (N, C, H, W) or videos (N, C, T, H, W), float in [-1, 1] -> (N, H, W, C) or (N, T, H, W, C) uint8
    (values clamped; channels last)."""
    x = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.movedim(1, -1).cpu().numpy()


def save_grid(images: np.ndarray, path: str | Path, nrow: int, upscale: int = 1, pad: int = 1) -> None:
    """Write (N, H, W, C) uint8 images as one PNG grid (``make_grid``). Written to a temporary name, then renamed."""
    grid = make_grid(images, nrow, upscale, pad)
    with atomic_path(path) as tmp:
        Image.fromarray(grid[..., 0] if grid.shape[-1] == 1 else grid).save(tmp, format="PNG")


def make_grid(images: np.ndarray, nrow: int, upscale: int = 1, pad: int = 1) -> np.ndarray:
    """(N, H, W, C) uint8 images -> one (GH, GW, C) uint8 grid of ``nrow`` per row with ``pad`` black pixels
    between them, enlarged ``upscale`` times (nearest neighbour, so small images stay sharp)."""
    n, h, w, c = images.shape
    rows = -(-n // nrow)
    grid = np.zeros((rows * (h + pad) + pad, nrow * (w + pad) + pad, c), dtype=np.uint8)
    for i, img in enumerate(images):
        r, q = divmod(i, nrow)
        grid[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + q * (w + pad) : pad + q * (w + pad) + w] = img
    return grid.repeat(upscale, axis=0).repeat(upscale, axis=1) if upscale > 1 else grid
