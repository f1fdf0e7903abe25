"""``ditforge sample``: load a checkpoint, draw class-conditional samples with guidance, write PNG / NPZ."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ditforge.atomic import atomic_path
from ditforge.data.images import save_grid, to_uint8
from ditforge.diffusion import SAMPLERS, create_diffusion, guided_model, sample_loop
from ditforge.errors import UserError
from ditforge.models import create_model, infer_dit_config
from ditforge.parallel.mesh import resolve_device
from ditforge.train.checkpoint import export_safetensors, load_weights, read_checkpoint_weights

log = logging.getLogger(__name__)


@dataclass
class SampleConfig:
    """Settings of ``ditforge sample`` (see ``ditforge sample --help``)."""

    ckpt: str
    model: str | None = None
    image_size: int | None = None
    class_labels: list[int] | None = None
    num_samples: int | None = None
    cfg_scale: float = 4.0
    num_sampling_steps: int = 250
    sampler: str = "ddpm"
    eta: float = 0.0
    seed: int = 0
    batch_size: int = 256
    out: str = "samples.png"
    save_npz: str | None = None
    use_ema: bool = True
    device: str = "auto"


def load_model(ckpt: str, model_name: str | None = None, image_size: int | None = None, use_ema: bool = True):
    """Build the model a checkpoint was trained as and load its weights (strict).

    ``ckpt`` is anything ``load_weights`` accepts. Model, size and conditioning come from the saved config,
    or, for an official DiT .pt, from the tensor shapes; ``model_name`` / ``image_size`` override them.

    Returns:
        (model in eval mode on the CPU, model settings dict with model, input_size, in_channels,
        num_classes, learn_sigma, and ``run_config``: the saved run config, or None).

    Raises:
        UserError: unreadable checkpoint, or weights that do not fit the (overridden) model.
    """
    state, config = load_weights(ckpt, use_ema)
    if config is None and isinstance(state, Path):
        raise UserError(f"--ckpt {ckpt}: the checkpoint's meta.json has no config")
    spec = dict(config["model"]) if config else infer_dit_config(state)
    if model_name is not None:
        spec["model"] = model_name
    if image_size is not None:
        spec["input_size"] = image_size
    model = create_model(spec["model"], spec["input_size"], spec["in_channels"], spec["num_classes"],
                         spec["learn_sigma"], spec.get("class_dropout_prob", 0.1))
    if isinstance(state, Path):  # a DCP checkpoint folder: read its (gathered) tensors into this model's shapes
        state = read_checkpoint_weights(state, model.state_dict(), use_ema)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        detail = " ".join(str(e).split())[:300]
        raise UserError(f"--ckpt {ckpt}: weights do not fit {spec['model']} at input size "
                        f"{spec['input_size']} ({detail})") from None
    spec["run_config"] = config
    return model.eval(), spec


def sample(cfg: SampleConfig) -> np.ndarray:
    """Draw images and write ``cfg.out`` (PNG grid) and, if set, ``cfg.save_npz``.

    Labels: ``class_labels`` as given, else ``num_samples`` labels cycling 0, 1, ..., C-1, else one per class.
    The NPZ holds ``samples`` (N, H, W, C) uint8 and ``labels`` (N,) int64.

    Returns:
        The samples as (N, H, W, C) uint8.

    Raises:
        UserError: bad checkpoint, labels outside [0, num_classes), unknown sampler, or a latent-space model
            (sampling to pixels needs the VAE of a later release).
    """
    if cfg.sampler not in SAMPLERS:
        raise UserError(f"--sampler: expected one of {', '.join(SAMPLERS)}, got {cfg.sampler}")
    if not 2 <= cfg.num_sampling_steps <= 1000:
        raise UserError(f"--num_sampling_steps: expected 2..1000, got {cfg.num_sampling_steps}")
    for name in ("num_samples", "batch_size"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UserError(f"--{name}: expected a positive integer, got {value}")
    device = resolve_device(cfg.device)
    model, spec = load_model(cfg.ckpt, cfg.model, cfg.image_size, cfg.use_ema)
    if spec["in_channels"] not in (1, 3):
        raise UserError(f"--ckpt {cfg.ckpt}: the model works on {spec['in_channels']}-channel latents; decoding "
                        "them to images needs a VAE, which this version does not support yet")
    num_classes = spec["num_classes"]
    if cfg.class_labels is not None:
        labels = list(cfg.class_labels)
    else:
        labels = [i % num_classes for i in range(cfg.num_samples or num_classes)]
    bad = [c for c in labels if not 0 <= c < num_classes]
    if bad or not labels:
        raise UserError(f"--class_labels: expected labels in 0..{num_classes - 1}, got {bad or 'none'}")
    model.to(device)
    diffusion = create_diffusion(str(cfg.num_sampling_steps), spec["learn_sigma"])
    shape = (spec["in_channels"], spec["input_size"], spec["input_size"])
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    chunks = []
    for start in range(0, len(labels), cfg.batch_size):
        y = torch.tensor(labels[start : start + cfg.batch_size], device=device)
        noise = torch.randn((len(y), *shape), generator=g, device=device)
        fn = guided_model(model, y, cfg.cfg_scale, num_classes)
        x = sample_loop(diffusion, fn, noise, cfg.sampler, cfg.eta, clip_denoised=True, generator=g, progress=True)
        chunks.append(to_uint8(x))
    images = np.concatenate(chunks)
    nrow = min(len(labels), num_classes if cfg.class_labels is None else 8)
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    save_grid(images, cfg.out, nrow=nrow, upscale=max(1, 64 // spec["input_size"]))
    if cfg.save_npz:
        _save_npz(cfg.save_npz, images, np.asarray(labels, dtype=np.int64))
    log.info("wrote %d samples to %s%s", len(images), cfg.out, f" and {cfg.save_npz}" if cfg.save_npz else "")
    return images


def export(ckpt: str, out: str, use_ema: bool = True) -> Path:
    """``ditforge export``: consolidate a checkpoint (sharded or not) into one safetensors file for sampling,
    with the run config in its metadata. Returns the file written."""
    model, spec = load_model(ckpt, use_ema=use_ema)
    config = spec.pop("run_config") or {"model": spec}
    export_safetensors(model.state_dict(), config, Path(out))
    log.info("wrote %s weights of %s to %s", "EMA" if use_ema else "raw", spec["model"], out)
    return Path(out)


def _save_npz(path: str, samples: np.ndarray, labels: np.ndarray) -> None:
    with atomic_path(path, suffix=".npz") as tmp:  # np.savez appends .npz to other names
        np.savez(tmp, samples=samples, labels=labels)
