"""The built-in ``digits`` data set: the 1,797 real 8x8 handwritten digits that scikit-learn ships
(UCI ML hand-written digits; read from the installed package, never downloaded)."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


def load_digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """All digits as (1797, 1, 8, 8) float32 in [-1, 1] (pixel values 0..16 mapped linearly) and (1797,) int64."""
    # scikit-learn's own file, read as its load_digits reads it (64 pixel columns then the label), without
    # importing sklearn.datasets: that import is 1.4 s of every training process's start
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the built-in digits need scikit-learn: pip install scikit-learn")
    with gzip.open(Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = torch.from_numpy(rows[:, :64]).reshape(-1, 1, 8, 8).div(8.0).sub(1.0)
    return x, torch.from_numpy(rows[:, 64]).long()


class DigitsDataset(Dataset):
    """Items are ``(image (1, 8, 8) float32 in [-1, 1], label int)``; 10 classes."""

    num_classes = 10
    in_channels = 1
    image_size = 8
    random_flip = False  # the default of --random_flip: flipped digits are other symbols
    class_captions = [f"a handwritten digit {w}" for w in
                      "zero one two three four five six seven eight nine".split()]  # for --condition text

    def __init__(self) -> None:
        self.images, self.labels = load_digits_arrays()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], int(self.labels[i])
