"""The three networks of a pipeline distillation (``distill_pipeline.py``), their optimizers and their checkpoint
state. The teacher's denoiser (``base``) is the real score with its peft adapters disabled; student and critic are
each either a peft adapter on it (``student`` / ``critic``, ``ADAPTERS``) or a full trainable copy of it:

- ``--lora_rank R``: the student is an adapter of rank R on the base; the critic an adapter too (``--critic_lora_rank``,
  default R), so one copy of the base weights serves the three networks (``dmd.py``'s docstring).
- ``--lora_rank 0``: the student is a full copy of the teacher's denoiser (fp32, initialised from it; DMD2's
  generator). Its critic is a full copy too by default (``--critic_lora_rank 0``): the fake score of DMD2
  (``tianweiy/DMD2``'s ``fake_unet``), FastVideo's DMD2 and Self-Forcing is a full copy of the teacher, and no
  measurement here shows an adapter tracks a fully trained student as well. ``--critic_lora_rank R`` makes it an
  adapter of rank R on the frozen teacher instead, which saves the critic's fp32 weights, gradients and AdamW
  moments (16 bytes per parameter: 21 GB for a 1.3B transformer).

``use`` switches to a network before its call and its backward: peft's ``set_adapter`` makes the active adapter's
parameters the ones that require gradients, so each backward (and, under gradient checkpointing, each recomputed
forward) runs with the adapter of its own forward active; a full copy needs no switch.

Checkpoint (``state``): each network's trainable tensors by their names in their module (``student``, ``critic``),
both optimizers by parameter name (``optimizer``, ``critic_optimizer``) and ``ema``, the student as ``ditforge
sample --ckpt RUN`` and ``ditforge export`` read a fine-tune of the pipeline: a LoRA student's adapters in peft's
default naming (a LoRA fine-tune's), a full student's weights by the denoiser's parameter names (a full fine-tune's;
held once, as ``ema`` alone).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from ditforge.errors import UserError

ADAPTERS = ("student", "critic")
BETAS = (0.0, 0.999)  # DMD2 trains both networks with Adam at beta1 = 0 (main/train_sd.py): the critic's target moves


def use_adapter(model: nn.Module, name: str | None) -> None:
    """Make ``name`` (``ADAPTERS``) the active peft adapter of every LoRA layer of ``model`` (its parameters then
    require gradients, the other's not: peft's ``set_adapter``), or with None disable the adapters (the teacher:
    the base weights alone). A model without adapters is left as it is."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            if name is None:
                module.enable_adapters(False)
            else:
                module.enable_adapters(True)
                module.set_adapter(name)


def adapter_params(model: nn.Module, name: str) -> dict[str, nn.Parameter]:
    """The parameters of adapter ``name`` by their names in ``model`` (peft's ``...lora_A.<name>.weight``)."""
    return {k: p for k, p in model.named_parameters() if f".{name}." in k and ".lora_" in k}


def critic_rank(cfg) -> int:
    """The critic's LoRA rank (0: a full copy): ``--critic_lora_rank``, else a LoRA student's ``--lora_rank``, a full
    student's 0 (module docstring)."""
    return cfg.lora_rank if cfg.critic_lora_rank is None else cfg.critic_lora_rank


def full_copy(model: nn.Module) -> nn.Module:
    """A trainable copy of the teacher's denoiser ``model`` (before any adapter is added to it): fp32 weights
    initialised from the teacher's (a bf16 teacher's exactly), every parameter requiring gradients."""
    return copy.deepcopy(model).float().requires_grad_(True)


def build_networks(cfg, pre, targets: list[str], device: torch.device, amp: torch.dtype) -> Networks:
    """The networks of ``cfg`` (a ``DistillConfig``) on the teacher pipeline ``pre``'s denoiser, on ``device`` in eval
    mode (no dropout: the student always sees its prompt), placed as fine-tuning places a LoRA run's frozen base:
    the full copies made first (gradient checkpointing on in them too), then the adapters on ``targets``
    (Gaussian A drawn after ``torch.manual_seed(seed)``, the student's first), the teacher's frozen weights stored in
    float8 (``--fp8_base``: ``finetune.store_base_in_fp8``) and its last ``--blocks_to_swap`` blocks in host memory
    (``build.swap_blocks``; the adapters, trainable though one at a time requires gradients, stay on ``device``).

    A teacher of two experts (``expert_models``) carries a student and a critic adapter on each (in the experts'
    order); full copies and the placements are not built for it yet.

    Raises:
        UserError (one line, naming the flag): ``--critic_lora_rank 0`` with a LoRA student (its critic is an
            adapter on the same base), ``--blocks_to_swap`` without ``--grad_checkpoint``, a full copy or a
            placement of a two-expert teacher, LoRA targets that match no module (``check_lora_targets``),
            ``swap_blocks``' errors.
    """
    from ditforge.parallel.mesh import Dist
    from ditforge.train.build import swap_blocks
    from ditforge.train.finetune import store_base_in_fp8
    from ditforge.weights.lora import add_lora, check_lora_targets

    model, ranks = pre.denoiser, (cfg.lora_rank, critic_rank(cfg))
    if cfg.lora_rank and not ranks[1]:
        raise UserError(f"--critic_lora_rank 0: a LoRA student's critic is an adapter on its base; give a rank or "
                        f"leave it out (default --lora_rank {cfg.lora_rank})")
    if cfg.blocks_to_swap and not cfg.grad_checkpoint:
        raise UserError("--blocks_to_swap: needs --grad_checkpoint (else the backward holds every swapped block's "
                        "device copy)")
    experts = model.expert_models()
    given = [flag for flag, on in (("--lora_rank 0", not ranks[0]), ("--critic_lora_rank 0", not ranks[1]),
                                   ("--fp8_base", cfg.fp8_base), ("--blocks_to_swap", cfg.blocks_to_swap)) if on]
    if len(experts) > 1 and given:
        raise UserError(f"{given[0]}: a teacher of two experts distils LoRA students and critics on its base, "
                        "unplaced, so far")
    if any(ranks):
        check_lora_targets(model.inner, targets)
    if cfg.grad_checkpoint:
        for inner in experts:
            inner.enable_gradient_checkpointing()
    copies = {name: full_copy(model).to(device).eval() for name, rank in zip(ADAPTERS, ranks) if not rank}
    model.requires_grad_(False)
    torch.manual_seed(cfg.seed)  # the adapters' Gaussian A: each adapter's, in the experts' order
    for name, rank in zip(ADAPTERS, ranks):
        for inner in experts if rank else ():  # two experts: a student and a critic adapter each
            add_lora(inner, rank, None, targets, adapter_name=name)
    if cfg.fp8_base:
        store_base_in_fp8(model, amp, "none")
    model.to(device).eval()
    if cfg.blocks_to_swap:
        adapters = [p for name in ADAPTERS if name not in copies for p in adapter_params(model, name).values()]
        for p in adapters:  # BlockSwap moves what does not require gradients
            p.requires_grad_(True)
        swap_blocks(model, cfg.blocks_to_swap, pre, Dist(device=device))
    return Networks(model, copies)


@dataclass
class Networks:
    """Student, critic and teacher on the teacher's denoiser ``base`` (module docstring). ``copies``: the networks
    (``"student"`` / ``"critic"``) that are full copies; the others are ``base``'s adapters of those names."""

    base: nn.Module
    copies: dict[str, nn.Module]

    def describe(self) -> str:
        """The networks in words, for the run's first log line."""
        def kind(name: str) -> str:
            if name in self.copies:
                return "full copy"
            return f"LoRA rank {next(iter(adapter_params(self.base, name).values())).shape[0]}"

        return f"{kind('student')}; critic: {kind('critic')}"

    def module(self, name: str | None) -> nn.Module:
        """The module that computes ``name`` (None: the teacher)."""
        return self.copies.get(name, self.base)

    def use(self, name: str | None) -> None:
        """Switch to network ``name`` (None: the teacher) before its call or its backward (``use_adapter``)."""
        if name not in self.copies:
            use_adapter(self.base, name)

    def params(self, name: str) -> dict[str, nn.Parameter]:
        """``name``'s trainable parameters by their names in ``module(name)``."""
        if name in self.copies:
            return dict(self.copies[name].named_parameters())
        return adapter_params(self.base, name)

    def optimizers(self, optimizer: str, lrs: tuple[float, float], device: torch.device) -> list:
        """The student's and the critic's optimizers (``--optimizer``, ``optim.build_optimizer``: fp32 AdamW, or
        8-bit / 4-bit / float8 moments) at learning rates ``lrs``, betas ``BETAS``, no weight decay."""
        from ditforge.optim import build_optimizer

        return [build_optimizer(list(self.params(name).values()), optimizer, lr, 0.0, device, betas=BETAS)
                for name, lr in zip(ADAPTERS, lrs)]

    def state(self, opts: list) -> dict:
        """The checkpoint's tensors (module docstring) of the networks and their optimizers ``opts``."""
        nets = {name: {k: p.detach() for k, p in self.params(name).items()} for name in ADAPTERS}
        student = nets.pop("student")
        ema = student if "student" in self.copies else {k.replace(".student.", ".default."): v
                                                        for k, v in student.items()}
        if "student" not in self.copies:
            nets["student"] = student
        return nets | {"ema": ema, "optimizer": self._optimizer_state("student", opts[0]),
                       "critic_optimizer": self._optimizer_state("critic", opts[1])}

    def _optimizer_state(self, name: str, opt, state: dict | None = None, partial: bool = False) -> dict | None:
        """``opt``'s state by parameter name (``get_optimizer_state_dict``), or with ``state`` that state loaded into
        it (``set_optimizer_state_dict``; ``partial``: some parameters' states left out, those never stepped, which
        then start from none), under ``name`` active: both initialise a fresh optimizer's state for the parameters
        that require gradients, which are the active adapter's."""
        self.use(name)
        if state is None:
            return get_optimizer_state_dict(self.module(name), opt)
        set_optimizer_state_dict(self.module(name), opt, state, options=StateDictOptions(strict=not partial))
        return None

    def resume(self, ckpt: Path, opts: list) -> int:
        """Load both networks and optimizers from ``ckpt``; returns its step.

        Raises:
            UserError: a checkpoint of another distillation (other networks, shapes or optimizer).
        """
        from ditforge.train.checkpoint import keep_saved_states
        from ditforge.weights.read import SafeFileSystemReader, _SafeLoadPlanner, read_meta

        state = self.state(opts)
        # an expert's adapter no step had reached when it was saved has no optimizer state there (two experts)
        partial = {part: keep_saved_states(state[part], ckpt, part) for part in ("optimizer", "critic_optimizer")}
        for key in (*ADAPTERS, "ema"):
            if key in state:
                state[key] = {k: v.clone() for k, v in state[key].items()}
        if "student" in state:
            state.pop("ema")  # the adapters' renamed copy
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), planner=_SafeLoadPlanner(), no_dist=True)
        except Exception as e:  # DCP's mismatch errors vary
            raise UserError(f"--resume: {ckpt} does not fit this distillation "
                            f"({' '.join(str(e).split())[:200]})") from None
        with torch.no_grad():
            for name in ADAPTERS:
                saved = state["ema" if name in self.copies and name == "student" else name]
                for k, p in self.params(name).items():
                    p.copy_(saved[k])
        for name, opt, key in zip(ADAPTERS, opts, ("optimizer", "critic_optimizer")):
            self._optimizer_state(name, opt, state[key], partial[key])
        return int(read_meta(ckpt)["step"])
