"""Whether float8 matrix products can pay in DiT-XL/2 training (issue 18): forward + backward of each block linear
at batch 64 x 256 tokens (M = 16,384 rows), compiled, bf16 autocast over fp32 weights (what ``ditforge bench``
rows b-f run) against torchao's float8 training recipes, and the bare GEMMs of one forward + backward (the
forward, the input gradient and the weight gradient) as bf16 ``torch.mm`` against ``torch._scaled_mm`` on operands
already in e4m3 (the ceiling: quantization free). Timed as GPU kernel time (``timing.kernel_ms``: torch.profiler,
median of 5 rounds of 4 calls after 5 warm-ups): one layer's compiled forward + backward is bound by its host
launches, and CUDA events around it measured 1.1-1.2 ms for every path, bf16 and float8 alike, against 0.2-0.8
ms of bf16 GEMMs (H100, 2026-11-27, ``results/single_gpu/fp8_linear_h100_events.log``); in a training step the
GPU is the bound, so its kernels are what a path costs there.

The table sums each path over the four layers and scales it to a step (28 blocks), beside the 63 ms of matrix
products in row f's profile (2026-11-27, ``results/single_gpu/profile_dit_xl2_row_f.json``).

    PYTHONPATH=. python benchmarks/fp8_linear.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
from timing import kernel_ms
from torch import nn

from ditforge.parallel import fp8_unavailable

SHAPES = [("qkv", 1152, 3456), ("proj", 1152, 1152), ("fc1", 1152, 4608), ("fc2", 4608, 1152)]  # (K, N)
M, DEPTH = 64 * 256, 28
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def linear_step(k: int, n: int, recipe: str | None, weights: torch.dtype):
    """A compiled forward + backward of one linear layer (bias on) with a fresh gradient of the output; torchao's
    float8 training linear for ``recipe`` (None: nn.Linear), weights in ``weights``, bf16 autocast."""
    torch._dynamo.reset()  # every layer compiles Sequential.forward afresh: no recompile limit, no eager fallback
    layer = nn.Sequential(nn.Linear(k, n)).cuda().to(weights)
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
    fn = torch.compile(layer)
    x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, n, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = None  # as a training step: no gradient accumulates into last call's
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            out = fn(x)
        out.backward(g)

    return step


def gemms(k: int, n: int, fp8: bool):
    """The three GEMMs of a linear's forward + backward: y = x W^T (M,K)x(K,N), dx = dy W (M,N)x(N,K),
    dW = dy^T x (N,M)x(M,K); in bf16, or as ``_scaled_mm`` on e4m3 operands with unit scales, bf16 out."""
    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    x, w, dy = rand(M, k), rand(n, k), rand(M, n)
    if not fp8:
        return lambda: (x @ w.t(), dy @ w, dy.t() @ x)
    e4 = torch.float8_e4m3fn
    one = torch.ones((), device="cuda")
    # _scaled_mm takes its first operand row-major and its second column-major
    xq, wq, dyq = x.to(e4), w.to(e4), dy.to(e4)
    wt_col = wq.t()                                   # (K, N) column-major
    w_col = wq.t().contiguous().t()                   # (N, K) column-major
    dyt_row = dy.t().contiguous().to(e4)              # (N, M) row-major
    x_col = xq.t().contiguous().t()                   # (M, K) column-major

    def run():  # the forward with fast accumulation, as torchao's tensorwise forward
        torch._scaled_mm(xq, wt_col, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)
        torch._scaled_mm(dyq, w_col, one, one, out_dtype=torch.bfloat16)
        torch._scaled_mm(dyt_row, x_col, one, one, out_dtype=torch.bfloat16)

    return run


def total(row: dict) -> float:
    """A path's milliseconds summed over the layers; NaN when one of them failed."""
    return sum(row.values()) if all(isinstance(v, float) for v in row.values()) else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    reason = fp8_unavailable(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if reason:
        print(f"fp8_linear.py {reason}", file=sys.stderr)
        sys.exit(2)
    import torchao
    paths = {"bf16 GEMMs": lambda k, n: gemms(k, n, False),
             "fp8 GEMMs, quantization free": lambda k, n: gemms(k, n, True),
             "bf16 linear (autocast, fp32 weights)": lambda k, n: linear_step(k, n, None, torch.float32)}
    for r in RECIPES:
        paths[f"torchao {r} (autocast, fp32 weights)"] = lambda k, n, r=r: linear_step(k, n, r, torch.float32)
        paths[f"torchao {r} (bf16 weights)"] = lambda k, n, r=r: linear_step(k, n, r, torch.bfloat16)
    table = {}
    for path, make in paths.items():
        row = {}
        for name, k, n in SHAPES:
            try:
                row[name] = kernel_ms(make(k, n))
            except Exception as e:  # a recipe that cannot run this way: its first line, and go on
                row[name] = f"failed: {str(e).strip().splitlines()[0][:120]}"
        table[path] = row
        print(path, row, flush=True)
        if args.out:  # after every path: a call cut off at its time limit keeps what it measured
            with open(args.out, "w") as f:
                json.dump(dict(date=datetime.datetime.now().isoformat(timespec="minutes"),
                               device=torch.cuda.get_device_name(), torch=torch.__version__,
                               torchao=torchao.__version__, m=M, depth=DEPTH, table=table), f, indent=1)
    base = total(table["bf16 linear (autocast, fp32 weights)"])
    print(f"\n| path | {' | '.join(s[0] for s in SHAPES)} | per layer (ms) | x {DEPTH} (ms/step) | vs bf16 linear |")
    print("|---|" + "---:|" * (len(SHAPES) + 3))
    for path, row in table.items():
        ms = total(row)
        cells = " | ".join(f"{v:.3f}" if isinstance(v, float) else v for v in row.values())
        print(f"| {path} | {cells} | {ms:.3f} | {DEPTH * ms:.1f} | {base / ms:.2f}x |")


if __name__ == "__main__":
    main()
