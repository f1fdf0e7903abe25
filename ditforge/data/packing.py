"""Sequence packing (``--pack_tokens N``): samples of different token counts (images and videos of any size
the patch divides) packed into rows of N tokens, so a step computes on useful tokens instead of padding.

* ``plan_packing``: which samples share a row, first-fit decreasing (Johnson 1973: at most 11/9 OPT + 1 rows);
  deterministic, a pure function of the token counts.
* ``patchify``: a sample (C, [T,] H, W) -> its tokens' patch values (n, C, P), the rows the objective and
  ``DiT.forward_packed`` take.
* ``pack``: the layout (``ops.attention.Packed``): where each sample's tokens lie, the documents of the
  block-diagonal attention, the gathers of per-sample conditioning.
* ``packed_training_losses``: the objective's per-sample loss terms of a packed step, equal to the unpacked
  step's (same samples, noise and timesteps).

Fill rate: useful tokens / (rows x N), the rest is padding at the rows' ends. On the benchmark's stream (each
sample an image of 256 tokens or a 16-frame video of 2,048 with probability 1/2, vDiT-XL/222, N = 4,096),
mean over 2,000 random windows: 82% for windows of 8 samples, 90% of 16, 95% of 32; padding every sample to
the window's longest fills 56%. The trainer packs each micro-batch (the window).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ditforge.errors import UserError
from ditforge.ops.attention import Packed


def plan_packing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: samples by token count, longest first (ties: lower index first), each into the
    first row with room, a new row when none has.

    Args:
        lengths: token count of each sample, positive.
        capacity: N, tokens per row.

    Returns:
        Rows, each the sample indices it holds in placement order; every index exactly once.

    Raises:
        ValueError: a sample longer than ``capacity``, or a non-positive length or capacity.
    """
    if capacity < 1 or any(n < 1 for n in lengths):
        raise ValueError(f"packing needs positive lengths and capacity, got {list(lengths)} into {capacity}")
    if lengths and max(lengths) > capacity:
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit a packed row of {capacity}")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    return rows


def fill_rate(lengths: Sequence[int], capacity: int, plan: Sequence[Sequence[int]]) -> float:
    """Useful tokens / (rows x capacity) of a plan."""
    return sum(lengths) / (len(plan) * capacity) if plan else 1.0


def patchify(x: torch.Tensor, patch_shape: Sequence[int]) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """One sample's patch values, token by token (the inverse of ``models.layers.unpatchify``'s layout, with
    channels first within a token as the patch embedding's convolution weight reads them).

    An image in a video model (1 frame, temporal patch t > 1) is its frame repeated t times (``VideoDiT``'s rule).

    Args:
        x: (C, H, W) with patch (p, p), or (C, T, H, W) with patch (t, h, w); any dtype.
        patch_shape: the model's patch edges.

    Returns:
        (rows (n, C, P) with n = prod(grid) tokens in row-major grid order and P = prod(patch) values in patch
        order, grid, whether the frame was repeated).

    Raises:
        ValueError: a size the patch does not divide (a 1-frame video excepted), or dimensions that do not
            match the patch.
    """
    patch = tuple(int(p) for p in patch_shape)
    if x.dim() != len(patch) + 1:
        raise ValueError(f"patchify: a sample of shape {tuple(x.shape)} for patch {patch}")
    repeated = len(patch) == 3 and x.shape[1] == 1 and patch[0] > 1
    if repeated:
        x = x.expand(-1, patch[0], *x.shape[2:])
    for n, p in zip(x.shape[1:], patch):
        if n % p:
            raise ValueError(f"patchify: size {tuple(x.shape[1:])} is not divisible by patch {patch}")
    grid = tuple(n // p for n, p in zip(x.shape[1:], patch))
    k = len(patch)
    x = x.reshape(x.shape[0], *(a for g, p in zip(grid, patch) for a in (g, p)))  # (C, g0, p0, g1, p1, ...)
    x = x.permute(*range(1, 2 * k, 2), 0, *range(2, 2 * k + 1, 2))  # (g0, g1, .., C, p0, p1, ..)
    return x.reshape(math.prod(grid), x.shape[k], math.prod(patch)), grid, repeated


def pack(grids: Sequence[Sequence[int]], capacity: int, plan: Sequence[Sequence[int]],
         repeated: Sequence[bool] | None = None, device: torch.device | str = "cpu") -> Packed:
    """The layout of samples with token grids ``grids`` placed by ``plan`` into rows of ``capacity`` tokens.

    Args:
        grids: each sample's token grid.
        capacity: L, tokens per row.
        plan: rows of sample indices (``plan_packing``), each row's samples end to end in that order.
        repeated: per sample, whether its frame was repeated (``patchify``); default none.
        device: where the tensors go.

    Returns:
        ``Packed`` (see its attributes).

    Raises:
        ValueError: a row holding more than ``capacity`` tokens, or a plan that does not hold every sample once.
    """
    counts = [math.prod(g) for g in grids]
    if sorted(i for row in plan for i in row) != list(range(len(grids))):
        raise ValueError(f"packing plan {plan} does not hold each of the {len(grids)} samples once")
    start = [0] * len(grids)
    docs, sample = [], torch.zeros(len(plan), capacity, dtype=torch.int64)
    valid = torch.zeros(len(plan), capacity, dtype=torch.bool)
    for r, row in enumerate(plan):
        used = 0
        for i in row:
            start[i] = r * capacity + used
            sample[r, used:used + counts[i]] = i
            valid[r, used:used + counts[i]] = True
            docs.append(counts[i])
            used += counts[i]
        if used > capacity:
            raise ValueError(f"packed row {r} holds {used} tokens, more than {capacity}")
        if used < capacity:
            docs.append(capacity - used)  # the padding tail: a document of its own
    lengths = torch.tensor(docs, dtype=torch.int64)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    document_ids = torch.repeat_interleave(torch.arange(len(docs)), lengths).view(len(plan), capacity)
    counts_t = torch.tensor(counts, dtype=torch.int64)
    index = torch.cat([torch.arange(s, s + n) for s, n in zip(start, counts)]) if counts else counts_t
    token_sample = torch.repeat_interleave(torch.arange(len(grids)), counts_t)
    flags = torch.tensor(list(repeated) if repeated is not None else [False] * len(grids), dtype=torch.bool)
    device = torch.device(device)
    return Packed(
        rows=len(plan), length=capacity, document_ids=_send(document_ids.int(), device),
        cu_seqlens=_send(cu.int(), device), max_len=int(lengths.max()) if docs else 0,
        sample=_send(sample, device), valid=_send(valid, device), index=_send(index, device),
        token_sample=_send(token_sample, device), first=_send(counts_t.cumsum(0) - counts_t, device),
        grids=tuple(tuple(int(n) for n in g) for g in grids),
        repeated=_send(torch.repeat_interleave(flags, counts_t), device),
    )


def _send(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. To a GPU through pinned memory, asynchronously: a blocking copy from pageable
    memory synchronises the stream, and ``pack`` runs in every packed training step. The caching host allocator
    keeps the pinned block until its copy has run."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def packed_training_losses(
    objective, model_fn: Callable[..., torch.Tensor], x_start: Sequence[torch.Tensor], t: torch.Tensor,
    noise: Sequence[torch.Tensor], capacity: int, patch_shape: Sequence[int],
    plan: Sequence[Sequence[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """The objective's loss terms per sample, computed on samples of any shapes packed into rows.

    Each token is one row of the objective's batch: its patch values (C, P) with its sample's timestep and
    noise. The objectives' terms are element-wise then a mean over each row's C x P values (``mean_flat``:
    MSE, and the VLB term of a learned sigma), so the mean over a sample's tokens, which all hold C x P values,
    is the mean over the sample's elements: each sample's term exactly as the unpacked step computes it (up
    to the order of float64 sums). Repeated frames (``patchify``) repeat values and leave the means alone.

    Args:
        objective: ``GaussianDiffusion`` or ``RectifiedFlow`` (``training_losses(model_fn, x, t, noise)``).
        model_fn: ``model_fn(x_t, model_timesteps, packed=...)`` -> predictions; x_t (M, C, P) token rows,
            timesteps (S,) per sample (e.g. ``model(x_t, t, packed=packed, y=..., force_drop_ids=...)``).
        x_start, noise: S samples each (C, H, W) or (C, T, H, W) (a batch tensor is a sequence of samples).
        t: (S,) the objective's timesteps.
        capacity: N, tokens per packed row (``--pack_tokens``).
        patch_shape: the model's patch edges.
        plan: rows of sample indices; default ``plan_packing`` (one sample per row of the longest one's length
            is padding to the longest, the baseline ``benchmarks/packing.py`` measures).

    Returns:
        dict of (S,) float64 terms, ``loss`` among them, like ``objective.training_losses``.

    Raises:
        ValueError: a sample of more than ``capacity`` tokens, or a size the patch does not divide.
    """
    pieces = [patchify(x, patch_shape) for x in x_start]
    if plan is None:
        plan = plan_packing([len(p[0]) for p in pieces], capacity)
    packed = pack([p[1] for p in pieces], capacity, plan, [p[2] for p in pieces], t.device)
    rows = torch.cat([p[0] for p in pieces])
    noise_rows = torch.cat([patchify(n, patch_shape)[0] for n in noise])
    terms = objective.training_losses(lambda xt, tt: model_fn(xt, tt[packed.first], packed=packed), rows,
                                      t[packed.token_sample], noise_rows)
    counts = torch.bincount(packed.token_sample, minlength=len(pieces)).to(torch.float64)
    return {k: torch.zeros(len(pieces), dtype=v.dtype, device=v.device).index_add_(0, packed.token_sample, v) / counts
            for k, v in terms.items()}


def packing_setup(model, capacity: int, sample_shape: Sequence[int] | None) -> tuple[int, tuple[int, ...]]:
    """What ``train_step`` takes for ``--pack_tokens capacity``: (capacity, the model's patch shape), after
    checking the model packs (ditforge's DiT or vDiT, unwrapped) and the run's sample (C, [T,] H, W) fits a row
    (None: the samples' shapes vary, ``--buckets``; ``train.mixed.check_bucket_tokens`` checks each bucket).

    Raises:
        UserError: a model without packed forward (STDiT, diffusers adapters), or a sample of more tokens than
            ``capacity``.
    """
    from ditforge.models import DiT, STDiT  # here: the data layer does not import models at load time

    if not isinstance(model, DiT) or isinstance(model, STDiT):
        raise UserError(f"--pack_tokens: {type(model).__name__} does not take packed sequences; use a DiT or vDiT")
    patch = tuple(model.x_embedder.patch_shape)
    tokens = 0 if sample_shape is None else len(patchify(torch.empty(sample_shape, device="meta"), patch)[0])
    if tokens > capacity:
        raise UserError(f"--pack_tokens {capacity}: a sample of shape {tuple(sample_shape)} has {tokens} tokens; "
                        "give at least that many")
    return capacity, patch
