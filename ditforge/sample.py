"""``ditforge sample``: load a checkpoint, draw guided samples for class labels or text prompts, decode them with
the run's VAE, and write a PNG grid (image models) or one MP4 + GIF per sample (video models)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ditforge.atomic import atomic_path
from ditforge.data.images import save_grid, to_uint8
from ditforge.data.sampler import derive_seed
from ditforge.config import COMPILE_MODES, SAMPLING_PRECISIONS, resolve_precision
from ditforge.diffusion import SAMPLERS, generate
from ditforge.diffusion.pab import PABConfig
from ditforge.encoders.vae import VAE, IdentityVAE, load_vae
from ditforge.errors import UserError
from ditforge.models import create_model, infer_dit_config, is_video_model
from ditforge.ops.attention import set_frame_exchange, set_sequence_attention
from ditforge.parallel.mesh import Dist, init_distributed, shutdown
from ditforge.train.checkpoint import export_safetensors, load_weights, read_checkpoint_weights

log = logging.getLogger(__name__)

# Keys of a run config's "model" section that older configs lack, and what they meant then.
SPEC_DEFAULTS = dict(condition="class", text_encoder=None, text_max_length=None, vae="none", qk_norm=False,
                     num_frames=None, text_dim=None, class_dropout_prob=0.1)


@dataclass
class SampleConfig:
    """Settings of ``ditforge sample`` (see ``ditforge sample --help``).

    ``prompt`` / ``prompt_file`` are for text-conditioned models, ``class_labels`` / ``num_samples`` for class
    models. ``image_size`` is the output side in pixels (the model's input size is ``image_size`` / the VAE's
    downsample factor); ``num_frames`` overrides a video model's (latent) frame count. ``out`` defaults to
    ``samples.png`` (image models: a PNG grid) or ``samples`` (video models: a folder of MP4s and GIFs).
    Speed: ``mixed_precision`` (auto: bf16 on CUDA), ``compile``, ``enable_*`` as ``prepare_model``; ``pab`` turns
    on Pyramid Attention Broadcast with ``PABConfig``'s defaults, ``fora`` FORA's static caching with that interval
    (``PABConfig.fora``); they change the samples (README: their PSNR / SSIM).
    """

    ckpt: str
    model: str | None = None
    image_size: int | None = None
    class_labels: list[int] | None = None
    num_samples: int | None = None
    prompt: list[str] | None = None
    prompt_file: str | None = None
    num_frames: int | None = None
    cfg_scale: float = 4.0
    num_sampling_steps: int = 250
    sampler: str | None = None
    eta: float = 0.0
    seed: int = 0
    batch_size: int = 256
    out: str | None = None
    save_npz: str | None = None
    fps: int = 8
    vae: str | None = None
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


def _read(ckpt: str, use_ema: bool) -> tuple[dict | Path, dict]:
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


def _check_precision(name: str) -> None:
    if name not in SAMPLING_PRECISIONS:
        raise UserError(f"--mixed_precision: expected {' | '.join(SAMPLING_PRECISIONS)} for sampling, got {name}")


def _check_fp8(d: Dist) -> None:
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
    where no GEMM memsets, 2.08 ms either way (H200, 2026-11-27, torch 2.11.0+cu130; ``benchmarks/gemm_memsets.py``).
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
    _check_precision(mixed_precision)
    if mixed_precision == "fp8":
        _check_fp8(d)
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


def _build(ckpt: str, state: dict | Path, spec: dict, use_ema: bool, rebuild_fixed: bool = False) -> torch.nn.Module:
    """The model ``spec`` describes, with the checkpoint's weights (strict). ``rebuild_fixed``: keep the model's
    own values of its untrained parameters (the fixed sin-cos position embeddings, ``requires_grad=False``)
    instead of the checkpoint's, which were computed for another token grid."""
    model = create_model(spec["model"], spec["input_size"], spec["in_channels"], spec["num_classes"],
                         spec["learn_sigma"], spec["class_dropout_prob"], num_frames=spec["num_frames"],
                         text_dim=spec["text_dim"], qk_norm=spec["qk_norm"])
    config = spec.get("run_config") or {}
    if config.get("model", {}).get("lora_rank"):  # a DiT LoRA run: its base weights come from its --init_from
        from ditforge.train.finetune import load_dit_lora

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
    state, spec = _read(ckpt, use_ema)
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
    return _build(ckpt, state, spec, use_ema, rebuild), spec


def read_prompts(prompts: list[str] | None, prompt_file: str | None) -> list[str]:
    """The prompts of ``--prompt`` (in order), then those of ``--prompt_file`` (one per non-empty line, stripped).

    Raises:
        UserError: an empty ``--prompt``; a prompt file that is missing, unreadable, not UTF-8, or has no prompt.
    """
    out = []
    for p in prompts or []:
        if not p.strip():
            raise UserError("--prompt: empty prompt")
        out.append(p.strip())
    if prompt_file is not None:
        try:
            lines = Path(prompt_file).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise UserError(f"--prompt_file {prompt_file}: no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--prompt_file {prompt_file}: unreadable ({type(e).__name__}: {e})") from None
        found = [line.strip() for line in lines if line.strip()]
        if not found:
            raise UserError(f"--prompt_file {prompt_file}: no prompts (expected one prompt per non-empty line)")
        out.extend(found)
    return out


def slug(text: str, max_len: int = 48) -> str:
    """A file-name part for a prompt: lower-case ASCII letters and digits, other runs as one ``-``, at most
    ``max_len`` characters; ``"prompt"`` when nothing is left. ``"A red car, at night!"`` -> ``a-red-car-at-night``."""
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:max_len].rstrip("-")
    return s or "prompt"


def _load_vae(cfg: SampleConfig, spec: dict, device: torch.device) -> VAE | IdentityVAE:
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


def _load_encoder(cfg: SampleConfig, spec: dict, device):
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


def _encode_prompts(cfg: SampleConfig, spec: dict, prompts: list[str], device, encoder=None,
                    one_by_one: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(states (N, L, D_text) float32, mask (N, L) bool) on ``device``, in batches padded to one length L.
    ``one_by_one``: encode each prompt alone and pad to the encoder's ``max_length``, so a prompt's states do
    not depend on which prompts share its batch (streaming and resuming)."""
    from ditforge.encoders.text import pad_states

    encoder = encoder if encoder is not None else _load_encoder(cfg, spec, device)
    step = 1 if one_by_one else cfg.batch_size
    parts = [encoder.encode(prompts[i : i + step]) for i in range(0, len(prompts), step)]
    length = encoder.max_length if one_by_one else max(s.shape[1] for s, _ in parts)
    padded = [pad_states(s, m, length) for s, m in parts]
    return torch.cat([s for s, _ in padded]).float(), torch.cat([m for _, m in padded])


def sample(cfg: SampleConfig) -> np.ndarray:
    """Draw samples and write them.

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
    ``_sample_npz``). Labels cycle as above (sample i has label i mod C), so every class has N/C samples.

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
    if not 2 <= cfg.num_sampling_steps <= 1000:
        raise UserError(f"--num_sampling_steps: expected 2..1000, got {cfg.num_sampling_steps}")
    for name in ("num_samples", "batch_size", "fps", "image_size", "num_frames"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UserError(f"--{name}: expected a positive integer, got {value}")
    _check_precision(cfg.mixed_precision)
    if cfg.compile not in COMPILE_MODES:
        raise UserError(f"--compile: expected one of {', '.join(COMPILE_MODES)}, got {cfg.compile}")
    if cfg.compile != "none" and cfg.sequence_parallel_size > 1:  # --cfg_parallel's gather is outside the model
        raise UserError(f"--compile {cfg.compile}: not with --sequence_parallel_size > 1 (collectives inside a "
                        "compiled, CUDA-graph-replayed model are untested); drop --compile")
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


def _sample(cfg: SampleConfig, prompts: list[str], d: Dist) -> np.ndarray:
    if cfg.mixed_precision == "fp8":  # before the checkpoint is read
        _check_fp8(d)
    evaluation = cfg.save_npz is not None and cfg.out is None and not prompts  # _sample_npz: processes split samples
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
    device = d.device
    state, spec = _read(cfg.ckpt, cfg.use_ema)
    if spec.get("family"):
        return _sample_pipeline(cfg, prompts, d, state, spec)
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

    vae = _load_vae(cfg, spec, device)
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
    model = _build(cfg.ckpt, state, spec, cfg.use_ema, rebuild)
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
        return _stream(cfg, d, model, vae, spec, prompts, out, video)
    if evaluation:
        return _sample_npz(cfg, d, model, vae, spec, labels, video)
    if text:
        y, y_mask = _encode_prompts(cfg, spec, prompts, device)
        names = [slug(p) for p in prompts]
    else:
        y, y_mask = torch.tensor(labels, dtype=torch.long, device=device), None
        names = [f"class-{c}" for c in labels]
    shape = _sample_shape(spec, video)
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    latents = _generate(cfg, d, model, spec, vae, shape, y, y_mask, generator=g, batch_size=cfg.batch_size)
    del model
    if not d.is_main:
        return np.empty(0, dtype=np.uint8)
    samples = np.concatenate([to_uint8(vae.decode(latents[i : i + cfg.batch_size]).float())
                              for i in range(0, len(latents), cfg.batch_size)])
    if video:
        _write_videos(samples, out, names, cfg.fps)
    else:
        nrow = min(len(samples), 8 if text or cfg.class_labels is not None else spec["num_classes"])
        save_grid(samples, out, nrow=nrow, upscale=max(1, 64 // samples.shape[1]))
        log.info("wrote %d samples (%dx%d) to %s", len(samples), samples.shape[2], samples.shape[1], out)
    if cfg.save_npz:
        extra = {"prompts": np.array(prompts, dtype=str)} if text else {"labels": np.asarray(labels, dtype=np.int64)}
        _save_npz(cfg.save_npz, samples=samples, **extra)
        log.info("wrote %s", cfg.save_npz)
    return samples


def _sample_pipeline(cfg: SampleConfig, prompts: list[str], d: Dist, state, spec: dict) -> np.ndarray:
    """A fine-tuned diffusers pipeline (``ditforge train --init_from FOLDER``): its own pipeline class and
    scheduler draw ``num_sampling_steps`` steps with guidance ``cfg_scale``; sample i starts from the noise of seed
    ``derive_seed(seed, i)``. Writes one PNG grid (``out``, default samples.png) and the optional .npz."""
    from ditforge.train.finetune import generate_with_pipeline, load_finetuned

    if d.world_size > 1:
        raise UserError("--sequence_parallel_size / --cfg_parallel: a fine-tuned diffusers pipeline samples in one "
                        "process")
    if not prompts:
        raise UserError(f"--prompt: {cfg.ckpt} is a text-to-image pipeline; give --prompt \"...\" (repeatable) or "
                        "--prompt_file FILE")
    if cfg.class_labels is not None or cfg.num_samples is not None:
        raise UserError("--class_labels/--num_samples: the model is text-conditioned; give --prompt or --prompt_file")
    pre, denoiser, run = load_finetuned(state, spec["run_config"], d.device, cfg.use_ema)
    size = cfg.image_size or run.data.image_size
    seeds = [derive_seed(cfg.seed, i) for i in range(len(prompts))]
    pixels = generate_with_pipeline(pre, denoiser, prompts, seeds, size, cfg.num_sampling_steps, cfg.cfg_scale,
                                    cfg.batch_size)
    images = to_uint8(pixels)
    out = cfg.out or "samples.png"
    save_grid(images, out, nrow=min(len(images), 8))
    if cfg.save_npz:
        _save_npz(cfg.save_npz, samples=images, prompts=np.array(prompts))
    log.info("wrote %d samples of %s to %s", len(images), pre.pipeline_class, out)
    return images


def _generate(cfg: SampleConfig, d: Dist, model, spec: dict, vae, shape: tuple[int, ...], y: torch.Tensor,
              y_mask: torch.Tensor | None, **noise) -> torch.Tensor:
    """``generate`` with the command's sampler, guidance, PAB and CFG-parallel settings; ``noise``: generator or
    seeds, and batch_size. Pixel-space samples are clipped to [-1, 1] at each step, latents are not. With
    ``cfg_parallel`` the two halves of the guided batch run on the two rows of the (dp, sp) mesh."""
    cfg_group = None
    if cfg.cfg_parallel:
        cfg_group = (d.sp_mesh["dp"] if d.sp_mesh is not None else d.mesh).get_group()
    objective = spec.get("objective") or "ddpm"
    sampler = cfg.sampler or ("euler" if objective == "flow" else "ddpm")
    if objective == "flow" and sampler != "euler":
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


def _sample_shape(spec: dict, video: bool) -> tuple[int, ...]:
    s = spec["input_size"]
    return (spec["in_channels"], spec["num_frames"], s, s) if video else (spec["in_channels"], s, s)


def _stream(cfg: SampleConfig, d: Dist, model, vae, spec: dict, prompts: list[str], out: Path,
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
    encoder = _load_encoder(cfg, spec, device) if todo else None
    shape = _sample_shape(spec, video)
    drawn = []
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), unit="sample", desc="samples",
               disable=not d.is_main)
    for start in range(0, len(todo), cfg.batch_size):
        rows = todo[start : start + cfg.batch_size]
        y, y_mask = _encode_prompts(cfg, spec, [prompts[i] for i in rows], device, encoder, one_by_one=True)
        latents = _generate(cfg, d, model, spec, vae, shape, y, y_mask,
                            seeds=[derive_seed(cfg.seed, i) for i in rows], batch_size=len(rows))
        if d.is_main:
            samples = to_uint8(vae.decode(latents).float())
            for i, sample_i in zip(rows, samples):
                if video:
                    _write_video_files(sample_i, stems[i], cfg.fps)
                else:
                    save_grid(sample_i[None], stems[i].with_suffix(".png"), nrow=1, pad=0)
            drawn.append(samples)
        bar.update(len(rows))
    bar.close()
    if d.is_main:
        log.info("wrote %d new samples to %s", sum(len(a) for a in drawn), out)
    return np.concatenate(drawn) if drawn else np.empty(0, dtype=np.uint8)


def _sample_npz(cfg: SampleConfig, d: Dist, model, vae, spec: dict, labels: list[int], video: bool) -> np.ndarray:
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
    shape = _sample_shape(spec, video)
    bar = tqdm(total=sum(map(len, batches)), unit="sample", desc="samples", disable=not d.is_main)
    for rows in batches:
        y = torch.tensor([labels[i] for i in rows], dtype=torch.long, device=d.device)
        latents = _generate(cfg, d, model, spec, vae, shape, y, None, seeds=[derive_seed(cfg.seed, i) for i in rows],
                            batch_size=len(rows))
        _save_npz(parts / f"part-{rows[0]:07d}.npz", index=np.asarray(rows, dtype=np.int64),
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
    _save_npz(cfg.save_npz, arr_0=samples, arr_1=np.asarray(labels, dtype=np.int64))
    shutil.rmtree(parts)
    log.info("wrote %d samples (%s) and their labels to %s", n, "x".join(map(str, samples.shape[1:])), cfg.save_npz)
    return samples


def _read_part(path: Path, key: str) -> np.ndarray:
    with np.load(path) as f:
        return f[key]


def _write_video_files(frames: np.ndarray, stem: Path, fps: int) -> None:
    """Write (T, H, W, C) uint8 frames as ``stem.mp4`` and ``stem.gif`` (grey is repeated to RGB); the GIF is
    written last, so an existing GIF marks a complete pair."""
    from ditforge.data.video import display_scale, write_gif, write_video

    if frames.shape[-1] == 1:
        frames = frames.repeat(3, axis=-1)
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_video(frames, stem.with_suffix(".mp4"), fps)
    write_gif(frames, stem.with_suffix(".gif"), fps)
    k = display_scale(*frames.shape[1:3])
    log.info("wrote %s.mp4 and .gif: %d frames of %dx%d (shown %dx enlarged) at %d fps", stem, len(frames),
             frames.shape[2], frames.shape[1], k, fps)


def _write_videos(videos: np.ndarray, folder: Path, names: list[str], fps: int) -> None:
    """Write (N, T, H, W, C) uint8 videos as ``folder/NNN-name.mp4`` plus ``.gif`` (grey is repeated to RGB)."""
    width = max(3, len(str(len(videos) - 1)))
    for i, (frames, name) in enumerate(zip(videos, names)):
        _write_video_files(frames, folder / f"{i:0{width}d}-{name}", fps)
    log.info("wrote %d videos to %s", len(videos), folder)


def export(ckpt: str, out: str, use_ema: bool = True) -> Path:
    """``ditforge export``: consolidate a checkpoint (sharded or not) into one safetensors file for sampling,
    with the run config in its metadata. Returns the file written."""
    model, spec = load_model(ckpt, use_ema=use_ema)
    config = spec.pop("run_config") or {"model": spec}
    export_safetensors(model.state_dict(), config, Path(out))
    log.info("wrote %s weights of %s to %s", "EMA" if use_ema else "raw", spec["model"], out)
    return Path(out)


def _save_npz(path: str, **arrays: np.ndarray) -> None:
    with atomic_path(path, suffix=".npz") as tmp:  # np.savez appends .npz to other names
        np.savez(tmp, **arrays)
