"""Wan2.2-Animate (``models/adapters/wan_animate.py``): ``ditforge sample`` of a tiny random ``WanAnimatePipeline``
built here from diffusers' classes against the pipeline's own call from the same seed, and its bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ditforge.cli import main
from ditforge.data.video import write_video
from tiny_pipelines import _save

FRAMES = 5  # one segment of 4k + 1 frames (segment_frame_length 5, one conditioning frame)


@pytest.fixture(scope="module")
def animate(tmp_path_factory, wan_pipeline):
    """A tiny ``WanAnimatePipeline`` folder (the session's ``make_wan`` tokenizer, UMT5, VAE and scheduler; a 2-layer
    ``WanAnimateTransformer3DModel`` 24 wide with a 16 px motion encoder and face adapter; a 2-layer CLIP vision
    model 4 wide) and random 16 px inputs: character PNG, pose and face MP4s of ``FRAMES`` frames."""
    from diffusers import WanAnimatePipeline, WanAnimateTransformer3DModel, WanPipeline
    from PIL import Image
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    root = tmp_path_factory.mktemp("animate")
    wan = WanPipeline.from_pretrained(str(wan_pipeline))
    parts = {n: getattr(wan, n) for n in ("tokenizer", "text_encoder", "vae", "scheduler")}
    torch.manual_seed(0)
    parts["transformer"] = WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, latent_channels=16, text_dim=32,
        ffn_dim=32, num_layers=2, image_dim=4, rope_max_seq_len=32, motion_encoder_size=16,
        motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16}, motion_style_dim=8, motion_dim=4,
        motion_encoder_dim=8, face_encoder_hidden_dim=8, face_encoder_num_heads=2, inject_face_latents_blocks=2,
        motion_encoder_batch_size=4).eval()
    torch.manual_seed(0)
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=4, num_hidden_layers=2, num_attention_heads=2,
                                               image_size=32, intermediate_size=16, patch_size=1)).eval()
    folder = _save(WanAnimatePipeline(**parts, image_encoder=encoder,
                                      image_processor=CLIPImageProcessor(crop_size=32, size=32)), root / "pipe")
    rng = np.random.default_rng()
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / "character.png")
    for name in ("pose", "face"):
        write_video(rng.integers(0, 256, (FRAMES, 16, 16, 3), dtype=np.uint8), root / f"{name}.mp4")
    write_video(rng.integers(0, 256, (FRAMES + 4, 16, 16, 3), dtype=np.uint8), root / "long.mp4")
    return root


def _args(root, *more):
    return ["sample", "--ckpt", str(root / "pipe"), "--prompt", "a cat dancing", "--image",
            str(root / "character.png"), "--pose_video", str(root / "pose.mp4"), "--face_video",
            str(root / "face.mp4"), "--height", "16", "--width", "16", "--num_sampling_steps", "2",
            "--segment_frame_length", str(FRAMES), *more]


def test_sample_returns_the_pipeline_frames(animate, tmp_path):
    """``sample()``'s returned frames against the pipeline's call from the same seed, to 1e-5 before rounding
    (both uint8 from the same float frames: equal)."""
    from diffusers import WanAnimatePipeline
    from PIL import Image

    from ditforge.cli import build_parser
    from ditforge.data.sampler import derive_seed
    from ditforge.data.video import read_clip
    from ditforge.sample.command import sample
    from ditforge.sample.load import SampleConfig

    args = vars(build_parser().parse_args(_args(animate, "--seed", "3", "--out", str(tmp_path / "out"))))
    args.pop("command", None)
    ours = sample(SampleConfig(**args))
    pipe = WanAnimatePipeline.from_pretrained(str(animate / "pipe"))
    video = {n: [Image.fromarray(f) for f in read_clip(str(animate / f"{n}.mp4"), FRAMES, 1, lambda _: 0)[0]]
             for n in ("pose", "face")}
    want = pipe(image=Image.open(animate / "character.png").convert("RGB"), pose_video=video["pose"],
                face_video=video["face"], prompt="a cat dancing", height=16, width=16,
                segment_frame_length=FRAMES, num_inference_steps=2, output_type="pt",
                generator=[torch.Generator().manual_seed(derive_seed(3, 0))]).frames
    want = ((want.transpose(1, 2).float() * 2 - 1).clamp(-1, 1) + 1) * 127.5
    want = want.round().to(torch.uint8).movedim(1, -1).numpy()
    assert ours.shape == (1, FRAMES, 16, 16, 3)
    np.testing.assert_array_equal(ours, want)


@pytest.mark.parametrize("more, says", [
    (("--face_video", "missing.mp4"), "--face_video missing.mp4: no such file"),
    (("--face_video", "long.mp4"), "--face_video: 9 frames, the --pose_video has 5"),
    (("--mode", "replace"), "--background_video: WanAnimatePipeline in mode replace needs it"),
    (("--mode", "dance"), "--mode dance: WanAnimatePipeline takes animate or replace"),
])
def test_bad_input_is_one_line_exit_2(animate, capsys, monkeypatch, more, says):
    monkeypatch.chdir(animate)
    assert main(_args(animate, *more)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
