"""``linear_gelu_tanh`` (the MLP's fc1 + GELU) against float64 GELU-tanh(x W^T + b)."""

import math

import pytest
import torch
from torch import nn

from ditforge.ops.linear import linear_gelu_tanh


def reference(x: torch.Tensor, fc: nn.Linear) -> torch.Tensor:
    """GELU with the tanh approximation (Hendrycks & Gimpel 2016, eq. after 2) in float64."""
    h = x.double() @ fc.weight.double().t() + fc.bias.double()
    return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))


def test_cpu_values_and_gradients_match_float64():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    fc = nn.Linear(24, 40, dtype=torch.float64)
    with torch.no_grad():
        fc.weight.copy_(torch.randn(40, 24, generator=g) / 3)
        fc.bias.copy_(torch.randn(40, generator=g))
    x = torch.randn(2, 7, 24, generator=g, dtype=torch.float64, requires_grad=True)
    out = linear_gelu_tanh(x, fc)
    ref = reference(x, fc)
    # float64 layer (the CPU path does not depend on the dtype): 1e-12 relative. In float32 the products' rounding
    # alone reached 2.5e-7 relative (sums over 14 to 40 terms; 0.25 of the old 1e-6), in float64 ~1e-16. The exact
    # (erf) GELU, which CPU _addmm_activation computes, differs from the tanh form by ~1e-4 relative here, so a CPU
    # dispatch to it fails this.
    assert out.shape == (2, 7, 40) and out.dtype == torch.float64
    assert (out - ref).norm() / ref.norm() < 1e-12
    dout = torch.randn(2, 7, 40, generator=g, dtype=torch.float64)
    out.backward(dout)
    xd = x.detach().double().requires_grad_()
    wd, bd = fc.weight.detach().double().requires_grad_(), fc.bias.detach().double().requires_grad_()
    h = xd @ wd.t() + bd
    (0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))).backward(dout)
    for got, want in ((x.grad, xd.grad), (fc.weight.grad, wd.grad), (fc.bias.grad, bd.grad)):
        assert (got - want).norm() / want.norm() < 1e-12
    with torch.no_grad():
        assert torch.equal(linear_gelu_tanh(x, fc), out.detach())  # the no-grad CPU path is the same one


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuBLASLt epilogue path runs on CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_epilogue_is_at_least_as_accurate_as_unfused(dtype):
    g = torch.Generator("cuda").manual_seed(int(torch.randint(0, 2**31, ())))
    fc = nn.Linear(1152, 4608).cuda().to(dtype).requires_grad_(False)
    x = torch.randn(2, 256, 1152, generator=g, device="cuda", dtype=dtype)
    ref = reference(x, fc)
    with torch.no_grad():
        fused = linear_gelu_tanh(x, fc)
        unfused = torch.nn.functional.gelu(fc(x), approximate="tanh")
        compiled = torch.compile(linear_gelu_tanh, dynamic=False)(x, fc)
    err = lambda out: ((out.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    # one rounding of the result in `dtype` (2^-8 for bf16) bounds both; the epilogue rounds once, the
    # unfused path twice (product, then GELU), so it must not be worse beyond noise (10%).
    assert fused.dtype == dtype and err(fused) < 2 ** -8
    assert err(fused) <= 1.1 * err(unfused)
    assert err(compiled) <= 1.1 * err(unfused)
