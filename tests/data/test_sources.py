"""The data-source registry: which source every kind of ``--data`` spec resolves to (tiny files in tmp_path), in
the documented precedence order, and what the sources build from it."""

from __future__ import annotations

import csv
import re

import pytest
from PIL import Image

from ditforge.data import ImageFolderDataset, build_dataset, source_of
from ditforge.data.captions import CaptionedImageDataset
from ditforge.data.sources import SOURCES
from ditforge.errors import UserError


def _image(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), (200, 30, 30)).save(path)
    return path


def _text(path, text="x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _csv(path, header, rows):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def test_sources_are_asked_in_the_documented_order():
    assert [s.name for s in SOURCES] == ["features", "clip folder", "blend", "shards", "digits", "clips",
                                         "captioned images", "video CSV", "image folder"]
    assert [s.name for s in SOURCES if s.streamed] == ["blend", "shards"]
    assert [s.name for s in SOURCES if s.files] == ["captioned images", "video CSV", "image folder"]


@pytest.fixture
def specs(tmp_path, monkeypatch):
    """{spec: the source it must resolve to}, one per kind of --data, made in tmp_path (the current folder)."""
    monkeypatch.chdir(tmp_path)
    t = tmp_path
    _image(t / "classes" / "cat" / "a.png"), _image(t / "classes" / "dog" / "b.png")
    _text(t / "classes" / "README.txt")  # no image beside it: not a caption
    _image(t / "flat" / "a.png"), _text(t / "flat" / "a.txt")
    _image(t / "pair" / "a.png"), _text(t / "pair" / "a.txt"), _image(t / "pair" / "sub" / "b.png")
    _image(t / "dotted" / ".cache" / "a.png"), _image(t / "dotted" / "b.png")  # .name folders do not count
    _text(t / "feats" / "features.json", "{}")
    _text(t / "feats_and_tars" / "features.json", "{}"), _text(t / "feats_and_tars" / "a.tar")
    _text(t / "tars" / "shard-00000.tar")
    _text(t / "manifest" / "shards.json", "{}")
    (t / "digits").mkdir(), (t / "clips").mkdir()  # folders named like the built-in sets do not shadow them
    _text(t / "videos" / "a.mp4"), _text(t / "videos" / "a.txt"), _image(t / "videos" / "b.png")
    _text(t / "nested" / "sub" / "a.webm")  # a video anywhere below: a folder of clips, captioned or not
    _text(t / "tars_and_clips" / "a.tar"), _text(t / "tars_and_clips" / "a.mp4")  # shards win over media
    return {
        "digits": "digits",
        "clips": "clips",
        str(t / "classes"): "image folder",
        str(t / "missing"): "image folder",
        str(_text(t / "notes.txt")): "image folder",
        str(t / "x{a,b}"): "image folder",  # braces without a range: not a shard pattern
        str(t / "flat"): "captioned images",
        str(t / "pair"): "captioned images",
        str(t / "dotted"): "captioned images",
        str(t / "m.jsonl"): "captioned images",
        str(t / "M.JSONL"): "captioned images",
        str(_csv(t / "images.csv", ["path", "text"], [["a.png", "x"]])): "captioned images",
        str(_csv(t / "UPPER.CSV", ["path", "text"], [["a.JPG", "x"]])): "captioned images",
        str(_csv(t / "hf.csv", ["file_name", "text"], [])): "captioned images",
        str(_csv(t / "caption.csv", ["x", "caption"], [])): "captioned images",
        str(_csv(t / "videos.csv", ["path", "text"], [["a.mp4", "x"]])): "video CSV",
        str(_csv(t / "header.csv", ["path", "text"], [])): "video CSV",
        str(t / "missing.csv"): "video CSV",
        str(t / "feats"): "features",
        str(t / "feats_and_tars"): "features",
        str(t / "tars"): "shards",
        str(t / "manifest"): "shards",
        str(t / "one.tar"): "shards",
        str(t / "tars" / "*.tar"): "shards",
        str(t / "tars" / "shard-{00000..00009}.tar"): "shards",
        "s3://bucket/shards/": "shards",
        "https://host/data.csv": "shards",  # a URL is shards whatever it ends in
        str(_text(t / "blend.yaml", "- path: tars\n")): "blend",
        str(t / "videos"): "clip folder",
        str(t / "nested"): "clip folder",
        str(t / "tars_and_clips"): "shards",
        str(_text(t / "clips.yaml", "- {path: videos, weight: 2}\n- {path: nested}\n")): "clip folder",
        str(_text(t / "mixed.yaml", "- {path: videos}\n- {path: tars}\n")): "blend",  # not all folders of clips
        str(t / "blend.YML"): "blend",
    }


def test_every_kind_of_spec_resolves_to_its_source(specs):
    assert {spec: source_of(spec).name for spec in specs} == specs


def test_the_file_sources_build_their_data_sets(specs, tmp_path):
    assert isinstance(build_dataset(str(tmp_path / "classes"), 4), ImageFolderDataset)
    captioned = build_dataset(str(tmp_path / "flat"), 4, resize_mode="letterbox")
    assert isinstance(captioned, CaptionedImageDataset) and captioned.resize_mode == "letterbox"


@pytest.mark.parametrize("spec", ["classes", "flat", "videos.csv"])
def test_file_sources_need_an_image_size(specs, tmp_path, spec):
    path = tmp_path / spec
    line = f"--image_size is required for {path} (e.g. --image_size 64)"
    with pytest.raises(UserError, match=f"^{re.escape(line)}$"):
        build_dataset(str(path), None)
