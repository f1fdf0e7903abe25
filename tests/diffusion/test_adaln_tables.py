"""adaLN tables: every adaLN regression of a sampling loop computed up front (``DiT.adaln_tables``,
``GuidedModel.plan``), against the plain path that regresses them inside each call.

References: the model's own forward without tables (per call), and the loops run with a model wrapper that offers no
tables (so nothing is planned). Tiny class and text DiT / vDiT / STDiT models with every parameter perturbed
(adaLN-Zero would otherwise make the regressions zero and the test vacuous), float64 on the CPU, fresh random inputs.

Tolerance: the tables are one matrix product over S x B rows instead of S products over B rows, which sums in
another order (the BLAS picks its blocking by CPU: MKL's AVX-512 and AVX2 kernels differ). In float32 that moved
guided 7-step loops by up to 1.4e-4 on one CPU and 1e-6 on another, so the tests run in float64: a reordered sum
there stays near 1e-15 relative, amplified by guidance 4 and a few steps to well under 1e-10, while a wrong step's
or row's modulation moves outputs of size ~1 by ~1e-1 (a table shifted by one step fails every test here).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ditforge.diffusion import create_diffusion
from ditforge.diffusion.flow import RectifiedFlow, euler_loop
from ditforge.diffusion.pab import PABConfig, PyramidAttentionBroadcast
from ditforge.diffusion.samplers import GuidedModel, sample_loop, solver_loop
from ditforge.models import DiT, STDiT, VideoDiT
from model_helpers import perturbed

pytestmark = pytest.mark.usefixtures("one_thread_module")
TOL = dict(rtol=1e-10, atol=1e-10)
B, C, L, TEXT_DIM = 2, 3, 5, 8


MODELS = {
    "dit-class": lambda: DiT(input_size=8, patch_size=2, in_channels=C, hidden_size=32, depth=2, num_heads=2,
                             num_classes=5),
    "dit-text": lambda: DiT(input_size=8, patch_size=2, in_channels=C, hidden_size=32, depth=2, num_heads=2,
                            text_dim=TEXT_DIM),
    "vdit-class": lambda: VideoDiT(input_size=4, num_frames=2, patch_size=(1, 2, 2), in_channels=C, hidden_size=32,
                                   depth=2, num_heads=2, num_classes=5),
    "stdit-text": lambda: STDiT(input_size=4, num_frames=2, patch_size=2, in_channels=C, hidden_size=32, depth=2,
                                num_heads=2, text_dim=TEXT_DIM),
}


def _model(name: str, seed: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return perturbed(MODELS[name](), seed).double()


def _condition(model: nn.Module, g: torch.Generator) -> tuple[torch.Tensor, dict]:
    if model.text_dim is None:
        return torch.randint(0, 5, (B,), generator=g), {}
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, -2:] = False  # a padded caption
    return torch.randn(B, L, TEXT_DIM, generator=g, dtype=torch.float64), {"y_mask": mask}


def _shape(model: nn.Module) -> tuple[int, ...]:
    frames = getattr(model, "num_frames", None)
    return (C, 4, 4) if frames is None else (C, frames, 4, 4)


class _Plain(nn.Module):
    """The model without ``adaln_tables``: a loop over it plans nothing (the reference)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.inner = model

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_with_tables_equals_plain_forward(name):
    """Each step's slice of the tables gives that call's plain output, dropped rows included."""
    model = _model(name)
    g = torch.Generator().manual_seed(11)
    y, kw = _condition(model, g)
    drop = torch.tensor([False, True])
    t = torch.randint(0, 1000, (3, B), generator=g)
    tables = model.adaln_tables(t, y, force_drop_ids=drop, **kw)
    assert len(tables) == len(model.blocks) + 1
    assert [tuple(x.shape) for x in tables] == [(3, B, 6 * 32)] * len(model.blocks) + [(3, B, 64)]
    with torch.no_grad():
        for s in range(3):
            x = torch.randn(B, *_shape(model), generator=g, dtype=torch.float64)
            plain = model(x, t[s], y, force_drop_ids=drop, **kw)
            tabled = model(x, t[s], y, force_drop_ids=drop, adaln=[table[s] for table in tables], **kw)
            torch.testing.assert_close(tabled, plain, **TOL)
            assert (plain - model(x, t[(s + 1) % 3], y, force_drop_ids=drop, **kw)).abs().max() > 1e-3


def test_tables_over_the_byte_limit_are_not_made():
    model = _model("dit-class")
    t, y = torch.zeros(4, B, dtype=torch.int64), torch.arange(B)
    need = 4 * B * (2 * 6 * 32 + 2 * 32) * 8  # float64 rows of every regression
    assert model.adaln_tables(t, y, max_bytes=need - 1) is None
    assert model.adaln_tables(t, y, max_bytes=need) is not None


def _regression_calls(model: nn.Module) -> list[int]:
    """Counts the calls of every adaLN regression module (forward hooks)."""
    calls = [0]
    for name, module in model.named_modules():
        if name.endswith("adaLN_modulation"):
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("name", ["dit-class", "stdit-text"])
@pytest.mark.parametrize("cfg_scale", [4.0, 1.0])
def test_planned_ddim_loop_equals_the_unplanned_one(name, cfg_scale):
    """A guided (and an unguided) DDIM loop over a model with tables equals the same loop over the model without:
    the regressions ran once per layer for the whole loop instead of once per step."""
    model = _model(name)
    g = torch.Generator().manual_seed(5)
    y, kw = _condition(model, g)
    noise = torch.randn(B, *_shape(model), generator=g, dtype=torch.float64)
    diffusion = create_diffusion("6")
    calls = _regression_calls(model)
    with torch.no_grad():
        planned = sample_loop(diffusion, GuidedModel(model, y, cfg_scale, kw.get("y_mask")), noise, "ddim")
        assert calls[0] == len(model.blocks) + 1  # each regression once, in adaln_tables
        plain = sample_loop(diffusion, GuidedModel(_Plain(model), y, cfg_scale, kw.get("y_mask")), noise, "ddim")
        assert calls[0] == (len(model.blocks) + 1) * 7  # and once per step without tables
    torch.testing.assert_close(planned, plain, **TOL)


@pytest.mark.parametrize("sampler", ["dpm++", "euler"])
def test_planned_diffusers_solver_loop_equals_the_unplanned_one(sampler):
    """diffusers' solvers (DPM-Solver++ 2M, Euler) plan the integer timesteps they then pass."""
    pytest.importorskip("diffusers")
    model = _model("dit-class")
    g = torch.Generator().manual_seed(8)
    y, _ = _condition(model, g)
    noise = torch.randn(B, *_shape(model), generator=g, dtype=torch.float64)
    calls = _regression_calls(model)
    with torch.no_grad():
        planned = solver_loop(GuidedModel(model, y, 4.0), noise, sampler, 6)
        assert calls[0] == len(model.blocks) + 1
        plain = solver_loop(GuidedModel(_Plain(model), y, 4.0), noise, sampler, 6)
    torch.testing.assert_close(planned, plain, **TOL)


def test_planned_euler_loop_and_pab_equal_the_unplanned_ones():
    """The flow loop plans the exact float timesteps it then passes; PAB's reuse (which patches the attention modules)
    runs unchanged on top of the tables."""
    model = _model("vdit-class")
    g = torch.Generator().manual_seed(6)
    y, _ = _condition(model, g)
    noise = torch.randn(B, *_shape(model), generator=g, dtype=torch.float64)
    flow = RectifiedFlow(shift=3.0)

    def loop(net, pab=None):
        fn = GuidedModel(net, y, 4.0)
        if pab is None:
            return euler_loop(flow, fn, noise, 5)
        with PyramidAttentionBroadcast(model, pab) as cache:
            return euler_loop(flow, fn, noise, 5, on_step=lambda t: (fn.step(t), cache.step(t)))

    calls = _regression_calls(model)
    with torch.no_grad():
        planned = loop(model)
        assert calls[0] == len(model.blocks) + 1  # planned: each regression once for the 5 steps
        torch.testing.assert_close(planned, loop(_Plain(model)), **TOL)
        torch.testing.assert_close(loop(model, PABConfig.fora(2)), loop(_Plain(model), PABConfig.fora(2)), **TOL)


def test_plan_is_skipped_where_rows_are_not_fixed_and_calls_are_counted():
    model = _model("dit-class")
    y, t = torch.arange(B), torch.tensor([900, 500])
    x = torch.randn(B, *_shape(model), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    interval = GuidedModel(model, y, 4.0, cfg_interval=(0, 600))  # guided at some steps only
    interval.plan(t)
    assert interval._tables is None
    plain = GuidedModel(_Plain(model), y, 4.0)
    plain.plan(t)
    assert plain._tables is None
    every = GuidedModel(model, y, 4.0, cfg_interval=(0, 999))  # guided at every step: the plain path, planned
    every.plan(t)
    assert every._tables is not None
    fn = GuidedModel(model, y, 4.0)
    fn.plan(t)
    with torch.no_grad():
        fn(x, t[:1].expand(B))
        fn(x, t[1:].expand(B))
        with pytest.raises(RuntimeError, match="more often than the 2 planned"):
            fn(x, t[1:].expand(B))
