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
    chosen = [n for n, m in model.named_modules() if par._big_linear(m, n)]
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
