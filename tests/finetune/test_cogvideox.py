"""CogVideoX's own fine-tuning tests (``ditforge train --init_from COGVIDEOX_FOLDER --data clips``, ``ditforge
sample``), end to end on the CPU with the tiny random pipelines of ``tiny_pipelines.make_cogvideox`` (32 px, 9 frames:
latents 4 x 3 x 4 x 4): the one-line errors (the 8k + 1 frame rule, CogVideoX 1.5 folders), and image to video
(``CogVideoXImageToVideoPipeline``) against diffusers' arithmetic written out here and the pipeline's own call. What
every video family shares (first loss, resume, export, LoRA file, features) is in test_video_families.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ditforge import cli
from ditforge.data import build_dataset
from ditforge.data.sampler import GlobalBatchSampler, derive_seed
from ditforge.train.logging import read_metrics
from families import VIDEO, assert_frames_match, assert_one_line_error  # tests/finetune is on sys.path

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE, FRAMES, INTERVAL, BATCH = (getattr(VIDEO["cogvideox"], k) for k in ("size", "frames", "interval", "batch"))
# 32 px, 9 = 8 x 1 + 1 frames: 3 latent frames


def _argv(folder: Path, out: Path, *extra: str) -> list[str]:
    return VIDEO["cogvideox"].argv(folder, out, *extra)


def test_bad_input_lines(cogvideox_pipeline, tmp_path, capsys):
    """One line, exit 2, nothing written: a frame count CogVideoX's VAE does not decode back (8k + 1: 5 frames
    give 2 latent frames, which decode to 8), naming the nearest valid counts; a CogVideoX 1.5 folder
    (``patch_size_t``)."""
    assert_one_line_error(capsys, _argv(cogvideox_pipeline, tmp_path / "r", "--max_steps", "1", "--num_frames", "5"),
                          "--num_frames 5", "8k + 1", "1 and 9")
    assert not (tmp_path / "r").exists()
    from diffusers import CogVideoXTransformer3DModel

    folder = tmp_path / "cog15"
    shutil.copytree(cogvideox_pipeline, folder)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    shutil.rmtree(folder / "transformer")
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    CogVideoXTransformer3DModel(**{**config, "patch_size_t": 2}).save_pretrained(folder / "transformer")
    assert_one_line_error(capsys, _argv(folder, tmp_path / "r", "--max_steps", "1"), "--init_from",
                          "CogVideoX 1.5", "patch_size_t")
    assert not (tmp_path / "r").exists() or not (tmp_path / "r" / "checkpoints").exists()


def test_i2v_first_loss_and_sample_like_the_pipeline(cogvideox_i2v_pipeline, tmp_path, capsys):
    """Image-to-video, 2 steps of full fine-tuning on the clips (each its own first frame): the first loss equals
    diffusers' arithmetic with the pipeline's conditioning written out (the first frame's latents times
    ``scaling_factor``, T' - 1 zero latent frames after it, concatenated to the noisy latents along the channels)
    within 1e-5, both with CogVideoX's training noise on the frame (the default: sigma_i = exp(-3 + 0.5 z_i) of
    pixel noise, then a posterior draw, from sample i's own seed ``derive_seed(seed, 7919, step, i)``) and with
    ``--no-noised_image_input`` (the clean frame's posterior mode); the two differ. The exported folder loads in
    ``CogVideoXImageToVideoPipeline``, whose call on an image (the image latents drawn from the call's generator
    before the noise) gives the video ``ditforge sample --image`` gives, to one uint8 level; ``--image`` left out
    is one line."""
    import diffusers
    from PIL import Image

    run, clean = tmp_path / "run", tmp_path / "clean"
    assert cli.main(_argv(cogvideox_i2v_pipeline, run, "--max_steps", "2", "--lr", "1e-3")) == 0
    assert cli.main(_argv(cogvideox_i2v_pipeline, clean, "--max_steps", "1", "--no-noised_image_input")) == 0
    pipe = diffusers.CogVideoXImageToVideoPipeline.from_pretrained(str(cogvideox_i2v_pipeline), local_files_only=True)
    ds = build_dataset("clips", SIZE, None, FRAMES, INTERVAL, 0)
    idx = GlobalBatchSampler(len(ds), BATCH, 0, 0, 1, 0).global_batch_indices(0).tolist()
    pixels = torch.stack([ds[i]["video"] for i in idx])
    with torch.no_grad():
        post = pipe.vae.encode(pixels).latent_dist
        g = torch.Generator().manual_seed(derive_seed(0, 0))
        shape = tuple(post.mean.shape[1:])
        noise = torch.randn((BATCH, *shape), generator=g).transpose(1, 2)
        t = torch.randint(0, 1000, (BATCH,), generator=g)
        torch.rand(BATCH, generator=g), torch.rand(BATCH, generator=g)
        eps = torch.randn((BATCH, *shape), generator=g)
        scale = pipe.vae.config.scaling_factor
        x0 = ((post.mean + post.std * eps) * scale).transpose(1, 2)
        embeds, _ = pipe.encode_prompt([ds[i]["text"] for i in idx], do_classifier_free_guidance=False,
                                       device="cpu", max_sequence_length=226)
        noisy = pipe.scheduler.add_noise(x0, noise, t)
        rotary = pipe._prepare_rotary_positional_embeddings(SIZE, SIZE, x0.shape[1], torch.device("cpu"))
        v = pipe.scheduler.get_velocity(x0, noise, t)  # sqrt(abar) noise - sqrt(1 - abar) x0

        def loss(image):  # image: the first frame's latents (B, 1, C, h, w), zero frames after it
            image = torch.cat([image * scale, image.new_zeros(BATCH, x0.shape[1] - 1, *image.shape[2:])], dim=1)
            out = pipe.transformer(hidden_states=torch.cat([noisy, image], dim=2), encoder_hidden_states=embeds,
                                   timestep=t, image_rotary_emb=rotary, return_dict=False)[0]
            return float(((out - v) ** 2).mean())

        gens = [torch.Generator().manual_seed(derive_seed(0, 7919, 0, i)) for i in range(BATCH)]
        sigma = torch.stack([(-3 + 0.5 * torch.randn(1, generator=g)).exp() for g in gens])
        frames = pixels[:, :, 0] + sigma.view(-1, 1, 1, 1) * torch.stack([torch.randn(3, SIZE, SIZE, generator=g)
                                                                          for g in gens])
        first = pipe.vae.encode(frames[:, :, None]).latent_dist
        draw = first.mean + first.std * torch.stack([torch.randn(first.mean.shape[1:], generator=g) for g in gens])
        noised = loss(draw.transpose(1, 2))
        plain = loss(pipe.vae.encode(pixels[:, :, :1]).latent_dist.mode().transpose(1, 2))
    assert read_metrics(run / "metrics.jsonl")[0]["loss"] == pytest.approx(noised, rel=1e-5)
    assert read_metrics(clean / "metrics.jsonl")[0]["loss"] == pytest.approx(plain, rel=1e-5)
    assert abs(noised - plain) > 1e-3 * plain  # the noise reaches the loss

    export = tmp_path / "export"
    assert cli.main(["export", "--ckpt", str(run), "--format", "diffusers", "--out", str(export)]) == 0
    pipe = diffusers.CogVideoXImageToVideoPipeline.from_pretrained(str(export), local_files_only=True)
    rng = np.random.default_rng(7)
    first = Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    first.save(tmp_path / "first.png")
    prompt, npz = "a rabbit on a green hill", tmp_path / "s.npz"
    assert cli.main(["sample", "--ckpt", str(run), "--prompt", prompt, "--image", str(tmp_path / "first.png"),
                     "--num_sampling_steps", "3", "--cfg_scale", "4", "--out", str(tmp_path / "clip.mp4"),
                     "--save_npz", str(npz), "--device", "cpu"]) == 0
    video = pipe(image=first, prompt=prompt, num_inference_steps=3, guidance_scale=4.0, height=SIZE, width=SIZE,
                 num_frames=FRAMES, generator=torch.Generator("cpu").manual_seed(derive_seed(0, 0)),
                 output_type="np").frames
    assert_frames_match(npz, video, (1, FRAMES, SIZE, SIZE, 3))
    capsys.readouterr()  # the progress bars of the calls above
    assert_one_line_error(capsys, ["sample", "--ckpt", str(run), "--prompt", prompt, "--out", str(tmp_path / "x.mp4"),
                                   "--device", "cpu"], "--image")
    assert not (tmp_path / "x.mp4").exists()
