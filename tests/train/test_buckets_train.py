"""A bucketed run end to end through the real CLI: a DiT on images of mixed sizes and a vDiT on images and short
videos together. Every step's batch has its bucket's shape, every sample lands in a bucket of its own nearest
aspect ratio, and the loss is finite."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

from ditforge import cli
from ditforge.data.buckets import BucketBatchSampler, BucketDataset, Buckets, read_bucket_config
from ditforge.train import trainer

pytestmark = pytest.mark.usefixtures("one_thread")

IMAGES = [(16, 32), (16, 32), (32, 16), (32, 16), (24, 24), (26, 26), (20, 36), (21, 37)]  # (h, w), aspect pairs
VIDEOS = [(24, 32), (24, 32), (32, 24), (32, 24)]  # 12 frames each: 4 at stride 3 need 10


def _data(tmp_path, videos: bool):
    from tests.data.test_video import write_video

    rng = np.random.default_rng(0)
    rows = []
    for i, (h, w) in enumerate(IMAGES):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / f"im{i}.png")
        rows.append(f"im{i}.png,class {i % 2}")
    for i, (h, w) in enumerate(VIDEOS if videos else []):
        write_video(tmp_path / f"v{i}.mp4", 12, w=w, h=h)
        rows.append(f"v{i}.mp4,class {i % 2}")
    (tmp_path / "data.csv").write_text("path,text\n" + "\n".join(rows) + "\n")
    frames = ", 4: [1.0, 2]" if videos else ""
    (tmp_path / "buckets.yaml").write_text(f"16px: {{1: [1.0, 2]{frames}}}\n")
    return tmp_path / "data.csv", tmp_path / "buckets.yaml"


@pytest.mark.parametrize("model,videos,patch", [("DiT-T/2", False, 2), ("vDiT-T/122", True, 2),
                                                ("vDiT-T/244", True, 4)])  # 244: an image's frame twice
def test_bucketed_run(tmp_path, monkeypatch, model, videos, patch):
    data, bucket_file = _data(tmp_path, videos)
    shapes = []
    real_step = trainer.train_step

    def recording(model_, diffusion, optimizer, scaler, micro_batches, *args, **kwargs):
        shapes.append(tuple(micro_batches[0][0].shape))
        return real_step(model_, diffusion, optimizer, scaler, micro_batches, *args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", recording)
    steps = 6 if videos else 4  # one epoch: every batch of every bucket
    out = tmp_path / "run"
    assert cli.main(["train", "--data", str(data), "--buckets", str(bucket_file), "--model", model, "--condition",
                     "class", "--frame_interval", "3", "--max_steps", str(steps), "--num_workers", "0",
                     "--sample_every", "0", "--log_every", "1", "--mixed_precision", "fp32", "--device", "cpu",
                     "--outputs", str(out)]) == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)

    # the batches the run saw: the sampler's plan for the run's seed, at the bucket shapes of pixel space
    buckets = Buckets(read_bucket_config(bucket_file), multiple=patch, frame_interval=3)
    ds = BucketDataset(data, buckets)
    sampler = BucketBatchSampler(buckets, ds.sizes, seed=0)
    seen = set()
    for k, shape in enumerate(shapes):
        b, ids = sampler.global_batch(k)
        bucket = buckets.buckets[b]
        assert shape == (2, 3, *([bucket.num_frames] if videos else []), bucket.height, bucket.width)
        for i in ids.tolist():
            h, w, t = ds.sizes[i]
            assert (bucket.num_frames == 1) == (t == 1)
            # its own nearest aspect ratio among the buckets of its frame count (log distance)
            errors = [abs(math.log(o.height / o.width / (h / w))) for o in buckets.buckets
                      if o.num_frames == bucket.num_frames]
            assert abs(math.log(bucket.height / bucket.width / (h / w))) == min(errors)
            seen.add(i)
    assert seen == set(range(len(ds)))  # every sample trained, images and videos
    assert len({s[2:] for s in shapes}) >= 3  # at several shapes (1:2, 1:1, 2:1 at least)


def test_bucket_errors_are_one_line(tmp_path, capsys):
    data, bucket_file = _data(tmp_path, videos=False)
    base = ["train", "--data", str(data), "--max_steps", "1", "--device", "cpu", "--outputs", str(tmp_path / "r")]
    (tmp_path / "odd.yaml").write_text("16px: {1: [1.0, 2], 3: [1.0, 2]}\n")
    (tmp_path / "three.yaml").write_text("16px: {1: [1.0, 3]}\n")
    for extra, words in [(["--buckets", str(tmp_path / "odd.yaml"), "--model", "vDiT-T/244"], "temporal patch 2"),
                         (["--buckets", str(tmp_path / "three.yaml"), "--grad_accum_steps", "2"], "not divisible"),
                         (["--buckets", str(tmp_path / "none.yaml")], "cannot read")]:
        assert cli.main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "--buckets" in err and len(err.splitlines()) == 1, err
