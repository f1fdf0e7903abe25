"""Which GELU form makes fc2's input pass (``ops.fp8.quantize_rows(gelu=True)``, 4096 x 4608 bf16) cheapest?

The pass cost 31.5 us with the GELU against 21.9 without (H100, 2026-11-27): the GELU's instructions, not the
bytes. Each variant below puts its ``_activation`` and / or ``_store_e4m3`` in place of the package's
(``ditforge.ops.triton.quant``) before anything compiles, in a process of its own (``--variant``; without it the
script runs every variant in turn), times ``rowwise_e4m3_kernel`` at the configuration ``_config`` gives, and
checks its result against ``quantize_rows_reference(gelu=True)`` (e4m3 steps off) and against float64 GELU in
the tail where float32 1 + tanh cancels (in units of about half an e4m3 step; the accuracy that
``test_quantize_rows_gelu_where_the_reference_cancels`` asks for).

    PYTHONPATH=. python benchmarks/gelu_forms.py --out benchmarks/results/sampling/gelu_forms.json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from datetime import datetime

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

K2 = tl.constexpr(-2.0 * 0.7978845608028654)  # -2 sqrt(2 / pi)


@triton.jit
def _div_full(ptrs, mask, GELU: tl.constexpr, INTERPRETED: tl.constexpr):
    h = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        h = h / (1.0 + tl.exp(h * K2 * (1.0 + 0.044715 * h * h)))
    return h


@triton.jit
def _fast_div(ptrs, mask, GELU: tl.constexpr, INTERPRETED: tl.constexpr):
    h = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        h = libdevice.fast_dividef(h, 1.0 + tl.exp(h * K2 * (1.0 + 0.044715 * h * h)))
    return h


@triton.jit
def _store_clamped(ptrs, v, mask, INTERPRETED: tl.constexpr):
    v = tl.minimum(tl.maximum(v, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


# name: (_activation, _store_e4m3) put in the package's place; None keeps the package's own
VARIANTS = {
    "exp, division, clamp (until 2026-11-27)": (_div_full, _store_clamped),
    "exp, fast_dividef, clamp": (_fast_div, _store_clamped),
    "exp2 of folded constants, fast_dividef, clamp": (None, _store_clamped),
    "exp2 of folded constants, fast_dividef, no clamp (the package)": (None, None),
}


def one(name: str) -> dict:
    from ditforge.ops import fp8
    from ditforge.ops.triton import quant
    from quant_kernel import graph_us

    activation, store = VARIANTS[name]
    quant._activation = activation or quant._activation
    quant._store_e4m3 = store or quant._store_e4m3
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(4096, 4608, device="cuda", generator=g) * 3).bfloat16()
    q, s = fp8.quantize_rows(x, gelu=True)
    q_ref, s_ref = fp8.quantize_rows_reference(x, gelu=True)
    code = lambda t: t.view(torch.uint8).to(torch.int16)  # noqa: E731 - e4m3 codes: neighbours differ by one
    off = (code(q) - code(q_ref)).abs()
    tail = -3 - 7 * torch.rand(64, 4608, device="cuda", generator=g)
    tail[:, :8] = 1e-2 * torch.rand(64, 8, device="cuda", generator=g)
    qt, st = fp8.quantize_rows(tail, gelu=True)
    h = tail.double()
    exact = h * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (h + 0.044715 * h**3))
    tail_err = ((qt.double() * st - exact).abs() / (st * 2**-9 + exact.abs() * 2**-4)).max().item()
    us = graph_us(lambda: fp8.quantize_rows(x, gelu=True))
    return dict(variant=name, us=us, scale_rel=((s - s_ref).abs() / s_ref).max().item(), steps_off_max=off.max().item(),
                steps_off_frac=(off > 0).float().mean().item(), tail_err_in_half_steps=tail_err)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant")
    p.add_argument("--out")
    args = p.parse_args()
    if args.variant:
        print(json.dumps(one(args.variant)))
        return
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print("| variant | us | max scale rel. diff | steps off (max, share) | tail error (half e4m3 steps) |")
    print("|---|---:|---:|---:|---:|")
    rows = []
    for name in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--variant", name], capture_output=True, text=True)
        if out.returncode:
            print(f"| {name} | failed: {' / '.join(out.stderr.strip().splitlines()[-6:])[:600]} |||")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(f"| {name} | {r['us']:.1f} | {r['scale_rel']:.1e} | {r['steps_off_max']}, {r['steps_off_frac']:.1e} | "
              f"{r['tail_err_in_half_steps']:.2f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(date=datetime.now().isoformat(timespec="minutes"), device=torch.cuda.get_device_name(),
                           torch=torch.__version__, triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
