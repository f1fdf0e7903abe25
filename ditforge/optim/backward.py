"""``StepInBackward``: the optimizer step fused into the backward, a block at a time
(``--fused_backward_pass``)."""

from __future__ import annotations

import torch
from torch import nn

from ditforge.optim.compensated import CompensatedAdamW
from ditforge.parallel import clip_coefficient


class StepInBackward:
    """The optimizer step fused into the backward, a block at a time: as soon as the last gradient of a block
    (``ditforge.models.block_paths``) has accumulated,
    that block takes its AdamW step (``CompensatedAdamW.update``: one multi-tensor pass over the block) and its
    gradients are freed; the parameters outside the blocks (a UNet's projections and samplers, a DiT's final
    layer) step with the block before them in module order, the embedders before the first block as one last
    group. Gradients then never exist for the whole model at once. The technique of PyTorch's
    tutorial "How to save memory by fusing the optimizer step into the backward pass" and kohya-ss'
    ``--fused_backward_pass``, which step each parameter from its own hook; here a block is one step.

    Clipping (``max_grad_norm`` > 0): a block steps before the later blocks' gradients, hence the global norm,
    exist, so step k's gradients are scaled by min(1, max_grad_norm / (n_{k-1} + 1e-6)), n_{k-1} the global
    norm of step k-1's gradients before clipping; step 0 is not clipped. ``finish`` returns step k's norm.

    Skipping (``arm(found_inf)``): each block's update takes the device flag as the optimizer's ``found_inf``,
    so a step whose loss is already known to be non-finite when the backward starts changes nothing (weights,
    states, step counters, the clipping norm carried to the next step) with no host sync. A gradient that turns
    non-finite during the backward of a finite loss is found only in ``finish``'s norm, after the blocks before
    it (in the backward's order) have stepped: the flag must exist before the first hook runs, and a block's
    update cannot be taken back once later blocks' gradients show the fault without keeping a copy of every
    block's weights and states, the memory this pass exists to save.

    Use: ``arm()`` before the backward of a step's last micro-batch (earlier micro-batches accumulate as
    usual), ``finish()`` after it. One process only: DDP and FSDP reduce gradients after the hooks would step.

    Args:
        model: the model (its trainable parameters are all the optimizer's).
        optimizer: the ``CompensatedAdamW`` over them.
        max_grad_norm: the clipping threshold (<= 0: no clipping).
        before_update: called once per step before the first block's update (an async checkpoint's staging
            must finish before the weights change, as an optimizer step pre-hook does for ``step``).
    """

    def __init__(self, model: nn.Module, optimizer: CompensatedAdamW, max_grad_norm: float,
                 before_update=None):
        from ditforge.models import block_paths

        seen: set[nn.Parameter] = set()
        self.groups: list[list[nn.Parameter]] = []
        index = {}
        for path in block_paths(model):
            group = [p for p in model.get_submodule(path).parameters() if p.requires_grad and p not in seen]
            seen.update(group)
            index[path] = len(self.groups)
            self.groups.append(group)
        # Outside the blocks, a module's own parameters join the block before it in module (forward) order, which
        # the backward reaches next: their gradients wait one block, and a step has one update per block, not
        # one per projection or norm (each update costs the host ~1 ms of launches). Before the first block
        # (embedders, a UNet's conv_in), whose gradients come last: one more group.
        current, first = None, []
        for name, module in model.named_modules():
            if name in index:
                current = index[name]
                continue
            own = [p for p in module.parameters(recurse=False) if p.requires_grad and p not in seen]
            seen.update(own)
            (first if current is None else self.groups[current]).extend(own)
        self.groups = [g for g in [*self.groups, first] if g]
        self.optimizer, self.max_grad_norm, self.before_update = optimizer, max_grad_norm, before_update
        self.prev_norm: torch.Tensor | None = None
        self.armed = False
        for k, group in enumerate(self.groups):
            for p in group:
                p.register_post_accumulate_grad_hook(lambda p, k=k: self._arrived(k))

    def state_dict(self) -> dict:
        """The previous step's gradient norm (it clips the next step): a float, for a checkpoint's meta."""
        return {"prev_grad_norm": None if self.prev_norm is None else float(self.prev_norm)}

    def load_state_dict(self, state: dict) -> None:
        norm = state.get("prev_grad_norm")
        self.prev_norm = None if norm is None else torch.tensor(norm)

    def arm(self, found_inf: torch.Tensor | None = None) -> None:
        """The next backward completes a step: update each block as its gradients arrive, skipped where
        ``found_inf`` (0-dim float on the device) is non-zero."""
        self.armed, self.started, self.found_inf = True, False, found_inf
        self.arrived = [0] * len(self.groups)
        self.norms: list[torch.Tensor] = []  # per gradient its L2 norm (0-dim, the gradient's dtype)
        self.scale = None
        if self.max_grad_norm > 0 and self.prev_norm is not None:
            self.scale = clip_coefficient(self.prev_norm, self.max_grad_norm)

    def _arrived(self, k: int) -> None:
        if not self.armed:
            return
        self.arrived[k] += 1
        if self.arrived[k] == len(self.groups[k]):
            self._update(self.groups[k])

    @torch.no_grad()
    def _update(self, group: list[nn.Parameter]) -> None:
        params = [p for p in group if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        if not self.started:
            self.started = True
            if self.before_update is not None:
                self.before_update()
            self.optimizer.advance()
            if self.scale is not None:
                self.scale = self.scale.to(grads[0].device)
            self.optimizer.clip_coef, self.optimizer.found_inf = self.scale, self.found_inf  # read on the device
        self.norms.extend(torch._foreach_norm(grads, 2.0))  # one launch per block; summed in finish
        self.optimizer.update(params)
        for p in params:
            p.grad = None

    def finish(self) -> torch.Tensor:
        """Update what no hook completed (a block with a parameter that got no gradient this step) and return
        the step's global gradient norm before clipping (0-dim fp32)."""
        for group in self.groups:
            self._update(group)
        self.armed = False
        self.optimizer.clip_coef = self.optimizer.found_inf = None
        norm = torch.stack(self.norms).float().pow(2).sum().sqrt() if self.norms else torch.zeros(())
        if self.found_inf is None:
            self.prev_norm = norm
        else:  # a skipped step keeps the norm that clips the next one (none yet: 0, which clips by exactly 1)
            prev = torch.zeros((), device=norm.device) if self.prev_norm is None else self.prev_norm.to(norm.device)
            self.prev_norm = torch.where(self.found_inf.to(norm.device) != 0, prev, norm)
        return norm
