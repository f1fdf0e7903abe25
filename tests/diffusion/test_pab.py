"""Tests of ``ditforge.diffusion.pab`` (Pyramid Attention Broadcast).

References: the plain model (no PAB), and an independent re-implementation of the reuse with plain
``register_forward_hook`` hooks on the same attention modules (record the output where the schedule computes,
return the recorded one where it reuses), the schedule written here as a small python function. Tiny STDiT /
vDiT models with every parameter perturbed (adaLN-Zero would otherwise make the blocks identities), seeded
random inputs, never zeros.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ditforge.diffusion.pab import KINDS, Broadcast, PABConfig, PyramidAttentionBroadcast
from ditforge.models import STDiT, VideoDiT
from model_helpers import perturbed

pytestmark = pytest.mark.usefixtures("one_thread_module")

TIMESTEPS = [950, 850, 750, 650, 550, 450, 350, 250, 150, 50]
EDGES = [999, 900, 899, 800, 801, 800, 400, 100, 100, 99, 100, 0]  # the windows' (inclusive) bounds
DEPTH, B, C, T, HW, L, TEXT_DIM = 2, 2, 2, 3, 4, 5, 8
ATTRS = {"spatial": "attn", "temporal": "attn_temp", "cross": "cross_attn"}


def text_stdit() -> nn.Module:
    """Text-conditioned STDiT: spatial, temporal and cross-attention in every block."""
    torch.manual_seed(0)
    return perturbed(STDiT(input_size=HW, num_frames=T, patch_size=2, depth=DEPTH, hidden_size=32, num_heads=2,
                           in_channels=C, text_dim=TEXT_DIM), 1)


def class_vdit() -> nn.Module:
    """Class-conditioned vDiT: full attention only (treated as spatial)."""
    torch.manual_seed(0)
    return perturbed(VideoDiT(input_size=HW, num_frames=T - 1, patch_size=(1, 2, 2), depth=DEPTH, hidden_size=32,
                              num_heads=2, in_channels=C, num_classes=5), 2)


MODELS = {"stdit-text": text_stdit, "vdit-class": class_vdit}


def make_inputs(model: nn.Module, n_calls: int, seed: int, batch: int = B,
                timesteps: list[int] = TIMESTEPS) -> list[list[tuple]]:
    """Per timestep, ``n_calls`` argument tuples (x, t, y[, mask]) with fresh random x (and captions)."""
    g = torch.Generator().manual_seed(seed)
    frames = model.num_frames
    out = []
    for t in timesteps:
        calls = []
        for _ in range(n_calls):
            x = torch.randn(batch, C, frames, HW, HW, generator=g)
            tt = torch.full((batch,), t, dtype=torch.int64)
            if model.text_dim is None:
                calls.append((x, tt, torch.randint(0, 5, (batch,), generator=g)))
            else:
                y = torch.randn(batch, L, TEXT_DIM, generator=g)
                mask = torch.ones(batch, L, dtype=torch.bool)
                mask[0, -2:] = False  # a padded caption
                calls.append((x, tt, y, mask))
        out.append(calls)
    return out


def run(model: nn.Module, args: tuple) -> torch.Tensor:
    with torch.no_grad():
        if len(args) == 4:
            return model(args[0], args[1], args[2], y_mask=args[3])
        return model(*args)


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(kind, module) found here independently of pab.py."""
    return [(kind, getattr(block, attr)) for block in model.blocks for kind, attr in ATTRS.items()
            if getattr(block, attr, None) is not None]


def expected_reuse(timesteps: list[int], low: int, high: int, gap: int) -> list[bool]:
    """Reuse flags per step: reuse inside [low, high] while fewer than ``gap`` steps have passed since the step
    that last computed (the first step always computes)."""
    flags, last = [], None
    for i, t in enumerate(timesteps):
        reuse = last is not None and low <= t <= high and i - last < gap
        if not reuse:
            last = i
        flags.append(reuse)
    return flags


def plan(config: PABConfig, timesteps: list[int] = TIMESTEPS) -> dict[str, list[bool]]:
    return {kind: expected_reuse(timesteps, getattr(config, kind).low, getattr(config, kind).high,
                                 getattr(config, kind).gap) for kind in ATTRS}


def run_pab(model, inputs, config=PABConfig()):
    outs = []
    with PyramidAttentionBroadcast(model, config) as pab:
        for t, calls in zip(TIMESTEPS, inputs):
            pab.step(t)
            outs.append([run(model, a) for a in calls])
    return outs, pab


def run_hook_reference(model, inputs, config=PABConfig()):
    """Broadcast by forward hooks: record each module's output (per call within the step) where the schedule
    computes, substitute the recorded one where it reuses."""
    flags = plan(config)
    store, state = {}, {"step": 0, "calls": {}}

    def make_hook(kind, module):
        def hook(mod, args, out):
            index = state["calls"].get(id(mod), 0)
            state["calls"][id(mod)] = index + 1
            if flags[kind][state["step"]]:
                return store[(id(mod), index)]
            store[(id(mod), index)] = out.detach().clone()
            return None
        return hook

    handles = [m.register_forward_hook(make_hook(k, m)) for k, m in attention_modules(model)]
    try:
        outs = []
        for i, calls in enumerate(inputs):
            state["step"], state["calls"] = i, {}
            outs.append([run(model, a) for a in calls])
    finally:
        for h in handles:
            h.remove()
    return outs


def test_default_schedule_matches_videosys_gaps():
    """The reference schedule itself, spelled out for the default config (R = reuse)."""
    got = {k: "".join("R" if r else "C" for r in v) for k, v in plan(PABConfig()).items()}
    assert got == {"spatial": "CCRCRCRCRC", "temporal": "CCRRCRRCRC", "cross": "CRRRRCRRRC"}
    got = {k: "".join("R" if r else "C" for r in v) for k, v in plan(PABConfig(), EDGES).items()}
    assert got == {"spatial": "CCCRCRCRCCRC", "temporal": "CCCRCRRCRCRC", "cross": "CRRRRCRRRCRC"}


@pytest.mark.parametrize("n_calls", [1, 2])
def test_gap_one_equals_plain_model(n_calls):
    model = text_stdit()
    inputs = make_inputs(model, n_calls, seed=3)
    always = PABConfig(Broadcast(0, 999, 1), Broadcast(0, 999, 1), Broadcast(0, 999, 1))
    outs, pab = run_pab(model, inputs, always)
    for got, calls in zip(outs, inputs):
        for o, a in zip(got, calls):
            assert torch.equal(o, run(model, a))
    assert sum(pab.reused.values()) == 0


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("n_calls", [1, 2])
def test_matches_hook_reference(name, n_calls):
    model = MODELS[name]()
    inputs = make_inputs(model, n_calls, seed=4)
    outs, _ = run_pab(model, inputs)
    ref = run_hook_reference(model, inputs)
    flags = plan(PABConfig())
    max_diff_from_plain = 0.0
    for i, (got, want, calls) in enumerate(zip(outs, ref, inputs)):
        for o, r, a in zip(got, want, calls):
            torch.testing.assert_close(o, r, atol=1e-6, rtol=0)
            plain = run(model, a)
            if not any(flags[k][i] for k in ATTRS):
                assert torch.equal(o, plain)  # a step where every kind computes is the plain model
            else:
                max_diff_from_plain = max(max_diff_from_plain, (o - plain).abs().max().item())
    assert max_diff_from_plain > 1e-3  # reuse does change the output, so the comparison above can fail


@pytest.mark.parametrize("timesteps", [TIMESTEPS, EDGES], ids=["spread", "edges"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_reuse_skips_attention_compute(name, timesteps):
    model = MODELS[name]()
    inputs = make_inputs(model, 1, seed=5, timesteps=timesteps)
    flags = plan(PABConfig(), timesteps)
    counts = {k: 0 for k in ATTRS}

    def counter(kind):
        def hook(mod, args, out):
            counts[kind] += 1
        return hook

    handles = [(m.qkv if kind != "cross" else m.q_linear).register_forward_hook(counter(kind))
               for kind, m in attention_modules(model)]
    present = {kind for kind, _ in attention_modules(model)}
    try:
        with PyramidAttentionBroadcast(model) as pab:
            for i, (t, calls) in enumerate(zip(timesteps, inputs)):
                before = dict(counts)
                pab.step(t)
                run(model, calls[0])
                for kind in ATTRS:
                    n = DEPTH if kind in present else 0
                    assert counts[kind] - before[kind] == (0 if flags[kind][i] else n), (kind, t)
    finally:
        for h in handles:
            h.remove()
    for kind in ATTRS:
        n = DEPTH if kind in present else 0
        assert pab.computed[kind] == counts[kind] == n * flags[kind].count(False)
        assert pab.reused[kind] == n * flags[kind].count(True)
        assert pab.computed[kind] + pab.reused[kind] == n * len(timesteps)


def test_exit_restores_modules_and_reset_recomputes():
    model = text_stdit()
    keys = list(model.state_dict())
    children = [n for n, _ in model.named_modules()]
    inputs = make_inputs(model, 1, seed=6)
    modules = [m for _, m in attention_modules(model)]
    plain0 = run(model, inputs[0][0])
    with PyramidAttentionBroadcast(model) as pab:
        assert all("forward" in m.__dict__ for m in modules)
        assert list(model.state_dict()) == keys and [n for n, _ in model.named_modules()] == children
        # before the first step every call is plain attention, and nothing is cached
        assert torch.equal(run(model, inputs[0][0]), plain0) and torch.equal(run(model, inputs[0][0]), plain0)
        assert pab.computed == {k: 2 * DEPTH if k in ATTRS else 0 for k in KINDS} and sum(pab.reused.values()) == 0
        pab.step(TIMESTEPS[0])
        run(model, inputs[0][0])
        pab.step(TIMESTEPS[1])  # cross reuses here (850 in [100, 900], gap 5)
        reused = pab.reused["cross"]
        run(model, inputs[1][0])
        assert pab.reused["cross"] == reused + DEPTH
        pab.reset()
        pab.step(TIMESTEPS[2])  # would reuse every kind without the reset
        computed = dict(pab.computed)
        out = run(model, inputs[2][0])
        assert all(pab.computed[k] == computed[k] + DEPTH for k in ATTRS)
        assert torch.equal(out, run(model, inputs[2][0]))  # recomputed everything: the plain output
        pab.step(TIMESTEPS[3])
        differs = run(model, inputs[3][0])
    assert not any("forward" in m.__dict__ for m in modules)
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_modules()] == children
    plain = run(model, inputs[3][0])
    assert not torch.allclose(differs, plain, atol=1e-3)
    model2 = text_stdit()  # same seeds: the same weights, never patched
    assert torch.equal(plain, run(model2, inputs[3][0]))


def test_new_shape_on_reuse_step_recomputes():
    model = text_stdit()
    small, big = make_inputs(model, 1, seed=7, batch=2), make_inputs(model, 1, seed=8, batch=3)
    with PyramidAttentionBroadcast(model) as pab:
        pab.step(TIMESTEPS[0])
        run(model, small[0][0])
        pab.step(TIMESTEPS[1])
        pab.step(TIMESTEPS[2])  # every kind reuses at 750 by the schedule, but the batch is now 3
        out = run(model, big[2][0])
    assert sum(pab.reused.values()) == 0
    assert torch.equal(out, run(model, big[2][0]))


@pytest.mark.parametrize("low,high,gap", [(100, 800, 0), (100, 800, -2), (800, 100, 2)])
def test_bad_config_raises(low, high, gap):
    with pytest.raises(ValueError):
        Broadcast(low, high, gap)
    with pytest.raises(ValueError):
        PABConfig(cross=Broadcast(low, high, gap))


def test_model_without_blocks_raises():
    with pytest.raises(ValueError, match="blocks"):
        PyramidAttentionBroadcast(nn.Linear(4, 4))


def test_fora_reuses_attention_and_mlp_every_n_steps():
    """FORA with N = 3: every block's attention and MLP outputs are computed at steps 0, 3, 6, 9 and reused in
    between, whatever the timestep; the outputs equal forward hooks that substitute the output each module
    recorded at the last computing step (an independent implementation), and the plain model where all compute."""
    model = class_vdit()
    inputs = make_inputs(model, 1, seed=7)
    outs, pab = run_pab(model, inputs, PABConfig.fora(3))
    recorded, state = {}, {"step": 0}

    def hook(mod, args, out):
        if state["step"] % 3 == 0:
            recorded[mod] = out.detach().clone()
            return None
        return recorded[mod]

    handles = [m.register_forward_hook(hook) for block in model.blocks for m in (block.attn, block.mlp)]
    try:
        for i, calls in enumerate(inputs):
            state["step"] = i
            torch.testing.assert_close(outs[i][0], run(model, calls[0]), atol=1e-6, rtol=0)
    finally:
        for h in handles:
            h.remove()
    for i, calls in enumerate(inputs):
        plain = run(model, calls[0])
        assert torch.equal(outs[i][0], plain) if i % 3 == 0 else (outs[i][0] - plain).abs().max() > 1e-3
    assert pab.computed["mlp"] == pab.computed["spatial"] == 4 * DEPTH
    assert pab.reused["mlp"] == pab.reused["spatial"] == 6 * DEPTH
