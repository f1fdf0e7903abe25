"""Where a training step's GPU time goes: ``torch.profiler`` over the timed steps of a ``ditforge bench`` row
(``bench.run_steps``, so exactly what the row runs: its optimizer, the one-pass step of row f included), kernels
grouped by kind (matrix products, attention, adaLN kernels, other element-wise, optimizer + EMA), the GPU's idle
share of the wall time, and the host synchronisations in those steps (``torch.cuda.set_sync_debug_mode``: each
is a blocking copy or wait that leaves the GPU idle while the host catches up).

    PYTHONPATH=. python benchmarks/profile_step.py --model DiT-XL/2 --rows bcdef [--batch_size 64]

``--rows`` picks the row's settings as in ``ditforge bench`` (cumulative); the last letter is profiled.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections import Counter, defaultdict
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from ditforge.bench import ROWS, Settings, run_steps
from ditforge.config import BenchConfig
from timing import cuda_kernels, host_syncs

KINDS = [  # first match wins; names of cuBLAS/cuDNN/Triton/inductor kernels on Hopper
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa", "softmax")),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul", "splitk")),
    ("adaln kernels", ("layernorm_modulate", "gated_residual")),
    ("optimizer + ema", ("adam", "lerp", "foreach", "multi_tensor", "norm_kernel")),
    ("layernorm", ("layer_norm", "layernorm")),
    ("inductor fused", ("triton_",)),
]


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other element-wise")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="DiT-XL/2")
    p.add_argument("--image_size", type=int, default=256)
    p.add_argument("--num_frames", type=int)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--rows", default="abcde")
    p.add_argument("--grad_checkpoint", default="none")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--text_dim", type=int, default=0)
    p.add_argument("--text_tokens", type=int, default=120)
    p.add_argument("--fp8_recipe", default="tensorwise", help="row g's, as ditforge bench --fp8_recipe")
    p.add_argument("--out")
    args = p.parse_args()
    cfg = BenchConfig(model=args.model, image_size=args.image_size, num_frames=args.num_frames,
                      batch_size=args.batch_size, grad_checkpoint=args.grad_checkpoint, text_dim=args.text_dim,
                      text_tokens=args.text_tokens, fp8_recipe=args.fp8_recipe)
    s = Settings()
    for key, _, change in ROWS:
        if key in args.rows:
            s = replace(s, **change)
    device = torch.device("cuda")
    prof = profile(activities=[ProfilerActivity.CUDA])
    syncs: list[str] = []  # where each host sync of the timed steps came from (the Python line behind it)

    @contextlib.contextmanager
    def timed():
        with prof, host_syncs() as found:
            yield
        syncs.extend(found)

    m = run_steps(cfg, s, device, cfg.batch_size, args.steps, warmup=5, timed=timed())
    wall = m["step_time_s"] * 1e3
    per_kernel = defaultdict(float)
    for ms, name in cuda_kernels(prof):
        if ms > 0:
            per_kernel[name] += ms / args.steps  # ms per step
    total = sum(per_kernel.values())
    per_kind = defaultdict(float)
    for name, ms in per_kernel.items():
        per_kind[kind(name)] += ms
    print(f"{args.model} batch {cfg.batch_size}, settings {s}: GPU kernel time {total:.1f} ms per step, "
          f"wall {wall:.1f} ms per step (median, under the profiler; GPU idle {100 * (1 - total / wall):.0f}%), "
          f"host syncs {len(syncs) / args.steps:g} per step")
    for where, n in Counter(syncs).most_common():
        print(f"  {n / args.steps:g} per step from {where}")
    print("| kind | ms/step | share |\n|---|---:|---:|")
    for k, ms in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {ms:.1f} | {100 * ms / total:.1f}% |")
    print("\ntop kernels:\n| kernel | kind | ms/step |\n|---|---|---:|")
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:20]
    for name, ms in top:
        print(f"| {name[:90]} | {kind(name)} | {ms:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(settings=str(s), total_ms=total, wall_ms=wall, host_syncs_per_step=len(syncs) / args.steps,
                           host_syncs=Counter(syncs), per_kind=per_kind, top=top), f, indent=1)


if __name__ == "__main__":
    main()
