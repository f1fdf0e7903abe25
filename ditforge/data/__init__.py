"""Data sets (built-in ``digits``, image folders) and the deterministic global-batch sampler."""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import Dataset

from ditforge.data.digits import DigitsDataset
from ditforge.data.images import ImageFolderDataset
from ditforge.data.sampler import GlobalBatchSampler
from ditforge.errors import UserError

BUILTIN_DATASETS = ("digits",)


def build_dataset(data: str, image_size: int | None, bad_samples_path: str | Path | None = None) -> Dataset:
    """The data set named by ``--data``: a built-in name or an image folder.

    Returns a Dataset with attributes ``num_classes``, ``in_channels`` and ``image_size``; items are
    ``(image (C, S, S) float32 in [-1, 1], label int)``.

    Raises:
        UserError: bad folder (see ``ImageFolderDataset``), a built-in set asked at a size it does not have,
            or an image folder without ``--image_size``.
    """
    if data == "digits":
        if image_size not in (None, DigitsDataset.image_size):
            raise UserError(f"--image_size: the digits data set is {DigitsDataset.image_size}x8, got {image_size}")
        return DigitsDataset()
    if image_size is None:
        raise UserError(f"--image_size is required for the image folder {data} (e.g. --image_size 64)")
    return ImageFolderDataset(data, image_size, bad_samples_path)


__all__ = ["build_dataset", "DigitsDataset", "ImageFolderDataset", "GlobalBatchSampler", "BUILTIN_DATASETS"]
