"""CogVideoX 1.0 text-to-video fine-tuning and sampling (``ditforge train --init_from COGVIDEOX_FOLDER --data clips``,
``ditforge sample``), end to end on the CPU with the tiny random ``CogVideoXPipeline`` of
``tiny_pipelines.make_cogvideox`` (32 px, 9 frames: latents 4 x 3 x 4 x 4): the first step's loss against the loss of
diffusers' ``train_cogvideox_lora.py`` (the scheduler's ``add_noise`` and ``get_velocity``, x0 weighted by
1 / (1 - abar)), written out here; full and LoRA runs resumed bit for bit; the exported folder and LoRA file read
back by ``CogVideoXPipeline``, whose own call draws what ``ditforge sample`` draws; the one-line errors."""

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
from test_finetune import (assert_frames_match, assert_one_line_error,  # tests/finetune is on sys.path
                           video_train_argv)
from tiny_pipelines import BUILDERS

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE, FRAMES, INTERVAL, BATCH = 32, 9, 1, 2  # 9 = 8 x 1 + 1 frames: 3 latent frames


@pytest.fixture(scope="module")
def cog(tmp_path_factory, one_thread_module) -> Path:
    """The tiny ``CogVideoXPipeline`` folder, built once for this module."""
    return BUILDERS["cogvideox"](tmp_path_factory.mktemp("cogvideox") / "pipe")


def _argv(folder: Path, out: Path, *extra: str) -> list[str]:
    return video_train_argv(folder, out, SIZE, FRAMES, INTERVAL, BATCH, *extra)


KINDS = {"full": ["--lr", "1e-3"], "lora": ["--lora_rank", "4", "--lr", "1e-2"]}


@pytest.fixture(scope="module")
def runs(cog, tmp_path_factory, one_thread_module) -> dict[str, Path]:
    """4 steps of full (lr 1e-3) and of LoRA (rank 4, lr 1e-2) fine-tuning, checkpoints every 2 steps."""
    root = tmp_path_factory.mktemp("cogvideox_runs")
    for kind, extra in KINDS.items():
        assert cli.main(_argv(cog, root / kind, "--max_steps", "4", "--ckpt_every", "2", *extra)) == 0
    return {kind: root / kind for kind in KINDS}


def _reference_first_loss(folder: Path) -> float:
    """Step 0's loss as diffusers' ``examples/cogvideo/train_cogvideox_lora.py`` computes it: the clips of the run's
    first batch (``GlobalBatchSampler``, seed 0) through ``AutoencoderKLCogVideoX``'s posterior times its
    ``scaling_factor``, frames first; the T5 states of ``pipe.encode_prompt`` (226 tokens); the step's draws in
    ditforge's order from ``derive_seed(0, 0)`` (noise, integer timesteps in [0, 1000), drop, flip, posterior
    eps); ``scheduler.add_noise``, the transformer with the pipeline's rotary positions, ``scheduler.get_velocity``
    of its output (the x0 estimate) against x0 weighted by 1 / (1 - abar_t); float32."""
    import diffusers

    pipe = diffusers.CogVideoXPipeline.from_pretrained(str(folder), local_files_only=True)
    ds = build_dataset("clips", SIZE, None, FRAMES, INTERVAL, 0)
    idx = GlobalBatchSampler(len(ds), BATCH, 0, 0, 1, 0).global_batch_indices(0).tolist()
    pixels = torch.stack([ds[i]["video"] for i in idx])
    texts = [ds[i]["text"] for i in idx]
    with torch.no_grad():
        post = pipe.vae.encode(pixels).latent_dist
        g = torch.Generator().manual_seed(derive_seed(0, 0))
        shape = tuple(post.mean.shape[1:])
        noise = torch.randn((BATCH, *shape), generator=g)
        t = torch.randint(0, 1000, (BATCH,), generator=g)
        torch.rand(BATCH, generator=g), torch.rand(BATCH, generator=g)  # caption drop, flip: unused here
        eps = torch.randn((BATCH, *shape), generator=g)
        x0 = ((post.mean + post.std * eps) * pipe.vae.config.scaling_factor).transpose(1, 2)  # (B, T', C, h, w)
        noise = noise.transpose(1, 2)
        embeds, _ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, device="cpu", max_sequence_length=226)
        noisy = pipe.scheduler.add_noise(x0, noise, t)
        rotary = pipe._prepare_rotary_positional_embeddings(SIZE, SIZE, x0.shape[1], torch.device("cpu"))
        out = pipe.transformer(hidden_states=noisy, encoder_hidden_states=embeds, timestep=t,
                               image_rotary_emb=rotary, return_dict=False)[0]
        pred = pipe.scheduler.get_velocity(out, noisy, t)
        weights = (1 / (1 - pipe.scheduler.alphas_cumprod[t])).view(-1, 1, 1, 1, 1)
    return float((weights * (pred - x0) ** 2).reshape(BATCH, -1).mean(1).mean())


def test_first_step_loss_matches_diffusers(cog, runs):
    """Both runs' first loss (LoRA starts with B = 0: the same model) equals diffusers' within 1e-5 relative
    (fp32); the run recorded the v objective read from the scheduler and 3 latent frames."""
    ref = _reference_first_loss(cog)
    for kind, run in runs.items():
        records = read_metrics(run / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2, 3, 4], kind
        assert records[0]["loss"] == pytest.approx(ref, rel=1e-5), kind
    config = __import__("yaml").safe_load((runs["full"] / "config.yaml").read_text())
    assert (config["model"]["family"], config["model"]["objective"]) == ("cogvideox", "v")
    assert (config["model"]["num_frames"], config["data"]["num_frames"]) == (3, FRAMES)


@pytest.mark.parametrize("kind", list(KINDS))
def test_resume_equals_uninterrupted(kind, cog, runs, tmp_path):
    """Stopped after 2 steps and resumed to 4 (``--resume auto``): the same 4 losses, bit for bit, as the run of 4
    steps in one go, and the same final weights."""
    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    part = tmp_path / "part"
    assert cli.main(_argv(cog, part, "--max_steps", "2", "--ckpt_every", "2", *KINDS[kind])) == 0
    assert cli.main(["train", "--outputs", str(part), "--resume", "auto", "--max_steps", "4"]) == 0
    assert [r["loss"] for r in read_metrics(part / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(runs[kind] / "metrics.jsonl")]
    weights = [load_finetuned(*load_weights(run, use_ema=True), torch.device("cpu"))[1].state_dict()
               for run in (runs[kind], part)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_features_train_like_on_the_fly(cog, runs, tmp_path):
    """``extract-features --init_from`` stores the VAE posterior of whole clips (3 latent frames) and the T5
    states; a run on them (the pipeline read from the features) logs the on-the-fly run's losses for the same
    seed within 1e-5 relative (stored float32 moments, summed in another order)."""
    feats = tmp_path / "feats"
    assert cli.main(["extract-features", "--init_from", str(cog), "--data", "clips", "--num_frames", str(FRAMES),
                     "--frame_interval", str(INTERVAL), "--image_size", str(SIZE), "--device", "cpu",
                     "--num_workers", "0", "--out", str(feats)]) == 0
    assert cli.main(["train", "--data", str(feats), "--batch_size", str(BATCH), "--max_steps", "2", "--log_every",
                     "1", "--sample_every", "0", "--mixed_precision", "fp32", "--device", "cpu",
                     "--class_dropout_prob", "0", "--lr", "1e-3", "--outputs", str(tmp_path / "run")]) == 0
    ours = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    fly = [r["loss"] for r in read_metrics(runs["full"] / "metrics.jsonl")][:2]
    assert ours == pytest.approx(fly, rel=1e-5)


def test_export_folder_samples_like_the_pipeline(runs, tmp_path):
    """``--format diffusers`` of the full run: ``CogVideoXPipeline.from_pretrained(local_files_only=True)`` loads it
    with the trained (EMA) weights exactly; from the same seed, prompt and steps the pipeline's own call (its DPM
    scheduler drawing fresh noise each step from the call's generator, guidance 4) draws the video
    ``ditforge sample --out clip.mp4`` draws, to one uint8 level, and the file holds the 9 frames."""
    import diffusers

    from ditforge.data.video import probe_video
    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    out = tmp_path / "export"
    assert cli.main(["export", "--ckpt", str(runs["full"]), "--format", "diffusers", "--out", str(out)]) == 0
    pipe = diffusers.CogVideoXPipeline.from_pretrained(str(out), local_files_only=True)
    _, trained, _ = load_finetuned(*load_weights(runs["full"], use_ema=True), torch.device("cpu"))
    exported, trained = pipe.transformer.state_dict(), trained.inner.state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)

    prompt, npz, clip = "a rabbit on a green hill", tmp_path / "s.npz", tmp_path / "clip.mp4"
    assert cli.main(["sample", "--ckpt", str(runs["full"]), "--prompt", prompt, "--num_sampling_steps", "4",
                     "--cfg_scale", "4", "--out", str(clip), "--save_npz", str(npz), "--device", "cpu"]) == 0
    g = torch.Generator("cpu").manual_seed(derive_seed(0, 0))
    video = pipe(prompt=[prompt], num_inference_steps=4, guidance_scale=4.0, height=SIZE, width=SIZE,
                 num_frames=FRAMES, generator=g, output_type="np").frames
    assert_frames_match(npz, video, (1, FRAMES, SIZE, SIZE, 3))
    assert probe_video(clip)["num_frames"] == FRAMES


def test_lora_file_loads_with_load_lora_weights(cog, runs, tmp_path):
    """``--format lora``: ``CogVideoXPipeline.load_lora_weights`` reads the file, and its transformer then gives
    ditforge's LoRA model's output on fresh random latents (frames first), timesteps and states within 1e-5 of the
    output's largest magnitude, while the base model is off by over 100 times that."""
    import diffusers

    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    out = tmp_path / "lora"
    assert cli.main(["export", "--ckpt", str(runs["lora"]), "--format", "lora", "--out", str(out)]) == 0
    pipe = diffusers.CogVideoXPipeline.from_pretrained(str(cog), local_files_only=True)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2, 4, 3, 4, 4, generator=g)
    t = torch.randint(0, 1000, (2,), generator=g)
    states = torch.randn(2, 226, 32, generator=g)
    _, ours, _ = load_finetuned(*load_weights(runs["lora"], use_ema=True), torch.device("cpu"))
    rotary = pipe._prepare_rotary_positional_embeddings(SIZE, SIZE, 3, torch.device("cpu"))

    def call(model):
        with torch.no_grad():
            return model(hidden_states=x.transpose(1, 2), timestep=t, encoder_hidden_states=states,
                         image_rotary_emb=rotary, return_dict=False)[0].transpose(1, 2)

    base = call(pipe.transformer)
    pipe.load_lora_weights(str(out))
    theirs = call(pipe.transformer)
    with torch.no_grad():
        mine = ours.denoise(x, t, states)
    tol = 1e-5 * mine.abs().max()
    assert (theirs - mine).abs().max() <= tol
    assert (base - mine).abs().max() > 100 * tol


def test_bad_input_lines(cog, tmp_path, capsys):
    """One line, exit 2, nothing written: a frame count CogVideoX's VAE does not decode back (8k + 1: 5 frames
    give 2 latent frames, which decode to 8), naming the nearest valid counts; a CogVideoX 1.5 folder
    (``patch_size_t``)."""
    assert_one_line_error(capsys, _argv(cog, tmp_path / "r", "--max_steps", "1", "--num_frames", "5"),
                          "--num_frames 5", "8k + 1", "1 and 9")
    assert not (tmp_path / "r").exists()
    from diffusers import CogVideoXTransformer3DModel

    folder = tmp_path / "cog15"
    shutil.copytree(cog, folder)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    shutil.rmtree(folder / "transformer")
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    CogVideoXTransformer3DModel(**{**config, "patch_size_t": 2}).save_pretrained(folder / "transformer")
    assert_one_line_error(capsys, _argv(folder, tmp_path / "r", "--max_steps", "1"), "--init_from",
                          "CogVideoX 1.5", "patch_size_t")
    assert not (tmp_path / "r").exists() or not (tmp_path / "r" / "checkpoints").exists()


@pytest.fixture(scope="module")
def cog_i2v(tmp_path_factory, one_thread_module) -> Path:
    """The tiny ``CogVideoXImageToVideoPipeline`` folder, built once for this module."""
    return BUILDERS["cogvideox_i2v"](tmp_path_factory.mktemp("cogvideox_i2v") / "pipe")


def test_i2v_first_loss_and_sample_like_the_pipeline(cog_i2v, tmp_path, capsys):
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
    assert cli.main(_argv(cog_i2v, run, "--max_steps", "2", "--lr", "1e-3")) == 0
    assert cli.main(_argv(cog_i2v, clean, "--max_steps", "1", "--no-noised_image_input")) == 0
    pipe = diffusers.CogVideoXImageToVideoPipeline.from_pretrained(str(cog_i2v), local_files_only=True)
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
