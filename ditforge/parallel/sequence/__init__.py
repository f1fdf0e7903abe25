"""Sequence-parallel attention: each rank of a sequence-parallel (sp) group holds a contiguous shard of every
sample's tokens, and ``sequence_parallel_attention`` computes the exact attention of its local queries over
the whole sequence. The attention seam (``ditforge.ops.attention``) routes here when sequence parallelism is
on; everything else in a block runs on the local shard.

Variants of q, k, v: ``ulysses`` (DeepSpeed-Ulysses all-to-all, ulysses.py), ``ring`` (Ring attention,
ring.py), ``fastseq_kv`` (all-gathered K/V, fastseq.py), ``usp`` (Ulysses inside groups, Ring across them,
usp.py). FastSeq as OpenDiT builds it gathers the attention's input instead, before the projection
(``fastseq_attention``, which takes x and the projection). ``communication_bytes_per_layer`` gives their
traffic.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ditforge.parallel.sequence.fastseq import fastseq_attention, fastseq_kv_attention
from ditforge.parallel.sequence.ring import ring_attention
from ditforge.parallel.sequence.ulysses import local_attention, ulysses_attention
from ditforge.parallel.sequence.usp import usp_attention

VARIANTS = ("ulysses", "ring", "fastseq_kv", "usp")

__all__ = ["VARIANTS", "sequence_parallel_attention", "communication_bytes_per_layer", "ulysses_attention",
           "ring_attention", "fastseq_attention", "fastseq_kv_attention", "usp_attention"]


def _one_group(group, variant: str) -> ProcessGroup:
    if group is None:
        return dist.group.WORLD
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"sequence parallelism {variant!r} needs a 1-D sp mesh or process group, got a "
                             f"{group.ndim}-D DeviceMesh {group.mesh_dim_names}")
        return group.get_group()
    if isinstance(group, (tuple, list)):
        raise ValueError(f"sequence parallelism {variant!r} takes one process group; (ulysses, ring) groups "
                         f"are for 'usp'")
    return group


def _usp_groups(group) -> tuple[ProcessGroup, ProcessGroup]:
    if isinstance(group, DeviceMesh):
        names = group.mesh_dim_names or ()
        if tuple(names) != ("ring", "ulysses"):  # flattened rank = ring_rank * U + ulysses_rank
            raise ValueError(f"usp needs a 2-D DeviceMesh with dims ('ring', 'ulysses'), got {group.ndim}-D "
                             f"{names}")
        return group.get_group("ulysses"), group.get_group("ring")
    if isinstance(group, (tuple, list)) and len(group) == 2:
        return group[0], group[1]
    raise ValueError("usp needs group=(ulysses_group, ring_group) or a 2-D DeviceMesh with dims "
                     "('ring', 'ulysses')")


def sequence_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                valid: torch.Tensor | None = None, group=None, variant: str = "ulysses", *,
                                fastseq_chunks: int = 2) -> torch.Tensor:
    """Exact softmax attention, softmax(q k^T / sqrt(Dh)) v (Vaswani et al. 2017), of this rank's queries over
    the (valid) keys of the whole, sequence-sharded sequence. Equal, up to float rounding, to attention on
    the gathered full sequence with the key padding mask, sliced to this rank's rows.

    Sharding (the caller's side): every sample's token sequence of N tokens is padded to P * N_local
    (P = sp group size; N_local >= ceil(N / P); more padding is allowed, down to ranks holding only padding)
    and sp rank r holds global positions [r * N_local, (r + 1) * N_local). For the 1-D variants r is the
    rank in ``group``; for ``usp`` r = ring_rank * U + ulysses_rank (``usp.py``), which is the flattened rank
    of a DeviceMesh of shape (R, U) with dims ("ring", "ulysses").

    Args:
        q, k, v: (B, H, N_local, Dh), this rank's shard, same shape and float dtype on every rank.
        valid: (B, N_local) bool, False for padding tokens; they are excluded as keys on every rank, and
            their own query rows come back finite but meaningless (mask them out of the loss). None = all
            valid. Every sample needs at least one valid key in the whole sequence.
        group: ``ulysses`` / ``ring`` / ``fastseq_kv``: the sp ProcessGroup, a 1-D DeviceMesh, or None (the
            default world group). ``usp``: ``(ulysses_group, ring_group)`` or a 2-D DeviceMesh with dims
            ("ring", "ulysses").
        variant: ``ulysses`` | ``ring`` | ``fastseq_kv`` | ``usp``.
        fastseq_chunks: head chunks of ``fastseq_kv``'s asynchronous K/V all-gather.

    Returns:
        (B, H, N_local, Dh), dtype of q. Differentiable in q, k and v (autograd-correct collectives).

    Raises:
        ValueError: unknown variant; bad shapes; a group of the wrong form; heads not divisible by the
            Ulysses group size (``ulysses``: P, ``usp``: U; the message names ``--sequence_parallel_size``).
    """
    if variant not in VARIANTS:
        raise ValueError(f"sequence parallel type {variant!r}: expected one of {VARIANTS}")
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must be (B, H, N_local, Dh) of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if valid is not None and (valid.dtype != torch.bool or valid.shape != (q.shape[0], q.shape[2])):
        raise ValueError(f"valid must be (B, N_local) = {(q.shape[0], q.shape[2])} bool, got "
                         f"{tuple(valid.shape)} {valid.dtype}")
    if variant == "usp":
        ug, rg = _usp_groups(group)
        if dist.get_world_size(rg) == 1:
            return ulysses_attention(q, k, v, valid, ug)
        if dist.get_world_size(ug) == 1:
            return ring_attention(q, k, v, valid, rg)
        return usp_attention(q, k, v, valid, ug, rg)
    g = _one_group(group, variant)
    if dist.get_world_size(g) == 1:
        return local_attention(q, k, v, valid)
    if variant == "ulysses":
        return ulysses_attention(q, k, v, valid, g)
    if variant == "ring":
        return ring_attention(q, k, v, valid, g)
    return fastseq_kv_attention(q, k, v, valid, g, chunks=fastseq_chunks)


COMM_VARIANTS = ("ulysses", "ring", "fastseq", "fastseq_kv", "usp")


def communication_bytes_per_layer(variant: str, N: int, D: int, sp: int, dtype_bytes: int = 2, *,
                                  ulysses_size: int | None = None, backward: bool = False) -> int:
    """Bytes one rank sends for one attention layer, per sample (multiply by the local batch), in the
    forward pass (or, ``backward=True``, the backward pass). N = global tokens, D = hidden size (H * Dh),
    P = ``sp``, b = ``dtype_bytes``; e = N * D / P, the elements of one local q, k, v or output shard.

    | variant | forward, sent per rank | backward, sent per rank |
    |---|---|---|
    | ulysses | 4 e (P-1)/P b: all-to-all of q, k, v and of the output; 1/P stays | same (adjoint all-to-alls) |
    | ring | 2 e (P-1) b: K and V shards, P-1 hops | 2 e (P-1) b (K, V again) + 2 e P * 4 (dK, dV float32, P hops) |
    | fastseq (OpenDiT: all-gather of x, all-to-all of the output) | e (P-1) (1 + 1/P) b | same (reduce-scatter of dx, all-to-all) |
    | fastseq_kv (K/V all-gather) | 2 e (P-1) b = 2 (P-1)/P N D b: equal to ring | same (reduce-scatter of dK, dV) |
    | usp (U x R, P = U R) | [4 (U-1)/U + 2 (R-1)] e b | 4 (U-1)/U e b + 2 e (R-1) b + 2 e R * 4 |

    Ulysses moves 4 e = 4 N D / P through its all-to-alls (the figure of Jacobs et al. 2023, whose per-link
    volume falls as 1/P); ring and fastseq_kv send a constant ~2 N D per rank whatever P; fastseq sends
    ~N D (less than Ulysses at P = 2, equal at P = 3, more above). (P-1)/P of bandwidth-
    optimal ring all-gather / reduce-scatter is counted as sent; the key masks (N bytes) are left out.

    Raises:
        ValueError: unknown variant, or ``ulysses_size`` missing / not dividing ``sp`` for usp.
    """
    if variant not in COMM_VARIANTS:
        raise ValueError(f"variant {variant!r}: expected one of {COMM_VARIANTS}")
    p = sp
    e = N * D / p
    if variant == "ulysses":
        elems, fp32 = 4 * e * (p - 1) / p, 0.0
    elif variant == "ring":
        elems, fp32 = 2 * e * (p - 1), (2 * e * p if backward and p > 1 else 0.0)
    elif variant == "fastseq":
        elems, fp32 = e * (p - 1) * (1 + 1 / p), 0.0
    elif variant == "fastseq_kv":
        elems, fp32 = 2 * e * (p - 1), 0.0
    else:
        if not ulysses_size or p % ulysses_size:
            raise ValueError(f"usp: ulysses_size {ulysses_size} must divide sp {p}")
        u, r = ulysses_size, p // ulysses_size
        elems = 4 * e * (u - 1) / u + 2 * e * (r - 1)
        fp32 = 2 * e * r if backward and r > 1 else 0.0
    return round(elems * dtype_bytes + fp32 * 4)

