"""Steps of mixed shapes (``--buckets`` with ``--pack_tokens``): each global batch holds samples of several
buckets (``BucketBatchSampler(batch_size=...)``), kept as a list of per-sample tensors and trained packed.

* ``mixed_step_inputs``: a loader batch's samples -> latents (encoded per shape) and the step's randomness,
  drawn per sample from (seed, step, the sample's position in the global batch), so the draws do not depend
  on the number of processes (as ``step.step_randomness`` for one-shape batches).
* ``check_bucket_tokens``: every bucket fits a packed row, checked at start.
* ``chunk``: a micro-batch split of tensors or lists (``--grad_accum_steps``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ditforge.data.packing import patchify
from ditforge.data.sampler import derive_seed
from ditforge.errors import UserError
from ditforge.train.randomness import StepRandomness


def chunk(value: torch.Tensor | list, k: int) -> list:
    """``value`` split into ``k`` consecutive parts along its first dimension: ``Tensor.chunk`` for a tensor,
    equal slices for a list (whose length ``k`` divides, as the trainer checks for the batch size)."""
    if isinstance(value, torch.Tensor):
        return list(value.chunk(k))
    n = len(value) // k
    return [value[i * n:(i + 1) * n] for i in range(k)]


def mixed_step_inputs(inputs, pixels: Sequence[torch.Tensor], device: torch.device, seed: int, step: int,
                      objective, drop_prob: float, first: int):
    """This process's latents and ``StepRandomness`` of a mixed-shape step.

    Samples of one shape are encoded together (``inputs.moments``, VAE or pixels). Sample j of the global batch
    (j = ``first`` + its position here; ``first`` = rank x local batch) draws, from a generator seeded by
    ``derive_seed(seed, step, j)``: its noise (its own shape), its timestep (``objective.sample_timesteps``), its
    label dropout (u < ``drop_prob``), its flip (u < 0.5) and, for a VAE posterior, its eps; then x0 = mean +
    std x eps (``BatchEncoder.draw``). So every draw is a function of (seed, step, j) whatever the world size.

    Args:
        inputs: the run's ``BatchEncoder``; pixels: S samples (C, [F,] h, w) float32, shapes may differ.

    Returns:
        (x0: S latents (C', [F,] h', w') float32 on ``device``, ``StepRandomness`` whose ``noise`` is a list of
        S tensors like x0, ``t`` (S,), ``drop`` and ``flip`` (S,) bool).
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, x in enumerate(pixels):
        groups.setdefault(tuple(x.shape), []).append(i)
    moments: list = [None] * len(pixels)
    for members in groups.values():
        mean, std = inputs.moments({"x": torch.stack([pixels[i] for i in members])}, device)
        for k, i in enumerate(members):
            moments[i] = (mean[k], None if std is None else std[k])
    x0, noise, t, drop, flip = [], [], [], [], []
    for j, (mean, std) in enumerate(moments, first):
        g = torch.Generator(device=device).manual_seed(derive_seed(seed, step, j))
        noise.append(torch.randn(mean.shape, generator=g, device=device))
        t.append(objective.sample_timesteps(1, g, device))
        drop.append(torch.rand(1, generator=g, device=device) < drop_prob)
        flip.append(torch.rand(1, generator=g, device=device) < 0.5)
        eps = torch.randn(mean.shape, generator=g, device=device) if std is not None else None
        x0.append(inputs.draw(mean, std, eps))
    return x0, StepRandomness(noise, torch.cat(t), torch.cat(drop), torch.cat(flip))


def check_bucket_tokens(buckets, capacity: int, patch: Sequence[int], channels: int, downsample: int,
                        video: bool) -> None:
    """Every bucket of ``buckets`` (a ``data.buckets.Buckets``) fits a packed row of ``capacity`` tokens: its
    sample, (``channels``, [F,] h / ``downsample``, w / ``downsample``) latents, patchified by ``patch``.

    Raises:
        UserError: a bucket of more tokens than ``capacity`` (naming ``--pack_tokens`` and the largest bucket).
    """
    tokens = {}
    for b in buckets.buckets:
        shape = (channels, *([b.num_frames] if video else []), b.height // downsample, b.width // downsample)
        tokens[b.name] = len(patchify(torch.empty(shape, device="meta"), patch)[0])
    name = max(tokens, key=tokens.get)
    if tokens[name] > capacity:
        raise UserError(f"--pack_tokens {capacity}: a sample of bucket {name} (--buckets) has {tokens[name]} tokens; "
                        "give at least that many")
