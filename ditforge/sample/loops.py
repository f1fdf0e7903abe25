"""The sampling loops of ``ditforge sample``: a loaded model made fast (``prepare_model``: dtype, kernels,
compile, CUDA graphs of whole loops), ``generate`` with the command's guidance and caching settings, and the three
ways to run it besides the grid: streaming prompts, evaluation-scale sampling into an .npz, and a fine-tuned
diffusers pipeline."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from ditforge.atomic import atomic_path
from ditforge.config.sections import SAMPLING_PRECISIONS
from ditforge.config.values import resolve_precision
from ditforge.data.captions import slug
from ditforge.data.images import open_rgb, save_grid, to_uint8
from ditforge.data.sampler import derive_seed
from ditforge.diffusion import generate
from ditforge.diffusion.pab import PABConfig
from ditforge.diffusion.samplers import STUDENT_SAMPLER
from ditforge.encoders.vae import IdentityVAE
from ditforge.errors import UserError
from ditforge.parallel.mesh import Dist
from ditforge.sample.load import VIDEO_LOOP_FLAGS, SampleConfig, encode_prompts, load_prompt_encoder
from ditforge.sample.write import save_npz, write_video_files

log = logging.getLogger(__name__)


def check_precision(name: str) -> None:
    """Raises UserError unless ``name`` is one of ``SAMPLING_PRECISIONS``."""
    if name not in SAMPLING_PRECISIONS:
        raise UserError(f"--mixed_precision: expected {' | '.join(SAMPLING_PRECISIONS)} for sampling, got {name}")


def check_fp8(d: Dist) -> None:
    """Raises UserError where fp8 sampling cannot run: no FP8 GPU or Triton, or sequence parallelism (FastSeq,
    which ``auto`` may pick, projects slices of the qkv weight; float8 weights offer none, and the other variants
    are untested with fp8)."""
    from ditforge.parallel import fp8_unavailable

    if d.sp_mesh is not None:
        raise UserError("--mixed_precision fp8: not with --sequence_parallel_size > 1 (FastSeq projects slices of "
                        "the qkv weight, which float8 weights do not offer; the other variants are untested with "
                        "fp8); use bf16")
    reason = fp8_unavailable(d.device, inference=True)
    if reason:
        raise UserError(f"--mixed_precision fp8: {reason}")


def use_sampling_gemm_settings(device: torch.device) -> None:
    """On a CUDA device, give cuBLASLt no workspace (``CUBLASLT_WORKSPACE_SIZE=0``) unless the environment already
    sets one. PyTorch reads the variable once, at the process's first cuBLASLt GEMM, so this acts only before it
    (``prepare_model`` calls it, before any GEMM in ``ditforge sample``).

    Why: with its default workspace cuBLASLt picks, for DiT-XL/2's sampling GEMMs at 4,096 rows, kernels that
    need a zeroed workspace, and every GEMM launches a memset first (112 of a forward's 143 memsets, 4 a block
    with float8 layers). Without one it picks kernels that take as long (3.57 against 3.58 ms of GEMMs a forward)
    and no memset: a float8 forward at 16 x 256 tokens in a CUDA graph took 5.69 instead of 5.99 ms; at 2 x 256,
    where no GEMM memsets, 2.08 ms either way (H200, 2026-11-27, torch 2.11.0+cu130; the probe ``benchmarks/gemm_memsets.py``, last at da2a95e; docs/speed.md).
    Training keeps the default (not measured without it: its weight-gradient GEMMs reduce over every token, the
    shape split-K kernels, which need the workspace, are for)."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLASLT_WORKSPACE_SIZE", "0")


def prepare_model(model: torch.nn.Module, d: Dist, mixed_precision: str = "auto", compile: str = "none",
                  enable_flashattn: bool = False, enable_modulate_kernel: bool = False,
                  enable_layernorm_kernel: bool = False, sequence_parallel_type: str = "auto",
                  batch_size: int = 1) -> Callable:
    """Make a loaded model fast for sampling; returns what to call like the model: the same module, its compiled
    wrapper, or (CUDA graphs) a function around that.

    - cuBLASLt without a workspace (``use_sampling_gemm_settings``);
    - weights cast to the compute dtype (``mixed_precision``: fp32 | bf16 | fp16; ``auto``: bf16 on CUDA, fp32 on
      CPU): inference keeps no float32 master copy, so every step reads half the bytes and autocast's per-call
      weight casts are gone (diffusers' pipelines do the same with ``torch_dtype``). Inputs are cast by the
      embedders; ``GuidedModel`` combines the guided outputs in float32. ``fp8``: bf16, and the blocks' big
      linear layers as float8 GEMMs with per-channel weight and per-row activation scales (``apply_fp8`` with
      ``inference=True``; H100-class GPU and Triton).
    - attention kernels, fused adaLN kernels and sequence parallelism (``dist.sp_mesh``) as in training
      (``ditforge.parallel.parallelize``, no optimizer-side wrapping);
    - ``compile``: ``torch.compile`` of the whole model with static shapes (``dynamic=False``: one graph per batch
      shape, compiled at first use; ``CompiledModel``), on a GPU with inductor's multi-kernel reductions.
      ``reduce-overhead`` and ``max-autotune`` add CUDA graphs:
      ``generate`` captures each loop of its own samplers whole, every step's model call, guidance and update
      in one graph (``diffusion.LoopGraphs``), and other loops replay the model as a graph per call. Launches, not
      arithmetic, bound a DiT-XL at batch 1 (diffusers' DiTPipeline is so), which is what this removes.

    Args:
        model: an eval-mode DiT / vDiT / STDiT (float32, any device).
        d: the process's ``Dist`` (device, sequence-parallel mesh).
        batch_size: rows of one model forward (2 per sample under guidance); sizes ``--sequence_parallel_type
            auto``'s measurement.

    Raises:
        UserError: an unknown precision; fp8 without an FP8 GPU or Triton, or with sequence parallelism; a fused
            kernel without Triton on the device.
    """
    from ditforge.parallel import apply_fp8, parallelize

    use_sampling_gemm_settings(d.device)
    check_precision(mixed_precision)
    if mixed_precision == "fp8":
        check_fp8(d)
    dtype = resolve_precision(mixed_precision, d.device)
    model = model.to(device=d.device, dtype=dtype).eval().requires_grad_(False)
    model = parallelize(model, d, attention="fast" if enable_flashattn else "auto",
                        enable_modulate_kernel=enable_modulate_kernel, enable_layernorm_kernel=enable_layernorm_kernel,
                        sequence_parallel_type=sequence_parallel_type, batch_size=batch_size)
    if mixed_precision == "fp8":
        log.info("fp8: %d linear layers run float8 GEMMs", apply_fp8(model, d.device, inference=True))
    if compile == "none":
        return model
    return CompiledModel(model, compile, d.device)


class CompiledModel:
    """``prepare_model``'s result when it compiles; called like the model. Everything compiles at first use.

    - The call: ``torch.compile(model, dynamic=False)`` with ``mode``'s options
      (``torch._inductor.list_mode_options``), on a GPU with inductor's option
      ``triton.multi_kernel`` on: for a row reduction longer than 1,024 elements (the LayerNorms at D = 1152)
      inductor then also builds the persistent kernel, which holds a row in registers instead of looping over
      it, and keeps whichever its first run times faster. The LayerNorm-modulate kernels of a batch-8 DiT-XL/2
      sampling loop took 37 instead of 48 ms (H100, 2026-11-27; compiling takes about 6 s longer). A
      ``TORCHINDUCTOR_MULTI_KERNEL`` in the environment overrides this (``0``: off). With CUDA
      graphs (``reduce-overhead`` or ``max-autotune`` on a GPU) each call replays the model's graph, marks a new
      CUDA-graph step and returns a copy, so outputs stay valid after the next call.
    - ``loop_graphs`` (CUDA-graph modes on a GPU, else None): a ``diffusion.LoopGraphs`` around the same model
      compiled without CUDA graphs of its own (``max-autotune-no-cudagraphs`` for ``max-autotune``), in which
      ``generate`` captures whole loops.
    - ``eager``: the model itself, which ``generate`` runs for PAB and FORA (their patched module forwards are
      invisible to a compiled graph; a CUDA graph around the loop follows them).
    """

    def __init__(self, model: torch.nn.Module, mode: str, device: torch.device):
        from torch._inductor import list_mode_options

        from ditforge.diffusion import LoopGraphs

        def compiled(mode: str) -> torch.nn.Module:
            options = dict(list_mode_options(mode))
            if device.type == "cuda" and "TORCHINDUCTOR_MULTI_KERNEL" not in os.environ:  # the user's choice wins
                options["triton.multi_kernel"] = 1
            return torch.compile(model, options=options, dynamic=False)

        self.eager = model
        self._compiled = compiled(mode)
        inner = "max-autotune-no-cudagraphs" if mode == "max-autotune" else "default"
        graphs = mode in ("reduce-overhead", "max-autotune") and device.type == "cuda"
        self.loop_graphs = LoopGraphs(compiled(inner)) if graphs else None

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if self.loop_graphs is None:
            return self._compiled(*args, **kwargs)
        torch.compiler.cudagraph_mark_step_begin()
        return self._compiled(*args, **kwargs).clone()


def generate_samples(cfg: SampleConfig, d: Dist, model, spec: dict, vae, shape: tuple[int, ...], y: torch.Tensor,
                     y_mask: torch.Tensor | None, **noise) -> torch.Tensor:
    """``generate`` with the command's sampler, guidance, PAB and CFG-parallel settings; ``noise``: generator or
    seeds, and batch_size. Pixel-space samples are clipped to [-1, 1] at each step, latents are not. With
    ``cfg_parallel`` the two halves of the guided batch run on the two rows of the (dp, sp) mesh."""
    cfg_group = None
    if cfg.cfg_parallel:
        cfg_group = (d.sp_mesh["dp"] if d.sp_mesh is not None else d.mesh).get_group()
    objective = spec.get("objective") or "ddpm"
    sampler = cfg.sampler or ("euler" if objective == "flow" else "ddpm")
    if objective == "flow" and sampler not in ("euler", STUDENT_SAMPLER):
        raise UserError(f"--sampler {sampler}: {cfg.ckpt} was trained with rectified flow; it samples with euler")
    return generate(model, y, shape, y_mask=y_mask, cfg_scale=cfg.cfg_scale, num_steps=cfg.num_sampling_steps,
                    sampler=sampler, eta=cfg.eta, learn_sigma=spec["learn_sigma"], objective=objective,
                    flow_shift=spec.get("flow_shift") or 1.0,
                    clip_denoised=isinstance(vae, IdentityVAE), guidance_channels=cfg.guidance_channels,
                    cfg_interval=cfg.cfg_interval, pab=_cache_schedule(cfg), cfg_group=cfg_group,
                    progress=d.is_main, **noise)


def _cache_schedule(cfg: SampleConfig) -> PABConfig | None:
    """The step-level reuse of ``--pab`` (VideoSys's default schedule) or ``--fora N`` (``PABConfig.fora``)."""
    if cfg.fora is not None:
        return PABConfig.fora(cfg.fora)
    return PABConfig() if cfg.pab else None


def sample_shape(spec: dict, video: bool) -> tuple[int, ...]:
    """The shape of one sample the model draws: (C, H, W), or (C, T, H, W) for video models (latent sizes)."""
    s = spec["input_size"]
    return (spec["in_channels"], spec["num_frames"], s, s) if video else (spec["in_channels"], s, s)


def sample_stream(cfg: SampleConfig, d: Dist, model, vae, spec: dict, prompts: list[str], out: Path,
                  video: bool) -> np.ndarray:
    """Streaming ``--prompt_file`` sampling: one output per prompt, written as soon as its batch is decoded;
    prompts whose output exists are skipped (so a re-run resumes). Sample i is drawn from the seeds
    ``derive_seed(seed, i)`` (``generate(seeds=...)``) with its prompt encoded alone, so it does not depend on
    ``batch_size`` or on which prompts were skipped. Returns the samples drawn now, (M, ...) uint8."""
    device = d.device
    width = max(3, len(str(len(prompts) - 1)))
    stems = [out / f"{i:0{width}d}-{slug(p)}" for i, p in enumerate(prompts)]
    exts = (".mp4", ".gif") if video else (".png",)
    todo = [i for i, stem in enumerate(stems) if not all(stem.with_suffix(e).exists() for e in exts)]
    if d.is_main:
        log.info("%d of %d prompts to draw into %s (%d done already)", len(todo), len(prompts), out,
                 len(prompts) - len(todo))
    encoder = load_prompt_encoder(cfg, spec, device) if todo else None
    shape = sample_shape(spec, video)
    drawn = []
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), unit="sample", desc="samples",
               disable=not d.is_main)
    for start in range(0, len(todo), cfg.batch_size):
        rows = todo[start : start + cfg.batch_size]
        y, y_mask = encode_prompts(cfg, spec, [prompts[i] for i in rows], device, encoder, one_by_one=True)
        latents = generate_samples(cfg, d, model, spec, vae, shape, y, y_mask,
                                   seeds=[derive_seed(cfg.seed, i) for i in rows], batch_size=len(rows))
        if d.is_main:
            samples = to_uint8(vae.decode(latents).float())
            for i, sample_i in zip(rows, samples):
                if video:
                    write_video_files(sample_i, stems[i], cfg.fps)
                else:
                    save_grid(sample_i[None], stems[i].with_suffix(".png"), nrow=1, pad=0)
            drawn.append(samples)
        bar.update(len(rows))
    bar.close()
    if d.is_main:
        log.info("wrote %d new samples to %s", sum(len(a) for a in drawn), out)
    return np.concatenate(drawn) if drawn else np.empty(0, dtype=np.uint8)


def sample_npz(cfg: SampleConfig, d: Dist, model, vae, spec: dict, labels: list[int], video: bool) -> np.ndarray:
    """Evaluation-scale sampling (``--save_npz`` without ``--out``), as DiT's ``sample_ddp.py``: the processes
    split the samples, and the result is one .npz in the layout of guided-diffusion's ADM evaluator.

    Sample i has label ``labels[i]`` and the seeds ``derive_seed(seed, i)`` (``generate(seeds=...)``), so the set
    is the same whatever the number of processes or ``batch_size`` (on one kind of device; up to the float
    rounding of batched matmuls). The missing samples are cut into batches of ``batch_size`` and batch j goes to
    process j mod world size. Each finished batch is written atomically to ``<save_npz>.parts/part-NNNNNNN.npz``
    (``index`` (B,) int64, ``samples`` (B, H, W, C) uint8); a re-run with the same settings (``settings.json``
    there) skips the samples those files hold, so an interrupted run resumes. When all are drawn, process 0
    merges them, writes ``save_npz`` atomically and removes the folder.

    Returns:
        On process 0 the samples ``arr_0`` (N, H, W, 3) or (N, T, H, W, 3) uint8 (grey repeated to RGB, as the
        evaluator's Inception network takes RGB); ``arr_1`` holds the labels (N,) int64. Elsewhere an empty array.

    Raises:
        UserError: the parts folder holds samples drawn with other settings.
    """
    parts = Path(f"{cfg.save_npz}.parts")
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("batch_size", "num_samples", "save_npz")}
    settings = json.loads(json.dumps(settings))  # tuples as lists, as they read back
    saved = parts / "settings.json"
    before = json.loads(saved.read_text()) if saved.exists() else settings
    if before != settings:
        changed = sorted(k for k in before.keys() | settings.keys() if before.get(k) != settings.get(k))
        raise UserError(f"--save_npz {cfg.save_npz}: {parts} holds samples drawn with other settings "
                        f"({', '.join(changed)}); re-run with those, or delete the folder to start over")
    n = len(labels)
    done = {int(i) for part in parts.glob("part-*.npz") for i in _read_part(part, "index") if i < n}
    todo = [i for i in range(n) if i not in done]
    if d.is_main:  # before any part exists (the other processes read the same settings, or none yet)
        with atomic_path(saved) as tmp:
            tmp.write_text(json.dumps(settings, indent=1))
    d.barrier()  # every process has listed the parts before any writes one: all cut the same batches
    if d.is_main:
        log.info("%d of %d samples to draw on %d process(es) into %s (%d done already)", len(todo), n,
                 d.world_size, parts, len(done))
    batches = [todo[s : s + cfg.batch_size] for s in range(0, len(todo), cfg.batch_size)][d.rank :: d.world_size]
    shape = sample_shape(spec, video)
    bar = tqdm(total=sum(map(len, batches)), unit="sample", desc="samples", disable=not d.is_main)
    for rows in batches:
        y = torch.tensor([labels[i] for i in rows], dtype=torch.long, device=d.device)
        latents = generate_samples(cfg, d, model, spec, vae, shape, y, None,
                                   seeds=[derive_seed(cfg.seed, i) for i in rows], batch_size=len(rows))
        save_npz(parts / f"part-{rows[0]:07d}.npz", index=np.asarray(rows, dtype=np.int64),
                  samples=to_uint8(vae.decode(latents).float()))
        bar.update(len(rows))
    bar.close()
    d.barrier()
    if not d.is_main:
        return np.empty(0, dtype=np.uint8)
    samples, filled = None, np.zeros(n, dtype=bool)
    for part in sorted(parts.glob("part-*.npz")):
        index, drawn = _read_part(part, "index"), _read_part(part, "samples")
        keep = index < n
        if samples is None:
            samples = np.empty((n, *drawn.shape[1:]), dtype=np.uint8)
        samples[index[keep]], filled[index[keep]] = drawn[keep], True
    if not filled.all():
        raise RuntimeError(f"{parts}: samples {np.flatnonzero(~filled)[:10].tolist()}... are missing after sampling")
    if samples.shape[-1] == 1:
        samples = samples.repeat(3, axis=-1)
    save_npz(cfg.save_npz, arr_0=samples, arr_1=np.asarray(labels, dtype=np.int64))
    shutil.rmtree(parts)
    log.info("wrote %d samples (%s) and their labels to %s", n, "x".join(map(str, samples.shape[1:])), cfg.save_npz)
    return samples


def _read_part(path: Path, key: str) -> np.ndarray:
    with np.load(path) as f:
        return f[key]


def sample_pipeline(cfg: SampleConfig, prompts: list[str], d: Dist, pre, denoiser, run=None) -> np.ndarray:
    """A diffusers pipeline: a pipeline folder (``run`` None) or a fine-tuned one (``ditforge train --init_from
    FOLDER``; ``run`` its ``RunConfig``, whose frame size and count are the defaults). A video family (an adapter with ``video``) is drawn
    by ditforge's own loop (``sample.video.sample_video_family``). An image family is drawn by its own pipeline
    class and scheduler, ``num_sampling_steps`` steps (default: the pipeline's) with guidance ``cfg_scale`` (default:
    the pipeline's); sample i starts from the noise of seed ``derive_seed(seed, i)``; writes one PNG grid (``out``,
    default samples.png) and the optional .npz.

    Raises:
        UserError: no prompts, class labels; an image family under torchrun or with a flag of the video loop
            (``--height``, ``--compile``, fp8, ...); ``--image`` missing for an
            image-to-video pipeline or given to another; ``--reference_image`` / ``--video`` / ``--mask`` for a
            pipeline without ``takes_references``; ``sample_video_family``'s.
    """
    from ditforge.models.adapters.pipeline import pipeline_defaults
    from ditforge.sample.video import sample_video_family
    from ditforge.models.adapters.pipeline import generate_with_pipeline

    if not prompts:
        raise UserError(f"--prompt: {cfg.ckpt} is a text-to-{'video' if denoiser.video else 'image'} pipeline; give "
                        "--prompt \"...\" (repeatable) or --prompt_file FILE")
    if cfg.class_labels is not None or cfg.num_samples is not None:
        raise UserError("--class_labels/--num_samples: the model is text-conditioned; give --prompt or --prompt_file")
    image = _conditioning_image(cfg, denoiser, pre.pipeline_class)
    given = next((n for n in ("reference_image", "video", "mask") if getattr(cfg, n)), None)
    if given is not None and not denoiser.takes_references:
        raise UserError(f"--{given}: {cfg.ckpt} is a {pre.pipeline_class}, which takes no reference images, control "
                        "video or mask (a reference-image pipeline does); leave it out")
    if denoiser.driving_videos:
        return _sample_driven(cfg, prompts, d, pre, denoiser, image)
    if given := [f"--{n}" for n in (*DRIVING_FLAGS, "mode") if getattr(cfg, n) is not None]:
        raise UserError(f"{given[0]}: for character pipelines driven by videos; {cfg.ckpt} is a "
                        f"{pre.pipeline_class}; leave it out")
    if denoiser.video:
        return sample_video_family(cfg, prompts, d, pre, denoiser, run, image)
    if d.world_size > 1:
        raise UserError("--sequence_parallel_size / --cfg_parallel: an image pipeline samples in one process")
    given = [f"--{n}" for n in (*VIDEO_LOOP_FLAGS, "num_frames") if getattr(cfg, n) is not None]
    given += ["--gif"] if cfg.gif else []
    if cfg.compile != "none" or cfg.mixed_precision == "fp8":
        given.append("--compile" if cfg.compile != "none" else "--mixed_precision fp8")
    if given:
        raise UserError(f"{given[0]}: {pre.pipeline_class} samples through its own diffusers pipeline, which takes "
                        "--image_size, --num_sampling_steps, --cfg_scale and --batch_size; leave it out")
    defaults = pipeline_defaults(pre.pipe)
    size = cfg.image_size or (run.data.image_size if run is not None else defaults["height"])
    pre.refuse_size(size, size, 1, f"--image_size {size}")
    seeds = [derive_seed(cfg.seed, i) for i in range(len(prompts))]
    pixels = generate_with_pipeline(pre, denoiser, prompts, seeds, size,
                                    cfg.num_sampling_steps or defaults["num_inference_steps"],
                                    cfg.cfg_scale if cfg.cfg_scale is not None else defaults["guidance_scale"],
                                    cfg.batch_size)
    images = to_uint8(pixels)  # (N, H, W, C)
    out = cfg.out or "samples.png"
    save_grid(images, out, nrow=min(len(images), 8))
    if cfg.save_npz:
        save_npz(cfg.save_npz, samples=images, prompts=np.array(prompts))
    log.info("wrote %d samples of %s to %s", len(images), pre.pipeline_class, out)
    return images


def _conditioning_image(cfg: SampleConfig, denoiser, pipeline_class: str):
    """``--image`` for an image-to-video pipeline (an adapter with ``image_to_video``): the file as a PIL RGB image (the
    pipeline resizes it to the frame size); None for other pipelines.

    Raises:
        UserError: ``--image`` missing for an image-to-video pipeline, given to another, or not a readable image
            (one line each, naming ``--image``).
    """
    if not (denoiser.image_to_video or denoiser.driving_videos):
        if cfg.image is not None:
            raise UserError(f"--image {cfg.image}: {cfg.ckpt} is a {pipeline_class}, which takes no image; leave "
                            "--image out")
        return None
    if cfg.image is None:
        raise UserError(f"--image: {cfg.ckpt} is a {pipeline_class}; give the first frame, --image FILE.png")
    return open_rgb(cfg.image, f"--image {cfg.image}")


DRIVING_FLAGS = ("pose_video", "face_video", "background_video", "mask_video")  # SampleConfig's driving videos


def _sample_driven(cfg: SampleConfig, prompts: list[str], d: Dist, pre, denoiser, image) -> np.ndarray:
    """A character pipeline driven by videos (``denoiser.driving_videos``), drawn by its own call
    (``generate_with_pipeline``) for each prompt from ``image`` (the character, PIL) and the videos of the
    ``DRIVING_FLAGS`` given (whole files, every frame, PIL RGB), checked by ``denoiser.driving_inputs``; frame size
    ``--height`` / ``--width`` (default the pipeline's), steps and guidance the pipeline's unless given; prompt i
    from seed ``derive_seed(seed, i)``. Writes ``out`` (default ``samples``) as ``NNN-<prompt>.mp4`` + ``.gif`` at
    ``--fps`` (default the family's); the pipeline's VAE in ``--vae_dtype`` when given. Returns (N, T, H, W, 3) uint8.
    ``--sampler student`` (a ``ditforge distill`` run's default): the call steps with the student's K-step sampler
    in place of its scheduler (``student.student_scheduler``), every segment.

    Raises:
        UserError: under torchrun; a video file that is missing or unreadable; ``driving_inputs``'s; a ``--sampler``
            other than student; student with ``--cfg_scale`` > 1 (one line each).
    """
    from ditforge.data.video import probe_video, read_clip
    from ditforge.models.adapters.pipeline import generate_with_pipeline
    from ditforge.models.adapters.pipeline import pipeline_defaults
    from ditforge.sample.video_vae import cast_vae
    from ditforge.sample.write import write_videos
    from PIL import Image

    if d.world_size > 1:
        raise UserError(f"--sequence_parallel_size / --cfg_parallel: {pre.pipeline_class} samples in one process")
    if cfg.sampler not in (None, STUDENT_SAMPLER):
        raise UserError(f"--sampler {cfg.sampler}: {pre.pipeline_class} steps with its own scheduler; leave --sampler "
                        f"out, or give --sampler {STUDENT_SAMPLER} (a distilled student's steps)")
    videos = {}
    for name in DRIVING_FLAGS:
        if (path := getattr(cfg, name)) is None:
            continue
        if not Path(path).is_file():
            raise UserError(f"--{name} {path}: no such file")
        try:
            frames, _ = read_clip(path, int(probe_video(path)["num_frames"]), 1, lambda _: 0)
        except Exception as e:  # PyAV's and the reader's errors for a file that is no video
            raise UserError(f"--{name} {path}: not a readable video ({type(e).__name__})") from None
        videos[name] = [Image.fromarray(f) for f in frames]
    inputs = {**denoiser.driving_inputs(pre.pipe, videos, cfg.mode), "image": image}
    if cfg.segment_frame_length is not None:
        inputs["segment_frame_length"] = cfg.segment_frame_length
    if cfg.vae_dtype is not None:  # the pipeline encodes and decodes in its VAE's dtype
        cast_vae(pre.pipe.vae, cfg.vae_dtype)
    defaults = pipeline_defaults(pre.pipe)
    size = (cfg.height or defaults["height"], cfg.width or defaults["width"])
    seeds = [derive_seed(cfg.seed, i) for i in range(len(prompts))]
    steps = cfg.num_sampling_steps or defaults["num_inference_steps"]
    scale = cfg.cfg_scale if cfg.cfg_scale is not None else defaults["guidance_scale"]
    scheduler = None
    if cfg.sampler == STUDENT_SAMPLER:
        from ditforge.sample.student import student_scheduler

        if scale > 1:
            raise UserError(f"--sampler {STUDENT_SAMPLER}: a student samples without guidance; --cfg_scale {scale:g} "
                            "asks for guidance; give --cfg_scale 1")
        scheduler = student_scheduler(pre, denoiser, size, inputs.get("segment_frame_length", defaults["num_frames"]),
                                      steps, pre.device)
    pixels = generate_with_pipeline(pre, denoiser, prompts, seeds, size, steps, scale, negative=cfg.negative_prompt,
                                    call_inputs=inputs, scheduler=scheduler)
    samples = to_uint8(pixels)  # (N, T, H, W, 3)
    write_videos(samples, Path(cfg.out or "samples"), [slug(p) for p in prompts], cfg.fps or denoiser.fps)
    return samples
