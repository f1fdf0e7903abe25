"""Deterministic global batches: step k's global batch is a fixed function of (seed, k), split over ranks.

So runs on 1, 2 or 8 processes see the same samples at every step, and resuming at step k needs only k.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from ditforge.errors import UserError


def derive_seed(*keys: int) -> int:
    """A well-mixed 32-bit seed from integer keys (numpy's SeedSequence hash), e.g. (seed, step) or
    (seed, epoch): distinct keys give unrelated streams, and the CPU generator, which keeps only 32 bits of
    its seed, sees every bit of every key."""
    return int(np.random.SeedSequence([k % 2**63 for k in keys]).generate_state(1)[0])


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's slice of each global batch, forever (epoch after epoch), from ``start_step`` on.

    Epoch e is ``randperm(num_samples)`` under seed ``derive_seed(seed, e)``; its first ``steps_per_epoch * global_batch``
    indices form the global batches (the incomplete tail is dropped, as DiT's ``drop_last=True``).
    Rank r of W takes positions ``[r * B/W, (r + 1) * B/W)`` of every global batch of size B.

    Raises:
        UserError: the global batch is larger than the data set, or not divisible by the world size.
    """

    def __init__(
        self, num_samples: int, global_batch: int, seed: int, rank: int = 0, world_size: int = 1, start_step: int = 0
    ):
        if global_batch > num_samples:
            raise UserError(f"--batch_size {global_batch} is larger than the data set ({num_samples} samples)")
        if global_batch % world_size:
            raise UserError(f"--batch_size {global_batch} is not divisible by the number of processes ({world_size})")
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.rank, self.world_size, self.start_step = rank, world_size, start_step
        self.steps_per_epoch = num_samples // global_batch

    def global_batch_indices(self, step: int) -> torch.Tensor:
        """Indices (global_batch,) int64 of the whole global batch at ``step``."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        perm = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(derive_seed(self.seed, epoch)))
        return perm[pos * self.global_batch : (pos + 1) * self.global_batch]

    def __iter__(self) -> Iterator[list[int]]:
        local = self.global_batch // self.world_size
        step = self.start_step
        while True:
            yield self.global_batch_indices(step)[self.rank * local : (self.rank + 1) * local].tolist()
            step += 1
