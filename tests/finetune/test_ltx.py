"""LTX-Video text- and image-to-video fine-tuning and sampling (``ditforge train --init_from LTX_FOLDER --data clips``,
``ditforge sample``), end to end on the CPU with the tiny random ``LTXPipeline`` of ``tiny_pipelines.make_ltx`` (32 px,
5 frames: latents 8 x 2 x 8 x 8): the first step's loss against diffusers' pieces (the pipeline's latent
normalisation, packing and ``calculate_shift``) written out here; a LoRA run resumed bit for bit; the exported folder
and LoRA file read back by ``LTXPipeline``, whose own call draws what ``ditforge sample`` draws; the frame rule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ditforge import cli
from ditforge.data import build_dataset
from ditforge.data.sampler import GlobalBatchSampler, derive_seed
from ditforge.train.logging import read_metrics
from test_finetune import (assert_frames_match, assert_image_to_video_run_samples_like_its_export,  # on sys.path
                           assert_one_line_error, video_train_argv)
from tiny_pipelines import BUILDERS

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE, FRAMES, INTERVAL, BATCH = 32, 5, 2, 2  # 5 = 4 x 1 + 1 frames: 2 latent frames of 8 x 8
KINDS = {"full": ["--lr", "1e-3"], "lora": ["--lora_rank", "4", "--lr", "1e-2"]}


@pytest.fixture(scope="module")
def ltx(tmp_path_factory, one_thread_module) -> Path:
    """The tiny ``LTXPipeline`` folder, built once for this module."""
    return BUILDERS["ltx"](tmp_path_factory.mktemp("ltx") / "pipe")


def _argv(folder: Path, out: Path, *extra: str) -> list[str]:
    return video_train_argv(folder, out, SIZE, FRAMES, INTERVAL, BATCH, *extra)


@pytest.fixture(scope="module")
def runs(ltx, tmp_path_factory, one_thread_module) -> dict[str, Path]:
    """4 steps of full (lr 1e-3) and of LoRA (rank 4, lr 1e-2) fine-tuning, checkpoints every 2 steps."""
    root = tmp_path_factory.mktemp("ltx_runs")
    for kind, extra in KINDS.items():
        assert cli.main(_argv(ltx, root / kind, "--max_steps", "4", "--ckpt_every", "2", *extra)) == 0
    return {kind: root / kind for kind in KINDS}


def _reference_first_loss(folder: Path, image_to_video: bool = False) -> tuple[float, float]:
    """Step 0's loss from diffusers' pieces, and the shift: the clips of the run's first batch (``GlobalBatchSampler``,
    seed 0) through ``AutoencoderKLLTXVideo``'s posterior, normalised by ``LTXPipeline._normalize_latents`` (its
    ``latents_mean`` / ``latents_std`` buffers and ``scaling_factor``); the T5 states and attention mask of
    ``pipe.encode_prompt`` (128 tokens); the step's draws in ditforge's order (noise, logit-normal u, drop, flip,
    posterior eps) from ``derive_seed(0, 0)``; shift = exp(mu), mu of the pipeline's ``calculate_shift`` at the
    latent frames x height x width (128) with the scheduler's settings; sigma = shift u / (1 + (shift - 1) u); the
    transformer on ``_pack_latents`` of x_t = (1 - sigma) x0 + sigma noise with the pipeline's rotary scale at 25
    fps, its output unpacked, against noise - x0; float32. ``image_to_video`` (``LTXImageToVideoPipeline``): the
    first latent frame of x_t is the clip's first frame alone through the VAE's posterior mode, normalised as
    ``prepare_latents`` normalises its draw, its 64 tokens at timestep 0 (the pipeline's ``t (1 -
    conditioning_mask)``), and the loss is over the other frames."""
    import diffusers
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    cls = diffusers.LTXImageToVideoPipeline if image_to_video else diffusers.LTXPipeline
    pipe = cls.from_pretrained(str(folder), local_files_only=True)
    ds = build_dataset("clips", SIZE, None, FRAMES, INTERVAL, 0)
    idx = GlobalBatchSampler(len(ds), BATCH, 0, 0, 1, 0).global_batch_indices(0).tolist()
    pixels = torch.stack([ds[i]["video"] for i in idx])
    config = pipe.scheduler.config
    with torch.no_grad():
        post = pipe.vae.encode(pixels).latent_dist
        g = torch.Generator().manual_seed(derive_seed(0, 0))
        shape = tuple(post.mean.shape[1:])
        noise = torch.randn((BATCH, *shape), generator=g)
        u = torch.sigmoid(torch.randn(BATCH, generator=g))
        torch.rand(BATCH, generator=g), torch.rand(BATCH, generator=g)
        eps = torch.randn((BATCH, *shape), generator=g)
        x0 = pipe._normalize_latents(post.mean + post.std * eps, pipe.vae.latents_mean, pipe.vae.latents_std,
                                     pipe.vae.config.scaling_factor)
        frames, h, w = x0.shape[2:]
        shift = math.exp(calculate_shift(frames * h * w, config.base_image_seq_len, config.max_image_seq_len,
                                         config.base_shift, config.max_shift))
        sigma = (shift * u / (1 + (shift - 1) * u)).view(-1, 1, 1, 1, 1)
        embeds, mask, _, _ = pipe.encode_prompt([ds[i]["text"] for i in idx], do_classifier_free_guidance=False,
                                                device="cpu", max_sequence_length=128)
        x_t = (1 - sigma) * x0 + sigma * noise
        timestep = sigma.flatten() * 1000
        if image_to_video:
            first = pipe._normalize_latents(pipe.vae.encode(pixels[:, :, :1]).latent_dist.mode(),
                                            pipe.vae.latents_mean, pipe.vae.latents_std)  # prepare_latents' call
            x_t = torch.cat([first, x_t[:, :, 1:]], dim=2)
            timestep = torch.cat([torch.zeros(BATCH, h * w), timestep[:, None].expand(-1, (frames - 1) * h * w)], 1)
        ratio = pipe.vae_spatial_compression_ratio
        out = pipe.transformer(hidden_states=pipe._pack_latents(x_t, 1, 1), encoder_hidden_states=embeds,
                               timestep=timestep, encoder_attention_mask=mask, num_frames=frames,
                               height=h, width=w, rope_interpolation_scale=(pipe.vae_temporal_compression_ratio / 25,
                                                                            ratio, ratio), return_dict=False)[0]
        pred = pipe._unpack_latents(out, frames, h, w, 1, 1)
    given = 1 if image_to_video else 0
    return float(((pred - (noise - x0))[:, :, given:] ** 2).mean()), shift


def test_first_step_loss_matches_diffusers(ltx, runs):
    """Both runs' first loss (LoRA starts with B = 0: the same model) equals diffusers' within 1e-5 relative
    (fp32); the run recorded the flow objective with the dynamic shift at its latent size."""
    ref, shift = _reference_first_loss(ltx)
    for kind, run in runs.items():
        records = read_metrics(run / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2, 3, 4], kind
        assert records[0]["loss"] == pytest.approx(ref, rel=1e-5), kind
    config = __import__("yaml").safe_load((runs["full"] / "config.yaml").read_text())
    assert (config["model"]["family"], config["model"]["objective"]) == ("ltx", "flow")
    assert config["model"]["flow_shift"] == pytest.approx(shift, rel=1e-12)


def test_image_to_video_first_loss_and_sample(tmp_path):
    """``LTXImageToVideoPipeline``: a full run's first loss equals ``_reference_first_loss``'s image-to-video form
    (1e-5 relative), and ``ditforge sample --image`` of the run draws what the exported pipeline's own call draws
    from the same seed (its first latent frame a draw from the image's posterior, before the noise), frames within
    one uint8 level."""
    folder = BUILDERS["ltx_i2v"](tmp_path / "pipe")
    run = tmp_path / "run"
    assert cli.main(_argv(folder, run, "--max_steps", "1", "--lr", "1e-3")) == 0
    ref, _ = _reference_first_loss(folder, image_to_video=True)
    assert read_metrics(run / "metrics.jsonl")[0]["loss"] == pytest.approx(ref, rel=1e-5)
    assert_image_to_video_run_samples_like_its_export(run, tmp_path, "LTXImageToVideoPipeline", SIZE, FRAMES, 3.0)


def test_lora_resume_equals_uninterrupted(ltx, runs, tmp_path):
    """A LoRA run stopped after 2 steps and resumed to 4 (``--resume auto``, the shift read back from the run's
    config) logs the same 4 losses, bit for bit, as the run of 4 steps in one go."""
    part = tmp_path / "part"
    assert cli.main(_argv(ltx, part, "--max_steps", "2", "--ckpt_every", "2", *KINDS["lora"])) == 0
    assert cli.main(["train", "--outputs", str(part), "--resume", "auto", "--max_steps", "4"]) == 0
    assert [r["loss"] for r in read_metrics(part / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(runs["lora"] / "metrics.jsonl")]


def test_export_folder_samples_like_the_pipeline(runs, tmp_path):
    """``--format diffusers`` of the full run: ``LTXPipeline.from_pretrained(local_files_only=True)`` loads it with
    the trained (EMA) weights exactly, and its own call (sigmas shifted by the dynamic mu, the last stretched to the
    scheduler's terminal 0.1) draws the video ``ditforge sample`` draws from the same seed, to one uint8 level."""
    import diffusers

    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    out = tmp_path / "export"
    assert cli.main(["export", "--ckpt", str(runs["full"]), "--format", "diffusers", "--out", str(out)]) == 0
    pipe = diffusers.LTXPipeline.from_pretrained(str(out), local_files_only=True)
    _, trained, _ = load_finetuned(*load_weights(runs["full"], use_ema=True), torch.device("cpu"))
    exported, trained = pipe.transformer.state_dict(), trained.inner.state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    prompt, npz = "a rabbit on a green hill", tmp_path / "s.npz"
    assert cli.main(["sample", "--ckpt", str(runs["full"]), "--prompt", prompt, "--num_sampling_steps", "4",
                     "--cfg_scale", "3", "--out", str(tmp_path / "clip.mp4"), "--save_npz", str(npz),
                     "--device", "cpu"]) == 0
    video = pipe(prompt=[prompt], num_inference_steps=4, guidance_scale=3.0, height=SIZE, width=SIZE,
                 num_frames=FRAMES, generator=torch.Generator("cpu").manual_seed(derive_seed(0, 0)),
                 output_type="np").frames
    assert_frames_match(npz, video, (1, FRAMES, SIZE, SIZE, 3))


def test_lora_file_loads_with_load_lora_weights(ltx, runs, tmp_path):
    """``--format lora``: ``LTXPipeline.load_lora_weights`` reads the file, and its transformer then gives ditforge's
    LoRA model's output on fresh random latents, times, states and mask within 1e-5 of the output's largest
    magnitude, while the base model is off by over 100 times that."""
    import diffusers

    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    out = tmp_path / "lora"
    assert cli.main(["export", "--ckpt", str(runs["lora"]), "--format", "lora", "--out", str(out)]) == 0
    pipe = diffusers.LTXPipeline.from_pretrained(str(ltx), local_files_only=True)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2, 8, 2, 8, 8, generator=g)
    t = torch.rand(2, generator=g) * 1000
    states = torch.randn(2, 128, 32, generator=g)
    mask = torch.arange(128).expand(2, 128) < torch.tensor([[9], [30]])
    _, ours, _ = load_finetuned(*load_weights(runs["lora"], use_ema=True), torch.device("cpu"))
    base_model = type(ours)(pipe.transformer, ours.vae_scale)
    base_model.attach_pipeline(pipe)
    with torch.no_grad():
        base = base_model.denoise(x, t, states, mask)
        pipe.load_lora_weights(str(out))
        theirs, mine = base_model.denoise(x, t, states, mask), ours.denoise(x, t, states, mask)
    tol = 1e-5 * mine.abs().max()
    assert (theirs - mine).abs().max() <= tol
    assert (base - mine).abs().max() > 100 * tol


def test_num_frames_the_vae_cannot_take(ltx, tmp_path, capsys):
    """6 frames: one line naming the nearest valid counts of the tiny VAE's 4k + 1 (the real one's: 8k + 1)."""
    assert_one_line_error(capsys, _argv(ltx, tmp_path / "r", "--max_steps", "1", "--num_frames", "6"),
                          "--num_frames 6", "4k + 1", "5 and 9")
