"""The fast sampling path: ``prepare_model`` (bf16 weights, torch.compile), the guidance interval, PAB through
``generate``, and the command's checks of the new flags. GPU-only parts (CUDA graphs, no host syncs per step) are
measured by benchmarks/sampling.py."""

from __future__ import annotations

import pytest
import torch

from ditforge.diffusion import generate
from ditforge.diffusion.pab import Broadcast, PABConfig
from ditforge.diffusion.samplers import GuidedModel
from ditforge.errors import UserError
from ditforge.models import create_model
from ditforge.parallel.mesh import Dist
from ditforge.sample import SampleConfig, prepare_model, sample

pytestmark = pytest.mark.usefixtures("one_thread_module")


def _model(name: str = "DiT-T/2", seed: int = 0, **kwargs) -> torch.nn.Module:
    """A tiny model with every weight random (adaLN-Zero layers included, else the output is zero)."""
    torch.manual_seed(seed)
    model = create_model(name, 8, 4, 10, True, 0.1, **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def _draw(model, y, shape=(4, 8, 8), **kwargs) -> torch.Tensor:
    return generate(model, y, shape, cfg_scale=4.0, num_steps=10, sampler="ddim", clip_denoised=False,
                    generator=torch.Generator().manual_seed(1), **kwargs)


def test_prepare_model_bf16_and_compile_match_fp32_eager():
    y = torch.tensor([1, 2, 3])
    ref = _draw(prepare_model(_model(), Dist(), "fp32"), y)
    assert ref.std() > 0.1  # non-trivial samples
    compiled = _draw(prepare_model(_model(), Dist(), "fp32", compile="default"), y)
    # inductor reorders float32 reductions: measured 3e-7 of the samples' scale
    assert (compiled - ref).abs().max() <= 1e-4 * ref.abs().max()
    bf16 = prepare_model(_model(), Dist(), "bf16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    low = _draw(bf16, y)
    assert low.dtype == torch.float32
    # bf16 weights and activations over 10 steps: measured 0.6% relative L2; bound 3%
    assert ((low - ref).norm() / ref.norm()) < 0.03
    with pytest.raises(UserError, match="--mixed_precision"):
        prepare_model(_model(), Dist(), "fp8")


class _Counting(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model, self.rows = model, []

    def forward(self, x, t, y, **kwargs):
        self.rows.append(x.shape[0])
        return self.model(x, t, y, **kwargs)


def test_cfg_interval_guides_inside_only():
    """Kynkaanniemi et al. 2024: inside [low, high] the guided 2B batch, outside the conditional model alone
    (B rows); a window covering every step is exactly plain guidance."""
    model, y = _model(), torch.tensor([4, 5])
    full = _draw(model, y)
    assert torch.equal(_draw(model, y, cfg_interval=(0, 999)), full)
    counting = _Counting(model)
    part = _draw(counting, y, cfg_interval=(300, 700))
    # DDIM 10 steps respaced from 1000: original timesteps 999, 888, ..., 0 (every 111)
    steps = [round(999 - i * 111) for i in range(10)]
    assert counting.rows == [4 if 300 <= t <= 700 else 2 for t in steps]
    assert (part - full).abs().max() > 1e-3
    cond_only = GuidedModel(model, y, 4.0, cfg_interval=(300, 700))
    cond_only.step(800)
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([800, 800])
    with torch.no_grad():
        assert torch.equal(cond_only(x, t), model(x, t, y))
    with pytest.raises(ValueError, match="cfg_interval"):
        GuidedModel(model, y, 4.0, cfg_interval=(700, 300))
    with pytest.raises(ValueError, match="guidance_channels"):
        GuidedModel(model, y, 4.0, guidance_channels=5)(x, t)  # 4 input channels; 5..8 are the variance's


def test_pab_through_generate():
    """PAB with every gap 1 is the plain path exactly; the default schedule reuses attention (fewer attention
    computations) and changes the samples, and the modules are restored afterwards."""
    text = dict(num_frames=4, text_dim=16)
    model = _model("STDiT-T/2", **text)
    g = torch.Generator().manual_seed(2)
    states, mask = torch.randn(2, 5, 16, generator=g), torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    shape = (4, 4, 8, 8)
    plain = _draw(model, states, shape, y_mask=mask)
    ones = PABConfig(*(Broadcast(0, 999, 1),) * 3)
    assert torch.equal(_draw(model, states, shape, y_mask=mask, pab=ones), plain)
    calls = []
    hook = model.blocks[0].attn.qkv.register_forward_hook(lambda *a: calls.append(1))
    cached = _draw(model, states, shape, y_mask=mask, pab=PABConfig())
    hook.remove()
    assert len(calls) < 10  # spatial attention of block 0 ran on fewer than all 10 steps
    assert (cached - plain).abs().max() > 1e-4
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert torch.equal(_draw(model, states, shape, y_mask=mask), plain)


@pytest.mark.parametrize("flags, message", [
    (dict(pab=True, compile="reduce-overhead"), "--pab"),
    (dict(compile="fast"), "--compile"),
    (dict(cfg_interval=(800, 100)), "--cfg_interval"),
    (dict(guidance_channels=0), "--guidance_channels"),
    (dict(mixed_precision="fp8"), "--mixed_precision"),
    (dict(compile="default", sequence_parallel_size=2), "--compile"),
    (dict(cfg_parallel=True, cfg_scale=1.0), "--cfg_parallel"),
    (dict(cfg_parallel=True), "--cfg_parallel: needs 2"),  # one process, not two
])
def test_sample_refuses_bad_speed_flags(flags, message):
    with pytest.raises(UserError, match=message):
        sample(SampleConfig(ckpt="unused", **flags))
