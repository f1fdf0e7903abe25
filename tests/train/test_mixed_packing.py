"""``--buckets`` with ``--pack_tokens``: one step packs images and videos of several buckets. Through the real CLI,
the first step's loss equals the loss computed unpacked, sample by sample, from the step's weights, samples,
noise and timesteps; the per-sample randomness does not depend on the number of processes; a bucket longer
than a packed row is a one-line error at start."""

from __future__ import annotations

import copy

import pytest
import torch

from ditforge import cli
from ditforge.data.buckets import BucketBatchSampler, BucketDataset, Buckets, read_bucket_config
from ditforge.train import trainer
from tests.train.test_buckets_train import _data

pytestmark = pytest.mark.usefixtures("one_thread")


def _argv(data, bucket_file, out, *extra):
    return ["train", "--data", str(data), "--buckets", str(bucket_file), "--model", "vDiT-T/122", "--condition",
            "class", "--frame_interval", "3", "--batch_size", "4", "--num_workers", "0", "--sample_every", "0",
            "--log_every", "1", "--mixed_precision", "fp32", "--device", "cpu", "--outputs", str(out), *extra]


def test_mixed_step_loss_equals_unpacked(tmp_path, monkeypatch):
    data, bucket_file = _data(tmp_path, videos=True)
    steps = []
    real_step = trainer.train_step

    def recording(model, diffusion, optimizer, scaler, micro_batches, *args, **kwargs):
        before = copy.deepcopy(model)  # the weights the step starts from
        out = real_step(model, diffusion, optimizer, scaler, micro_batches, *args, **kwargs)
        steps.append((before, diffusion, micro_batches, out))
        return out

    monkeypatch.setattr(trainer, "train_step", recording)
    assert cli.main(_argv(data, bucket_file, tmp_path / "run", "--pack_tokens", "320", "--grad_accum_steps", "2",
                          "--max_steps", "1")) == 0
    model, diffusion, micro, out = steps[0]
    assert len(micro) == 2 and all(len(mb[0]) == 2 for mb in micro)  # 4 samples over 2 micro-batches

    # the batch is the sampler's step 0: samples of several buckets (images and videos), each at its bucket's shape
    buckets = Buckets(read_bucket_config(bucket_file), multiple=2, frame_interval=3)
    bucket_ids, _ = BucketBatchSampler(buckets, BucketDataset(data, buckets).sizes, seed=0, batch_size=4).global_batch(0)
    assert len({buckets.buckets[b].num_frames for b in bucket_ids.tolist()}) == 2
    shapes = [tuple(s.shape) for x, *_ in micro for s in x]
    assert shapes == [(3, buckets.buckets[b].num_frames, buckets.buckets[b].height, buckets.buckets[b].width)
                      for b in bucket_ids.tolist()]

    # unpacked reference: each sample alone through the step's weights, same flip, noise, timestep and dropout
    losses = []
    with torch.no_grad():
        for x, cond, rnd in micro:
            for j, s in enumerate(x):
                s = s.flip(-1) if rnd.flip[j] else s

                def model_fn(xt, tt):
                    return model(xt, tt, y=cond["y"][j:j + 1], force_drop_ids=rnd.drop[j:j + 1])

                losses.append(diffusion.training_losses(model_fn, s[None], rnd.t[j:j + 1], rnd.noise[j][None])["loss"])
    ref = torch.cat(losses).mean()
    torch.testing.assert_close(out["loss"].double(), ref.double(), rtol=1e-6, atol=0)


def test_sample_randomness_is_world_size_independent():
    """``mixed_step_inputs`` at 2 simulated ranks (each its half, offset by its first position) equals 1 rank."""
    from ditforge.diffusion import create_diffusion
    from ditforge.encoders.batch import BatchEncoder
    from ditforge.encoders.vae import IdentityVAE
    from ditforge.train.mixed import mixed_step_inputs

    gen = torch.Generator().manual_seed(4)
    pixels = [torch.randn(3, f, h, w, generator=gen) for f, h, w in [(1, 8, 12), (4, 8, 8), (4, 12, 8), (1, 8, 8)]]
    inputs, diffusion = BatchEncoder("class", IdentityVAE()), create_diffusion(None, True)
    whole = mixed_step_inputs(inputs, pixels, torch.device("cpu"), 5, 7, diffusion, 0.5, 0)
    halves = [mixed_step_inputs(inputs, pixels[r * 2:(r + 1) * 2], torch.device("cpu"), 5, 7, diffusion, 0.5, r * 2)
              for r in range(2)]
    for i in range(4):
        (x, rnd), k = halves[i // 2], i % 2
        assert torch.equal(x[k], whole[0][i]) and torch.equal(rnd.noise[k], whole[1].noise[i])
        assert rnd.noise[k].shape == pixels[i].shape
        for name in ("t", "drop", "flip"):
            assert torch.equal(getattr(rnd, name)[k], getattr(whole[1], name)[i])
    assert len(set(whole[1].t.tolist())) > 1  # distinct draws per sample


def test_bucket_longer_than_a_row_is_one_line(tmp_path, capsys):
    data, bucket_file = _data(tmp_path, videos=True)
    assert cli.main(_argv(data, bucket_file, tmp_path / "run", "--pack_tokens", "256", "--max_steps", "1")) == 2
    err = capsys.readouterr().err.strip()
    assert "--pack_tokens 256" in err and "16px/4f/" in err and len(err.splitlines()) == 1, err


def test_raw_shards_with_buckets_train_packed(tmp_path, monkeypatch):
    """Raw image and video shards with --buckets --pack_tokens: every sample reaches a bucket of its own nearest
    aspect ratio (images 1 frame, videos 4), steps mix buckets, and the loss is finite. Without --pack_tokens, one
    line."""
    import json
    import math

    from ditforge.data.shards.write import ShardWriter
    from tests.train.test_buckets_train import IMAGES, VIDEOS

    data, bucket_file = _data(tmp_path, videos=True)
    sizes, writer = {}, ShardWriter(tmp_path / "sh", 5)
    for i, (name, size) in enumerate([(f"im{i}.png", s) for i, s in enumerate(IMAGES)] +
                                     [(f"v{i}.mp4", s) for i, s in enumerate(VIDEOS)]):
        writer.write({"__key__": f"{i:09d}", name.rsplit(".", 1)[1]: (tmp_path / name).read_bytes(), "cls": i % 2})
        sizes[f"{i:09d}"] = (*size, 1 if name.endswith(".png") else 12)
    writer.close({"kind": "raw", "media": "image", "num_classes": 2, "class_captions": None, "texts": None})
    argv = ["train", "--data", str(tmp_path / "sh"), "--buckets", str(bucket_file), "--model", "vDiT-T/122",
            "--condition", "class", "--frame_interval", "3", "--batch_size", "4", "--data_streams", "2",
            "--num_workers", "0", "--sample_every", "0", "--log_every", "1", "--mixed_precision", "fp32",
            "--device", "cpu", "--max_steps", "3"]
    assert cli.main([*argv, "--outputs", str(tmp_path / "r0")]) == 2  # per-bucket batches need a CSV / JSONL

    shapes = []
    real_step = trainer.train_step

    def recording(model, diffusion, optimizer, scaler, micro_batches, *args, **kwargs):
        shapes.extend(tuple(s.shape) for s in micro_batches[0][0])
        return real_step(model, diffusion, optimizer, scaler, micro_batches, *args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", recording)
    monkeypatch.setenv("DITFORGE_SHARD_KEYS", str(tmp_path / "keys.jsonl"))
    assert cli.main([*argv, "--pack_tokens", "320", "--outputs", str(tmp_path / "r")]) == 0
    keys = [k.rsplit("#", 1)[1] for line in (tmp_path / "keys.jsonl").read_text().splitlines()
            for k in json.loads(line)["keys"]][:len(shapes)]
    buckets = Buckets(read_bucket_config(bucket_file), multiple=2, frame_interval=3).buckets
    for key, (_, f, bh, bw) in zip(keys, shapes):
        h, w, t = sizes[key]
        assert f == (1 if t == 1 else 4)
        errors = [abs(math.log(o.height / o.width / (h / w))) for o in buckets if o.num_frames == f]
        assert abs(math.log(bh / bw / (h / w))) == min(errors)
    assert len({s[1] for s in shapes}) == 2 and len(set(shapes)) >= 3  # images and videos, several shapes
    losses = [json.loads(line)["loss"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
