"""The training loop: diffusion loss, AdamW with fp32 master weights, mixed precision, EMA, logging,
periodic sample grids and checkpoints, resume.

Recipe of DiT (Peebles & Xie 2023, section 5): AdamW at constant learning rate, no weight decay, EMA of
the weights, the hybrid loss of Improved DDPM with learned sigma, label dropout 0.1 for guidance.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ditforge.atomic import atomic_path
from ditforge.config import LIBRARY_OPTIMIZERS, RunConfig, parse_bytes, resolve_precision
from ditforge.data import BUILTIN_DATASETS, GlobalBatchSampler, build_dataset, build_shard_loader, source_of
from ditforge.data.prefetch import DevicePrefetcher, default_num_workers
from ditforge.data.shards.decode import LatentDecoder
from ditforge.data.shards.loader import ShardData
from ditforge.data.features import read_manifest
from ditforge.data.sources import FEATURES, build_bucket_dataset
from ditforge.data.packing import packed_training_losses, packing_setup
from ditforge.data.sampler import derive_seed
from ditforge.data.images import make_grid, save_grid, to_uint8
from ditforge.encoders.batch import BatchEncoder, as_batch, build_batch_encoder, pipeline_batch_encoder
from ditforge.diffusion import generate
from ditforge.diffusion.objective import Objective, create_objective
from ditforge.errors import RunError, UserError
from ditforge.models import create_model, is_video_model
from ditforge.models.adapters import family_of_pipeline
from ditforge.models.adapters.pipeline import (Pretrained, is_adapted_pipeline, load_pretrained,
                                               read_model_index)
from ditforge.ops.attention import whole_sequences
from ditforge.ops.fused_adamw import on_gpu_with_triton
from ditforge.parallel import (clip_coefficient, clip_grad_norm_, gradient_sync, init_sharded, parallelize,
                               resolve_plugin, unwrap)
from ditforge.optim import build_optimizer
from ditforge.optim.backward import StepInBackward
from ditforge.optim.library import set_lr
from ditforge.optim.placement import cap_gpu_memory, keep_states_within, out_of_memory, plan_placement
from ditforge.optim.skip import settle_skip, step_skipping_on_device
from ditforge.parallel.context import refuse_unsplittable
from ditforge.parallel.ema import EMA
from ditforge.parallel.mesh import Dist, init_distributed, shutdown
from ditforge.train import checkpoint as ckpt_io
from ditforge.train import finetune
from ditforge.train.mixed import check_bucket_tokens, chunk, mixed_step_inputs
from ditforge.train.randomness import StepRandomness
from ditforge.train.guard import LossSpikeGuard, NonfiniteGuard, all_finite, claim_run_folder, disk_errors
from ditforge.train.logging import MetricsLog, Tracker
from ditforge.weights import read as weights_io
from ditforge.weights.finetuned import dit_init_weights, load_dit_weights, read_dit_init
from ditforge.weights.lora import add_lora_to_denoiser, train_text_encoder

log = logging.getLogger(__name__)
DEFAULT_MODELS = {False: "DiT-T/2", True: "vDiT-T/244"}  # by video data


def step_randomness(
    seed: int, step: int, global_batch: int, sample_shape: tuple[int, ...], objective: Objective,
    drop_prob: float, device: torch.device, rank: int = 0, world_size: int = 1, latent_noise: bool = False,
) -> StepRandomness:
    """Counter-based randomness: drawn for the whole global batch from a generator seeded by (seed, step),
    then sliced for this rank, so a step sees the same numbers whatever the number of processes (and
    whether the latents are encoded on the fly or read from stored features). Timesteps come from
    ``objective.sample_timesteps`` (DDPM: uniform integers; flow: logit-normal or uniform times).
    ``latent_noise`` adds ``eps``."""
    g = torch.Generator(device=device).manual_seed(derive_seed(seed, step))
    noise = torch.randn((global_batch, *sample_shape), generator=g, device=device)
    t = objective.sample_timesteps(global_batch, g, device)
    drop = torch.rand(global_batch, generator=g, device=device) < drop_prob
    flip = torch.rand(global_batch, generator=g, device=device) < 0.5
    eps = torch.randn((global_batch, *sample_shape), generator=g, device=device) if latent_noise else None
    local = global_batch // world_size
    sl = slice(rank * local, (rank + 1) * local)
    return StepRandomness(noise[sl], t[sl], drop[sl], flip[sl], eps[sl] if latent_noise else None)


def ema_decay_at(decay: float, step: int) -> float:
    """Warm-up of the EMA decay, min(decay, (1 + k) / (10 + k)) (TensorFlow's ExponentialMovingAverage
    with num_updates), so short runs average over a useful window instead of their random start."""
    return min(decay, (1 + step) / (10 + step))


def learning_rate(cfg: RunConfig, step: int) -> float:
    """Constant learning rate (as DiT) after an optional linear warm-up of ``warmup_steps``."""
    t = cfg.train
    return t.lr * min(1.0, (step + 1) / t.warmup_steps) if t.warmup_steps else t.lr


def train_step(
    model: nn.Module, diffusion: Objective, optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None, micro_batches: list[tuple], amp_dtype: torch.dtype, max_grad_norm: float,
    d: Dist, rows_per_sample: int = 1, stepper: StepInBackward | None = None,
    packing: tuple[int, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """One optimizer step over this process's micro-batches, on the diffusion loss.

    A micro-batch is (x0 (B, C, [T,] H, W) latents or pixels (with ``packing``, a list of B samples of several
    shapes, ``train.mixed``), the model's condition keywords (``{"y": labels}`` or ``{"y": text states, "y_mask":
    mask}``, see ``BatchEncoder.conditioning``), its ``StepRandomness``[, per-row loss weights (B,) float]). Flips apply to x0 (for VAE latents: flipping the latents, as an approximation of
    encoding flipped pixels). ``rows_per_sample``: rows that make one sample (2 for DreamBooth's instance and
    class pairs, ``finetune.interleave_prior``).

    The loss of each micro-batch is its (weighted) sum over rows divided by this process's number of samples, so
    the accumulated gradient is this process's mean; DDP / FSDP then average over processes, which gives the
    mean over the global batch whatever the world size. Gradients are reduced only after the last
    micro-batch. ``stepper`` (``--fused_backward_pass``): the optimizer steps block by block during the last
    micro-batch's backward instead of after it (clipping by the previous step's norm, ``StepInBackward``).
    Divergence guard: a step whose loss or global gradient norm is not finite on any process changes nothing:
    the optimizer skips it on the device through its ``found_inf`` input, as the fp16 grad scaler drives torch's
    fused AdamW (``CompensatedAdamW`` on either of its paths, torch's fused AdamW), so no host sync; the
    libraries' own optimizers (torchao's, Adafactor) are stepped and selected back on the device
    (``step_skipping_on_device``; their first step reads the flag on the host). The caller skips
    the EMA update by ``"skipped"``. Under fp16 the grad scaler's own skip is that skip. With ``stepper`` the
    blocks step during the backward, each skipped on the device where the loss is not finite (the flag is
    computed before the backward); a non-finite gradient of a finite loss is found only after the blocks before
    it stepped (``StepInBackward`` says why); the EMA still skips that step, and the trainer's weight check
    refuses to save non-finite weights. ``packing`` (``--pack_tokens``): (tokens per
    row, the model's patch shape); each micro-batch's samples run packed (``data.packing``), same loss terms.

    Returns this process's loss (as optimised) and mean terms per row, the global gradient norm, and
    ``"skipped"`` (bool), as 0-dim tensors (no host sync here: the caller reads them when it logs).
    """
    rows = sum(len(mb[0]) for mb in micro_batches)
    local_batch = rows / rows_per_sample
    first = micro_batches[0][0]
    device_type = (first[0] if isinstance(first, list) else first).device.type
    # A new iteration for compiled CUDA graphs (--compile reduce-overhead / max-autotune): lets them replay
    # instead of falling back while the previous step's graphs look pending. A no-op without them; not called
    # off CUDA, where importing it (torch._inductor) would add ~1.5 s to every process's start.
    if device_type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()
    autocast = (torch.autocast(device_type, dtype=amp_dtype) if amp_dtype != torch.float32
                else contextlib.nullcontext())
    sums: dict[str, torch.Tensor] = {}
    total = 0  # the loss as optimised: the sum of the micro-batches' (each already divided by local_batch)
    for i, (x, cond, rnd, *weight) in enumerate(micro_batches):
        x = ([torch.where(f, s.flip(-1), s) for s, f in zip(x, rnd.flip)] if isinstance(x, list)
             else torch.where(rnd.flip.view(-1, *[1] * (x.ndim - 1)), x.flip(-1), x))  # images and videos
        with gradient_sync(model, i == len(micro_batches) - 1):
            with autocast:
                def model_fn(xt, tt, **packed):
                    return model(xt, tt, **cond, force_drop_ids=rnd.drop, **packed)

                terms = (diffusion.training_losses(model_fn, x, rnd.t, rnd.noise) if packing is None
                         else packed_training_losses(diffusion, model_fn, x, rnd.t, rnd.noise, *packing))
            per_row = terms["loss"] * weight[0].to(terms["loss"]) if weight else terms["loss"]
            loss = per_row.sum() / local_batch
            last = i == len(micro_batches) - 1
            if stepper is not None and last:  # the hooks step each block, skipped where the loss is not finite
                stepper.arm((~(total + loss.detach()).isfinite()).float())
            (scaler.scale(loss) if scaler is not None else loss).backward()
        for k, v in terms.items():
            sums[k] = sums.get(k, 0) + v.detach().sum()
        total = total + loss.detach()
    if stepper is not None:
        norm = stepper.finish()
        skipped = ~(total.isfinite() & norm.isfinite())
        return {k: v / rows for k, v in sums.items()} | {"loss": total, "grad_norm": norm, "skipped": skipped}
    if scaler is not None:
        scaler.unscale_(optimizer)
    # The fused steps scale the gradients as they read them, instead of a pass of their own over the gradients:
    # ours takes the clip factor, torch's fused AdamW divides by its grad_scale (AMP's unscale, here 1 / factor).
    folds = getattr(optimizer, "folds_clipping", False)
    divides = not folds and scaler is None and getattr(optimizer, "_step_supports_amp_scaling", False)
    grad_norm = clip_grad_norm_(model, 0.0 if folds or divides else max_grad_norm, d).detach()
    if folds and max_grad_norm > 0:
        optimizer.clip_coef = clip_coefficient(grad_norm, max_grad_norm)
    # torch's fused AdamW takes grad_scale and found_inf on the weights' device (the CPU under --cpu_offload all)
    scalar_device = optimizer.param_groups[0]["params"][0].device
    if divides and max_grad_norm > 0:
        optimizer.grad_scale = clip_coefficient(grad_norm, max_grad_norm).reciprocal().to(scalar_device)
    skipped = ~(total.isfinite() & grad_norm.isfinite())
    if d.mesh is not None:  # the loss is this process's: every process must skip alike
        flag = skipped.to(d.device, torch.float32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        skipped = flag.bool()
    if scaler is not None:  # its found-inf is the same test (non-finite unscaled gradients)
        scaler.step(optimizer)
        scaler.update()
    elif getattr(optimizer, "_step_supports_amp_scaling", False):  # skipped on the device
        optimizer.found_inf = skipped.float().to(scalar_device)
        optimizer.step()
        optimizer.found_inf = None
    else:
        step_skipping_on_device(optimizer, skipped.float())
    if folds:
        optimizer.clip_coef = None
    if divides:
        optimizer.grad_scale = None
    optimizer.zero_grad(set_to_none=True)
    return {k: v / rows for k, v in sums.items()} | {"loss": total, "grad_norm": grad_norm, "skipped": skipped}


@torch.no_grad()
def sample_grid(
    model: nn.Module, cond: dict[str, torch.Tensor], shape: tuple[int, ...], seed: int, cfg_scale: float = 4.0,
    num_steps: int = 100, learn_sigma: bool = True, clip_denoised: bool = True, objective: str = "ddpm",
    flow_shift: float | None = None, sampler: str | None = None,
) -> torch.Tensor:
    """Draw one sample per condition row (``cond`` as ``BatchEncoder.conditioning``) with ``sampler`` (default DDPM,
    Euler for a rectified-flow ``objective``) respaced to ``num_steps`` and guidance; (N, *shape) float32 (pixels
    in [-1, 1] or latents)."""
    y = cond["y"]
    g = torch.Generator(device=y.device).manual_seed(seed)
    return generate(model, y, shape, y_mask=cond.get("y_mask"), cfg_scale=cfg_scale, num_steps=num_steps,
                    sampler=sampler or ("euler" if objective == "flow" else "ddpm"), learn_sigma=learn_sigma, generator=g,
                    clip_denoised=clip_denoised, objective=objective, flow_shift=flow_shift or 1.0)


def _create_model(cfg: RunConfig, device: torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """The run's DiT, built on the meta device and materialised on ``device`` one block at a time, each block's
    weights cast to ``dtype`` as soon as they are initialised (None: fp32)."""
    m = cfg.model

    def cast(block: nn.Module) -> None:
        for p in block.parameters():
            p.data = p.data.to(dtype)

    return create_model(m.model, m.input_size, m.in_channels, m.num_classes, m.learn_sigma, m.class_dropout_prob,
                        num_frames=m.num_frames, text_dim=m.text_dim, qk_norm=m.qk_norm, depth=m.depth, device=device,
                        block_ready=cast if dtype is not None else None)


def _grid_conditioning(cfg: RunConfig, dataset, inputs: BatchEncoder, device: torch.device) -> dict:
    """What the periodic samples show: every class (up to 80 images, 8 each for 10 or fewer classes), or the
    first 8 distinct captions of the data (4 for videos)."""
    m = cfg.model
    if m.condition == "class":
        n = 8 if m.num_classes <= 10 else 1
        return {"y": torch.arange(m.num_classes, device=device).repeat_interleave(n)[:80]}
    captions = list(dict.fromkeys(getattr(dataset, "texts", None) or dataset.class_captions))
    captions = captions[:4 if m.num_frames else 8]
    if inputs.text_encoder is None:  # features: their captions were encoded before; load the encoder to sample
        from ditforge.encoders import load_text_encoder

        inputs = BatchEncoder("text", text_encoder=load_text_encoder(m.text_encoder, device,
                                                                     max_length=m.text_max_length))
    return inputs.conditioning({"text": captions}, device)


def _decode(cfg: RunConfig, inputs: BatchEncoder, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Samples -> pixels through the run's VAE (loaded here when the run reads features)."""
    vae = inputs.vae
    if vae is None:
        from ditforge.encoders import load_vae

        vae = inputs.vae = load_vae(cfg.model.vae, device, pixel_channels=cfg.model.in_channels)
    return vae.decode(x).float()


def _build_dataset(cfg: RunConfig, run_dir: Path, pre, d: Dist):
    """The data set of ``--data``, or DreamBooth's (``--instance_data``), after the base pipeline ``pre`` has
    generated the class images ``--class_data`` lacks (rank 0; the others wait)."""
    data, bad = cfg.data, run_dir / "bad_samples.jsonl"
    if data.buckets is not None:
        from ditforge.data.buckets import read_bucket_config

        if pre is not None:
            raise UserError(f"--buckets: not with --init_from {cfg.model.init_from} (a diffusers pipeline)")
        if source_of(data.data).streamed and not cfg.train.pack_tokens:
            raise UserError(f"--buckets with shards --data {data.data}: add --pack_tokens N (each step packs samples "
                            "of several buckets); one bucket per step needs a CSV / JSONL of files")
        video = any(t > 1 for frames in read_bucket_config(data.buckets).values() for t in frames)
        return build_bucket_dataset(cfg, bad, cfg.model.model or DEFAULT_MODELS[video])
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


def _default_outputs(cfg: RunConfig, d: Dist) -> str:
    data = Path(cfg.data.instance_data or cfg.data.data).name or "data"
    model = f"{cfg.model.model.replace('/', '-')}-" if cfg.model.model else ""
    name = [str(Path("outputs") / f"{data}-{model}{datetime.now():%Y%m%d-%H%M%S}")]
    if d.mesh is not None:  # every rank must write into the folder rank 0 named
        dist.broadcast_object_list(name, src=0)
    return name[0]


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


def _mean_over_processes(values: dict[str, torch.Tensor], d: Dist) -> dict[str, float]:
    """Average 0-dim tensors over all processes (one all-reduce) and read them on the host."""
    keys = sorted(values)
    stacked = torch.stack([torch.as_tensor(values[k], dtype=torch.float64) for k in keys])
    if d.mesh is not None:
        stacked = stacked.to(d.device)
        dist.all_reduce(stacked)
        stacked /= d.world_size
    return dict(zip(keys, stacked.tolist()))


def train(cfg: RunConfig) -> Path:
    """Train a DiT as configured, in this process or as one of torchrun's; returns the run folder.

    Writes (rank 0) ``config.yaml``, ``metrics.jsonl`` (step, loss, mse, vb, lr, grad_norm, samples_per_sec,
    ...), ``samples/step-*.png`` and ``checkpoints/step-*/`` (every rank its shards); a checkpoint is saved
    every ``ckpt_every`` steps, at the end, and on Ctrl-C or SIGTERM (then KeyboardInterrupt is re-raised).

    Raises:
        UserError: bad data, model, parallelism or checkpoint settings.
    """
    if cfg.train.gpu_memory_budget is not None:
        # Under a cap the caching allocator's fixed-size segments fragment (a free 300 MB that no 350 MB request
        # fits is lost to the budget); segments that grow in place do not. Read when CUDA first allocates.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sp = cfg.parallel.sequence_parallel_size
    if sp > 1 and (family := _pipeline_family(cfg)) is not None:  # before any process group or run folder
        refuse_unsplittable(family, sp, "shard it with --plugin fsdp instead", use="train")
    d = init_distributed(cfg.train.device, sp,
                         group_of_one=cfg.train.cpu_offload == "all",  # FSDP2 offloads, even in one process
                         tensor_parallel_size=cfg.parallel.tensor_parallel)
    try:
        with contextlib.ExitStack() as held:
            return _train(cfg, d, held)
    finally:
        shutdown(d)


def _pipeline_family(cfg: RunConfig):
    """The adapter class of the diffusers pipeline the run fine-tunes (``--init_from``, or the one a features folder
    was made from), or None."""
    init = cfg.model.init_from
    if init is None and source_of(cfg.data.data) is FEATURES:
        init = read_manifest(cfg.data.data).get("init_from")
    if init is None or not is_adapted_pipeline(init):
        return None
    return family_of_pipeline(read_model_index(init)["_class_name"])


def _train(cfg: RunConfig, d: Dist, held: contextlib.ExitStack) -> Path:
    """The run's phases, in order; each fills its part of the state they share (``_Run``)."""
    run = _open_run(cfg, d, held)
    _load_init(run)
    _build_data(run)
    _build_objective(run)
    _build_model(run)
    _build_optimizer(run)
    _resume(run)
    _open_outputs(run)
    _build_loader(run)
    _open_logs(run)
    return _finish(run, _loop(run))


@dataclass
class _Run:
    """What the phases of one run share. ``_open_run`` fills the fields up to ``bf16_weights``; each later phase
    fills its own group below, so a field keeps its default until its phase has run."""

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
    # --init_from (_load_init)
    features: dict | None = None  # the manifest of a features folder --data
    pre: Pretrained | None = None  # a pretrained pipeline of a diffusers family
    dit_init: tuple | None = None  # DiT weights and their model settings (read_dit_init)
    # data (_build_data)
    dataset: object = None
    video: bool = False
    inputs: BatchEncoder | None = None
    bucketed: object = None  # --buckets: the BucketBatchSampler (each bucket's batch size is its global batch)
    steps_per_epoch: int = 0
    max_steps: int = 0
    # objective, model and optimizer (_build_objective, _build_model, _build_optimizer, _resume)
    diffusion: Objective | None = None
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
    # outputs, loader and logs (_open_outputs, _build_loader, _open_logs)
    checkpointer: ckpt_io.Checkpointer | None = None
    shard_loader: object = None  # streamed shards: their loader, whose position each checkpoint saves
    loader: DevicePrefetcher | None = None
    sample_shape: tuple[int, ...] = ()
    packing: tuple[int, tuple[int, ...]] | None = None  # --pack_tokens (train_step's)
    metrics: MetricsLog | None = None  # rank 0's, as the tracker
    tracker: Tracker | None = None
    nonfinite: NonfiniteGuard | None = None
    # the sample grids' model and conditioning, made for the first grid (rank 0)
    grid_model: nn.Module | None = None
    grid_cond: dict | None = None

    def last_good(self) -> Path | None:
        return _last_checkpoint(self.run_dir)

    def written(self, what: str) -> contextlib.AbstractContextManager:
        return disk_errors(what, self.run_dir, self.cfg.train.continue_on_save_error, self.last_good)

    def save(self, step: int) -> Path | None:
        """Save step ``step`` unless its weights are not finite (RunError); a failed write is a RunError too, or
        with --continue_on_save_error a warning (returns None)."""
        model, ema, d = self.model, self.ema, self.d
        self.nonfinite.flush()
        weights = [p for p in model.parameters() if p.requires_grad] + [ema.shadow[k] for k in ema.trainable]
        if not all_finite(weights, d):
            raise RunError(f"step {step}: the weights hold NaN or inf; not saved (the last good checkpoint is "
                           f"{self.last_good()}); lower --lr, add --warmup_steps or keep --max_grad_norm")
        meta = {"config": self.cfg.to_dict(), "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "step_in_backward": self.stepper.state_dict() if self.stepper is not None else None,
                "world_size": d.world_size, "plugin": self.cfg.parallel.plugin,
                "loader": (self.shard_loader.state_dict(step + self.data_offset, self.checkpointer.group)
                           if self.shard_loader is not None else None),
                "data_offset": self.data_offset,
                "loss_spike": self.spikes.state_dict(d) if self.spikes is not None else None}
        with self.written(f"checkpoint step-{step:07d}"):
            return self.checkpointer.save(step, ckpt_io.training_state(model, self.optimizer, ema, self.adapters_only),
                                          meta)
        return None

    def finish_saves(self) -> None:
        with self.written("checkpoint"):
            self.checkpointer.wait()

    def update_ema(self, step: int, skipped: torch.Tensor) -> None:
        decay = self.cfg.train.ema_decay
        if skipped.device.type == "cpu":  # known on the host already
            if not skipped:
                self.ema.update(self.model, ema_decay_at(decay, step))
        else:
            self.ema.update(self.model, ema_decay_at(decay, step), skip=skipped)

    def write_samples(self, step: int) -> None:
        t = self.cfg.train
        try:
            with self.written(f"sample grid of step {step}"):
                self.draw_samples(step)
                if self.tracker is not None:  # the grid draw_samples wrote
                    suffix = ".gif" if self.video else ".png"
                    self.tracker.image(step, self.run_dir / "samples" / f"step-{step:07d}{suffix}")
        except torch.OutOfMemoryError:  # a grid is never worth the run (a tight --gpu_memory_budget)
            log.warning("step %d: no sample grid, out of GPU memory (%s)", step,
                        f"--gpu_memory_budget {t.gpu_memory_budget}" if t.gpu_memory_budget else "the GPU's memory")
            torch.cuda.empty_cache()

    def draw_samples(self, step: int) -> None:
        cfg, device = self.cfg, self.d.device
        weights = self.ema.full_state_dict()  # a collective under zero2/fsdp: every rank takes part
        if not self.d.is_main:
            return
        name = self.run_dir / "samples" / f"step-{step:07d}"
        if self.pre is not None:  # the family's own pipeline and scheduler draw the grid
            # on the run's device: under --cpu_offload all the trained weights are in host memory
            pixels, self.grid_model = finetune.sample_grid(self.pre, cfg, weights, self.dataset, self.grid_model,
                                                           device=device)
            if not self.video:
                save_grid(to_uint8(pixels), name.with_suffix(".png"), nrow=4)
                return
        else:
            if self.grid_cond is None:
                self.grid_cond = _grid_conditioning(cfg, self.dataset, self.inputs, device)
            pixels = self.draw(weights, self.grid_cond, cfg.train.seed)
        if self.video:  # a GIF of grids: frame k of every sample side by side
            from ditforge.data.video import write_gif  # PyAV: ditforge[video]

            frames = to_uint8(pixels)  # (N, T, H, W, C)
            grids = [make_grid(frames[:, k], nrow=min(len(pixels), 4), upscale=max(1, 64 // cfg.data.image_size))
                     for k in range(frames.shape[1])]
            write_gif(np.stack(grids), name.with_suffix(".gif"), fps=8)
        else:
            save_grid(to_uint8(pixels), name.with_suffix(".png"), nrow=8, upscale=max(1, 64 // cfg.data.image_size))

    def draw(self, weights: dict[str, torch.Tensor], cond: dict[str, torch.Tensor], seed: int, **how) -> torch.Tensor:
        """Pixels (N, C, [T,] H, W) in [-1, 1] of samples of a DiT with ``weights`` (rank 0); ``how``: sampler and
        steps (``sample_grid``'s)."""
        cfg, m, device = self.cfg, self.cfg.model, self.d.device
        if self.grid_model is None:
            self.grid_model = _create_model(cfg, device).eval()
        self.grid_model.load_state_dict(weights)
        with whole_sequences():  # rank 0 alone: no sequence-parallel attention
            x = sample_grid(self.grid_model, cond, self.sample_shape, seed=seed, learn_sigma=m.learn_sigma,
                            clip_denoised=m.vae == "none",  # VAE latents are not bounded to [-1, 1]
                            objective=m.objective, flow_shift=m.flow_shift, **how)
        return _decode(cfg, self.inputs, x, device)

    def evaluate(self) -> dict[str, float]:
        """--eval_every: the built-in digits extractor's metrics of ``eval_samples`` EMA samples, labels cycling
        through the classes, drawn with DDIM in 25 steps at guidance 4 (cheap enough to run often on a CPU) in
        batches of 256 (batch k seeded by ``derive_seed(seed, k)``)."""
        from ditforge.eval.digits import evaluate_digits

        t, device = self.cfg.train, self.d.device
        weights = self.ema.full_state_dict()  # a collective under zero2/fsdp: every rank takes part
        if not self.d.is_main:
            return {}
        labels = torch.arange(t.eval_samples, device=device) % self.cfg.model.num_classes
        pixels = torch.cat([self.draw(weights, {"y": y}, derive_seed(t.seed, k), sampler="ddim", num_steps=25)
                            for k, y in enumerate(labels.split(256))])
        result = evaluate_digits(pixels.cpu(), labels.cpu(), device=device)
        return {f"digits_{k}": v for k, v in result.items()}


def _last_checkpoint(run_dir: Path) -> Path | None:
    found = weights_io.list_checkpoints(run_dir)
    return found[-1] if found else None


def _open_run(cfg: RunConfig, d: Dist, held: contextlib.ExitStack) -> _Run:
    """Run folder and guards: the folder claimed (its lock released by ``held``), the checkpoint to resume from,
    the compute dtype, memory budget and plugin resolved, and what they cannot run with refused (UserError)."""
    t, m, par = cfg.train, cfg.model, cfg.parallel
    resume_from, t.outputs = ckpt_io.find_resume(t.resume, t.outputs)
    if t.outputs is None:
        t.outputs = _default_outputs(cfg, d)
    run_dir = Path(t.outputs)
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
    if plugin in ("zero2", "fsdp") and t.optimizer in LIBRARY_OPTIMIZERS:  # not tested over DTensors
        raise UserError(f"--optimizer {t.optimizer}: supported with --plugin none or ddp, got {plugin}; under "
                        "zero2 / fsdp use --optimizer adamw or adamw8bit")
    if cfg.parallel.tensor_parallel > 1 and (t.optimizer, t.master_weights) != ("adamw", "fp32"):
        # CompensatedAdamW steps FSDP2's shards of the first dimension; tensor parallelism shards others
        raise UserError(f"--optimizer {t.optimizer} --master_weights {t.master_weights}: not with --tensor_parallel "
                        f"{cfg.parallel.tensor_parallel}; use --optimizer adamw --master_weights fp32")
    if t.cpu_offload == "optimizer" and plugin in ("zero2", "fsdp"):
        raise UserError(f"--cpu_offload optimizer: supported with --plugin none or ddp, got {plugin}; "
                        "--cpu_offload all offloads under zero2 / fsdp")
    if t.cpu_offload == "all" and plugin not in ("zero2", "fsdp"):
        raise UserError(f"--cpu_offload all: offloads through FSDP2, with --plugin fsdp or zero2, got {plugin}")
    if t.fused_backward_pass and plugin != "none":  # DDP / FSDP reduce a gradient after the hook would step
        raise UserError(f"--fused_backward_pass: one process only, got --plugin {plugin} over {d.world_size}")
    par.plugin = plugin
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
    return _Run(cfg, d, run_dir, resume_from, amp_dtype, budget, mixed, per_step, home, half_base, bf16_weights)


def _load_init(run: _Run) -> None:
    """--init_from: a diffusers family's pretrained pipeline (``run.pre``) or DiT weights (``run.dit_init``); a
    features folder made from a pipeline names that pipeline."""
    cfg, m, device, amp_dtype = run.cfg, run.cfg.model, run.d.device, run.amp_dtype
    features = read_manifest(cfg.data.data) if source_of(cfg.data.data) is FEATURES else None
    if m.init_from is None and features is not None:
        m.init_from = features.get("init_from")  # features of a pretrained pipeline: fine-tune that pipeline
    if m.init_from is not None:
        if is_adapted_pipeline(m.init_from):
            # From features, the text encoders only encode the empty prompt and the sample grids, and the VAE only
            # decodes the grids: kept on the CPU (the VAE visits the GPU for a grid), out of a tight memory budget.
            on_gpu = device.type == "cuda" and features is None
            helpers = device if features is None else torch.device("cpu")
            # a base to be stored in fp8, swapped, or placed under a budget is cast and changed in host memory and
            # moves to the GPU after (_build_model): the bf16 base alone can exceed the budget (Wan-14B's 26.6 GiB)
            staged = m.fp8_base or cfg.train.blocks_to_swap or cfg.train.gpu_memory_budget is not None
            run.pre = load_pretrained(m.init_from, device, amp_dtype if on_gpu else torch.float32,
                                      text_device=helpers, vae_device=helpers,
                                      denoiser_device=torch.device("cpu") if staged else run.home,
                                      denoiser_dtype=amp_dtype if run.bf16_weights else torch.float32,
                                      expert=m.expert, other_expert_device=torch.device("cpu"))
            if features is not None and run.pre.denoiser.image_noise and m.noised_image_input:
                log.info("--noised_image_input: the features hold the clean first frames' latents, so the image "
                         "conditioning is not noised; train on the clips to noise it")
            if m.expert is not None and cfg.train.sample_every:  # the pipeline's grid would need both experts
                log.info("--expert %s: no periodic samples (the other expert stays in host memory); draw them "
                         "with ditforge sample --ckpt RUN", m.expert)
                cfg.train.sample_every = 0
        else:
            run.dit_init = read_dit_init(cfg)
    run.features = features


def _settle_flips(cfg: RunConfig, dataset, pre) -> None:
    """``--random_flip``'s default: the data set's, but off for a video pipeline (Wan), whose flips would act on
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


def _build_data(run: _Run) -> None:
    """Data: the data set, the batch encoder (VAE, text encoder), the data and model settings the data decides
    (flips, streams, workers, classes, the default model), the bucket sampler and the run's length in steps."""
    cfg, d, run_dir, pre = run.cfg, run.d, run.run_dir, run.pre
    t, m, device = cfg.train, cfg.model, d.device
    dataset = _build_dataset(cfg, run_dir, pre, d)
    video = getattr(dataset, "num_frames", None) is not None
    if pre is not None:
        inputs = pipeline_batch_encoder(cfg, pre, dataset)
    else:
        if m.model is None:
            m.model = DEFAULT_MODELS[video]
        if is_video_model(m.model) != video:
            raise UserError(f"--model {m.model} is {'a video' if is_video_model(m.model) else 'an image'} model; "
                            f"--data {cfg.data.data} holds {'videos' if video else 'images'}")
        inputs = build_batch_encoder(cfg, dataset, device, run.amp_dtype if device.type == "cuda" else torch.float32)
    _settle_flips(cfg, dataset, pre)
    if isinstance(dataset, ShardData) and cfg.data.data_streams is None:
        cfg.data.data_streams = math.gcd(t.batch_size, math.lcm(16, d.dp_size))  # >= 16 and every rank its streams
    if cfg.data.num_workers is None:
        cfg.data.num_workers = _default_workers(dataset, cfg.data, d.dp_size)
    if not dataset.num_classes and m.condition == "class":  # captioned images have no labels
        raise UserError(f"--data {cfg.data.data} holds captioned images, no class labels; use --condition text")
    if m.num_classes is None:
        m.num_classes = dataset.num_classes or None
    elif m.num_classes < dataset.num_classes and m.condition == "class":
        raise UserError(f"--num_classes {m.num_classes}: the data has {dataset.num_classes} classes")
    bucketed = None  # --buckets: each bucket's batch size is its global batch; --batch_size is not used
    if cfg.data.buckets is not None and not isinstance(dataset, ShardData):  # shards: the streams' order
        from ditforge.data.buckets import BucketBatchSampler

        if not run.mixed:
            dataset.buckets.check_batch_sizes(run.per_step, f"{d.dp_size} data-parallel processes x "
                                                            f"--grad_accum_steps {cfg.parallel.grad_accum_steps}")
        bucketed = BucketBatchSampler(dataset.buckets, dataset.sizes, t.seed, d.dp_rank, d.dp_size,
                                      batch_size=t.batch_size if run.mixed else None)
    run.steps_per_epoch = bucketed.steps_per_epoch if bucketed else len(dataset) // t.batch_size
    run.max_steps = t.max_steps or (t.epochs * max(run.steps_per_epoch, 1) if t.epochs else 1000)
    run.dataset, run.video, run.inputs, run.bucketed = dataset, video, inputs, bucketed


def _build_objective(run: _Run) -> None:
    """The learning rate's default (by the model and the optimizer asked, before a memory budget may change the
    optimizer), and the objective, which a diffusers family's scheduler config decides; the config records it."""
    t, m, pre = run.cfg.train, run.cfg.model, run.pre
    if t.lr is None and t.optimizer == "adafactor":  # its lr is a relative step size: the paper's 1e-2
        t.lr = 1e-2
    if t.lr is None:  # the tiny model trains well (and fast enough for a CPU) at 1e-3; see benchmarks/digits_quality.py --sweep
        t.lr = (1e-4 if m.lora_rank else 1e-5) if pre is not None else 1e-3 if "-T/" in m.model else 1e-4
    # the family's part (an expert's side of the schedule, given frames, the sequence a dynamic shift follows)
    family = pre.denoiser.objective_args(pre.pipe, m.expert, m.num_frames, m.input_size) if pre is not None else {}
    diffusion = create_objective(m.objective, m.learn_sigma, pre.scheduler_config if pre is not None else None,
                                 m.flow_shift, m.weighting_scheme, m.logit_mean, m.logit_std,
                                 where=f"--init_from {m.init_from}", device=run.d.device, **family)
    m.objective = {"flow": "flow", "v_prediction": "v", "epsilon": "ddpm"}[diffusion.prediction_type]
    if m.objective == "flow":
        m.flow_shift = diffusion.shift
    run.diffusion = diffusion


def _build_model(run: _Run) -> None:
    """The denoiser: the pipeline's or a new DiT (initial weights alike on every rank), its LoRA, its storage
    dtype, then ``parallelize``; under zero2 / fsdp a DiT is sharded on the meta device, then initialised."""
    cfg, d, pre, home, amp_dtype = run.cfg, run.d, run.pre, run.home, run.amp_dtype
    t, m, par, plugin = cfg.train, cfg.model, cfg.parallel, cfg.parallel.plugin
    torch.manual_seed(t.seed)  # the same initial weights on every rank
    skeleton = None  # an unsharded meta copy of a model that is sharded before it is materialised
    if pre is not None:
        model = pre.denoiser
        if m.train_text_encoder:
            if run.features is not None:
                raise UserError(f"--train_text_encoder: --data {cfg.data.data} holds prompts encoded already; "
                                "train on the captioned images")
            train_text_encoder(model, pre.pipe.text_encoder, pre.pipe, cfg)
    else:
        # bf16 weights: cast block by block, so the model never is whole in fp32 (the loop below casts the rest)
        # zero2 / fsdp: sharded on the meta device, then each process initialises its shards (init_sharded), so
        # the model never is whole on a GPU. Not with what needs the whole model first: official weights, LoRA,
        # FP8 conversion, the sequence-parallel measurement, or host shards (--cpu_offload all)
        if (plugin in ("zero2", "fsdp") and run.dit_init is None and not m.lora_rank and d.sp_mesh is None
                and t.mixed_precision != "fp8" and t.cpu_offload != "all"):
            skeleton = _create_model(cfg, torch.device("meta"))
            model = copy.deepcopy(skeleton)
        else:
            # LoRA: the adapters are drawn in fp32 on the fp32 base, which the loop below casts after injection
            model = _create_model(cfg, home, amp_dtype if run.bf16_weights and not m.lora_rank else None)
        if run.dit_init is not None:
            load_dit_weights(model, dit_init_weights(run.dit_init, cfg), t.seed)
    if m.lora_rank:
        add_lora_to_denoiser(model, cfg)
    if m.lora_rank and pre is not None and run.budget is not None and not m.fp8_base and plugin in ("none", "ddp"):
        m.fp8_base = finetune.fp8_base_pays(sum(p.numel() for p in model.parameters() if not p.requires_grad),
                                            run.budget)
        if m.fp8_base and d.is_main:
            log.info("--gpu_memory_budget %s: --fp8_base", t.gpu_memory_budget)
    if m.fp8_base:
        finetune.store_base_in_fp8(model, amp_dtype, plugin)
    (model if skeleton is not None else model.to(home)).train()
    if run.budget is not None:
        _place_under_budget(run, model)
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
        _swap_blocks(run, model)
    run.model = model


def _swap_blocks(run: _Run, model: nn.Module) -> None:
    """--blocks_to_swap: the last N repeated blocks' frozen weights to host memory (``parallel.offload.BlockSwap``).

    Raises:
        UserError: a model that is no diffusers pipeline's, or fewer blocks than asked.
    """
    from ditforge.parallel.offload import BlockSwap

    n, pre = run.cfg.train.blocks_to_swap, run.pre
    if pre is None:
        raise UserError("--blocks_to_swap: swaps the blocks of a diffusers pipeline's transformer (--init_from)")
    blocks = [m for m in model.modules() if type(m).__name__ in pre.denoiser.block_classes]
    if n > len(blocks):
        raise UserError(f"--blocks_to_swap {n}: {pre.pipeline_class}'s transformer has {len(blocks)} blocks")
    swap = BlockSwap(blocks[len(blocks) - n:], run.d.device)  # its hooks hold it
    if run.d.is_main:
        log.info("--blocks_to_swap %d: %.2f GiB of frozen weights in host memory", n, swap.host_bytes / 2**30)


def _place_under_budget(run: _Run, model: nn.Module) -> None:
    """--gpu_memory_budget: the optimizer, master weights, fused backward and CPU offload that fit the budget
    (``plan_placement``'s rule), written into the config."""
    t, d, plugin = run.cfg.train, run.d, run.cfg.parallel.plugin
    frozen = sum(p.numel() * (min(2, p.element_size()) if run.half_base else p.element_size())
                 for p in model.parameters() if not p.requires_grad)
    given = (t.optimizer, t.master_weights, t.fused_backward_pass, t.cpu_offload)
    choice = plan_placement(run.budget, sum(p.numel() for p in model.parameters() if p.requires_grad), frozen,
                            t.ema_decay != 0, given, run.amp_dtype == torch.bfloat16,
                            lowmem=plugin in ("none", "ddp"), fused_ok=plugin == "none",
                            offload_ok=t.fused_optimizer == "auto" and on_gpu_with_triton(d.device))
    if choice != given and d.is_main:
        log.info("--gpu_memory_budget %s: --optimizer %s --master_weights %s%s --cpu_offload %s",
                 t.gpu_memory_budget, *choice[:2], " --fused_backward_pass" if choice[2] else "", choice[3])
    t.optimizer, t.master_weights, t.fused_backward_pass, t.cpu_offload = choice


def _build_optimizer(run: _Run) -> None:
    """The EMA, the optimizer (its placement and precision), the step in the backward and the fp16 grad scaler."""
    t, model, device = run.cfg.train, run.model, run.d.device
    run.adapters_only = bool(run.cfg.model.lora_rank)  # LoRA: EMA and checkpoints hold the adapters alone
    ema = run.ema = EMA(model, trainable_only=run.adapters_only, alias=t.ema_decay == 0)
    optimizer = run.optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], t.optimizer,
                                                t.lr, t.weight_decay, device, t.master_weights,
                                                in_backward=t.fused_backward_pass, fused=t.fused_optimizer == "auto",
                                                offload=t.cpu_offload, delayed_update=t.delayed_update)
    # the fused step updates the EMA in its own pass (update_ema is then a no-op); StepInBackward's is per block
    run.ema_in_step = not t.fused_backward_pass and ema.fuse_into(unwrap(model), optimizer)
    # --fused_backward_pass: the blocks step during the backward; an async checkpoint's staging finishes first
    run.stepper = (StepInBackward(unwrap(model), optimizer, t.max_grad_norm,
                                  lambda: run.checkpointer.wait_for_staging()) if t.fused_backward_pass else None)
    if run.amp_dtype == torch.float16:
        if run.cfg.parallel.plugin in ("zero2", "fsdp"):  # found-inf must agree across ranks that hold different shards
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            run.scaler = ShardedGradScaler(device.type)
        else:
            run.scaler = torch.amp.GradScaler(device.type)


def _resume(run: _Run) -> None:
    """The loss-spike guard (--loss_spike_factor); --resume: the weights, optimizer, EMA, grad scaler,
    step-in-backward and loss-spike guard states of ``run.resume_from``, its step, data offset and shard loader's
    position."""
    resume_from, t = run.resume_from, run.cfg.train
    if t.loss_spike_factor is not None:  # a partial, not run.last_good (see _open_logs)
        run.spikes = LossSpikeGuard(t.loss_spike_factor, t.loss_spike_window, t.max_loss_spike_rollbacks,
                                    run.d.device, functools.partial(_last_checkpoint, run.run_dir))
    if resume_from is None:
        return
    saved = bool(weights_io.read_meta(resume_from).get("config", {}).get("train", {}).get("delayed_update"))
    if saved != t.delayed_update:  # its optimizer state holds the masters, one update ahead of the weights
        raise UserError(f"--resume {resume_from}: saved {'with' if saved else 'without'} --delayed_update; "
                        f"resume it {'with' if saved else 'without'} the flag")
    meta = _load_checkpoint(run, resume_from)
    run.start_step, run.loader_state = int(meta["step"]), meta.get("loader")
    run.data_offset = meta.get("data_offset", 0)  # kept with the guard off: the skipped batches stay skipped
    if run.spikes is not None:
        run.spikes.load_state_dict(meta.get("loss_spike"), run.d)
    if run.d.is_main:
        log.info("resumed from %s at step %d (saved by %s processes, plugin %s)", resume_from, run.start_step,
                 meta.get("world_size", 1), meta.get("plugin", "none"))


def _load_checkpoint(run: _Run, ckpt: Path) -> dict:
    """The weights, optimizer, EMA, grad scaler and step-in-backward states of ``ckpt`` into the run's; returns
    its meta (``ckpt_io.load_training_state``'s errors)."""
    meta = ckpt_io.load_training_state(ckpt, run.model, run.optimizer, run.ema, run.adapters_only)
    if run.scaler is not None and meta.get("scaler"):
        run.scaler.load_state_dict(meta["scaler"])
    if run.stepper is not None and meta.get("step_in_backward"):
        run.stepper.load_state_dict(meta["step_in_backward"])
    return meta


def _open_outputs(run: _Run) -> None:
    """The run folder's ``samples/`` and ``config.yaml`` (rank 0), the metrics of steps after the resumed
    checkpoint (all of them on a fresh start) dropped, and the checkpointer, whose async staging every optimizer
    step waits for."""
    d, run_dir, t = run.d, run.run_dir, run.cfg.train
    if d.is_main:
        (run_dir / "samples").mkdir(parents=True, exist_ok=True)
        _write_config(run_dir / "config.yaml", run.cfg)
        # a fresh start drops them all: they are a killed run's that saved no checkpoint
        _truncate_metrics(run_dir / "metrics.jsonl", run.start_step)
    d.barrier()
    checkpointer = run.checkpointer = ckpt_io.Checkpointer(
        run_dir, t.keep_last, run.cfg.parallel.async_checkpoint, d,
        last_step=run.start_step if run.resume_from is not None else None)
    run.optimizer.register_step_pre_hook(lambda *_: checkpointer.wait_for_staging())


def _build_loader(run: _Run) -> None:
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


def _open_logs(run: _Run) -> None:
    """``metrics.jsonl`` and the tracker (rank 0), the non-finite step guard, and the run's summary in the log."""
    cfg, d, t, m = run.cfg, run.d, run.cfg.train, run.cfg.model
    run.metrics = MetricsLog(run.run_dir / "metrics.jsonl") if d.is_main else None
    run.tracker = (Tracker(run.run_dir, t.report_to, cfg.to_dict(), run.start_step if run.resume_from else None)
                   if d.is_main else None)
    # not run.last_good: a bound method kept in run.nonfinite would tie run to itself in a reference cycle, and the
    # run's loader workers, which hold the run folder's lock file open, would outlive the run until a GC pass
    run.nonfinite = NonfiniteGuard(1 if t.on_nonfinite == "stop" else t.max_nonfinite_steps,
                                   functools.partial(_last_checkpoint, run.run_dir))
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


def _loop(run: _Run) -> int:
    """The training loop, from ``run.start_step`` to ``run.max_steps``; returns the step reached. The first Ctrl-C
    or SIGTERM ends it after the step in flight with a checkpoint, then KeyboardInterrupt is re-raised; on a
    RunError a background save of good weights completes first."""
    t, d = run.cfg.train, run.d
    step, stepped = run.start_step, False
    # --gpu_memory_budget with streamed states: after two steps, as many states as the measured peak leaves room for
    # stay on the GPU (keep_states_within)
    measure_at = run.start_step + 2 if run.budget is not None and t.cpu_offload == "optimizer" else None
    window = _Window()
    bar = tqdm(total=run.max_steps, initial=run.start_step, desc="train", dynamic_ncols=True,
               disable=None if d.is_main else True)
    interrupted = _DeferredInterrupt()
    # Its own gloo group: the checkpointer's may be busy in a background save's collectives.
    control_group = dist.new_group(backend="gloo") if d.mesh is not None else None
    try:
        batches = iter(run.loader)
        while step < run.max_steps:
            if not interrupted.check(run.checkpointer.writing(), control_group) and run.checkpointer.pending:
                # a background save written on every rank is published now, not by the next save: a kill then
                # redoes at most --ckpt_every steps, not up to twice that
                run.finish_saves()
            waited = time.perf_counter()
            batch = as_batch(next(batches))
            window.data_wait += time.perf_counter() - waited
            micro, rows, samples = _micro_batches(run, batch, step + run.data_offset)
            set_lr(run.optimizer, learning_rate(run.cfg, step))
            if run.ema_in_step:
                run.optimizer.ema_decay = ema_decay_at(t.ema_decay, step)
            try:
                out = train_step(run.model, run.diffusion, run.optimizer, run.scaler, micro, run.amp_dtype,
                                 t.max_grad_norm, d, rows, run.stepper, run.packing)
            except torch.OutOfMemoryError:
                raise out_of_memory(step, t.gpu_memory_budget, d.device) from None
            skipped, stepped = out.pop("skipped"), True
            run.checkpointer.wait_for_staging()  # a skipped fp16 step runs no pre-step hook; the EMA changes next
            run.update_ema(step, skipped)
            run.nonfinite.push(step + 1, skipped, out["loss"], out["grad_norm"])  # reads the previous step's flag
            if run.spikes is not None:
                run.spikes.push(step, out["loss"], skipped)
            step, stepped = step + 1, False
            if step == measure_at:
                _keep_states_within_budget(run)
            window.add(out, skipped, samples)
            bar.update(1)
            step = _after_step(run, step, window, bar)
    except KeyboardInterrupt:
        bar.close()
        if stepped:  # the optimizer already took this step: finish it, so the checkpoint is step-consistent
            run.update_ema(step, skipped)
            step += 1
        path = run.save(step)
        run.finish_saves()
        log.warning("interrupted at step %d; checkpoint saved to %s", step, path)
        raise
    except RunError:
        with contextlib.suppress(RunError):
            run.finish_saves()  # a background save of good weights still completes
        raise
    finally:
        interrupted.restore()
        if run.metrics is not None:
            run.metrics.close()
    bar.close()
    return step


IMAGE_NOISE_STREAM = 7919  # the key that sets the image-to-video training noise's seeds apart from every other's


def _micro_batches(run: _Run, batch: dict, position: int) -> tuple[list[tuple], int, int]:
    """A loader batch -> the micro-batches for ``train_step`` (latents, conditioning, ``StepRandomness`` of data
    position ``position``, the step plus the batches skipped (``_Run.data_offset``) [, loss weights];
    ``--grad_accum_steps`` of them), its rows per sample (2 for DreamBooth's prior pairs) and the samples of its
    global batch."""
    cfg, d, inputs, device = run.cfg, run.d, run.inputs, run.d.device
    t, m = cfg.train, cfg.model
    weights = None
    if "class_x" in batch:  # DreamBooth with prior preservation: instance and class rows alternate
        batch, weights = finetune.interleave_prior(batch, cfg.data.prior_loss_weight)
    rows = 1 if weights is None else 2
    noise_seeds = None
    if run.pre is not None and run.pre.denoiser.image_noise and m.noised_image_input and "x" in batch:
        # sample j of the global batch noises its first frame from its own stream: the same at any world size
        first = d.dp_rank * len(batch["x"])
        noise_seeds = [derive_seed(t.seed, IMAGE_NOISE_STREAM, position, first + i) for i in range(len(batch["x"]))]
    cond = inputs.conditioning(batch, device, noise_seeds)
    if run.mixed:
        x, rnd = mixed_step_inputs(inputs, batch["x"], device, t.seed, position, run.diffusion, m.class_dropout_prob,
                                   d.dp_rank * len(batch["x"]))
    else:
        mean, std = inputs.moments(batch, device)
        # the global batch and its shape: this step's bucket's with --buckets
        rnd = step_randomness(t.seed, position, len(mean) * d.dp_size, tuple(mean.shape[1:]), run.diffusion,
                              m.class_dropout_prob, device, d.dp_rank, d.dp_size, latent_noise=std is not None)
        x = inputs.draw(mean, std, rnd.eps)
    if not cfg.data.random_flip:
        rnd.flip.zero_()
    k = cfg.parallel.grad_accum_steps
    conds = [dict(zip(cond, parts)) for parts in zip(*(v.chunk(k) for v in cond.values()))]
    rnds = [StepRandomness(*parts, None) for parts in zip(*(chunk(v, k) for v in
                                                             (rnd.noise, rnd.t, rnd.drop, rnd.flip)))]
    micro = list(zip(chunk(x, k), conds, rnds, *([weights.chunk(k)] if rows > 1 else [])))
    return micro, rows, len(x) * d.dp_size // rows


def _keep_states_within_budget(run: _Run) -> None:
    moved, peak = keep_states_within(run.optimizer, run.budget, run.d.device)
    if run.d.is_main:
        log.info("--gpu_memory_budget %s: peak %.2f GiB reserved over the first steps; %.2f GiB of "
                 "optimizer states moved to the GPU, the rest stream", run.cfg.train.gpu_memory_budget, peak / 2**30,
                 moved / 2**30)


class _Window:
    """The steps since the last metrics record: their summed values (a skipped step's left out), their count,
    their samples, and the time since the window opened and spent waiting for data."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.start, self.steps, self.samples, self.data_wait = time.perf_counter(), 0, 0, 0.0

    def add(self, out: dict[str, torch.Tensor], skipped: torch.Tensor, samples: int) -> None:
        self.steps, self.samples = self.steps + 1, self.samples + samples
        for k, v in out.items():  # a skipped step's values (NaN, inf) stay out of the means
            self.sums[k] = self.sums.get(k, 0) + torch.where(skipped, 0.0, v)
        self.sums["good_steps"] = self.sums.get("good_steps", 0) + (~skipped).double()

    def record(self, run: _Run, step: int) -> dict[str, float]:
        """The window's metrics record at ``step``: means over its good steps and all processes (one all-reduce),
        lr, throughput, epoch, skipped steps, data-wait fraction and (CUDA) peak memory."""
        sums = _mean_over_processes(self.sums, run.d)
        good = sums.pop("good_steps")  # the same on every process
        record = {k: v / good if good else math.nan for k, v in sums.items()}
        elapsed = time.perf_counter() - self.start
        record |= {"lr": learning_rate(run.cfg, step - 1), "samples_per_sec": self.samples / elapsed,
                   "epoch": step / max(run.steps_per_epoch, 1), "skipped_steps": self.steps - round(good),
                   "data_wait_fraction": self.data_wait / elapsed}
        if run.d.device.type == "cuda":
            record["peak_memory_gib"] = torch.cuda.max_memory_allocated(run.d.device) / 2**30
        return record


def _after_step(run: _Run, step: int, window: _Window, bar: tqdm) -> int:
    """What follows step ``step`` (counted from 1) on its schedule: the loss-spike check and the metrics record
    (--log_every), the evaluation (--eval_every), a sample grid (--sample_every) and a checkpoint (--ckpt_every);
    the last step's grid and checkpoint are ``_finish``'s. Returns the step reached: ``step``, or after a
    loss spike the step rolled back to (``_roll_back``)."""
    t, max_steps = run.cfg.train, run.max_steps
    logs = step % t.log_every == 0 or step == max_steps
    spike = run.spikes.check(step, run.d) if run.spikes is not None and logs else None
    if spike is not None:
        step = _roll_back(run, step, *spike)
        window.reset()
        bar.n = step
        bar.refresh()
        return step
    metrics = run.metrics
    evaluated = run.evaluate() if t.eval_every and (step % t.eval_every == 0 or step == max_steps) else {}
    if evaluated and step % t.log_every and step != max_steps and metrics is not None:
        with run.written("metrics.jsonl"):  # between two log steps: a record of its own
            metrics.write({"step": step, **evaluated})
            run.tracker.log(step, evaluated)
    if logs:
        record = window.record(run, step) | evaluated
        if run.spikes is not None:
            record["rollbacks"] = run.spikes.rollbacks
        if metrics is not None:
            with run.written("metrics.jsonl"):
                metrics.write({"step": step, **record})
                run.tracker.log(step, record)
        bar.set_postfix(loss=f"{record['loss']:.4f}")
        window.reset()
    if t.sample_every and step % t.sample_every == 0 and step < max_steps:
        run.write_samples(step)
    if step % t.ckpt_every == 0 and step < max_steps:
        run.save(step)
    return step


def _roll_back(run: _Run, step: int, mean: float, median: float) -> int:
    """A loss spike found after step ``step``: reload the newest checkpoint saved before the window that spiked
    (``run.spikes``), drop the checkpoints and metrics records after it (they belong to the abandoned steps), and
    skip the batches of the steps from it up to ``step``: the loader goes on where it is, so the data offset grows
    by those steps. Returns the checkpoint's step.

    Raises:
        RunError: no checkpoint was saved before the window.
    """
    d, window = run.d, run.spikes.window
    run.finish_saves()
    run.nonfinite.flush()
    settle_skip(run.optimizer)  # before the checkpoint's states are loaded into the same tensors
    found = [None]  # rank 0 lists the folder (another rank may see a background save's rename late)
    if d.is_main:
        before = [p for p in weights_io.list_checkpoints(run.run_dir) if _step_of(p) <= step - window]
        found = [before[-1] if before else None]
    if d.mesh is not None:
        dist.broadcast_object_list(found, src=0)
    spike = (f"step {step}: mean loss {mean:.4g} over the last {window} steps is more than "
             f"{run.spikes.factor:g} x the median {median:.4g}")
    if found[0] is None:
        raise RunError(f"{spike}, and no checkpoint was saved before step {step - window + 1} to roll back to; "
                       "save more often (--ckpt_every) or keep more checkpoints (--keep_last)")
    ckpt, back = found[0], _step_of(found[0])
    if d.is_main:
        for later in weights_io.list_checkpoints(run.run_dir):
            if _step_of(later) > back:  # out of the listing first, as the checkpointer drops old ones
                doomed = later.with_name(f".tmp-delete-{later.name}")
                os.replace(later, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
        run.metrics.close()
        _truncate_metrics(run.run_dir / "metrics.jsonl", back)
        run.metrics = MetricsLog(run.run_dir / "metrics.jsonl")
    d.barrier()
    meta = _load_checkpoint(run, ckpt)
    run.checkpointer.last_step = back
    run.data_offset += step - back
    run.spikes.rolled_back(meta.get("loss_spike"), d)
    if d.is_main:
        log.warning("%s: rolled back to %s, skipping the batches of steps %d-%d (rollback %d in a row, %d in all)",
                    spike, ckpt.name, back + 1, step, run.spikes.in_row, run.spikes.rollbacks)
    return back


def _step_of(ckpt: Path) -> int:
    return int(ckpt.name.split("-")[1])


def _finish(run: _Run, step: int) -> Path:
    """The end: the last sample grid, the tracker closed, the last checkpoint and every save finished."""
    if run.cfg.train.sample_every:
        run.write_samples(step)
    if run.tracker is not None:  # (every event is flushed when logged: a run that dies loses none)
        run.tracker.close()
    path = run.save(step)
    run.finish_saves()
    if run.d.is_main:
        log.info("finished %d steps; checkpoint %s, samples in %s", step, path, run.run_dir / "samples")
    return run.run_dir


class _DeferredInterrupt:
    """Turns the first Ctrl-C (SIGINT) or SIGTERM (a scheduler's preemption notice) into a flag checked
    between steps, so a step is never cut in half (e.g. between the optimizer update and the EMA update) and
    the run saves a checkpoint; a second signal interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.pending = False
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True
        log.warning("%s: finishing this step and saving a checkpoint (again to stop at once)",
                    signal.Signals(signum).name)

    def check(self, writing: bool, group: dist.ProcessGroup | None = None) -> bool:
        """Between two steps: raise KeyboardInterrupt on every rank if any rank was interrupted (torchrun may
        signal only some ranks, e.g. only one host's); else return whether a background save is still being
        written on any rank (``writing``: this rank's ``Checkpointer.writing()``). One tiny all-reduce on ``group``
        (gloo, host tensors: no device sync) per step makes the ranks agree on both."""
        flags = torch.tensor([int(self.pending), int(writing)])
        if group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        interrupt, writing = flags.tolist()
        if interrupt:
            raise KeyboardInterrupt
        return bool(writing)

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _default_workers(dataset, data, dp_size: int) -> int:
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


def _ignore_sigint(worker_id: int) -> None:
    """Data-loader workers leave Ctrl-C to the trainer, which finishes the step and saves."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _truncate_metrics(path: Path, step: int) -> None:
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
