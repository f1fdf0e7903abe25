"""FastSeq (OpenDiT, Zhao et al. 2024, "OpenDiT: An Easy, Fast and Memory-Efficient System for DiT Training
and Inference", github.com/NUS-HPC-AI-Lab/OpenDiT, section "FastSeq"): sequence parallelism built on
all-gather, for sequence-heavy, parameter-light DiT workloads at small parallelism.

Two forms:

- ``fastseq_attention`` (``--sequence_parallel_type fastseq``), OpenDiT's: every rank all-gathers the
  block's attention input x (B, N_local, D) and projects q, k, v of the whole sequence for its own head group
  (the rows of the qkv weight of heads [r H/P, (r+1) H/P): as many FLOPs as projecting its own tokens for
  every head), attends over the whole sequence with those heads, and an all-to-all returns the output to
  token shards (Ulysses' second all-to-all). The gather is issued asynchronously in token chunks and the
  projection of one chunk runs while the later chunks arrive. Sent per rank and layer: (P-1)/P N D for the
  gather + (P-1)/P N D / P for the all-to-all, against Ulysses' 4 (P-1)/P N D / P: less at P = 2 (0.75 vs
  1 N D), equal at 3, more from 4. Needs H divisible by P. Backward: reduce-scatter of dx, all-to-all.
- ``fastseq_kv_attention`` (``fastseq_kv``): every rank all-gathers the K and V shards and attends its own
  queries to them, any head count; 2 (P-1)/P N D per rank, as the ring. The gather is issued in head chunks
  and the attention of one chunk overlaps the later chunks' gather. Backward: reduce-scatter of dK, dV.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ditforge.ops.attention import Projection
from ditforge.parallel.collectives import all_gather_single, reduce_scatter_single
from ditforge.parallel.sequence.ulysses import check_heads, gather_valid, heads_to_seq, local_attention


class _Pending:
    """The work handle of an asynchronous collective started inside an autograd Function."""

    work = None
    keep = None  # the gather's input, alive until the gather completes

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.work = self.keep = None


class _AllGatherStart(torch.autograd.Function):
    """Start an all-gather along dim 0 ((n, ...) -> (P*n, ...), group-rank order) and return its output
    buffer at once; ``pending.wait()`` must be called before the buffer is read. Backward: reduce-scatter
    (sum) of the gradient, the adjoint of the all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, pending: _Pending) -> torch.Tensor:
        ctx.group = group
        p = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((p * x.shape[0], *x.shape[1:]))
        pending.work = all_gather_single(out, x, group, async_op=True)
        pending.keep = x
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // p, *grad.shape[1:]))
        reduce_scatter_single(out, grad, ctx.group)
        return out, None, None


def fastseq_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                         group: ProcessGroup, chunks: int = 2) -> torch.Tensor:
    """FastSeq (K/V all-gather) attention of this rank's queries over the whole sequence.

    Args:
        q, k, v: (B, H, N_local, Dh), this rank's contiguous token shard (group rank r holds global
            positions [r * N_local, (r + 1) * N_local)).
        valid: (B, N_local) bool, False for padding keys, or None.
        group: the sequence-parallel process group (size P).
        chunks: number of head chunks the K/V all-gather is split into (clipped to [1, H]); the attention
            of one chunk overlaps the gather of the later ones.

    Returns:
        (B, H, N_local, Dh), dtype of q.

    Communication per rank: forward, all-gather of K and V, 2 (P - 1)/P * N * D elements received (and, in
    a ring all-gather, sent); backward, reduce-scatter of dK and dV, the same volume.
    """
    b, h, n, dh = q.shape
    chunks = max(1, min(chunks, h))
    bounds = [round(i * h / chunks) for i in range(chunks + 1)]
    mask = gather_valid(valid, group)  # tiny; before the big gathers so it does not queue behind them
    started = []
    for c in range(chunks):  # issue every chunk's gather first
        h0, h1 = bounds[c], bounds[c + 1]
        # token-major layout (n, 2, B, hc, Dh): the gathered (P*n, ...) buffer is then the whole sequence in
        # order, and K, V are strided views of it (no copy after the gather)
        kv = torch.stack([k[:, h0:h1], v[:, h0:h1]]).permute(3, 0, 1, 2, 4)
        pending = _Pending()
        started.append((h0, h1, _AllGatherStart.apply(kv, group, pending), pending))
    outs = []
    for h0, h1, full, pending in started:
        pending.wait()
        k_full, v_full = full.permute(1, 2, 3, 0, 4)  # (2, B, hc, N, Dh) views
        outs.append(local_attention(q[:, h0:h1], k_full, v_full, mask))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _gathered_chunk(t: torch.Tensor, p: int) -> torch.Tensor:
    """(B, h, P*nc, Dh), the P ranks' chunk c in rank order -> (B, P, nc, h, Dh), a view."""
    return t.transpose(1, 2).unflatten(1, (p, t.shape[2] // p))


def fastseq_attention(x: torch.Tensor, project: Projection, num_heads: int, valid: torch.Tensor | None,
                      group: ProcessGroup, chunks: int = 2) -> torch.Tensor:
    """FastSeq as OpenDiT builds it (module docstring): the input all-gather, a head group's attention over
    the whole sequence, an all-to-all back to token shards.

    Args:
        x: (B, N_local, D), this rank's contiguous token shard of the attention's input (group rank r holds
            global positions [r * N_local, (r + 1) * N_local)).
        project: ``project(x, heads)`` -> q, k, v (B, h, N', Dh) of tokens (B, N', D) for the heads in the
            slice ``heads`` (``ditforge.models.layers.Attention.project``).
        num_heads: H, divisible by the group size P.
        valid: (B, N_local) bool, False for padding keys, or None.
        group: the sequence-parallel process group (size P).
        chunks: token chunks of the asynchronous all-gather (clipped to [1, N_local]); the projection of
            chunk c overlaps the gather of chunks c+1...

    Returns:
        (B, H, N_local, Dh), the dtype of the projection. Differentiable in x and the projection's
        parameters; rank r's gradient reaches only the qkv rows of its head group, from the whole sequence.

    Raises:
        ValueError: H does not divide by P (names ``--sequence_parallel_size``).
    """
    p, r = dist.get_world_size(group), dist.get_rank(group)
    check_heads(num_heads, p, "fastseq")
    if torch.is_autocast_enabled(x.device.type):  # the projection would cast it anyway: gather half the bytes
        x = x.to(torch.get_autocast_dtype(x.device.type))
    hp = num_heads // p
    n = x.shape[1]
    chunks = max(1, min(chunks, n))
    bounds = [round(i * n / chunks) for i in range(chunks + 1)]
    mask = gather_valid(valid, group)
    started = []
    for c in range(chunks):  # issue every chunk's gather first; token-major, so rank order is sequence order
        pending = _Pending()
        started.append((_AllGatherStart.apply(x[:, bounds[c]:bounds[c + 1]].transpose(0, 1), group, pending),
                        pending))
    pieces = []
    for full, pending in started:
        pending.wait()
        pieces.append(project(full.transpose(0, 1), slice(r * hp, (r + 1) * hp)))  # (B, h, P*nc, Dh) x 3
    if chunks == 1:
        q, k, v = pieces[0]
    else:  # chunk-major -> sequence order, tokens-major memory (cuDNN's SDPA layout)
        q, k, v = (torch.cat([_gathered_chunk(t, p) for t in ts], dim=2).flatten(1, 2).transpose(1, 2)
                   for ts in zip(*pieces))
    return heads_to_seq(local_attention(q, k, v, mask), group)
