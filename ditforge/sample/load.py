"""What ``ditforge sample`` reads before it draws: its settings (``SampleConfig``), the prompts, a checkpoint as
a model (``load_model``), the run's VAE and text encoder, and a reference-image family's control inputs
(``read_control``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ditforge.config.values import resolve_precision
from ditforge.encoders.vae import VAE, IdentityVAE, load_vae
from ditforge.data.captions import read_prompts  # noqa: F401  (sample's reader of --prompt / --prompt_file)
from ditforge.errors import UserError
from ditforge.models import create_model_from_spec, infer_dit_config, is_video_model
from ditforge.weights.read import load_weights, read_checkpoint_weights


# Keys of a run config's "model" section that older configs lack, and what they meant then.
SPEC_DEFAULTS = dict(condition="class", text_encoder=None, text_max_length=None, vae="none", qk_norm=False,
                     num_frames=None, text_dim=None, class_dropout_prob=0.1)


@dataclass
class SampleConfig:
    """Settings of ``ditforge sample`` (see ``ditforge sample --help``).

    ``prompt`` / ``prompt_file`` are for text-conditioned models, ``class_labels`` / ``num_samples`` for class
    models. ``image_size`` is the output side in pixels (the model's input size is ``image_size`` / the VAE's
    downsample factor); ``num_frames`` overrides a video model's (latent) frame count. ``out`` defaults to
    ``samples.png`` (image models: a PNG grid) or ``samples`` (video models: a folder of MP4s and GIFs; a fine-tuned
    video pipeline also takes a video file name for one prompt). ``image`` is the first frame of an image-to-video
    pipeline (an adapter with ``image_to_video``), refused by other models; ``reference_image`` (paths), ``video``
    and ``mask`` (a clip; the mask a clip or an image) those of a reference-image pipeline (``takes_references``).
    Speed: ``mixed_precision`` (auto: bf16 on CUDA), ``compile``, ``enable_*`` as ``prepare_model``; ``pab`` turns
    on Pyramid Attention Broadcast with ``PABConfig``'s defaults, ``fora`` FORA's static caching with that interval
    (``PABConfig.fora``); they change the samples (docs/sampling.md: their PSNR / SSIM).
    """

    ckpt: str
    model: str | None = None
    image_size: int | None = None
    class_labels: list[int] | None = None
    num_samples: int | None = None
    prompt: list[str] | None = None
    prompt_file: str | None = None
    image: str | None = None
    reference_image: list[str] | None = None  # reference-image pipelines (takes_references), with video / mask
    video: str | None = None
    mask: str | None = None
    # a driven pipeline's (``driving_videos``) videos and mode, named as its call's arguments
    pose_video: str | None = None
    face_video: str | None = None
    background_video: str | None = None
    mask_video: str | None = None
    mode: str | None = None
    segment_frame_length: int | None = None
    num_frames: int | None = None
    cfg_scale: float | None = None
    num_sampling_steps: int | None = None
    sampler: str | None = None
    eta: float = 0.0
    seed: int = 0
    batch_size: int = 256
    out: str | None = None
    save_npz: str | None = None
    fps: int | None = None
    vae: str | None = None
    transformer: str | None = None  # single files replacing a pipeline folder's components (single_file.COMPONENTS)
    transformer_2: str | None = None
    text_encoder: str | None = None
    use_ema: bool = True
    device: str = "auto"
    sequence_parallel_size: int = 1
    sequence_parallel_type: str = "auto"
    mixed_precision: str = "auto"
    compile: str = "none"
    enable_flashattn: bool = False
    enable_modulate_kernel: bool = False
    enable_layernorm_kernel: bool = False
    guidance_channels: int | None = None
    cfg_interval: tuple[int, int] | None = None
    pab: bool = False
    fora: int | None = None
    cfg_parallel: bool = False
    height: int | None = None
    width: int | None = None
    negative_prompt: str | None = None
    first_block_cache: float | None = None
    taylorseer_cache: int | None = None
    quantized_attention: bool | None = None  # video pipelines: None when not given (VIDEO_LOOP_FLAGS)
    gif: bool = False
    vae_tile: int | None = None
    vae_parallel: str | None = None  # video pipelines under torchrun: patch (exact, the default) or strips
    vae_dtype: str | None = None  # video pipelines: VAE_DTYPES; None keeps the VAE as loaded (float32)
    lora: str | None = None
    cfg_scale_2: float | None = None
    plugin: str | None = None  # video pipelines: fsdp shards the transformer over the torchrun processes


# SampleConfig fields only the video pipelines' loop (``sample.video``) reads; other models refuse them in one line.
VIDEO_LOOP_FLAGS = ("height", "width", "negative_prompt", "first_block_cache", "taylorseer_cache",
                    "quantized_attention", "vae_tile", "vae_parallel", "vae_dtype", "cfg_scale_2", "plugin",
                    "reference_image", "video", "mask")


def read_spec(ckpt: str, use_ema: bool) -> tuple[dict | Path, dict]:
    """(weights or DCP folder, model settings with ``SPEC_DEFAULTS`` filled in and ``run_config``)."""
    state, config = load_weights(ckpt, use_ema)
    if config is None and isinstance(state, Path):
        raise UserError(f"--ckpt {ckpt}: the checkpoint's meta.json has no config")
    spec = dict(config["model"]) if config else infer_dit_config(state)
    for key, value in SPEC_DEFAULTS.items():
        if spec.get(key) is None:
            spec[key] = value
    spec["run_config"] = config
    return state, spec


def build_model(ckpt: str, state: dict | Path, spec: dict, use_ema: bool,
                rebuild_fixed: bool = False) -> torch.nn.Module:
    """The model ``spec`` describes, with the checkpoint's weights (strict). ``rebuild_fixed``: keep the model's
    own values of its untrained parameters (the fixed sin-cos position embeddings, ``requires_grad=False``)
    instead of the checkpoint's, which were computed for another token grid."""
    model = create_model_from_spec(spec)
    config = spec.get("run_config") or {}
    if config.get("model", {}).get("lora_rank"):  # a DiT LoRA run: its base weights come from its --init_from
        from ditforge.weights.finetuned import load_dit_lora

        return load_dit_lora(model, config, state, use_ema).eval()
    own = model.state_dict()
    fixed = {k for k, p in model.named_parameters() if not p.requires_grad} if rebuild_fixed else set()
    if isinstance(state, Path):  # a DCP checkpoint folder: read its (gathered) tensors into this model's shapes
        state = read_checkpoint_weights(state, {k: v for k, v in own.items() if k not in fixed}, use_ema)
    state = {**{k: v for k, v in state.items() if k not in fixed}, **{k: own[k] for k in fixed}}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        detail = " ".join(str(e).split())[:300]
        frames = f", {spec['num_frames']} frames" if spec["num_frames"] is not None else ""
        raise UserError(f"--ckpt {ckpt}: weights do not fit {spec['model']} at input size "
                        f"{spec['input_size']}{frames} ({detail})") from None
    return model.eval()


def load_model(ckpt: str, model_name: str | None = None, input_size: int | None = None, use_ema: bool = True,
               num_frames: int | None = None):
    """Build the model a checkpoint was trained as and load its weights (strict).

    ``ckpt`` is anything ``load_weights`` accepts. Model, size, frames and conditioning come from the saved config
    (older configs lack some keys: ``SPEC_DEFAULTS`` fills them: class conditioning, no VAE, no QK-norm), or, for
    an official DiT .pt, from the tensor shapes. ``model_name`` / ``input_size`` (the model's spatial input, in
    latent pixels) / ``num_frames`` (a video model's latent frames) override them; a new size or frame count
    rebuilds the fixed sin-cos position embeddings for the new token grid (they are not learned; all other weights
    are independent of the grid).

    Returns:
        (model in eval mode on the CPU, model settings dict with model, input_size, in_channels, num_classes,
        learn_sigma, class_dropout_prob, condition, text_encoder, text_max_length, vae, qk_norm, num_frames,
        text_dim, and ``run_config``: the saved run config, or None).

    Raises:
        UserError: unreadable checkpoint, bad overrides (``create_model``'s errors), or weights that do not fit
            the (overridden) model.
    """
    state, spec = read_spec(ckpt, use_ema)
    if model_name is not None:
        spec["model"] = model_name
    rebuild = (input_size is not None and input_size != spec["input_size"]
               or num_frames is not None and num_frames != spec["num_frames"])
    if input_size is not None:
        spec["input_size"] = input_size
    if num_frames is not None:
        if not is_video_model(spec["model"]):
            raise UserError(f"--num_frames: {spec['model']} is an image model; frames apply to video models")
        spec["num_frames"] = num_frames
    return build_model(ckpt, state, spec, use_ema, rebuild), spec


def load_sample_vae(cfg: SampleConfig, spec: dict, device: torch.device) -> VAE | IdentityVAE:
    """The run's VAE (``--vae`` overrides it); the identity for pixel-space models (1 or 3 channels)."""

    path = cfg.vae if cfg.vae is not None else spec["vae"]
    channels = spec["in_channels"]
    if str(path).lower() == "none":
        if channels not in (1, 3):
            raise UserError(f"--vae: the model works on {channels}-channel latents and {cfg.ckpt} names no VAE; "
                            "pass --vae FOLDER (a local diffusers AutoencoderKL, e.g. sd-vae-ft-ema) to decode them")
        return load_vae("none", device, pixel_channels=channels)
    vae = load_vae(path, device, resolve_precision(cfg.mixed_precision, device))  # decoded in the model's precision
    if vae.latent_channels != channels:
        raise UserError(f"--vae {path}: its latents have {vae.latent_channels} channels, the model's {channels}")
    return vae.compile() if cfg.compile != "none" else vae


def load_prompt_encoder(cfg: SampleConfig, spec: dict, device):
    """The run's text encoder (float32, on ``device``), checked against the model's text width."""
    from ditforge.encoders.text import load_text_encoder

    try:
        encoder = load_text_encoder(spec["text_encoder"], device, torch.float32, spec["text_max_length"])
    except UserError as e:
        raise UserError(f"--ckpt {cfg.ckpt}: cannot load the run's text encoder: {e}") from None
    if encoder.hidden_size != spec["text_dim"]:
        raise UserError(f"--ckpt {cfg.ckpt}: the text encoder {encoder.path} gives {encoder.hidden_size}-wide "
                        f"states, the model expects {spec['text_dim']}")
    return encoder


def encode_prompts(cfg: SampleConfig, spec: dict, prompts: list[str], device, encoder=None,
                   one_by_one: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(states (N, L, D_text) float32, mask (N, L) bool) on ``device``, in batches padded to one length L.
    ``one_by_one``: encode each prompt alone and pad to the encoder's ``max_length``, so a prompt's states do
    not depend on which prompts share its batch (streaming and resuming)."""
    from ditforge.encoders.text import pad_states

    encoder = encoder if encoder is not None else load_prompt_encoder(cfg, spec, device)
    step = 1 if one_by_one else cfg.batch_size
    parts = [encoder.encode(prompts[i : i + step]) for i in range(0, len(prompts), step)]
    length = encoder.max_length if one_by_one else max(s.shape[1] for s, _ in parts)
    padded = [pad_states(s, m, length) for s, m in parts]
    return torch.cat([s for s, _ in padded]).float(), torch.cat([m for _, m in padded])


def read_control(cfg: SampleConfig, height: int, width: int, frames: int) -> tuple[list, list | None, list | None]:
    """``--reference_image`` / ``--video`` / ``--mask`` of a reference-image family (``takes_references``) as PIL
    images: (the references, read by ``open_rgb``; the control clip's first ``frames`` frames or None; the mask's
    frames, an image repeated over the frames or a clip's first ``frames``, or None).

    Raises:
        UserError: a missing or unreadable file, a clip shorter than ``frames``, a mask of another size (frames, up
            to ``frames``, height, width) than the video's (``frames`` x ``height`` x ``width`` without a video), one line each.
    """
    from PIL import Image

    from ditforge.data.images import IMAGE_EXTENSIONS, open_rgb
    from ditforge.data.video import DECODE_ERRORS, BadVideo, probe_video, read_clip

    def clip(flag: str, path: str) -> list:
        if not Path(path).is_file():
            raise UserError(f"--{flag} {path}: no such file")
        try:
            pixels = read_clip(path, frames, 1, lambda _: 0)[0]
        except (BadVideo, *DECODE_ERRORS) as e:
            raise UserError(f"--{flag} {path}: not a readable clip of {frames} frames ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:120]})") from None
        return [Image.fromarray(p) for p in pixels]

    references = [open_rgb(p, f"--reference_image {p}") for p in cfg.reference_image or ()]
    video = clip("video", cfg.video) if cfg.video else None
    if not cfg.mask:
        return references, video, None
    image = Path(cfg.mask).suffix.lower() in IMAGE_EXTENSIONS
    if image:
        mask = open_rgb(cfg.mask, f"--mask {cfg.mask}")
        have = (frames, mask.height, mask.width)
    else:
        if not Path(cfg.mask).is_file():
            raise UserError(f"--mask {cfg.mask}: no such file")
        try:
            meta = probe_video(cfg.mask)
        except (BadVideo, *DECODE_ERRORS) as e:
            raise UserError(f"--mask {cfg.mask}: not a readable clip ({type(e).__name__})") from None
        have = (min(meta["num_frames"], frames) or frames, meta["height"], meta["width"])  # 0: unknown
    want = (frames, *(video[0].size[::-1] if video else (height, width)))
    if have != want:
        raise UserError(f"--mask {cfg.mask}: {have[0]} frames of {have[2]}x{have[1]}; expected the "
                        f"{'video' if video else 'sampled video'}'s size, {want[0]} frames of {want[2]}x{want[1]}")
    return references, video, [mask] * frames if image else clip("mask", cfg.mask)
