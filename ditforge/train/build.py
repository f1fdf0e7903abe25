"""The named build phases of a training run, in the order ``trainer.train`` calls them: the run folder and its
guards, ``--init_from``, the data, (the settings resolved, ``resolve.resolve``, and the config frozen), the model,
the EMA and optimizer, the outputs, the loader and the logs. Each fills its part of the state they share (``Run``).
The phases before the resolution open things and report the settings they found (``Run.found``); none writes the
config, which ``resolve`` alone writes."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.utils.data import DataLoader

from ditforge.atomic import atomic_path
from ditforge.config.sections import LIBRARY_OPTIMIZERS, SHARDED_PLUGINS, RunConfig, assign
from ditforge.config.values import parse_bytes, resolve_precision
from ditforge.data import GlobalBatchSampler, build_dataset, build_shard_loader, source_of
from ditforge.data.prefetch import DevicePrefetcher
from ditforge.data.shards.loader import ShardData
from ditforge.data.features import read_manifest
from ditforge.data.sources import CLIP_FOLDER, FEATURES, build_bucket_dataset
from ditforge.data.packing import packing_setup
from ditforge.encoders.batch import BatchEncoder, build_batch_encoder, pipeline_batch_encoder
from ditforge.diffusion.objective import Objective
from ditforge.errors import UserError
from ditforge.models import create_model, is_video_model
from ditforge.models.adapters.pipeline import Pretrained, is_adapted_pipeline, load_pretrained
from ditforge.models.adapters.single_file import component_files
from ditforge.parallel import init_sharded, parallelize, resolve_plugin, unwrap
from ditforge.parallel.ema import EMA
from ditforge.optim import build_optimizer
from ditforge.optim.backward import StepInBackward
from ditforge.optim.placement import cap_gpu_memory
from ditforge.parallel.heartbeat import Heartbeat
from ditforge.parallel.offload import swap_blocks
from ditforge.parallel.mesh import Dist
from ditforge.train import checkpoint as ckpt_io
from ditforge.train import finetune
from ditforge.train.experts import TwoExperts
from ditforge.train.mixed import check_bucket_tokens
from ditforge.train.guard import LossSpikeGuard, NonfiniteGuard, claim_run_folder, disk_errors
from ditforge.train.logging import MetricsLog, Tracker
from ditforge.weights import read as weights_io
from ditforge.weights.finetuned import dit_init_weights, dit_settings, load_dit_weights, read_dit_init
from ditforge.weights.lora import add_lora_to_denoiser, train_text_encoder

log = logging.getLogger(__name__)

DEFAULT_MODELS = {False: "DiT-T/2", True: "vDiT-T/244"}  # by video data


def default_outputs(cfg: RunConfig, d: Dist) -> str:
    data = Path(cfg.data.instance_data or cfg.data.data).name or "data"
    model = f"{cfg.model.model.replace('/', '-')}-" if cfg.model.model else ""
    name = [str(Path("outputs") / f"{data}-{model}{datetime.now():%Y%m%d-%H%M%S}")]
    if d.mesh is not None:  # every rank must write into the folder rank 0 named
        dist.broadcast_object_list(name, src=0)
    return name[0]


def create_run_model(cfg: RunConfig, device: torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """The run's DiT, built on the meta device and materialised on ``device`` one block at a time, each block's
    weights cast to ``dtype`` as soon as they are initialised (None: fp32)."""
    m = cfg.model

    def cast(block: nn.Module) -> None:
        for p in block.parameters():
            p.data = p.data.to(dtype)

    return create_model(m.model, m.input_size, m.in_channels, m.num_classes, m.learn_sigma, m.class_dropout_prob,
                        num_frames=m.num_frames, text_dim=m.text_dim, qk_norm=m.qk_norm, depth=m.depth, device=device,
                        block_ready=cast if dtype is not None else None)


def _build_dataset(cfg: RunConfig, run_dir: Path, pre, d: Dist, class_clips: Callable | None = None):
    """The data set of ``--data``, or DreamBooth's (``--instance_data``), after the base pipeline ``pre`` has
    generated the class images ``--class_data`` lacks (rank 0; the others wait), or a video pipeline's class clips
    (``class_clips``, every process; ``data.prior.PriorPairs`` pairs them with the instance buckets)."""
    data, bad = cfg.data, run_dir / "bad_samples.jsonl"
    clip_folder = source_of(data.data) is CLIP_FOLDER
    video_dreambooth = data.instance_data is not None and pre is not None and pre.denoiser.video
    if pre is not None and (data.buckets is not None or clip_folder or video_dreambooth):
        buckets = build_bucket_dataset(cfg, bad, pre=pre)  # the pipeline's shapes and frame rule
        if data.class_data is None:
            return buckets
        from ditforge.data.prior import with_class_clips

        return with_class_clips(cfg, buckets, pre, d, class_clips)
    if data.buckets is not None:
        from ditforge.data.buckets import read_bucket_config

        if source_of(data.data).streamed and not cfg.train.pack_tokens:
            raise UserError(f"--buckets with shards --data {data.data}: add --pack_tokens N (each step packs samples "
                            "of several buckets); one bucket per step needs a CSV / JSONL of files")
        video = any(t > 1 for frames in read_bucket_config(data.buckets).values() for t in frames)
        return build_bucket_dataset(cfg, bad, cfg.model.model or DEFAULT_MODELS[video])
    if data.instance_data is None and source_of(data.data) is FEATURES:  # buckets made from the data: --batch_size
        from ditforge.data.features import FeatureDataset

        return FeatureDataset(data.data, cfg.train.batch_size)
    if data.instance_data is None:
        return build_dataset(data.data, data.image_size, bad, data.num_frames, data.frame_interval, cfg.train.seed,
                             resize_mode=data.resize_mode, shard_retries=data.shard_retries)
    from ditforge.data.captions import DreamBoothDataset, count_images, generate_class_images

    if data.image_size is None:
        raise UserError("--image_size is required with --instance_data (e.g. --image_size 512)")
    if data.class_data is not None:
        if d.is_main and count_images(data.class_data) < data.num_class_images:
            if pre is None:
                raise UserError(f"--class_data {data.class_data}: fewer than --num_class_images "
                                f"{data.num_class_images} images, and only a text-to-image pipeline (--init_from a "
                                "diffusers folder) can generate the rest")
            generate_class_images(pre.pipe, data.class_prompt, data.class_data, data.num_class_images, data.image_size,
                                  seed=cfg.train.seed)
        d.barrier()
    return DreamBoothDataset(data.instance_data, data.instance_prompt, data.image_size, data.class_data,
                             data.class_prompt, bad, data.resize_mode)



def _intact_resume(found: Path | None, resume: str | None, run_dir: Path, d: Dist) -> Path | None:
    """The checkpoint to resume from after checking its files (rank 0 reads them, every rank gets the answer):
    ``--resume auto`` falls back past damaged checkpoints (``ckpt_io.newest_intact``); a damaged checkpoint named
    explicitly is an error."""
    answer: list = [found, None]
    if d.is_main and found is not None:
        try:
            if resume == "auto":
                answer[0] = ckpt_io.newest_intact(run_dir)
            else:
                weights_io.check_intact(found, "--resume")
        except UserError as e:
            answer[1] = str(e)
    if d.mesh is not None:
        dist.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise UserError(answer[1])
    return answer[0]


@dataclass
class Run:
    """What the phases of one run share. ``open_run`` fills the fields up to ``bf16_weights`` and starts ``found``;
    each later phase fills its own group below, so a field keeps its default until its phase has run."""

    cfg: RunConfig
    d: Dist
    run_dir: Path
    resume_from: Path | None  # an intact checkpoint to resume from
    amp_dtype: torch.dtype  # the compute dtype
    budget: int | None  # --gpu_memory_budget, in bytes
    mixed: bool  # global batches of several buckets, packed
    per_step: int  # data-parallel processes x --grad_accum_steps
    home: torch.device  # where the weights are built (the host under --cpu_offload all)
    half_base: bool  # a LoRA's frozen base stored in bf16
    bf16_weights: bool  # the weights stored in bf16 from the start
    # the settings the phases before the resolution found ("section.field" -> value; a later phase's value wins):
    # the run folder, the plugin, a features folder's pipeline, DiT weights' model, the data's and encoders' shapes.
    # resolve.resolve writes them into the config.
    found: dict = field(default_factory=dict)
    # --init_from (load_init)
    features: dict | None = None  # the manifest of a features folder --data
    pre: Pretrained | None = None  # a pretrained pipeline of a diffusers family
    dit_init: tuple | None = None  # DiT weights and their model settings (read_dit_init)
    # data (build_data)
    dataset: object = None
    video: bool = False
    inputs: BatchEncoder | None = None
    bucketed: object = None  # --buckets: the BucketBatchSampler (each bucket's batch size is its global batch)
    steps_per_epoch: int = 0
    max_steps: int = 0
    # objective, model and optimizer (resolve.resolve, build_model, build_ema_and_optimizer, trainer._resume)
    diffusion: Objective | None = None  # with two experts, the side's of the step in flight (experts.activate)
    experts: TwoExperts | None = None  # --expert both: the switch between a pipeline's two experts
    # a pipeline's bucketed run: the objective of each (expert side or None, bucket's latent (frames, height,
    # width)); a dynamic shift follows the sequence length
    objectives: dict[tuple[int | None, tuple[int, ...]], Objective] | None = None
    model: nn.Module | None = None
    adapters_only: bool = False  # LoRA: EMA and checkpoints hold the adapters alone
    ema: EMA | None = None
    optimizer: torch.optim.Optimizer | None = None
    ema_in_step: bool = False  # the fused optimizer step updates the EMA in its own pass
    stepper: StepInBackward | None = None  # --fused_backward_pass
    scaler: torch.amp.GradScaler | None = None  # fp16
    start_step: int = 0
    loader_state: dict | None = None  # the shard loader's, saved with the checkpoint resumed
    # batches skipped by loss-spike rollbacks: step k reads the batch, and draws the randomness, of data position
    # k + data_offset (a function of (seed, position))
    data_offset: int = 0
    spikes: LossSpikeGuard | None = None  # --loss_spike_factor
    # outputs, loader and logs (open_outputs, build_loader, open_logs)
    checkpointer: ckpt_io.Checkpointer | None = None
    shard_loader: object = None  # streamed shards: their loader, whose position each checkpoint saves
    loader: DevicePrefetcher | None = None
    sample_shape: tuple[int, ...] = ()
    packing: tuple[int, tuple[int, ...]] | None = None  # --pack_tokens (train_step's)
    metrics: MetricsLog | None = None  # rank 0's, as the tracker
    heartbeat: Heartbeat | None = None  # several processes: this one's beats (parallel.heartbeat)
    tracker: Tracker | None = None
    nonfinite: NonfiniteGuard | None = None
    # the sample grids' model and conditioning, made for the first grid (rank 0)
    grid_model: nn.Module | None = None
    grid_cond: dict | None = None
    validation: list | None = None  # --validation_prompts: the file's samples (trainer.train), fitted (resolve)
    # this step's latent frames before the clip's (a reference-image family's, encoders.batch.PREFIX; set by
    # step.make_micro_batches): the buckets' objectives are keyed by the clip's latent shape
    lead_frames: int = 0
    class_clips: Callable | None = None  # draws a video DreamBooth's class clips (trainer.train's class_clips)

    def objective_of(self, x: torch.Tensor | list) -> Objective:
        """The objective of latents ``x`` (B, C, lead_frames + T', h, w): their bucket's (and the active expert's
        side) in a pipeline's bucketed run, keyed by the clip's T' x h x w, else ``diffusion``."""
        if self.objectives is None:
            return self.diffusion
        shape = (x.shape[2] - self.lead_frames, *x.shape[3:])
        return self.objectives[(self.experts.active if self.experts is not None else None, shape)]

    def settled(self) -> RunConfig:
        """The config as the phases so far found it: a copy with ``found`` written in, for a phase that reads what
        an earlier one found (the run's own config is written by ``resolve`` alone)."""
        cfg = self.cfg
        parts = {name: dataclasses.replace(getattr(cfg, name)) for name in ("model", "data", "train", "parallel")}
        return assign(dataclasses.replace(cfg, **parts), self.found)

    def last_good(self) -> Path | None:
        return last_checkpoint(self.run_dir)

    def written(self, what: str) -> contextlib.AbstractContextManager:
        return disk_errors(what, self.run_dir, self.cfg.train.continue_on_save_error, self.last_good)


def last_checkpoint(run_dir: Path) -> Path | None:
    found = weights_io.list_checkpoints(run_dir)
    return found[-1] if found else None


def open_run(cfg: RunConfig, d: Dist, held: contextlib.ExitStack) -> Run:
    """Run folder and guards: the folder claimed (its lock released by ``held``), the checkpoint to resume from,
    the compute dtype, memory budget and plugin found (``Run.found``: ``--outputs``, ``--plugin``), and what they
    cannot run with refused (UserError)."""
    t, m, par = cfg.train, cfg.model, cfg.parallel
    resume_from, outputs = ckpt_io.find_resume(t.resume, t.outputs)
    if outputs is None:
        outputs = default_outputs(cfg, d)
    run_dir = Path(outputs)
    lock = claim_run_folder(run_dir, d)  # before anything is written there
    if lock is not None:
        held.callback(lock.release)
    resume_from = _intact_resume(resume_from, t.resume, run_dir, d)
    if resume_from is None and weights_io.list_checkpoints(run_dir):
        raise UserError(f"--outputs {run_dir} already holds a run; pass --resume auto to continue it, "
                        "or choose another folder")
    device = d.device
    amp_dtype = resolve_precision(t.mixed_precision, device)
    if t.master_weights != "fp32" and amp_dtype != torch.bfloat16:
        raise UserError(f"--master_weights {t.master_weights}: needs bf16 compute; --mixed_precision {t.mixed_precision} is "
                        f"{str(amp_dtype).removeprefix('torch.')} on {device.type}")
    budget = parse_bytes(t.gpu_memory_budget, "--gpu_memory_budget") if t.gpu_memory_budget is not None else None
    if budget is not None and device.type == "cuda":
        cap_gpu_memory(budget, device)
    plugin = resolve_plugin(par.plugin, d.world_size, t.cpu_offload)
    if plugin in SHARDED_PLUGINS and t.optimizer in LIBRARY_OPTIMIZERS:  # not tested over DTensors
        raise UserError(f"--optimizer {t.optimizer}: supported with --plugin none or ddp, got {plugin}; under "
                        "zero2 / fsdp / hsdp use --optimizer adamw or adamw8bit")
    if cfg.parallel.tensor_parallel > 1 and (t.optimizer, t.master_weights) != ("adamw", "fp32"):
        # CompensatedAdamW steps FSDP2's shards of the first dimension; tensor parallelism shards others
        raise UserError(f"--optimizer {t.optimizer} --master_weights {t.master_weights}: not with --tensor_parallel "
                        f"{cfg.parallel.tensor_parallel}; use --optimizer adamw --master_weights fp32")
    if t.cpu_offload == "optimizer" and plugin in SHARDED_PLUGINS:
        raise UserError(f"--cpu_offload optimizer: supported with --plugin none or ddp, got {plugin}; "
                        "--cpu_offload all offloads under zero2 / fsdp")
    if t.cpu_offload == "all" and plugin not in SHARDED_PLUGINS:
        raise UserError(f"--cpu_offload all: offloads through FSDP2, with --plugin fsdp, zero2 or hsdp, got {plugin}")
    if t.fused_backward_pass and plugin != "none":  # DDP / FSDP reduce a gradient after the hook would step
        raise UserError(f"--fused_backward_pass: one process only, got --plugin {plugin} over {d.world_size}")
    per_step = d.dp_size * par.grad_accum_steps
    mixed = cfg.data.buckets is not None and bool(t.pack_tokens)  # global batches of several buckets, packed
    if (cfg.data.buckets is None or mixed) and t.batch_size % per_step:  # buckets: checked per bucket later
        raise UserError(f"--batch_size {t.batch_size} is not divisible by {d.dp_size} data-parallel processes x "
                        f"--grad_accum_steps {par.grad_accum_steps}")
    # --cpu_offload all: the model stays in host memory; fully_shard moves one block at a time to the GPU, shards
    # it and offloads the shards, so the whole model never is on the GPU.
    home = torch.device("cpu") if t.cpu_offload == "all" else device
    # A LoRA's frozen base computes in bf16 anyway: stored so (half the memory). --master_weights bf16 / bf16_sr: the
    # trainable weights too (updated through an fp32 rebuild). Either way the weights are stored in bf16 from the start.
    half_base = bool(m.lora_rank) and amp_dtype != torch.float32 and plugin in ("none", "ddp")
    bf16_weights = half_base or (t.master_weights != "fp32" and not m.lora_rank)
    return Run(cfg, d, run_dir, resume_from, amp_dtype, budget, mixed, per_step, home, half_base, bf16_weights,
               found={"train.outputs": outputs, "parallel.plugin": plugin})


def load_init(run: Run) -> None:
    """--init_from: a diffusers family's pretrained pipeline (``run.pre``) or DiT weights (``run.dit_init``, whose
    model settings go into ``run.found``); a features folder made from a pipeline names that pipeline (found as
    ``--init_from``)."""
    cfg, m, device, amp_dtype = run.cfg, run.cfg.model, run.d.device, run.amp_dtype
    features = read_manifest(cfg.data.data) if source_of(cfg.data.data) is FEATURES else None
    init_from = m.init_from
    if init_from is None and features is not None:
        init_from = run.found["model.init_from"] = features.get("init_from")  # fine-tune the features' pipeline
    if init_from is not None:
        if is_adapted_pipeline(init_from, tuple(component_files(m))):
            # From features, the text encoders only encode the empty prompt and the sample grids, and the VAE only
            # decodes the grids: kept on the CPU (the VAE visits the GPU for a grid), out of a tight memory budget.
            on_gpu = device.type == "cuda" and features is None
            helpers = device if features is None else torch.device("cpu")
            # a base to be stored in fp8, swapped, or placed under a budget is cast and changed in host memory and
            # moves to the GPU after (build_model): the bf16 base alone can exceed the budget (a 14B video
            # transformer's 26.6 GiB)
            staged = m.fp8_base or cfg.train.blocks_to_swap or cfg.train.gpu_memory_budget is not None
            run.pre = load_pretrained(init_from, device, amp_dtype if on_gpu else torch.float32,
                                      text_device=helpers, vae_device=helpers,
                                      denoiser_device=torch.device("cpu") if staged else run.home,
                                      denoiser_dtype=amp_dtype if run.bf16_weights else torch.float32,
                                      expert=m.expert, other_expert_device=torch.device("cpu"),
                                      files=component_files(m), keep_fp8=m.fp8_base)
            if features is not None and run.pre.denoiser.image_noise and m.noised_image_input:
                log.info("--noised_image_input: the features hold the clean first frames' latents, so the image "
                         "conditioning is not noised; train on the clips to noise it")
        else:
            run.dit_init = read_dit_init(cfg)
            run.found.update(dit_settings(run.dit_init[1], m))
    run.features = features


def build_data(run: Run) -> None:
    """Data: the data set, the batch encoder (VAE, text encoder; the data's shapes they find and the default model
    go into ``run.found``), the bucket sampler and the run's length in steps."""
    cfg, d, run_dir, pre = run.cfg, run.d, run.run_dir, run.pre
    if cfg.data.frame_interval is None:  # the source's default (data/sources.py, Source.frame_interval)
        run.found["data.frame_interval"] = source_of(cfg.data.data).frame_interval
    t, device, settled = cfg.train, d.device, run.settled()
    dataset = _build_dataset(settled, run_dir, pre, d, run.class_clips)
    video = getattr(dataset, "num_frames", None) is not None
    if pre is not None:
        inputs, found = pipeline_batch_encoder(settled, pre, dataset)
    else:
        model = settled.model.model or DEFAULT_MODELS[video]
        if is_video_model(model) != video:
            raise UserError(f"--model {model} is {'a video' if is_video_model(model) else 'an image'} model; "
                            f"--data {cfg.data.data} holds {'videos' if video else 'images'}")
        inputs, found = build_batch_encoder(settled, dataset, device,
                                            run.amp_dtype if device.type == "cuda" else torch.float32)
        found["model.model"] = model
    run.found.update(found)
    bucketed = None  # --buckets: each bucket's batch size is its global batch; --batch_size is not used
    if getattr(dataset, "buckets", None) is not None and not isinstance(dataset, ShardData):  # shards: streams'
        from ditforge.data.buckets import BucketBatchSampler

        if not run.mixed:
            dataset.buckets.check_batch_sizes(run.per_step, f"{d.dp_size} data-parallel processes x "
                                                            f"--grad_accum_steps {cfg.parallel.grad_accum_steps}")
        bucketed = BucketBatchSampler(dataset.buckets, dataset.sizes, t.seed, d.dp_rank, d.dp_size,
                                      batch_size=t.batch_size if run.mixed else None)
    run.steps_per_epoch = bucketed.steps_per_epoch if bucketed else len(dataset) // t.batch_size
    run.max_steps = t.max_steps or (t.epochs * max(run.steps_per_epoch, 1) if t.epochs else 1000)
    run.dataset, run.video, run.inputs, run.bucketed = dataset, video, inputs, bucketed


def sharded_on_meta(run: Run) -> bool:
    """zero2 / fsdp: a DiT sharded on the meta device, then each process initialises its shards (``init_sharded``),
    so the model never is whole on a GPU. Not with what needs the whole model first: official weights, LoRA, FP8
    conversion, the sequence-parallel measurement, or host shards (``--cpu_offload all``)."""
    t = run.cfg.train
    return (run.cfg.parallel.plugin in SHARDED_PLUGINS and run.pre is None and run.dit_init is None
            and not run.cfg.model.lora_rank and run.d.sp_mesh is None and t.mixed_precision != "fp8"
            and t.cpu_offload != "all")


def dit_dtype(run: Run) -> torch.dtype | None:
    """The dtype a new DiT's blocks are cast to as they are built (``create_run_model``): bf16 weights are cast
    block by block, so the model never is whole in fp32 (``build_model`` casts the rest); a LoRA's adapters are
    drawn in fp32 on the fp32 base, which ``build_model`` casts after injection; a model sharded on the meta
    device stays fp32 until ``parallelize``."""
    if sharded_on_meta(run) or not run.bf16_weights or run.cfg.model.lora_rank:
        return None
    return run.amp_dtype


def adapt(run: Run, model: nn.Module, text_encoder: nn.Module | None) -> nn.Module:
    """The denoiser's trained parts: the pipeline's ``text_encoder`` attached (``--train_text_encoder``), then the
    LoRA adapters (``--lora_rank``). ``build_model`` adapts the run's model; ``resolve`` a meta-device copy of it,
    to count what the memory budget's choices need. Returns ``model``.

    Raises:
        UserError: ``--train_text_encoder`` on features (their prompts are encoded already), or see
            ``train_text_encoder``, ``add_lora_to_denoiser``.
    """
    cfg, pre = run.cfg, run.pre
    if cfg.model.train_text_encoder and pre is not None:
        if run.features is not None:
            raise UserError(f"--train_text_encoder: --data {cfg.data.data} holds prompts encoded already; "
                            "train on the captioned images")
        train_text_encoder(model, text_encoder, pre.pipe, cfg)
    if cfg.model.lora_rank:
        add_lora_to_denoiser(model, cfg)
    return model


def build_model(run: Run) -> None:
    """The denoiser: the pipeline's or a new DiT (initial weights alike on every rank), its LoRA, its storage
    dtype, then ``parallelize``; under zero2 / fsdp a DiT is sharded on the meta device, then initialised. Reads
    the frozen config: ``--fp8_base`` and the placement flags are what ``resolve`` decided."""
    cfg, d, pre, home, amp_dtype = run.cfg, run.d, run.pre, run.home, run.amp_dtype
    t, m, par, plugin = cfg.train, cfg.model, cfg.parallel, cfg.parallel.plugin
    torch.manual_seed(t.seed)  # the same initial weights on every rank
    skeleton = None  # an unsharded meta copy of a model that is sharded before it is materialised
    if pre is not None:
        model = pre.denoiser
    elif sharded_on_meta(run):
        skeleton = create_run_model(cfg, torch.device("meta"))
        model = copy.deepcopy(skeleton)
    else:
        model = create_run_model(cfg, home, dit_dtype(run))
    if run.dit_init is not None:
        load_dit_weights(model, dit_init_weights(run.dit_init, cfg), t.seed)
    adapt(run, model, pre.pipe.text_encoder if pre is not None else None)
    if m.fp8_base:
        finetune.store_base_in_fp8(model, amp_dtype, plugin)
    if run.experts is not None:  # the idle expert's frozen weights may stay in host memory
        run.experts.place(home, run.budget, sharded=plugin in SHARDED_PLUGINS)
    elif skeleton is None:
        model.to(home)
    model.train()
    for p in model.parameters():  # what is not bf16 yet (a LoRA's base built here; the budget's choice)
        if (run.half_base and not p.requires_grad and p.element_size() > 1) or (
                p.requires_grad and t.master_weights != "fp32"):
            p.data = p.data.to(amp_dtype)
    reduce_dtype = torch.bfloat16 if par.grad_reduce_dtype == "bf16" else torch.float32
    model = parallelize(model, d, plugin, t.grad_checkpoint, t.compile, "fast" if t.enable_flashattn else "auto",
                        param_dtype=None if amp_dtype == torch.float32 else amp_dtype, reduce_dtype=reduce_dtype,
                        enable_modulate_kernel=t.enable_modulate_kernel,
                        enable_layernorm_kernel=t.enable_layernorm_kernel,
                        fp8=t.fp8_recipe if t.mixed_precision == "fp8" else None, fp8_min_width=t.fp8_min_width,
                        sequence_parallel_type=par.sequence_parallel_type, batch_size=t.batch_size // run.per_step,
                        fused_backward_pass=t.fused_backward_pass, cpu_offload=t.cpu_offload == "all",
                        offload_activations=t.offload_activations)
    if skeleton is not None:
        init_sharded(model, skeleton, d)
    if t.blocks_to_swap:
        swaps = swap_blocks(model, t.blocks_to_swap, pre, run.d)
        if run.experts is not None:  # BlockSwap's alone to move (TwoExperts.keep_out)
            run.experts.keep_out(p for swap in swaps for block in swap.params for p in block)
    run.model = model


def build_ema_and_optimizer(run: Run) -> None:
    """The EMA, the optimizer (its placement and precision), the step in the backward and the fp16 grad scaler."""
    t, model, device = run.cfg.train, run.model, run.d.device
    run.adapters_only = bool(run.cfg.model.lora_rank)  # LoRA: EMA and checkpoints hold the adapters alone
    ema = run.ema = EMA(model, trainable_only=run.adapters_only, alias=t.ema_decay == 0)
    optimizer = run.optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], t.optimizer,
                                                t.lr, t.weight_decay, device, t.master_weights,
                                                in_backward=t.fused_backward_pass, fused=t.fused_optimizer == "auto",
                                                offload=t.cpu_offload, delayed_update=t.delayed_update)
    # the fused step updates the EMA in its own pass (trainer._update_ema then a no-op); StepInBackward's is per block
    run.ema_in_step = not t.fused_backward_pass and ema.fuse_into(unwrap(model), optimizer)
    # --fused_backward_pass: the blocks step during the backward; an async checkpoint's staging finishes first
    run.stepper = (StepInBackward(unwrap(model), optimizer, t.max_grad_norm,
                                  lambda: run.checkpointer.wait_for_staging()) if t.fused_backward_pass else None)
    if run.amp_dtype == torch.float16:
        if run.cfg.parallel.plugin in SHARDED_PLUGINS:  # found-inf must agree across ranks that hold different shards
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            run.scaler = ShardedGradScaler(device.type)
        else:
            run.scaler = torch.amp.GradScaler(device.type)


def open_outputs(run: Run) -> None:
    """The run folder's ``samples/`` and ``config.yaml`` (rank 0), the metrics of steps after the resumed
    checkpoint (all of them on a fresh start) dropped, and the checkpointer, whose async staging every optimizer
    step waits for."""
    d, run_dir, t = run.d, run.run_dir, run.cfg.train
    if d.is_main:
        (run_dir / "samples").mkdir(parents=True, exist_ok=True)
        _write_config(run_dir / "config.yaml", run.cfg)
        # a fresh start drops them all: they are a killed run's that saved no checkpoint
        truncate_metrics(run_dir / "metrics.jsonl", run.start_step)
    d.barrier()
    checkpointer = run.checkpointer = ckpt_io.Checkpointer(
        run_dir, t.keep_last, run.cfg.parallel.async_checkpoint, d,
        last_step=run.start_step if run.resume_from is not None else None)
    run.optimizer.register_step_pre_hook(lambda *_: checkpointer.wait_for_staging())


def build_loader(run: Run) -> None:
    """This process's loader from ``run.start_step``'s data position, one batch ahead on the device, and
    ``--pack_tokens``' packing (every bucket checked to fit a row). A loss-spike rollback rewinds the steps, never
    the loader: the batches it reads next are those after the spike."""
    cfg, d, dataset, device = run.cfg, run.d, run.dataset, run.d.device
    start_step = run.start_step + run.data_offset
    t, m = cfg.train, cfg.model
    if isinstance(dataset, ShardData):  # streamed shards: the position is the loader's state, saved with the checkpoint
        data = cfg.data
        run.shard_loader = build_shard_loader(dataset, t.batch_size, data.data_streams, data.shuffle_shards, t.seed,
                                              d.dp_rank, d.dp_size, data.num_workers, start_step, run.loader_state,
                                              worker_init_fn=_ignore_sigint)
        # one batch ahead: the shard loader keeps two steps' states
        run.loader = DevicePrefetcher(run.shard_loader, device)
    else:
        sampler = run.bucketed or GlobalBatchSampler(len(dataset), t.batch_size, t.seed, d.dp_rank, d.dp_size,
                                                     start_step)
        sampler.start_step = start_step
        from ditforge.data.buckets import collate_mixed

        run.loader = DevicePrefetcher(DataLoader(
            dataset, batch_sampler=sampler, num_workers=cfg.data.num_workers,
            persistent_workers=cfg.data.num_workers > 0, worker_init_fn=_ignore_sigint,
            collate_fn=collate_mixed if run.mixed else None,
        ), device)
    run.sample_shape = (m.in_channels, *([m.num_frames] if run.video else []), m.input_size, m.input_size)
    if t.pack_tokens:
        run.packing = packing_setup(unwrap(run.model), t.pack_tokens, None if run.mixed else run.sample_shape)
    if run.mixed:
        check_bucket_tokens(dataset.buckets, t.pack_tokens, run.packing[1], m.in_channels,
                            cfg.data.image_size // m.input_size, run.video)


def open_logs(run: Run) -> None:
    """``metrics.jsonl`` and the tracker (rank 0), the non-finite step guard, and the run's summary in the log."""
    cfg, d, t, m = run.cfg, run.d, run.cfg.train, run.cfg.model
    run.metrics = MetricsLog(run.run_dir / "metrics.jsonl") if d.is_main else None
    run.tracker = (Tracker(run.run_dir, t.report_to, cfg.to_dict(), run.start_step if run.resume_from else None)
                   if d.is_main else None)
    # not run.last_good: a bound method kept in run.nonfinite would tie run to itself in a reference cycle, and the
    # run's loader workers, which hold the run folder's lock file open, would outlive the run until a GC pass
    run.nonfinite = NonfiniteGuard(1 if t.on_nonfinite == "stop" else t.max_nonfinite_steps,
                                   functools.partial(last_checkpoint, run.run_dir))
    if not d.is_main:
        return
    optimizer = run.optimizer
    n_params = sum(p.numel() for p in unwrap(run.model).parameters() if p.requires_grad)
    log.info("%s (%.2fM parameters) on %d x %s, plugin %s, %s compute, %d steps of global batch %s, "
             "run folder %s", (f"{m.model} ({m.depth} blocks)" if m.depth else m.model) if m.model
             else f"{run.pre.pipeline_class} denoiser", n_params / 1e6, d.world_size,
             d.device.type, cfg.parallel.plugin, str(run.amp_dtype).removeprefix("torch."), run.max_steps,
             "per bucket" if run.bucketed and not run.mixed else t.batch_size, run.run_dir)
    log.info("optimizer step: %s%s", "one Triton pass (clipping, AdamW" + (", EMA)" if run.ema_in_step else ")")
             if getattr(optimizer, "fused", False) else "torch's fused AdamW on the CPU" if t.cpu_offload == "all"
             else f"the library's {type(optimizer).__name__}" if t.optimizer in LIBRARY_OPTIMIZERS
             else "the libraries' kernels (--fused_optimizer off or no GPU)",
             {"optimizer": "; states in pinned host memory, streamed through a GPU ring",
              "all": ", over weights, gradients and states in host memory (FSDP2's CPUOffloadPolicy)"
                     + ("; one-step delayed update" if t.delayed_update else "")}.get(t.cpu_offload, ""))


def _ignore_sigint(worker_id: int) -> None:
    """Data-loader workers leave Ctrl-C to the trainer, which finishes the step and saves."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records logged after ``step`` (by a run that died before its next checkpoint), atomically."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except json.JSONDecodeError:  # blank, or the last line cut short by a kill in the middle of its write
            continue
    with atomic_path(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in keep))


def _write_config(path: Path, cfg: RunConfig) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
