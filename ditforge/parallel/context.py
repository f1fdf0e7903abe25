"""The tokens of a diffusers video transformer split over processes: diffusers' context parallelism, for sampling
(``sample.video``) and for fine-tuning (``parallelize``).

diffusers' ``ModelMixin.enable_parallelism`` applies the model's ``_cp_plan``: hooks keep this process's slice of
the tokens where the plan splits them (e.g. the input of the first block, the RoPE tables, a per-token timestep), and
all-gather them at its output (e.g. ``proj_out``); attention runs Ulysses (all-to-all over the heads; Jacobs et al.
2023), ring (K/V rotated; Liu et al. 2023), or both (USP; Fang and Zhao 2024), with a backward for each. The
diffusers code is not copied: this module chooses the split, builds its DeviceMesh and fixes the gradient scale.

A joint text-video attention (blocks that attend over [video tokens; text tokens] at once, or over [text tokens;
video tokens]) has no diffusers plan: split as a cross-attending model's tokens are, the text tokens every process
holds would enter Ulysses' all-to-all P times over, and weigh P times in the softmax. The adapter of such a family
declares its own plan (``cp_plan``), which splits the video tokens alone, and ``cp_text``; ``JointTextAttention``
runs Ulysses on the video tokens while each process keeps the text's keys and values of its own heads (no
communication for them), then gathers the text's output over the heads. What else a family's transformer needs
once its tokens are split is the adapter's ``split_hooks``.

Gradients when training: every process of a group computes the same loss on the gathered output; the gather's
backward (``diffusers.hooks.context_parallel.AllGatherFunction``) keeps this process's slice of the gradient, so
each process holds its tokens' share of every parameter gradient, and the group's shares sum to one process's
gradient of the whole sequence. The data-parallel reduction averages over all processes (dp x sp), so
``scale_gradient`` multiplies the output's gradient by the group size: the average is then exactly the gradient
of one process per sample (the same bookkeeping as ``sequence.shard``'s gather of ditforge's own DiTs).
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch
import torch.distributed as dist
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


def split_tokens(denoiser: nn.Module, d: Dist, mesh) -> None:
    """diffusers' context parallelism on ``denoiser``'s transformer over ``mesh``'s ring x ulysses part
    (``token_mesh``), in place, with a one-line refusal of a token count the group does not divide (diffusers would
    assert), by the adapter's declarations: ``cp_plan``, the model's own ``_cp_plan`` (None) or ditforge's plan (a
    function returning it), and ``cp_text``, what that plan's attention does with the whole text: ``"joint"`` and
    ``"joint_text_first"``, ``JointTextAttention`` over [video; text] or [text; video], at diffusers' dispatcher or,
    for a family whose processors call PyTorch's SDPA (``attention_calls_sdpa``), there (``intercept_sdpa``);
    ``"cross"``, each cross-attention over the whole text on every process. Then the adapter's ``split_hooks``.
    ditforge's plans run Ulysses only.

    Raises:
        UserError: a ring part for one of ditforge's plans. TypeError: a ``cp_plan`` and ``cp_text`` that do not
            match (``_text_kind``)."""
    from diffusers import ContextParallelConfig

    transformer = denoiser.inner
    plan, text = denoiser.cp_plan, _text_kind(type(denoiser))
    ring, ulysses = mesh["ring"].size(), mesh["ulysses"].size()
    if plan and ring > 1:  # ditforge's plans keep the text whole, exchanged by Ulysses alone (tested)
        heads = transformer.config.num_attention_heads
        raise UserError(f"--sequence_parallel_size {ring * ulysses}: {type(transformer).__name__} splits its video "
                        f"tokens by Ulysses alone; use a size that divides its {heads} heads "
                        "(--sequence_parallel_type ulysses)")
    if ring > 1:
        transformer.set_attention_backend("_native_cudnn")  # the SDPA kernel that returns the log-sum-exp
    config = ContextParallelConfig(ring_degree=ring if ring > 1 else None,
                                   ulysses_degree=ulysses if ulysses > 1 else None, mesh=mesh["ring", "ulysses"])
    with contextlib.ExitStack() as stack:
        if d.device.type == "cpu":  # diffusers takes the device index rank % torch.accelerator.device_count(),
            from unittest import mock  # 0 on a machine without one; the index is unused on the CPU

            stack.enter_context(mock.patch.object(torch.accelerator, "device_count", lambda: 1))
        transformer.enable_parallelism(config=config, cp_plan=plan() if plan else None)
    from ditforge.models.adapters.dispatch import intercept_attention, intercept_sdpa

    group = mesh["ulysses"].get_group()
    if text in ("joint", "joint_text_first"):
        attention = JointTextAttention(group, text_first=text == "joint_text_first")
        (intercept_sdpa if denoiser.attention_calls_sdpa else intercept_attention)(transformer, attention)
        transformer.register_forward_pre_hook(attention.read_text_length, with_kwargs=True)
    elif text == "cross":  # this process's queries over the whole text: no exchange
        intercept_attention(transformer, lambda q, k, v, mask, attend: attend(q, k, v, mask), cross_only=True)
    denoiser.split_hooks(transformer, group)
    patch, patch_t = transformer.config.patch_size, getattr(transformer.config, "patch_size_t", None)
    if patch_t:  # a transformer that states its temporal patch apart; else patch_size holds one or all three
        patch = (patch_t, patch, patch)
    check = _divisible_check(ring * ulysses, patch, frames_first=getattr(denoiser, "frames_first", False))
    transformer.register_forward_pre_hook(check, with_kwargs=True)


class JointTextAttention:
    """Ulysses over a joint attention whose queries, keys and values are (B, S + L, H, D): this process's S video
    tokens (the sequence split over the group of P in order) then the L text tokens, the same on every process, or
    the text first (``text_first``: ``cp_text`` ``"joint_text_first"``).

    The video tokens go through Ulysses' all-to-all (``ulysses.seq_to_heads``): each process then holds all P S video
    tokens of its H / P heads, beside the text tokens of the same heads (a slice, no communication); attention over
    video and text runs there through the processor's own backend, under the text's key mask (the text's entries of
    the transformer's (B, 1, 1, N + L) mask; video keys all kept); the video output goes back by the inverse
    all-to-all and the text output is gathered over the heads. Equal to one process's attention over the whole
    sequence (Jacobs et al. 2023's Ulysses with the replicated tokens kept out of the exchange). (A text-only attention
    that calls PyTorch directly, not the dispatcher, such as a token refiner's, runs whole on every process.)
    Gradients: the all-to-all's backward is its inverse; the text gather's is a reduce-scatter (sum), since each
    process's copy of the text feeds its own heads' part of the loss; the replicated text's parameter gradients then
    sum over the group as ``scale_gradient`` expects. L is read from the transformer's ``encoder_hidden_states``
    before each forward (``read_text_length``).
    """

    def __init__(self, group, text_first: bool = False):
        self.group, self.text_first, self.text = group, text_first, None

    def read_text_length(self, module, args, kwargs) -> None:
        if "encoder_hidden_states" not in kwargs:  # diffusers' hooks wrap the forward: bind to the class's own
            kwargs = inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments
        self.text = kwargs["encoder_hidden_states"].shape[1]

    def _order(self, video, text) -> tuple:
        """(video, text) in the attention's token order."""
        return (text, video) if self.text_first else (video, text)

    # eager inside compiled blocks: traced, the text length (a host int) would be a guard, and every prompt length
    # of a file (trim_padding) a recompile of every block, past dynamo's limit of 8
    @torch.compiler.disable
    def __call__(self, query, key, value, attn_mask, attend):
        from ditforge.parallel.collectives import gather_dim1
        from ditforge.parallel.sequence.ulysses import heads_to_seq, seq_to_heads

        text, video = self.text, query.shape[1] - self.text
        p, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        heads = query.shape[2]
        own = slice(rank * heads // p, (rank + 1) * heads // p)
        # the text's place in q, k, v and in the mask (whose video part is the whole video's)
        at_video, at_text = (slice(text, None), slice(None, text)) if self.text_first else \
            (slice(None, -text), slice(-text, None))
        # (B, H, S, D) views of the video part -> (3, B, H/P, P S, D), tokens-major as the processor's own
        qv, kv, vv = seq_to_heads(*(x[:, at_video].transpose(1, 2) for x in (query, key, value)), self.group)
        q, k, v = (torch.cat(self._order(x.transpose(1, 2), y[:, at_text, own]), dim=1) for x, y in
                   ((qv, query), (kv, key), (vv, value)))
        if attn_mask is not None:  # (B, 1, 1, N + L): the video keys all kept (True, or 0 added), the text's as given
            text_keys = attn_mask[..., at_text]
            keep = torch.ones if text_keys.dtype == torch.bool else torch.zeros
            video_keys = keep(*text_keys.shape[:-1], p * video, dtype=text_keys.dtype, device=text_keys.device)
            attn_mask = torch.cat(self._order(video_keys, text_keys), dim=-1)
        out = attend(q, k, v, attn_mask)  # (B, P S + L, H/P, D), in the same order
        video_out, text_out = self._order(*out.split(self._order(p * video, text), dim=1))
        video_out = heads_to_seq(video_out.transpose(1, 2), self.group).transpose(1, 2)  # (B, S, H, D)
        text_out = gather_dim1(text_out.transpose(1, 2), self.group)  # (B, H, L, D), heads in rank order
        return torch.cat(self._order(video_out, text_out.transpose(1, 2)), dim=1)


def _text_kind(family: type) -> str | None:
    """The adapter class ``family``'s ``cp_text``, checked against its ``cp_plan``: ditforge's plan (a function)
    needs one of the kinds ``split_tokens`` knows, the model's own plan (None) none.

    Raises:
        TypeError: naming the adapter, for a plan without a kind, a kind without a plan, or an unknown kind."""
    plan, text = family.cp_plan, family.cp_text
    if (plan is None) != (text is None) or text not in (None, "joint", "joint_text_first", "cross"):
        raise TypeError(f"{family.__name__}: cp_plan {plan!r} with cp_text {text!r}; ditforge's plan (a "
                        "function) needs cp_text 'joint', 'joint_text_first' or 'cross', the model's own (None) none")
    return text


def _divisible_check(size: int, patch, frames_first: bool = False):
    """A forward pre-hook: the video's token count (B, C, T, H, W latents over the (p_t, p_h, p_w) patch, (B, T, C, H,
    W) with ``frames_first`` (the adapter's), or tokens packed already, (B, N, C)) must divide into
    ``size`` equal slices."""
    p_t, p_h, p_w = patch if isinstance(patch, (tuple, list)) else (1, patch, patch)

    def check(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        if frames_first:
            x = x.transpose(1, 2)
        tokens = x.shape[1] if x.ndim == 3 else (x.shape[2] // p_t) * (x.shape[3] // p_h) * (x.shape[4] // p_w)
        if tokens % size:
            shape = "" if x.ndim == 3 else f" (latents {tuple(x.shape[2:])} over patches {(p_t, p_h, p_w)})"
            raise UserError(f"--sequence_parallel_size {size}: a video of {tokens} tokens{shape} does not split "
                            f"into {size} equal parts; change --num_frames or the size, or the process count")

    return check


def scale_gradient(transformer: nn.Module, factor: int) -> None:
    """A forward hook on ``transformer``: its output (the prediction, or a tuple that starts with it: the adapters
    call with ``return_dict=False``) passes through unchanged and its gradient comes back ``factor`` times larger."""

    from ditforge.parallel.collectives import MapGradient

    def scaled(grad: torch.Tensor) -> torch.Tensor:
        return grad * factor

    def hook(module, args, out):
        if isinstance(out, tuple):
            return (MapGradient.apply(out[0], scaled), *out[1:])
        return MapGradient.apply(out, scaled)

    transformer.register_forward_hook(hook)


def refuse_unsplittable(family, sp_size: int, remedy: str, use: str = "sample") -> None:
    """UserError (one line, ending in ``remedy``) when each sample's tokens are split over ``sp_size`` > 1 processes
    (``--sequence_parallel_size``) for ``use`` (``"sample"`` or ``"train"``) and the adapter class ``family`` (a
    ``DiffusersDenoiser`` subclass) has no tested context-parallel plan for it (``context_parallel``: every video
    family has one for both uses)."""
    if sp_size > 1 and use not in family.context_parallel:
        doing = "fine-tuning" if use == "train" else "sampling"
        raise UserError(f"--sequence_parallel_size {sp_size}: {' / '.join(family.pipelines)} does not split its "
                        f"tokens when {doing} (ditforge splits the video families' tokens; the image families have no "
                        f"plan); {remedy}")


MAX_TRAINING_RING = 2  # diffusers 0.42.1's ring backward passes each K/V chunk's gradient the wrong way round a ring
# of 3 or more (an index walk of TemplatedRingAttention.backward: it sums different chunks' gradients); 2 is exact


def apply_context_parallel(denoiser: nn.Module, d: Dist, kind: str) -> None:
    """Fine-tuning: the tokens of ``denoiser``'s diffusers transformer (a ``DiffusersDenoiser`` of a family that
    ``refuse_unsplittable`` passes; of two experts, ``expert_models``, each one's) split over ``d``'s ``sp`` groups
    (``token_mesh``, ``split_tokens``), its gradients scaled so that the data-parallel average over every process
    is one process's gradient.

    Raises:
        UserError: ``token_mesh``'s, or a ring of more than ``MAX_TRAINING_RING`` processes.
    """
    mesh = token_mesh(denoiser.inner, d, kind)
    if mesh["ring"].size() > MAX_TRAINING_RING:
        raise UserError(f"--sequence_parallel_size {d.sp_size}: fine-tuning would run ring attention over "
                        f"{mesh['ring'].size()} processes, whose backward in diffusers 0.42.1 is wrong beyond "
                        f"{MAX_TRAINING_RING}; use a size whose Ulysses part divides the "
                        f"{denoiser.inner.config.num_attention_heads} heads with a ring of at most {MAX_TRAINING_RING}")
    current = denoiser.expert
    for expert, transformer in enumerate(denoiser.expert_models()):  # two experts: both split over the same mesh
        denoiser.expert = expert
        split_tokens(denoiser, d, mesh)
        scale_gradient(transformer, d.sp_size)
    denoiser.expert = current
