"""The one resolution of a training run's settings: every setting the run decides from what it opened (the run
folder, the pretrained pipeline, the data set) rather than from its flags, computed and written into the config
once, before the model and optimizer are built (``resolve``; the trainer freezes the config right after); the
pipeline family a run fine-tunes, ``--random_flip``'s and ``--num_workers``' defaults, and the memory budget's
choices (``settle_budget``)."""

from __future__ import annotations

import copy
import itertools
import logging
import math
import os

import torch
from torch import nn

from ditforge.config.sections import RunConfig, assign
from ditforge.data import BUILTIN_DATASETS, source_of
from ditforge.data.features import read_manifest
from ditforge.data.prefetch import default_num_workers
from ditforge.data.shards.decode import LatentDecoder
from ditforge.data.shards.loader import ShardData
from ditforge.data.sources import FEATURES
from ditforge.diffusion.objective import create_objective
from ditforge.errors import UserError
from ditforge.models.adapters import family_of_pipeline
from ditforge.models.adapters.pipeline import is_adapted_pipeline, read_model_index
from ditforge.models.adapters.single_file import component_files
from ditforge.ops.fused_adamw import on_gpu_with_triton
from ditforge.optim.placement import plan_placement
from ditforge.train import finetune
from ditforge.weights.lora import lora_targets
from ditforge.train.build import Run, adapt, create_run_model, dit_dtype, sharded_on_meta
from ditforge.train.experts import TwoExperts, refuse_unsupported
from ditforge.train.validation import fit_samples

log = logging.getLogger(__name__)


def resolve(run: Run) -> RunConfig:
    """The run's settings resolved and written into ``run.cfg``, the one place they are written, once the run folder,
    the pretrained pipeline and the data set are open (``build.open_run``, ``load_init``, ``build_data``) and before the
    model and optimizer are built: first what those phases found (``run.found``: the run folder, the plugin, a features
    folder's pipeline, DiT weights' model settings, the default model, the data's and encoders' shapes), then both
    experts of a two-expert pipeline unless ``--expert`` names one, and their switch (``run.experts``), no periodic
    grid for a two-expert pipeline nor for a driven one (``trained_videos``), the ``--validation_prompts`` samples fitted to the run (``validation.fit_samples``),
    the flips, the shard streams and loader workers, the class count, the learning rate's default (by the model and
    the optimizer asked, before a memory budget may change the optimizer), the objective (which a diffusers family's
    scheduler config decides; the config records its kind and shift, ``run.diffusion`` holds it; a bucketed run's
    per bucket and side, ``run.objectives``), the LoRA targets and the memory budget's choices (``settle_budget``).
    Returns ``run.cfg``.

    Raises:
        UserError: ``fit_samples``'s; ``--validation_prompts`` for a driven pipeline; ``--expert both`` with a
            setting it does not run with (``experts.refuse_unsupported``), ``--random_flip`` for an image-to-video
            pipeline, class conditioning on data without labels, ``--num_classes`` below the data's, an objective
            the pipeline's scheduler does not give, or a memory budget nothing fits (``plan_placement``).
    """
    cfg, d, pre, dataset = run.cfg, run.d, run.pre, run.dataset
    t, m = cfg.train, cfg.model
    assign(cfg, run.found)
    if pre is not None and m.expert is None and len(pre.denoiser.expert_models()) == 2:
        m.expert = "both"  # a pipeline of two experts trains both (train/experts.py)
    if pre is not None and m.expert is not None and t.sample_every and not run.validation:
        # the grid's pipeline call takes one expert; validation samples bring the other one in
        log.info("--expert %s: no periodic grid (the grid's pipeline call takes one expert); give "
                 "--validation_prompts FILE, or draw them with ditforge sample --ckpt RUN", m.expert)
        t.sample_every = 0
    if pre is not None and pre.denoiser.trained_videos:  # a driven pipeline's call needs its driving videos
        if run.validation:
            raise UserError(f"--validation_prompts: a {pre.pipeline_class} samples from driving videos, which the "
                            "file's lines do not carry; drop it and sample the run with ditforge sample --ckpt RUN")
        if t.sample_every:
            log.info("%s: no periodic grid (its call needs driving videos); sample the run with ditforge sample "
                     "--ckpt RUN --pose_video ... --face_video ...", pre.pipeline_class)
            t.sample_every = 0
    if run.validation:
        run.validation = fit_samples(run.validation, run)
    settle_flips(cfg, dataset, pre)
    if isinstance(dataset, ShardData) and cfg.data.data_streams is None:
        cfg.data.data_streams = math.gcd(t.batch_size, math.lcm(16, d.dp_size))  # >= 16 and every rank its streams
    if cfg.data.num_workers is None:
        cfg.data.num_workers = default_workers(dataset, cfg.data, d.dp_size)
    if not dataset.num_classes and m.condition == "class":  # captioned images have no labels
        raise UserError(f"--data {cfg.data.data} holds captioned images, no class labels; use --condition text")
    if m.num_classes is None:
        m.num_classes = dataset.num_classes or None
    elif m.num_classes < dataset.num_classes and m.condition == "class":
        raise UserError(f"--num_classes {m.num_classes}: the data has {dataset.num_classes} classes")
    if t.lr is None and t.optimizer == "adafactor":  # its lr is a relative step size: the paper's 1e-2
        t.lr = 1e-2
    if t.lr is None:  # the tiny model trains well (and fast enough for a CPU) at 1e-3; see benchmarks/digits_quality.py --sweep
        t.lr = (1e-4 if m.lora_rank else 1e-5) if pre is not None else 1e-3 if "-T/" in m.model else 1e-4

    def objective(expert: str | None, frames: int, height: int, width: int):
        # the family's part (an expert's side of the schedule, given frames, the sequence a dynamic shift follows)
        family = pre.denoiser.objective_args(pre.pipe, expert, frames, height, width) if pre is not None else {}
        return create_objective(m.objective, m.learn_sigma, pre.scheduler_config if pre is not None else None,
                                m.flow_shift, m.weighting_scheme, m.logit_mean, m.logit_std,
                                where=f"--init_from {m.init_from}", device=run.d.device, **family)

    square = (m.num_frames, m.input_size, m.input_size)
    diffusion = objective(m.expert, *square)
    sides = ("high_noise", "low_noise") if m.expert == "both" else (m.expert,)
    if m.expert == "both":  # each step's side drawn from the whole range, its times from that side's
        refuse_unsupported(cfg)
        run.experts = TwoExperts(pre.denoiser, diffusion, tuple(objective(side, *square) for side in sides),
                                 pre.denoiser.expert_boundary(pre.pipe))
    if pre is not None and run.bucketed is not None:  # each bucket's latents (and side): its own sequence length
        run.objectives = {(k if run.experts is not None else None, shape): objective(side, *shape)
                          for k, side in enumerate(sides) for shape in bucket_latent_shapes(run)}
    m.objective = {"flow": "flow", "v_prediction": "v", "epsilon": "ddpm"}[diffusion.prediction_type]
    if m.objective == "flow":
        m.flow_shift = diffusion.shift
    run.diffusion = diffusion
    if m.lora_rank:  # a diffusers family's default targets, else a DiT's
        m.lora_target_modules = lora_targets(pre.denoiser if pre is not None else None, cfg)
    if run.budget is not None:
        settle_budget(run)
    return cfg


def bucket_latent_shapes(run: Run) -> set[tuple[int, int, int]]:
    """The latent (frames, height, width) of each bucket of a pipeline's bucketed run: the VAE's latent frames of
    its frame count, its sides over the VAE's downsample."""
    vae, scale = run.inputs.vae, run.pre.denoiser.vae_scale
    return {(vae.latent_frames(b.num_frames), b.height // scale, b.width // scale)
            for b in run.dataset.buckets.buckets}


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device: the same shapes, dtypes,
    ``requires_grad`` and sharing, no memory (``copy.deepcopy`` with each tensor's meta twin in its memo)."""
    memo = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        twin = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(twin, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else twin
    return copy.deepcopy(module, memo)


def model_on_meta(run: Run) -> nn.Module:
    """The denoiser as ``build.build_model`` makes it before its storage choices, on the meta device: a copy of
    the pipeline's (its text encoder's copy attached with ``--train_text_encoder``) or the DiT built there, with
    their LoRA (``build.adapt``); shapes, dtypes and what trains are the real model's."""
    pre = run.pre
    if pre is None:
        return adapt(run, create_run_model(run.cfg, torch.device("meta"), dit_dtype(run)), None)
    encoder = meta_copy(pre.pipe.text_encoder) if run.cfg.model.train_text_encoder else None
    return adapt(run, meta_copy(pre.denoiser), encoder)


def state_counts(model: nn.Module, half_base: bool) -> tuple[int, int]:
    """(trainable parameters, bytes of the frozen ones as stored: at most 2 each with ``half_base``, a LoRA's
    frozen base that ``build_model`` stores in bf16) of ``model``, for ``plan_placement``."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * (min(2, p.element_size()) if half_base else p.element_size())
                 for p in model.parameters() if not p.requires_grad)
    return trainable, frozen


def settle_budget(run: Run) -> None:
    """``--gpu_memory_budget``'s choices, written into the config before the model is built, from the parameters of
    its meta-device twin (``model_on_meta``): a LoRA on a pipeline stores its base in fp8 (``--fp8_base``) where
    ``finetune.fp8_base_pays``; then the optimizer, master weights, fused backward and CPU offload that fit the
    budget (``plan_placement``'s rule) with the base as it will be stored.

    Raises:
        UserError: nothing fits the budget (``plan_placement``).
    """
    cfg, d = run.cfg, run.d
    t, m, plugin = cfg.train, cfg.model, cfg.parallel.plugin
    model = model_on_meta(run)
    if m.lora_rank and run.pre is not None and not m.fp8_base and plugin in ("none", "ddp"):
        m.fp8_base = finetune.fp8_base_pays(sum(p.numel() for p in model.parameters() if not p.requires_grad),
                                            run.budget)
        if m.fp8_base and d.is_main:
            log.info("--gpu_memory_budget %s: --fp8_base", t.gpu_memory_budget)
    if m.fp8_base:
        finetune.store_base_in_fp8(model, run.amp_dtype, plugin)
    given = (t.optimizer, t.master_weights, t.fused_backward_pass, t.cpu_offload)
    choice = plan_placement(run.budget, *state_counts(model, run.half_base), t.ema_decay != 0, given,
                            run.amp_dtype == torch.bfloat16, lowmem=plugin in ("none", "ddp"),
                            fused_ok=plugin == "none" and run.experts is None,  # neither with two experts
                            offload_ok=(t.fused_optimizer == "auto" and on_gpu_with_triton(d.device)
                                        and run.experts is None))  # (train/experts.py: its optimizer steps one side)
    if choice != given and d.is_main:
        log.info("--gpu_memory_budget %s: --optimizer %s --master_weights %s%s --cpu_offload %s",
                 t.gpu_memory_budget, *choice[:2], " --fused_backward_pass" if choice[2] else "", choice[3])
    t.optimizer, t.master_weights, t.fused_backward_pass, t.cpu_offload = choice


def pipeline_family(cfg: RunConfig):
    """The adapter class of the diffusers pipeline the run fine-tunes (``--init_from``, or the one a features folder
    was made from), or None."""
    init = cfg.model.init_from
    if init is None and source_of(cfg.data.data) is FEATURES:
        init = read_manifest(cfg.data.data).get("init_from")
    replaced = tuple(component_files(cfg.model))
    if init is None or not is_adapted_pipeline(init, replaced):
        return None
    return family_of_pipeline(read_model_index(init, replaced=replaced)["_class_name"])


def settle_flips(cfg: RunConfig, dataset, pre) -> None:
    """``--random_flip``'s default: the data set's, but off for a video pipeline, whose flips would act on
    the latents of a 3-D VAE (not mirror-symmetric: the flipped clip's latents are not the flipped latents); on
    asked explicitly it flips those latents (text-to-video), and an image-to-video pipeline refuses it: its
    conditioning (the first frame's latents and CLIP states) is not flipped with them.

    Raises:
        UserError: ``--random_flip`` for an image-to-video pipeline.
    """
    video_pipeline = pre is not None and pre.denoiser.video
    if cfg.data.random_flip is None:
        cfg.data.random_flip = False if video_pipeline else getattr(dataset, "random_flip", True)
    elif cfg.data.random_flip and video_pipeline and pre.denoiser.image_to_video:
        raise UserError(f"--random_flip: {pre.pipeline_class} conditions on the unflipped first frame, and flips "
                        "act on the latents; leave --random_flip off")


def default_workers(dataset, data, dp_size: int) -> int:
    """``--num_workers`` when not given. Built-in sets (decoded once, kept) and features folders (memory-mapped
    slices): 0. Latent shards: 1, off the training process, where reading them in-process cost 3.5 ms a step
    (14 ms at the 90th percentile, when a window of shards is opened) and each worker's batch costs about
    1.7 ms to receive (8 workers: 13.8 ms a step) on an H100 host, DiT-XL/2 batch 64 (benchmarks/data_loading.py).
    Image files and raw shards: ``default_num_workers``; for shards the largest count up to it that splits this
    process's streams evenly."""
    if not isinstance(dataset, ShardData):
        in_memory = data.data in BUILTIN_DATASETS or getattr(dataset, "manifest", None) is not None
        return 0 if in_memory else default_num_workers(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if isinstance(dataset.decoder, LatentDecoder):
        return 1
    most, streams = default_num_workers(int(os.environ.get("LOCAL_WORLD_SIZE", 1))), max(data.data_streams // dp_size, 1)
    return max(w for w in range(1, most + 1) if streams % w == 0)
