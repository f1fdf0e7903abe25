"""Sequence parallelism applied from outside the model (the model code knows nothing of it).

Every process of an ``sp`` group holds the same samples. After the patch and position embeddings (which each
process computes whole), a forward pre-hook on the first block keeps this process's contiguous slice of the
tokens, padded at the end so that every process holds ``ceil(N / sp)``; the blocks then run on the slice:
adaLN, LayerNorm, MLP and the final layer are per token, conditioning (timestep, label, caption tokens for
cross-attention) is whole on every process, and only self-attention communicates (through the seam
``ops.self_attention``, with the padding masked as keys). A forward hook on the final layer all-gathers its
output (P * C_out values per token, a fraction of the width D) and drops the padding, so the loss and
``unpatchify`` see the whole sample.

Gradients: every process computes the same loss on the gathered output; the gather's backward sums the
copies' gradients over the group (a reduce-scatter), so each process holds sp times its slice's share of every
parameter gradient, and the data-parallel average over all dp x sp processes (DDP, ZeRO-2 or FSDP over the
whole world) gives exactly the gradient of one process running the whole sequence.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ditforge.errors import UserError
from ditforge.ops.attention import Projection, set_frame_exchange, set_sequence_attention
from ditforge.parallel.collectives import all_to_all, gather_dim1
from ditforge.parallel.mesh import Dist
from ditforge.parallel.sequence import fastseq_attention, sequence_parallel_attention


class SequenceShard:
    """The hooks and attention of sequence parallelism on one model (see the module docstring).

    Args:
        group: the sp process group (this process's row of the (dp, sp) mesh); the slices are in its rank order.
        variant: ``ulysses`` | ``ring`` | ``fastseq`` | ``fastseq_kv`` | ``usp`` (see
            ``ditforge.parallel.sequence``).
        attention_group: what ``sequence_parallel_attention`` takes: ``group``, or for ``usp`` the 2-D
            (``ring``, ``ulysses``) mesh over the same processes (its flattened rank is the rank in ``group``).
        num_heads: the model's head count (``fastseq`` splits the heads among the group).
    """

    def __init__(self, group: dist.ProcessGroup, variant: str, num_heads: int, attention_group=None):
        self.group = group
        self.variant = variant
        self.num_heads = num_heads
        self.attention_group = group if attention_group is None else attention_group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.valid: torch.Tensor | None = None  # this forward's local key mask (B, n), None when nothing is padding
        self.length = 0  # N, the whole sequence of this forward

    def local_valid(self, batch: int, total: int, device: torch.device) -> torch.Tensor | None:
        """The (B, n) key mask of this process's slice of ``total`` tokens padded to P * ceil(total / P): False
        on padding; None when nothing is padding."""
        n = -(-total // self.size)
        if n * self.size == total:
            return None
        return (torch.arange(self.rank * n, (self.rank + 1) * n, device=device) < total).expand(batch, n)

    def split(self, module: nn.Module, args: tuple) -> tuple:
        """Forward pre-hook of the first block: its input tokens (B, N, D) -> this process's (B, n, D)."""
        x, *rest = args
        b, n_total = x.shape[:2]
        n = -(-n_total // self.size)
        self.length = n_total
        self.valid = self.local_valid(b, n_total, x.device)
        if self.valid is not None:
            x = torch.nn.functional.pad(x, (0, 0, 0, n * self.size - n_total))
        return (x[:, self.rank * n:(self.rank + 1) * n], *rest)

    def gather(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        """Forward hook of the final layer: this process's (B, n, P*C) -> the whole (B, N, P*C)."""
        return gather_dim1(out, self.group)[:, :self.length]

    @torch.compiler.disable  # eager inside compiled blocks: see collectives.all_to_all (the same for every variant)
    def attention(self, x: torch.Tensor, project: Projection) -> torch.Tensor:
        """The ``ops.self_attention`` of this process's tokens x (B, n, D) -> (B, H, n, Dh)."""
        if self.variant == "fastseq":
            return fastseq_attention(x, project, self.num_heads, self.valid, self.group)
        return sequence_parallel_attention(*project(x, None), self.valid, self.attention_group, self.variant)


def _frames_to_positions(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, T_local, S, D) -> (B, P T_local, S / P, D): slice j of the positions goes to rank j, frames come
    back in rank order (= global frame order); autograd: the inverse all-to-all."""
    p = dist.get_world_size(group)
    b, t, s, d = x.shape
    y = all_to_all(x.reshape(b, t, p, s // p, d).permute(2, 0, 1, 3, 4), group)  # (P src frames, B, t, s/P, D)
    return y.permute(1, 0, 2, 3, 4).reshape(b, p * t, s // p, d)


def _positions_to_frames(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of ``_frames_to_positions``: (B, T, S_local, D) -> (B, T / P, P S_local, D)."""
    p = dist.get_world_size(group)
    b, t, s, d = x.shape
    y = all_to_all(x.reshape(b, p, t // p, s, d).permute(1, 0, 2, 3, 4), group)  # (P src positions, B, t/P, s, D)
    return y.permute(1, 2, 0, 3, 4).reshape(b, t // p, p * s, d)


def usp_ulysses_size(num_heads: int, size: int) -> int:
    """The Ulysses degree U of ``usp`` over ``size`` processes: the largest divisor of ``size`` below it that
    divides the heads, so the ring degree ``size / U`` is at least 2 (the hybrid; Fang & Zhao 2024 put
    Ulysses inside a host and the ring across hosts). 1 (a pure ring) when no such divisor exists."""
    return max(u for u in range(1, size) if size % u == 0 and num_heads % u == 0) if size > 1 else 1


def usp_attention_group(d: Dist, num_heads: int):
    """The 2-D (``ring``, ``ulysses``) DeviceMesh over each of ``d``'s sp groups that ``usp`` attends over, with
    Ulysses degree ``usp_ulysses_size``: a slice of a new (dp, ring, ulysses) mesh; every process must call it."""
    u = usp_ulysses_size(num_heads, d.sp_size)
    mesh = init_device_mesh(d.device.type, (d.dp_size, d.sp_size // u, u), mesh_dim_names=("dp", "ring", "ulysses"))
    return mesh["ring", "ulysses"]


def apply_sequence_parallel(model: nn.Module, d: Dist, variant: str, usp_group=None) -> SequenceShard:
    """Split ``model``'s token sequence over ``d``'s sp groups (hooks on ``model.blocks[0]`` and
    ``model.final_layer``, attention through ``ops.self_attention``); every process must call it (``usp``
    builds its mesh here unless ``usp_group``, one from ``usp_attention_group``, is given). Returns the
    installed ``SequenceShard``.

    An STDiT is split by whole frames instead (the contiguous token slices are whole frames when the frames
    divide among the processes): its attention within frames is local, and around its attention across
    frames an all-to-all exchanges frames for token columns and back (``ops.frames_to_positions``; the
    scheme of Open-Sora's sequence-parallel STDiT); ``variant`` does not apply to it.

    Raises:
        UserError: an STDiT whose frames or tokens per frame the group size does not divide, or Ulysses with a
            head count that the group size does not divide.
    """
    from ditforge.models.video import STDiT

    group, size = d.sp_mesh["sp"].get_group(), d.sp_size
    if isinstance(model, STDiT):
        frames, spatial = model.x_embedder.grid_shape[0], model.blocks[0].num_spatial
        if frames % size or spatial % size:
            raise UserError(f"--sequence_parallel_size {size}: an STDiT is split by frames and by token columns; "
                            f"its {frames} frames and {spatial} tokens per frame must both divide by it")
        shard = SequenceShard(group, variant, model.num_heads)
        model.blocks[0].register_forward_pre_hook(shard.split)
        model.final_layer.register_forward_hook(shard.gather)
        set_frame_exchange((lambda x: _frames_to_positions(x, group), lambda x: _positions_to_frames(x, group)))
        return shard
    if variant in ("ulysses", "fastseq") and (model.num_heads // d.tp_size) % size:  # the heads a process holds
        raise UserError(f"--sequence_parallel_type {variant}: {model.num_heads} heads are not divisible by "
                        f"--sequence_parallel_size {size}; use ring, fastseq_kv or usp")
    attention_group = None
    if variant == "usp":
        attention_group = usp_group if usp_group is not None else usp_attention_group(d, model.num_heads)
    shard = SequenceShard(group, variant, model.num_heads, attention_group)
    model.blocks[0].register_forward_pre_hook(shard.split)
    model.final_layer.register_forward_hook(shard.gather)
    set_sequence_attention(shard.attention)
    return shard


# What ``auto`` measures, where each applies.
AUTO_CANDIDATES = ("ulysses", "fastseq", "fastseq_kv", "ring", "usp")


def measure_sequence_parallel_types(model: nn.Module, d: Dist, batch_size: int = 1, dtype: torch.dtype | None = None,
                                    usp_group=None, repeats: int = 3) -> dict[str, float]:
    """Milliseconds one self-attention layer of ``model`` (a copy of ``model.blocks[0].attn``, qkv projection
    included) takes under each candidate variant at the shape at hand: ``batch_size`` samples of ceil(N / P)
    random float32 tokens per process (the last process's padding masked as in the run), under autocast to
    ``dtype`` when that is lower, forward and, when the model is training, backward; the median of ``repeats``
    calls after a warm-up call, then the maximum over all processes, so every process gets the same figures.
    Candidates: ``AUTO_CANDIDATES`` whose condition holds (ulysses and fastseq need the heads to divide by P;
    usp is measured on ``usp_group``, when given). Every process must call it. Leaves the global random state
    alone.

    Args:
        model: a DiT or video DiT (``blocks[0].attn`` an ``Attention``, ``x_embedder.num_patches`` = N), on
            ``d.device``.
        d: its ``Dist`` with an sp mesh of size P.
        batch_size: samples per process in one forward.
        dtype: the compute dtype (default: the model's parameter dtype).
    """
    size, group = d.sp_size, d.sp_mesh["sp"].get_group()
    dtype = dtype or next(model.parameters()).dtype
    layer = copy.deepcopy(model.blocks[0].attn).to(dtype)
    heads, backward, total = model.num_heads, model.training, model.x_embedder.num_patches
    n = -(-total // size)
    g = torch.Generator(d.device).manual_seed(0)
    x = torch.randn(batch_size, n, layer.qkv.in_features, generator=g, device=d.device)
    candidates = [v for v in AUTO_CANDIDATES
                  if v in ("fastseq_kv", "ring") or (usp_group is not None if v == "usp" else heads % size == 0)]
    shards = {v: SequenceShard(group, v, heads, usp_group if v == "usp" else None) for v in candidates}
    for shard in shards.values():
        shard.valid = shard.local_valid(batch_size, total, d.device)

    def call(variant: str) -> None:
        xi = x.detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward), torch.autocast(d.device.type, dtype, enabled=dtype != torch.float32):
            out = shards[variant].attention(xi, layer.project)
            if backward:
                out.sum().backward()
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)

    def median_ms(variant: str) -> float:
        call(variant)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call(variant)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    ms = torch.tensor([median_ms(v) for v in candidates], dtype=torch.float64, device=d.device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return dict(zip(candidates, ms.tolist()))


def choose_sequence_parallel_type(variant: str, model: nn.Module, d: Dist, batch_size: int = 1,
                                  dtype: torch.dtype | None = None) -> tuple[str, dict[str, float], object]:
    """What ``apply_sequence_parallel`` gets for ``--sequence_parallel_type variant``: (variant, the
    measurement behind it or {}, the usp mesh it was measured on or None). An STDiT -> ``frames`` (it is
    split by frames whatever the variant); ``fastseq`` -> ``fastseq_kv`` when the heads do not divide among
    the group (OpenDiT's form splits the heads); ``auto`` -> the fastest of ``measure_sequence_parallel_types``,
    usp included where it is a hybrid (Ulysses degree between 1 and P; every process must then call it);
    other names as given."""
    from ditforge.models.video import STDiT

    if isinstance(model, STDiT):
        return "frames", {}, None
    if variant == "fastseq" and model.num_heads % d.sp_size:
        return "fastseq_kv", {}, None
    if variant != "auto":
        return variant, {}, None
    usp = usp_attention_group(d, model.num_heads) if usp_ulysses_size(model.num_heads, d.sp_size) > 1 else None
    ms = measure_sequence_parallel_types(model, d, batch_size, dtype, usp)
    best = min(ms, key=ms.get)
    return best, ms, usp if best == "usp" else None
