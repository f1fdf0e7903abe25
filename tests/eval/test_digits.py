"""The shipped digits extractor: accurate on real digits it never saw, a small digits-FID between two sets of
real digits and a large one against noise; ``ditforge eval --ref digits`` and ``evaluate_digits`` agree."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ditforge import cli
from ditforge.data.digits import load_digits_arrays
from ditforge.eval.digits import DigitsExtractor, evaluate_digits, held_out_split, real_digits_uint8
from ditforge.eval.fid import extract_features, feature_statistics, frechet_distance


@pytest.fixture(scope="module")
def digits():
    images, labels = real_digits_uint8()
    train, held_out = held_out_split(len(labels))
    return images, labels, train, held_out


def test_held_out_accuracy(digits):
    images, labels, _, held_out = digits
    assert evaluate_digits(images[held_out], labels[held_out], metrics=("accuracy",))["accuracy"] > 0.97


def test_fid_small_between_real_sets_large_against_noise(digits):
    images, _, train, held_out = digits
    extractor = DigitsExtractor()

    def stats(x):
        return feature_statistics(extract_features(extractor, x, {"pool"}, 512)["pool"])

    ref = stats(images[train])
    real = frechet_distance(*stats(images[held_out]), *ref)
    noise = np.random.default_rng().integers(0, 256, images[held_out].shape, dtype=np.uint8)
    fake = frechet_distance(*stats(noise), *ref)
    assert 0 < real < 40 and fake > 20 * real


def test_trainer_input_equals_npz_input(digits):
    # The trainer passes (N, 1, 8, 8) float samples, ditforge eval reads uint8 (N, 8, 8, 1): same numbers.
    images, labels, _, held_out = digits
    floats = load_digits_arrays()[0][held_out] + torch.randn(len(held_out), 1, 8, 8) * 0.05
    from ditforge.data.images import to_uint8

    assert evaluate_digits(floats, labels[held_out]) == evaluate_digits(to_uint8(floats), labels[held_out])


def test_cli_eval_against_digits(digits, tmp_path, capsys):
    images, labels, _, held_out = digits
    samples = tmp_path / "samples.npz"
    np.savez(samples, samples=images[held_out], labels=labels[held_out])  # as ditforge sample --save_npz writes
    assert cli.main(["eval", "--samples", str(samples), "--ref", "digits", "--device", "cpu",
                     "--save_ref", str(tmp_path / "ref.npz")]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result.pop("extractor") == "digits"
    assert result == pytest.approx({"num_samples": len(held_out),
                                    **evaluate_digits(images[held_out], labels[held_out])}, rel=1e-9)
    # The cached reference gives the same numbers.
    assert cli.main(["eval", "--samples", str(samples), "--ref", str(tmp_path / "ref.npz"), "--device", "cpu"]) == 0
    cached = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert cached.pop("extractor") == "digits" and cached == pytest.approx(result, rel=1e-9)
