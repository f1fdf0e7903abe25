"""Captioned images for text-to-image fine-tuning, and DreamBooth's instance and class images.

Captioned data (``CaptionedImageDataset``) comes in three layouts:

* a folder of images, each with its caption in a sidecar ``<stem>.txt`` beside it (``photo.jpg`` ->
  ``photo.txt``; searched recursively; the kohya-ss / EveryDream convention);
* a CSV file with a header row and the columns ``path,text`` (as video CSVs, see ``ditforge.data.video``);
* a JSONL file, one JSON object per line with the same keys (diffusers' ImageFolder ``metadata.jsonl``).

In CSV and JSONL files the image column may also be called ``file_name`` or ``image`` and the caption column
``caption`` (diffusers' names); when a row has several, ``path`` wins over ``file_name`` over ``image``, and
``text`` over ``caption``. Relative paths resolve against the file's folder.

DreamBooth (Ruiz et al. 2023, "DreamBooth: Fine Tuning Text-to-Image Diffusion Models for Subject-Driven
Generation"; the layout of diffusers' ``examples/dreambooth/train_dreambooth.py``): a folder of a few images of
the subject, all captioned with one instance prompt, and optionally a folder of class images captioned with the
class prompt for the prior-preservation loss; ``generate_class_images`` fills that folder with the base model.

Image files are found by extension (``IMAGE_EXTENSIONS``); files and folders whose names start with ``.`` are
skipped (temporary files, ``.ipynb_checkpoints``, macOS ``._*`` resource forks).
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import re
from collections.abc import Collection, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ditforge.atomic import atomic_path
from ditforge.config.sections import RESIZE_MODES
from ditforge.data.images import (CSV_EXPECTED, IMAGE_EXTENSIONS, center_crop_arr, error_text, load_or_substitute,
                                  read_csv_rows, report_bad_samples)
from ditforge.data.sampler import derive_seed
from ditforge.errors import UserError

PATH_KEYS = ("path", "file_name", "image")  # the image column, in order of preference
TEXT_KEYS = ("text", "caption")  # the caption column, in order of preference
CAPTION_SUFFIX = ".txt"
CLASS_IMAGE_PATTERN = "class-{:05d}.png"
# PIL raises all of these on bad files (DecompressionBombError: an image too large to be safe to open)
IMAGE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
log = logging.getLogger(__name__)


def slug(text: str, max_len: int = 48) -> str:
    """A file-name part for a prompt: lower-case ASCII letters and digits, other runs as one ``-``, at most
    ``max_len`` characters; ``"prompt"`` when nothing is left. ``"A red car, at night!"`` -> ``a-red-car-at-night``."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:max_len].rstrip("-")
    return s or "prompt"


class BadImage(ValueError):
    """An image already found unreadable in this process (it is not read again)."""


# ----------------------------------------------------------------------------------------------------------
# Finding and reading images


def read_prompts(prompts: list[str] | None, prompt_file: str | None) -> list[str]:
    """The prompts of ``--prompt`` (in order), then those of ``--prompt_file`` (one per non-empty line, stripped).

    Raises:
        UserError: an empty ``--prompt``; a prompt file that is missing, unreadable, not UTF-8, or has no prompt.
    """
    out = []
    for p in prompts or []:
        if not p.strip():
            raise UserError("--prompt: empty prompt")
        out.append(p.strip())
    if prompt_file is not None:
        try:
            lines = Path(prompt_file).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise UserError(f"--prompt_file {prompt_file}: no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--prompt_file {prompt_file}: unreadable ({type(e).__name__}: {e})") from None
        found = [line.strip() for line in lines if line.strip()]
        if not found:
            raise UserError(f"--prompt_file {prompt_file}: no prompts (expected one prompt per non-empty line)")
        out.extend(found)
    return out


def list_images(folder: str | Path, extensions: Collection[str] = IMAGE_EXTENSIONS) -> list[Path]:
    """The image files under ``folder`` (recursive, sorted by path; by lower-case extension, ``IMAGE_EXTENSIONS``
    or ``extensions``), leaving out files and folders whose names start with ``.``. ``[]`` when ``folder`` is not a
    folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [Path(dirpath) / f for f in filenames
                  if not f.startswith(".") and Path(f).suffix.lower() in extensions]
    return sorted(p for p in found if p.is_file())


def count_images(folder: str | Path) -> int:
    """How many images ``list_images(folder)`` finds (0 for a missing folder)."""
    return len(list_images(folder))


def letterbox_arr(pil_image: Image.Image, image_size: int) -> np.ndarray:
    """Resize the LONG side to ``image_size``, aspect kept: (h, w, 3) uint8 with ``max(h, w) == image_size``
    (the short side ``round(short * image_size / long)``, at least 1), not yet padded.

    Resampled as ``center_crop_arr`` does: halved with a box filter while the long side is at least twice the
    target (and the short side at least 2 pixels), then bicubic.
    """
    while max(*pil_image.size) >= 2 * image_size and min(*pil_image.size) >= 2:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = image_size / max(*pil_image.size)
    size = tuple(max(1, round(x * scale)) for x in pil_image.size)
    return np.array(pil_image.resize(size, resample=Image.BICUBIC))


def load_image(path: str | Path, image_size: int, resize_mode: str = "center_crop") -> torch.Tensor:
    """Read an image file (EXIF orientation applied, as diffusers' DreamBooth script does; converted to RGB) as
    (3, S, S) float32 in [-1, 1] (``uint8 / 127.5 - 1``), S = ``image_size``.

    ``resize_mode``: ``"center_crop"``: short side to S, centre square (``center_crop_arr``); ``"letterbox"``: long
    side to S, aspect kept (``letterbox_arr``), the short side padded symmetrically to S (the extra pixel of an
    odd padding at the bottom / right) with 0.0, the mean grey of [-1, 1] (uint8 127.5, between 127 and 128).

    Raises:
        OSError / ValueError / SyntaxError / PIL.Image.DecompressionBombError: an unreadable file.
        ValueError: an unknown ``resize_mode``.
    """
    with Image.open(path) as img:
        rgb = ImageOps.exif_transpose(img).convert("RGB")
    if resize_mode == "center_crop":
        arr = np.ascontiguousarray(center_crop_arr(rgb, image_size))
        return torch.from_numpy(arr).permute(2, 0, 1).float().div(127.5).sub(1.0)
    if resize_mode != "letterbox":
        raise ValueError(f"unknown resize_mode {resize_mode!r}; expected one of {', '.join(RESIZE_MODES)}")
    arr = letterbox_arr(rgb, image_size)
    h, w = arr.shape[:2]
    top, left = (image_size - h) // 2, (image_size - w) // 2
    out = torch.zeros(3, image_size, image_size)
    out[:, top : top + h, left : left + w] = torch.from_numpy(arr).permute(2, 0, 1).float().div(127.5).sub(1.0)
    return out


class _Images:
    """Image files read by ``load_image``; an unreadable one is recorded once (``report_bad_samples``, JSON lines
    ``{"path", "error"}``), never read again by this process, and replaced by the next readable one
    (``load_or_substitute``)."""

    max_substitutions = 16

    def __init__(self, paths: Sequence[str], image_size: int, resize_mode: str,
                 bad_samples_path: str | Path | None):
        self.paths, self.image_size, self.resize_mode = list(paths), image_size, resize_mode
        self.bad_samples_path = bad_samples_path
        self._bad: dict[int, str] = {}

    def load(self, i: int) -> torch.Tensor:
        if i in self._bad:
            raise BadImage(f"found bad before ({self._bad[i]})")
        return load_image(self.paths[i], self.image_size, self.resize_mode)

    def get(self, i: int) -> tuple[int, torch.Tensor]:
        """``(j, image j)``: ``j = i`` unless image ``i`` is unreadable, then the next readable one."""
        return load_or_substitute(i, len(self.paths), self.load, self._report_bad, IMAGE_ERRORS,
                                  min(self.max_substitutions, len(self.paths)), "unreadable images")

    def _report_bad(self, j: int, error: Exception) -> None:
        if j in self._bad:
            return
        self._bad[j] = error_text(error)
        report_bad_samples(self.bad_samples_path, [{"path": self.paths[j], "error": error_text(error)}],
                           "unreadable image")


def _check_image_settings(image_size: int, resize_mode: str) -> None:
    if isinstance(image_size, bool) or not isinstance(image_size, numbers.Integral) or image_size < 1:
        raise UserError(f"--image_size must be a positive integer, got {image_size!r}")
    if resize_mode not in RESIZE_MODES:
        raise UserError(f"--resize_mode: expected one of {', '.join(RESIZE_MODES)}, got {resize_mode}")


# ----------------------------------------------------------------------------------------------------------
# Caption files


def _pick(row: dict, keys: Sequence[str]):
    return next((row[k] for k in keys if k in row), None)


def _names(keys: Sequence[str]) -> str:
    return f"{keys[0]} (or {', '.join(keys[1:])})"


def read_caption_csv(path: str | Path) -> list[dict]:
    """The rows of a captioned-image CSV: dicts ``{"path": str, "text": str, "line": int, "row": dict}`` (the
    image and caption columns, see the module docstring; ``row`` holds every column; column names stripped and
    lower-cased; UTF-8, a BOM allowed; blank lines skipped).

    Raises:
        UserError: the file is missing or empty, the header has no image or caption column, or a row is cut
            short before either (naming the file and line).
    """
    header, rows = read_csv_rows(path)
    for keys in (PATH_KEYS, TEXT_KEYS):
        if not any(k in header for k in keys):
            raise UserError(f"--data: {path} line 1: no column {_names(keys)} in the header row "
                            f"({','.join(header)[:80]}); {CSV_EXPECTED}")
    out = []
    for line, row in rows:
        for keys in (PATH_KEYS, TEXT_KEYS):
            if _pick(row, keys) is None:
                raise UserError(f"--data: {path} line {line}: no {_names(keys)} value (the row has {len(row)} "
                                f"fields, the header {len(header)}); {CSV_EXPECTED}")
        out.append({"path": _pick(row, PATH_KEYS), "text": _pick(row, TEXT_KEYS), "line": line, "row": row})
    return out


def read_caption_jsonl(path: str | Path) -> list[dict]:
    """The rows of a captioned-image JSONL file (one JSON object per line, diffusers' ``metadata.jsonl``):
    dicts ``{"path": str, "text": str, "line": int, "row": dict}`` as ``read_caption_csv`` (keys stripped and
    lower-cased; blank lines skipped).

    Raises:
        UserError: the file is missing, a line is not a JSON object, lacks the image or caption key, or its
            value is not a string (naming the file and line).
    """
    path = Path(path)
    expected = 'expected one JSON object per line with the keys "path" and "text"'
    if not path.is_file():
        raise UserError(f"--data: {path} does not exist ({expected})")
    rows = []
    with open(path, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise UserError(f"--data: {path} line {n}: not valid JSON ({e}); {expected}") from None
            if not isinstance(obj, dict):
                raise UserError(f"--data: {path} line {n}: a JSON {type(obj).__name__}, not an object; {expected}")
            row = {str(k).strip().lower(): v for k, v in obj.items()}
            values = []
            for keys in (PATH_KEYS, TEXT_KEYS):
                value = _pick(row, keys)
                if value is None:
                    raise UserError(f"--data: {path} line {n}: no key {_names(keys)}; {expected}")
                if not isinstance(value, str):
                    raise UserError(f"--data: {path} line {n}: {keys[0]} must be a string, got "
                                    f"{json.dumps(value)[:40]}; {expected}")
                values.append(value)
            rows.append({"path": values[0], "text": values[1], "line": n, "row": obj})
    return rows


# ----------------------------------------------------------------------------------------------------------
# Data sets


class CaptionedImageDataset(Dataset):
    """Captioned images (see the module docstring for the folder, CSV and JSONL layouts), resized to
    ``image_size`` by ``resize_mode`` and scaled to [-1, 1].

    ``resize_mode``: ``"center_crop"`` (the short side to ``image_size``, aspect kept, then the centre square:
    ``center_crop_arr``, DiT's recipe) or ``"letterbox"`` (the long side to ``image_size``, aspect kept, then the
    short side padded symmetrically to a square with 0.0, the mean grey of [-1, 1]; nothing is cut off). See
    ``load_image``.

    Items are dicts: ``x`` (3, S, S) float32 in [-1, 1], ``text`` str (the caption). Attributes: ``in_channels``
    3, ``image_size``, ``num_classes`` 0 (no labels), ``texts`` (every sample's caption, in order), ``paths``,
    ``class_captions`` None, ``random_flip`` True (what the trainer does by default with this data).

    Bad input never stops a run. In a folder, an image without a sidecar gets the empty caption "" (counted in
    ``num_uncaptioned``, one warning); a sidecar that cannot be read leaves its image out. CSV / JSONL rows
    whose image file does not exist (or whose path is empty) are left out. Left-out samples are counted in
    ``num_dropped`` and recorded in ``bad_samples_path`` (JSON lines with the path, the reason and, for files,
    the line and row). An image that turns out unreadable when read is recorded once and replaced by the next
    readable one (``load_or_substitute``), the same on every process.

    Raises:
        UserError: bad ``image_size`` or ``resize_mode`` (naming the flag); ``source`` is missing or neither a
            folder nor a ``.csv`` / ``.jsonl`` file; a folder with no images or no caption at all; a CSV / JSONL
            file without the image or caption column on some line (see ``read_caption_csv`` /
            ``read_caption_jsonl``); no usable sample at all.
    """

    in_channels = 3
    num_classes = 0
    class_captions = None
    random_flip = True

    def __init__(self, source: str | Path, image_size: int, bad_samples_path: str | Path | None = None,
                 resize_mode: str = "center_crop"):
        _check_image_settings(image_size, resize_mode)
        source = Path(source)
        self.source, self.image_size, self.resize_mode = source, int(image_size), resize_mode
        self.bad_samples_path = bad_samples_path
        self.num_uncaptioned = 0
        if source.is_dir():
            paths, texts, dropped = self._read_folder(source)
            total = len(paths) + len(dropped)
        elif source.suffix.lower() in (".csv", ".jsonl"):
            rows = read_caption_csv(source) if source.suffix.lower() == ".csv" else read_caption_jsonl(source)
            paths, texts, dropped = self._check_rows(rows, source.parent)
            total = len(rows)
        elif not source.exists():
            raise UserError(f"--data: {source} does not exist (expected a folder of images with <stem>.txt "
                            "captions, a .csv or a .jsonl file of path,text)")
        else:
            raise UserError(f"--data: {source} is neither a folder nor a .csv or .jsonl file (expected a folder of "
                            "images with <stem>.txt captions, a .csv or a .jsonl file of path,text)")
        self.num_dropped = len(dropped)
        if dropped:
            report_bad_samples(bad_samples_path, dropped, "captioned image")
            where = f"; recorded in {bad_samples_path}" if bad_samples_path is not None else ""
            log.warning("%s: %d of %d samples left out (missing image file or unreadable caption)%s", source,
                        len(dropped), total, where)
        if not paths:
            raise UserError(f"--data: {source} has no usable sample ({total} listed, {len(dropped)} with a missing "
                            "image file, an empty path or an unreadable caption)")
        self.paths, self.texts = paths, texts
        self._images = _Images(paths, self.image_size, resize_mode, bad_samples_path)

    def _read_folder(self, root: Path) -> tuple[list[str], list[str], list[dict]]:
        images = list_images(root)
        if not images:
            raise UserError(f"--data: {root} holds no images ({', '.join(sorted(IMAGE_EXTENSIONS))}); expected "
                            "images with <stem>.txt captions beside them, or ROOT/<class>/<image> class folders")
        paths, texts, dropped = [], [], []
        for image in images:
            caption = image.with_suffix(CAPTION_SUFFIX)
            if not caption.is_file():
                self.num_uncaptioned += 1
                paths.append(str(image))
                texts.append("")
                continue
            try:
                text = caption.read_text(encoding="utf-8-sig").strip()
            except (OSError, UnicodeDecodeError) as e:
                dropped.append({"path": str(image), "error": f"unreadable caption {caption.name}: {error_text(e)}"})
                continue
            paths.append(str(image))
            texts.append(text)
        if self.num_uncaptioned == len(images):
            raise UserError(f"--data: {root} has no caption at all ({len(images)} images, no <stem>.txt beside any "
                            "of them); expected a caption file beside each image (photo.jpg -> photo.txt), or "
                            "ROOT/<class>/<image> class folders")
        if self.num_uncaptioned:
            log.warning("%s: %d of %d images have no caption file (<stem>.txt); they get the empty caption", root,
                        self.num_uncaptioned, len(images))
        return paths, texts, dropped

    @staticmethod
    def _check_rows(rows: list[dict], base: Path) -> tuple[list[str], list[str], list[dict]]:
        paths, texts, dropped = [], [], []
        for row in rows:
            raw = row["path"].strip()
            file = base / Path(raw).expanduser()
            if not raw or not file.is_file():
                dropped.append({"path": str(file) if raw else "", "error": "file not found" if raw else "empty path",
                                "line": row["line"], "row": row["row"]})
                continue
            paths.append(str(file))
            texts.append(row["text"])
        return paths, texts, dropped

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, i: int) -> torch.Tensor:
        """Read image ``i``: (3, S, S) float32 in [-1, 1]. Raises one of ``IMAGE_ERRORS`` if unreadable."""
        return self._images.load(i)

    def __getitem__(self, i: int) -> dict:
        j, x = self._images.get(i)
        return {"x": x, "text": self.texts[j]}


class DreamBoothDataset(Dataset):
    """DreamBooth's data (Ruiz et al. 2023; diffusers' ``train_dreambooth.py``): the instance images of
    ``instance_data`` (a folder, searched recursively), each captioned ``instance_prompt``, and with
    ``class_data`` (prior preservation) the class images of that folder, each captioned ``class_prompt``.
    Images are resized as ``CaptionedImageDataset``'s (``resize_mode``, see ``load_image``).

    Without ``class_data``: items ``{"x": (3, S, S) float32 in [-1, 1], "text": instance_prompt}``, one per
    instance image. With it: the length is ``max(#instance, #class)`` (as diffusers), and item i pairs instance
    image ``i % #instance`` with class image ``i % #class``: ``{"x", "text": instance_prompt, "class_x": (3, S, S)
    float32, "class_text": class_prompt}``. The class images must exist before construction (``generate_class_images``
    makes the missing ones). An unreadable image is recorded once in ``bad_samples_path`` and replaced by the next
    readable one of its own folder.

    Attributes: ``in_channels`` 3, ``image_size``, ``num_classes`` 0, ``texts`` ``[instance_prompt]``,
    ``class_captions`` None, ``random_flip`` True, ``instance_paths``, ``class_paths`` (empty without class data).

    Raises:
        UserError: bad ``image_size`` or ``resize_mode``; no ``instance_prompt``; ``instance_data`` not a folder or
            without images (naming ``--instance_data``); ``class_data`` without ``class_prompt``, not a folder or
            without images (naming ``--class_data``).
    """

    in_channels = 3
    num_classes = 0
    class_captions = None
    random_flip = True

    def __init__(self, instance_data: str | Path, instance_prompt: str, image_size: int,
                 class_data: str | Path | None = None, class_prompt: str | None = None,
                 bad_samples_path: str | Path | None = None, resize_mode: str = "center_crop"):
        _check_image_settings(image_size, resize_mode)
        if instance_prompt is None:
            raise UserError("--instance_prompt is required with --instance_data (e.g. 'a photo of sks dog')")
        if class_data is not None and class_prompt is None:
            raise UserError("--class_prompt is required with --class_data (e.g. 'a photo of dog')")
        if class_data is None and class_prompt is not None:
            log.warning("--class_prompt is ignored without --class_data (prior preservation needs both)")
        self.image_size, self.resize_mode, self.bad_samples_path = int(image_size), resize_mode, bad_samples_path
        self.instance_prompt, self.class_prompt = instance_prompt, class_prompt if class_data is not None else None
        self.instance_paths = [str(p) for p in self._images_of(instance_data, "--instance_data")]
        self.class_paths = [str(p) for p in self._images_of(class_data, "--class_data")] if class_data else []
        self.texts = [instance_prompt]
        self._instances = _Images(self.instance_paths, self.image_size, resize_mode, bad_samples_path)
        self._classes = _Images(self.class_paths, self.image_size, resize_mode, bad_samples_path)

    @staticmethod
    def _images_of(folder: str | Path, flag: str) -> list[Path]:
        if not Path(folder).is_dir():
            raise UserError(f"{flag}: {folder} is not a folder (expected a folder of images)")
        images = list_images(folder)
        if not images:
            raise UserError(f"{flag}: {folder} holds no images ({', '.join(sorted(IMAGE_EXTENSIONS))})")
        return images

    def __len__(self) -> int:
        return max(len(self.instance_paths), len(self.class_paths))

    def __getitem__(self, i: int) -> dict:
        _, x = self._instances.get(i % len(self.instance_paths))
        item = {"x": x, "text": self.instance_prompt}
        if self.class_paths:
            _, class_x = self._classes.get(i % len(self.class_paths))
            item |= {"class_x": class_x, "class_text": self.class_prompt}
        return item


# ----------------------------------------------------------------------------------------------------------
# Class images for prior preservation


def generate_class_images(pipe, class_prompt: str, class_dir: str | Path, num_class_images: int, image_size: int,
                          batch_size: int = 4, seed: int = 0, num_inference_steps: int = 25) -> int:
    """Fill ``class_dir`` up to ``num_class_images`` images for DreamBooth's class-specific prior preservation
    loss (Ruiz et al. 2023, sec. 4.2: the model's own samples of the class, trained on beside the subject so it
    keeps what it knew of the class; diffusers' ``train_dreambooth.py``, ``--with_prior_preservation``).

    The images already there are counted (``count_images``; the folder is created if missing); only the rest
    are generated, with ``pipe`` (a diffusers text-to-image pipeline, or anything called the same way: keyword
    arguments ``prompt`` (list of str), ``num_inference_steps``, ``height``, ``width``, ``generator`` (one
    ``torch.Generator`` on ``pipe.device`` per image), ``output_type="pil"``; returns an object whose ``images``
    are PIL images), ``batch_size`` images per call. Each image is written as a PNG named
    ``class-{index:05d}.png``, its index counting on from the number of images already there (names taken are
    skipped), under a temporary name then renamed, so an interrupted run leaves whole images and a re-run
    resumes. Image ``index`` is drawn from a generator seeded ``derive_seed(seed, index)``: it does not depend on
    ``batch_size`` nor on where a run was interrupted.

    Returns:
        The number of images generated (0 when the folder already holds enough).
    Raises:
        UserError: ``num_class_images`` negative. ValueError: ``batch_size`` < 1.
        RuntimeError: the pipeline returned fewer images than asked.
    """
    if num_class_images < 0:
        raise UserError(f"--num_class_images: expected an integer >= 0, got {num_class_images}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    class_dir = Path(class_dir)
    class_dir.mkdir(parents=True, exist_ok=True)
    existing = count_images(class_dir)
    if existing >= num_class_images:
        return 0
    indices, index = [], existing
    while len(indices) < num_class_images - existing:
        if not (class_dir / CLASS_IMAGE_PATTERN.format(index)).exists():
            indices.append(index)
        index += 1
    log.info("%s: %d class images there, generating %d ('%s')", class_dir, existing, len(indices), class_prompt)
    with tqdm(total=len(indices), desc="class images", unit="image", dynamic_ncols=True, disable=None) as bar:
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            generators = [torch.Generator(pipe.device).manual_seed(derive_seed(seed, i)) for i in chunk]
            images = pipe(prompt=[class_prompt] * len(chunk), num_inference_steps=num_inference_steps,
                          height=image_size, width=image_size, generator=generators, output_type="pil").images
            if len(images) < len(chunk):
                raise RuntimeError(f"the pipeline returned {len(images)} images, {len(chunk)} were asked")
            for i, image in zip(chunk, images):
                with atomic_path(class_dir / CLASS_IMAGE_PATTERN.format(i)) as tmp:
                    image.save(tmp, format="PNG")
            bar.update(len(chunk))
    return len(indices)
