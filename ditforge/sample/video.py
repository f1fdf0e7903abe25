"""The video families of diffusers that ditforge adapts (``models.adapters``, text- and image-to-video)
sampled by ditforge's own loop instead of the pipeline's ``__call__``: the pipeline's scheduler, conditioning and VAE,
with the conditional and unconditional passes in one batch (or on two GPUs), the transformer in bf16 or with float8
linear layers, compiled block by block, split over GPUs along its tokens (context parallelism by diffusers' plan or
ditforge's: Ulysses and ring attention), optionally with diffusers' step caching (First Block Cache, TaylorSeer), and
the VAE decode split in tiles over the GPUs.

The arithmetic follows the family's diffusers pipeline ``__call__`` (each adapter's docstring names its source
file), with each family's differences behind its adapter (``models.adapters``); ``tests/test_sample_video.py`` and
the family tests in ``tests/finetune`` check that the loop gives the pipeline's frames from the same noise."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ditforge.config.values import resolve_precision
from ditforge.data.captions import slug
from ditforge.data.images import to_uint8
from ditforge.data.sampler import derive_seed
from ditforge.encoders.vae import VAE
from ditforge.errors import UserError
from ditforge.models import is_block
from ditforge.models.adapters import by_expert
from ditforge.models.adapters.pipeline import pipeline_defaults
from ditforge.parallel.context import refuse_unsplittable, split_tokens, token_mesh
from ditforge.parallel.mesh import Dist
from ditforge.sample.video_vae import cast_vae, decode, decode_split, enable_vae_tiles
from ditforge.sample.load import SampleConfig, read_control
from ditforge.sample.student import student_latents
from ditforge.sample.write import video_file_out, write_video_file

log = logging.getLogger(__name__)


class VideoSampler:
    """A video family's transformer made fast for sampling, and the guided loop around it.

    Preparation, in this order (each changes the module in place):

    - weights cast to the compute dtype (``mixed_precision``: auto is bf16 on CUDA, fp32 on CPU; fp8 is bf16);
    - ``fp8``: the linear layers of the repeated blocks as ``ops.fp8.RowwiseFloat8Linear`` (``parallel.apply_fp8``:
      e4m3 weights with one scale per output channel, each activation row scaled by its own maximum; H100-class
      GPU and Triton);
    - ``sequence_parallel_size`` > 1: diffusers' context parallelism (``parallel.context``:
      ``ModelMixin.enable_parallelism`` with a ``ContextParallelConfig`` on the ``ring`` x ``ulysses`` part of
      ``mesh``): every block's tokens are split over the group and attention runs Ulysses (all-to-all over
      heads), ring (rotating K/V), or both (USP). ``auto`` puts as many processes on Ulysses as the head count
      allows (the largest divisor of both) and the rest on ring. A family whose adapter declares ditforge's plan
      (``cp_plan``, ``cp_text``: the text whole on every process) splits by it, Ulysses only;
    - ``plugin`` fsdp: every repeated block and the rest of the transformer sharded over all processes (FSDP2's
      ``fully_shard`` on the 1-D mesh of the world: each process holds 1 / N of the weights, and a block's are
      gathered for its forward and freed after it), for a model that does not fit one GPU with room for its
      activations (a 14B model's 28 GB of bf16 weights on 24 GB cards). The weights are cast on the host and move to
      the GPU as shards. Composes with ``cfg_parallel`` and context parallelism, whose processes run the same
      blocks in the same order;
    - step caching (``step_cache``), one of: ``first_block_cache`` (a threshold), diffusers' First Block Cache
      (ParaAttention; TeaCache's idea): when the first block's residual changed by less than this mean relative L1
      distance since the last full pass, the other blocks' residual of that pass is reused; ``taylorseer_cache``
      (an interval N), diffusers' TaylorSeer cache (lite): a full pass every N steps after the first 3, and in
      between the blocks skipped and the output forecast to first order;
    - ``quantized_attention``: the transformer's self-attention through ``ops.quant_attention`` (int8 Q K^T,
      float8 P V; SageAttention's scaling), routed at diffusers' attention dispatcher, or at the SDPA call of a
      processor that calls PyTorch itself (``models.adapters.dispatch``); cross-attention and masked attention
      stay on diffusers' default (a masked joint attention takes the kernel once unmasked, below);
    - ``enable_flashattn`` (without ``quantized_attention``): the same routing to ``ops.flash4``'s exact attention,
      FlashAttention-4 where it is installed and measured faster at the shape, else SDPA in ``fast_backends`` order;
    - a family whose attention always carries a mask (``masked_self_attention``: the text padding of a joint
      attention): the
      padding cropped from the conditioning (the adapter's ``trim_padding``) and, when every mask is then all True
      (batch 1), the attention run without them (``models.adapters.dispatch.unmask_full_attention``), so SDPA takes
      its Flash / cuDNN kernels;
    - ``compile``: each repeated block compiled (``torch.compile``, static shapes but a cropped text's length;
      ``fullgraph`` unless context parallelism, whose split is a hook diffusers' way of reading arguments keeps
      dynamo from tracing; a cache's hooks wrap the compiled forwards, so its decisions stay on the host), as
      diffusers' ``compile_repeated_blocks``.
      No CUDA graphs: a step of a 480x832x81 clip of a 1.3B model takes about a second, which launches do not bound.

    The VAE's weights are cast to ``vae_dtype`` (None: kept as loaded, float32), and its decoder compiled under
    ``compile`` when one process decodes (``encoders.vae.VAE.compile``; benchmarks/vae_decode.py times both against
    diffusers' float32 decode); the split decode below runs eager.
    The VAE decodes in spatial tiles of ``vae_tile`` pixels (diffusers' tiled decode), or whole frames; under
    torchrun, a VAE the adapter declares splittable (``vae_split_decode``) over all processes, by default each
    decoder call in bands of rows (``parallel.vae_decode.split_decoder``, the one-process frames), with
    ``--vae_parallel strips`` one column strip a process; another family's on process 0 (``decode``).

    With ``cfg_group`` (a process group of 2; ``--cfg_parallel``) process 0 of the group runs the conditional pass
    and process 1 the unconditional one; the two are gathered before guidance, so every process keeps the same
    latents. First Block Cache then decides on each half alone (one process decides on the pair), so its video can
    differ from one process's where a skip happens.

    Raises:
        UserError: fp8 or quantized attention without an FP8 GPU or Triton, quantized attention under sequence
            parallelism; a sequence-parallel size the token count or heads cannot take (diffusers' message), or
            for a family whose tokens are not split (``context_parallel``); First Block Cache under sequence
            parallelism or for a family that adds between its blocks (``adds_between_blocks``); step caching with fsdp; fsdp with fp8 or in one process.
    """

    def __init__(self, pre, denoiser, d: Dist, cfg: SampleConfig):
        self.pre, self.device = pre, d.device
        self.dtype = resolve_precision(cfg.mixed_precision, d.device)
        pipe = pre.pipe
        # a pipeline of two experts: the first (``transformer``) runs the steps at t >= the adapter's
        # expert_boundary x 1000, the second (``transformer_2``) the rest (the family's pipeline __call__)
        # (the denoiser is one of them: the one a fine-tuned run of such a pipeline trained, --expert; a run of both
        # holds both, each then behind an adapter of its own, prepared once)
        one = len(denoiser.expert_models()) == 1
        self.experts = [denoiser if one and denoiser.inner is model else _wrap(denoiser, model, pipe)
                        for model in (pipe.transformer, getattr(pipe, "transformer_2", None)) if model is not None]
        ratio = denoiser.expert_boundary(pipe) if len(self.experts) > 1 else None
        self.boundary = None if ratio is None else ratio * pipe.scheduler.config.num_train_timesteps
        self.cache = step_cache(cfg)  # (flag, diffusers cache config) or None
        self.student = cfg.sampler == "student"  # a distilled student's K steps (_student), no guidance
        self.is_main = d.is_main
        self.vae = VAE(pipe.vae, frame_factor=denoiser.vae_frame_factor,
                       folds_pixels=denoiser.vae_folds_pixels)  # the family's latent normalisation
        vae = pipe.vae
        if cfg.vae_dtype is not None:  # the decode runs in the weights' dtype (VAE.unscale casts the latents)
            cast_vae(vae, cfg.vae_dtype)
        if cfg.vae_tile:
            enable_vae_tiles(vae, cfg.vae_tile)
        self.vae_modules = denoiser.vae_halo_modules, denoiser.vae_whole_modules  # the adapter's, for split_decoder
        self.split = decode_split(d, denoiser, vae, cfg)
        self.decode_group = d.mesh.get_group() if self.split else None
        if self.split and d.is_main:
            log.info("VAE decode over %d processes: %s", d.world_size,
                     "bands of rows (exact)" if self.split == "patch" else "column strips (approximate)")
        if cfg.compile != "none" and self.split is None:  # (the split's halo exchange stays out of a graph)
            self.vae.compile()
        self.cfg_group = self.cfg_rank = None
        if cfg.cfg_parallel:
            self.cfg_group = (d.sp_mesh["dp"] if d.sp_mesh is not None else d.mesh).get_group()
            self.cfg_rank = dist.get_rank(self.cfg_group)
        if d.sp_size > 1 and cfg.first_block_cache is not None:  # TaylorSeer's fixed schedule skips on all alike
            raise UserError("--first_block_cache: not with --sequence_parallel_size > 1 (each process would decide on "
                            "its own slice of the tokens, and a skip on one would hang the others); use "
                            "--cfg_parallel, --taylorseer_cache, or drop --first_block_cache")
        if cfg.first_block_cache is not None and denoiser.adds_between_blocks:
            raise UserError(f"--first_block_cache: {type(denoiser.inner).__name__} adds to its hidden states between "
                            "its blocks, which a skipped pass would add twice; use --taylorseer_cache N")
        self.shard = cfg.plugin == "fsdp"
        if self.shard and d.mesh is None:
            raise UserError("--plugin fsdp: shards the transformer over the processes of torchrun; in one process "
                            "drop it")
        if self.shard and (self.cache is not None or cfg.mixed_precision == "fp8"):
            other = (f"{self.cache[0]} (a skipped block on one process would leave the others waiting in a gather)"
                     if self.cache is not None else "--mixed_precision fp8")
            raise UserError(f"--plugin fsdp: not with {other}; drop one of them")
        if cfg.quantized_attention:
            _check_quantized_attention(d, denoiser)
        refuse_unsplittable(type(denoiser), d.sp_size, "use --cfg_parallel, or one process a video")
        self.unmasked = []  # dispatch.Unmask markers of the experts' attention
        self.quantized = cfg.quantized_attention
        mesh = token_mesh(self.transformer, d, cfg.sequence_parallel_type) if d.sp_size > 1 else None
        for expert in self.experts:
            self._prepare(expert, d, cfg, mesh)

    @property
    def transformer(self) -> torch.nn.Module:
        """The (first) diffusers transformer."""
        return self.experts[0].inner

    def _prepare(self, denoiser, d: Dist, cfg: SampleConfig, mesh) -> None:
        """One expert made fast, in place: dtype, shards, fp8, context parallelism, First Block Cache, compile."""
        transformer = denoiser.inner
        blocks = [m for m in transformer.modules() if is_block(m, denoiser.block_classes)]
        denoiser.to(dtype=self.dtype).eval().requires_grad_(False)
        if self.shard:  # before the move: the whole model never is on one GPU
            from torch.distributed.fsdp import fully_shard

            for block in blocks:
                fully_shard(block, mesh=d.mesh)
            # the root frees its gathered weights after each forward too (by default it keeps them for a backward)
            fully_shard(transformer, mesh=d.mesh, reshard_after_forward=True)  # moves shards and buffers to the device
            params = list(transformer.parameters())
            log.info("fsdp: %d of the transformer's %d weights held by this process",
                     sum(p.to_local().numel() for p in params), sum(p.numel() for p in params))
            denoiser._apply(lambda t: t.to(d.device), recurse=False)  # the adapter's own (null condition) buffers
        else:
            denoiser.to(device=d.device)
        if cfg.mixed_precision == "fp8":
            from ditforge.parallel import apply_fp8

            log.info("fp8: %d linear layers run float8 GEMMs", apply_fp8(denoiser, d.device, inference=True))
        if cfg.quantized_attention:
            from ditforge.models.adapters.dispatch import route_self_attention
            from ditforge.ops.quant_attention import HEAD_DIMS, ops, quantized_attention

            ops()  # registered before the blocks compile
            routed = route_self_attention(transformer, quantized_attention, HEAD_DIMS)
            if not routed:
                raise UserError(f"--quantized_attention: {type(transformer).__name__}'s attention processors make no "
                                "self-attention call ditforge can route (neither diffusers' dispatcher nor "
                                "F.scaled_dot_product_attention); drop the flag")
            log.info("quantized attention: %d self-attention modules run int8 Q K^T and float8 P V", routed)
        elif cfg.enable_flashattn:
            from ditforge.models.adapters.dispatch import route_exact_attention

            route_exact_attention(transformer, d.device)
        if mesh is not None:  # before the unmasking, whose mask drop then comes first in each call
            split_tokens(denoiser, d, mesh)
        if denoiser.masked_self_attention:  # unmasked while trim_padding leaves the masks full (denoise)
            from ditforge.models.adapters.dispatch import unmask_full_attention

            self.unmasked += unmask_full_attention(transformer)
        if cfg.compile != "none":
            from torch._inductor import list_mode_options

            mode = "max-autotune-no-cudagraphs" if cfg.compile.startswith("max-autotune") else "default"
            # static shapes, but a masked family's text, cropped to each video's own length (trim_padding): dynamic
            # after its second length (automatic dynamic shapes), where one graph a length would meet dynamo's
            # recompile limit (8) within a prompt file
            options = dict(fullgraph=mesh is None, dynamic=None if denoiser.masked_self_attention else False,
                           options=dict(list_mode_options(mode)))
            for block in blocks:
                # the hooks of context parallelism (block 0 splits its input) are not traceable whole: those
                # blocks compile in parts. FSDP's gathers are hooks that dynamo does not trace (it finds no frame),
                # and a cache's decision is host-side: there a block compiles its forward, inside those hooks
                if self.shard or self.cache is not None:
                    block.forward = torch.compile(block.forward, **options)
                else:
                    block.compile(**options)
        if self.cache is not None:  # after the compile: its hooks wrap the compiled forwards
            transformer.enable_cache(self.cache[1])

    def denoise(self, cond: dict, uncond: dict | None, shape: tuple[int, ...], seed: int, steps: int,
                guidance: float, image_cond: dict | None = None, progress: bool = False,
                guidance_2: float | None = None) -> torch.Tensor:
        """One video's latents (1, C, T', h, w) float32 from the noise of ``torch.Generator(device).manual_seed(seed)``
        (drawn as the pipeline's ``prepare_latents`` draws it), after ``steps`` steps of a fresh copy of the
        pipeline's scheduler. ``cond`` / ``uncond``: the denoiser's text conditioning tensors (batch 1) of the
        prompt and the negative prompt (None: no guidance); ``image_cond``: an image-to-video family's image
        tensors, the same for both passes, or a function of the generator giving them (drawn first). Guidance:
        ``uncond + guidance (cond - uncond)`` in float32; a second (low-noise) expert guides with ``guidance_2``
        (default ``guidance``)."""
        if self.student:
            return self._student(cond, uncond, image_cond, shape, seed, steps)
        pipe, device = self.pre.pipe, self.device
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        scheduler.set_timesteps(steps, device=device, **self.experts[0].timestep_kwargs(pipe, shape, steps))
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        from diffusers.utils.torch_utils import randn_tensor

        # the noise is drawn, and the scheduler steps, in the pipeline's layout: frames first for a frames_first
        # family, whose DPM scheduler draws fresh noise of that shape from the same generator at each step
        swap = self.experts[0].frames_first
        generator = torch.Generator(device).manual_seed(seed)
        if callable(image_cond):  # drawn from the generator before the noise (image_from_generator)
            image_cond = image_cond(generator=generator)
        latents = randn_tensor(_layout(shape, swap), generator=generator, device=device, dtype=torch.float32)
        latents = latents * getattr(scheduler, "init_noise_sigma", 1.0)  # the DDPM-family schedulers scale it
        given = dict(image_cond or {})  # as encoded (float32): what finish puts back
        latents = _layout(self.experts[0].start(_layout(latents, swap), given), swap)
        step_args = inspect.signature(scheduler.step).parameters
        extra = {k: v for k, v in (("eta", 0.0), ("generator", generator)) if k in step_args}  # as the pipelines'
        two_step = "old_pred_original_sample" in step_args  # a step taking the last x0 estimate: a 2nd-order SDE solver
        old_x0 = None
        image_cond = {k: v.to(self.dtype) for k, v in given.items()}
        halves = [cond] if uncond is None else [cond, uncond]
        if self.cfg_group is not None:
            halves = [halves[self.cfg_rank]]
        inputs = {k: torch.cat([h[k] for h in halves]).to(self.dtype) for k in cond}
        inputs.update({k: v.expand(len(halves), *v.shape[1:]) for k, v in image_cond.items()})
        inputs, full = self.experts[0].trim_padding(inputs)
        for marker in self.unmasked:
            marker.full = full
        if self.unmasked and not full and self.quantized:
            log.warning("--quantized_attention: the guided passes' prompts differ in length, so the joint attention "
                        "keeps its mask and the exact kernel")
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if self.cache is not None:
                for expert in self.experts:
                    expert.inner._reset_stateful_cache()
                    stack.enter_context(expert.inner.cache_context("cfg"))
            timesteps = scheduler.timesteps
            for i, t in enumerate(tqdm(timesteps, desc="steps", unit="step", disable=not progress, leave=False)):
                low = self.boundary is not None and t < self.boundary
                x = _layout(latents, swap).to(self.dtype).expand(len(halves), *shape[1:])
                out = _layout(self.experts[int(low)].denoise(x, t.expand(len(halves)), **inputs).float(), swap)
                if self.cfg_group is not None:
                    parts = [torch.empty_like(out) for _ in range(2)]
                    dist.all_gather(parts, out.contiguous(), group=self.cfg_group)
                    out = torch.cat(parts)
                if uncond is not None:
                    pred, pred_uncond = out.chunk(2)
                    scale = guidance_2 if low and guidance_2 is not None else guidance
                    out = pred_uncond + scale * (pred - pred_uncond)
                if two_step:  # (model output, last x0 estimate, t, the previous t, sample), as its pipeline
                    latents, old_x0 = scheduler.step(out, old_x0, t, timesteps[i - 1] if i else None, latents,
                                                     return_dict=False, **extra)
                else:
                    latents = scheduler.step(out, t, latents, return_dict=False, **extra)[0]
        return self.experts[0].finish(_layout(latents, swap), given)

    def _student(self, cond: dict, uncond: dict | None, image_cond, shape: tuple[int, ...], seed: int,
                 steps: int) -> torch.Tensor:
        """A K-step (``steps``) student's latents (1, C, T', h, w) float32, no guidance (``student.student_latents``:
        DMD2's multi-step sampler, what ``ditforge distill`` trains through). A guidance-distilled student takes its
        embedded scale in ``cond`` (``guidance_inputs``), an image-to-video one ``image_cond`` as ``denoise`` does;
        a reference-image pipeline's control (``image_cond``) goes to every step, its prepended frames in the
        latents. A pipeline of two experts runs each step on the expert whose side of the boundary holds its t
        (``adapters.by_expert``, as ``denoise``), with that expert's student LoRA (merged).
        Raises UserError: guidance asked for (a student bakes it in), and ``student_latents``'."""
        if uncond:
            raise UserError(f"--sampler student: a student samples without guidance; {self.pre.pipeline_class} "
                            f"({type(self.pre.pipe.scheduler).__name__}): --cfg_scale > 1 asks for guidance; give "
                            "--cfg_scale 1")
        def student(x, t, given):
            inputs = {k: v.to(self.dtype) for k, v in {**cond, **given}.items()}

            def on(expert: int, rows):  # the whole batch (slice(None)) or the indices of one expert's rows
                return self.experts[expert].denoise(x[rows].to(self.dtype), t[rows],
                                                    **{k: v[rows] for k, v in inputs.items()}).float()

            return on(0, slice(None)) if self.boundary is None else by_expert(t, self.boundary, on)

        return student_latents(self.pre, self.experts[0], student, image_cond, shape, seed, steps, self.device)

    def decode(self, latents: torch.Tensor) -> torch.Tensor | None:
        """Latents (B, C, T', h, w) -> frames (B, 3, T, H, W) float in [-1, 1] on process 0, None on the others
        (``video_vae.decode``)."""
        return decode(self.vae, self.pre.pipe.vae, latents, self.split, self.decode_group, self.vae_modules,
                      self.is_main)


def _check_quantized_attention(d: Dist, denoiser) -> None:
    """``--quantized_attention``'s one-line refusals: no FP8 GPU (nor Triton's interpreter), a split sequence,
    heads the kernel does not take. (A family whose attention is masked, ``masked_self_attention``, takes the kernel
    while its masks are full, ``trim_padding``; a masked call keeps the exact kernel.)"""
    from ditforge.ops.quant_attention import HEAD_DIMS
    from ditforge.ops.triton import interpreting

    if d.device.type == "cuda" or not interpreting():
        from ditforge.parallel import fp8_unavailable

        reason = fp8_unavailable(d.device, inference=True)
        if reason:
            raise UserError(f"--quantized_attention: {reason}")
    if d.sp_size > 1:
        raise UserError("--quantized_attention: not with --sequence_parallel_size > 1 (the split sequence attends "
                        "through diffusers' context-parallel kernels); use --cfg_parallel, or drop one of them")
    width = getattr(denoiser.inner.config, "attention_head_dim", None)
    if width not in HEAD_DIMS:
        raise UserError(f"--quantized_attention: the kernel takes heads {', '.join(map(str, HEAD_DIMS))} wide; "
                        f"{type(denoiser.inner).__name__}'s are {width}")


def step_cache(cfg: SampleConfig) -> tuple[str, object] | None:
    """(the flag, its diffusers cache config) of the step caching asked for, or None; the command checks that one is
    given at most.

    - ``--first_block_cache T``: ``FirstBlockCacheConfig(threshold=T)`` (ParaAttention's First Block Cache,
      TeaCache's idea: Liu et al. 2024, arXiv 2411.19108): the other blocks' residual is reused while the first
      block's output moved by less than T (mean relative L1) since the last full pass. Adaptive: how many passes it
      skips depends on the weights.
    - ``--taylorseer_cache N``: ``TaylorSeerCacheConfig(cache_interval=N, max_order=1, use_lite_mode=True)``
      (TaylorSeer: Liu et al. 2025, arXiv 2503.06923, its Taylor forecast to first order; diffusers' lite variant):
      steps 0-2 and then 4, 4 + N, 4 + 2N, ... are full passes; at the others the blocks are skipped and the
      transformer's output (``proj_out``'s) is forecast from the last two full passes,
      ``f(k) + (s - k) (f(k) - f(j)) / (k - j)`` at step s (k, j the last two full steps; float32 factors). A fixed
      schedule: of 50 steps 26 are full at N = 2, 19 at N = 3. Its memory is two of the transformer's outputs.
    """
    if cfg.first_block_cache is not None:
        from diffusers.hooks import FirstBlockCacheConfig

        return "--first_block_cache", FirstBlockCacheConfig(threshold=cfg.first_block_cache)
    if cfg.taylorseer_cache is not None:
        from diffusers.hooks import TaylorSeerCacheConfig

        return "--taylorseer_cache", TaylorSeerCacheConfig(cache_interval=cfg.taylorseer_cache, max_order=1,
                                                           disable_cache_before_step=3,
                                                           taylor_factors_dtype=torch.float32, use_lite_mode=True)
    return None


def _wrap(denoiser, model: torch.nn.Module, pipe):
    """``model`` (another expert of ``denoiser``'s pipeline) behind the same adapter."""
    other = type(denoiser)(model, denoiser.vae_scale)
    other.attach_pipeline(pipe)
    return other


def _layout(x, swap: bool):
    """Latents (B, C, T', h, w) as (B, T', C, h, w) and back when ``swap`` (a shape tuple too); else ``x``."""
    if not swap:
        return x
    if isinstance(x, tuple):
        return (x[0], x[2], x[1], *x[3:])
    return x.transpose(1, 2)


def _video_targets(cfg: SampleConfig, prompts: list[str], d: Dist) -> tuple[Path | None, list[Path], list[int]]:
    """(the one video file ``--out`` names or None, each prompt's file, the prompts still to draw): a folder's
    ``NNN-<prompt slug>.mp4`` files that exist (with their ``.gif`` under ``--gif``) are done already."""
    one_file = video_file_out(cfg.out, len(prompts))
    if one_file is not None:
        return one_file, [one_file], list(range(len(prompts)))
    folder = Path(cfg.out or "samples")
    digits = max(3, len(str(len(prompts) - 1)))
    targets = [folder / f"{i:0{digits}d}-{slug(p)}.mp4" for i, p in enumerate(prompts)]
    todo = [i for i, t in enumerate(targets) if not (t.exists() and (not cfg.gif or t.with_suffix(".gif").exists()))]
    if d.is_main and len(todo) < len(prompts):
        log.info("%d of %d videos to draw into %s (%d done already)", len(todo), len(prompts), folder,
                 len(prompts) - len(todo))
    return None, targets, todo


def _settle(cfg: SampleConfig, pre, denoiser, run) -> tuple[int, int, int, int, float, VAE]:
    """The call's size, steps and guidance from the flags, the run and the pipeline's defaults, checked: (height,
    width, frames, steps, guidance, the VAE). Raises ``UserError`` (one line) for what the pipeline cannot take."""
    if cfg.pab or cfg.fora is not None:
        raise UserError("--pab/--fora: ditforge's step caching works on its own DiTs; a diffusers video pipeline "
                        "takes --first_block_cache THRESHOLD or --taylorseer_cache N")
    pipe = pre.pipe
    defaults = pipeline_defaults(pipe)
    size = run.data.image_size if run is not None else None
    height = cfg.height or cfg.image_size or size or defaults["height"]
    width = cfg.width or cfg.image_size or size or defaults["width"]
    frames = cfg.num_frames or (run.data.num_frames if run is not None else defaults["num_frames"])
    if cfg.sampler not in (None, "student"):
        raise UserError(f"--sampler {cfg.sampler}: a video pipeline steps with its own scheduler "
                        f"({type(pipe.scheduler).__name__}); leave --sampler out, or give --sampler student")
    # a distilled student: its few steps (default 4, DMD2's and LightX2V's), its guidance baked in
    student = cfg.sampler == "student"
    steps = cfg.num_sampling_steps or (4 if student else defaults["num_inference_steps"])
    # (a guidance-distilled family's student embeds its pipeline's scale, what ditforge distill embeds by default)
    guidance = cfg.cfg_scale if cfg.cfg_scale is not None else (
        1.0 if student and not denoiser.embedded_guidance else defaults["guidance_scale"])
    if cfg.cfg_scale_2 is not None and getattr(pipe, "transformer_2", None) is None:
        raise UserError(f"--cfg_scale_2: for a pipeline's low-noise expert (transformer_2); {pre.pipeline_class} at "
                        f"{cfg.ckpt} has one transformer")
    vae = VAE(pipe.vae, frame_factor=denoiser.vae_frame_factor, folds_pixels=denoiser.vae_folds_pixels)
    vae.check_frames(frames, f"the VAE of {pre.pipeline_class}")
    pre.refuse_size(height, width, frames, f"--height {height} --width {width} --num_frames {frames}")
    patch = denoiser.inner.config.patch_size
    patch = tuple(patch) if isinstance(patch, (list, tuple)) else (patch,)  # (p_t, p_h, p_w), or one side
    step = vae.downsample * patch[-1]
    for flag, value in (("--height", height), ("--width", width)):
        if value % step:
            raise UserError(f"{flag} {value}: {pre.pipeline_class} takes frame sides that are multiples of {step} "
                            f"(the VAE's {vae.downsample} x the {patch[-1]}-pixel patches)")
    if cfg.cfg_parallel and (guidance <= 1.0 or denoiser.embedded_guidance):
        raise UserError("--cfg_parallel: " + (f"{pre.pipeline_class} embeds --cfg_scale in one pass (guidance "
                                              "distilled): no unconditional pass to put on the second GPU"
                                              if denoiser.embedded_guidance else
                                              "--cfg_scale 1 runs no unconditional pass to put on the second GPU"))
    return height, width, frames, steps, guidance, vae


def sample_video_family(cfg: SampleConfig, prompts: list[str], d: Dist, pre, denoiser, run=None,
                        image=None) -> np.ndarray:
    """``ditforge sample`` for a video family (the adapter's ``video``): a pipeline folder (``run``
    None) or a fine-tuned run (``run``: its ``RunConfig``, whose frame size and count are the defaults). Each prompt
    is one video of
    ``height`` x ``width`` x ``num_frames`` (defaults: the run's, else the pipeline's, ``pipeline_defaults``),
    drawn by ``VideoSampler`` from the seed ``derive_seed(seed, i)`` for prompt i, guided against
    ``negative_prompt`` (default: the empty prompt, as the pipeline) with ``cfg_scale`` (default: the pipeline's;
    a second, low-noise expert with ``cfg_scale_2``, default the same; a guidance-distilled family
    (``embedded_guidance``) embeds it in its one pass),
    ``num_sampling_steps`` steps (default: the pipeline's). ``image`` (a PIL image) is the first frame of an
    image-to-video family. A reference-image family (``takes_references``) is conditioned on ``--reference_image``,
    ``--video`` and ``--mask`` (``read_control``) through the adapter's ``encode_control``; the R latent frames it
    prepends are dropped before decoding, as its pipeline does, and so are the frames a family's pipeline pads the
    latents with in front (the adapter's ``padding_frames``, for its temporal patches). ``sampler`` "student":
    ``VideoSampler._student``'s few-step recipe (default 4 steps, ``cfg_scale`` 1; a guidance-distilled family: the
    pipeline's scale, embedded).

    Writes (process 0): with one prompt and ``out`` a video file name (``clip.mp4``, ``.gif``, ...) that file;
    else ``out/NNN-<prompt slug>.mp4`` (default folder ``samples``) and, with ``gif``, a ``.gif`` beside it, a
    video written as soon as it is decoded; prompts whose files exist are skipped, so a re-run resumes.
    ``save_npz`` also writes the videos drawn, (N, T, H, W, 3) uint8, and their prompts.

    Returns:
        With ``save_npz``, the videos drawn in this run, (M, T, H, W, 3) uint8; else (and on processes other than
        0) an empty array: a written video is not kept.

    Raises:
        UserError: ``read_control``'s, a frame count the VAE cannot take, a frame size the latents and patches do not divide, a video
            file ``out`` for several prompts, speed settings this path lacks (``--pab`` / ``--fora``; use
            ``--first_block_cache`` or ``--taylorseer_cache``), and ``VideoSampler``'s.
    """
    from ditforge.sample.write import save_npz

    pipe = pre.pipe
    height, width, frames, steps, guidance, vae = _settle(cfg, pre, denoiser, run)
    one_file, targets, todo = _video_targets(cfg, prompts, d)
    if not todo:
        return np.empty(0, dtype=np.uint8)

    # Conditioning first, then the text encoders leave the GPU before the transformer is made fast.
    # the pipelines' do_classifier_free_guidance; a guidance-distilled model (embedded_guidance) takes the scale as an
    # input of its one pass instead (its pipeline's true CFG, off by default, is not offered)
    guided = guidance > 1.0 and not denoiser.embedded_guidance
    embedded = denoiser.guidance_inputs(guidance, 1)
    seen = {"images": [image]} if denoiser.prompt_sees_image else {}  # prompt_sees_image: its encoder reads the image
    conds = {i: {**{k: v.cpu() for k, v in pre.encode_prompt([prompts[i]], **seen).items()}, **embedded}
             for i in todo}  # GPU: one at a time
    uncond = pre.encode_prompt([cfg.negative_prompt or ""]) if guided else None  # (with a black image)
    latent_frames = vae.latent_frames(frames)
    # the frames the pipeline pads the latents with in front, cut before decoding as it does (ditforge distill
    # trains a student on the same)
    prepended = denoiser.padding_frames(latent_frames)
    shape = (1, denoiser.in_channels, latent_frames + prepended, height // vae.downsample, width // vae.downsample)
    image_cond = None
    if denoiser.takes_references:  # the control latents lead the latents (R reference frames), cut before decoding
        image_cond, references = denoiser.encode_control(pipe, *read_control(cfg, height, width, frames),
                                                         height, width, frames, pre.device)
        prepended += references
        shape = (*shape[:2], shape[2] + references, *shape[3:])
    if denoiser.image_to_video:  # for the padded clip, as the pipeline encodes it
        first = pipe.video_processor.preprocess(image, height=height, width=width)
        image_cond = functools.partial(pre.encode_image, first, frames + prepended * vae.temporal, images=[image])
        if not denoiser.image_from_generator:  # else drawn per video from its seed's generator (VideoSampler.denoise)
            image_cond = image_cond()
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module) and (name.startswith("text_encoder") or name == "image_encoder"):
            module.to("cpu")
    if d.device.type == "cuda":
        torch.cuda.empty_cache()

    if run is not None and run.model.lora_rank:  # the adapters folded into the weights: plain layers for fp8
        from ditforge.weights.lora import merge_lora  # (whose float8 weights peft's LoRA input cast would take)

        merge_lora(denoiser)
    sampler = VideoSampler(pre, denoiser, d, cfg)
    fps = cfg.fps or denoiser.fps
    drawn = []
    for i in tqdm(todo, desc="videos", unit="video", disable=not d.is_main or len(todo) == 1):
        cond = {k: v.to(d.device) for k, v in conds.pop(i).items()}
        latents = sampler.denoise(cond, uncond, shape, derive_seed(cfg.seed, i), steps, guidance, image_cond,
                                  progress=d.is_main, guidance_2=cfg.cfg_scale_2)[:, :, prepended:]
        pixels = sampler.decode(latents)  # every process decodes its share of the tiles
        if not d.is_main:
            continue
        pixels = denoiser.decoded_frames(pipe, pixels)
        video = to_uint8(pixels)[0]  # (T, H, W, 3)
        del pixels
        write_video_file(video, targets[i], fps)
        if cfg.gif and targets[i].suffix.lower() != ".gif":
            write_video_file(video, targets[i].with_suffix(".gif"), fps)
        if cfg.save_npz:  # else nothing of a written video stays in memory
            drawn.append(video)
    d.barrier()
    if not d.is_main:
        return np.empty(0, dtype=np.uint8)
    videos = np.stack(drawn) if drawn else np.empty(0, dtype=np.uint8)
    if cfg.save_npz:
        save_npz(cfg.save_npz, samples=videos, prompts=np.array([prompts[i] for i in todo]))
    log.info("wrote %d videos (%d frames of %dx%d) of %s to %s", len(todo), len(video), width, height,
             pre.pipeline_class, one_file or targets[0].parent)
    return videos
