"""Time of one optimizer step over DiT-XL/2's parameters (675M) on a GPU: the libraries' kernels against the
one-pass Triton step (``--fused_optimizer``), for each placement. Each row: clipping (global norm, then scaling)
+ AdamW + EMA where the row has one. CUDA events, median of 20 steps after 5 warm-up steps.

    PYTHONPATH=. python benchmarks/optimizer_step.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import cuda_median_ms

from ditforge.models import create_model
from ditforge.parallel import clip_coefficient, squared_norm
from ditforge.parallel.ema import EMA
from ditforge.parallel.optim import CompensatedAdamW

ROWS = [  # name, weights dtype, states, ema
    ("fp32 + EMA", torch.float32, "fp32", True),
    ("8-bit moments, Kahan bf16, no EMA", torch.bfloat16, "8bit", False),
    ("8-bit moments, fp32 + EMA", torch.float32, "8bit", True),
]


def run(dtype, states, ema_on, fused):
    torch.manual_seed(0)
    model = create_model("DiT-XL/2", 32, 4, 1000).cuda()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    params = list(model.parameters())
    if not fused and states == "fp32" and dtype == torch.float32:
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    else:
        opt = CompensatedAdamW(params, lr=1e-4, states=states, fused=fused)
    ema = EMA(model, alias=not ema_on)
    if ema.fuse_into(model, opt):
        opt.ema_decay = 0.9999
    for p in params:  # the same gradient tensors every step, as the caching allocator mostly hands them back
        p.grad = torch.randn_like(p)

    def step():
        coef = clip_coefficient(squared_norm([p.grad for p in params]).sqrt(), 1.0)
        if getattr(opt, "folds_clipping", False):
            opt.clip_coef = coef
        else:
            torch._foreach_mul_([p.grad for p in params], coef)
        opt.step()
        ema.update(model, 0.9999)

    return cuda_median_ms(step, steps=20, warmup=5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for name, dtype, states, ema_on in ROWS:
        lib = run(dtype, states, ema_on, fused=False)
        one = run(dtype, states, ema_on, fused=True)
        rows.append(dict(row=name, library_ms=round(lib, 2), one_pass_ms=round(one, 2), speedup=round(lib / one, 2)))
        print(f"| {name} | {lib:.2f} ms | {one:.2f} ms | {lib / one:.2f}x |", flush=True)
    if args.out:
        env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
