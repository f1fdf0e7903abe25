"""Ancestral DDPM and DDIM sampling loops with classifier-free guidance, diffusers' DPM-Solver++ and Euler
solvers on DiT's schedule, and ``generate`` (noise -> samples).

Sources: Ho et al. 2020 (ancestral sampling, Algorithm 2), Song et al. 2021 ("DDIM", eq. 12 with eta),
Ho & Salimans 2022 (classifier-free guidance); loops as in guided-diffusion's ``p_sample_loop`` and
``ddim_sample_loop``; ``generate`` as facebookresearch/DiT ``sample.py`` (respaced diffusion, 2B guided batch). ``"dpm++"``
(Lu et al. 2022, DPM-Solver++ 2M) and ``"euler"`` (Karras et al. 2022, Euler on the sigma ODE) are diffusers'
``DPMSolverMultistepScheduler`` / ``EulerDiscreteScheduler``, driven as diffusers' pipelines drive them.
``LoopGraphs`` replays a whole loop of our samplers as one CUDA graph. No I/O here: writing files is
``ditforge.sample``'s job.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ditforge.diffusion.dmd import student_loop, student_times
from ditforge.diffusion.flow import RectifiedFlow, euler_loop
from ditforge.diffusion.gaussian import GaussianDiffusion, ModelFn, create_diffusion
from ditforge.diffusion.pab import PABConfig, PyramidAttentionBroadcast
from ditforge.errors import UserError
from ditforge.parallel.collectives import all_gather_single

OWN_SAMPLERS = ("ddpm", "ddim")
DIFFUSERS_SAMPLERS = ("dpm++", "euler")
STUDENT_SAMPLER = "student"  # a distilled few-step student's own loop (``dmd.student_loop``)
SAMPLERS = OWN_SAMPLERS + DIFFUSERS_SAMPLERS + (STUDENT_SAMPLER,)

Generators = torch.Generator | Sequence[torch.Generator] | None
# The most memory one loop's adaLN tables may take (GuidedModel.plan): DiT-XL/2, DDIM 50 at batch 8 under
# guidance needs 313 MB in bf16; a larger loop computes its regressions step by step instead.
ADALN_TABLE_BYTES = 1 << 30


def randn_like_rows(x: torch.Tensor, generator: Generators) -> torch.Tensor:
    """Standard normal noise shaped like ``x`` (same dtype, device): from one generator (None: the global RNG),
    or, given a sequence of B generators, row i from ``generator[i]`` (as diffusers' ``randn_tensor``), so a
    row's noise does not depend on the other rows."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    if len(generator) != x.shape[0]:
        raise ValueError(f"{len(generator)} generators for {x.shape[0]} rows")
    return torch.cat([torch.randn((1, *x.shape[1:]), generator=g, device=x.device, dtype=x.dtype)
                      for g in generator])


def diffusers_scheduler(sampler: str, num_train_timesteps: int = 1000, prediction_type: str = "epsilon"):
    """diffusers' scheduler for ``sampler`` on DiT's training schedule.

    Both: ``num_train_timesteps`` linear betas 1e-4..0.02 (``beta_schedule="linear"``, as ``linear_betas``),
    ``prediction_type`` (epsilon, or v_prediction), ``timestep_spacing="trailing"`` (integer timesteps from T - 1 down with an even stride,
    so the model only sees timesteps it was trained on; Lin et al. 2024). ``"dpm++"``:
    ``DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2)`` (second-order multistep,
    first order on the last steps as diffusers' default ``lower_order_final``); ``"euler"``:
    ``EulerDiscreteScheduler`` (no churn: deterministic).

    Raises:
        UserError: diffusers is not installed (naming ``--sampler``).
        ValueError: ``sampler`` is not one of ``DIFFUSERS_SAMPLERS``.
    """
    if sampler not in DIFFUSERS_SAMPLERS:
        raise ValueError(f"not a diffusers sampler: {sampler!r}; expected one of {DIFFUSERS_SAMPLERS}")
    try:
        from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler
    except ImportError as e:
        raise UserError(f"--sampler {sampler}: needs diffusers (pip install diffusers), which cannot be imported "
                        f"({e}); --sampler ddpm and ddim work without it") from None
    common = dict(num_train_timesteps=num_train_timesteps, beta_start=1e-4, beta_end=0.02, beta_schedule="linear",
                  prediction_type=prediction_type, timestep_spacing="trailing")
    if sampler == "dpm++":
        return DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2, **common)
    return EulerDiscreteScheduler(**common)


@torch.no_grad()
def solver_loop(
    model_fn: ModelFn,
    noise: torch.Tensor,
    sampler: str,
    num_steps: int,
    generator: Generators = None,
    progress: bool = False,
    desc: str | None = None,
    callback=None,
    on_step: Callable[[int], None] | None = None,
    prediction_type: str = "epsilon",
) -> torch.Tensor:
    """Run a diffusers solver (``"dpm++"`` or ``"euler"``) from ``noise`` to x_0, as diffusers' pipelines do.

    ``set_timesteps(num_steps)``; x = noise * ``init_noise_sigma`` (1 for DPM-Solver++, sqrt(sigma_max^2 + 1)
    for Euler); per timestep t: eps = the first C channels of ``model_fn(scale_model_input(x, t), t)`` (learned
    variance channels are dropped, as ``DiTPipeline`` does), x = ``step(eps, t, x, generator=...)``. Host syncs:
    only those inside the schedulers (``set_begin_index(0)`` spares the step-index lookup).

    Args:
        model_fn: (x (B, C, ...), t (B,) int64 original timesteps) -> (B, C or 2C, ...) (see ``GuidedModel``); one
            with a ``plan`` method gets the loop's timesteps first (``GuidedModel.plan``).
        noise: (B, C, ...) float starting noise N(0, I) (unscaled).
        sampler: ``"dpm++"`` or ``"euler"``.
        num_steps: solver steps (model calls), 1..1000.
        generator: passed to ``step`` (Euler draws its unused churn noise from it; DPM-Solver++ draws nothing);
            a sequence of B generators gives each row its own.
        callback: called as ``callback(i, t, x)`` after step i with the new x (tests compare intermediates).
        on_step: called with each step's timestep (host int) before its model call (default: ``model_fn.step``
            when it has one, e.g. ``GuidedModel``).
        prediction_type: the scheduler's (``epsilon`` or ``v_prediction``): what the model's first C channels are.

    Returns:
        (B, C, ...) samples in ``noise``'s dtype.

    Raises:
        UserError: diffusers missing. ValueError: unknown sampler.
    """
    sched = diffusers_scheduler(sampler, prediction_type=prediction_type)
    sched.set_timesteps(num_steps, device=noise.device)
    sched.set_begin_index(0)
    x = noise * sched.init_noise_sigma
    c = noise.shape[1]
    gen = generator if generator is None or isinstance(generator, torch.Generator) else list(generator)
    host_timesteps = sched.timesteps.tolist()  # one copy before the loop, none inside it
    on_step = on_step if on_step is not None else getattr(model_fn, "step", None)
    if hasattr(model_fn, "plan"):  # the values the loop passes below, one per step
        model_fn.plan(sched.timesteps.to(torch.long))
    for i, t in enumerate(tqdm(sched.timesteps, desc=desc or f"{sampler} sampling", disable=not progress,
                               leave=False)):
        if on_step is not None:
            on_step(round(host_timesteps[i]))
        t_model = t.to(torch.long).expand(x.shape[0])  # trailing spacing: integer-valued (Euler keeps floats)
        out = model_fn(sched.scale_model_input(x, t), t_model)
        x = sched.step(out[:, :c], t, x, generator=gen, return_dict=False)[0]
        if callback is not None:
            callback(i, t, x)
    return x.to(noise.dtype)


class GuidedModel:
    """A conditional model as ``(x, t) -> output`` with classifier-free guidance.

    The conditional and unconditional passes run as one batch of 2B: ``model(cat[x, x], cat[t, t], cat[y, y],
    force_drop_ids=cat[False * B, True * B], y_mask=cat[y_mask, y_mask])``. The unconditional half is the same
    condition with every row dropped, i.e. what the model learnt under label / caption dropout: for class
    models the null label ``num_classes`` (exactly the official DiT ``forward_with_cfg`` input ``y_null``), for
    text models the learned null caption. On the epsilon channels
    ``eps = eps_uncond + cfg_scale * (eps_cond - eps_uncond)`` (Ho & Salimans 2022, eq. 6), computed in at least
    float32 whatever the model's dtype; the learned-variance channels come from the conditional pass.
    ``cfg_scale == 1`` runs the conditional model alone (B rows, no ``force_drop_ids``).

    Guidance interval (Kynkaanniemi et al. 2024, "Applying Guidance in a Limited Interval Improves Sample and
    Distribution Quality in Diffusion Models"): with ``cfg_interval = (low, high)`` the guided 2B batch runs
    only at original timesteps low <= t <= high; at the others the conditional model runs alone (B rows, half
    the compute). The sampling loop announces each step's timestep with ``step(t)`` before the call.

    CFG parallelism (``cfg_group``, a process group of 2): process 0 of the group runs the conditional half, process
    1 the unconditional one, B rows each, and the halves are all-gathered before they are combined; both
    processes then hold the same guided output (the loop around runs identically on both).

    adaLN tables (``plan``): a loop that knows its timesteps up front (ours and the diffusers solvers') announces
    them, and every adaLN regression of the whole loop is computed at once (``DiT.adaln_tables``: one matrix
    product per layer over all steps' rows, which reads the regression weights once instead of once per step);
    each call then takes its step's rows.

    Args:
        model: ``model(x, t, y, force_drop_ids=None, y_mask=None)`` -> (B, C_out, ...) (``DiT.forward``);
            ``y_mask`` is passed only when given, so class models need not accept it.
        y: (B,) int64 labels, or (B, L, D_text) text-encoder states.
        cfg_scale: guidance scale s (1: no guidance; 0: the unconditional model).
        y_mask: (B, L) bool caption mask of text states; None for labels.
        guidance_channels: guide only the first k channels; ``None`` guides all eps channels (C = input
            channels). The official DiT sampler guides 3 of 4 latent channels; pass 3 to reproduce it.
        cfg_interval: (low, high) original timesteps (0..999, inclusive) where guidance applies; None: all.
        cfg_group: a 2-process group to split the guided batch over (see above); None: one 2B call.

    Call: ``fn(x (B, C, ...) float, t (B,) int64) -> (B, C_out, ...)`` in the model's output dtype promoted to at
    least float32.

    Raises:
        TypeError: ``y_mask`` neither a tensor nor None.
        ValueError: ``cfg_interval`` not 0 <= low <= high <= 999; a ``cfg_group`` not of 2 processes;
            ``guidance_channels`` < 1 (or, at the call, above C).
    """

    def __init__(self, model: torch.nn.Module, y: torch.Tensor, cfg_scale: float, y_mask: torch.Tensor | None = None,
                 guidance_channels: int | None = None, cfg_interval: tuple[int, int] | None = None,
                 cfg_group: dist.ProcessGroup | None = None):
        if y_mask is not None and not isinstance(y_mask, torch.Tensor):
            raise TypeError(f"y_mask must be a (B, L) bool tensor or None, got {type(y_mask).__name__}")
        if cfg_interval is not None and not 0 <= cfg_interval[0] <= cfg_interval[1] <= 999:
            raise ValueError(f"cfg_interval must be (low, high) with 0 <= low <= high <= 999, got {cfg_interval}")
        if guidance_channels is not None and guidance_channels < 1:
            raise ValueError(f"guidance_channels must be positive, got {guidance_channels}")
        if cfg_interval is not None and tuple(cfg_interval) == (0, 999):
            cfg_interval = None  # guidance at every step: exactly the plain path (adaLN tables included)
        self.model, self.y = model, y
        self.cfg_scale, self.guidance_channels, self.cfg_interval = cfg_scale, guidance_channels, cfg_interval
        self.guided, self.cfg_group = cfg_scale != 1.0, cfg_group
        if cfg_group is not None and dist.get_world_size(cfg_group) != 2:
            raise ValueError(f"cfg_group must hold 2 processes, got {dist.get_world_size(cfg_group)}")
        self.cond_kwargs = {} if y_mask is None else {"y_mask": y_mask}
        if self.guided and cfg_group is None:
            b = y.shape[0]
            self.guided_kwargs = {"force_drop_ids": torch.arange(2 * b, device=y.device) >= b}  # True: uncond half
            if y_mask is not None:
                self.guided_kwargs["y_mask"] = torch.cat([y_mask, y_mask])
            self.y2 = torch.cat([y, y])
        elif self.guided:  # this process's half: rank 1 of the group drops every condition
            drop = torch.full((y.shape[0],), dist.get_rank(cfg_group) == 1, device=y.device)
            self.guided_kwargs = {"force_drop_ids": drop, **self.cond_kwargs}
            self.y2 = y
        self._tables: list[torch.Tensor] | None = None
        self._next = 0

    def plan(self, timesteps: torch.Tensor) -> None:
        """Announce the model timesteps of the calls to come, (S,) in call order on ``y``'s device (as the loop will
        pass them, one value per call), so that their adaLN regressions are computed now (see the class
        docstring). Planned calls must then come exactly once per step, in that order. Nothing is planned (each
        call computes its own) for a model without ``adaln_tables`` (``_adaln_model``), under a guidance interval
        or a CFG group (the rows of a call are not fixed in advance), or when the tables would take more than
        ``ADALN_TABLE_BYTES``."""
        self._tables, self._next = None, 0
        model = _adaln_model(self.model)
        if model is None or self.cfg_interval is not None or self.cfg_group is not None:
            return
        y, kwargs = (self.y2, self.guided_kwargs) if self.guided else (self.y, self.cond_kwargs)
        t = timesteps.reshape(-1, 1).expand(-1, y.shape[0])
        self._tables = model.adaln_tables(t, y, max_bytes=ADALN_TABLE_BYTES, **kwargs)

    def step(self, timestep: int) -> None:
        """The original timestep of the next call (host int: deciding needs no device sync)."""
        low, high = self.cfg_interval or (0, 999)
        self.guided = self.cfg_scale != 1.0 and low <= timestep <= high

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        adaln = {}
        if self._tables is not None:
            if self._next == len(self._tables[0]):
                raise RuntimeError(f"GuidedModel: called more often than the {self._next} planned steps")
            adaln = {"adaln": [table[self._next] for table in self._tables]}
            self._next += 1
        if not self.guided:
            out = self.model(x, t, self.y, **self.cond_kwargs, **adaln)
            return out.to(torch.promote_types(out.dtype, torch.float32))
        if self.cfg_group is None:
            out = self.model(torch.cat([x, x]), torch.cat([t, t]), self.y2, **self.guided_kwargs, **adaln)
        else:
            half = self.model(x, t, self.y2, **self.guided_kwargs).contiguous()
            out = half.new_empty((2 * half.shape[0], *half.shape[1:]))  # [cond; uncond]: group-rank order
            all_gather_single(out, half, self.cfg_group)
        cond, uncond = out.to(torch.promote_types(out.dtype, torch.float32)).chunk(2)
        k = x.shape[1] if self.guidance_channels is None else self.guidance_channels
        if k > x.shape[1]:  # the channels beyond C are the learned variance's, never guided
            raise ValueError(f"guidance_channels {k} exceeds the model's {x.shape[1]} input channels")
        guided = uncond[:, :k] + self.cfg_scale * (cond[:, :k] - uncond[:, :k])
        return torch.cat([guided, cond[:, k:]], dim=1)


def _adaln_model(model) -> torch.nn.Module | None:
    """The DiT-family module that ``model`` runs (itself, a ``torch.compile`` wrapper's or ``CompiledModel``'s) when
    it offers ``adaln_tables`` and holds whole weights (sharded ones are gathered only inside its forward); else
    None."""
    from torch.distributed.tensor import DTensor

    module = getattr(model, "eager", model)
    module = getattr(module, "_orig_mod", module)
    if not hasattr(module, "adaln_tables") or any(isinstance(p, DTensor) for p in module.parameters()):
        return None
    return module


def draws_noise(sampler: str, eta: float) -> bool:
    """Whether ``sample_loop`` draws noise at each step: ancestral DDPM, or DDIM with ``eta`` > 0."""
    return sampler == "ddpm" or eta > 0


@torch.no_grad()
def sample_loop(
    diffusion: GaussianDiffusion,
    model_fn: ModelFn,
    noise: torch.Tensor,
    sampler: str = "ddpm",
    eta: float = 0.0,
    clip_denoised: bool = False,
    generator: Generators = None,
    progress: bool = False,
    desc: str | None = None,
    on_step: Callable[[int], None] | None = None,
    step_noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the reverse process from x_T = ``noise`` down to x_0.

    Args:
        diffusion: the (usually respaced) process; its steps are the sampling steps.
        model_fn: (x_t, original timesteps) -> model output (see ``GuidedModel``); one with a ``plan`` method gets
            the loop's timesteps first (``GuidedModel.plan``).
        noise: (B, C, ...) starting noise, float32.
        sampler: ``"ddpm"`` (ancestral, learned or fixed variance) or ``"ddim"`` (``eta`` = 0 is deterministic).
        generator: source of the per-step noise (drawn only where used: DDPM, DDIM with ``eta`` > 0); same
            generator state, same samples. A sequence of B generators draws row i's noise from the i-th.
        progress: show a tqdm bar over the steps (on stderr); ``desc`` labels it (default "<sampler> sampling").
        on_step: called with each step's original timestep (host int) before its model call (default:
            ``model_fn.step`` when it has one, e.g. ``GuidedModel``'s guidance interval).
        step_noise: (S, B, C, ...) the S steps' noise drawn beforehand, step k's as the loop would draw it
            (``randn_like_rows(noise, generator)`` S times), used instead of drawing: the same samples, and a
            loop that draws nothing can be captured as a CUDA graph (``LoopGraphs``).

    No host syncs inside the loop: the schedule tables are moved to ``noise``'s device first
    (``diffusion.to``, in place) and per-step coefficients are indexed there.

    Returns:
        (B, C, ...) float32 samples.

    Raises:
        ValueError: unknown sampler (the diffusers solvers run in ``solver_loop``).
    """
    if sampler not in OWN_SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; expected one of {OWN_SAMPLERS}")
    noisy = draws_noise(sampler, eta)
    diffusion.to(noise.device)
    on_step = on_step if on_step is not None else getattr(model_fn, "step", None)
    x = noise
    steps = range(diffusion.num_timesteps - 1, -1, -1)
    if hasattr(model_fn, "plan"):  # on the device: nothing here copies from the host (capturable)
        model_fn.plan(diffusion.model_timesteps(torch.arange(diffusion.num_timesteps - 1, -1, -1, device=x.device)))
    for i in tqdm(steps, desc=desc or f"{sampler} sampling", disable=not progress, leave=False):
        if on_step is not None:
            on_step(diffusion.original_timesteps[i])
        t = torch.full((x.shape[0],), i, dtype=torch.long, device=x.device)
        out = diffusion.p_mean_variance(model_fn(x, diffusion.model_timesteps(t)), x, t, clip_denoised)
        z = None if not noisy else (randn_like_rows(x, generator) if step_noise is None
                                    else step_noise[diffusion.num_timesteps - 1 - i]).double()
        if sampler == "ddpm":
            x_prev = out.mean + (i > 0) * torch.exp(0.5 * out.log_variance) * z
        else:
            abar = diffusion.alphas_cumprod[i]
            abar_prev = diffusion.alphas_cumprod_prev[i]
            sigma = eta * ((1 - abar_prev) / (1 - abar)).sqrt() * (1 - abar / abar_prev).sqrt()
            eps = diffusion.predict_eps_from_xstart(x, t, out.pred_xstart)
            x_prev = out.pred_xstart * abar_prev.sqrt() + (1 - abar_prev - sigma**2).sqrt() * eps
            if noisy:
                x_prev = x_prev + (i > 0) * sigma * z
        x = x_prev.to(noise.dtype)
    return x


class LoopGraphs:
    """Whole sampling loops captured as CUDA graphs, one per loop setting, replayed for every batch.

    A loop of our samplers (DDPM, DDIM; Euler on a flow) without a guidance interval or CFG group does the same
    host work at every call: its timesteps, coefficients, guidance and PAB / FORA reuse pattern are fixed by its
    settings, and its random noise can be drawn before it (``sample_loop``'s ``step_noise``). So the whole
    loop, every step's model call, guidance and update, is captured once (``torch.cuda.graph``) and replayed: the
    GPU runs all steps back to back with no host work or launch gaps between them. (A model compiled with
    torch.compile's own CUDA graphs replays one graph per model call, and the guidance and update kernels in
    between are launched from Python: a DiT-XL/2 DDIM-50 call at batch 1 took 0.13 s that way and 0.113 s as one
    graph, H100, 2026-11-25.)

    The first call with a key runs the loop once eagerly on a side stream (torch.compile compiles there, kernels
    autotune, lazy state is created: what the capture must not do), then captures it. Later calls copy their
    inputs into the graph's static buffers, replay, and return a copy of the output. Every graph shares one memory
    pool; they never run concurrently and each output is copied before the next replay, so that is safe. A graph
    reads tensors made before its capture (the schedule tables, the model's weights and cached position
    embeddings), so the entry keeps the loop (and with it the schedule) alive.

    Args:
        model: what runs inside the captures: a CUDA module without CUDA graphs of its own (eager, or
            ``torch.compile`` without ``mode="reduce-overhead"``).
    """

    def __init__(self, model: Callable[..., torch.Tensor]):
        self.model = model
        self._graphs: dict[tuple, tuple] = {}
        self._pool = None

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: tuple, loop: Callable[..., torch.Tensor], *inputs: torch.Tensor | None) -> torch.Tensor:
        """``loop(*inputs)`` (CUDA tensors or None; the result a CUDA tensor), replayed from the graph captured for
        ``key``, which must determine everything about the loop but the inputs' values (their shapes and dtypes
        included)."""
        entry = self._graphs.get(key)
        if entry is None:
            static = [None if x is None else x.clone() for x in inputs]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loop(*static)
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = loop(*static)
            entry = self._graphs[key] = (graph, static, out, loop)
        graph, static, out, _ = entry
        for buffer, x in zip(static, inputs):
            if buffer is not None:
                buffer.copy_(x)
        graph.replay()
        return out.clone()


def _check_generate_args(sampler: str, objective: str, num_steps: int, n: int, y_mask: torch.Tensor | None,
                         generator: torch.Generator | None, seeds: Sequence[int] | None, batch_size: int) -> None:
    """``generate``'s ValueErrors about its arguments (``n``: the rows of ``y``; ``batch_size`` resolved)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; expected one of {SAMPLERS}")
    if objective == "flow" and sampler not in ("euler", STUDENT_SAMPLER):
        raise ValueError(f"a rectified-flow model samples with euler, not {sampler!r}")
    if not (1 if sampler == STUDENT_SAMPLER else 2) <= num_steps <= 1000:
        raise ValueError(f"num_steps must be in 2..1000 (1 step cannot be respaced; a student: 1..1000), "
                         f"got {num_steps}")
    if y_mask is not None and y_mask.shape[0] != n:
        raise ValueError(f"y_mask has {y_mask.shape[0]} rows, y has {n}")
    if seeds is not None and (generator is not None or len(seeds) != n):
        raise ValueError(f"seeds: expected {n} seeds and no generator, got {len(seeds)} seeds"
                         + (" and a generator" if generator is not None else ""))
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")


def _starting_noise(n: int, shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None,
                    seeds: Sequence[int] | None) -> tuple[torch.Tensor, list[torch.Generator] | None]:
    """(x_T (n, *shape) float32, the per-row generators or None), in ``generate``'s two noise conventions: all rows
    from ``generator`` at once, or row i from its own generator seeded ``seeds[i]``, which is returned to draw the
    row's step noise too."""
    if seeds is None:
        gens: list | None = None
        noise = torch.randn((n, *shape), generator=generator, device=device, dtype=torch.float32)
    else:
        gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
        noise = torch.cat([torch.randn((1, *shape), generator=g, device=device, dtype=torch.float32) for g in gens])
    return noise, gens


def _batch_loop(sampler: str, num_steps: int, eta: float, clip_denoised: bool, cfg_scale: float,
                guidance_channels: int | None, cfg_interval: tuple[int, int] | None,
                cfg_group: dist.ProcessGroup | None, pab: PABConfig | None, diffusion: GaussianDiffusion | None,
                flow: RectifiedFlow | None, prediction_type: str) -> Callable[..., torch.Tensor]:
    """``generate``'s loop over one batch, ``loop(net, x, y_rows, mask_rows, step_noise=None, g=None, desc=None,
    bar=False)``: ``net`` guided by ``GuidedModel``, with a PAB cache for the batch, run by ``euler_loop``
    (``flow``), ``sample_loop`` (``diffusion``: our samplers) or ``solver_loop`` (the diffusers solvers)."""

    def loop(net, x, y_rows, mask_rows, step_noise=None, g=None, desc=None, bar=False) -> torch.Tensor:
        fn = GuidedModel(net, y_rows, cfg_scale, mask_rows, guidance_channels, cfg_interval, cfg_group)
        # PAB's cache lives for one batch (its shapes)
        with PyramidAttentionBroadcast(net, pab) if pab is not None else contextlib.nullcontext() as cache:
            def both_steps(t: int) -> None:
                fn.step(t)
                cache.step(t)

            on_step = both_steps if cache is not None else None  # None: the loops call fn.step themselves
            if sampler == STUDENT_SAMPLER:
                process = flow if flow is not None else diffusion
                return student_loop(process, fn, x, student_times(process, num_steps, x.device),
                                    lambda z: randn_like_rows(z, g))
            if flow is not None:
                return euler_loop(flow, fn, x, num_steps, on_step)
            if diffusion is not None:
                return sample_loop(diffusion, fn, x, sampler, eta, clip_denoised, g, bar, desc, on_step, step_noise)
            return solver_loop(fn, x, sampler, num_steps, g, bar, desc, on_step=on_step,
                               prediction_type=prediction_type)

    return loop


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    y: torch.Tensor,
    shape: tuple[int, ...],
    *,
    y_mask: torch.Tensor | None = None,
    cfg_scale: float = 4.0,
    num_steps: int = 250,
    sampler: str = "ddpm",
    eta: float = 0.0,
    learn_sigma: bool = True,
    generator: torch.Generator | None = None,
    seeds: Sequence[int] | None = None,
    batch_size: int | None = None,
    clip_denoised: bool = True,
    guidance_channels: int | None = None,
    cfg_interval: tuple[int, int] | None = None,
    pab: PABConfig | None = None,
    cfg_group: dist.ProcessGroup | None = None,
    progress: bool = False,
    objective: str = "ddpm",
    flow_shift: float = 1.0,
) -> torch.Tensor:
    """Draw one sample per condition row: respaced diffusion or a diffusers solver, classifier-free guidance,
    in batches; or, for a rectified-flow model, Euler steps on the velocity.

    The shared sampler of ``ditforge sample`` and the trainer's periodic sample grids. Two noise conventions:

    - ``generator`` (or neither: the global RNG): the starting noise of all N samples is drawn first, as one
      (N, *shape) tensor from ``generator`` (so sample i starts from the same x_T whatever ``batch_size``);
      then each batch runs its loop with the same generator for its per-step noise. With ``batch_size`` >= N
      this is exactly ``noise = randn((N, *shape), generator)`` then one ``sample_loop(create_diffusion(
      str(num_steps), learn_sigma), GuidedModel(...), noise, ...)`` (or ``solver_loop``).
    - ``seeds`` (one int per row): row i has its own generator ``torch.Generator(device).manual_seed(seeds[i])``
      that draws its starting noise (``randn(shape)``) and then its per-step noise; so sample i depends only on
      its condition and seed, not on ``batch_size`` or the other rows (up to the float rounding of batched
      matmuls). ``ditforge sample --prompt_file`` uses ``seeds[i] = derive_seed(seed, i)`` to resume.

    Same seeds / generator state and settings -> same samples (on the same device).

    Compiled models (``ditforge.sample.CompiledModel``): with ``pab`` their ``eager`` module runs. One with
    ``loop_graphs`` (``LoopGraphs``: ``--compile reduce-overhead`` / ``max-autotune`` on a GPU) replays each batch's
    whole loop as one CUDA graph for our samplers (``ddpm``, ``ddim``; a noisy loop's step noise is drawn before
    the replay, as the loop would draw it) and ``euler`` on a flow, without ``cfg_interval`` or ``cfg_group`` (PAB's
    reuse pattern depends on the timesteps only, so the graph follows it); it shows no progress bar. Other loops
    (the diffusers solvers) call ``model`` once per step.

    Args:
        model: a conditional DiT / vDiT in eval mode (see ``GuidedModel``), on ``y``'s device.
        y: (N,) int64 labels, or (N, L, D_text) text-encoder states.
        shape: the shape of one sample, e.g. (C, H, W) or (C, T, H, W) (latent or pixel).
        y_mask: (N, L) bool caption mask for text states; None for labels.
        cfg_scale: guidance scale (1: no guidance, B rows per model call instead of 2B).
        num_steps: sampling steps: our samplers respace the 1000-step training process to them (2..1000); the
            diffusers solvers take that many solver steps (model calls).
        sampler, eta: ``"ddpm"`` (ancestral, learned variance) or ``"ddim"`` with ``eta`` (0: deterministic), see
            ``sample_loop``; ``"dpm++"`` or ``"euler"`` (diffusers, ``eta`` unused), see ``solver_loop``;
            ``"student"``: a distilled student's ``num_steps`` (1..1000) steps, ``dmd.student_loop`` on
            ``dmd.student_times`` (x_0 predicted, then re-noised with fresh noise; any objective).
        learn_sigma: the model predicts the variance too (C_out = 2C).
        generator: random source, on ``y``'s device (None: the global RNG); not with ``seeds``.
        seeds: N per-sample seeds (see above); not with ``generator``.
        batch_size: samples per loop (a guided model call sees 2 x that, or that on each of a ``cfg_group``'s
            processes; outside ``cfg_interval``, that); None: all N.
        clip_denoised: clamp predicted x_0 to [-1, 1] (right for pixels; DiT's sampler uses False for VAE
            latents, which are not bounded so). Our samplers only; the diffusers solvers never clip.
        guidance_channels, cfg_interval, cfg_group: see ``GuidedModel``.
        pab: Pyramid Attention Broadcast settings (``ditforge.diffusion.pab``): attention outputs reused across
            neighbouring steps (one cache per batch); None: every step computes everything.
        progress: a tqdm bar over the steps of each batch.
        objective: what the model was trained on (``ditforge.diffusion.objective``): ``ddpm`` (epsilon), ``v``
            (v-prediction: our samplers and the diffusers solvers convert it) or ``flow`` (velocity: sampler
            ``euler`` only, ``flow.euler_loop`` on ``flow_shift``-shifted times; guidance acts on the velocity).

    Returns:
        (N, *shape) float32 samples on ``y``'s device.

    Raises:
        ValueError: unknown sampler, ``num_steps`` outside 2..1000, ``batch_size`` < 1, ``y_mask`` rows
            that do not match ``y``, ``seeds`` of the wrong length or given with ``generator``; ``GuidedModel``'s
            (``cfg_interval``, ``cfg_group``, ``guidance_channels``); PAB on a model without ``blocks``.
        UserError: a diffusers solver without diffusers installed.
    """
    n = y.shape[0]
    batch_size = n if batch_size is None else batch_size
    _check_generate_args(sampler, objective, num_steps, n, y_mask, generator, seeds, batch_size)
    device = y.device
    noise, gens = _starting_noise(n, shape, device, generator, seeds)
    prediction_type = "v_prediction" if objective == "v" else "epsilon"
    diffusion = (create_diffusion(str(num_steps), learn_sigma, prediction_type=prediction_type)
                 if sampler in OWN_SAMPLERS else None)
    if sampler == STUDENT_SAMPLER and objective != "flow":  # a student runs on the training process's timesteps
        diffusion = create_diffusion(None, learn_sigma, prediction_type=prediction_type)
    flow = RectifiedFlow(shift=flow_shift) if objective == "flow" else None
    loop = _batch_loop(sampler, num_steps, eta, clip_denoised, cfg_scale, guidance_channels, cfg_interval, cfg_group,
                       pab, diffusion, flow, prediction_type)
    graphs = getattr(model, "loop_graphs", None)
    if pab is not None:  # PAB patches module forwards, which a compiled graph would not follow
        model = getattr(model, "eager", model)
    graphed = (isinstance(graphs, LoopGraphs) and device.type == "cuda" and cfg_interval is None
               and cfg_group is None and (flow is not None or diffusion is not None) and sampler != STUDENT_SAMPLER)
    noisy = diffusion is not None and draws_noise(sampler, eta)
    key = (sampler, num_steps, eta, clip_denoised, learn_sigma, objective, flow_shift, cfg_scale, guidance_channels,
           pab, y.dtype, y.shape[1:], None if y_mask is None else y_mask.shape[1:])
    out = []
    batches = range(0, n, batch_size)
    for j, start in enumerate(batches):
        rows = slice(start, start + batch_size)
        mask_rows = None if y_mask is None else y_mask[rows]
        g = generator if gens is None else gens[rows]
        if graphed:  # the graph draws nothing: a noisy loop's step noise is drawn first, as the loop would draw it
            net = graphs.model if pab is None else model
            z = torch.stack([randn_like_rows(noise[rows], g) for _ in range(num_steps)]) if noisy else None
            out.append(graphs.run((*key, noise[rows].shape), lambda *a, net=net: loop(net, *a), noise[rows], y[rows],
                                  mask_rows, z))
            continue
        desc = f"{sampler} sampling" + (f" (batch {j + 1}/{len(batches)})" if len(batches) > 1 else "")
        out.append(loop(model, noise[rows], y[rows], mask_rows, None, g, desc, progress))
    return torch.cat(out).float()
