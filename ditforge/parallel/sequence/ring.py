"""Ring attention (Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context", arXiv:2310.01889), in the form of ring-flash-attention and torchtitan's context parallelism.

Each rank keeps its queries; the K/V blocks travel round the ring of the P ranks (rank r sends to r+1 and
receives from r-1 with ``batch_isend_irecv``). At step s rank r holds the block of rank (r - s) mod P,
computes the partial attention of its queries over it together with the log-sum-exp of the scores, and
merges it exactly into the running output (online softmax, Milakov and Gimelshein 2018; float32
accumulation). The transfer of the next block is issued before the current block is computed, so the two
overlap.

Backward (the standard ring backward, as FlashAttention-2's backward per block, Dao 2023, algorithm 2):
with the final output O and log-sum-exp L saved, each block's probabilities are recomputed as
P = exp(S - L), which is exact per block; dQ accumulates locally, while dK/dV accumulators (float32)
travel round the ring with their K/V block and, after P hops, arrive back at the block's owner.

Per-block kernels: on CUDA in fp16/bf16, blocks without padding keys run PyTorch's fused attention forward and
backward ops, which give the block's output and lse and whose backward takes the final O and L (exactly as
ring-flash-attention calls flash-attn): cuDNN's (``aten::_scaled_dot_product_cudnn_attention[_backward]``)
where PyTorch's own SDPA prefers it (``ops.attention.cudnn_attention_preferred``: Hopper and Blackwell
datacenter GPUs with cuDNN newer than 9.15.0; measured by ``benchmarks/kernel_speed.py ring-attention`` on an H100 with
cuDNN 9.19, 2026-11-23, one 16-head Dh 72 bf16 block of 32k x 32k tokens: forward 13.95 vs 20.50 ms, backward
39.2 vs 62.9 ms), else FlashAttention-2's (``aten::_scaled_dot_product_flash_attention[_backward]``, Ampere or newer). Blocks with padding keys, float32
inputs, older GPUs and CPUs run plain PyTorch in float32, which materialises one N_local x N_local score block
per head (never the full N x N).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ditforge.ops.attention import cudnn_attention_preferred
from ditforge.parallel.sequence.ulysses import gather_valid

_KV_TAG, _DKV_TAG = 0, 1


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """float32 scores q k^T * scale, (B, H, Nq, Nk); masked keys -inf."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows without a valid key) replaced by 0, so exp(s - lse) is 0, not NaN, there."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def block_forward(q, k, v, mask, scale):
    """Attention of q over one K/V block: (out (B, H, Nq, Dh) float32, lse (B, H, Nq) float32). Rows whose
    keys are all masked give out 0 and lse -inf."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse)[..., None])
    return torch.matmul(p, v.float()), lse


def merge(out, lse, out_b, lse_b):
    """Exact merge of two partial softmax attentions over disjoint key sets (float32): returns the attention
    over their union and its lse. lse = -inf (no valid key yet) on either or both sides is handled without
    NaN (both -inf gives out 0, lse -inf)."""
    m = torch.maximum(lse, lse_b)
    m = _finite(m)
    a, b = torch.exp(lse - m), torch.exp(lse_b - m)
    s = a + b
    out = (out * a[..., None] + out_b * b[..., None]) / torch.where(s == 0, torch.ones_like(s), s)[..., None]
    return out, m + torch.log(s)


def block_backward(q, k, v, mask, scale, lse, do, delta):
    """Gradients of one block given the FINAL lse (B, H, Nq) and delta = rowsum(dO * O) (B, H, Nq):
    (dq, dk, dv), float32."""
    p = torch.exp(_scores(q, k, mask, scale) - _finite(lse)[..., None])  # exact block probabilities
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.float().transpose(-1, -2))
    ds = p.mul_(dp.sub_(delta[..., None]))
    dq = torch.matmul(ds, k.float()).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), q.float()).mul_(scale)
    return dq, dk, dv


def fused_block_kernel(q: torch.Tensor, mask: torch.Tensor | None) -> str | None:
    """Which fused op computes a block of these queries: "cudnn", "flash", or None (plain PyTorch)."""
    dh = q.shape[-1]
    if not (mask is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dh % 8 == 0):
        return None
    if dh <= 128 and cudnn_attention_preferred(q.device):
        return "cudnn"
    return "flash" if torch.cuda.get_device_capability(q.device) >= (8, 0) and dh <= 256 else None  # FA2: Ampere+


def fused_block_forward(kernel: str, q, k, v, scale):
    """Fused block forward: (out float32, lse float32 (B, H, Nq), aux for the backward)."""
    if kernel == "cudnn":
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)
        return r[0].float(), r[1].squeeze(-1), (r[2], r[3], r[6], r[7])  # cuDNN's lse is (B, H, Nq, 1)
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    return r[0].float(), r[1], (r[2], r[3], r[6], r[7])


def fused_block_backward(kernel: str, q, k, v, scale, out, lse, dout, aux):
    """Fused block backward with the final output ``out`` and lse (B, H, Nq) float32: (dq, dk, dv) float32.
    ``aux``: the (dropout-free, hence block-independent) sequence and RNG tensors of a forward call."""
    cum_q, cum_k, seed, offset = aux
    n_q, n_k = q.shape[2], k.shape[2]
    if kernel == "cudnn":
        g = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1), seed, offset, None, cum_q, cum_k, n_q, n_k, 0.0, False,
            scale=scale)
    else:
        g = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, n_q, n_k, 0.0, False, seed, offset, scale=scale)
    return tuple(t.float() for t in g)


def _ring_peers(group: ProcessGroup) -> tuple[int, int, int, int]:
    p, r = dist.get_world_size(group), dist.get_rank(group)
    return p, r, dist.get_global_rank(group, (r + 1) % p), dist.get_global_rank(group, (r - 1) % p)


def _shift(x: torch.Tensor, send_to: int, recv_from: int, group: ProcessGroup, tag: int):
    """Start sending ``x`` to the next rank and receiving the previous rank's tensor of the same shape;
    returns (receive buffer, works to wait on)."""
    buf = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, send_to, group, tag), dist.P2POp(dist.irecv, buf, recv_from, group, tag)]
    return buf, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for w in works:
        w.wait()


def _block_mask(mask: torch.Tensor | None, j: int, n: int, full: tuple[bool, ...]) -> torch.Tensor | None:
    """Block j's key mask, None when it has no padding key."""
    return None if mask is None or full[j] else mask[:, j * n : (j + 1) * n]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, group, has_keys, full):
        p, r, nxt, prv = _ring_peers(group)
        n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
        kv = torch.stack([k, v]).contiguous()
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        aux = None
        for s in range(p):
            works = None
            if s + 1 < p:  # issue the next block's transfer before computing this one
                kv_next, works = _shift(kv, nxt, prv, group, _KV_TAG)
            j = (r - s) % p
            if has_keys[j]:
                mask_b = _block_mask(mask, j, n, full)
                kernel = fused_block_kernel(q, mask_b)
                if kernel:
                    out_b, lse_b, aux = fused_block_forward(kernel, q, kv[0], kv[1], scale)
                else:
                    out_b, lse_b = block_forward(q, kv[0], kv[1], mask_b, scale)
                out, lse = merge(out, lse, out_b, lse_b)
            if works is not None:
                _wait(works)
                kv = kv_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(() if mask is None else (mask,)))
        ctx.group, ctx.has_keys, ctx.full, ctx.aux = group, has_keys, full, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *m = ctx.saved_tensors
        mask = m[0] if m else None
        group, has_keys, full = ctx.group, ctx.has_keys, ctx.full
        dout = dout.contiguous()
        p, r, nxt, prv = _ring_peers(group)
        n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
        do = dout.float()
        delta = (do * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv, dkv_recv, dkv_works = None, None, None
        for s in range(p):
            kv_works = None
            if s + 1 < p:
                kv_next, kv_works = _shift(kv, nxt, prv, group, _KV_TAG)
            j = (r - s) % p
            if has_keys[j]:
                mask_b = _block_mask(mask, j, n, full)
                kernel = fused_block_kernel(q, mask_b)
                if kernel:
                    dq_b, dk_b, dv_b = fused_block_backward(kernel, q, kv[0], kv[1], scale, out, lse, dout, ctx.aux)
                else:
                    dq_b, dk_b, dv_b = block_backward(q, kv[0], kv[1], mask_b, scale, lse, do, delta)
                dq += dq_b
                mine = torch.stack([dk_b, dv_b])
            else:
                mine = None
            if dkv_works is not None:  # the accumulator of block j, from rank r-1
                _wait(dkv_works)
                dkv, dkv_sent = dkv_recv, None
            if mine is not None:
                dkv = mine if dkv is None else dkv.add_(mine)
            elif dkv is None:
                dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
            # pass block j's accumulator on; after the last step it reaches block j's owner, r + 1 (the
            # sent tensor is kept referenced until its send is waited on in the next step)
            dkv_sent = dkv
            dkv_recv, dkv_works = _shift(dkv_sent, nxt, prv, group, _DKV_TAG)
            if kv_works is not None:
                _wait(kv_works)
                kv = kv_next
        _wait(dkv_works)  # our own block's dK/dV, from every rank
        dkv, dkv_sent = dkv_recv, None
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention_full_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                             group: ProcessGroup) -> torch.Tensor:
    """Ring attention given the already-gathered key mask of the whole ring: mask (B, P * N_local) bool in
    group-rank order, or None. See ``ring_attention``."""
    p = dist.get_world_size(group)
    n = q.shape[2]
    if mask is None:
        has_keys = full = (True,) * p
    else:  # one host sync per call: skip blocks that are padding in every sample, run full ones unmasked
        blocks = mask.view(mask.shape[0], p, n)
        flags = torch.stack([blocks.any(dim=2).any(dim=0), blocks.all(dim=2).all(dim=0)]).tolist()
        has_keys, full = tuple(flags[0]), tuple(flags[1])
    return _RingAttention.apply(q, k, v, mask, group, has_keys, full)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                   group: ProcessGroup) -> torch.Tensor:
    """Ring attention of this rank's queries over the whole sequence.

    Args:
        q, k, v: (B, H, N_local, Dh), this rank's contiguous token shard (group rank r holds global
            positions [r * N_local, (r + 1) * N_local)); any float dtype.
        valid: (B, N_local) bool, False for padding keys, or None. A block that is entirely padding
            contributes nothing (lse -inf, handled without NaN) and is not computed.
        group: the sequence-parallel process group (size P); the ring runs in group-rank order.

    Returns:
        (B, H, N_local, Dh), dtype of q; merged in float32.

    Communication per rank: forward (P - 1) K/V blocks of 2 * N_local * D elements sent (and received);
    backward the same K/V blocks again plus P float32 dK/dV blocks.
    """
    return ring_attention_full_mask(q, k, v, gather_valid(valid, group), group)
