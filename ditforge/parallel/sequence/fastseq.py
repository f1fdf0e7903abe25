"""FastSeq (OpenDiT, Zhao et al. 2024, "OpenDiT: An Easy, Fast and Memory-Efficient System for DiT Training
and Inference", github.com/NUS-HPC-AI-Lab/OpenDiT, section "FastSeq"): sequence parallelism built on
all-gather, for sequence-heavy, parameter-light DiT workloads.

This module implements the K/V-gather form: every rank all-gathers the K and V shards of the whole
sequence and attends its own queries to them; the backward of the all-gather is a reduce-scatter of
dK/dV. The gather is issued asynchronously in head chunks, all at once, and the attention of chunk c runs
while chunks c+1... are still arriving (the overlap).

OpenDiT's own form gathers the block's input activations x (B, N_local, D) before the QKV projection
instead, and projects K/V for the whole sequence on every rank (overlapping the projection of one chunk with
the gather of the next, an asynchronous ring): half the bytes of the K/V gather ((P-1)/P * N * D against
2 (P-1)/P * N * D per rank), but every rank computes the K/V projection of all N tokens (4 N D^2 FLOPs
instead of 4 N D^2 / P) and the gradient of the replicated projection comes from the full sequence. That
form lives in the caller (it owns the projections); this function serves it too: gather x, project, then
call plain local attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ditforge.parallel.sequence.ulysses import (_all_gather_single, _reduce_scatter_single, gather_valid,
                                                local_attention)


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
        pending.work = _all_gather_single(out, x, group, async_op=True)
        pending.keep = x
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // p, *grad.shape[1:]))
        _reduce_scatter_single(out, grad, ctx.group)
        return out, None, None


def fastseq_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
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
