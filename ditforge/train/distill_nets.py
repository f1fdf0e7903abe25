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

``use`` switches to a network before its call and its backward, so each backward (and, under gradient checkpointing,
each recomputed forward) runs with the adapter of its own forward active; a full copy needs no switch. The switch
changes which adapter computes, never which parameters require gradients (both adapters' always do, the base's
never): only the active adapter is in a forward's graph, so only it gets gradients, and under FSDP2 (``--plugin
fsdp``), which gathers each parameter with its shard's ``requires_grad``, a flag flipped on a gathered parameter
would be lost at the next gather.

Under torchrun (``distill_pipeline``) the networks are data parallel (``--plugin ddp``: whole on every process, the
gradients averaged by the iteration) or sharded (``--plugin fsdp``: ``parallel.parallelize``, fine-tuning's FSDP2,
over the teacher's base with both adapters in its blocks and over each full copy, one ``fully_shard`` per
transformer block and one for the rest), and with ``--sequence_parallel_size`` each network's transformer splits
its tokens (``parallelize``'s ``parallel.context``, fine-tuning's).

With ``--data`` the critic carries DMD2's GAN head (``dmd.GANHead`` as its module's submodule ``gan_head``: the
full copy's, or a LoRA critic's base's, after the float8 storage), trained and saved with the critic's parameters;
under ``--plugin fsdp`` an FSDP2 unit of its own (``build_networks`` says why), its shards in the critic's optimizer
and checkpoint as the critic's other shards are. One head serves both experts of a two-expert teacher
(``distill_real``'s docstring says why).

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
    """Make ``name`` (``ADAPTERS``) the active peft adapter of every LoRA layer of ``model`` (peft's ``set_adapter``),
    or with None disable the adapters (the teacher: the base weights alone). Every parameter keeps its
    ``requires_grad`` (peft's switch sets the active adapter's and clears the others'; module docstring: why not
    here). A model without adapters is left as it is."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            flags = [(p, p.requires_grad) for p in module.parameters()]
            if name is None:
                module.enable_adapters(False)
            else:
                module.enable_adapters(True)
                module.set_adapter(name)
            for p, flag in flags:
                p.requires_grad_(flag)


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


def build_networks(cfg, pre, targets: list[str], amp: torch.dtype, d, plugin: str) -> Networks:
    """The networks of ``cfg`` (a ``DistillConfig``) on the teacher pipeline ``pre``'s denoiser, on ``d.device`` (``d``:
    this process's ``parallel.mesh.Dist``) in eval mode (no dropout: the student always sees its prompt), placed as
    fine-tuning places a LoRA run's frozen base: the full copies made first (gradient checkpointing on in them too),
    then the adapters on ``targets`` (Gaussian A drawn after ``torch.manual_seed(seed)``, the student's first; both
    adapters' parameters require gradients from then on, ``use_adapter``), the teacher's frozen weights stored in
    float8 (``--fp8_base``: ``finetune.store_base_in_fp8``); then, with ``plugin`` ``fsdp`` or ``d.sp_mesh``
    (``--sequence_parallel_size``), ``parallel.parallelize`` of the base and of each full copy (FSDP2 per block,
    gathered in ``amp``, fp32 shards and gradient reduction; the tokens split by ``parallel.context``); last the
    teacher's last ``--blocks_to_swap`` blocks in host memory (``parallel.offload.swap_blocks``, after
    ``parallelize`` as in fine-tuning; the adapters stay on the device).

    A teacher of two experts (``expert_models``) carries a student and a critic adapter on each (in the experts'
    order), and is placed and parallelised as one: both experts' bases in float8, each one's last
    ``--blocks_to_swap`` blocks swapped (``swap_blocks``), each one's blocks and the rest of it FSDP2 units of their
    own (``parallel._apply_fsdp``: an expert's weights gathered only for its calls), each one's tokens split. Under
    torchrun every process calls the experts that any process's rows of a call need (``adapters.by_expert``'s
    ``agree``, ``routing_agree``): FSDP2's gathers and the gradients' reduction are collectives every process must
    enter alike.

    Raises:
        UserError (one line, naming the flag): ``--critic_lora_rank 0`` with a LoRA student (its critic is an
            adapter on the same base), ``--blocks_to_swap`` without ``--grad_checkpoint``, ``--fp8_base`` or
            ``--blocks_to_swap`` with ``--plugin fsdp`` (each process holds a shard of the base, not the whole), a
            full copy of a two-expert teacher (``--lora_rank 0`` / ``--critic_lora_rank 0``), LoRA targets that
            match no module (``check_lora_targets``), ``swap_blocks``' and ``parallelize``'s errors
            (``parallel.context``'s: a head count the group does not divide, ring attention off CUDA).
    """
    from ditforge.parallel import parallelize
    from ditforge.parallel.offload import swap_blocks
    from ditforge.train.finetune import store_base_in_fp8
    from ditforge.weights.lora import add_lora, check_lora_targets

    model, ranks, device = pre.denoiser, (cfg.lora_rank, critic_rank(cfg)), d.device
    if cfg.lora_rank and not ranks[1]:
        raise UserError(f"--critic_lora_rank 0: a LoRA student's critic is an adapter on its base; give a rank or "
                        f"leave it out (default --lora_rank {cfg.lora_rank})")
    if cfg.blocks_to_swap and not cfg.grad_checkpoint:
        raise UserError("--blocks_to_swap: needs --grad_checkpoint (else the backward holds every swapped block's "
                        "device copy)")
    placed = [flag for flag, on in (("--fp8_base", cfg.fp8_base), ("--blocks_to_swap", cfg.blocks_to_swap)) if on]
    if plugin == "fsdp" and placed:
        raise UserError(f"{placed[0]}: with --plugin ddp (each process holds the whole teacher); --plugin fsdp "
                        "shards it instead")
    experts = model.expert_models()
    full = [flag for flag, on in (("--lora_rank 0", not ranks[0]), ("--critic_lora_rank 0", not ranks[1])) if on]
    if len(experts) > 1 and full:
        raise UserError(f"{full[0]}: a teacher of two experts distils LoRA students and critics (a full copy of both "
                        "experts would train twice the weights, with fp32 AdamW moments 16 bytes a parameter: 448 GB "
                        "for two 14B experts); give a LoRA rank")
    if len(experts) > 1 and d.world_size > 1:  # every process calls the experts any process's rows need (by_expert)
        from ditforge.parallel.collectives import sum_over_processes

        model.routing_agree = lambda counts: sum_over_processes(counts, d)
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
    for name in ADAPTERS:  # peft's add_adapter leaves one of them trainable; use_adapter keeps the flags
        for p in adapter_params(model, name).values():
            p.requires_grad_(True)
    if cfg.fp8_base:
        store_base_in_fp8(model, amp, "none")
    model.to(device).eval()
    if cfg.data is not None:  # DMD2's cls_pred_branch, the critic's: in its optimizer and its checkpoint entry
        from ditforge.diffusion.dmd import GANHead

        torch.manual_seed(cfg.seed)
        head = copies.get("critic", model).gan_head = GANHead(model.feature_width).to(device)
        if plugin == "fsdp":
            from torch.distributed.fsdp import fully_shard

            # sharded as the house shards every parameter outside the blocks (the root's, each expert's), but a unit
            # of its own: gathered in float32 (the head computes in float32; the root's unit gathers in the compute
            # dtype) and by its own call, which runs after its module's forward, so its own hooks gather it for its
            # backward and reduce-scatter its gradients (FSDP2's defaults: float32 parameters and reduction)
            fully_shard(head, mesh=d.shard_mesh)
    if plugin == "fsdp" or d.sp_mesh is not None:
        for module in (model, *copies.values()):
            parallelize(module, d, plugin if plugin == "fsdp" else "none",
                        param_dtype=None if amp == torch.float32 else amp,
                        sequence_parallel_type=cfg.sequence_parallel_type)
    if cfg.blocks_to_swap:
        swap_blocks(model, cfg.blocks_to_swap, pre, d)
    return Networks(model, copies)


@dataclass
class Networks:
    """Student, critic and teacher on the teacher's denoiser ``base`` (module docstring). ``copies``: the networks
    (``"student"`` / ``"critic"``) that are full copies; the others are ``base``'s adapters of those names. Made
    after ``parallelize``: the trainable parameters are taken then, as the optimizers take them (FSDP2's shards;
    ``reshard``)."""

    base: nn.Module
    copies: dict[str, nn.Module]

    def __post_init__(self):
        self.trainable = {name: dict(self.copies[name].named_parameters()) if name in self.copies else
                          adapter_params(self.base, name) for name in ADAPTERS}
        head = getattr(self.base, "gan_head", None)  # a LoRA critic's head sits on the base (build_networks)
        if head is not None:
            self.trainable["critic"] |= {f"gan_head.{k}": p for k, p in head.named_parameters()}

    def describe(self) -> str:
        """The networks in words, for the run's first log line."""
        def kind(name: str) -> str:
            if name in self.copies:
                return "full copy"
            return f"LoRA rank {next(iter(adapter_params(self.base, name).values())).shape[0]}"

        head = " with a GAN head" if hasattr(self.module("critic"), "gan_head") else ""
        return f"{kind('student')}; critic: {kind('critic')}{head}"

    def module(self, name: str | None) -> nn.Module:
        """The module that computes ``name`` (None: the teacher)."""
        return self.copies.get(name, self.base)

    def use(self, name: str | None) -> None:
        """Switch to network ``name`` (None: the teacher) before its call or its backward (``use_adapter``)."""
        if name not in self.copies:
            use_adapter(self.base, name)

    def params(self, name: str) -> dict[str, nn.Parameter]:
        """``name``'s trainable parameters by their names in ``module(name)`` (under FSDP2 the shards, which the
        optimizer steps, also while a module holds its gathered parameters)."""
        return self.trainable[name]

    def reshard(self) -> None:
        """Under FSDP2, every sharded module back on its shards: the root's and the last block's parameters, which
        ``parallel._apply_fsdp`` keeps gathered from a forward to its backward, stay gathered (registered on the
        modules in place of the shards) after a forward without backward (the guided teacher's, the student's of
        a critic-only iteration). ``get_optimizer_state_dict`` reads the modules' parameters. No-op otherwise."""
        from torch.distributed.fsdp import FSDPModule

        for module in (self.base, *self.copies.values()):
            for m in module.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def optimizers(self, optimizer: str, lrs: tuple[float, float], device: torch.device) -> list:
        """The student's and the critic's optimizers (``--optimizer``, ``optim.build_optimizer``: fp32 AdamW, or
        8-bit / 4-bit / float8 moments) at learning rates ``lrs``, betas ``BETAS``, no weight decay."""
        from ditforge.optim import build_optimizer

        return [build_optimizer(list(self.params(name).values()), optimizer, lr, 0.0, device, betas=BETAS)
                for name, lr in zip(ADAPTERS, lrs)]

    def state(self, opts: list) -> dict:
        """The checkpoint's tensors (module docstring) of the networks and their optimizers ``opts``."""
        self.reshard()
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
