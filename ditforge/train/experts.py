"""Both experts of a two-expert pipeline trained in one run (``--expert both``, the default for such a pipeline).

The rule, one expert a step (musubi-tuner's, given both models; ai-toolkit's two-transformer wrapper switches
every few steps instead): each step draws one time from the run's whole training-time
density, on a host generator seeded by (seed, data position) alone, so the draw is the same on every rank and
after a resume, and costs no device sync. The side of the pipeline's boundary it falls on (at and above: the first
expert, below: the second) picks the expert the step trains, and the global batch's times are drawn from the density
restricted to that side, from the step's own generator, exactly as a run of that expert alone (``--expert
high_noise | low_noise``) draws them at that position: the same batch, times, noise and loss (the mean over the
global batch). Over the run a sample's time so follows the whole density, and each expert learns only its side.
The idle expert gets no gradient: the optimizer steps only parameters with one, so its weights and optimizer state
stay as they are; the EMA follows every trainable weight each step, as it does for any weight a step leaves alone.

Offload: where ``--gpu_memory_budget`` is given, or the two experts' weights take more than half of the GPU, the
idle expert's frozen weights (the whole base of a LoRA run) wait in (pinned) host memory, and a switch of sides
brings the active one's in: one host-to-device copy of its frozen weights a switch (the host keeps their copy, so
parking one costs no transfer). Trainable weights, their optimizer state and EMA stay on the device. Not under
``--plugin zero2 | fsdp``: each process holds a shard of both experts, whose storage FSDP2 owns
(``parallel._apply_fsdp``: an expert's units are gathered for its calls alone, so the idle one's never are).
``--blocks_to_swap``'s blocks (each expert's last N, ``parallel.offload.swap_blocks``) are BlockSwap's alone to
move (``keep_out``).

Data and sequence parallelism (``--plugin ddp | zero2 | fsdp``, ``--sequence_parallel_size``): the side is a
function of (seed, position) alone, never of the rank, so every process trains the same expert each step and enters
the same collectives (DDP's all-reduce of that expert's gradients, FSDP2's gathers and reduce-scatters of its units,
the exchanges of the split tokens, which ``parallel.context`` sets up in both experts).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from ditforge.data.sampler import derive_seed
from ditforge.diffusion.objective import Objective
from ditforge.errors import UserError

log = logging.getLogger(__name__)

EXPERT_STREAM = 6007  # the key that sets the side draws' seeds apart from every other stream's


def refuse_unsupported(cfg) -> None:
    """The settings ``--expert both`` does not run with yet, one line each.

    Raises:
        UserError: a plugin other than none, ddp, zero2 or fsdp (hsdp), tensor parallelism, CPU offload, the
            fused backward pass, or a trained text encoder.
    """
    t, m, par = cfg.train, cfg.model, cfg.parallel
    refused = [(par.plugin == "hsdp", "--plugin hsdp (none, ddp, zero2 or fsdp)"),
               (par.tensor_parallel > 1, f"--tensor_parallel {par.tensor_parallel}"),
               (t.cpu_offload != "none", f"--cpu_offload {t.cpu_offload}"),
               (t.fused_backward_pass, "--fused_backward_pass"), (m.train_text_encoder, "--train_text_encoder")]
    for bad, what in refused:
        if bad:
            raise UserError(f"--expert both: not with {what}; train one expert a run (--expert high_noise, then "
                            "--expert low_noise from its export)")


class TwoExperts:
    """The two experts' switch: which one a step trains (``side``), with its objective, and where the idle one's
    frozen weights are (``place``, ``activate``).

    Args:
        denoiser: the adapter holding both experts (``DiffusersDenoiser.add_expert``); ``expert`` 0 runs the first.
        full: the objective over the whole time range (the side draw's density).
        sides: the objectives of the first expert's side and of the second's (``t_range`` [boundary, 1), [0,
            boundary)).
        boundary: the boundary in times t in (0, 1) (the adapter's ``expert_boundary``).
    """

    def __init__(self, denoiser: nn.Module, full: Objective, sides: tuple[Objective, Objective], boundary: float):
        self.denoiser, self.full, self.sides, self.boundary = denoiser, full, sides, float(boundary)
        self.offload = False
        self.device: torch.device | None = None
        self.host: dict[nn.Parameter, torch.Tensor] = {}  # frozen weights' host copies (they never change)
        self.kept_out: set[nn.Parameter] = set()  # frozen weights another placement moves (keep_out)
        self.active = 0

    def side(self, seed: int, position: int) -> int:
        """The expert of data position ``position``: 0 where one time drawn from ``full`` on the host generator of
        ``derive_seed(seed, EXPERT_STREAM, position)`` is at or above the boundary, else 1."""
        g = torch.Generator().manual_seed(derive_seed(seed, EXPERT_STREAM, position))
        return 0 if float(self.full.sample_timesteps(1, g, torch.device("cpu"))[0]) >= self.boundary else 1

    def _frozen(self, index: int) -> list[nn.Parameter]:
        """Expert ``index``'s frozen weights that the switch parks and brings (``kept_out`` left to their own)."""
        return [p for p in self.denoiser.expert_models()[index].parameters()
                if not p.requires_grad and p not in self.kept_out]

    def keep_out(self, params) -> None:
        """Leave the frozen weights ``params`` to another placement: ``--blocks_to_swap``'s swapped blocks, whose
        ``parallel.offload.BlockSwap`` keeps them in host memory whichever expert is active and points each block's
        at a device copy for its forward alone. Parked by the switch they would be parked already (on the host);
        brought, each would get a second, whole-block device copy that lives until BlockSwap's next hook points the
        weight back at its own host tensor: the transfer and memory that the swap exists to save."""
        self.kept_out.update(params)

    def place(self, device: torch.device, budget: int | None, sharded: bool = False) -> None:
        """The build's move to ``device``: every weight but, when offloading, the second expert's frozen ones,
        which stay in host memory. Offloads under a memory ``budget``, or on a GPU where the experts' weights take
        more than half of its memory; never when the experts are to be ``sharded`` (FSDP2 owns the storage of its
        shards: module docstring), and then moves nothing: ``fully_shard`` moves each unit's weights to the device
        as it shards them, so the second expert, loaded in host memory, is never whole on the GPU (a 14B expert
        takes 56 GB in fp32: two do not fit an 80 GB GPU)."""
        weights = sum(p.numel() * p.element_size() for p in self.denoiser.parameters())
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
        self.offload = device.type != "cpu" and not sharded and (budget is not None or weights > total / 2)
        self.device = device
        if sharded:
            return
        idle = set(self._frozen(1)) if self.offload else set()
        for p in self.denoiser.parameters():
            p.data = p.data.to("cpu" if p in idle else device)
        for b in self.denoiser.buffers():
            b.data = b.data.to(device)
        if self.offload:
            log.info("--expert both: the idle expert's %.2f GiB of frozen weights wait in host memory",
                     sum(p.numel() * p.element_size() for p in self._frozen(1)) / 2**30)

    # Host copies are made in the loop only, after the build has cast the frozen weights (a bf16 base); from then on
    # they never change, so a parked expert's weights are its host copy, with no copy back.
    def _park(self, index: int) -> None:
        for p in self._frozen(index):
            if p.device.type != "cpu":
                if p not in self.host:  # an expert on the device since the build: copied once
                    self.host[p] = self._pinned(p.data)
                p.data = self.host[p]

    def _bring(self, index: int) -> None:
        for p in self._frozen(index):
            if p.device.type == "cpu":
                self.host[p] = p.data if p.data.is_pinned() else self._pinned(p.data)
                p.data = self.host[p].to(self.device, non_blocking=True)

    @staticmethod
    def _pinned(t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` in host memory, page-locked (an asynchronous copy to the GPU)."""
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True).copy_(t)

    @contextlib.contextmanager
    def both_on(self):
        """Both experts' frozen weights on the device for the block (a pipeline call that runs both: the
        validation samples), the idle one's parked again after it when offloading."""
        idle = 1 - self.active
        if self.offload:
            self._bring(idle)
        try:
            yield
        finally:
            if self.offload:
                self._park(idle)

    def activate(self, seed: int, position: int) -> Objective:
        """Data position ``position``'s expert made the one that runs (its frozen weights brought to the device,
        the other's parked, when offloading); returns its side's objective, which the step draws its times from."""
        side = self.side(seed, position)
        if side != self.active and self.offload:
            self._park(self.active)
            self._bring(side)
        self.active = self.denoiser.expert = side
        return self.sides[side]
