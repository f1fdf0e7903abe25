"""The built-in ``digits`` data set: the 1,797 real 8x8 handwritten digits that scikit-learn ships
(UCI ML hand-written digits; read from the installed package, never downloaded)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


def load_digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """All digits as (1797, 1, 8, 8) float32 in [-1, 1] (pixel values 0..16 mapped linearly) and (1797,) int64."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images).float().div(8.0).sub(1.0).unsqueeze(1)
    return x, torch.from_numpy(d.target).long()


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
