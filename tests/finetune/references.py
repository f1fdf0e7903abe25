"""Step 0's loss of a fine-tuning run of each video family (``families.VIDEO``), written out from diffusers'
pieces (the family's pipeline, VAE, scheduler and transformer) with the step's draws in ditforge's order: what the
first-step tests of ``test_video_families.py`` and of the families' own modules compare a run's first loss with."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ditforge.data import build_dataset
from ditforge.data.sampler import GlobalBatchSampler, derive_seed
from families import I2V, VIDEO


def _first_batch(data: str, size: int, frames: int, interval: int, batch: int) -> list[dict]:
    """The items of a run's first batch (``GlobalBatchSampler``, seed 0) of ``build_dataset(data, ...)``."""
    ds = build_dataset(data, size, None, frames, interval, 0)
    return [ds[i] for i in GlobalBatchSampler(len(ds), batch, 0, 0, 1, 0).global_batch_indices(0).tolist()]


def as_pil(frames: torch.Tensor) -> list:
    """(B, 3, H, W) in [-1, 1] -> B uint8 PIL images (a decoded frame's bytes back)."""
    from PIL import Image

    pixels = ((frames + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(p) for p in pixels]


def _geometry(family: str) -> tuple[int, int, int, int]:
    """(pixels, frames, frame interval, batch) of the family's runs (a ``VIDEO`` or an ``I2V`` row)."""
    spec = VIDEO[family] if family in VIDEO else I2V[family]
    return spec.size, spec.frames, spec.interval, spec.batch


def flow_draws(post, step: int = 0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A flow run's draws of ``step`` in ditforge's order from ``derive_seed(seed, step)``, for a batch of VAE
    posteriors ``post`` (mean (B, C, T', h, w)): noise like the latents, logit-normal u (mean 0, std 1) of shape
    (B,), the caption drop and flip (drawn, unused here), and the posterior's eps like the latents."""
    batch, shape = post.mean.shape[0], tuple(post.mean.shape[1:])
    g = torch.Generator().manual_seed(derive_seed(seed, step))
    noise = torch.randn((batch, *shape), generator=g)
    u = torch.sigmoid(torch.randn(batch, generator=g))
    torch.rand(batch, generator=g), torch.rand(batch, generator=g)
    return noise, u, torch.randn((batch, *shape), generator=g)


def step0_latents(pipe, pixels: torch.Tensor, shift: float, step: int = 0, seed: int = 0):
    """Step 0's (or ``step``'s) latents from diffusers' pieces: ``pixels`` (B, 3, T, H, W) through
    ``AutoencoderKLWan``'s posterior, with the step's draws in ditforge's order from ``derive_seed(seed, step)`` (noise,
    logit-normal u, caption drop, flip, posterior eps), normalised as ``WanPipeline`` un-normalises before decoding
    (``latents / (1 / latents_std) + latents_mean``, inverted). Returns (x0, noise, sigma = shift u / (1 + (shift -
    1) u), mean, inv_std), the last two (1, C, 1, 1, 1)."""
    post = pipe.vae.encode(pixels).latent_dist
    noise, u, eps = flow_draws(post, step, seed)
    view = (1, pipe.vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(view)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(view)
    return (post.mean + post.std * eps - mean) * inv_std, noise, shift * u / (1 + (shift - 1) * u), mean, inv_std


def wan_first_loss(folder: Path, size: int = 16) -> float:
    """Step 0's loss from diffusers' pieces: the clips of the run's first batch (``GlobalBatchSampler``, seed 0)
    through ``AutoencoderKLWan``'s posterior, normalised as ``WanPipeline`` un-normalises before decoding
    (``latents / (1 / latents_std) + latents_mean``, inverted); the UMT5 states of ``pipe.encode_prompt`` at the
    call's ``max_sequence_length`` (512); the step's random draws in ditforge's order (noise, logit-normal u, drop,
    flip, posterior eps) from ``derive_seed(0, 0)``; sigma = shift u / (1 + (shift - 1) u) with the scheduler's
    ``flow_shift`` (checked here against ``UniPCMultistepScheduler``'s own flow sigmas); x_t = (1 - sigma) x0 +
    sigma noise, target noise - x0, ``pipe.transformer`` called directly at timestep 1000 sigma (Wan 2.2 TI2V,
    ``expand_timesteps``: repeated for each token, as ``WanPipeline.__call__`` feeds it); MSE in float32."""
    _, FRAMES, INTERVAL, BATCH = _geometry("wan")
    import diffusers

    pipe = diffusers.WanPipeline.from_pretrained(str(folder), local_files_only=True)
    items = _first_batch("clips", size, FRAMES, INTERVAL, BATCH)
    return wan_loss(pipe, torch.stack([it["video"] for it in items]), [it["text"] for it in items])


def wan_loss(pipe, pixels: torch.Tensor, texts: list[str], step: int = 0, seed: int = 0) -> float:
    """``wan_first_loss``'s arithmetic on a batch of clips ``pixels`` (B, 3, T, H, W) in [-1, 1] (any T, H, W: a
    bucket's) captioned ``texts``, with the draws of ``step`` of a run of ``seed``."""
    sched = dict(pipe.scheduler.config)
    shift, n_train = float(sched["flow_shift"]), int(sched["num_train_timesteps"])
    # The shift map is the scheduler's: its flow sigmas for 10 steps are the shifted linear grid (float32; the
    # first, 1, is moved 1e-6 down by the scheduler, so it is left out).
    pipe.scheduler.set_timesteps(10)
    u_grid = np.linspace(1, 1 / n_train, 11)[1:-1]
    np.testing.assert_allclose(pipe.scheduler.sigmas[1:-1].numpy(), shift * u_grid / (1 + (shift - 1) * u_grid),
                               rtol=1e-6)
    with torch.no_grad():
        x0, noise, sigma, *_ = step0_latents(pipe, pixels, shift, step, seed)
        embeds, _ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, device="cpu", max_sequence_length=512)
        s = sigma.view(-1, 1, 1, 1, 1)
        timestep = sigma * n_train
        if pipe.config.get("expand_timesteps"):  # the 1 x 2 x 2 patches' tokens: T' x h / 2 x w / 2
            timestep = timestep[:, None].expand(-1, x0.shape[2] * (x0.shape[3] // 2) * (x0.shape[4] // 2))
        pred = pipe.transformer(hidden_states=(1 - s) * x0 + s * noise, timestep=timestep,
                                encoder_hidden_states=embeds, return_dict=False)[0]
    return float(torch.nn.functional.mse_loss(pred.float(), (noise - x0).float()))


def wan_i2v_first_loss(folder: Path, size: int = 16, data: str = "clips") -> float:
    """Step 0's loss of an image-to-video run from diffusers' pieces (``WanImageToVideoPipeline``,
    ``pipeline_wan_i2v.py``) at ``size`` pixels on ``data``: the noisy latents as ``wan_first_loss``'s
    (``step0_latents``), the UMT5 states of ``pipe.encode_prompt`` (512 tokens), and the first frame (a CSV row's
    ``image`` where it has one, else the clip's) as the pipeline conditions on it, checked against its own
    ``prepare_latents`` first (1e-6):

    - Wan 2.1 (no ``expand_timesteps``): the frame as a clip [frame, T - 1 zero frames] through
      ``AutoencoderKLWan``'s posterior mode, normalised; the mask, 1 on the first latent frame's 4 channels and 0
      after; both concatenated on the channels after the noisy latents (16 + 4 + 16 = 36); the CLIP vision model's
      second-to-last hidden states of the frame as uint8 images through ``image_processor``; MSE over all frames.
    - Wan 2.2 TI2V-5B (``expand_timesteps``): the frame alone through the posterior mode, normalised, in place of
      the noisy first latent frame, its tokens at timestep 0 and the others' at 1000 sigma (1 x 2 x 2 patches);
      MSE over the other frames.

    float32."""
    _, FRAMES, INTERVAL, BATCH = _geometry("wan")
    import diffusers

    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(str(folder), local_files_only=True)
    shift, n_train = float(pipe.scheduler.config.flow_shift), int(pipe.scheduler.config.num_train_timesteps)
    items = _first_batch(data, size, FRAMES, INTERVAL, BATCH)
    pixels = torch.stack([it["video"] for it in items])
    first = torch.stack([it.get("image", it["video"][:, 0]) for it in items])
    channels, expand = pipe.vae.config.z_dim, pipe.config.get("expand_timesteps")
    with torch.no_grad():
        x0, noise, sigma, mean, inv_std = step0_latents(pipe, pixels, shift)
        s = sigma.view(-1, 1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * noise
        embeds, _ = pipe.encode_prompt([it["text"] for it in items], do_classifier_free_guidance=False, device="cpu",
                                       max_sequence_length=512)
        if expand:
            condition = (pipe.vae.encode(first[:, :, None]).latent_dist.mode() - mean) * inv_std
        else:
            clip = torch.cat([first[:, :, None], torch.zeros(BATCH, 3, FRAMES - 1, size, size)], dim=2)
            latent_condition = (pipe.vae.encode(clip).latent_dist.mode() - mean) * inv_std
            mask = torch.zeros(BATCH, 4, *latent_condition.shape[2:])
            mask[:, :, 0] = 1
            condition = torch.cat([mask, latent_condition], dim=1)
        for row in range(BATCH):  # the pipeline's own conditioning of that image
            theirs = pipe.prepare_latents(first[row:row + 1], 1, channels, size, size, FRAMES, torch.float32, "cpu")[1]
            torch.testing.assert_close(theirs, condition[row:row + 1], rtol=0, atol=1e-6)
        if expand:
            hidden = torch.cat([condition, x_t[:, :, 1:]], dim=2)
            per_frame = (hidden.shape[3] // 2) * (hidden.shape[4] // 2)
            timestep = torch.cat([torch.zeros(BATCH, per_frame),
                                  (sigma * n_train)[:, None].expand(-1, (hidden.shape[2] - 1) * per_frame)], dim=1)
            pred = pipe.transformer(hidden_states=hidden, timestep=timestep, encoder_hidden_states=embeds,
                                    return_dict=False)[0]
            return float(torch.nn.functional.mse_loss(pred[:, :, 1:], (noise - x0)[:, :, 1:]))
        processed = pipe.image_processor(images=as_pil(first), return_tensors="pt")
        image_states = pipe.image_encoder(**processed, output_hidden_states=True).hidden_states[-2]
        pred = pipe.transformer(hidden_states=torch.cat([x_t, condition], dim=1), timestep=sigma * n_train,
                                encoder_hidden_states=embeds, encoder_hidden_states_image=image_states,
                                return_dict=False)[0]
    return float(torch.nn.functional.mse_loss(pred.float(), (noise - x0).float()))


def cogvideox_first_loss(folder: Path, max_sequence_length: int = 226) -> float:
    """Step 0's loss as diffusers' ``examples/cogvideo/train_cogvideox_lora.py`` computes it: the clips of the run's
    first batch (``GlobalBatchSampler``, seed 0) through ``AutoencoderKLCogVideoX``'s posterior times its
    ``scaling_factor``, frames first; the T5 states of ``pipe.encode_prompt`` (``max_sequence_length`` tokens, the
    call's default 226 unless given: a transformer of another ``max_text_seq_length`` needs its own); the step's draws
    in ditforge's order from ``derive_seed(0, 0)`` (noise, integer timesteps in [0, 1000), drop, flip, posterior eps);
    ``scheduler.add_noise``, the transformer with the pipeline's rotary positions, ``scheduler.get_velocity``
    of its output (the x0 estimate) against x0 weighted by 1 / (1 - abar_t); float32."""
    SIZE, FRAMES, INTERVAL, BATCH = _geometry("cogvideox")
    import diffusers

    pipe = diffusers.CogVideoXPipeline.from_pretrained(str(folder), local_files_only=True)
    items = _first_batch("clips", SIZE, FRAMES, INTERVAL, BATCH)
    return cogvideox_loss(pipe, torch.stack([it["video"] for it in items]), [it["text"] for it in items],
                          max_sequence_length=max_sequence_length)


def cogvideox_loss(pipe, pixels: torch.Tensor, texts: list[str], step: int = 0, seed: int = 0,
                   max_sequence_length: int = 226) -> float:
    """``cogvideox_first_loss``'s arithmetic on a batch of clips ``pixels`` (B, 3, T, H, W) in [-1, 1] (any T, H, W: a
    bucket's; the rotary positions of H x W, for a transformer with them) captioned ``texts``, with the draws of
    ``step`` of a run of ``seed``."""
    BATCH, (height, width) = len(pixels), pixels.shape[3:]
    with torch.no_grad():
        post = pipe.vae.encode(pixels).latent_dist
        g = torch.Generator().manual_seed(derive_seed(seed, step))
        shape = tuple(post.mean.shape[1:])
        noise = torch.randn((BATCH, *shape), generator=g)
        t = torch.randint(0, 1000, (BATCH,), generator=g)
        torch.rand(BATCH, generator=g), torch.rand(BATCH, generator=g)  # caption drop, flip: unused here
        eps = torch.randn((BATCH, *shape), generator=g)
        x0 = ((post.mean + post.std * eps) * pipe.vae.config.scaling_factor).transpose(1, 2)  # (B, T', C, h, w)
        noise = noise.transpose(1, 2)
        embeds, _ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, device="cpu",
                                       max_sequence_length=max_sequence_length)
        noisy = pipe.scheduler.add_noise(x0, noise, t)
        rotary = (pipe._prepare_rotary_positional_embeddings(height, width, x0.shape[1], torch.device("cpu"))
                  if pipe.transformer.config.use_rotary_positional_embeddings else None)  # 2B: sinusoidal, no rotary
        out = pipe.transformer(hidden_states=noisy, encoder_hidden_states=embeds, timestep=t,
                               image_rotary_emb=rotary, return_dict=False)[0]
        pred = pipe.scheduler.get_velocity(out, noisy, t)
        weights = (1 / (1 - pipe.scheduler.alphas_cumprod[t])).view(-1, 1, 1, 1, 1)
    return float((weights * (pred - x0) ** 2).reshape(BATCH, -1).mean(1).mean())


def cogvideox_i2v_first_loss(folder: Path, noised_image_input: bool = True) -> float:
    """Step 0's loss of an image-to-video run (``CogVideoXImageToVideoPipeline``): ``cogvideox_first_loss``'s noisy
    latents and T5 states, and the pipeline's conditioning written out: the first frame's latents times
    ``scaling_factor``, T' - 1 zero latent frames after it, concatenated to the noisy latents along the channels;
    the transformer's output against ``get_velocity(x0, noise, t)`` (sqrt(abar) noise - sqrt(1 - abar) x0),
    float32. ``noised_image_input`` (the default of a run): CogVideoX's training noise on the frame, sigma_i =
    exp(-3 + 0.5 z_i) of pixel noise, then a posterior draw, from sample i's own seed ``derive_seed(seed, 7919, step,
    i)``; else the clean frame's posterior mode (``--no-noised_image_input``)."""
    return _cogvideox_i2v_first_losses(folder)[noised_image_input]


@functools.cache  # both forms in one pass: the shared suite asks for one, test_cogvideox.py for the other
def _cogvideox_i2v_first_losses(folder: Path) -> dict[bool, float]:
    """{noised_image_input: the first loss} of ``cogvideox_i2v_first_loss``."""
    SIZE, FRAMES, INTERVAL, BATCH = _geometry("cogvideox_i2v")
    import diffusers

    pipe = diffusers.CogVideoXImageToVideoPipeline.from_pretrained(str(folder), local_files_only=True)
    items = _first_batch("clips", SIZE, FRAMES, INTERVAL, BATCH)
    pixels = torch.stack([it["video"] for it in items])
    with torch.no_grad():
        post = pipe.vae.encode(pixels).latent_dist
        g = torch.Generator().manual_seed(derive_seed(0, 0))
        shape = tuple(post.mean.shape[1:])
        noise = torch.randn((BATCH, *shape), generator=g).transpose(1, 2)
        t = torch.randint(0, 1000, (BATCH,), generator=g)
        torch.rand(BATCH, generator=g), torch.rand(BATCH, generator=g)  # caption drop, flip: unused here
        eps = torch.randn((BATCH, *shape), generator=g)
        scale = pipe.vae.config.scaling_factor
        x0 = ((post.mean + post.std * eps) * scale).transpose(1, 2)
        embeds, _ = pipe.encode_prompt([it["text"] for it in items], do_classifier_free_guidance=False,
                                       device="cpu", max_sequence_length=226)
        noisy = pipe.scheduler.add_noise(x0, noise, t)
        rotary = pipe._prepare_rotary_positional_embeddings(SIZE, SIZE, x0.shape[1], torch.device("cpu"))
        v = pipe.scheduler.get_velocity(x0, noise, t)

        def loss(image):  # the first frame's latents (B, C, 1, h, w); zero frames after it
            image = image.transpose(1, 2) * scale
            image = torch.cat([image, image.new_zeros(BATCH, x0.shape[1] - 1, *image.shape[2:])], dim=1)
            out = pipe.transformer(hidden_states=torch.cat([noisy, image], dim=2), encoder_hidden_states=embeds,
                                   timestep=t, image_rotary_emb=rotary, return_dict=False)[0]
            return float(((out - v) ** 2).mean())

        gens = [torch.Generator().manual_seed(derive_seed(0, 7919, 0, i)) for i in range(BATCH)]
        sigma = torch.stack([(-3 + 0.5 * torch.randn(1, generator=g)).exp() for g in gens])
        frames = pixels[:, :, 0] + sigma.view(-1, 1, 1, 1) * torch.stack(
            [torch.randn(3, SIZE, SIZE, generator=g) for g in gens])
        dist = pipe.vae.encode(frames[:, :, None]).latent_dist
        draw = dist.mean + dist.std * torch.stack([torch.randn(dist.mean.shape[1:], generator=g) for g in gens])
        return {True: loss(draw), False: loss(pipe.vae.encode(pixels[:, :, :1]).latent_dist.mode())}

def ltx_first_loss(folder: Path, image_to_video: bool = False) -> tuple[float, float]:
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
    SIZE, FRAMES, INTERVAL, BATCH = _geometry("ltx")
    import diffusers

    cls = diffusers.LTXImageToVideoPipeline if image_to_video else diffusers.LTXPipeline
    pipe = cls.from_pretrained(str(folder), local_files_only=True)
    items = _first_batch("clips", SIZE, FRAMES, INTERVAL, BATCH)
    return ltx_loss(pipe, torch.stack([it["video"] for it in items]), [it["text"] for it in items],
                    image_to_video=image_to_video)


def ltx_loss(pipe, pixels: torch.Tensor, texts: list[str], step: int = 0, seed: int = 0,
             image_to_video: bool = False) -> tuple[float, float]:
    """``ltx_first_loss``'s arithmetic and shift on a batch of clips ``pixels`` (B, 3, T, H, W) in [-1, 1] (any T,
    H, W: a bucket's, whose latent frames x height x width the dynamic shift follows) captioned ``texts``, with the
    draws of ``step`` of a run of ``seed``; ``pipe`` an ``LTXImageToVideoPipeline`` for ``image_to_video``."""
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    BATCH, config = len(pixels), pipe.scheduler.config
    with torch.no_grad():
        post = pipe.vae.encode(pixels).latent_dist
        noise, u, eps = flow_draws(post, step, seed)
        x0 = pipe._normalize_latents(post.mean + post.std * eps, pipe.vae.latents_mean, pipe.vae.latents_std,
                                     pipe.vae.config.scaling_factor)
        frames, h, w = x0.shape[2:]
        shift = math.exp(calculate_shift(frames * h * w, config.base_image_seq_len, config.max_image_seq_len,
                                         config.base_shift, config.max_shift))
        sigma = (shift * u / (1 + (shift - 1) * u)).view(-1, 1, 1, 1, 1)
        embeds, mask, _, _ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, device="cpu",
                                                max_sequence_length=128)
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


def hunyuan_video_first_loss(folder: Path, condition: str | None = None) -> float:
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
    SIZE, FRAMES, INTERVAL, BATCH = _geometry("hunyuan_video")
    import diffusers

    cls = diffusers.HunyuanVideoPipeline if condition is None else diffusers.HunyuanVideoImageToVideoPipeline
    pipe = cls.from_pretrained(str(folder), local_files_only=True)
    shift = float(pipe.scheduler.config.shift)
    assert shift == 7.0
    pipe.scheduler.set_timesteps(sigmas=[0.5])
    assert float(pipe.scheduler.sigmas[0]) == pytest.approx(shift * 0.5 / (1 + (shift - 1) * 0.5), rel=1e-6)
    items = _first_batch("clips", SIZE, FRAMES, INTERVAL, BATCH)
    pixels = torch.stack([it["video"] for it in items])
    with torch.no_grad():
        post = pipe.vae.encode(pixels).latent_dist
        noise, u, eps = flow_draws(post)
        x0 = (post.mean + post.std * eps) * pipe.vae.config.scaling_factor
        sigma = shift * u / (1 + (shift - 1) * u)
        texts = [it["text"] for it in items]
        s = sigma.view(-1, 1, 1, 1, 1)
        x_t, given = (1 - s) * x0 + s * noise, 0
        if condition is None:
            embeds, pooled, mask = pipe.encode_prompt(texts, device="cpu", max_sequence_length=256)
        else:
            first = pixels[:, :, 0]
            embeds, pooled, mask = pipe.encode_prompt(image=as_pil(first), prompt=texts, device="cpu", max_sequence_length=256,
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


def first_loss(family: str, folder: Path) -> tuple[float, dict]:
    """The family's reference first loss of its pipeline ``folder``, and what the run's ``config.yaml`` must hold
    beyond ``VIDEO[family].config`` (LTX-Video: the dynamic shift at the run's latent size, 1e-12 relative)."""
    if family == "ltx":
        loss, shift = ltx_first_loss(folder)
        return loss, {"model.flow_shift": pytest.approx(shift, rel=1e-12)}
    return {"wan": wan_first_loss, "cogvideox": cogvideox_first_loss,
            "hunyuan_video": hunyuan_video_first_loss}[family](folder), {}


def image_to_video_first_loss(name: str, folder: Path) -> float:
    """The reference first loss of the run of the image-to-video row ``I2V[name]`` from its pipeline ``folder`` (a
    LoRA run's first step is the base model's: B = 0)."""
    return {"wan_i2v": lambda: wan_i2v_first_loss(folder, I2V[name].size),
            "wan22_ti2v_i2v": lambda: wan_i2v_first_loss(folder, I2V[name].size),
            "cogvideox_i2v": lambda: cogvideox_i2v_first_loss(folder),
            "ltx_i2v": lambda: ltx_first_loss(folder, image_to_video=True)[0],
            "hunyuan_video_i2v": lambda: hunyuan_video_first_loss(folder, "token_replace"),
            "hunyuan_video_i2v_33ch": lambda: hunyuan_video_first_loss(folder, "latent_concat")}[name]()
