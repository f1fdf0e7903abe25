"""The built-in feature extractor of ``digits``: a small CNN trained on scikit-learn's real 8x8 digits, shipped
as ``digits_cnn.safetensors`` (trained by ``benchmarks/digits_quality.py --train_extractor``, deterministic on
the CPU), so that ``ditforge eval --ref digits`` needs nothing downloaded.

Held-out accuracy: 98.9%, 356 of the 360 digits of ``held_out_split`` it never saw in training (the script prints
it and writes it to ``benchmarks/results/digits_extractor.json``; torch 2.13 CPU).

Its digits-FID is the Fréchet distance (``fid.frechet_distance``) between the 64-d penultimate features of the
samples and of the 1,797 real digits; its accuracy the fraction of samples whose argmax class is the label they
were drawn for.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ditforge.eval.fid import compute_metrics, extract_features, reference_statistics

WEIGHTS = Path(__file__).with_name("digits_cnn.safetensors")
NUM_HELD_OUT = 360


class DigitsCNN(nn.Module):
    """(B, 1, 8, 8) float in [-1, 1] -> (features (B, 64), logits (B, 10)). The features are the penultimate
    layer before its ReLU (no unit is constant zero there, so their covariance has full rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 64))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return features, self.head(torch.relu(features))


def to_model_input(images: torch.Tensor) -> torch.Tensor:
    """(B, C, 8, 8) uint8, C 1 or 3 (grey as RGB is averaged back) -> (B, 1, 8, 8) float32 in [-1, 1], the inverse
    of ``ditforge.data.images.to_uint8``."""
    return images.float().mean(dim=1, keepdim=True).div(127.5).sub(1.0)


def real_digits_uint8() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 real digits as samples are stored: (1797, 8, 8, 1) uint8 (``to_uint8`` of the [-1, 1] images)
    and their labels (1797,) int64."""
    from ditforge.data.digits import load_digits_arrays
    from ditforge.data.images import to_uint8

    images, labels = load_digits_arrays()
    return to_uint8(images), labels.numpy()


def held_out_split(n: int = 1797) -> tuple[np.ndarray, np.ndarray]:
    """Indices (training, held-out) of the real digits: a fixed permutation (numpy seed 0), the last
    ``NUM_HELD_OUT`` held out."""
    order = np.random.default_rng(0).permutation(n)
    return order[:-NUM_HELD_OUT], order[-NUM_HELD_OUT:]


class DigitsExtractor:
    """The shipped CNN as an extractor (see ``ditforge.eval.fid``): (B, C, 8, 8) uint8 -> ``pool`` (B, 64),
    ``logits`` (B, 10) float32."""

    name = "digits"
    provides = ("pool", "logits")

    def __init__(self, device: torch.device | str = "cpu", weights: str | Path = WEIGHTS):
        from safetensors.torch import load_file

        self.device = torch.device(device)
        self.net = DigitsCNN()
        self.net.load_state_dict(load_file(str(weights)))
        self.net.to(self.device).eval()

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        pool, logits = self.net(to_model_input(images))
        return {"pool": pool, "logits": logits}


@functools.cache
def _reference(device: str) -> dict[str, np.ndarray]:
    return reference_statistics(DigitsExtractor(device), real_digits_uint8()[0], batch_size=1024)


def evaluate_digits(images: torch.Tensor | np.ndarray, labels: torch.Tensor | np.ndarray | None = None,
                    metrics: tuple[str, ...] = ("fid", "pr", "accuracy"),
                    device: torch.device | str = "cpu") -> dict[str, float]:
    """Digits-FID, precision / recall and class accuracy of samples against the 1,797 real digits (the
    reference statistics are computed once per process and device).

    Args:
        images: (N, 1, 8, 8) float in [-1, 1] (as a model samples them; rounded to 8 bits first, as
            ``to_uint8`` stores them, so that the trainer and ``ditforge eval`` on an .npz agree), or
            (N, 8, 8, C) uint8 (as ``ditforge sample --save_npz`` writes them), N >= 2.
        labels: (N,) int, the classes the samples were drawn for; without them no ``accuracy``.
        metrics: of ``fid``, ``is``, ``pr``, ``accuracy``.
        device: where the CNN and the distances run.

    Returns:
        ``{"fid", "is", "precision", "recall", "accuracy"}`` as asked; FID in squared feature units, the rest
        fractions (IS: in [1, 10]).
    """
    if isinstance(images, torch.Tensor) and images.is_floating_point():
        from ditforge.data.images import to_uint8

        images = to_uint8(images)
    images = np.asarray(images)
    extractor = DigitsExtractor(device)
    feats = extract_features(extractor, images, {"pool", "logits"}, batch_size=1024)
    out = compute_metrics(feats, _reference(str(extractor.device)), [m for m in metrics if m != "accuracy"],
                          extractor.device)
    if "accuracy" in metrics and labels is not None:
        out["accuracy"] = class_accuracy(feats["logits"], np.asarray(labels))
    return out


def class_accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """The fraction of rows of logits (N, 10) whose argmax is the label (N,) int."""
    return float((logits.argmax(axis=1) == labels).mean())
