"""The training loop: diffusion loss, AdamW with fp32 master weights, mixed precision, EMA, logging,
periodic sample grids and checkpoints, resume.

Recipe of DiT (Peebles & Xie 2023, section 5): AdamW at constant learning rate, no weight decay, EMA of
the weights, the hybrid loss of Improved DDPM with learned sigma, label dropout 0.1 for guidance.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ditforge.config import RunConfig
from ditforge.data import BUILTIN_DATASETS, GlobalBatchSampler, build_dataset
from ditforge.data.sampler import derive_seed
from ditforge.data.images import save_grid, to_uint8
from ditforge.diffusion import GaussianDiffusion, create_diffusion, guided_model, sample_loop
from ditforge.errors import UserError
from ditforge.models import create_model
from ditforge.parallel import parallelize
from ditforge.train import checkpoint as ckpt_io
from ditforge.train.logging import MetricsLog

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu. Raises UserError for cuda without a GPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA GPU is available")
    return torch.device(name)


def resolve_precision(name: str, device: torch.device) -> torch.dtype:
    """Compute dtype for autocast: fp32 | bf16 | fp16; ``auto`` is bf16 on CUDA, fp32 on CPU."""
    if name == "auto":
        name = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@dataclass
class StepRandomness:
    """Everything random in one training step, for this process's slice of the global batch."""

    noise: torch.Tensor  # like x
    t: torch.Tensor  # (B,) int64 timesteps
    drop: torch.Tensor  # (B,) bool, labels replaced by the null label
    flip: torch.Tensor  # (B,) bool, horizontal flips


def step_randomness(
    seed: int, step: int, global_batch: int, sample_shape: tuple[int, ...], num_timesteps: int,
    drop_prob: float, device: torch.device, rank: int = 0, world_size: int = 1,
) -> StepRandomness:
    """Counter-based randomness: drawn for the whole global batch from a generator seeded by (seed, step),
    then sliced for this rank, so a step sees the same numbers whatever the number of processes."""
    g = torch.Generator(device=device).manual_seed(derive_seed(seed, step))
    noise = torch.randn((global_batch, *sample_shape), generator=g, device=device)
    t = torch.randint(0, num_timesteps, (global_batch,), generator=g, device=device)
    drop = torch.rand(global_batch, generator=g, device=device) < drop_prob
    flip = torch.rand(global_batch, generator=g, device=device) < 0.5
    local = global_batch // world_size
    sl = slice(rank * local, (rank + 1) * local)
    return StepRandomness(noise[sl], t[sl], drop[sl], flip[sl])


@torch.no_grad()
def update_ema(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * model over trainable parameters (Polyak averaging)."""
    pairs = [(e, p) for e, p in zip(ema.parameters(), model.parameters()) if p.requires_grad]
    torch._foreach_lerp_([e for e, _ in pairs], [p.detach() for _, p in pairs], 1.0 - decay)


def ema_decay_at(decay: float, step: int) -> float:
    """Warm-up of the EMA decay, min(decay, (1 + k) / (10 + k)) (TensorFlow's ExponentialMovingAverage
    with num_updates), so short runs average over a useful window instead of their random start."""
    return min(decay, (1 + step) / (10 + step))


def learning_rate(cfg: RunConfig, step: int) -> float:
    """Constant learning rate (as DiT) after an optional linear warm-up of ``warmup_steps``."""
    t = cfg.train
    return t.lr * min(1.0, (step + 1) / t.warmup_steps) if t.warmup_steps else t.lr


def train_step(
    model: nn.Module, diffusion: GaussianDiffusion, optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None, x: torch.Tensor, y: torch.Tensor, rnd: StepRandomness,
    amp_dtype: torch.dtype, max_grad_norm: float,
) -> dict[str, float | torch.Tensor]:
    """One optimizer step on the diffusion loss. Returns the mean loss terms and the gradient norm as
    0-dim tensors (no host sync here: the caller reads them when it logs)."""
    x = torch.where(rnd.flip[:, None, None, None], x.flip(-1), x)
    autocast = (
        torch.autocast(x.device.type, dtype=amp_dtype) if amp_dtype != torch.float32 else contextlib.nullcontext()
    )
    with autocast:
        terms = diffusion.training_losses(lambda xt, tt: model(xt, tt, y, force_drop_ids=rnd.drop), x, rnd.t, rnd.noise)
    loss = terms["loss"].mean()
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
    clip = max_grad_norm if max_grad_norm > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().mean() for k, v in terms.items()} | {"grad_norm": grad_norm.detach()}


@torch.no_grad()
def sample_grid(
    model: nn.Module, labels: torch.Tensor, shape: tuple[int, ...], seed: int, cfg_scale: float = 4.0,
    num_steps: int = 100, learn_sigma: bool = True,
) -> torch.Tensor:
    """Draw one image per label with DDPM (respaced to ``num_steps``) and guidance; (N, C, H, W) in [-1, 1]."""
    device = labels.device
    g = torch.Generator(device=device).manual_seed(seed)
    noise = torch.randn((len(labels), *shape), generator=g, device=device)
    diffusion = create_diffusion(str(num_steps), learn_sigma)
    fn = guided_model(model, labels, cfg_scale, model.num_classes)
    return sample_loop(diffusion, fn, noise, "ddpm", clip_denoised=True, generator=g)


def _default_outputs(cfg: RunConfig) -> str:
    data = Path(cfg.data.data).name or "data"
    return str(Path("outputs") / f"{data}-{cfg.model.model.replace('/', '-')}-{datetime.now():%Y%m%d-%H%M%S}")


def _find_resume(cfg: RunConfig) -> Path | None:
    """The checkpoint to resume from, or None for a fresh run; fills ``outputs`` when resuming a path."""
    t = cfg.train
    if t.resume is None:
        return None
    if t.resume == "auto":
        found = ckpt_io.list_checkpoints(Path(t.outputs)) if t.outputs else []
        return found[-1] if found else None
    ckpt = ckpt_io.resolve_checkpoint(t.resume)
    if t.outputs is None:
        t.outputs = str(ckpt.parent.parent)
    return ckpt


def train(cfg: RunConfig) -> Path:
    """Train a DiT as configured; returns the run folder.

    Writes ``config.yaml``, ``metrics.jsonl`` (step, loss, mse, vb, lr, grad_norm, samples_per_sec, ...),
    ``samples/step-*.png`` and ``checkpoints/step-*/``; a checkpoint is saved every ``ckpt_every`` steps, at
    the end, and on Ctrl-C (then KeyboardInterrupt is re-raised).

    Raises:
        UserError: bad data, model or checkpoint settings.
    """
    t, m = cfg.train, cfg.model
    resume_from = _find_resume(cfg)
    if t.outputs is None:
        t.outputs = _default_outputs(cfg)
    run_dir = Path(t.outputs)
    if resume_from is None and ckpt_io.list_checkpoints(run_dir):
        raise UserError(f"--outputs {run_dir} already holds a run; pass --resume auto to continue it, "
                        "or choose another folder")
    device = resolve_device(t.device)
    amp_dtype = resolve_precision(t.mixed_precision, device)
    dataset = build_dataset(cfg.data.data, cfg.data.image_size, run_dir / "bad_samples.jsonl")
    cfg.data.image_size = dataset.image_size
    in_memory = cfg.data.data in BUILTIN_DATASETS
    if cfg.data.random_flip is None:
        cfg.data.random_flip = not in_memory  # flipped digits are other symbols
    if cfg.data.num_workers is None:
        cfg.data.num_workers = 0 if in_memory else 4
    if m.num_classes is None:
        m.num_classes = dataset.num_classes
    elif m.num_classes < dataset.num_classes:
        raise UserError(f"--num_classes {m.num_classes}: the data has {dataset.num_classes} classes")
    m.in_channels, m.input_size = dataset.in_channels, dataset.image_size
    steps_per_epoch = len(dataset) // t.batch_size
    max_steps = t.max_steps or (t.epochs * max(steps_per_epoch, 1) if t.epochs else 1000)
    if t.lr is None:  # the tiny model trains well (and fast enough for a CPU) at 1e-3; see benchmarks/digits_sweep.py
        t.lr = 1e-3 if m.model.startswith("DiT-T/") else 1e-4

    torch.manual_seed(t.seed)
    model = create_model(m.model, m.input_size, m.in_channels, m.num_classes, m.learn_sigma, m.class_dropout_prob)
    ema = copy.deepcopy(model).requires_grad_(False)
    model.to(device).train()
    ema.to(device).eval()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.999),
        fused=device.type == "cuda",
    )
    scaler = torch.amp.GradScaler(device.type) if amp_dtype == torch.float16 else None
    start_step = 0
    if resume_from is not None:
        start_step = _load_training_state(resume_from, model, ema, optimizer, scaler)
        log.info("resumed from %s at step %d", resume_from, start_step)
    parallelize(model, grad_checkpoint=t.grad_checkpoint)
    (run_dir / "samples").mkdir(parents=True, exist_ok=True)
    _write_config(run_dir / "config.yaml", cfg)
    if resume_from is not None:
        _truncate_metrics(run_dir / "metrics.jsonl", start_step)

    sampler = GlobalBatchSampler(len(dataset), t.batch_size, t.seed, start_step=start_step)
    loader = DataLoader(
        dataset, batch_sampler=sampler, num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda",
        persistent_workers=cfg.data.num_workers > 0,
    )
    diffusion = create_diffusion(None, m.learn_sigma)
    sample_shape = (m.in_channels, m.input_size, m.input_size)
    grid_labels = torch.arange(m.num_classes, device=device).repeat_interleave(8 if m.num_classes <= 10 else 1)[:80]
    drop_prob = m.class_dropout_prob
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("%s (%.2fM parameters) on %s, %s compute, %d steps of batch %d, run folder %s", m.model,
             n_params / 1e6, device, str(amp_dtype).removeprefix("torch."), max_steps, t.batch_size, run_dir)

    def save(step: int) -> Path:
        meta = {"config": cfg.to_dict(), "scaler": scaler.state_dict() if scaler is not None else None}
        return ckpt_io.save_checkpoint(run_dir, step, model.state_dict(), ema.state_dict(),
                                       optimizer.state_dict(), meta, t.keep_last)

    def write_samples(step: int) -> None:
        images = sample_grid(ema, grid_labels, sample_shape, seed=t.seed, learn_sigma=m.learn_sigma)
        save_grid(to_uint8(images), run_dir / "samples" / f"step-{step:07d}.png", nrow=8,
                  upscale=max(1, 64 // m.input_size))

    step, stepped = start_step, False
    window: dict[str, torch.Tensor] = {}
    window_start, window_steps = time.perf_counter(), 0
    bar = tqdm(total=max_steps, initial=start_step, desc="train", dynamic_ncols=True, disable=None)
    interrupted = _DeferredInterrupt()
    try:
        batches = iter(loader)
        while step < max_steps:
            interrupted.check()
            x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            rnd = step_randomness(t.seed, step, t.batch_size, sample_shape, diffusion.num_timesteps,
                                  drop_prob, device)
            if not cfg.data.random_flip:
                rnd.flip.zero_()
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(cfg, step)
            out = train_step(model, diffusion, optimizer, scaler, x, y, rnd, amp_dtype, t.max_grad_norm)
            stepped = True
            update_ema(ema, model, ema_decay_at(t.ema_decay, step))
            step, stepped = step + 1, False
            window_steps += 1
            for k, v in out.items():
                window[k] = window.get(k, 0) + v
            bar.update(1)
            if step % t.log_every == 0 or step == max_steps:
                record = {k: float(v) / window_steps for k, v in window.items()}
                elapsed = time.perf_counter() - window_start
                record |= {"step": step, "lr": learning_rate(cfg, step - 1),
                           "samples_per_sec": window_steps * t.batch_size / elapsed,
                           "epoch": step / max(steps_per_epoch, 1)}
                if device.type == "cuda":
                    record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                if not math.isfinite(record["loss"]):
                    raise RuntimeError(f"loss is {record['loss']} at step {step}; lower --lr or use bf16/fp32")
                metrics.write({"step": record.pop("step"), **record})
                bar.set_postfix(loss=f"{record['loss']:.4f}")
                window, window_start, window_steps = {}, time.perf_counter(), 0
            if t.sample_every and step % t.sample_every == 0 and step < max_steps:
                write_samples(step)
            if step % t.ckpt_every == 0 and step < max_steps:
                save(step)
    except KeyboardInterrupt:
        bar.close()
        if stepped:  # the optimizer already took this step: finish it, so the checkpoint is step-consistent
            update_ema(ema, model, ema_decay_at(t.ema_decay, step))
            step += 1
        path = save(step)
        log.warning("interrupted at step %d; checkpoint saved to %s", step, path)
        raise
    finally:
        interrupted.restore()
        metrics.close()
    bar.close()
    write_samples(step)
    path = save(step)
    log.info("finished %d steps; checkpoint %s, samples in %s", step, path, run_dir / "samples")
    return run_dir


class _DeferredInterrupt:
    """Turns the first Ctrl-C into a flag checked between steps, so a step is never cut in half (e.g.
    between the optimizer update and the EMA update); a second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.pending = False
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True
        log.warning("Ctrl-C: finishing this step and saving a checkpoint (press again to stop at once)")

    def check(self) -> None:
        if self.pending:
            raise KeyboardInterrupt

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records logged after ``step`` (by a run that died before its next checkpoint), atomically."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


def _load_training_state(ckpt: Path, model, ema, optimizer, scaler) -> int:
    """Load weights, EMA, optimizer and scaler from a checkpoint folder; returns its step."""
    meta = ckpt_io.read_meta(ckpt)
    for module, name in ((model, "model.safetensors"), (ema, "ema.safetensors")):
        try:
            module.load_state_dict(ckpt_io.read_tensors(ckpt / name))
        except RuntimeError as e:
            first = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
            raise UserError(f"--resume: {ckpt / name} does not fit the configured model ({first})") from None
    optimizer.load_state_dict(ckpt_io.read_optimizer(ckpt))
    if scaler is not None and meta.get("scaler"):
        scaler.load_state_dict(meta["scaler"])
    return int(meta["step"])


def _write_config(path: Path, cfg: RunConfig) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tmp.replace(path)
