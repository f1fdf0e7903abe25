"""HunyuanVideo text- and image-to-video fine-tuning and sampling (``ditforge train --init_from HUNYUAN_FOLDER --data
clips``, ``ditforge sample``), end to end on the CPU with the tiny random ``HunyuanVideoPipeline`` of
``tiny_pipelines.make_hunyuan_video`` (16 px, 5 frames: latents 4 x 2 x 2 x 2): the first step's loss against
diffusers' model called directly (flow matching at the scheduler's shift 7, the embedded guidance at 1.0 x 1000); a
LoRA run resumed bit for bit; the exported folder read back by ``HunyuanVideoPipeline``, whose own call (its
distilled guidance embedded, no unconditional pass) draws what ``ditforge sample`` draws; the LoRA file. Image to
video (``HunyuanVideoImageToVideoPipeline``, both of its transformers): the first loss, and sampling against the
pipeline's own call."""

from __future__ import annotations

import contextlib
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

SIZE, FRAMES, INTERVAL, BATCH = 16, 5, 2, 2
KINDS = {"full": ["--lr", "1e-3"], "lora": ["--lora_rank", "4", "--lr", "1e-2"]}


@pytest.fixture(scope="module")
def hunyuan(tmp_path_factory, one_thread_module) -> Path:
    """The tiny ``HunyuanVideoPipeline`` folder, built once for this module."""
    return BUILDERS["hunyuan_video"](tmp_path_factory.mktemp("hunyuan") / "pipe")


def _argv(folder: Path, out: Path, *extra: str) -> list[str]:
    return video_train_argv(folder, out, SIZE, FRAMES, INTERVAL, BATCH, *extra)


@pytest.fixture(scope="module")
def runs(hunyuan, tmp_path_factory, one_thread_module) -> dict[str, Path]:
    """4 steps of full (lr 1e-3) and of LoRA (rank 4, lr 1e-2) fine-tuning, checkpoints every 2 steps."""
    root = tmp_path_factory.mktemp("hunyuan_runs")
    for kind, extra in KINDS.items():
        assert cli.main(_argv(hunyuan, root / kind, "--max_steps", "4", "--ckpt_every", "2", *extra)) == 0
    return {kind: root / kind for kind in KINDS}


def _reference_first_loss(folder: Path, condition: str | None = None) -> float:
    """Step 0's loss from diffusers' pieces: the first batch's clips through ``AutoencoderKLHunyuanVideo``'s posterior
    times its ``scaling_factor``; the Llama states, mask and CLIP pooled states of ``pipe.encode_prompt`` (256
    tokens); the draws from ``derive_seed(0, 0)`` in ditforge's order (noise, logit-normal u, drop, flip, posterior
    eps); sigma = 7 u / (1 + 6 u) (the scheduler's shift 7, checked against its own sigmas); the transformer at
    1000 sigma with guidance 1000 (embedded guidance 1.0) on x_t = (1 - sigma) x0 + sigma noise, against
    noise - x0.

    ``condition`` (``HunyuanVideoImageToVideoPipeline``, its transformer's ``image_condition_type``): the prompts
    encoded with the clips' first frames as uint8 images (every 4th / 2nd of the image states, the call's
    ``image_embed_interleave``), and the first frames' posterior mode times ``scaling_factor`` (``prepare_latents``):
    token_replace puts it in place of x_t's first latent frame and leaves that frame out of the loss;
    latent_concat concatenates [it on frame 0 and zeros, the first-frame mask] to x_t's channels, as
    ``__call__``'s ``latent_model_input``."""
    import diffusers
    import numpy as np
    from PIL import Image

    cls = diffusers.HunyuanVideoPipeline if condition is None else diffusers.HunyuanVideoImageToVideoPipeline
    pipe = cls.from_pretrained(str(folder), local_files_only=True)
    shift = float(pipe.scheduler.config.shift)
    assert shift == 7.0
    pipe.scheduler.set_timesteps(sigmas=[0.5])
    assert float(pipe.scheduler.sigmas[0]) == pytest.approx(shift * 0.5 / (1 + (shift - 1) * 0.5), rel=1e-6)
    ds = build_dataset("clips", SIZE, None, FRAMES, INTERVAL, 0)
    idx = GlobalBatchSampler(len(ds), BATCH, 0, 0, 1, 0).global_batch_indices(0).tolist()
    pixels = torch.stack([ds[i]["video"] for i in idx])
    with torch.no_grad():
        post = pipe.vae.encode(pixels).latent_dist
        g = torch.Generator().manual_seed(derive_seed(0, 0))
        shape = tuple(post.mean.shape[1:])
        noise = torch.randn((BATCH, *shape), generator=g)
        u = torch.sigmoid(torch.randn(BATCH, generator=g))
        torch.rand(BATCH, generator=g), torch.rand(BATCH, generator=g)
        eps = torch.randn((BATCH, *shape), generator=g)
        x0 = (post.mean + post.std * eps) * pipe.vae.config.scaling_factor
        sigma = shift * u / (1 + (shift - 1) * u)
        texts = [ds[i]["text"] for i in idx]
        s = sigma.view(-1, 1, 1, 1, 1)
        x_t, given = (1 - s) * x0 + s * noise, 0
        if condition is None:
            embeds, pooled, mask = pipe.encode_prompt(texts, device="cpu", max_sequence_length=256)
        else:
            first = pixels[:, :, 0]
            uint8 = ((first + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
            images = [Image.fromarray(np.asarray(f)) for f in uint8]
            embeds, pooled, mask = pipe.encode_prompt(image=images, prompt=texts, device="cpu", max_sequence_length=256,
                                                      image_embed_interleave=4 if condition == "token_replace" else 2)
            image = pipe.vae.encode(first[:, :, None]).latent_dist.mode() * pipe.vae.config.scaling_factor
            if condition == "token_replace":
                x_t, given = torch.cat([image, x_t[:, :, 1:]], dim=2), 1
            else:
                padded = torch.cat([image, torch.zeros_like(x_t[:, :, 1:])], dim=2)
                frame_mask = torch.zeros_like(x_t[:, :1])
                frame_mask[:, :, 0] = 1
                x_t = torch.cat([x_t, padded, frame_mask], dim=1)
        pred = pipe.transformer(hidden_states=x_t, timestep=sigma * 1000,
                                encoder_hidden_states=embeds, encoder_attention_mask=mask, pooled_projections=pooled,
                                guidance=torch.full((BATCH,), 1000.0), return_dict=False)[0]
    return float(((pred - (noise - x0))[:, :, given:] ** 2).mean())


def test_first_step_loss_matches_diffusers(hunyuan, runs):
    """Both runs' first loss (LoRA starts with B = 0) equals diffusers' within 1e-5 relative (fp32); the prompts
    reach the states (two captions of the batch encode differently: the template's crop leaves their tokens)."""
    import diffusers

    ref = _reference_first_loss(hunyuan)
    for kind, run in runs.items():
        assert read_metrics(run / "metrics.jsonl")[0]["loss"] == pytest.approx(ref, rel=1e-5), kind
    config = __import__("yaml").safe_load((runs["full"] / "config.yaml").read_text())
    assert (config["model"]["family"], config["model"]["objective"], config["model"]["flow_shift"]) == (
        "hunyuan_video", "flow", 7.0)
    pipe = diffusers.HunyuanVideoPipeline.from_pretrained(str(hunyuan), local_files_only=True)
    with torch.no_grad():
        embeds, _, mask = pipe.encode_prompt(["a dog runs on the grass", "a red bicycle"], device="cpu")
    assert not torch.equal(embeds[0][mask[0].bool()][-3:], embeds[1][mask[1].bool()][-3:])


def test_lora_resume_equals_uninterrupted(hunyuan, runs, tmp_path):
    """A LoRA run stopped after 2 steps and resumed to 4 logs the same 4 losses, bit for bit."""
    part = tmp_path / "part"
    assert cli.main(_argv(hunyuan, part, "--max_steps", "2", "--ckpt_every", "2", *KINDS["lora"])) == 0
    assert cli.main(["train", "--outputs", str(part), "--resume", "auto", "--max_steps", "4"]) == 0
    assert [r["loss"] for r in read_metrics(part / "metrics.jsonl")] == [
        r["loss"] for r in read_metrics(runs["lora"] / "metrics.jsonl")]


@contextlib.contextmanager
def _joint_masks(length: int):
    """The ``attn_mask`` of every SDPA call over ``length`` tokens (the joint video + text attention) meanwhile."""
    import torch.nn.functional as F

    masks, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        if (args[0] if args else kwargs["query"]).shape[-2] == length:
            masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        yield masks
    finally:
        F.scaled_dot_product_attention = sdpa


def test_export_folder_samples_like_the_pipeline(runs, tmp_path, capsys):
    """``--format diffusers`` of the full run loads in ``HunyuanVideoPipeline`` with the trained weights exactly; its
    own call at guidance 6 (embedded: one pass a step, its sigmas linear from 1 and shifted by 7) draws the video
    ``ditforge sample --cfg_scale 6`` draws from the same seed, to one uint8 level, with the prompt's padding cropped
    and the joint attention unmasked (no SDPA call over the video and the kept text tokens gets a mask)."""
    import diffusers

    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    out = tmp_path / "export"
    assert cli.main(["export", "--ckpt", str(runs["full"]), "--format", "diffusers", "--out", str(out)]) == 0
    pipe = diffusers.HunyuanVideoPipeline.from_pretrained(str(out), local_files_only=True)
    _, trained, _ = load_finetuned(*load_weights(runs["full"], use_ema=True), torch.device("cpu"))
    exported, trained = pipe.transformer.state_dict(), trained.inner.state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    prompt, npz = "a rabbit on a green hill", tmp_path / "s.npz"
    common = ["sample", "--ckpt", str(runs["full"]), "--prompt", prompt, "--num_sampling_steps", "4", "--cfg_scale",
              "6", "--out", str(tmp_path / "clip.mp4"), "--device", "cpu"]
    with torch.no_grad():
        kept = int(pipe.encode_prompt([prompt], device="cpu")[2].sum())
    with _joint_masks(8 + kept) as masks:  # 2 x 2 x 2 latent tokens + the prompt's, cropped: no mask
        assert cli.main([*common, "--save_npz", str(npz)]) == 0
    assert len(masks) == 4 * 2 and all(m is None for m in masks)  # 4 steps x (one double, one single block)
    capsys.readouterr()  # the 8-bit kernel takes heads 32, 64 or 128 wide
    assert_one_line_error(capsys, [*common, "--quantized_attention"], "--quantized_attention",
                          "HunyuanVideoTransformer3DModel's are 10")
    video = pipe(prompt=[prompt], num_inference_steps=4, guidance_scale=6.0, height=SIZE, width=SIZE,
                 num_frames=FRAMES, generator=torch.Generator("cpu").manual_seed(derive_seed(0, 0)),
                 output_type="np").frames
    assert_frames_match(npz, video, (1, FRAMES, SIZE, SIZE, 3))


def test_lora_file_loads_with_load_lora_weights(hunyuan, runs, tmp_path):
    """``--format lora``: ``HunyuanVideoPipeline.load_lora_weights`` reads the file, and its transformer then gives
    ditforge's LoRA model's output on fresh random inputs within 1e-5 of its largest magnitude, while the base
    model is off by over 100 times that."""
    import diffusers

    from ditforge.weights.read import load_weights
    from ditforge.weights.finetuned import load_finetuned

    out = tmp_path / "lora"
    assert cli.main(["export", "--ckpt", str(runs["lora"]), "--format", "lora", "--out", str(out)]) == 0
    pipe = diffusers.HunyuanVideoPipeline.from_pretrained(str(hunyuan), local_files_only=True)
    g = torch.Generator().manual_seed(1234)
    x, t = torch.randn(2, 4, 2, 2, 2, generator=g), torch.rand(2, generator=g) * 1000
    states, pooled = torch.randn(2, 256, 16, generator=g), torch.randn(2, 8, generator=g)
    mask = torch.arange(256).expand(2, 256) < torch.tensor([[7], [20]])
    guidance = torch.full((2,), 1000.0)
    _, ours, _ = load_finetuned(*load_weights(runs["lora"], use_ema=True), torch.device("cpu"))

    def call(model):
        with torch.no_grad():
            return model(hidden_states=x, timestep=t, encoder_hidden_states=states, encoder_attention_mask=mask,
                         pooled_projections=pooled, guidance=guidance, return_dict=False)[0]

    base = call(pipe.transformer)
    pipe.load_lora_weights(str(out))
    theirs = call(pipe.transformer)
    with torch.no_grad():
        mine = ours.denoise(x, t, states, mask, pooled)
    tol = 1e-5 * mine.abs().max()
    assert (theirs - mine).abs().max() <= tol
    assert (base - mine).abs().max() > 100 * tol


@pytest.mark.parametrize("family, condition, kind, guidance, returned", [
    ("hunyuan_video_i2v", "token_replace", "full", 6.0, FRAMES),
    ("hunyuan_video_i2v_33ch", "latent_concat", "lora", 1.0, FRAMES - 4)])
def test_image_to_video_first_loss_and_sample(family, condition, kind, guidance, returned, tmp_path, monkeypatch):
    """``HunyuanVideoImageToVideoPipeline``, both transformers: a run's first loss (full for HunyuanVideo-I2V, LoRA
    for the 33-channel model) equals ``_reference_first_loss``'s image-to-video form (1e-5 relative), whose Llava
    states carry the image (two first frames give two encodings of one prompt); and ``ditforge sample --image`` of
    the run draws what the exported pipeline's own call draws from the same seed (guidance embedded at 6 / none),
    frames within one uint8 level, the 33-channel model's first latent frame's 4 dropped as its pipeline drops
    them. The tiny videos barely depend on the image, so its two uses are checked on their own: the loop's start
    equals ``prepare_latents``' (0.999 noise + 0.001 image latents, 1e-6), and the sampled prompt is encoded with
    the given image; a batch of a prompt longer than the 256 tokens and a short one encodes as each alone."""
    import diffusers
    import numpy as np
    from PIL import Image

    from ditforge.models.adapters.hunyuan import HunyuanVideoI2VDenoiser

    folder = BUILDERS[family](tmp_path / "pipe")
    run = tmp_path / "run"
    assert cli.main(_argv(folder, run, "--max_steps", "1", *KINDS[kind])) == 0
    assert read_metrics(run / "metrics.jsonl")[0]["loss"] == pytest.approx(_reference_first_loss(folder, condition),
                                                                           rel=1e-5)
    pipe = diffusers.HunyuanVideoImageToVideoPipeline.from_pretrained(str(folder), local_files_only=True)
    with torch.no_grad():
        embeds = [pipe.encode_prompt(image=[Image.new("RGB", (16, 16), color)], prompt=["a red bicycle"],
                                     device="cpu")[0] for color in ((0, 0, 0), (200, 30, 90))]
    assert not torch.allclose(*embeds)
    images = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
              for i in range(2)]
    first = pipe.video_processor.preprocess(images[0], SIZE, SIZE)
    with torch.no_grad():
        start, _ = pipe.prepare_latents(first, 1, 4, SIZE, SIZE, FRAMES, torch.float32, "cpu",
                                        torch.Generator().manual_seed(5), None, condition)
        noise = torch.randn(start.shape, generator=torch.Generator().manual_seed(5))
        ours = HunyuanVideoI2VDenoiser.start(noise, HunyuanVideoI2VDenoiser.encode_image(pipe, first, FRAMES))
        torch.testing.assert_close(ours, start, rtol=0, atol=1e-6)
        texts = [" ".join(["a dog runs on the grass"] * 60), "a red bicycle"]  # 360 words, and 3
        both = HunyuanVideoI2VDenoiser.encode_prompt(pipe, texts, "cpu", images=images)
        for i in range(2):
            alone = HunyuanVideoI2VDenoiser.encode_prompt(pipe, texts[i:i + 1], "cpu", images=images[i:i + 1])
            assert all(torch.equal(both[k][i], alone[k][0]) for k in alone)
    seen = []
    encode = HunyuanVideoI2VDenoiser.encode_prompt
    monkeypatch.setattr(HunyuanVideoI2VDenoiser, "encode_prompt",
                        staticmethod(lambda p, texts, device, images=None: seen.append(images) or encode(
                            p, texts, device, images=images)))
    assert_image_to_video_run_samples_like_its_export(run, tmp_path, "HunyuanVideoImageToVideoPipeline", SIZE, FRAMES,
                                                      guidance, returned)
    png = np.asarray(Image.open(tmp_path / "first.png").convert("RGB"))  # the helper's first frame
    given = [i for i in seen if i is not None]
    assert len(given) == 1 and np.array_equal(np.asarray(given[0][0]), png)


def test_sampling_crops_the_text_padding_and_drops_full_masks(monkeypatch):
    """``trim_padding`` crops the text states past the last kept token, and with the masks then full the joint
    attention runs without one (``unmask_full_attention``): the output of a HunyuanVideo transformer with heads 32
    wide on fresh random latents equals its output with the padded, masked states (1e-5 of its largest magnitude,
    fp32), and no joint SDPA call (over the video and text tokens; the token refiner's over the text alone calls
    PyTorch itself) gets a mask. Routed as ``--quantized_attention`` routes (here to exact attention), the two joint
    calls (one double-, one single-stream block) reach the route with the cropped token count, the output unchanged.
    With two rows of different lengths the masks stay (not full) and nothing is routed."""
    import torch.nn.functional as F
    from diffusers import HunyuanVideoTransformer3DModel

    from ditforge.models.adapters.dispatch import route_self_attention, unmask_full_attention
    from ditforge.models.adapters.hunyuan import HunyuanVideoDenoiser

    torch.manual_seed(0)
    denoiser = HunyuanVideoDenoiser(HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
        rope_axes_dim=(8, 12, 12)).eval())
    g = torch.Generator().manual_seed(7)
    x, t = torch.randn(1, 4, 2, 2, 2, generator=g), torch.rand(1, generator=g) * 1000
    mask = torch.arange(256)[None] < 9
    cond = {"encoder_hidden_states": torch.randn(1, 256, 16, generator=g), "encoder_attention_mask": mask,
            "pooled_projections": torch.randn(1, 8, generator=g)}
    masks, routed, sdpa = [], [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        if (args[0] if args else kwargs["query"]).shape[-2] in (8 + 256, 8 + 9):  # joint: 8 video + the text tokens
            masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    def exact(q, k, v, scale=None):
        routed.append(q.shape)
        return sdpa(*(a.transpose(1, 2) for a in (q, k, v)), scale=scale).transpose(1, 2)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        padded = denoiser.denoise(x, t, **cond)
        assert len(masks) == 2 and all(m is not None for m in masks)
        trimmed, full = denoiser.trim_padding(cond)
        assert full and trimmed["encoder_hidden_states"].shape[1] == 9
        markers = unmask_full_attention(denoiser.inner)
        for marker in markers:
            marker.full = full
        masks.clear()
        out = denoiser.denoise(x, t, **trimmed)
        assert len(markers) == 2 and masks == [None, None]
        assert (out - padded).abs().max() <= 1e-5 * padded.abs().max()
        assert route_self_attention(denoiser.inner, exact, (32,)) == 2
        masks.clear()
        out = denoiser.denoise(x, t, **trimmed)
        assert routed == [torch.Size([1, 8 + 9, 2, 32])] * 2 and masks == []
        assert (out - padded).abs().max() <= 1e-5 * padded.abs().max()
        two = {k: torch.cat([v, v]) for k, v in cond.items()}
        two["encoder_attention_mask"] = torch.cat([mask, torch.arange(256)[None] < 4])
        trimmed, full = denoiser.trim_padding(two)
        assert not full and trimmed["encoder_hidden_states"].shape[1] == 9
        for marker in markers:
            marker.full = full
        routed.clear()
        denoiser.denoise(torch.cat([x, x]), torch.cat([t, t]), **trimmed)
        assert routed == [] and len(masks) == 2 and all(m is not None for m in masks)

