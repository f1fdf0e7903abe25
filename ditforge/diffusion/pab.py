"""Pyramid Attention Broadcast (PAB): reuse attention outputs across neighbouring sampling steps.

Source: Zhao, Jin, Wang, You, "Real-Time Video Generation with Pyramid Attention Broadcast" (arXiv 2408.12588);
reference implementation NUS-HPC-AI-Lab/VideoSys (``docs/pab.md``, ``videosys/core/pab_mgr.py``). Attention
outputs change little between neighbouring timesteps in the middle of the schedule (the paper's U-shaped
differences), and least for cross-attention, most for spatial attention; so inside a window of original
timesteps each kind is recomputed only every ``gap`` steps and its last output broadcast in between, with a
pyramid of gaps. Defaults: VideoSys's example configuration (``docs/pab.md``): spatial [100, 800] gap 2,
temporal [100, 800] gap 3, cross [100, 900] gap 5.

Differences from VideoSys: windows are inclusive (VideoSys: ``low < t < high``), and the gap counts steps since
this kind last computed (VideoSys: a global step counter, reuse where ``count % range != 0``).

Kinds: ``block.attn`` is "spatial" (in ``DiTBlock`` of DiT / vDiT it is full attention over all tokens; it is
treated as spatial, the most-varying kind, so it gets the smallest gap), ``block.attn_temp`` (``STDiTBlock``)
is "temporal", ``block.cross_attn`` (text models) is "cross", and ``block.mlp`` is "mlp" (VideoSys's MLP
broadcast; off in the PAB defaults: gap 1).

FORA (``PABConfig.fora(n)``): Selvaraju et al., "FORA: Fast-Forward Caching in Diffusion Transformer
Acceleration" (arXiv 2407.01425): every block's attention and MLP outputs are recomputed every ``n`` steps and
reused in between, over the whole schedule (static caching). The adaLN gates and the residual sums still use the
current step's conditioning, as in FORA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

KINDS = ("spatial", "temporal", "cross", "mlp")
_BLOCK_ATTRS = (("attn", "spatial"), ("attn_temp", "temporal"), ("cross_attn", "cross"), ("mlp", "mlp"))


@dataclass(frozen=True)
class Broadcast:
    """Window [low, high] of original (0..999) timesteps, inclusive, inside which the output is recomputed every
    ``gap`` steps (1: never reused). Raises ValueError for gap < 1 or low > high."""

    low: int
    high: int
    gap: int

    def __post_init__(self):
        if self.gap < 1 or self.low > self.high:
            raise ValueError(f"PAB broadcast needs gap >= 1 and low <= high, got low={self.low}, high={self.high}, "
                             f"gap={self.gap}")


@dataclass(frozen=True)
class PABConfig:
    """Per-kind broadcast windows and gaps; defaults from VideoSys ``docs/pab.md`` (MLPs always computed)."""

    spatial: Broadcast = Broadcast(100, 800, 2)
    temporal: Broadcast = Broadcast(100, 800, 3)
    cross: Broadcast = Broadcast(100, 900, 5)
    mlp: Broadcast = Broadcast(0, 999, 1)

    @classmethod
    def fora(cls, interval: int) -> PABConfig:
        """FORA's static caching: every kind (attention of each kind and the MLP) recomputed every ``interval``
        steps over all timesteps (FORA, arXiv 2407.01425, sec. 3.2; ``interval`` is its N). Raises ValueError for
        ``interval`` < 1."""
        every = Broadcast(0, 999, interval)
        return cls(every, every, every, every)


class PyramidAttentionBroadcast:
    """Context manager: ``with PyramidAttentionBroadcast(model, config) as pab:`` patches the forward of every
    block's attention modules (an instance attribute ``forward``, removed again on exit, so the state-dict keys and
    the module tree are unchanged). In the sampling loop call ``pab.step(t)`` with the original timestep (python
    int) before each model call; ``pab.reset()`` drops the cache (a new batch of samples, other shapes).

    A patched module, on a reuse step of its kind, returns its cached output (B', N', D) from the last computing
    step if that has the input's leading dims (B', N'), else computes; spatial inputs are (B T', S, D) in STDiT,
    (B, N, D) in DiT / vDiT, temporal (B S, T', D), cross and mlp (B, N, D). Only kinds with a gap above 1 are
    patched (and counted). Outputs are cached detached: for sampling, not training. Memory: one output per patched
    module (per call after a ``step``). Eager modules only (a compiled graph would not see the patched forwards;
    a CUDA graph captured around the whole loop does, ``samplers.LoopGraphs``). Under sequence parallelism every
    rank follows the same schedule (it depends on t only), so all skip their collectives together.

    Attributes:
        computed, reused: per kind, how many module calls computed attention / returned the cached output
            (cumulative; ``reset`` keeps them).

    Raises:
        ValueError: ``model`` has no ``blocks`` (e.g. a DDP wrapper: pass the inner module).
    """

    def __init__(self, model: nn.Module, config: PABConfig = PABConfig()):
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"PAB needs a DiT-family model with .blocks (nn.ModuleList); got {type(model).__name__}")
        self.config = config
        self.modules = [(kind, m) for block in blocks for attr, kind in _BLOCK_ATTRS
                        if getattr(config, kind).gap > 1 and isinstance(m := getattr(block, attr, None), nn.Module)]
        self.computed = dict.fromkeys(KINDS, 0)
        self.reused = dict.fromkeys(KINDS, 0)
        self._saved: list[tuple[nn.Module, object]] = []
        self.reset()

    def reset(self) -> None:
        """Drop every cached output; the next step computes every kind."""
        self._cache: dict[tuple[int, int], torch.Tensor] = {}  # (id(module), call index in the step) -> output
        self._filled = dict.fromkeys(KINDS, False)  # a kind has stored outputs since the last reset
        self._since = dict.fromkeys(KINDS, 0)  # steps since the kind last computed
        self._reuse = dict.fromkeys(KINDS, False)
        self._calls: dict[int, int] | None = None  # per module, calls since the last step; None: no step yet

    def step(self, timestep: int) -> None:
        """Decide, for the model call(s) that follow, which kinds reuse: inside the kind's window, with a cache, and
        fewer than ``gap`` steps since it last computed. Host-only (``timestep`` is a python int)."""
        t = int(timestep)
        for kind in KINDS:
            b: Broadcast = getattr(self.config, kind)
            reuse = b.low <= t <= b.high and self._filled[kind] and self._since[kind] < b.gap
            self._reuse[kind] = reuse
            self._since[kind] = self._since[kind] + 1 if reuse else 1
        # Calls are numbered within a step so that a loop calling the model twice per step (e.g. conditional and
        # unconditional passes apart) gets each call's own output back, not the last one's.
        self._calls = {}

    def _patched(self, kind: str, module: nn.Module, original):
        def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if self._calls is None:  # before the first step: plain attention, nothing cached (no unbounded cache)
                self.computed[kind] += 1
                return original(x, *args, **kwargs)
            index = self._calls.get(id(module), 0)
            self._calls[id(module)] = index + 1
            key = (id(module), index)
            cached = self._cache.get(key)
            if self._reuse[kind] and cached is not None and cached.shape[:-1] == x.shape[:-1]:
                self.reused[kind] += 1
                return cached  # the same tensor each reuse: the blocks only read attention outputs, never in place
            out = original(x, *args, **kwargs)
            self._cache[key] = out.detach()
            self._filled[kind] = True
            self.computed[kind] += 1
            return out

        return forward

    def __enter__(self) -> PyramidAttentionBroadcast:
        if self._saved:
            raise RuntimeError("this PyramidAttentionBroadcast is already active")
        for kind, module in self.modules:
            self._saved.append((module, module.__dict__.get("forward")))  # an instance forward someone else set
            module.forward = self._patched(kind, module, module.forward)
        return self

    def __exit__(self, *exc) -> None:
        for module, previous in reversed(self._saved):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._saved = []
        self.reset()  # free the cached activations
