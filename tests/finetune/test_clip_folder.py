"""Fine-tuning a video pipeline on a folder of clips as users keep it (``--data FOLDER``: mp4 and png files, each
with a ``<stem>.txt`` caption, in sub-folders), in buckets made from the data: Wan 2.1's and CogVideoX 1.0's tiny
pipelines (``tiny_pipelines``), each step's loss against diffusers' arithmetic on that step's bucket
(``references.wan_loss`` / ``cogvideox_loss``), a resumed run against an uninterrupted one, the uncaptioned medium
listed and skipped, ``--caption_missing filename``, a blend of folders with repeats, and a ``--buckets`` file."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import references
from ditforge import cli
from ditforge.data.buckets import BucketBatchSampler, BucketDataset, data_buckets
from ditforge.data.folders import folder_rows
from ditforge.train.logging import read_metrics
from families import VIDEO, assert_one_line_error, video_train_argv
from tiny_pipelines import smooth_pixels, write_mp4

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE, INTERVAL, BATCH = 32, 1, 2  # --image_size 32: buckets of about 32 x 32 pixels; each bucket's batch 2
SHAPES = {"tall": (64, 32), "square": (32, 32), "wide": (32, 64)}  # (height, width) of each sub-folder's media
FRAMES = (9, 17)  # 4k + 1 (Wan) and 8k + 1 (the tiny CogVideoX's VAE); images are 1-frame clips
UNCAPTIONED = "no_caption_here.mp4"


@pytest.fixture(scope="session")
def clip_folder(tmp_path_factory) -> Path:
    """ROOT/<tall|square|wide>/: 2 mp4 clips of each of 9 and 17 frames and 2 png images, at that sub-folder's
    aspect ratio (2:1, 1:1, 1:2 height:width), each captioned ``<kind> <n>`` in its ``.txt``; and ROOT/
    ``no_caption_here.mp4`` without a caption. Smooth random frames (upsampled noise), so the codec keeps them."""
    root = tmp_path_factory.mktemp("clip_folder")
    pixels = functools.partial(smooth_pixels, np.random.default_rng(0))

    n = 0
    for kind, (h, w) in SHAPES.items():
        (root / kind).mkdir()
        media = [(f"clip_{f}f_{j}.mp4", f) for f in FRAMES for j in range(2)] + [(f"still_{j}.png", 1) for j in range(2)]
        for name, frames in media:
            path = root / kind / name
            if frames == 1:
                Image.fromarray(pixels(1, h, w)[0]).save(path)
            else:
                write_mp4(path, pixels(frames, h, w))
            path.with_suffix(".txt").write_text(f"{kind} {n}")
            n += 1
    write_mp4(root / UNCAPTIONED, pixels(9, 32, 32))
    return root


def _bucketed(folder: Path, frame_step: int, seed: int, multiple: int = 16, min_frames: int = 1
              ) -> tuple[BucketDataset, BucketBatchSampler]:
    """The folder read as the runs read it (buckets made from the data at ``SIZE``, sides multiples of ``multiple``:
    Wan's and CogVideoX's VAE's 8 x the transformer's 2 x 2 patch; frame counts from ``min_frames``), and the
    sampler of their global batches for ``seed``."""
    ds = BucketDataset(folder_rows(str(folder)), lambda sizes: data_buckets(sizes, SIZE, multiple, frame_step, None,
                                                                            INTERVAL, BATCH, min_frames), seed=seed)
    return ds, BucketBatchSampler(ds.buckets, ds.sizes, seed=seed)


def _argv(pipe: Path, folder: Path, out: Path, *extra: str) -> list[str]:
    """``train`` of ``pipe`` on ``folder``, without ``--num_frames`` (each clip's own count, by the frame rule) and
    without ``--frame_interval`` (a folder of clips reads consecutive frames: INTERVAL = 1, the stride the references
    read at)."""
    argv = video_train_argv(pipe, out, SIZE, 1, INTERVAL, BATCH, *extra)
    i = argv.index("--num_frames")
    del argv[i:i + 4]  # --num_frames N --frame_interval N
    argv[argv.index("--data") + 1] = str(folder)
    return argv


@pytest.mark.slow
@pytest.mark.parametrize("family, frame_step, loss", [("wan", 4, references.wan_loss),
                                                      ("cogvideox", 8, references.cogvideox_loss)])
def test_each_steps_bucket_trains_like_diffusers(family, frame_step, loss, request, clip_folder, tmp_path, caplog):
    """2 steps of seed 16 (whose batches are 1-frame images at 32 x 16 and 9-frame clips at 32 x 48) at lr 1e-20
    (AdamW then moves each weight by about 1e-20, far below float32's resolution of weights of order 1e-2, so
    both steps see the initial model): each step's loss equals diffusers' arithmetic on that step's global batch,
    read at its bucket's shape, within 1e-5 relative (fp32); each bucket's shape has the orientation of its
    media. The uncaptioned clip is one warning line and one record of bad_samples.jsonl, and trains in no
    batch."""
    import diffusers

    pipe_folder = request.getfixturevalue(f"{family}_pipeline")
    out = tmp_path / "run"
    assert cli.main(_argv(pipe_folder, clip_folder, out, "--max_steps", "2", "--lr", "1e-20", "--seed", "16")) == 0
    assert sum(UNCAPTIONED in r.getMessage() and "caption" in r.getMessage() for r in caplog.records) == 1
    records = read_metrics(out / "metrics.jsonl")
    ds, sampler = _bucketed(clip_folder, frame_step, 16)
    pipe = getattr(diffusers, VIDEO[family].pipeline).from_pretrained(str(pipe_folder),
                                                                                 local_files_only=True)
    shapes = []
    for step, record in enumerate(records):
        b, ids = sampler.global_batch(step)
        bucket = ds.buckets.buckets[b]
        items = [ds[(int(i), b)] for i in ids]
        kinds = {Path(ds.paths[item["index"]]).parent.name for item in items}
        assert len(kinds) == 1 and np.sign(bucket.height - bucket.width) == np.sign(np.subtract(*SHAPES[kinds.pop()]))
        pixels = torch.stack([item["x"] for item in items])
        assert pixels.shape[1:] == (3, bucket.num_frames, bucket.height, bucket.width)
        shapes.append(pixels.shape[2:])
        ref = loss(pipe, pixels, [item["text"] for item in items], step, 16)
        assert record["loss"] == pytest.approx(ref, rel=1e-5), (step, bucket.name)
    assert shapes == [(1, 32, 16), (9, 32, 48)]
    bad = [json.loads(line) for line in (out / "bad_samples.jsonl").read_text().splitlines()]
    assert [Path(r["path"]).name for r in bad] == [UNCAPTIONED]
    assert all(Path(p).name != UNCAPTIONED for p in ds.paths)


@pytest.mark.slow
@pytest.mark.parametrize("image_to_video", [False, True])
def test_the_dynamic_shift_and_first_frame_follow_the_bucket(image_to_video, request, clip_folder, tmp_path):
    """LTX-Video, whose scheduler shifts by the sequence length (``use_dynamic_shifting``): 2 steps of seed 16 at lr
    1e-20 (as above); each step's loss equals ``references.ltx_loss`` on its bucket's latents, whose shift follows
    that bucket's latent frames x height x width (the two steps' shifts differ). ``LTXImageToVideoPipeline``: the
    given first latent frame is the bucket's first frame, and the images (1 latent frame, all given) fit no
    bucket: frame counts start at 5 (2 latent frames)."""
    import diffusers

    name = "ltx_i2v" if image_to_video else "ltx"
    pipe_folder = request.getfixturevalue(f"{name}_pipeline")
    out = tmp_path / "run"
    assert cli.main(_argv(pipe_folder, clip_folder, out, "--max_steps", "2", "--lr", "1e-20", "--seed", "16")) == 0
    # the VAE's 4 x the transformer's 1 x 1 patch
    ds, sampler = _bucketed(clip_folder, 4, 16, multiple=4, min_frames=5 if image_to_video else 1)
    cls = diffusers.LTXImageToVideoPipeline if image_to_video else diffusers.LTXPipeline
    pipe = cls.from_pretrained(str(pipe_folder), local_files_only=True)
    shifts = []
    for step, record in enumerate(read_metrics(out / "metrics.jsonl")):
        b, ids = sampler.global_batch(step)
        items = [ds[(int(i), b)] for i in ids]
        pixels = torch.stack([item["x"] for item in items])
        assert pixels.shape[2] > 1 or not image_to_video
        loss, shift = references.ltx_loss(pipe, pixels, [item["text"] for item in items], step, 16, image_to_video)
        assert record["loss"] == pytest.approx(loss, rel=1e-5), step
        shifts.append(shift)
    assert len(shifts) == 2 and shifts[0] != pytest.approx(shifts[1], rel=1e-3), shifts


@pytest.fixture(scope="module")
def wan_run(one_thread_module, wan_pipeline, clip_folder, tmp_path_factory) -> Path:
    """Wan on the folder at lr 1e-3: 4 steps, a checkpoint every 2 (both kept)."""
    whole = tmp_path_factory.mktemp("wan_folder_run") / "run"
    assert cli.main(_argv(wan_pipeline, clip_folder, whole, "--max_steps", "4", "--ckpt_every", "2",
                          "--keep_last", "2", "--lr", "1e-3")) == 0
    return whole


@pytest.mark.slow
def test_resume_equals_uninterrupted(wan_run, tmp_path):
    """The run folder of ``wan_run`` taken back to its step-2 checkpoint and resumed to 4 (``--resume auto``; the
    bucket sampler starts at the step's position): the same 4 losses and gradient norms, bit for bit, and the same
    final weights."""
    from ditforge.weights.finetuned import load_finetuned
    from ditforge.weights.read import load_weights

    whole, part = wan_run, tmp_path / "part"
    # a folder of clips defaults to consecutive frames (data/sources.py, CLIP_FOLDER); the config records it
    assert yaml.safe_load((whole / "config.yaml").read_text())["data"]["frame_interval"] == 1
    shutil.copytree(whole, part)
    shutil.rmtree(part / "checkpoints" / "step-0000004")
    assert cli.main(["train", "--outputs", str(part), "--resume", "auto", "--max_steps", "4"]) == 0
    a, b = (read_metrics(run / "metrics.jsonl") for run in (whole, part))
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in a] == [(r["step"], r["loss"], r["grad_norm"]) for r in b]
    assert len(a) == 4
    weights = [load_finetuned(*load_weights(run), torch.device("cpu"))[1].state_dict() for run in (whole, part)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_caption_missing_and_repeats(clip_folder, tmp_path):
    """The uncaptioned clip is left out by default and captioned by its name in words under ``--caption_missing
    filename``; a blend file of folders lists each folder's media ``weight`` times; a fractional weight is one
    line naming the file and the entry."""
    skipped = folder_rows(str(clip_folder), bad_samples_path=tmp_path / "bad.jsonl")
    named = folder_rows(str(clip_folder), caption_missing="filename")
    assert len(named) == len(skipped) + 1 == 3 * 6 + 1
    assert {r["text"] for r in named} - {r["text"] for r in skipped} == {"no caption here"}
    assert json.loads((tmp_path / "bad.jsonl").read_text())["path"].endswith(UNCAPTIONED)
    blend = tmp_path / "blend.yaml"
    blend.write_text(f"- {{path: {clip_folder / 'tall'}, weight: 3}}\n- {{path: {clip_folder / 'wide'}}}\n")
    rows = folder_rows(str(blend))
    assert [Path(r["path"]).parent.name for r in rows] == ["tall"] * 18 + ["wide"] * 6
    assert rows[:6] == rows[6:12] == rows[12:18]
    blend.write_text(f"- {{path: {clip_folder / 'tall'}, weight: 1.5}}\n")
    from ditforge.errors import UserError

    with pytest.raises(UserError, match=r"blend.yaml: entry 0 .*weight 1.5"):
        folder_rows(str(blend))


def test_a_buckets_file_overrides_and_is_checked(wan_pipeline, clip_folder, tmp_path, capsys):
    """With ``--buckets``, a frame count outside Wan's 4k + 1 is one line naming the file and the count."""
    buckets = tmp_path / "buckets.yaml"
    buckets.write_text("32px: {1: [1.0, 2], 8: [1.0, 2]}\n")
    assert_one_line_error(capsys, _argv(wan_pipeline, clip_folder, tmp_path / "run", "--buckets", str(buckets)),
                          "--buckets", "frame counts 8", "4k + 1")


@pytest.mark.slow
def test_features_per_bucket_train_like_the_folder(wan_pipeline, clip_folder, wan_run, tmp_path):
    """``extract-features`` of the folder stores each sample's latents at its bucket's shape (one bucket a shard:
    the shapes of each bucket's latents, 16 channels x the VAE's latent frames x the sides / 8); a sample not stored
    at a bucket (left out as unreadable) reads as the bucket's next stored one; and a run on the features
    (``--batch_size`` 2 a bucket, as the folder's run) logs the folder run's first 2 losses within 1e-5 relative
    (stored float32 moments, encoded in other batches)."""
    feats = tmp_path / "feats"
    assert cli.main(["extract-features", "--init_from", str(wan_pipeline), "--data", str(clip_folder), "--image_size",
                     str(SIZE), "--frame_interval", str(INTERVAL), "--device", "cpu", "--num_workers", "0",
                     "--batch_size", "3", "--shard_size", "2", "--out", str(feats)]) == 0
    manifest = json.loads((feats / "features.json").read_text())
    ds, _ = _bucketed(clip_folder, 4, 0)
    shapes = {s["bucket"]: s["shape"] for s in manifest["shards"]}
    buckets = ds.buckets.buckets
    assert shapes == {b: [16, (buckets[b].num_frames - 1) // 4 + 1, buckets[b].height // 8, buckets[b].width // 8]
                      for b in set(shapes)}
    assert manifest["num_samples"] == len(ds) == 18
    from ditforge.data.features import FeatureDataset

    stored, tall = FeatureDataset(feats), next(b for b in shapes if buckets[b].height > buckets[b].width)
    members = [i for i in range(len(ds)) if ds.buckets.candidates(*ds.sizes[i])[0] == tall]
    other = next(i for i in range(members[0] + 1, len(ds)) if i not in members)  # not stored at that bucket
    nxt = next((i for i in members if i > other), members[0])  # as an unreadable sample's substitute
    assert torch.equal(stored[(other, tall)]["mean"], stored[(nxt, tall)]["mean"])
    assert list(stored[(other, tall)]["mean"].shape) == shapes[tall]
    argv = ["train", "--data", str(feats), "--batch_size", str(BATCH), "--max_steps", "2", "--log_every", "1",
            "--sample_every", "0", "--mixed_precision", "fp32", "--device", "cpu", "--class_dropout_prob", "0",
            "--num_workers", "0", "--lr", "1e-3", "--outputs", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    ours = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert ours == pytest.approx([r["loss"] for r in read_metrics(wan_run / "metrics.jsonl")][:2], rel=1e-5)


@pytest.mark.slow
def test_both_experts_train_in_buckets(clip_folder, tmp_path):
    """A two-expert pipeline (the tiny Wan 2.2 A14B) on the folder, both experts in one run: at a vanishing lr
    (1e-30: the fp32 weights stay as they are) each of 3 steps' loss equals that of the one-expert run of the
    step's side (``test_wan22.SIDES``: low, low, high for seed 0) at the same step, so each bucket's batch gets the
    objective of its own side and shape (1e-6 relative)."""
    from test_wan22 import SIDES
    from tiny_pipelines import make_wan22

    pipe = make_wan22(tmp_path / "pipe")
    losses = {}
    for expert in ("both", "high_noise", "low_noise"):
        out = tmp_path / expert
        assert cli.main(_argv(pipe, clip_folder, out, "--max_steps", "3", "--expert", expert, "--lr", "1e-30")) == 0
        losses[expert] = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
    assert losses["both"] == pytest.approx([losses[side][k] for k, side in enumerate(SIDES)], rel=1e-6)
