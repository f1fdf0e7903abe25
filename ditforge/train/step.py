"""One training step: its randomness (drawn from ``(seed, step)``), the learning-rate schedule, the EMA decay's
warm-up, a loader batch cut into micro-batches, and ``train_step``, the one place where model, loss and backward
meet.

Recipe of DiT (Peebles & Xie 2023, section 5): AdamW at constant learning rate, no weight decay, EMA of
the weights, the hybrid loss of Improved DDPM with learned sigma, label dropout 0.1 for guidance.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ditforge.config.sections import RunConfig
from ditforge.data.packing import packed_training_losses
from ditforge.data.sampler import derive_seed
from ditforge.data.video import default_references
from ditforge.diffusion.objective import Objective
from ditforge.parallel import clip_coefficient, clip_grad_norm_, gradient_sync
from ditforge.optim.backward import StepInBackward
from ditforge.optim.skip import step_skipping_on_device
from ditforge.parallel.mesh import Dist
from ditforge.train import finetune
from ditforge.train.mixed import chunk, mixed_step_inputs
from ditforge.train.randomness import StepRandomness

if TYPE_CHECKING:  # the annotation of make_micro_batches' run; build imports nothing of this module
    from ditforge.train.build import Run


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


IMAGE_NOISE_STREAM = 7919  # the key that sets the image-to-video training noise's seeds apart from every other's


def make_micro_batches(run: Run, batch: dict, position: int) -> tuple[list[tuple], int, int]:
    """A loader batch -> the micro-batches for ``train_step`` (latents, conditioning, ``StepRandomness`` of data
    position ``position``, the step plus the batches skipped (``Run.data_offset``) [, loss weights];
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
    if run.pre is not None and run.pre.denoiser.takes_references and "x" in batch and "references" not in batch:
        batch["references"] = default_references(batch["x"], batch["index"], t.seed)
    cond = inputs.conditioning(batch, device, noise_seeds)
    if run.mixed:
        x, rnd = mixed_step_inputs(inputs, batch["x"], device, t.seed, position, run.diffusion, m.class_dropout_prob,
                                   d.dp_rank * len(batch["x"]))
    else:
        # reference frames lead the clip's: clean (std 0), then noised and learned as x0
        mean, std, run.lead_frames = inputs.lead_with_prefix(*inputs.moments(batch, device), cond)
        # the global batch and its shape: this step's bucket's with --buckets
        rnd = step_randomness(t.seed, position, len(mean) * d.dp_size, tuple(mean.shape[1:]), run.objective_of(mean),
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
