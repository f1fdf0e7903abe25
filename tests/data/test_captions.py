"""Captioned images (sidecar captions, CSV, JSONL), DreamBooth data and the generation of class images."""

from __future__ import annotations

import csv
import json
import logging
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from ditforge.data import ImageFolderDataset, build_dataset, source_of
from ditforge.data.captions import CaptionedImageDataset, DreamBoothDataset, generate_class_images
from ditforge.data.sources import CAPTIONED_IMAGES, CLIPS, DIGITS, IMAGE_FOLDER, VIDEO_CSV
from ditforge.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


def _noise(rng, size):
    w, h = size
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), mode="RGB")


def _as_x(arr):
    """(H, W, 3) uint8 -> (3, H, W) float32 in [-1, 1], as the data sets scale pixels."""
    return torch.from_numpy(arr.astype(np.float32)).permute(2, 0, 1) / 127.5 - 1.0


def _reference_center_crop(path, s):
    """Short side to s (box-halving while >= 2s, then bicubic), centre square; (s, s, 3) uint8. Written out
    independently of ditforge from the ADM / DiT recipe."""
    with Image.open(path) as im:
        img = im.convert("RGB")
    while min(img.size) >= 2 * s:
        img = img.resize((img.width // 2, img.height // 2), resample=Image.BOX)
    short = min(img.size)
    img = img.resize((round(img.width * s / short), round(img.height * s / short)), resample=Image.BICUBIC)
    left, top = (img.width - s) // 2, (img.height - s) // 2
    return np.array(img.crop((left, top, left + s, top + s)))


def _reference_long_side(path, s):
    """Long side to s, aspect kept (box-halving while the long side >= 2s, then bicubic); (h, w, 3) uint8."""
    with Image.open(path) as im:
        img = im.convert("RGB")
    while max(img.size) >= 2 * s:
        img = img.resize((img.width // 2, img.height // 2), resample=Image.BOX)
    long = max(img.size)
    return np.array(img.resize((round(img.width * s / long), round(img.height * s / long)), resample=Image.BICUBIC))


# (relative path, (width, height), caption): different aspect ratios, a nested folder, a halved one, a JPEG,
# captions with a comma, quotes and non-ASCII text (CSV quoting)
IMAGES = [
    ("a_wide.png", (40, 24), "a wide, noisy picture"),
    ("b_tall.png", (24, 40), 'a "tall" one'),
    ("sub/c_big.png", (100, 60), "grand café"),
    ("sub/d_square.jpg", (33, 33), ""),  # an empty caption file
]


@pytest.fixture
def captioned(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "captioned"
    for rel, size, text in IMAGES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        _noise(rng, size).save(root / rel)
        (root / rel).with_suffix(".txt").write_text(text + "\n", encoding="utf-8")
    (root / "notes.md").write_text("not an image")
    (root / ".ipynb_checkpoints").mkdir()  # hidden: never searched
    _noise(rng, (8, 8)).save(root / ".ipynb_checkpoints" / "a_wide-checkpoint.png")
    return root


def _write_csv(path, header, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def _write_jsonl(path, objects):
    path.write_text("".join(json.dumps(o) + "\n" for o in objects), encoding="utf-8")
    return path


def _items(ds):
    return [ds[i] for i in range(len(ds))]


def _assert_same_items(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["text"] == y["text"] and torch.equal(x["x"], y["x"])


# ----------------------------------------------------------------------------------------------------------
# Resizing


def test_sidecar_folder_center_crop(captioned):
    s = 16
    ds = CaptionedImageDataset(captioned, s)
    assert [os.path.relpath(p, captioned) for p in ds.paths] == [rel for rel, _, _ in IMAGES]
    assert ds.texts == [text for _, _, text in IMAGES]
    assert (ds.in_channels, ds.image_size, ds.num_classes, ds.class_captions, ds.random_flip) == (3, s, 0, None, True)
    assert ds.num_uncaptioned == 0 and ds.num_dropped == 0
    for i, (rel, _, text) in enumerate(IMAGES):
        item = ds[i]
        assert set(item) == {"x", "text"} and item["text"] == text
        assert item["x"].shape == (3, s, s) and item["x"].dtype == torch.float32
        torch.testing.assert_close(item["x"], _as_x(_reference_center_crop(captioned / rel, s)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("size,s,content", [
    ((40, 24), 24, (14, 24)),   # 24 * 24 / 40 = 14.4 rows, padded 5 + 5
    ((24, 40), 24, (24, 14)),
    ((40, 25), 24, (15, 24)),   # padded 4 above, 5 below
    ((100, 60), 16, (10, 16)),  # halved (long side >= 2s) before the bicubic resize
])
def test_letterbox_keeps_aspect_and_pads_with_mid_grey(tmp_path, size, s, content):
    root = tmp_path / "lb"
    root.mkdir()
    _noise(np.random.default_rng(1), size).save(root / "x.png")
    (root / "x.txt").write_text("x")
    x = CaptionedImageDataset(root, s, resize_mode="letterbox")[0]["x"]
    assert x.shape == (3, s, s) and x.dtype == torch.float32
    ref = _reference_long_side(root / "x.png", s)
    h, w = ref.shape[:2]
    assert (h, w) == content
    top, left = (s - h) // 2, (s - w) // 2
    torch.testing.assert_close(x[:, top : top + h, left : left + w], _as_x(ref), rtol=0, atol=1e-6)
    border = torch.ones(s, s, dtype=torch.bool)
    border[top : top + h, left : left + w] = False
    assert border.sum() == s * s - h * w and bool((x[:, border] == 0.0).all())


def test_exif_orientation_is_applied(tmp_path):
    root = tmp_path / "exif"
    root.mkdir()
    img = _noise(np.random.default_rng(2), (40, 24))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": shown as 24 x 40
    img.save(root / "x.png", exif=exif)
    (root / "x.txt").write_text("x")
    img.transpose(Image.Transpose.ROTATE_270).save(tmp_path / "upright.png")
    x = CaptionedImageDataset(root, 16)[0]["x"]
    torch.testing.assert_close(x, _as_x(_reference_center_crop(tmp_path / "upright.png", 16)), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# Layouts


def test_folder_csv_and_jsonl_give_the_same_items(captioned, tmp_path):
    folder = _items(CaptionedImageDataset(captioned, 16))
    rel = [r for r, _, _ in IMAGES]
    texts = [t for _, _, t in IMAGES]
    absolute = [str(captioned / r) for r in rel]
    sources = [
        _write_csv(captioned / "rel.csv", ["path", "text"], zip(rel, texts)),
        _write_csv(tmp_path / "abs.csv", [" File_Name", "caption ", "extra"],
                   [(p, t, 1) for p, t in zip(absolute, texts)]),
        _write_csv(captioned / "img.csv", ["image", "text"], zip(rel, texts)),
        _write_jsonl(captioned / "metadata.jsonl", [{"file_name": r, "text": t} for r, t in zip(rel, texts)]),
        _write_jsonl(tmp_path / "abs.jsonl", [{"image": p, "caption": t, "n": 3} for p, t in zip(absolute, texts)]),
        _write_jsonl(tmp_path / "both.jsonl", [  # path wins over file_name, text over caption
            {"path": p, "file_name": "nope.png", "text": t, "caption": "no"} for p, t in zip(absolute, texts)]),
    ]
    for source in sources:
        ds = CaptionedImageDataset(source, 16)
        assert ds.num_dropped == 0
        _assert_same_items(_items(ds), folder)
        built = build_dataset(str(source), 16)
        assert isinstance(built, CaptionedImageDataset)
        _assert_same_items(_items(built), folder)


def test_missing_sidecar_gets_the_empty_caption(captioned, caplog):
    (captioned / "b_tall.txt").unlink()
    (captioned / "sub" / "c_big.txt").unlink()
    with caplog.at_level(logging.WARNING):
        ds = CaptionedImageDataset(captioned, 16)
    assert ds.texts == ["a wide, noisy picture", "", "", ""] and ds.num_uncaptioned == 2 and len(ds) == 4
    said = [r.getMessage() for r in caplog.records if "no caption file" in r.getMessage()]
    assert len(said) == 1 and "2 of 4" in said[0]


def test_rows_with_missing_files_are_left_out_and_recorded(captioned, tmp_path):
    bad = tmp_path / "bad_samples.jsonl"
    data = _write_csv(captioned / "d.csv", ["path", "text"],
                      [("a_wide.png", "one"), ("gone.png", "missing"), ("", "no path"), ("b_tall.png", "two")])
    ds = CaptionedImageDataset(data, 16, bad)
    assert ds.texts == ["one", "two"] and ds.num_dropped == 2
    records = [json.loads(line) for line in bad.read_text().splitlines()]
    assert [(r["path"], r["line"], r["error"]) for r in records] == [
        (str(captioned / "gone.png"), 3, "file not found"), ("", 4, "empty path")]
    assert records[0]["row"]["text"] == "missing"

    data = _write_jsonl(captioned / "d.jsonl", [{"path": "a_wide.png", "text": "one"},
                                                {"path": "other.png", "text": "x"}])
    ds = CaptionedImageDataset(data, 16, bad)
    assert ds.texts == ["one"]
    assert json.loads(bad.read_text().splitlines()[-1])["path"] == str(captioned / "other.png")

    with pytest.raises(UserError, match="--data.*no usable sample"):
        CaptionedImageDataset(_write_jsonl(tmp_path / "none.jsonl", [{"path": "gone.png", "text": "x"}]), 16)


def test_corrupt_image_is_substituted_and_reported_once(captioned, tmp_path, caplog):
    (captioned / "b_tall.png").write_bytes(np.random.default_rng(3).bytes(300))
    bad = tmp_path / "bad_samples.jsonl"
    ds = CaptionedImageDataset(captioned, 16, bad)
    with caplog.at_level(logging.WARNING):
        first, second = ds[1], ds[1]
    nxt = ds[2]
    assert first["text"] == second["text"] == nxt["text"] == "grand café"
    assert torch.equal(first["x"], nxt["x"]) and torch.equal(second["x"], nxt["x"])
    records = [json.loads(line) for line in bad.read_text().splitlines()]
    assert [r["path"] for r in records] == [str(captioned / "b_tall.png")] and records[0]["error"]
    assert len([r for r in caplog.records if "unreadable image" in r.getMessage()]) == 1
    # a new data set (another worker or epoch) meets it again: still one record
    CaptionedImageDataset(captioned, 16, bad)[1]
    assert len(bad.read_text().splitlines()) == 1


# ----------------------------------------------------------------------------------------------------------
# Errors


def test_errors_name_the_flag_and_file(captioned, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("x")
    with pytest.raises(UserError, match=f"--data: {re.escape(str(empty))} holds no images"):
        CaptionedImageDataset(empty, 16)

    bare = tmp_path / "bare"  # images, not one caption
    bare.mkdir()
    _noise(np.random.default_rng(4), (20, 20)).save(bare / "x.png")
    with pytest.raises(UserError, match=f"--data: {re.escape(str(bare))} has no caption"):
        CaptionedImageDataset(bare, 16)
    with pytest.raises(UserError, match="--resize_mode"):
        CaptionedImageDataset(captioned, 16, resize_mode="stretch")
    with pytest.raises(UserError, match="--image_size"):
        CaptionedImageDataset(captioned, 0)
    with pytest.raises(UserError, match="--data.*neither a folder"):
        CaptionedImageDataset(captioned / "notes.md", 16)

    cases = {
        "no_text.csv": ("path,title\na_wide.png,x\n", "line 1: no column text"),
        "short.csv": ("path,text\na_wide.png,x\nb_tall.png\n", "line 3: no text"),
        "no_key.jsonl": ('{"path": "a_wide.png", "text": "x"}\n\n{"file_name": "b_tall.png"}\n', "line 3: no key text"),
        "no_path.jsonl": ('{"caption": "x"}\n', "line 1: no key path"),
        "not_json.jsonl": ("{nope\n", "line 1: not valid JSON"),
        "list.jsonl": ('["a_wide.png", "x"]\n', "line 1: a JSON list"),
        "number.jsonl": ('{"path": "a_wide.png", "text": 3}\n', "line 1: text must be a string"),
    }
    for name, (content, message) in cases.items():
        (captioned / name).write_text(content)
        with pytest.raises(UserError, match=f"--data: {re.escape(str(captioned / name))} {message}"):
            CaptionedImageDataset(captioned / name, 16)

    inst = tmp_path / "instance"
    inst.mkdir()
    with pytest.raises(UserError, match=f"--instance_data: {re.escape(str(inst))} holds no images"):
        DreamBoothDataset(inst, "a photo of sks dog", 16)
    with pytest.raises(UserError, match="--instance_data.*not a folder"):
        DreamBoothDataset(tmp_path / "missing", "a photo of sks dog", 16)
    with pytest.raises(UserError, match=f"--class_data: {re.escape(str(empty))} holds no images"):
        DreamBoothDataset(captioned, "a photo of sks dog", 16, empty, "a photo of dog")
    with pytest.raises(UserError, match="--class_prompt"):
        DreamBoothDataset(captioned, "a photo of sks dog", 16, captioned)
    with pytest.raises(UserError, match="--resize_mode"):
        DreamBoothDataset(captioned, "a photo of sks dog", 16, resize_mode="fit")


# ----------------------------------------------------------------------------------------------------------
# build_dataset


def test_build_dataset_tells_the_layouts_apart(captioned, tmp_path, monkeypatch):
    assert source_of(str(captioned)) is CAPTIONED_IMAGES
    assert source_of(str(tmp_path / "anything.jsonl")) is CAPTIONED_IMAGES
    img_csv = _write_csv(tmp_path / "img.csv", ["path", "text"], [(str(captioned / "a_wide.png"), "x")])
    vid_csv = _write_csv(tmp_path / "vid.csv", ["path", "text"], [("v.mp4", "x")])
    head_csv = _write_csv(tmp_path / "head.csv", ["path", "text"], [])
    hf_csv = _write_csv(tmp_path / "hf.csv", ["file_name", "text"], [])
    assert source_of(str(img_csv)) is CAPTIONED_IMAGES and source_of(str(vid_csv)) is VIDEO_CSV
    assert source_of(str(head_csv)) is VIDEO_CSV and source_of(str(hf_csv)) is CAPTIONED_IMAGES
    assert source_of(str(tmp_path / "missing.csv")) is VIDEO_CSV and source_of("clips") is CLIPS
    monkeypatch.chdir(tmp_path)  # a folder named like a built-in data set does not shadow it
    (tmp_path / "clips").mkdir()
    assert source_of("clips") is CLIPS and source_of("digits") is DIGITS

    ds = build_dataset(str(captioned), 16, resize_mode="letterbox")
    assert isinstance(ds, CaptionedImageDataset) and ds.resize_mode == "letterbox"
    assert float(ds[0]["x"][:, 0].abs().max()) == 0.0  # the wide image's padded top row

    classes = tmp_path / "classes"  # class sub-folders: an image folder, as before, sidecars or not
    for rel, _, _ in IMAGES[:2]:
        (classes / "cat").mkdir(parents=True, exist_ok=True)
        os.link(captioned / rel, classes / "cat" / rel)
        (classes / "cat" / rel).with_suffix(".txt").write_text("a cat")
    (classes / "README.txt").write_text("cats")  # no image beside it: not a caption
    assert source_of(str(classes)) is IMAGE_FOLDER
    assert isinstance(build_dataset(str(classes), 16, resize_mode="letterbox"), ImageFolderDataset)

    flat = tmp_path / "flat"  # no sub-folders: captioned, and says so when the captions are missing
    flat.mkdir()
    _noise(np.random.default_rng(8), (20, 20)).save(flat / "x.png")
    assert source_of(str(flat)) is CAPTIONED_IMAGES
    with pytest.raises(UserError, match="--data.*no caption.*or ROOT/<class>/<image>"):
        build_dataset(str(flat), 16)


# ----------------------------------------------------------------------------------------------------------
# DreamBooth


def _folder(path, n, rng, size=(24, 40)):
    path.mkdir(parents=True)
    for i in range(n):
        _noise(rng, size).save(path / f"{i:02d}.png")
    return path


def test_dreambooth_pairs_instances_with_class_images(tmp_path):
    rng = np.random.default_rng(5)
    inst, cls = _folder(tmp_path / "inst", 3, rng), _folder(tmp_path / "cls", 5, rng, (40, 24))
    ref = lambda folder, i: _as_x(_reference_center_crop(folder / f"{i:02d}.png", 16))  # noqa: E731

    ds = DreamBoothDataset(inst, "a photo of sks dog", 16, cls, "a photo of dog")
    assert len(ds) == 5 and ds.texts == ["a photo of sks dog"]
    assert (ds.in_channels, ds.image_size, ds.num_classes, ds.class_captions, ds.random_flip) == (3, 16, 0, None, True)
    for i in range(5):
        item = ds[i]
        assert item["text"] == "a photo of sks dog" and item["class_text"] == "a photo of dog"
        torch.testing.assert_close(item["x"], ref(inst, i % 3), rtol=0, atol=1e-6)
        torch.testing.assert_close(item["class_x"], ref(cls, i), rtol=0, atol=1e-6)

    ds = DreamBoothDataset(cls, "a photo of sks dog", 16, inst, "a photo of dog")  # more instances than class
    assert len(ds) == 5
    torch.testing.assert_close(ds[4]["class_x"], ref(inst, 1), rtol=0, atol=1e-6)

    ds = DreamBoothDataset(inst, "a photo of sks dog", 16, resize_mode="letterbox")
    assert len(ds) == 3 and set(ds[2]) == {"x", "text"}
    assert float(ds[2]["x"][:, :, 0].abs().max()) == 0.0  # the tall image is padded left and right


def test_dreambooth_bad_instance_image_is_substituted(tmp_path):
    inst = _folder(tmp_path / "inst", 3, np.random.default_rng(6))
    (inst / "01.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(50))
    bad = tmp_path / "bad.jsonl"
    ds = DreamBoothDataset(inst, "sks", 16, bad_samples_path=bad)
    assert torch.equal(ds[1]["x"], ds[2]["x"])
    assert [json.loads(line)["path"] for line in bad.read_text().splitlines()] == [str(inst / "01.png")]


# ----------------------------------------------------------------------------------------------------------
# generate_class_images


class FakePipe:
    """A stand-in for a diffusers text-to-image pipeline: each image is one flat colour drawn from its own
    generator, so an image shows which seed made it. Records each call's arguments."""

    device = torch.device("cpu")

    def __init__(self, fail_on_call=None):
        self.calls, self.fail_on_call = [], fail_on_call

    def __call__(self, prompt, num_inference_steps, height, width, generator, output_type):
        self.calls.append({"prompt": list(prompt), "steps": num_inference_steps, "size": (height, width),
                           "output_type": output_type, "generators": len(generator)})
        if len(self.calls) == self.fail_on_call:
            raise KeyboardInterrupt  # an interrupted run
        colours = [tuple(torch.randint(0, 256, (3,), generator=g).tolist()) for g in generator]
        return SimpleNamespace(images=[Image.new("RGB", (width, height), c) for c in colours])


def _expected_colour(seed, index):
    # derive_seed's documented hash (numpy's SeedSequence, first 32-bit word), written out here
    s = int(np.random.SeedSequence([seed, index]).generate_state(1)[0])
    return tuple(torch.randint(0, 256, (3,), generator=torch.Generator().manual_seed(s)).tolist())


def _pixels(path):
    with Image.open(path) as im:
        return np.array(im)


def test_generate_class_images_fills_up_and_resumes(tmp_path):
    cls = tmp_path / "cls"
    cls.mkdir()
    rng = np.random.default_rng(7)
    _noise(rng, (8, 8)).save(cls / "mine-a.jpg")
    _noise(rng, (8, 8)).save(cls / "mine-b.png")
    pipe = FakePipe()
    assert generate_class_images(pipe, "a photo of dog", cls, 7, 12, batch_size=3, seed=11, num_inference_steps=5) == 5
    assert [c["prompt"] for c in pipe.calls] == [["a photo of dog"] * 3, ["a photo of dog"] * 2]
    assert all(c["steps"] == 5 and c["size"] == (12, 12) and c["output_type"] == "pil" for c in pipe.calls)
    names = sorted(os.listdir(cls))
    assert names == ["class-00002.png", "class-00003.png", "class-00004.png", "class-00005.png", "class-00006.png",
                     "mine-a.jpg", "mine-b.png"]  # nothing left under a temporary name
    for i in range(2, 7):
        arr = _pixels(cls / f"class-{i:05d}.png")
        assert arr.shape == (12, 12, 3) and (arr == _expected_colour(11, i)).all()

    assert generate_class_images(pipe, "a photo of dog", cls, 7, 12, seed=11) == 0  # a re-run: nothing to do
    assert len(pipe.calls) == 2

    (cls / "class-00003.png").unlink()  # 6 left: one more, under a free name; none overwritten
    before = {n: _pixels(cls / n) for n in os.listdir(cls) if n.startswith("class")}
    assert generate_class_images(pipe, "a photo of dog", cls, 7, 12, seed=11) == 1
    assert (_pixels(cls / "class-00007.png") == _expected_colour(11, 7)).all()
    assert all(np.array_equal(_pixels(cls / n), a) for n, a in before.items())


def test_generate_class_images_independent_of_batch_size_and_interruptions(tmp_path):
    one, four = tmp_path / "one", tmp_path / "new" / "four"  # created when missing
    assert generate_class_images(FakePipe(), "dog", one, 5, 8, batch_size=1, seed=3) == 5
    with pytest.raises(KeyboardInterrupt):
        generate_class_images(FakePipe(fail_on_call=2), "dog", four, 5, 8, batch_size=2, seed=3)
    assert sorted(os.listdir(four)) == ["class-00000.png", "class-00001.png"]  # whole images only
    pipe = FakePipe()
    assert generate_class_images(pipe, "dog", four, 5, 8, batch_size=4, seed=3) == 3
    assert [c["generators"] for c in pipe.calls] == [3]
    assert sorted(os.listdir(one)) == sorted(os.listdir(four))
    for name in os.listdir(one):
        assert np.array_equal(_pixels(one / name), _pixels(four / name))
    ds = DreamBoothDataset(one, "sks dog", 8, four, "dog")
    assert len(ds) == 5 and ds.class_paths == [str(four / f"class-{i:05d}.png") for i in range(5)]
