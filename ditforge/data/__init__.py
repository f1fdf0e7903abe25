"""Data sets (built-in ``digits`` and ``clips``, image folders, video CSVs, stored features) and the
deterministic global-batch sampler."""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import Dataset

from ditforge.data.digits import DigitsDataset
from ditforge.data.images import ImageFolderDataset
from ditforge.data.sampler import GlobalBatchSampler
from ditforge.errors import UserError

BUILTIN_DATASETS = ("digits", "clips")
CLIPS_IMAGE_SIZE = 32
DEFAULT_NUM_FRAMES = 16
FEATURES_MANIFEST = "features.json"


def is_video_data(data: str) -> bool:
    """True for ``clips`` and video CSV files (``.csv``)."""
    return data == "clips" or data.lower().endswith(".csv")


def is_features(data: str) -> bool:
    """True for a folder written by ``ditforge extract-features`` (it holds ``features.json``)."""
    return (Path(data) / FEATURES_MANIFEST).is_file()


def build_dataset(data: str, image_size: int | None, bad_samples_path: str | Path | None = None,
                  num_frames: int | None = None, frame_interval: int = 3, seed: int = 0) -> Dataset:
    """The data set named by ``--data``.

    Image data (``digits``, an image folder): items ``(image (C, S, S) float32 in [-1, 1], label int)``;
    attributes ``num_classes``, ``in_channels``, ``image_size``, ``class_captions``. Video data (``clips``, a
    CSV): ``VideoDataset`` (dict items; ``num_frames`` defaults to 16, ``image_size`` to 32 for ``clips``).
    A features folder: ``FeatureDataset``.

    Raises:
        UserError: bad folder or CSV (see the data sets), a built-in set asked at a size it does not have, or
            image folders and CSVs without ``--image_size``.
    """
    if is_features(data):
        from ditforge.data.features import FeatureDataset

        return FeatureDataset(data)
    if data == "digits":
        if image_size not in (None, DigitsDataset.image_size):
            raise UserError(f"--image_size: the digits data set is {DigitsDataset.image_size}x8, got {image_size}")
        return DigitsDataset()
    if data == "clips":
        image_size = image_size or CLIPS_IMAGE_SIZE
    if image_size is None:
        raise UserError(f"--image_size is required for {data} (e.g. --image_size 64)")
    if is_video_data(data):
        from ditforge.data.video import build_video_dataset

        return build_video_dataset(data, num_frames or DEFAULT_NUM_FRAMES, frame_interval, image_size,
                                   bad_samples_path, seed)
    return ImageFolderDataset(data, image_size, bad_samples_path)


__all__ = ["build_dataset", "is_video_data", "is_features", "DigitsDataset", "ImageFolderDataset",
           "GlobalBatchSampler", "BUILTIN_DATASETS"]
