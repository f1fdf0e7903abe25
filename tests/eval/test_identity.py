"""``ditforge eval --metrics identity``: the mean cosine of each sample frame's embedding to each reference's
(DreamBooth's CLIP-I / DINO), with a tiny random CLIP vision model and a tiny random DINOv2 saved to local folders,
against the models' own forward on their processors' pixels, cosine in float64."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from PIL import Image

from ditforge import cli


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    from transformers import (BitImageProcessor, CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection,
                              Dinov2Config, Dinov2Model)

    root = tmp_path_factory.mktemp("encoders")
    torch.manual_seed(0)
    tiny = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=4)
    CLIPVisionModelWithProjection(CLIPVisionConfig(**tiny, projection_dim=16)).save_pretrained(root / "clip")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(root / "clip")
    Dinov2Model(Dinov2Config(**tiny)).save_pretrained(root / "dinov2")
    BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(root / "dinov2")
    return root


@functools.cache
def _model(folder):
    from transformers import AutoImageProcessor, CLIPVisionModelWithProjection, Dinov2Model

    model = (CLIPVisionModelWithProjection if folder.name == "clip" else Dinov2Model).from_pretrained(folder)
    return model.eval(), AutoImageProcessor.from_pretrained(folder)


def _embed(folder, image: np.ndarray) -> torch.Tensor:
    """One image's embedding by the model's own forward: CLIP's image_embeds, DINOv2's CLS token; float64."""
    model, processor = _model(folder)
    pixels = processor(images=[image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model(pixel_values=pixels)
        return (out.image_embeds[0] if folder.name == "clip" else out.last_hidden_state[0, 0]).double()


@pytest.mark.parametrize("kind", ["clip", "dinov2"])
def test_identity_equals_transformers(encoders, kind, tmp_path, capsys):
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    a, b, other = rng.integers(0, 256, (3, 24, 24, 3), dtype=np.uint8)
    for name, image in (("a", a), ("b", b)):
        Image.fromarray(image).save(tmp_path / f"{name}.png")
    videos = np.stack([np.stack([a, a]), np.stack([other, b]), rng.integers(0, 256, (2, 24, 24, 3), dtype=np.uint8)])
    np.savez(tmp_path / "videos.npz", samples=videos)
    folder = encoders / kind

    def run(*refs):
        capsys.readouterr()
        argv = ["eval", "--samples", str(tmp_path / "videos.npz"), "--metrics", "identity", "--image_encoder",
                str(folder), "--num_frames", "2", "--device", "cpu", "--batch_size", "3"]
        assert cli.main(argv + [x for r in refs for x in ("--reference_image", str(tmp_path / r))]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    got = run("a.png")
    assert got["identity_scores"][0] == pytest.approx(1.0, abs=1e-6)  # frames equal to the reference
    assert max(got["identity_scores"][1:]) < 1 - 1e-3
    got = run("a.png", "b.png")
    refs = [_embed(folder, r) for r in (a, b)]
    expected = [np.mean([torch.nn.functional.cosine_similarity(_embed(folder, f), r, dim=0).item()
                         for f in video for r in refs]) for video in videos]
    assert got["num_samples"] == 3
    assert got["identity_scores"] == pytest.approx(expected, abs=1e-5)
    assert got["identity_score"] == pytest.approx(np.mean(expected), abs=1e-5)


def test_identity_bad_input(encoders, tmp_path, capsys):
    from transformers import BertConfig

    images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    np.savez(tmp_path / "s.npz", samples=images)
    Image.fromarray(images[0]).save(tmp_path / "a.png")
    BertConfig().save_pretrained(tmp_path / "bert")
    base = ["eval", "--samples", str(tmp_path / "s.npz"), "--metrics", "identity", "--device", "cpu"]
    for argv, message in (
            (["--reference_image", str(tmp_path / "no.png"), "--image_encoder", str(encoders / "clip")],
             "no such file"),
            (["--reference_image", str(tmp_path / "a.png"), "--image_encoder", str(tmp_path / "bert")],
             "expected CLIP or DINOv2"),
            (["--image_encoder", str(encoders / "clip")], "needs --reference_image")):
        capsys.readouterr()
        assert cli.main(base + argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
