"""Data sets (built-in digits, image folders, bad files) and the deterministic global-batch sampler."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from ditforge.data import DigitsDataset, GlobalBatchSampler, ImageFolderDataset, build_dataset
from ditforge.data.images import center_crop_arr
from ditforge.errors import UserError

# ----------------------------------------------------------------------------------------------------------
# digits


def test_digits_match_sklearn():
    from sklearn.datasets import load_digits

    ref = load_digits()
    ds = DigitsDataset()
    assert len(ds) == 1797
    assert (ds.num_classes, ds.in_channels, ds.image_size) == (10, 1, 8)
    xs = torch.stack([ds[i][0] for i in range(len(ds))])
    ys = [ds[i][1] for i in range(len(ds))]
    assert xs.shape == (1797, 1, 8, 8) and xs.dtype == torch.float32
    assert float(xs.min()) == -1.0 and float(xs.max()) == 1.0  # pixel values 0..16 both occur
    # pixels 0..16 -> [-1, 1] linearly: exact in float32 (multiples of 1/8)
    assert np.array_equal(xs[:, 0].numpy(), (ref.images / 8.0 - 1.0).astype(np.float32))
    assert ys == ref.target.tolist() and set(ys) == set(range(10))
    assert all(isinstance(y, int) for y in ys[:5])


def test_build_dataset_digits_size_check():
    assert build_dataset("digits", None).image_size == 8
    assert build_dataset("digits", 8).image_size == 8
    with pytest.raises(UserError, match="--image_size"):
        build_dataset("digits", 16)


# ----------------------------------------------------------------------------------------------------------
# image folders


def _random_image(rng, size, mode="RGB"):
    w, h = size
    if mode == "L":
        return Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8), mode="L")
    # smooth random colours (a gradient plus noise), so JPEG and resampling have something to do
    base = rng.integers(0, 256, 3)
    yy, xx = np.mgrid[0:h, 0:w]
    arr = (base + 3 * xx[..., None] - 2 * yy[..., None] + rng.integers(-40, 40, (h, w, 3))) % 256
    return Image.fromarray(arr.astype(np.uint8), mode="RGB")


def _reference_crop(path, s):
    """Short side to s (box-halving while >= 2s, then bicubic), centre crop; (s, s, 3) uint8. Written out
    independently of ditforge from the ADM/DiT recipe."""
    with Image.open(path) as im:
        img = im.convert("RGB")
    while min(img.width, img.height) >= 2 * s:
        img = img.resize((img.width // 2, img.height // 2), resample=Image.BOX)
    short = min(img.width, img.height)
    new_w, new_h = round(img.width * s / short), round(img.height * s / short)
    img = img.resize((new_w, new_h), resample=Image.BICUBIC)
    arr = np.array(img)
    assert min(arr.shape[:2]) == s
    top, left = (new_h - s) // 2, (new_w - s) // 2
    return arr[top : top + s, left : left + s]


@pytest.fixture
def image_tree(tmp_path):
    rng = np.random.default_rng()
    root = tmp_path / "images"
    files = {
        "cat/a_wide.png": ((40, 30), "RGB", "PNG"),
        "cat/b_tall.jpg": ((17, 50), "RGB", "JPEG"),
        "cat/sub/c_big_gray.png": ((100, 70), "L", "PNG"),  # halved twice; nested folders are searched
        "dog/b_good.jpeg": ((33, 33), "RGB", "JPEG"),
    }
    for rel, (size, mode, fmt) in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        _random_image(rng, size, mode).save(root / rel, format=fmt)
    (root / "dog" / "notes.txt").write_text("not an image")
    return root


def test_image_folder_items(image_tree):
    s = 16
    ds = ImageFolderDataset(image_tree, s)
    assert ds.classes == ["cat", "dog"] and ds.num_classes == 2 and ds.in_channels == 3
    assert len(ds) == 4  # notes.txt is not an image
    names = [os.path.relpath(p, image_tree) for p, _ in ds.samples]
    assert names == ["cat/a_wide.png", "cat/b_tall.jpg", "cat/sub/c_big_gray.png", "dog/b_good.jpeg"]
    for i, (path, label) in enumerate(ds.samples):
        x, y = ds[i]
        assert y == label == (0 if "cat" in path else 1)
        assert x.shape == (3, s, s) and x.dtype == torch.float32
        assert -1.0 <= float(x.min()) and float(x.max()) <= 1.0
        ref = _reference_crop(path, s)
        # uint8 -> [-1, 1] is x / 127.5 - 1 (float32 rounding of that expression)
        expect = torch.from_numpy(ref.astype(np.float32)).permute(2, 0, 1) / 127.5 - 1.0
        torch.testing.assert_close(x, expect, rtol=0, atol=1e-6)


@pytest.mark.parametrize("size,s", [((40, 30), 16), ((17, 50), 16), ((100, 70), 16), ((64, 64), 32), ((31, 9), 8)])
def test_center_crop_arr_matches_reference(tmp_path, size, s):
    path = tmp_path / "x.png"
    _random_image(np.random.default_rng(), size).save(path)
    with Image.open(path) as img:
        got = center_crop_arr(img.convert("RGB"), s)
    assert got.shape == (s, s, 3) and got.dtype == np.uint8
    assert np.array_equal(got, _reference_crop(path, s))


def test_image_folder_bad_roots(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(UserError, match=str(missing)):
        ImageFolderDataset(missing, 16)

    flat = tmp_path / "flat"  # images but no class sub-folders
    flat.mkdir()
    _random_image(np.random.default_rng(), (20, 20)).save(flat / "x.png")
    with pytest.raises(UserError, match=str(flat)):
        ImageFolderDataset(flat, 16)

    empty = tmp_path / "empty"  # class folders without images
    (empty / "a").mkdir(parents=True)
    (empty / "b").mkdir()
    (empty / "b" / "readme.txt").write_text("x")
    with pytest.raises(UserError, match=str(empty)):
        ImageFolderDataset(empty, 16)

    with pytest.raises(UserError, match="--image_size"):
        build_dataset(str(flat), None)


def test_corrupt_image_is_skipped_and_recorded(image_tree, tmp_path):
    rng = np.random.default_rng()
    (image_tree / "dog" / "a_bad.png").write_bytes(rng.bytes(300))
    (image_tree / "dog" / "z_bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + rng.bytes(100))  # PNG magic, junk body
    log = tmp_path / "bad_samples.jsonl"
    ds = ImageFolderDataset(image_tree, 16, log)
    names = [os.path.basename(p) for p, _ in ds.samples]
    assert names == ["a_wide.png", "b_tall.jpg", "c_big_gray.png", "a_bad.png", "b_good.jpeg", "z_bad.png"]

    x, y = ds[3]  # a_bad.png -> the next readable image, b_good.jpeg, with its own label
    good, _ = ds[4]
    assert y == 1 and torch.equal(x, good)
    x, y = ds[5]  # z_bad.png is the last: wraps to the first image
    first, first_label = ds[0]
    assert y == first_label == 0 and torch.equal(x, first)

    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [os.path.basename(r["path"]) for r in records] == ["a_bad.png", "z_bad.png"]
    assert all(r["error"] for r in records)


# ----------------------------------------------------------------------------------------------------------
# GlobalBatchSampler


def _take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def test_sampler_epoch_batches_are_disjoint_and_cover():
    n, b, seed = int(torch.randint(60, 200, ())), 8, int(torch.randint(0, 1000, ()))
    s = GlobalBatchSampler(n, b, seed)
    spe = n // b
    assert s.steps_per_epoch == spe
    for epoch in range(2):
        batches = _take(GlobalBatchSampler(n, b, seed, start_step=epoch * spe), spe)
        flat = [i for batch in batches for i in batch]
        assert all(len(batch) == b for batch in batches)
        assert len(set(flat)) == spe * b and all(0 <= i < n for i in flat)
        # the documented order: epoch e is randperm(n) under SeedSequence([seed, e])'s first 32-bit word,
        # its incomplete tail dropped
        epoch_seed = int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed))
        assert flat == perm[: spe * b].tolist()
    e0, e1 = _take(s, 2 * spe)[:spe], _take(s, 2 * spe)[spe:]
    assert e0 != e1  # a new order each epoch


@pytest.mark.parametrize("world_size", [2, 4])
def test_sampler_rank_slices_concatenate(world_size):
    n, b, seed = 150, 16, int(torch.randint(0, 1000, ()))
    whole = _take(GlobalBatchSampler(n, b, seed), 20)  # 20 > 9 steps per epoch: crosses epochs
    parts = [_take(GlobalBatchSampler(n, b, seed, rank=r, world_size=world_size), 20) for r in range(world_size)]
    for k in range(20):
        assert all(len(p[k]) == b // world_size for p in parts)
        assert sum((p[k] for p in parts), []) == whole[k]


@pytest.mark.parametrize("k", [0, 1, 5, 9, 23])
def test_sampler_start_step(k):
    n, b, seed = 100, 10, 7
    fresh = _take(GlobalBatchSampler(n, b, seed), k + 3)
    assert _take(GlobalBatchSampler(n, b, seed, start_step=k), 3) == fresh[k:]
    # and per rank
    assert _take(GlobalBatchSampler(n, b, seed, rank=1, world_size=2, start_step=k), 1)[0] == fresh[k][5:]


def test_sampler_errors():
    with pytest.raises(UserError, match="--batch_size 33"):
        GlobalBatchSampler(32, 33, 0)
    with pytest.raises(UserError, match="not divisible"):
        GlobalBatchSampler(100, 10, 0, rank=0, world_size=4)
    GlobalBatchSampler(32, 32, 0)  # exactly the data set: fine, one step per epoch
