"""``ditforge extract-features`` and ``FeatureDataset``: training on stored features equals training on the fly.

Independent references: the trainer's own on-the-fly run (same seed) for the losses; ``VAE.encode_moments`` and
``TextEncoder.encode`` called directly, one sample at a time, for the stored tensors; ``VideoDataset`` items for
pixel-space video features. Data: the built-in digits, and tiny synthetic videos written with PyAV (random
smooth frames, fresh each session) encoded by a randomly initialised tiny ``AutoencoderKL`` and the shipped
MiniLM caption encoder.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ditforge import cli
from ditforge.config.load import build_config
from ditforge.data import build_dataset
from ditforge.data.features import FeatureDataset, read_manifest
from ditforge.data.store import extract_features
from ditforge.data.video import VideoDataset, write_video
from ditforge.errors import UserError
from ditforge.train.logging import read_metrics
from ditforge.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread_module")

SIZE, FRAMES, INTERVAL = 16, 4, 2
CAPTIONS = ["a red ball rolls to the left", "waves", "a small grey cat jumps over a wooden fence in the garden",
            "snow falls on a quiet street at night"]


def _frames(rng: np.random.Generator, n: int) -> np.ndarray:
    """n smooth random (SIZE, SIZE, 3) uint8 frames: bilinear blow-ups of 4x4 colour grids, drifting in time."""
    coarse = rng.uniform(0, 255, (n + 1, 4, 4, 3))
    t = np.linspace(0, 1, n)[:, None, None, None]
    grids = torch.from_numpy((1 - t) * coarse[:1] + t * coarse[1:]).permute(0, 3, 1, 2)
    up = torch.nn.functional.interpolate(grids, size=(SIZE, SIZE), mode="bilinear", align_corners=True)
    return up.permute(0, 2, 3, 1).round().clamp(0, 255).to(torch.uint8).numpy()


def _write_csv(path: Path, rows: list[tuple[str, str]]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "text"])
        w.writerows(rows)
    return path


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    """A CSV of 4 captioned synthetic 8-frame videos (written enlarged to 64x64 by ``write_video``)."""
    root = tmp_path_factory.mktemp("videos")
    rng = np.random.default_rng()
    rows = []
    for i, caption in enumerate(CAPTIONS):
        rows.append((str(write_video(_frames(rng, 8), root / f"v{i}.mp4")), caption))
    return _write_csv(root / "videos.csv", rows)


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory) -> Path:
    """A randomly initialised tiny AutoencoderKL (downsample 2, 4 latent channels) saved with save_pretrained."""
    from diffusers import AutoencoderKL

    torch.manual_seed(int(np.random.default_rng().integers(2**31)))
    model = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                          up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                          latent_channels=4, norm_num_groups=32, sample_size=32, scaling_factor=0.5)
    folder = tmp_path_factory.mktemp("vae")
    model.eval().save_pretrained(str(folder))
    return folder


def _video_settings(data, vae) -> dict:
    return dict(data=str(data), image_size=SIZE, num_frames=FRAMES, frame_interval=INTERVAL, vae=str(vae),
                condition="text", text_max_length=32, num_workers=0, seed=3, device="cpu")


@pytest.fixture(scope="module")
def video_features(videos, tiny_vae, tmp_path_factory) -> Path:
    """Features of ``videos``: tiny VAE latents and MiniLM caption states, 3 samples a shard (so 2 shards)."""
    out = tmp_path_factory.mktemp("vfeat") / "features"
    extract_features(build_config(None, _video_settings(videos, tiny_vae)), out, batch_size=3, shard_size=3,
                     device="cpu")
    return out


@pytest.fixture(scope="module")
def digit_features(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dfeat") / "features"
    extract_features(build_config(None, dict(data="digits", num_workers=0)), out, batch_size=500, shard_size=700,
                     device="cpu")
    return out


def _train_losses(outputs: Path, **settings) -> list[float]:
    values = dict(batch_size=16, max_steps=3, sample_every=0, log_every=1, ckpt_every=1000, mixed_precision="fp32",
                  device="cpu", num_workers=0, outputs=str(outputs))
    values |= settings
    run = train(build_config(None, values))
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, values["max_steps"] + 1))
    return [r["loss"] for r in records]


# ----------------------------------------------------------------------------------------------------------
# Round trip: the same training loss as encoding on the fly


def test_digits_features_train_like_pixels(digit_features, tmp_path):
    """Pixel space, class labels: the stored features are the pixels themselves, so the losses agree to float32
    round-off of identical arithmetic (1e-6 relative; in practice bit for bit)."""
    ref = _train_losses(tmp_path / "pixels", data="digits", model="DiT-T/2", seed=5)
    got = _train_losses(tmp_path / "features", data=str(digit_features), model="DiT-T/2", seed=5)
    assert len(ref) == len(got) == 3
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0)
    cfg = yaml.safe_load((tmp_path / "features" / "config.yaml").read_text())
    assert cfg["data"]["random_flip"] is False and cfg["model"]["num_classes"] == 10  # the digits' defaults


def test_video_text_features_train_like_on_the_fly(videos, tiny_vae, video_features, tmp_path):
    """Latent video + captions: a real (random) VAE's posterior moments and MiniLM states. Same float32 math both
    ways; only the batching differs (the VAE and MiniLM see batches of 3 at extraction, of 2 in training, and
    MiniLM pads each batch to its longest caption), which moves the inputs by float32 round-off (~1e-7), so the
    losses agree to 1e-5 relative. The posterior noise eps of each step is drawn the same way both times.

    A high learning rate over 4 steps makes the check sharp: measured on CPU, the two runs differ by < 2e-7
    relative, while dropping the stored std (no posterior noise) or giving each sample another's caption
    states moves the losses of steps 3-4 by 1e-2 or more (step 1 cannot tell: adaLN-zero and the zero-initialised
    cross-attention output make the first prediction independent of the inputs)."""
    common = dict(model="vDiT-T/122", batch_size=2, max_steps=4, seed=3, lr=1e-2)
    settings = _video_settings(videos, tiny_vae)
    ref = _train_losses(tmp_path / "fly", **settings | common)
    got = _train_losses(tmp_path / "features", data=str(video_features), **common)
    assert len(ref) == len(got) == 4
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=0)
    saved = yaml.safe_load((tmp_path / "features" / "config.yaml").read_text())
    assert saved["model"]["vae"] == str(tiny_vae) and saved["model"]["condition"] == "text"
    assert (saved["model"]["in_channels"], saved["model"]["input_size"], saved["model"]["num_frames"]) == (4, 8, 4)
    assert saved["model"]["text_max_length"] == 32 and saved["model"]["text_dim"] == 384


# ----------------------------------------------------------------------------------------------------------
# What is stored


def _reordered_float32(terms: int, scale: float) -> float:
    """Worst-case difference of two float32 evaluations of a network whose products sum in other orders (the
    extraction encodes batches of 3, the test one sample: the BLAS and oneDNN block by batch size and by CPU): a
    K-term sum in another order moves by at most 2 K u of its terms' magnitudes (u = 2^-24; Higham, Accuracy and
    Stability of Numerical Algorithms, 2002, section 3.1), taken as the output's ``scale`` (normalised layers), and
    chained sums add: ``terms`` is the sum of K along the chain."""
    return 2 * terms * 2.0**-24 * scale


def test_manifest_and_items_match_the_encoders(videos, tiny_vae, video_features):
    from ditforge.encoders import load_text_encoder, load_vae

    m = read_manifest(video_features)
    expected = {"format": "ditforge-features", "version": 1, "condition": "text", "vae": str(tiny_vae),
                "text_encoder": None, "text_max_length": 32, "text_dim": 384, "in_channels": 4, "input_size": 8,
                "num_frames": FRAMES, "pixel_channels": 3, "image_size": SIZE, "frame_interval": INTERVAL, "seed": 3,
                "num_classes": 4, "class_captions": None, "random_flip": True, "stochastic": True,
                "data": str(videos), "num_samples": 4, "texts": CAPTIONS, "init_from": None, "cond_keys": None,
                "shards": [{"file": "shard-00000.safetensors", "num_samples": 3},
                           {"file": "shard-00001.safetensors", "num_samples": 1}]}
    assert m == expected
    assert not (video_features / "bad_samples.jsonl").exists()

    ds = build_dataset(str(video_features), None)
    assert isinstance(ds, FeatureDataset) and len(ds) == 4 and ds.manifest == m
    assert (ds.image_size, ds.num_frames, ds.in_channels, ds.num_classes) == (SIZE, FRAMES, 4, 4)
    assert ds.random_flip is True and ds.texts == CAPTIONS and ds.class_captions is None

    source = VideoDataset(videos, FRAMES, INTERVAL, SIZE, seed=3)  # the same clips as the extraction's (same seed)
    vae = load_vae(str(tiny_vae))
    text = load_text_encoder(None, max_length=32)
    for i in range(len(ds)):
        item = ds[i]
        assert set(item) == {"mean", "std", "label", "text_states", "text_mask", "text"}
        src = source[i]
        mean, std = vae.encode_moments(src["video"][None])  # alone, not in a batch of 3
        assert item["mean"].dtype == item["std"].dtype == torch.float32
        assert item["mean"].shape == (4, FRAMES, 8, 8)
        # the tiny VAE's encoder: 4,899 terms along its chain of convolutions and attention (observed up to 1.2e-6,
        # 0.12 of the old 1e-5, on some CPUs); a wrong clip, frame or sample order is off by O(0.1)
        vae_bound = _reordered_float32(4899, max(mean.abs().max().item(), std.abs().max().item()))
        torch.testing.assert_close(item["mean"], mean[0], rtol=0, atol=vae_bound)
        torch.testing.assert_close(item["std"], std[0], rtol=0, atol=vae_bound)
        assert item["label"] == src["label"] and item["text"] == src["text"] == CAPTIONS[i]
        states, mask = text.encode([CAPTIONS[i]])
        n = int(mask.sum())
        assert item["text_states"].shape == (32, 384) and item["text_mask"].shape == (32,)
        assert item["text_mask"].tolist() == [True] * n + [False] * (32 - n)
        # MiniLM: 6 layers of q/k/v (384 terms), scores (32), values (<= 32), output (384) and MLP (384, 1,536)
        # products (observed up to 4.3e-6, 0.34 of the old 1e-5, on AVX-512); another caption's states differ by O(1)
        text_bound = _reordered_float32(6 * 2752, states.abs().max().item())
        torch.testing.assert_close(item["text_states"][:n], states[0, :n].float(), rtol=0, atol=text_bound)
        assert not item["text_states"][n:].any()
        assert ds.source_index(i) == i
    assert len({int(ds[i]["text_mask"].sum()) for i in range(4)}) > 1  # captions of different lengths: trimmed
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))  # the default collate stacks them
    assert batch["text_states"].shape == (4, 32, 384) and batch["mean"].shape == (4, 4, FRAMES, 8, 8)
    with pytest.raises(IndexError):
        ds[4]


def test_broken_feature_folders_are_user_errors(video_features, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(video_features, broken)
    (broken / "shard-00001.safetensors").unlink()
    with pytest.raises(UserError, match=r"--data .*shard-00001\.safetensors.* is missing"):
        build_dataset(str(broken), None)

    manifest = json.loads((video_features / "features.json").read_text())
    shutil.copy(video_features / "shard-00001.safetensors", broken)
    (broken / "features.json").write_text(json.dumps(manifest | {"version": 99}))
    with pytest.raises(UserError, match=r"--data .*features\.json has features format version 99"):
        FeatureDataset(broken)
    (broken / "features.json").write_text("{not json")
    with pytest.raises(UserError, match=r"--data .*features\.json is not a readable features manifest"):
        FeatureDataset(broken)
    (broken / "features.json").write_text(json.dumps(manifest | {"num_frames": 2}))
    with pytest.raises(UserError, match=r"shard-00000\.safetensors: tensors mean, std do not match"):
        FeatureDataset(broken)


def test_extracting_into_a_features_folder_is_refused(video_features, tiny_vae, videos):
    before = {p.name: p.read_bytes() for p in video_features.iterdir()}
    with pytest.raises(UserError, match=r"--out .* already holds features"):
        extract_features(build_config(None, _video_settings(videos, tiny_vae)), video_features, device="cpu")
    assert {p.name: p.read_bytes() for p in video_features.iterdir()} == before
    with pytest.raises(UserError, match=r"--data .* holds features already"):
        extract_features(build_config(None, dict(data=str(video_features))), video_features.parent / "x")


def test_bad_videos_are_left_out_and_reported(videos, tmp_path):
    """Pixel space, class labels (no encoder to load): a corrupt video (its substitute is not stored) and a
    missing one (dropped by the data set) are recorded in bad_samples.jsonl; the other samples equal the data
    set's items exactly."""
    rows = list(csv.reader(open(videos)))[1:]
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(np.random.default_rng().bytes(3000))
    data = _write_csv(tmp_path / "bad.csv", [tuple(rows[0]), (str(corrupt), "broken"), tuple(rows[1]),
                                             (str(tmp_path / "gone.mp4"), "gone"), tuple(rows[2])])
    out = tmp_path / "features"
    cfg = build_config(None, dict(data=str(data), image_size=SIZE, num_frames=FRAMES, frame_interval=INTERVAL,
                                  condition="class", num_workers=2, seed=1))  # decoded in worker processes
    extract_features(cfg, out, batch_size=2, shard_size=2, device="cpu")
    records = [json.loads(line) for line in (out / "bad_samples.jsonl").read_text().splitlines()]
    assert sorted(Path(r["path"]).name for r in records) == ["corrupt.mp4", "gone.mp4"]
    ds = FeatureDataset(out)
    assert len(ds) == 3 and ds.manifest["num_samples"] == 3 and ds.texts is None
    assert ds.manifest["stochastic"] is False and ds.manifest["in_channels"] == 3
    source = VideoDataset(data, FRAMES, INTERVAL, SIZE, seed=1)  # rows: v0, corrupt, v1, v2 (gone dropped)
    for i, j in enumerate([0, 2, 3]):
        item = ds[i]
        assert set(item) == {"mean", "label"} and ds.source_index(i) == j
        assert torch.equal(item["mean"], source[j]["video"]) and item["label"] == source[j]["label"]
    loader = torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2)  # shards reopened in each worker
    assert torch.equal(next(iter(loader))["mean"], torch.stack([ds[i]["mean"] for i in range(3)]))


# ----------------------------------------------------------------------------------------------------------
# Command line


def test_cli_extract_then_train(tmp_path, capsys, tiny_argv):
    out = tmp_path / "features"
    argv = ["extract-features", "--data", "digits", "--out", str(out), "--device", "cpu", "--batch_size", "512",
            "--shard_size", "1000", "--num_workers", "0"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.strip() == f"wrote 1797 samples to {out}"
    assert [s["num_samples"] for s in read_manifest(out)["shards"]] == [1000, 797]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ditforge extract-features: error: --out") and len(err.splitlines()) == 1
    assert cli.main(tiny_argv(tmp_path / "run", "--data", str(out), "--max_steps", "2")) == 0
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 2
