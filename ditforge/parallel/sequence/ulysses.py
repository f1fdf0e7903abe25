"""DeepSpeed-Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for
Enabling Training of Extreme Long Sequence Transformer Models", arXiv:2309.14509).

Each rank of the sequence-parallel group holds a contiguous shard of the tokens and every head. One
all-to-all turns that into every token for H/P heads; attention runs locally over the whole sequence; a
second all-to-all turns the output back into the rank's own tokens for every head.

Also home of the pieces the other variants share: the key-mask gather and the local SDPA call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

import ditforge.ops.attention as _seam
from ditforge.parallel.collectives import all_gather_single, all_to_all


def gather_valid(valid: torch.Tensor | None, group: ProcessGroup) -> torch.Tensor | None:
    """All-gather the (B, N_local) bool key mask of every group rank into (B, P * N_local), in group-rank
    order (the contiguous-shard convention: group rank r holds positions [r * N_local, (r + 1) * N_local)).
    None stays None. Sent as uint8 (gloo has no bool collectives); no gradient."""
    if valid is None:
        return None
    p = dist.get_world_size(group)
    b, n = valid.shape
    out = torch.empty(p, b, n, dtype=torch.uint8, device=valid.device)
    all_gather_single(out, valid.to(torch.uint8)[None].contiguous(), group)
    return out.permute(1, 0, 2).reshape(b, p * n).bool()


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(Dh)) v through PyTorch's SDPA with the kernel order chosen by
    ``ditforge.ops.attention.set_attention_backend``. q (B, H, Nq, Dh), k, v (B, H, Nk, Dh), mask (B, Nk)
    bool (True = attend) or None. Calls SDPA directly, not ``ops.attention``, so that the seam can route
    to sequence parallelism without recursing into it."""
    attn_mask = None if mask is None else mask[:, None, None, :]
    preferred = getattr(_seam, "_preferred", None)
    if preferred is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    with _seam.sdpa_kernel(preferred, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


def check_heads(heads: int, size: int, what: str = "ulysses") -> None:
    """Raise ValueError unless ``heads`` divides into ``size`` head groups (Ulysses' group, FastSeq's ranks)."""
    if heads % size:
        raise ValueError(
            f"{what}: {heads} attention heads do not divide by the group size {size} "
            f"(--sequence_parallel_size); choose a size that divides the head count, or "
            f"--sequence_parallel_type ring / fastseq_kv / usp")


def seq_to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(B, H, n, Dh) x3, this rank's n tokens of every head -> (3, B, H/P, P*n, Dh): q, k, v of the P ranks'
    tokens (concatenated in group-rank order) for head group ``rank`` (heads [rank*H/P, (rank+1)*H/P)).
    One all-to-all for q, k and v together (same bytes as three, one latency)."""
    p = dist.get_world_size(group)
    b, h, n, dh = q.shape
    x = torch.stack([q, k, v]).view(3, b, p, h // p, n, dh).permute(2, 0, 1, 3, 4, 5)  # (P dest, 3, B, H/P, n, Dh)
    y = all_to_all(x, group)  # (P src = token shard, 3, B, H/P, n, Dh)
    # Tokens-major memory (B, N, H, Dh), viewed as (B, H, N, Dh), as the model's own q, k, v are: cuDNN's SDPA
    # takes that layout and not contiguous (B, H, N, Dh), where PyTorch falls back to Flash, 1.5x slower on
    # H200 at 32k tokens (benchmarks/sequence_parallel.py --top).
    return y.permute(1, 2, 0, 4, 3, 5).reshape(3, b, p * n, h // p, dh).transpose(2, 3)


def heads_to_seq(o: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Inverse of ``seq_to_heads`` for one tensor: (B, H/P, P*n, Dh) -> (B, H, n, Dh)."""
    p = dist.get_world_size(group)
    b, hp, pn, dh = o.shape
    n = pn // p
    x = o.view(b, hp, p, n, dh).permute(2, 0, 1, 3, 4)  # (P dest = token shard, B, H/P, n, Dh)
    y = all_to_all(x, group)  # (P src = head group, B, H/P, n, Dh)
    return y.permute(1, 0, 2, 3, 4).reshape(b, p * hp, n, dh)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                      group: ProcessGroup) -> torch.Tensor:
    """DeepSpeed-Ulysses attention of this rank's queries over the whole sequence.

    Args:
        q, k, v: (B, H, N_local, Dh), this rank's contiguous token shard (group rank r holds global
            positions [r * N_local, (r + 1) * N_local)).
        valid: (B, N_local) bool, False for padding keys, or None.
        group: the sequence-parallel process group (size P).

    Returns:
        (B, H, N_local, Dh), dtype of q.

    Communication per rank: 2 all-to-alls (q, k, v stacked: 3 N D / P elements; the output: N D / P), of
    which the fraction (P - 1) / P leaves the rank; the same again in the backward.

    Raises:
        ValueError: H does not divide by P (names ``--sequence_parallel_size``).
    """
    check_heads(q.shape[1], dist.get_world_size(group))
    mask = gather_valid(valid, group)
    qh, kh, vh = seq_to_heads(q, k, v, group)
    return heads_to_seq(local_attention(qh, kh, vh, mask), group)
