"""Data sets (built-in ``digits`` and ``clips``, image folders, captioned images, video CSVs, stored features)
and the deterministic global-batch sampler."""

from __future__ import annotations

import csv
from pathlib import Path

from torch.utils.data import Dataset

from ditforge.data.digits import DigitsDataset
from ditforge.data.images import IMAGE_EXTENSIONS, ImageFolderDataset
from ditforge.data.sampler import GlobalBatchSampler
from ditforge.data.shards import build_shard_loader, is_shard_data
from ditforge.errors import UserError

BUILTIN_DATASETS = ("digits", "clips")
CLIPS_IMAGE_SIZE = 32
DEFAULT_NUM_FRAMES = 16
FEATURES_MANIFEST = "features.json"


def _csv_holds_images(path: str) -> bool:
    """True when a CSV's first data row names an image file (its ``path``, ``file_name`` or ``image`` column ends
    in one of ``IMAGE_EXTENSIONS``), or, with no data row, when its header has a ``file_name``, ``image`` or
    ``caption`` column (diffusers' image metadata names; video CSVs have ``path,text``). False when the file
    cannot be read: the video reader then says what is wrong with it."""
    from ditforge.data.captions import PATH_KEYS

    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = [h.strip().lower() for h in next(reader, [])]
            column = next((header.index(k) for k in PATH_KEYS if k in header), None)
            for values in reader:
                if any(v.strip() for v in values):
                    if column is None or column >= len(values):
                        return False
                    return Path(values[column].strip()).suffix.lower() in IMAGE_EXTENSIONS
    except (OSError, UnicodeDecodeError, csv.Error):
        return False
    return any(k in header for k in ("file_name", "image", "caption"))


def is_captioned_image_data(data: str) -> bool:
    """True for captioned images (``CaptionedImageDataset``): a ``.jsonl`` file, a ``.csv`` file whose rows name
    image files (``_csv_holds_images``), or a folder of images with ``<stem>.txt`` captions beside them: one
    without sub-folders (those whose names start with ``.`` do not count), or one holding, directly, an image with
    its caption file (its sub-folders are then searched too). Any other folder is an image folder
    ``ROOT/<class>/<image>``, whether its images have caption files or not. False for the built-in names."""
    if data in BUILTIN_DATASETS:
        return False
    path = Path(data)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return True
    if suffix == ".csv":
        return path.is_file() and _csv_holds_images(data)
    if not path.is_dir() or (path / FEATURES_MANIFEST).is_file() or is_shard_data(data):
        return False
    entries = [p for p in path.iterdir() if not p.name.startswith(".")]
    if not any(p.is_dir() for p in entries):
        return True
    return any(p.suffix.lower() in IMAGE_EXTENSIONS and p.with_suffix(".txt").is_file() for p in entries)


def is_video_data(data: str) -> bool:
    """True for ``clips`` and video CSV files (``.csv`` files whose rows do not name images, see
    ``is_captioned_image_data``)."""
    return data == "clips" or (data.lower().endswith(".csv") and not is_captioned_image_data(data))


def is_features(data: str) -> bool:
    """True for a folder written by ``ditforge extract-features`` (it holds ``features.json``)."""
    return (Path(data) / FEATURES_MANIFEST).is_file()


def build_dataset(data: str, image_size: int | None, bad_samples_path: str | Path | None = None,
                  num_frames: int | None = None, frame_interval: int = 3, seed: int = 0,
                  resize_mode: str = "center_crop", shard_retries: int = 3) -> Dataset:
    """The data set named by ``--data``.

    Image data (``digits``, an image folder ``ROOT/<class>/<image>``): items ``(image (C, S, S) float32 in
    [-1, 1], label int)``; attributes ``num_classes``, ``in_channels``, ``image_size``, ``class_captions``.
    Captioned images (a folder of images with ``<stem>.txt`` captions, a ``.jsonl`` file, a ``.csv`` file naming
    images; see ``is_captioned_image_data``): ``CaptionedImageDataset`` (dict items ``x``, ``text``; resized by
    ``resize_mode``, which only this data uses). Video data (``clips``, a CSV naming videos): ``VideoDataset``
    (dict items; ``num_frames`` defaults to 16, ``image_size`` to 32 for ``clips``).
    A features folder: ``FeatureDataset``. WebDataset shards or a blend of them (``is_shard_data``): ``ShardData``
    (streamed by ``ditforge.data.shards.build_shard_loader``, not a map-style data set; ``shard_retries``).

    Raises:
        UserError: bad folder or CSV (see the data sets), a built-in set asked at a size it does not have, or
            image folders and CSVs without ``--image_size``.
    """
    if is_features(data):
        from ditforge.data.features import FeatureDataset

        return FeatureDataset(data)
    if is_shard_data(data):
        from ditforge.data.shards import ShardData

        return ShardData(data, image_size, bad_samples_path, resize_mode, shard_retries,
                         num_frames or DEFAULT_NUM_FRAMES, frame_interval, seed)
    if data == "digits":
        if image_size not in (None, DigitsDataset.image_size):
            raise UserError(f"--image_size: the digits data set is {DigitsDataset.image_size}x8, got {image_size}")
        return DigitsDataset()
    if data == "clips":
        image_size = image_size or CLIPS_IMAGE_SIZE
    if image_size is None:
        raise UserError(f"--image_size is required for {data} (e.g. --image_size 64)")
    if is_captioned_image_data(data):
        from ditforge.data.captions import CaptionedImageDataset

        return CaptionedImageDataset(data, image_size, bad_samples_path, resize_mode)
    if is_video_data(data):
        from ditforge.data.video import build_video_dataset

        return build_video_dataset(data, num_frames or DEFAULT_NUM_FRAMES, frame_interval, image_size,
                                   bad_samples_path, seed)
    return ImageFolderDataset(data, image_size, bad_samples_path)


__all__ = ["build_dataset", "is_video_data", "is_captioned_image_data", "is_features", "DigitsDataset",
           "ImageFolderDataset", "GlobalBatchSampler", "BUILTIN_DATASETS", "is_shard_data", "build_shard_loader"]
