"""Single-GPU training throughput of DiT-XL/2 at 256px (4x32x32 latents, synthetic), through ditforge's own
training step (diffusion loss, AdamW, EMA): images/sec, step time, peak memory and MFU per precision.

MFU = 3 x forward FLOPs (DiT.flops_per_sample: matrix products, multiply-add = 2) x images/sec / peak,
with peak = 989 TFLOP/s (H100 SXM dense bf16 datasheet) for every row, so rows compare directly.

Usage (on the GPU machine): python benchmarks/train_throughput.py [--model DiT-XL/2] [--batch_sizes 32,64]
Writes a JSON file with --json and prints a Markdown table last.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from ditforge.diffusion import create_diffusion
from ditforge.models import create_model
from ditforge.ops.attention import set_attention_backend
from ditforge.parallel.ema import EMA
from ditforge.parallel.mesh import Dist
from ditforge.train.trainer import step_randomness, train_step

PEAK_FLOPS = 989e12


def measure(name: str, precision: str, batch: int, steps: int, warmup: int) -> dict:
    """``precision``: fp32 | tf32 | bf16, with ``-flashattn`` appended for --enable_flashattn."""
    base, _, flashattn = precision.partition("-")
    set_attention_backend(bool(flashattn))
    torch.backends.cuda.matmul.allow_tf32 = base == "tf32"
    torch.backends.cudnn.allow_tf32 = base == "tf32"
    amp = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}[base]
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = create_model(name, 32, 4, 1000).to(device).train()
    ema = EMA(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0, fused=True)
    diffusion = create_diffusion(None)
    x = torch.randn(batch, 4, 32, 32, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        rnd = step_randomness(0, i, batch, (4, 32, 32), 1000, 0.1, device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = train_step(model, diffusion, opt, None, [(x, y, rnd)], amp, 1.0, Dist(device=device))
        ema.update(model, 0.9999)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    step_s = sorted(times)[len(times) // 2]
    flops = 3 * model.flops_per_sample() * batch
    row = {"model": name, "precision": precision, "batch": batch, "step_ms": step_s * 1e3,
           "images_per_sec": batch / step_s, "tflops": flops / step_s / 1e12, "mfu": flops / step_s / PEAK_FLOPS,
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": float(out["loss"]),
           "step_ms_spread": [round(min(times) * 1e3, 1), round(max(times) * 1e3, 1)]}
    del model, ema, opt
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="DiT-XL/2")
    p.add_argument("--precisions", default="fp32,tf32,bf16,bf16-flashattn")
    p.add_argument("--batch_sizes", default="32,64")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    env = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version()}
    rows = []
    for precision in args.precisions.split(","):
        for batch in map(int, args.batch_sizes.split(",")):
            rows.append(measure(args.model, precision, batch, args.steps, args.warmup))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    print(f"\n{env}\n")
    print("| model | precision | batch | step (ms) | images/sec | TFLOP/s | MFU | peak memory (GiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['precision']} | {r['batch']} | {r['step_ms']:.1f} | {r['images_per_sec']:.1f} | "
              f"{r['tflops']:.0f} | {100 * r['mfu']:.1f}% | {r['peak_memory_gib']:.1f} |")


if __name__ == "__main__":
    main()
