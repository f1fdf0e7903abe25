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
