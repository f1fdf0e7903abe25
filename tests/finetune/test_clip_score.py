"""``ditforge eval --metrics clip``: the CLIP score of text-to-image samples, with a tiny random CLIP saved to a
local folder (its tokenizer trained offline, tiny_pipelines.py), against transformers' CLIP computed directly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ditforge import cli
from tiny_pipelines import make_clip_tokenizer


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = make_clip_tokenizer()
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, projection_dim=16,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                           num_attention_heads=4, projection_dim=16),
        projection_dim=16)
    folder = tmp_path_factory.mktemp("clip") / "clip"
    CLIPModel(config).eval().save_pretrained(folder)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    return folder


def _reference(folder, images: np.ndarray, prompts: list[str]) -> float:
    """Hessel et al.'s CLIPScore with w = 100, one sample at a time, from CLIP's towers and projections (not
    CLIPModel.forward's embeddings): mean of max(100 cos, 0)."""
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(folder).eval(), CLIPProcessor.from_pretrained(folder)
    scores = []
    for image, prompt in zip(images, prompts):
        inputs = processor(text=[prompt], images=[image], return_tensors="pt")
        with torch.no_grad():
            e_image = model.visual_projection(model.vision_model(pixel_values=inputs["pixel_values"]).pooler_output)
            e_text = model.text_projection(model.text_model(input_ids=inputs["input_ids"]).pooler_output)
        cos = torch.nn.functional.cosine_similarity(e_image.double(), e_text.double()).item()
        scores.append(max(100 * cos, 0.0))
    return float(np.mean(scores))


def test_clip_score_equals_transformers_clip(tiny_clip, tmp_path, capsys):
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    images = rng.integers(0, 256, (7, 24, 24, 3), dtype=np.uint8)
    prompts = ["a red circle", "two dogs", "a cat on a mat", "blue sky", "an old tree", "a car", "the sea at night"]
    npz = tmp_path / "samples.npz"
    np.savez(npz, samples=images, prompts=np.array(prompts))
    capsys.readouterr()
    assert cli.main(["eval", "--samples", str(npz), "--metrics", "clip", "--clip", str(tiny_clip),
                     "--batch_size", "4", "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["num_samples"] == 7
    assert got["clip_score"] == pytest.approx(_reference(tiny_clip, images, prompts), abs=1e-4)


def test_clip_score_of_videos_is_the_frames_mean(tiny_clip):
    """Videos (N, T, H, W, 3): every frame scored against its video's prompt, the N x T scores averaged (the
    distillation's evaluation of video students); against the per-frame reference, 1e-4."""
    from ditforge.eval.clip_score import clip_score

    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    videos = rng.integers(0, 256, (3, 2, 20, 20, 3), dtype=np.uint8)
    prompts = ["a red circle", "two dogs", "blue sky"]
    want = np.mean([_reference(tiny_clip, video, [prompt] * len(video)) for video, prompt in zip(videos, prompts)])
    assert clip_score(videos, prompts, tiny_clip, batch_size=4) == pytest.approx(want, abs=1e-4)


def test_clip_score_bad_input(tiny_clip, tmp_path, capsys):
    images = np.zeros((3, 16, 16, 3), dtype=np.uint8) + np.arange(3, dtype=np.uint8)[:, None, None, None]
    no_prompts = tmp_path / "np.npz"
    np.savez(no_prompts, samples=images)
    with_prompts = tmp_path / "p.npz"
    np.savez(with_prompts, samples=images, prompts=np.array(["a", "b", "c"]))
    for argv, message in (
            (["--samples", str(no_prompts), "--metrics", "clip", "--clip", str(tiny_clip)], "holds no 'prompts'"),
            (["--samples", str(with_prompts), "--metrics", "clip", "--clip", str(tmp_path)], "not a local CLIP folder"),
            (["--samples", str(with_prompts), "--metrics", "clip"], "needs --clip"),
            (["--samples", str(with_prompts), "--metrics", "fid"], "--ref: needed")):
        capsys.readouterr()
        assert cli.main(["eval", *argv, "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
