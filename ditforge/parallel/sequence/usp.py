"""USP, Unified Sequence Parallelism (Fang and Zhao 2024, "USP: A Unified Sequence Parallelism Approach for
Long Context Generative AI", arXiv:2405.07719): Ulysses inside groups of U ranks, Ring attention across the
R = P / U groups.

Rank layout (2-D sequence mesh of shape (R, U), dims ("ring", "ulysses")): the rank at ring index i and
Ulysses index u is sp rank ``i * U + u`` and holds the contiguous token shard i * U + u, like every other
variant. The Ulysses all-to-all inside ring index i gathers the U consecutive shards of chunk i (global
positions [i * U * N_local, (i + 1) * U * N_local)) for heads [u * H/U, (u + 1) * H/U); the ring then runs
over the R ranks with the same u, whose chunks i = 0..R-1 tile the sequence in order. ``init_device_mesh(
device, (R, U), mesh_dim_names=("ring", "ulysses"))`` over consecutive ranks gives exactly this layout
(Ulysses groups are consecutive ranks, usually one host's NVLink island; the ring crosses hosts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ditforge.parallel.sequence.ring import ring_attention_full_mask
from ditforge.parallel.sequence.ulysses import check_heads, gather_valid, heads_to_seq, seq_to_heads


def usp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                  ulysses_group: ProcessGroup, ring_group: ProcessGroup) -> torch.Tensor:
    """USP attention of this rank's queries over the whole sequence.

    Args:
        q, k, v: (B, H, N_local, Dh), token shard ``ring_rank * U + ulysses_rank`` (module docstring).
        valid: (B, N_local) bool, False for padding keys, or None.
        ulysses_group: this rank's Ulysses group (size U, consecutive shards).
        ring_group: this rank's ring group (size R; the ranks with the same Ulysses index).

    Returns:
        (B, H, N_local, Dh), dtype of q.

    Communication per rank: Ulysses 2 all-to-alls in a group of U (4 N D / P elements through them),
    then ring attention over R ranks on blocks of N/R tokens x D/U channels: (R - 1) * 2 N D / P sent.

    Raises:
        ValueError: H does not divide by U.
    """
    check_heads(q.shape[1], dist.get_world_size(ulysses_group), "usp")
    mask = gather_valid(gather_valid(valid, ulysses_group), ring_group)
    qh, kh, vh = seq_to_heads(q, k, v, ulysses_group)  # (B, H/U, U*N_local, Dh): chunk ring_rank
    return heads_to_seq(ring_attention_full_mask(qh, kh, vh, mask, ring_group), ulysses_group)
