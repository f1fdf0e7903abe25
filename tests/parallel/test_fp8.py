"""torchao float8 training linears through ``apply_fp8`` for each ``--fp8_recipe``, on the CPU (torch's
``_scaled_mm`` runs there too; the GPU check of ``fp8_unavailable`` is bypassed), against closed forms of float8
rounding.

Rounding x to a float format with p mantissa bits leaves a relative error of rms 2^-p / sqrt(12) * sqrt(E[1/m^2])
for a mantissa m log-uniform in [1, 2) (E[1/m^2] = 3 / (8 ln 2)): 0.0265 for e4m3 (p = 3), 0.0531 for e5m2 (p = 2).
A product of two rounded operands errs by the root sum of squares of theirs, and a sum of many such products with
independent errors by the same relative rms. So, against the same layer in bf16 autocast:

  * the output (e4m3 x e4m3): 0.0375 in every recipe;
  * tensorwise: the input and weight gradients take e5m2 output gradients: 0.0593;
  * rowwise: e4m3 throughout: 0.0375; rowwise_with_gw_hp: the weight gradient in bf16, equal to the reference.

Each is checked within 15%, which tells the recipes apart (0.0375 against 0.0593).
"""

from __future__ import annotations

import math

import pytest
import torch

import ditforge.parallel as par
from ditforge.models import create_model

pytest.importorskip("torchao")

E4M3, E5M2 = (2.0**-p / math.sqrt(12) * math.sqrt(3 / (8 * math.log(2))) for p in (3, 2))
PRODUCT = math.hypot(E4M3, E4M3)  # 0.0375
GRAD = {"tensorwise": math.hypot(E5M2, E4M3), "rowwise": PRODUCT, "rowwise_with_gw_hp": PRODUCT}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_recipe_reaches_the_layers_and_rounds_as_float8(recipe, monkeypatch):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    monkeypatch.setattr(par, "fp8_unavailable", lambda device, inference=False: None)
    torch.manual_seed(0)
    model = create_model("DiT-T/2", 16, 4, 10)
    reference = create_model("DiT-T/2", 16, 4, 10)
    reference.load_state_dict(model.state_dict())
    chosen = [n for n, m in model.named_modules() if par.fp8_layer(m, n)]
    assert par.apply_fp8(model, torch.device("cpu"), recipe=recipe) == len(chosen) > 0
    expected = Float8LinearConfig.from_recipe_name(recipe)
    for name, module in model.named_modules():
        assert isinstance(module, Float8Linear) == (name in chosen), name
        if name in chosen:
            assert module.config == expected, name
    # one converted layer against its bf16 twin: fresh weights and inputs of unit scale, a random output gradient
    fc1, twin = model.get_submodule("blocks.0.mlp.fc1"), reference.get_submodule("blocks.0.mlp.fc1")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        w = torch.randn(fc1.weight.shape, generator=g) / math.sqrt(fc1.in_features)
        fc1.weight.copy_(w)
        twin.weight.copy_(w)
    x = torch.randn(512, fc1.in_features, generator=g).bfloat16()
    dy = torch.randn(512, fc1.out_features, generator=g).bfloat16()
    results = []
    for layer in (fc1, twin):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            y = layer(xi)
        y.backward(dy)
        results.append((y, xi.grad, layer.weight.grad))
    (y8, dx8, dw8), (y, dx, dw) = results
    assert _rel(y8, y) == pytest.approx(PRODUCT, rel=0.15)
    assert _rel(dx8, dx) == pytest.approx(GRAD[recipe], rel=0.15)
    if recipe == "rowwise_with_gw_hp":
        assert _rel(dw8, dw) < 1e-3
    else:
        assert _rel(dw8, dw) == pytest.approx(GRAD[recipe], rel=0.15)


@pytest.mark.parametrize("min_width", [192, 208])
def test_width_policy_converts_only_wide_layers(min_width, monkeypatch):
    """``--fp8_min_width``: a layer runs float8 only where its input and output are both that wide. A text DiT-T's
    6 blocks hold 7 such layers each (qkv 192 -> 576, proj, cross-attention q, kv (caption states embedded to 192
    first) and proj, MLP 192 -> 768 -> 192), all of width 192: 192 converts the 42, 208 none."""
    from torch import nn
    from torchao.float8.float8_linear import Float8Linear

    monkeypatch.setattr(par, "fp8_unavailable", lambda device, inference=False: None)
    model = create_model("DiT-T/2", 16, 4, 10, text_dim=48)
    expected = {n for n, m in model.named_modules() if type(m) is nn.Linear and n.startswith("blocks.")
                and "adaLN" not in n and min(m.in_features, m.out_features) >= min_width}
    assert len(expected) == {192: 6 * 7, 208: 0}[min_width]
    assert par.apply_fp8(model, torch.device("cpu"), min_width=min_width) == len(expected)
    assert {n for n, m in model.named_modules() if isinstance(m, Float8Linear)} == expected


def test_run_below_the_width_warns_and_trains_in_bf16(tmp_path, monkeypatch, caplog):
    """``ditforge train --mixed_precision fp8`` on a model narrower than ``--fp8_min_width`` says so in one warning
    and trains with no float8 layer."""
    from ditforge import cli

    monkeypatch.setattr(par, "fp8_unavailable", lambda device, inference=False: None)
    with caplog.at_level("WARNING"):
        assert cli.main(["train", "--mixed_precision", "fp8", "--fp8_min_width", "4096", "--max_steps", "1",
                         "--batch_size", "4", "--sample_every", "0", "--outputs", str(tmp_path / "run")]) == 0
    assert "no linear layer of the blocks is --fp8_min_width 4096 wide" in caplog.text
    assert cli.main(["train", "--fp8_min_width", "0", "--outputs", str(tmp_path / "bad")]) == 2


def test_adapter_blocks_of_a_diffusers_transformer(monkeypatch):
    """An adapter's repeated blocks are found by their classes (HunyuanVideo's double- and single-stream blocks,
    not ``blocks.i``): every linear layer inside them becomes float8 but the adaLN regressions (``norm*.linear``) and
    a layer whose weight is stored in float8 already (``--fp8_base``), and nothing outside them (embedders, token
    refiner, output layer)."""
    from diffusers import HunyuanVideoTransformer3DModel
    from torchao.float8.float8_linear import Float8Linear

    from ditforge.models.adapters.hunyuan import HunyuanVideoDenoiser

    monkeypatch.setattr(par, "fp8_unavailable", lambda device, inference=False: None)
    torch.manual_seed(0)
    denoiser = HunyuanVideoDenoiser(HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1, num_single_layers=1,
        num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
        rope_axes_dim=(4, 6, 6)))
    linears = {n for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)}
    expected = {n for n in linears if n.startswith(("transformer.transformer_blocks.0.",
                                                    "transformer.single_transformer_blocks.0."))
                and ".norm" not in n}
    assert len(expected) == 17  # double: q, k, v, out, added q, k, v, out, 2 + 2 MLP; single: q, k, v, proj_mlp, out
    stored = "transformer.single_transformer_blocks.0.proj_mlp"  # --fp8_base stored it in float8: left as it is
    layer = denoiser.get_submodule(stored)
    layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
    expected.remove(stored)
    assert par.apply_fp8(denoiser, torch.device("cpu")) == len(expected)
    assert {n for n, m in denoiser.named_modules() if isinstance(m, Float8Linear)} == expected
