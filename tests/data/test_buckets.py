"""Multi-resolution buckets: the aspect table, the assignment rule (nearest aspect, frame counts, keep
probabilities within 3 sigma), bucketed global batches (batch sizes, world-size independence, resume), the
mixed image / video data set, and bad configs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from ditforge.data.buckets import (ASPECT_RATIOS, BucketBatchSampler, BucketDataset, Buckets, aspect_shape,
                                   read_bucket_config, resolution_area)
from ditforge.data.images import center_crop_arr
from ditforge.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


def _shapes_of(buckets: Buckets, res: str, frames: int) -> list[tuple[int, int, int]]:
    return [(i, b.height, b.width) for i, b in enumerate(buckets.buckets)
            if b.resolution == res and b.num_frames == frames]


@pytest.mark.parametrize("res,multiple", [("256px", 16), ("512px", 16), ("240p", 8), ("64px", 2), ("1024", 64)])
def test_aspect_table(res, multiple):
    area = resolution_area(res)
    for ratio in ASPECT_RATIOS:
        h, w = aspect_shape(area, ratio, multiple)
        assert h % multiple == 0 and w % multiple == 0
        # the rounding moves each side by less than one multiple: bounds of the area and aspect errors
        slack = multiple / math.sqrt(area * min(ratio) / max(ratio))
        assert abs(math.log(h * w / area)) <= 2 * slack
        assert abs(math.log(h / w * ratio[1] / ratio[0])) <= 2 * slack
    assert resolution_area("240p") == 240 * 427 and resolution_area("256") == 256 * 256


def test_nearest_aspect_and_frame_rules():
    cfg = {"64px": {1: (1.0, 4), 8: (1.0, 2), 4: (1.0, 2)}, "32px": {1: (1.0, 4), 4: (1.0, 2)}}
    buckets = Buckets(cfg, multiple=4, frame_interval=3)
    rng = np.random.default_rng(0)
    for _ in range(300):
        h, w = (int(v) for v in rng.integers(20, 200, 2))
        t = int(rng.choice([1, 3, 9, 10, 21, 22, 40]))
        cands = buckets.candidates(h, w, t)
        # independent reference of rule 1: the resolutions big enough, largest first, with their frame count
        expect = []
        for res in ("64px", "32px"):
            if h * w < 0.8 * resolution_area(res):
                continue
            counts = [f for f in cfg[res] if (f == 1 if t == 1 else f > 1 and (f - 1) * 3 + 1 <= t)]
            if counts:
                expect.append((res, max(counts)))
        assert [(buckets.buckets[b].resolution, buckets.buckets[b].num_frames) for b in cands] == expect
        for b in cands:  # rule 3: nearest aspect in log among that (resolution, frames)' shapes
            bucket = buckets.buckets[b]
            errors = {i: abs(math.log(hh / ww) - math.log(h / w))
                      for i, hh, ww in _shapes_of(buckets, bucket.resolution, bucket.num_frames)}
            assert errors[b] == min(errors.values())
        if cands:  # all keep probabilities are 1: the first candidate
            assert buckets.assign_bucket(h, w, t, (7, h, w, t)) == buckets.buckets[cands[0]]
        else:
            assert buckets.assign_bucket(h, w, t, 1) is None


def test_keep_probabilities_within_3_sigma():
    cfg = {"64px": {1: (0.3, 4)}, "32px": {1: (0.6, 4)}, "16px": {1: (0.5, 4)}}
    buckets = Buckets(cfg, multiple=2)
    # a big square image: 64px with p 0.3, else 32px with 0.6, else 16px with 0.5, else dropped
    expect = {"64px": 0.3, "32px": 0.7 * 0.6, "16px": 0.7 * 0.4 * 0.5, None: 0.7 * 0.4 * 0.5}
    n = 6000
    seen = [buckets.assign_bucket(80, 80, 1, (3, i)) for i in range(n)]
    counts = {k: sum((b.resolution if b else None) == k for b in seen) for k in expect}
    for k, p in expect.items():
        assert abs(counts[k] - n * p) < 3 * math.sqrt(n * p * (1 - p)), (k, counts, expect)
    # the sampler's vectorised draws follow the same rule: its epoch counts over all samples
    sampler = BucketBatchSampler(buckets, np.tile([80, 80, 1], (n, 1)), seed=5)
    sampler.epoch_plan(0)
    p = expect[None]
    assert abs(sampler.counts[0]["dropped"] - n * p) < 3 * math.sqrt(n * p * (1 - p))


def _sizes(rng, n):
    """Images of mixed sizes and videos of mixed lengths: (n, 3) (height, width, frames)."""
    h = rng.integers(12, 90, n)
    w = rng.integers(12, 90, n)
    t = np.where(rng.random(n) < 0.4, rng.integers(2, 30, n), 1)
    return np.stack([h, w, t], 1)


CFG = {"64px": {1: (0.6, 8), 8: (0.7, 4)}, "32px": {1: (1.0, 16), 4: (0.9, 8), 8: (1.0, 4)}}


def test_batches_hold_one_bucket_of_its_size():
    rng = np.random.default_rng(1)
    sizes = _sizes(rng, 700)
    buckets = Buckets(CFG, multiple=4, frame_interval=2)
    sampler = BucketBatchSampler(buckets, sizes, seed=3)
    total = 0
    for epoch in range(3):
        plan = sampler.epoch_plan(epoch)
        used = torch.cat([ids for _, ids in plan])
        assert len(used) == len(set(used.tolist()))  # no sample twice in an epoch
        for b, ids in plan:
            assert len(ids) == buckets.buckets[b].batch_size
            for i in ids.tolist():
                assert b in buckets.candidates(*sizes[i])
        c = sampler.counts[epoch]
        assert c["batched"] == len(used) and c["batched"] + c["dropped"] + c["tails"] == len(sizes)
        total += len(plan)
    assert len({b for b, _ in sampler.epoch_plan(0)}) > 4  # images and videos of several buckets


@pytest.mark.parametrize("start,batch_size", [(17, None), (61, None), (23, 12)])
def test_world_size_independence_and_resume(start, batch_size):
    """Batches of one bucket (``batch_size`` None), or of mixed buckets (``--pack_tokens``): the global batch at
    each step, from a resume at ``start``, is the uninterrupted run's at 1, 2 and 4 processes."""
    rng = np.random.default_rng(2)
    sizes = _sizes(rng, 500)
    buckets = Buckets(CFG, multiple=4, frame_interval=2)
    ref = BucketBatchSampler(buckets, sizes, seed=9, batch_size=batch_size)
    steps = 25
    assert ref.locate(start)[0] != ref.locate(start + steps)[0]  # across an epoch boundary
    expect = []
    for k in range(start, start + steps):
        b, ids = ref.global_batch(k)
        expect.append(list(zip(ids.tolist(), b.tolist() if batch_size else [b] * len(ids))))
    if batch_size:  # each of 12 samples in a bucket of its own candidates, several buckets a batch
        assert all(len(keys) == batch_size and all(b in buckets.candidates(*sizes[i]) for i, b in keys)
                   for keys in expect)
        assert min(len({b for _, b in keys}) for keys in expect) > 1
    for world in (1, 2, 4):
        iters = [iter(BucketBatchSampler(buckets, sizes, 9, r, world, start_step=start, batch_size=batch_size))
                 for r in range(world)]
        for keys in expect:
            assert [key for it in iters for key in next(it)] == keys


def test_bad_configs(tmp_path):
    def write(obj):
        path = tmp_path / "b.json"
        path.write_text(json.dumps(obj))
        return path

    assert read_bucket_config(write({"256px": {"1": [1.0, 64], "16": [0.5, 8]}})) == {"256px": {1: (1.0, 64),
                                                                                         16: (0.5, 8)}}
    for bad, words in [({"256pix": {"1": [1, 2]}}, "unknown resolution"), ({"256px": {"0": [1, 2]}}, "positive"),
                       ({"256px": {"1": [1.5, 2]}}, "keep probability"), ({"256px": {"1": [1, 0]}}, "batch size"),
                       ({"256px": {}}, "no frame counts"), ([], "no buckets")]:
        with pytest.raises(UserError, match=words):
            read_bucket_config(write(bad))
    buckets = Buckets({"32px": {1: (1.0, 6)}}, 2)
    with pytest.raises(UserError, match="not divisible by the number of processes"):
        BucketBatchSampler(buckets, np.tile([40, 40, 1], (20, 1)), 0, 0, 4)
    with pytest.raises(UserError, match="no bucket gathers a full global batch"):
        BucketBatchSampler(buckets, np.tile([40, 40, 1], (5, 1)), 0)


@pytest.mark.parametrize("h,w,size", [(37, 90, (12, 20)), (90, 37, (20, 12)), (100, 100, (16, 24)), (23, 29, (8, 8))])
def test_rectangular_centre_crop(h, w, size):
    img = Image.fromarray(np.random.default_rng(h).integers(0, 256, (h, w, 3), dtype=np.uint8))
    # reference: box-halve while both sides allow, bicubic to cover (h', w'), centre crop
    th, tw = size
    ref = img
    while ref.width >= 2 * tw and ref.height >= 2 * th:
        ref = ref.resize((ref.width // 2, ref.height // 2), Image.BOX)
    s = max(th / ref.height, tw / ref.width)
    ref = np.asarray(ref.resize((round(ref.width * s), round(ref.height * s)), Image.BICUBIC))
    top, left = (ref.shape[0] - th) // 2, (ref.shape[1] - tw) // 2
    np.testing.assert_array_equal(center_crop_arr(img, size), ref[top:top + th, left:left + tw])
    if th == tw:  # the square call is the same function
        np.testing.assert_array_equal(center_crop_arr(img, th), center_crop_arr(img, size))


def test_mixed_data_set(tmp_path):
    from tests.data.test_video import frame_ids, write_video

    rng = np.random.default_rng(4)
    rows = []
    for i, (h, w) in enumerate([(40, 80), (80, 40), (48, 48), (36, 60), (64, 50), (30, 30)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / f"im{i}.png")
        rows.append((f"im{i}.png", f"image {i % 2}"))
    for i, n in enumerate([12, 30, 20]):
        write_video(tmp_path / f"v{i}.mp4", n, w=48, h=32)
        rows.append((f"v{i}.mp4", "a video"))
    rows.append(("missing.png", "gone"))
    (tmp_path / "data.csv").write_text("path,text\n" + "".join(f"{p},{t}\n" for p, t in rows))
    buckets = Buckets({"32px": {1: (1.0, 1), 4: (1.0, 1)}}, multiple=4, frame_interval=3)
    ds = BucketDataset(tmp_path / "data.csv", buckets, tmp_path / "bad.jsonl")
    assert len(ds) == 9 and ds.num_dropped == 1 and "missing.png" in (tmp_path / "bad.jsonl").read_text()
    assert ds.sizes[:2].tolist() == [[40, 80, 1], [80, 40, 1]] and ds.sizes[6:].tolist() == [[32, 48, 12],
                                                                                            [32, 48, 30],
                                                                                            [32, 48, 20]]
    assert ds.num_frames == 4 and ds.classes == ["a video", "image 0", "image 1"]
    sampler = BucketBatchSampler(buckets, ds.sizes, seed=0)
    seen = set()
    for b, ids in sampler.epoch_plan(0):
        bucket = buckets.buckets[b]
        for i in ids.tolist():
            item = ds[(i, b)]
            assert item["index"] == i and item["x"].shape == (3, bucket.num_frames, bucket.height, bucket.width)
            h, w, t = ds.sizes[i]
            ratios = [math.log(bb.height / bb.width) for bb in buckets.buckets if bb.num_frames == bucket.num_frames]
            assert abs(math.log(bucket.height / bucket.width) - math.log(h / w)) == min(
                abs(r - math.log(h / w)) for r in ratios)
            if t == 1:
                with Image.open(ds.paths[i]) as img:
                    ref = center_crop_arr(img.convert("RGB"), (bucket.height, bucket.width))
                torch.testing.assert_close(item["x"][:, 0], torch.from_numpy(ref).permute(2, 0, 1).float() / 127.5 - 1)
            else:  # frames at stride 3 (the synthetic frames carry their index)
                ids_ = frame_ids(item["x"])
                assert np.diff(ids_).tolist() == [3] * (bucket.num_frames - 1)
            seen.add(i)
    assert seen == set(range(9))  # keep probability 1 and batch size 1: every sample is used
