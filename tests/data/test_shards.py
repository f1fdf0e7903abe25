"""Shard data (``ditforge.data.shards``): the order covers every sample once per epoch, resumes exactly at another
world size and worker count, blends in proportion, skips and reports bad data, and the shard writers round-trip
their sources. References: the uninterrupted single-process loader, the binomial law, the source files and the
safetensors features of the same data."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_train_argv, write_latent_shards

from ditforge import cli
from ditforge.data.shards.loader import ShardData, build_shard_loader
from ditforge.data.shards.order import SetStream, blend_choices, deal

pytestmark = pytest.mark.usefixtures("one_thread")


def loader(data, rank=0, world=1, workers=0, start=0, state=None, batch=16, streams=8, window=2, seed=0):
    return iter(build_shard_loader(data, batch, streams, window, seed, rank, world, workers, start, state))


def keys_of(it, steps):
    return [next(it)["key"] for _ in range(steps)]


def test_epoch_reads_every_sample_once(tmp_path):
    """Fewer shards (3) than streams (8): shards are cut into member ranges; epoch 0 of all streams together is a
    permutation of the whole set, and epoch 1 another one."""
    counts = [23, 40, 17]
    seen = {0: [], 1: []}
    for stream in range(8):
        s = SetStream(counts, 8, stream, 0, seed=5, window=2)
        for epoch in (0, 1):
            n = sum(hi - lo for _, lo, hi in deal(counts, 8, 5, 0, epoch)[stream])
            seen[epoch] += s.take(n)
            assert s.state[:3] == [epoch, *s.state[1:3]] and s.take(0) == []
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == sorted((i, m) for i, n in enumerate(counts) for m in range(n))
    assert seen[0] != seen[1]


def test_resume_across_world_size_and_workers(tmp_path):
    """Stop at step 7 of a 2-rank run (1 worker each), resume in one process with 2 workers: the next 20 global
    batches hold exactly the uninterrupted single-process run's sample ids, in order (the sets wrap epochs)."""
    write_latent_shards(tmp_path / "a", [37, 29, 41, 33, 30])
    data = ShardData(str(tmp_path / "a"), None, tmp_path / "bad.jsonl")
    ref = keys_of(loader(data), 27)
    ranks = [loader(data, rank=r, world=2) for r in range(2)]
    first = [sum((next(r)["key"] for r in ranks), []) for _ in range(7)]
    assert first == ref[:7]  # the global batch is the same at world size 2, order included
    state = {"streams": 8, "shuffle_shards": 2, "states": {}}
    for r in ranks:
        state["states"] |= {str(k): v for k, v in r.state_dict(7)["states"].items()}
    assert len(state["states"]) == 8
    state = json.loads(json.dumps(state))  # as meta.json stores it
    resumed = keys_of(loader(data, workers=2, start=7, state=state), 20)
    assert resumed == ref[7:]
    # no sample twice before the smallest stream (one piece, 14 samples, 2 a step) ends its epoch
    assert len(set(sum(ref[:7], []))) == 7 * 16


def test_blend_proportions(tmp_path):
    """Weights 0.7 / 0.3: over 10,000 drawn samples each set's count lies within 3 binomial sigma of its share;
    the draws are counter-based (the same positions give the same sets however they are requested)."""
    write_latent_shards(tmp_path / "big", [50, 50, 50], prefix="big")
    write_latent_shards(tmp_path / "small", [40, 45], seed=1, prefix="small")
    (tmp_path / "blend.yaml").write_text("- {path: big, weight: 0.7}\n- {path: 'small/shard-{00000..00001}.tar', "
                                         "weight: 0.3}\n")
    data = ShardData(str(tmp_path / "blend.yaml"), None, None)
    keys = sum(keys_of(loader(data, batch=80), 125), [])
    n = len(keys)
    big = sum("#big" in k for k in keys)
    assert n == 10_000 and abs(big - 0.7 * n) <= 3 * np.sqrt(n * 0.7 * 0.3)
    cum = np.array([0.7, 1.0])
    assert (blend_choices(3, 2, 100, 5000, cum)[900:1000] == blend_choices(3, 2, 1000, 100, cum)).all()


def _corrupt(tmp_path: Path) -> tuple[Path, str, str]:
    """Shards where one member's npy bytes are garbage and the last shard is cut in half."""
    folder = tmp_path / "bad"
    keys = write_latent_shards(folder, [20, 20, 20, 20])
    first = folder / "shard-00000.tar"
    raw = bytearray(first.read_bytes())
    at = raw.find(b"\x93NUMPY", raw.find(f"{keys[3]}.latent.npy".encode()))
    raw[at:at + 6] = b"garbag"
    first.write_bytes(bytes(raw))
    last = folder / "shard-00003.tar"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    return folder, f"{first}#{keys[3]}", str(last)


def test_bad_member_and_truncated_shard_are_skipped_and_reported(tmp_path):
    folder, member, shard = _corrupt(tmp_path)
    bad = tmp_path / "bad_samples.jsonl"
    data = ShardData(str(folder), None, bad, retries=1)
    it = loader(data, batch=8, streams=4)
    got = keys_of(it, 20)  # 160 samples: two epochs of the 80 listed, about 70 of them readable
    reported = {json.loads(line)["path"] for line in bad.read_text().splitlines()}
    assert reported == {member, shard}
    flat = sum(got, [])
    assert all(len(k) == 8 for k in got) and member not in flat
    readable = [k for k in flat if k.startswith(shard)]
    assert readable and len(set(readable)) < 20  # the members before the damage are used, the rest skipped
    assert keys_of(loader(data, batch=8, streams=4), 20) == got  # skips are a function of the files
    state = next(it) and it.state_dict(21)
    assert sum(st["sets"][0][3] for st in state["states"].values()) > 0  # skips are counted


def test_missing_blend_is_one_line_error(tmp_path, capsys):
    write_latent_shards(tmp_path / "ok", [10])
    (tmp_path / "blend.yaml").write_text("- {path: ok, weight: 1}\n- {path: 'gone/shard-{000..003}.tar', weight: 2}\n")
    rc = cli.main(tiny_train_argv(tmp_path / "run", "--data", str(tmp_path / "blend.yaml"), "--max_steps", "1"))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "gone/shard-{000..003}.tar" in err and "no shard file" in err


def test_extract_features_wds_equals_safetensors(tmp_path):
    """`extract-features --format wds` stores the values the safetensors features hold, sample by sample."""
    from ditforge.data.features import FeatureDataset

    base = ["extract-features", "--data", "digits", "--device", "cpu", "--shard_size", "700"]
    assert cli.main([*base, "--out", str(tmp_path / "st")]) == 0
    assert cli.main([*base, "--out", str(tmp_path / "wds"), "--format", "wds"]) == 0
    ref = FeatureDataset(tmp_path / "st")
    data = ShardData(str(tmp_path / "wds"), None, None)
    assert len(data) == len(ref) == 1797 and data.manifest["in_channels"] == ref.in_channels
    batch = next(loader(data, batch=128, streams=8))
    for key, mean, label in zip(batch["key"], batch["mean"], batch["label"]):
        item = ref[int(key.rsplit("#", 1)[1])]
        assert torch.equal(mean, item["mean"]) and int(label) == item["label"]


def test_shard_command_round_trip(tmp_path):
    """`ditforge shard` stores each image's bytes unchanged with its label; training reads them as the image
    folder does (``load_image``)."""
    from PIL import Image

    from ditforge.data.captions import load_image

    g = np.random.default_rng(0)
    files = []
    for c, ext in (("cat", "png"), ("dog", "jpg")):
        (tmp_path / "img" / c).mkdir(parents=True)
        for i in range(3):
            files.append(tmp_path / "img" / c / f"{i}.{ext}")
            Image.fromarray(g.integers(0, 255, (12, 10, 3), dtype=np.uint8)).save(files[-1])
    assert cli.main(["shard", "--data", str(tmp_path / "img"), "--out", str(tmp_path / "sh"), "--shard_size", "4"]) == 0
    import tarfile

    members = {}
    for tar in sorted((tmp_path / "sh").glob("*.tar")):
        with tarfile.open(tar) as t:
            members |= {m.name: t.extractfile(m).read() for m in t.getmembers()}
    for i, f in enumerate(files):
        ext = f.suffix[1:]
        assert members[f"{i:09d}.{ext}"] == f.read_bytes() and members[f"{i:09d}.cls"] == str(i // 3).encode()
    data = ShardData(str(tmp_path / "sh"), 8, None)
    assert data.num_classes == 2 and len(data) == 6
    batch = next(loader(data, batch=6, streams=2))
    for key, x, label in zip(batch["key"], batch["x"], batch["label"]):
        i = int(key.rsplit("#", 1)[1])
        assert torch.equal(x, load_image(files[i], 8)) and int(label) == i // 3


def test_cli_resume_continues_the_same_samples(tmp_path, monkeypatch, capsys):
    """The real `ditforge train`: stopped at step 3 (its checkpoint), resumed with 2 loader workers, the steps
    after 3 read exactly the uninterrupted run's samples."""
    write_latent_shards(tmp_path / "d", [60, 70, 50])
    flags = ["--data", str(tmp_path / "d"), "--max_steps", "6", "--ckpt_every", "3", "--data_streams", "4",
             "--shuffle_shards", "2"]
    for name, extra in (("full", []), ("cut", ["--max_steps", "3"])):
        monkeypatch.setenv("DITFORGE_SHARD_KEYS", str(tmp_path / f"{name}.jsonl"))
        assert cli.main(tiny_train_argv(tmp_path / name, *flags, *extra)) == 0
    monkeypatch.setenv("DITFORGE_SHARD_KEYS", str(tmp_path / "cut.jsonl"))
    assert cli.main(["train", "--resume", "auto", "--outputs", str(tmp_path / "cut"), "--max_steps", "6",
                     "--num_workers", "2"]) == 0
    read = lambda name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]  # noqa
    full = {r["step"]: r["keys"] for r in read("full")}
    cut: dict[int, list] = {}
    for r in read("cut"):  # the trainer's prefetcher reads one batch ahead: a stopped run records one step more
        assert cut.setdefault(r["step"], r["keys"]) == r["keys"]
    assert set(range(6)) <= set(cut) and all(cut[s] == full[s] for s in range(6))
    meta = json.loads((tmp_path / "cut" / "checkpoints" / "step-0000006" / "meta.json").read_text())
    assert meta["loader"]["streams"] == 4 and len(meta["loader"]["states"]) == 4
    rc = cli.main(["train", "--resume", "auto", "--outputs", str(tmp_path / "cut"), "--max_steps", "7",
                   "--data_streams", "8"])  # --data_streams is fixed for a run
    assert rc == 2 and "the checkpoint's loader was saved with --data_streams 4" in capsys.readouterr().err
    rc = cli.main(["train", "--resume", "auto", "--outputs", str(tmp_path / "cut"), "--max_steps", "7",
                   "--seed", "1"])  # the saved positions belong to the order of the old seed
    assert rc == 2 and "--seed the checkpoint's loader read" in capsys.readouterr().err


def test_raw_video_shards_decode_like_the_files(tmp_path):
    """`ditforge shard` on a video CSV, read back: each clip equals ``read_clip`` of the original file with the
    same start frame (drawn from the seed and the sample's key), centre-cropped as ``VideoDataset`` crops."""
    import zlib

    from PIL import Image
    from test_video import write_video

    from ditforge.data.images import center_crop_arr
    from ditforge.data.sampler import derive_seed
    from ditforge.data.video import read_clip

    files = [write_video(tmp_path / "v" / f"{i}.mp4", 9 + 3 * i, w=20, h=16) for i in range(3)]
    (tmp_path / "v.csv").write_text("path,text\n" + "".join(f"{f},clip {i}\n" for i, f in enumerate(files)))
    assert cli.main(["shard", "--data", str(tmp_path / "v.csv"), "--out", str(tmp_path / "sh")]) == 0
    data = ShardData(str(tmp_path / "sh"), 16, None, num_frames=4, frame_interval=2, seed=5)
    assert data.num_frames == 4
    batch = next(loader(data, batch=3, streams=1, seed=5))
    assert batch["x"].shape == (3, 3, 4, 16, 16)
    for key, x, text in zip(batch["key"], batch["x"], batch["text"]):
        i = int(key.rsplit("#", 1)[1])
        rng = np.random.default_rng(derive_seed(5, zlib.crc32(f"{i:09d}".encode())))
        frames, _ = read_clip(files[i], 4, 2, lambda m: int(rng.integers(0, m + 1)))
        ref = np.stack([center_crop_arr(Image.fromarray(f), 16) for f in frames])
        assert torch.equal(x, torch.from_numpy(ref).permute(3, 0, 1, 2).float().div(127.5).sub(1.0))
        assert text == f"clip {i}"


def test_a_set_of_bad_samples_stops_with_one_line_from_a_worker(tmp_path):
    """Every member corrupt: the stream gives up with a UserError, one line even when raised in a loader worker."""
    from ditforge.data.shards.write import ShardWriter
    from ditforge.errors import UserError

    writer = ShardWriter(tmp_path / "d", 10**9)
    for i in range(6):
        writer.write({"__key__": f"k{i}", "latent.npy": b"not an npy file", "cls": 1})
    writer.close({"kind": "latent", "condition": "class", "vae": "none", "text_encoder": None, "text_max_length": None,
                  "text_dim": None, "in_channels": 1, "input_size": 8, "num_frames": None, "image_size": 8,
                  "stochastic": False, "num_classes": 10, "class_captions": None, "random_flip": False, "texts": None})
    data = ShardData(str(tmp_path / "d"), None, tmp_path / "bad.jsonl")
    for workers in (0, 1):
        with pytest.raises(UserError) as e:
            next(loader(data, batch=2, streams=1, workers=workers))
        assert "\n" not in str(e.value) and "no readable sample" in str(e.value)


def test_remote_shards_through_the_cache(tmp_path, monkeypatch):
    """An fsspec URL (the in-memory file system here): shards are copied whole into the cache and read exactly as
    the local set is; the cache stays under $DITFORGE_SHARD_CACHE_GB, least recently used copies deleted first."""
    import fsspec

    write_latent_shards(tmp_path / "d", [30, 25, 35, 28])
    fs = fsspec.filesystem("memory")
    for f in sorted((tmp_path / "d").iterdir()):
        fs.pipe(f"/remote/{f.name}", f.read_bytes())
    shard_bytes = max(f.stat().st_size for f in (tmp_path / "d").glob("*.tar"))
    monkeypatch.setenv("DITFORGE_SHARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DITFORGE_SHARD_CACHE_GB", str(2.5 * shard_bytes / 2**30))  # room for two or three
    try:
        remote = ShardData("memory://remote/", None, None)
        local = ShardData(str(tmp_path / "d"), None, None)
        got = [k.rsplit("/", 1)[-1] for ks in keys_of(loader(remote, streams=4, window=1), 12) for k in ks]
        want = [k.rsplit("/", 1)[-1] for ks in keys_of(loader(local, streams=4, window=1), 12) for k in ks]
        assert got == want
        cached = list((tmp_path / "cache").iterdir())
        assert len(cached) < 4 and sum(f.stat().st_size for f in cached) <= 2.5 * shard_bytes  # some were evicted
    finally:
        fs.rm("/remote", recursive=True)
