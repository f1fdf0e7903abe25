"""The tokens of a diffusers video transformer split over processes: diffusers' context parallelism, for sampling
(``sample.video``) and for fine-tuning (``parallelize``).

diffusers' ``ModelMixin.enable_parallelism`` applies the model's ``_cp_plan``: hooks keep this process's slice of
the tokens where the plan splits them (Wan: the input of ``blocks.0``, the RoPE tables, a per-token timestep), and
all-gather them at its output (Wan: ``proj_out``); attention runs Ulysses (all-to-all over the heads; Jacobs et al.
2023), ring (K/V rotated; Liu et al. 2023), or both (USP; Fang and Zhao 2024), with a backward for each. The
diffusers code is not copied: this module chooses the split, builds its DeviceMesh and fixes the gradient scale.

Gradients when training: every process of a group computes the same loss on the gathered output; the gather's
backward (``diffusers.hooks.context_parallel.AllGatherFunction``) keeps this process's slice of the gradient, so
each process holds its tokens' share of every parameter gradient, and the group's shares sum to one process's
gradient of the whole sequence. The data-parallel reduction averages over all processes (dp x sp), so
``scale_gradient`` multiplies the output's gradient by the group size: the average is then exactly the gradient
of one process per sample (the same bookkeeping as ``sequence.shard``'s gather of ditforge's own DiTs).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from ditforge.errors import UserError
from ditforge.parallel.mesh import Dist

log = logging.getLogger(__name__)

KINDS = ("auto", "usp", "ulysses", "ring")  # what --sequence_parallel_type may be for a diffusers transformer


def token_mesh(transformer: nn.Module, d: Dist, kind: str):
    """The (``outer``, ``ring``, ``ulysses``) DeviceMesh that splits each sample's tokens over ``d.sp_size``
    consecutive processes (the rank layout of ``init_distributed``'s ``sp`` groups); ``outer`` is what is left of
    the world (data- or CFG-parallel). ``auto`` / ``usp`` put as many processes on Ulysses as the head count allows
    (the largest common divisor) and the rest on ring.

    Raises:
        UserError: ``kind`` not one of ``KINDS``; Ulysses over a process count that does not divide the heads; ring
            attention off CUDA (diffusers' ring needs the log-sum-exp of cuDNN attention).
    """
    from torch.distributed.device_mesh import init_device_mesh

    size = d.sp_size
    heads = int(transformer.config.num_attention_heads)
    if kind not in KINDS:
        raise UserError(f"--sequence_parallel_type {kind}: a diffusers video transformer splits its tokens with "
                        "ulysses, ring, or usp (auto)")
    ulysses = {"ulysses": size, "ring": 1}.get(kind) or max(u for u in range(1, size + 1)
                                                           if size % u == 0 and heads % u == 0)
    if heads % ulysses:
        raise UserError(f"--sequence_parallel_size {size}: Ulysses needs a process count that divides the "
                        f"{heads} attention heads; use --sequence_parallel_type ring or usp")
    ring = size // ulysses
    if ring > 1 and d.device.type != "cuda":
        raise UserError(f"--sequence_parallel_size {size}: ring attention over a diffusers transformer runs on "
                        "CUDA only (it needs the log-sum-exp of cuDNN attention); on the CPU use "
                        f"--sequence_parallel_type ulysses with a size that divides the {heads} heads")
    log.info("context parallel: %d processes per sample (ulysses %d x ring %d)", size, ulysses, ring)
    return init_device_mesh(d.device.type, (d.world_size // size, ring, ulysses),
                            mesh_dim_names=("outer", "ring", "ulysses"))


def split_tokens(transformer: nn.Module, d: Dist, mesh) -> None:
    """diffusers' context parallelism on ``transformer`` over ``mesh``'s ring x ulysses part (``token_mesh``), in
    place, with a one-line refusal of a token count the group does not divide (diffusers would assert)."""
    from diffusers import ContextParallelConfig

    ring, ulysses = mesh["ring"].size(), mesh["ulysses"].size()
    if ring > 1:
        transformer.set_attention_backend("_native_cudnn")  # the SDPA kernel that returns the log-sum-exp
    config = ContextParallelConfig(ring_degree=ring if ring > 1 else None,
                                   ulysses_degree=ulysses if ulysses > 1 else None, mesh=mesh["ring", "ulysses"])
    with contextlib.ExitStack() as stack:
        if d.device.type == "cpu":  # diffusers takes the device index rank % torch.accelerator.device_count(),
            from unittest import mock  # 0 on a machine without one; the index is unused on the CPU

            stack.enter_context(mock.patch.object(torch.accelerator, "device_count", lambda: 1))
        transformer.enable_parallelism(config=config)
    transformer.register_forward_pre_hook(_divisible_check(ring * ulysses, transformer.config.patch_size),
                                          with_kwargs=True)


def _divisible_check(size: int, patch):
    """A forward pre-hook: the video's token count (B, C, T, H, W latents over the (p_t, p_h, p_w) patch) must
    divide into ``size`` equal slices."""
    p_t, p_h, p_w = patch if isinstance(patch, (tuple, list)) else (1, patch, patch)

    def check(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        tokens = (x.shape[2] // p_t) * (x.shape[3] // p_h) * (x.shape[4] // p_w)
        if tokens % size:
            raise UserError(f"--sequence_parallel_size {size}: a video of {tokens} tokens (latents "
                            f"{tuple(x.shape[2:])} over patches {(p_t, p_h, p_w)}) does not split into {size} "
                            "equal parts; change --num_frames or the size, or the process count")

    return check


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient times ``factor`` (the module docstring says why)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_gradient(transformer: nn.Module, factor: int) -> None:
    """A forward hook on ``transformer``: its output (the prediction, or a tuple that starts with it: the adapters
    call with ``return_dict=False``) passes through unchanged and its gradient comes back ``factor`` times larger."""

    def hook(module, args, out):
        if isinstance(out, tuple):
            return (_ScaleGradient.apply(out[0], factor), *out[1:])
        return _ScaleGradient.apply(out, factor)

    transformer.register_forward_hook(hook)


def refuse_unsplittable(family, sp_size: int, remedy: str) -> None:
    """UserError (one line, ending in ``remedy``) when each sample's tokens are split over ``sp_size`` > 1 processes
    (``--sequence_parallel_size``) and the adapter class ``family`` (a ``DiffusersDenoiser`` subclass) has no tested
    context-parallel plan (``context_parallel``: the Wan families)."""
    if sp_size > 1 and not family.context_parallel:
        raise UserError(f"--sequence_parallel_size {sp_size}: {' / '.join(family.pipelines)} does not split its "
                        "tokens (ditforge splits the Wan families' by diffusers' context-parallel plan; diffusers "
                        "has none for CogVideoX, HunyuanVideo and the image families, and LTX-Video's fails under "
                        f"Ulysses on its attention mask); {remedy}")


MAX_TRAINING_RING = 2  # diffusers 0.42.1's ring backward passes each K/V chunk's gradient the wrong way round a ring
# of 3 or more (an index walk of TemplatedRingAttention.backward: it sums different chunks' gradients); 2 is exact


def apply_context_parallel(denoiser: nn.Module, d: Dist, kind: str) -> None:
    """Fine-tuning: the tokens of ``denoiser``'s diffusers transformer (a ``DiffusersDenoiser`` of a family that
    ``refuse_unsplittable`` passes) split over ``d``'s ``sp`` groups (``token_mesh``, ``split_tokens``), its
    gradients scaled so that the data-parallel average over every process is one process's gradient.

    Raises:
        UserError: ``token_mesh``'s, or a ring of more than ``MAX_TRAINING_RING`` processes.
    """
    mesh = token_mesh(denoiser.inner, d, kind)
    if mesh["ring"].size() > MAX_TRAINING_RING:
        raise UserError(f"--sequence_parallel_size {d.sp_size}: fine-tuning would run ring attention over "
                        f"{mesh['ring'].size()} processes, whose backward in diffusers 0.42.1 is wrong beyond "
                        f"{MAX_TRAINING_RING}; use a size whose Ulysses part divides the "
                        f"{denoiser.inner.config.num_attention_heads} heads with a ring of at most {MAX_TRAINING_RING}")
    split_tokens(denoiser.inner, d, mesh)
    scale_gradient(denoiser.inner, d.sp_size)
