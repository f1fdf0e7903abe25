"""Data sets (built-in ``digits`` and ``clips``, image folders, captioned images, video CSVs, stored features,
WebDataset shards and blends), recognised and built by one registry (``ditforge.data.sources``), and the
deterministic global-batch sampler."""

from __future__ import annotations

from ditforge.data.digits import DigitsDataset
from ditforge.data.images import ImageFolderDataset
from ditforge.data.sampler import GlobalBatchSampler
from ditforge.data.shards.loader import build_shard_loader
from ditforge.data.sources import BUILTIN_DATASETS, SOURCES, Source, build_dataset, source_of

__all__ = ["build_dataset", "source_of", "Source", "SOURCES", "DigitsDataset", "ImageFolderDataset",
           "GlobalBatchSampler", "BUILTIN_DATASETS", "build_shard_loader"]
