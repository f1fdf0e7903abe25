"""The fast sampling path: ``prepare_model`` (bf16 weights, torch.compile), the guidance interval, PAB through
``generate``, and the command's checks of the new flags. GPU-only: whole loops as CUDA graphs (here) and float8
GEMMs; no host syncs per step is measured by benchmarks/sampling.py."""

from __future__ import annotations

import os

import pytest
import torch

from ditforge.diffusion import generate
from ditforge.diffusion.pab import Broadcast, PABConfig
from ditforge.diffusion.samplers import GuidedModel
from ditforge.errors import UserError
from ditforge.models import create_model
from ditforge.parallel.mesh import Dist
from ditforge.sample import SampleConfig, prepare_model, sample, use_sampling_gemm_settings

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


def _draw(model, y, shape=(4, 8, 8), sampler="ddim", seed_noise=1, **kwargs) -> torch.Tensor:
    return generate(model, y, shape, cfg_scale=4.0, num_steps=10, sampler=sampler, clip_denoised=False,
                    generator=torch.Generator(y.device).manual_seed(seed_noise), **kwargs)


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
    with pytest.raises(UserError, match="--mixed_precision: expected"):
        prepare_model(_model(), Dist(), "fp64")
    with pytest.raises(UserError, match="--mixed_precision fp8: needs a CUDA GPU with FP8 tensor cores"):
        prepare_model(_model(), Dist(), "fp8")
    with pytest.raises(UserError, match="--mixed_precision fp8: not with --sequence_parallel_size"):
        prepare_model(_model(), Dist(sp_mesh=object()), "fp8")  # refused before the mesh is used


def test_sampling_gives_cublaslt_no_workspace_unless_the_user_chose_one(monkeypatch):
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "")  # recorded, so the test's own setting is undone after it
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE")
    prepare_model(_model(), Dist(), "fp32")  # a CPU process: cuBLASLt's settings are left alone
    assert "CUBLASLT_WORKSPACE_SIZE" not in os.environ
    use_sampling_gemm_settings(torch.device("cuda"))
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "0"
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "4096")
    use_sampling_gemm_settings(torch.device("cuda", 0))
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "4096"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_whole_loop_cuda_graph_equals_the_compiled_model_per_step():
    """``--compile reduce-overhead`` on a GPU: a DDIM loop (eta 0), an ancestral DDPM loop (its step noise drawn
    before the replay) and a flow's Euler loop are captured whole (``LoopGraphs``, one graph per loop setting and
    batch shape) and replayed with new noise, labels and generator states; each equals the same compiled model
    called step by step (no graphs) to float32 rounding (the same kernels; bound 1e-5 of the samples' scale). The
    diffusers solvers are not captured."""
    dev = torch.device("cuda")
    seed = int(torch.randint(0, 2**31, ()))
    graphed = prepare_model(_model(seed=seed), Dist(device=dev), "fp32", compile="reduce-overhead")
    plain = prepare_model(_model(seed=seed), Dist(device=dev), "fp32", compile="default")
    for objective, sampler in (("ddpm", "ddim"), ("ddpm", "ddpm"), ("flow", "euler")):
        for labels in ([1, 2, 3], [4, 5, 6], [7, 8]):
            y = torch.tensor(labels, device=dev)
            kwargs = dict(shape=(4, 8, 8), sampler=sampler, objective=objective, seed_noise=len(labels))
            got, want = (_draw(m, y, **kwargs) for m in (graphed, plain))
            assert want.std() > 0.1
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (objective, labels)
    assert len(graphed.loop_graphs) == 6  # three settings x two batch shapes: the second batch of 3 replayed
    _draw(graphed, torch.tensor([1, 2], device=dev), sampler="dpm++")
    assert len(graphed.loop_graphs) == 6


def _fp8_roundtrip_rows(a: torch.Tensor) -> torch.Tensor:
    """a (..., K) rounded to e4m3 with one float32 scale per row (its absolute maximum / 448), back in float32:
    an independent emulation of ``RowwiseFloat8Linear``'s operands."""
    amax = a.float().abs().amax(-1, keepdim=True)
    top = torch.full_like(amax, torch.finfo(torch.float8_e4m3fn).max)  # CUDA divides by a Python number through
    # its reciprocal: 1 ulp off, and bf16 inputs put many values on exact e4m3 ties, which that ulp decides
    return (a.float() * (top / amax)).to(torch.float8_e4m3fn).float() * (amax / top)


@pytest.mark.slow
def test_fp8_sampling_layers_are_the_float8_rounded_products(monkeypatch):
    """fp8: exactly the blocks' qkv, proj, fc1 and fc2 run float8 GEMMs, each equal to an independent float32
    emulation (weight rounded to e4m3 per output channel, input per row) up to its bf16 output rounding, which
    is far below float8's own rounding (the distance to the exact float32 product); the whole model stays
    within 5% of float32. On the CPU (Triton's interpreter; torch's CPU ``_scaled_mm``) the GPU check is
    bypassed. DiT-S/2 is cut to 2 of its 12 blocks: each block's float8 layers run under the interpreter, and
    every block has the same four."""
    from ditforge import parallel
    from ditforge.ops.fp8 import RowwiseFloat8Linear

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        monkeypatch.setattr(parallel, "fp8_unavailable", lambda device, inference=False: None)
    elif parallel.fp8_unavailable(dev, inference=True):
        pytest.skip(parallel.fp8_unavailable(dev, inference=True))
    seed = int(torch.randint(0, 2**31, ()))
    exact = _model("DiT-S/2", seed=seed, depth=2).to(dev)
    fp8 = prepare_model(_model("DiT-S/2", seed=seed, depth=2), Dist(device=dev), "fp8")
    quantized = {n for n, m in fp8.named_modules() if isinstance(m, RowwiseFloat8Linear)}
    assert quantized == {f"blocks.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    g = torch.Generator(dev).manual_seed(seed)
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    for name in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"):
        fc, ref = fp8.blocks[1].get_submodule(name), exact.blocks[1].get_submodule(name)
        x = torch.randn(64, fc.in_features, generator=g, device=dev).bfloat16()
        with torch.no_grad():
            got = fc(x).float()
            emulated = torch.nn.functional.linear(_fp8_roundtrip_rows(x), _fp8_roundtrip_rows(ref.weight.bfloat16()),
                                                  ref.bias.bfloat16().float())
            product = ref(x.float())
        assert 1e-2 < rel(got, product) and rel(got, emulated) < 0.2 * rel(got, product), \
            (seed, name, rel(got, emulated), rel(got, product))
    # 2 samples (32 token rows): the interpreter runs one program per row of each fused LayerNorm kernel
    x = torch.randn(2, 4, 8, 8, generator=g, device=dev)
    t, y = torch.randint(0, 1000, (2,), generator=g, device=dev), torch.randint(0, 10, (2,), generator=g, device=dev)
    with torch.no_grad():
        whole = rel(fp8(x, t, y).float(), exact(x, t, y))
    assert 1e-3 < whole < 0.05, (seed, whole)  # torchao's path measured 1.6-2.3% (H200, 3 seeds, 12 blocks);
    # 2 blocks on the CPU, 4 samples: 0.80-1.05% (2 seeds); 2 samples: 0.68%, 1.13%, 0.88% (seeds 11, 22, 33;
    # 4 samples at those seeds: 0.69%, 0.91%, 0.65%)


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
    # a compiled model runs PAB on its eager module (a compiled graph would not see the patched forwards)
    compiled = prepare_model(model, Dist(), "fp32", compile="default")
    assert torch.equal(_draw(compiled, states, shape, y_mask=mask, pab=PABConfig()), cached)
    fora = _draw(compiled, states, shape, y_mask=mask, pab=PABConfig.fora(3))
    assert (fora - plain).abs().max() > 1e-4 and (fora - cached).abs().max() > 1e-4


@pytest.mark.parametrize("flags, message", [
    (dict(fora=1), "--fora: expected a recompute interval N >= 2"),
    (dict(fora=3, pab=True), "--fora: .* with --pab"),
    (dict(compile="fast"), "--compile"),
    (dict(cfg_interval=(800, 100)), "--cfg_interval"),
    (dict(guidance_channels=0), "--guidance_channels"),
    (dict(mixed_precision="fp64"), "--mixed_precision"),
    (dict(mixed_precision="fp8", device="cpu"), "--mixed_precision fp8: needs a CUDA GPU"),  # before --ckpt is read
    (dict(cfg_parallel=True, cfg_scale=1.0), "--cfg_parallel"),
    (dict(cfg_parallel=True), "--cfg_parallel: needs 2"),  # one process, not two
])
def test_sample_refuses_bad_speed_flags(flags, message):
    with pytest.raises(UserError, match=message):
        sample(SampleConfig(ckpt="unused", **flags))
