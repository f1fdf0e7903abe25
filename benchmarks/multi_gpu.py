"""Data-parallel training of DiT-XL/2 at 256px (4x32x32 latents, synthetic) per plugin through ditforge's
own parallelize / EMA / train_step / Checkpointer: images/sec per GPU, scaling against one GPU, peak memory
and the memory of weights + optimizer states + EMA per GPU; and how long a checkpoint save blocks training,
synchronous against asynchronous.

Usage: bash benchmarks/run.sh multi-gpu      (runs 1 GPU, then all GPUs, and prints the table)
       torchrun --nproc_per_node N benchmarks/multi_gpu.py --plugins ddp,zero2,fsdp --json OUT.json
       python benchmarks/multi_gpu.py --table ONE.json MANY.json     (the markdown table of two such runs)
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from timing import max_over_ranks

from ditforge.diffusion import create_diffusion
from ditforge.models import create_model
from ditforge.parallel import parallelize
from ditforge.parallel.ema import EMA
from ditforge.parallel.mesh import init_distributed, shutdown
from ditforge.train import checkpoint as ckpt_io
from ditforge.train.trainer import step_randomness, train_step


def run_plugin(d, plugin, model_name, batch_per_gpu, steps, warmup, save_dir):
    device = d.device
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = create_model(model_name, 32, 4, 1000).to(device).train()
    model = parallelize(model, d, plugin, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ema = EMA(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0, fused=True)
    diffusion = create_diffusion(None).to(device)  # tables on the GPU, as the trainer's: no sync per step
    global_batch = batch_per_gpu * d.world_size
    x = torch.randn(batch_per_gpu, 4, 32, 32, device=device)
    y = torch.randint(0, 1000, (batch_per_gpu,), device=device)
    times = []
    for i in range(warmup + steps):
        rnd = step_randomness(0, i, global_batch, (4, 32, 32), diffusion, 0.1, device, d.rank, d.world_size)
        if d.world_size > 1:
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        train_step(model, diffusion, opt, None, [(x, y, rnd)], torch.bfloat16, 1.0, d)
        ema.update(model, 0.9999)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(max_over_ranks(start.elapsed_time(end) / 1e3, device))
    step_s = sorted(times)[len(times) // 2]
    static_gib = max_over_ranks(torch.cuda.memory_allocated() / 2**30, device)  # weights + Adam + EMA, no grads
    row = {"plugin": plugin, "gpus": d.world_size, "batch_per_gpu": batch_per_gpu, "step_ms": step_s * 1e3,
           "images_per_sec_per_gpu": batch_per_gpu / step_s,
           "peak_memory_gib": max_over_ranks(torch.cuda.max_memory_allocated() / 2**30, device),
           "weights_optimizer_ema_gib": static_gib}
    if save_dir is not None:
        state = ckpt_io.training_state(model, opt, ema)
        for mode in ("sync", "async"):
            root = Path(save_dir) / f"{plugin}-{mode}"
            cp = ckpt_io.Checkpointer(root, keep_last=2, async_save=mode == "async", d=d)
            hook = opt.register_step_pre_hook(lambda *_: cp.wait_for_staging())
            for k in (1, 2):  # the second save shows the steady state (pinned host buffers already allocated)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                cp.save(k, state, {"bench": True})
                # Training goes on: one more step, which waits for the copy off the GPU before it updates.
                rnd = step_randomness(0, 99, global_batch, (4, 32, 32), diffusion, 0.1, device, d.rank, d.world_size)
                train_step(model, diffusion, opt, None, [(x, y, rnd)], torch.bfloat16, 1.0, d)
                torch.cuda.synchronize()
                blocked = time.perf_counter() - t0 - step_s
                cp.wait()
                total = time.perf_counter() - t0 - step_s
            hook.remove()
            row[f"save_{mode}_blocking_s"] = max_over_ranks(blocked, device)
            row[f"save_{mode}_total_s"] = max_over_ranks(total, device)
            if d.is_main:
                shutil.rmtree(root, ignore_errors=True)
    del model, ema, opt
    return row


def table(one_path: str, many_path: str) -> None:
    """Print the markdown table of a 1-GPU run and an N-GPU run, scaling against the 1-GPU run's first row."""
    one, many = (json.loads(Path(path).read_text()) for path in (one_path, many_path))
    base = one["rows"][0]["images_per_sec_per_gpu"]
    print(f"{many['env']}\n")
    print("| plugin | GPUs | images/sec per GPU | scaling vs 1 GPU | peak memory (GiB) | weights + Adam + EMA (GiB) |"
          " save blocks (sync) | save blocks (async) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in one["rows"] + many["rows"]:
        save = (f"{r['save_sync_blocking_s']:.2f} s | {r['save_async_blocking_s']:.2f} s "
                f"({100 * r['save_async_blocking_s'] / r['save_sync_blocking_s']:.0f}%)"
                if "save_sync_blocking_s" in r else "- | -")
        print(f"| {r['plugin']} | {r['gpus']} | {r['images_per_sec_per_gpu']:.1f} | "
              f"{100 * r['images_per_sec_per_gpu'] / base:.1f}% | {r['peak_memory_gib']:.1f} | "
              f"{r['weights_optimizer_ema_gib']:.1f} | {save} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--table", nargs=2, metavar=("ONE_JSON", "MANY_JSON"), help="print the table of two runs and exit")
    p.add_argument("--model", default="DiT-XL/2")
    p.add_argument("--plugins", default="ddp,zero2,fsdp")
    p.add_argument("--batch_per_gpu", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--save_plugin", default="zero2", help="plugin whose checkpoint save is timed ('' for none)")
    p.add_argument("--save_dir", default=None)
    p.add_argument("--json")
    args = p.parse_args()
    if args.table:
        table(*args.table)
        return
    d = init_distributed("cuda")
    rows = []
    save_root = args.save_dir or tempfile.mkdtemp()
    for plugin in args.plugins.split(","):
        save = save_root if plugin == args.save_plugin else None
        rows.append(run_plugin(d, plugin, args.model, args.batch_per_gpu, args.steps, args.warmup, save))
        if d.is_main:
            print(json.dumps(rows[-1]), flush=True)
    if d.is_main and args.json:
        env = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "cuda": torch.version.cuda, "gpus": d.world_size}
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    shutdown(d)


if __name__ == "__main__":
    main()
