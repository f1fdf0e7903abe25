"""``ditforge sample``: load a checkpoint, draw guided samples for class labels or text prompts, decode them with
the run's VAE, and write a PNG grid (image models) or one MP4 + GIF per sample (video models)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import torch

from ditforge.config.sections import COMPILE_MODES, VAE_DTYPES
from ditforge.config.values import resolve_precision
from ditforge.data.captions import slug
from ditforge.data.images import save_grid, to_uint8
from ditforge.diffusion import SAMPLERS
from ditforge.errors import UserError
from ditforge.models import is_video_model
from ditforge.models.adapters.pipeline import encoder_dtype, is_adapted_pipeline, load_pretrained
from ditforge.models.adapters.single_file import component_files
from ditforge.ops.attention import set_frame_exchange, set_sequence_attention
from ditforge.parallel.mesh import Dist, init_distributed, shutdown
from ditforge.sample.load import (VIDEO_LOOP_FLAGS, SampleConfig, build_model, encode_prompts, load_sample_vae,
                                  read_prompts, read_spec)
from ditforge.sample.loops import (check_fp8, check_precision, generate_samples, prepare_model, sample_npz,
                                   sample_pipeline, sample_shape, sample_stream)
from ditforge.sample.write import save_npz, write_videos

log = logging.getLogger(__name__)


def sample(cfg: SampleConfig) -> np.ndarray:
    """Draw samples and write them.

    ``ckpt`` is a ditforge run or checkpoint (its own DiTs, or a fine-tuned diffusers pipeline), or a diffusers
    pipeline folder of a family ditforge adapts; a video family (the adapter's ``video``) is drawn by ``sample.video``'s loop, an image
    family by its own pipeline (``loops.sample_pipeline``). What follows is about ditforge's own models.

    Conditions: text models take ``prompt`` then the lines of ``prompt_file``, one sample per prompt, encoded by
    the run's text encoder; class models take ``class_labels`` as given, else ``num_samples`` labels cycling
    0, 1, ..., C-1, else one per class. Sampling: ``ditforge.diffusion.generate`` (``sampler``: respaced DDPM or
    DDIM, or diffusers' DPM-Solver++ / Euler; guidance against the dropped condition; a progress bar per batch);
    latents are decoded by the run's VAE (or ``cfg.vae``).

    Writes: image models a PNG grid at ``out`` (default ``samples.png``); video models, into the folder ``out``
    (default ``samples``), ``NNN-<slug of the prompt>.mp4`` (or ``NNN-class-K.mp4``) and a ``.gif`` preview beside
    it for sample NNN (see ``write_video`` / ``write_gif`` for the size rule). ``save_npz`` also writes
    ``samples`` (N, H, W, C) or (N, T, H, W, C) uint8, and ``labels`` (N,) int64 or ``prompts`` (N,) str.
    Noise: one generator seeded ``seed`` draws all starting noise, then the per-step noise (``generate``'s
    ``generator`` convention).

    Streaming (``prompt_file`` given, and a video model or an ``out`` not ending in ``.png``; ``out`` defaults to
    the folder ``samples``): the prompts (``prompt`` ones first) run in batches of ``batch_size``; each sample is
    written as soon as its batch is decoded, to ``out/NNN-<slug>.png`` (image models, one PNG of the sample's own
    size) or ``.mp4`` + ``.gif`` (video models; the GIF last); a tqdm bar counts samples. A sample whose file(s)
    exist is skipped, so re-running the same command resumes. Sample i uses ``generate``'s ``seeds`` convention
    with seed ``derive_seed(seed, i)`` and its prompt encoded alone, so it is the same whatever ``batch_size`` and
    whichever samples were skipped. ``save_npz`` is refused then.

    Evaluation-scale (class models, ``save_npz`` given and ``out`` not): no grid or videos; the processes under
    torchrun (or the one process) split the samples, each with its own seeds, write them in resumable parts and
    merge them into one .npz in the ADM evaluator's layout (``arr_0`` samples, ``arr_1`` labels; see
    ``sample_npz``). Labels cycle as above (sample i has label i mod C), so every class has N/C samples.

    Under torchrun with ``sequence_parallel_size`` = the number of processes, every process draws the same
    noise and runs its slice of each sample's tokens (``apply_sequence_parallel``); process 0 writes. With
    ``cfg_parallel`` the processes are 2 x ``sequence_parallel_size``: the conditional and the unconditional halves
    of the guided batch run on the two halves of them (``GuidedModel``'s ``cfg_group``); the halves are gathered
    outside the model, so ``compile`` (CUDA graphs) combines with it when ``sequence_parallel_size`` is 1.

    Returns:
        The samples as (N, H, W, C) uint8, or (N, T, H, W, C) for video models (an empty array on processes
        other than 0 under torchrun); when streaming, only those drawn in this run (M <= N, in prompt order).

    Raises:
        UserError: bad checkpoint or settings; a text model without a prompt or a class model with one (naming
            ``--prompt``); labels outside [0, num_classes); a missing or empty prompt file; latents without a
            known VAE (naming ``--vae``); an image size the VAE does not divide; ``save_npz`` when streaming; a
            diffusers sampler without diffusers installed (naming ``--sampler``); ``fora`` below 2 or with ``pab``;
            ``compile`` with sequence parallelism; ``cfg_parallel`` without guidance or with the wrong process count; a
            ``cfg_interval`` outside 0..999 or ``guidance_channels`` beyond the model's channels; evaluation-scale
            sampling with ``cfg_parallel`` or sequence parallelism, or into a parts folder of other settings.
    """
    if cfg.sampler is not None and cfg.sampler not in SAMPLERS:
        raise UserError(f"--sampler: expected one of {', '.join(SAMPLERS)}, got {cfg.sampler}")
    if cfg.num_sampling_steps is not None and not 2 <= cfg.num_sampling_steps <= 1000:
        raise UserError(f"--num_sampling_steps: expected 2..1000, got {cfg.num_sampling_steps}")
    for name in ("num_samples", "batch_size", "fps", "image_size", "num_frames", "height", "width"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UserError(f"--{name}: expected a positive integer, got {value}")
    check_precision(cfg.mixed_precision)
    if cfg.compile not in COMPILE_MODES:
        raise UserError(f"--compile: expected one of {', '.join(COMPILE_MODES)}, got {cfg.compile}")
    if cfg.first_block_cache is not None and not cfg.first_block_cache > 0:
        raise UserError(f"--first_block_cache: expected a threshold > 0 (e.g. 0.05), got {cfg.first_block_cache}")
    if cfg.taylorseer_cache is not None and (cfg.taylorseer_cache < 2 or cfg.first_block_cache is not None):
        raise UserError(f"--taylorseer_cache: expected a full-pass interval N >= 2 and no --first_block_cache (both "
                        f"are step caches), got {cfg.taylorseer_cache}"
                        + (" with --first_block_cache" if cfg.first_block_cache is not None else ""))
    if cfg.vae_tile is not None and (cfg.vae_tile < 32 or cfg.vae_tile % 32):
        raise UserError(f"--vae_tile: expected a multiple of 32 pixels (tiles overlap by a quarter, in whole latent "
                        f"pixels), got {cfg.vae_tile}")
    if cfg.vae_dtype is not None and cfg.vae_dtype not in VAE_DTYPES:
        raise UserError(f"--vae_dtype: expected one of {', '.join(VAE_DTYPES)}, got {cfg.vae_dtype}")
    if cfg.cfg_parallel and cfg.cfg_scale == 1.0:
        raise UserError("--cfg_parallel: --cfg_scale 1 runs no unconditional pass to put on the second GPU")
    if cfg.fora is not None and (cfg.fora < 2 or cfg.pab):
        raise UserError(f"--fora: expected a recompute interval N >= 2 and no --pab (both are caching schedules), "
                        f"got {cfg.fora}" + (" with --pab" if cfg.pab else ""))
    if cfg.cfg_interval is not None and not 0 <= cfg.cfg_interval[0] <= cfg.cfg_interval[1] <= 999:
        raise UserError(f"--cfg_interval: expected LOW HIGH timesteps with 0 <= LOW <= HIGH <= 999, got "
                        f"{' '.join(map(str, cfg.cfg_interval))}")
    if cfg.guidance_channels is not None and cfg.guidance_channels < 1:
        raise UserError(f"--guidance_channels: expected a positive channel count, got {cfg.guidance_channels}")
    prompts = read_prompts(cfg.prompt, cfg.prompt_file)
    d = init_distributed(cfg.device, cfg.sequence_parallel_size)
    try:
        return _sample(cfg, prompts, d)
    finally:
        set_sequence_attention(None)
        set_frame_exchange(None)
        shutdown(d)


def _fuse_lora(pre, path: str) -> None:
    """Load the LoRA file or folder ``path`` (``ditforge export --format lora``, or any LoRA diffusers reads for
    this pipeline) with the pipeline's ``load_lora_weights`` and merge it into the weights (``fuse_lora``, then
    ``unload_lora_weights``: the sampling loop runs plain layers).

    Raises:
        UserError: no such path, diffusers / peft could not load it, or it matched none of the pipeline's modules
            (one line each)."""
    if not Path(path).exists():
        raise UserError(f"--lora {path}: no such file or folder")
    try:
        pre.pipe.load_lora_weights(path)
    except Exception as e:  # diffusers and peft raise many types for a file that does not fit
        raise UserError(f"--lora {path}: could not load it into {pre.pipeline_class} ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]})") from None
    if not any(pre.pipe.get_list_adapters().values()):  # diffusers only warns when no key matched
        raise UserError(f"--lora {path}: holds no LoRA weights for {pre.pipeline_class}'s modules")
    pre.pipe.fuse_lora()
    pre.pipe.unload_lora_weights()


def _sample(cfg: SampleConfig, prompts: list[str], d: Dist) -> np.ndarray:
    if cfg.mixed_precision == "fp8":  # before the checkpoint is read
        check_fp8(d)
    evaluation = cfg.save_npz is not None and cfg.out is None and not prompts  # sample_npz: processes split samples
    if evaluation and (cfg.cfg_parallel or d.sp_size > 1):
        raise UserError("--cfg_parallel/--sequence_parallel_size: not with --save_npz without --out, where every "
                        "process draws its own share of the samples; drop them")
    if cfg.cfg_parallel and d.world_size != 2 * d.sp_size:
        raise UserError(f"--cfg_parallel: needs 2 x --sequence_parallel_size ({2 * d.sp_size}) processes under "
                        f"torchrun, got {d.world_size}")
    if not cfg.cfg_parallel and not evaluation and d.world_size != d.sp_size:
        raise UserError(f"--sequence_parallel_size {cfg.sequence_parallel_size}: under torchrun, `ditforge sample` "
                        f"splits every sample over all {d.world_size} processes; give --sequence_parallel_size "
                        f"{d.world_size} (or --cfg_parallel with half of that), or --save_npz without --out to "
                        "split the samples among the processes")
    host = torch.device("cpu") if cfg.plugin == "fsdp" else None  # the transformer reaches the GPU as shards
    if is_adapted_pipeline(cfg.ckpt, tuple(component_files(cfg))):  # a diffusers pipeline folder itself
        pre = load_pretrained(cfg.ckpt, d.device, encoder_dtype(d.device), flag="--ckpt",
                              denoiser_dtype=resolve_precision(cfg.mixed_precision, d.device), sampling=True,
                              denoiser_device=host, files=component_files(cfg))
        if cfg.lora is not None:
            if getattr(pre.pipe, "transformer_2", None) is not None:
                raise UserError(f"--lora {cfg.lora}: {cfg.ckpt} has two experts (transformer and transformer_2); a LoRA of one of them "
                                "is not applied by ditforge yet")
            _fuse_lora(pre, cfg.lora)
        return sample_pipeline(cfg, prompts, d, pre, pre.denoiser.eval())
    for name, file in component_files(cfg).items():
        if name != "vae" or Path(file).is_file():  # a missing --vae: load_sample_vae's to name
            raise UserError(f"--{name} {file}: replaces a component of a diffusers pipeline folder as --ckpt; "
                            f"{cfg.ckpt} is none (a run reads the single files of its --init_from)")
    if cfg.lora is not None:
        raise UserError(f"--lora {cfg.lora}: for a diffusers pipeline folder as --ckpt (a LoRA run's own adapters "
                        f"load with its checkpoint); {cfg.ckpt} is none")
    state, spec = read_spec(cfg.ckpt, cfg.use_ema)
    if spec.get("family"):
        from ditforge.weights.finetuned import load_finetuned

        # a distilled student: its steps, no guidance pass (a guidance-distilled family's: the scale it embeds)
        student = (spec["run_config"] or {}).get("distill")
        if student:
            scale = student.get("sample_cfg_scale", 1.0) if cfg.cfg_scale is None else cfg.cfg_scale
            cfg = dataclasses.replace(cfg, sampler=cfg.sampler or student["sampler"],
                                      num_sampling_steps=cfg.num_sampling_steps or student["student_steps"],
                                      cfg_scale=scale, segment_frame_length=cfg.segment_frame_length or student.get(
                                          "segment_frame_length"),
                                      **({} if cfg.image_size else {"height": cfg.height or student.get("height"),
                                                                    "width": cfg.width or student.get("width")}))
        return sample_pipeline(cfg, prompts, d, *load_finetuned(state, spec["run_config"], d.device, cfg.use_ema,
                                                                denoiser_device=host))
    return _sample_dit(cfg, prompts, d, state, spec, evaluation)


def _sample_dit(cfg: SampleConfig, prompts: list[str], d: Dist, state: dict, spec: dict,
                evaluation: bool) -> np.ndarray:
    """``sample`` for ditforge's own DiTs: ``state`` / ``spec`` as ``read_spec`` returns them."""
    for name in VIDEO_LOOP_FLAGS:
        if getattr(cfg, name) is not None:
            raise UserError(f"--{name}: for diffusers video pipelines; {cfg.ckpt} is a ditforge {spec['model']}"
                            + (" (give --image_size)" if name in ("height", "width") else ""))
    if cfg.compile != "none" and cfg.sequence_parallel_size > 1:  # --cfg_parallel's gather is outside the model
        raise UserError(f"--compile {cfg.compile}: not with --sequence_parallel_size > 1 (collectives inside a "
                        "compiled, CUDA-graph-replayed model are untested); drop --compile")
    # A distilled student (``ditforge distill``) samples in its own steps, its guidance baked in.
    student = (spec["run_config"] or {}).get("distill")
    cfg = dataclasses.replace(cfg, num_sampling_steps=cfg.num_sampling_steps or (
        student["student_steps"] if student else 250), cfg_scale=(1.0 if student else 4.0) if cfg.cfg_scale is None
        else cfg.cfg_scale, sampler=cfg.sampler or (student["sampler"] if student else None), fps=cfg.fps or 8)
    device = d.device
    if cfg.image is not None:
        raise UserError(f"--image {cfg.image}: {cfg.ckpt} is a ditforge {spec['model']}, which takes no image; "
                        "--image is for image-to-video pipelines; leave it out")
    if cfg.model is not None:
        spec["model"] = cfg.model
    video = is_video_model(spec["model"])
    text = spec["text_dim"] is not None
    if text and not prompts:
        raise UserError(f"--prompt: {cfg.ckpt} is a text-conditioned model; give --prompt \"...\" (repeatable) "
                        "or --prompt_file FILE")
    if text and (cfg.class_labels is not None or cfg.num_samples is not None):
        raise UserError("--class_labels/--num_samples: the model is text-conditioned; give --prompt or --prompt_file")
    if not text and prompts:
        raise UserError(f"--prompt: {cfg.ckpt} is a class-conditional model; give --class_labels or --num_samples")
    labels: list[int] = []
    if not text:
        num_classes = spec["num_classes"]
        if cfg.class_labels is not None:
            labels = list(cfg.class_labels)
        else:
            labels = [i % num_classes for i in range(cfg.num_samples or num_classes)]
        bad = [c for c in labels if not 0 <= c < num_classes]
        if bad or not labels:
            raise UserError(f"--class_labels: expected labels in 0..{num_classes - 1}, got {bad or 'none'}")
    default_out = "samples" if video or cfg.prompt_file is not None else "samples.png"
    out = Path(cfg.out if cfg.out is not None else default_out)
    if video and out.suffix.lower() in (".png", ".jpg", ".mp4", ".gif", ".npz"):
        raise UserError(f"--out {out}: a video model writes a folder of .mp4 and .gif files; give a folder name")
    stream = cfg.prompt_file is not None and (video or out.suffix.lower() != ".png")
    if stream and cfg.save_npz:
        raise UserError(f"--save_npz: not with --prompt_file streaming into the folder {out} (one file per sample, "
                        "resumable); give --out FILE.png for one grid and an .npz (image models), or drop --save_npz")

    vae = load_sample_vae(cfg, spec, device)
    trained_size = spec["input_size"]
    if cfg.image_size is not None:
        if cfg.image_size % vae.downsample:
            raise UserError(f"--image_size {cfg.image_size}: not divisible by the VAE's downsample factor "
                            f"{vae.downsample}")
        spec["input_size"] = cfg.image_size // vae.downsample
    # The models take any size the patch divides: at another size or frame count only the fixed sin-cos tables
    # (not learned) are rebuilt, for the new token grid.
    rebuild = (spec["input_size"] != trained_size
               or cfg.num_frames is not None and cfg.num_frames != spec["num_frames"])
    if cfg.num_frames is not None:
        if not video:
            raise UserError(f"--num_frames: {spec['model']} is an image model; frames apply to video models")
        spec["num_frames"] = cfg.num_frames
    if cfg.guidance_channels is not None and cfg.guidance_channels > spec["in_channels"]:
        raise UserError(f"--guidance_channels {cfg.guidance_channels}: the model has {spec['in_channels']} channels")
    model = build_model(cfg.ckpt, state, spec, cfg.use_ema, rebuild)
    del state
    if not text:
        table = model.y_embedder.embedding_table.num_embeddings
        if cfg.cfg_scale != 1.0 and table <= spec["num_classes"]:
            raise UserError("--cfg_scale: the model has no null label (trained without label dropout), so it "
                            "cannot be guided; use --cfg_scale 1")
    # Under sequence parallelism every process draws the same noise and runs its slice of the tokens.
    guided_rows = 1 if cfg.cfg_scale == 1.0 or cfg.cfg_parallel else 2  # cond and uncond in one forward
    model = prepare_model(model, d, cfg.mixed_precision, cfg.compile, cfg.enable_flashattn,
                          cfg.enable_modulate_kernel, cfg.enable_layernorm_kernel, cfg.sequence_parallel_type,
                          guided_rows * min(cfg.batch_size, len(prompts) if text else len(labels)))

    if stream:
        return sample_stream(cfg, d, model, vae, spec, prompts, out, video)
    if evaluation:
        return sample_npz(cfg, d, model, vae, spec, labels, video)
    if text:
        y, y_mask = encode_prompts(cfg, spec, prompts, device)
        names = [slug(p) for p in prompts]
    else:
        y, y_mask = torch.tensor(labels, dtype=torch.long, device=device), None
        names = [f"class-{c}" for c in labels]
    shape = sample_shape(spec, video)
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    latents = generate_samples(cfg, d, model, spec, vae, shape, y, y_mask, generator=g, batch_size=cfg.batch_size)
    del model
    if not d.is_main:
        return np.empty(0, dtype=np.uint8)
    samples = np.concatenate([to_uint8(vae.decode(latents[i : i + cfg.batch_size]).float())
                              for i in range(0, len(latents), cfg.batch_size)])
    if video:
        write_videos(samples, out, names, cfg.fps)
    else:
        nrow = min(len(samples), 8 if text or cfg.class_labels is not None else spec["num_classes"])
        save_grid(samples, out, nrow=nrow, upscale=max(1, 64 // samples.shape[1]))
        log.info("wrote %d samples (%dx%d) to %s", len(samples), samples.shape[2], samples.shape[1], out)
    if cfg.save_npz:
        extra = {"prompts": np.array(prompts, dtype=str)} if text else {"labels": np.asarray(labels, dtype=np.int64)}
        save_npz(cfg.save_npz, samples=samples, **extra)
        log.info("wrote %s", cfg.save_npz)
    return samples
