"""Training on several GPUs through ditforge's own parallelize / init_sharded / EMA / train_step / Checkpointer, on
synthetic latents, one row per plugin:

- data-parallel scaling (the defaults: DiT-XL/2 at 256px, 4x32x32 latents, 64 images per GPU; ddp, zero2, fsdp):
  images/s per GPU, scaling against one GPU, peak memory and the memory of weights + optimizer states + EMA per
  GPU; and how long a checkpoint save blocks training, synchronous against asynchronous (``--save_plugin``);
- large DiTs (issue 45, ``run.sh scale``): TFLOPS and tokens/s per GPU of one parallel plan (``--tensor_parallel``,
  ``--sequence_parallel_size``, ``--grad_checkpoint``, ``--compile``), counted as NeMo counts its rows: every matrix
  product, attention included, x 3 (``flops_per_sample()``).

Under zero2 / fsdp the model is built on the meta device and each process initialises only its shards
(``parallel.init_sharded``). The step time is the slowest rank's median over ``--steps`` timed steps (CUDA events),
after ``--warmup``. ``--batch_per_gpu`` is the batch of each data-parallel group (the processes of one sequence- or
tensor-parallel group share it). A plugin that does not fit is recorded with ``"status": "out of memory"``.

Usage: bash benchmarks/run.sh multi-gpu      (runs 1 GPU, then all GPUs, and prints the table)
       bash benchmarks/run.sh scale [ROWS]   (the large-DiT rows, one torchrun a row)
       torchrun --nproc_per_node N benchmarks/multi_gpu.py --plugins ddp,zero2,fsdp --json OUT.json
       torchrun --nproc_per_node 4 benchmarks/multi_gpu.py --model vDiT-7B/222 --image_size 512 --num_frames 16 \
           --plugins zero2 --batch_per_gpu 1 --enable_flashattn --compile default --save_plugin "" --json OUT.json
       python benchmarks/multi_gpu.py --table ONE.json MANY.json     (the markdown table of two such runs)
``--json`` adds the rows to the file's rows (a new file: with the run's environment).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from timing import kernel_ms_by_kind, max_over_ranks

from ditforge.bench import peak_flops
from ditforge.diffusion import create_diffusion
from ditforge.models import create_model
from ditforge.parallel import init_sharded, parallelize
from ditforge.parallel.ema import EMA
from ditforge.parallel.mesh import init_distributed, shutdown
from ditforge.train import checkpoint as ckpt_io
from ditforge.train.step import step_randomness, train_step


def run_plugin(d, plugin: str, args, save_dir: str | None) -> dict:
    cuda = d.device.type == "cuda"
    side = args.image_size // 8  # latents: 4 channels, 8x smaller
    shape = (4, args.num_frames, side, side) if args.num_frames else (4, side, side)
    extra = {"num_frames": args.num_frames} if args.num_frames else {}
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    meta = plugin in ("zero2", "fsdp")
    skeleton = create_model(args.model, side, 4, 1000, device="meta" if meta else d.device, **extra)
    flops, tokens = skeleton.flops_per_sample(), skeleton.x_embedder.num_patches
    params = sum(p.numel() for p in skeleton.parameters())
    model = parallelize(copy.deepcopy(skeleton) if meta else skeleton, d, plugin, args.grad_checkpoint, args.compile,
                        "fast" if args.enable_flashattn else "auto", param_dtype=torch.bfloat16 if cuda else None,
                        reduce_dtype=torch.float32, sequence_parallel_type=args.sequence_parallel_type,
                        batch_size=args.batch_per_gpu)
    if meta:
        init_sharded(model, skeleton, d)
    model.train()
    ema = EMA(model, alias=args.ema_decay == 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0, fused=cuda)
    diffusion = create_diffusion(None).to(d.device)  # tables on the device, as the trainer's: no sync per step
    g = torch.Generator(d.device).manual_seed(d.dp_rank)
    x = torch.randn((args.batch_per_gpu, *shape), generator=g, device=d.device)
    y = torch.randint(0, 1000, (args.batch_per_gpu,), generator=g, device=d.device)
    amp = torch.bfloat16 if cuda else torch.float32
    global_batch = args.batch_per_gpu * d.dp_size

    def step(i: int) -> dict:
        rnd = step_randomness(0, i, global_batch, shape, diffusion, 0.1, d.device, d.dp_rank, d.dp_size)
        return train_step(model, diffusion, opt, None, [(x, {"y": y}, rnd)], amp, 1.0, d)

    times = []
    for i in range(args.warmup + args.steps):
        d.barrier()
        start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            start.record()
        terms = step(i)
        ema.update(model, args.ema_decay)
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            seconds = time.perf_counter() - start
        if i >= args.warmup:
            times.append(max_over_ranks(seconds, d.device))
    step_s = statistics.median(times)
    samples_per_gpu = global_batch / step_s / d.world_size  # a sequence- or tensor-parallel group shares its samples
    peak = peak_flops(d.device, None)  # dense bf16 of the datasheet
    tflops = 3 * flops * samples_per_gpu / 1e12
    memory = (lambda gib: max_over_ranks(gib / 2**30, d.device)) if cuda else (lambda gib: None)
    row = {"model": args.model, "plan": plan_name(plugin, args), "plugin": plugin, "gpus": d.world_size,
           "batch_per_gpu": args.batch_per_gpu, "step_s": step_s, "images_per_sec_per_gpu": samples_per_gpu,
           "tokens_per_sample": tokens, "tokens_per_s_per_gpu": samples_per_gpu * tokens, "tflops_per_gpu": tflops,
           "mfu": tflops * 1e12 / peak if peak else None, "params_b": params / 1e9, "loss": float(terms["loss"]),
           "grad_norm": float(terms["grad_norm"]),
           "peak_memory_gib": memory(torch.cuda.max_memory_allocated() if cuda else 0),
           # weights + Adam + EMA, no gradients
           "weights_optimizer_ema_gib": memory(torch.cuda.memory_allocated() if cuda else 0)}
    if args.profile and cuda:
        # rank 0's, each rank profiling its own steps (NCCL's kernels are "communication")
        row["kernel_ms_by_kind"] = kernel_ms_by_kind(lambda: step(args.warmup + args.steps))
        d.barrier()
    if save_dir is not None:
        row.update(save_blocking(d, plugin, model, opt, ema, lambda: step(99), step_s, save_dir))
    del model, ema, opt
    return row


def save_blocking(d, plugin, model, opt, ema, step, step_s: float, save_dir: str) -> dict:
    """How long a checkpoint save blocks training, and takes in all, synchronous against asynchronous."""
    row = {}
    state = ckpt_io.training_state(model, opt, ema)
    for mode in ("sync", "async"):
        root = Path(save_dir) / f"{plugin}-{mode}"
        cp = ckpt_io.Checkpointer(root, keep_last=2, async_save=mode == "async", d=d)
        hook = opt.register_step_pre_hook(lambda *_: cp.wait_for_staging())
        for k in (1, 2):  # the second save shows the steady state (pinned host buffers already allocated)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cp.save(k, state, {"bench": True})
            step()  # training goes on: one more step, which waits for the copy off the GPU before it updates
            torch.cuda.synchronize()
            blocked = time.perf_counter() - t0 - step_s
            cp.wait()
            total = time.perf_counter() - t0 - step_s
        hook.remove()
        row[f"save_{mode}_blocking_s"] = max_over_ranks(blocked, d.device)
        row[f"save_{mode}_total_s"] = max_over_ranks(total, d.device)
        if d.is_main:
            shutil.rmtree(root, ignore_errors=True)
    return row


def plan_name(plugin: str, args) -> str:
    parts = [plugin]
    if args.tensor_parallel > 1:
        parts.append(f"tp{args.tensor_parallel}")
    if args.sequence_parallel_size > 1:
        parts.append(f"sp{args.sequence_parallel_size} {args.sequence_parallel_type}")
    if args.grad_checkpoint != "none":
        parts.append(f"checkpoint {args.grad_checkpoint}")
    if args.compile != "none":
        parts.append("compile")
    parts.append("no EMA" if args.ema_decay == 0 else "EMA")
    return " + ".join(parts)


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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", nargs=2, metavar=("ONE_JSON", "MANY_JSON"), help="print the table of two runs and exit")
    p.add_argument("--model", default="DiT-XL/2")
    p.add_argument("--image_size", type=int, default=256)
    p.add_argument("--num_frames", type=int, default=0, help="latent frames of a video model (0: an image model)")
    p.add_argument("--plugins", default="ddp,zero2,fsdp")
    p.add_argument("--batch_per_gpu", type=int, default=64)
    p.add_argument("--sequence_parallel_size", type=int, default=1)
    p.add_argument("--sequence_parallel_type", default="ulysses")
    p.add_argument("--tensor_parallel", type=int, default=1)
    p.add_argument("--grad_checkpoint", default="none")
    p.add_argument("--compile", default="none")
    p.add_argument("--enable_flashattn", action="store_true")
    p.add_argument("--ema_decay", type=float, default=0.9999)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--save_plugin", default="zero2", help="plugin whose checkpoint save is timed ('' for none)")
    p.add_argument("--save_dir", default=None)
    p.add_argument("--json")
    p.add_argument("--profile", action="store_true", help="add rank 0's GPU kernel time per step by kind")
    args = p.parse_args()
    if args.table:
        table(*args.table)
        return
    d = init_distributed("auto", args.sequence_parallel_size, tensor_parallel_size=args.tensor_parallel)
    rows = []
    save_root = args.save_dir or tempfile.mkdtemp()
    for plugin in args.plugins.split(","):
        try:
            rows.append(run_plugin(d, plugin, args, save_root if plugin == args.save_plugin else None))
        except torch.OutOfMemoryError as e:
            rows.append({"model": args.model, "plan": plan_name(plugin, args), "plugin": plugin,
                         "batch_per_gpu": args.batch_per_gpu, "status": "out of memory",
                         "error": str(e).splitlines()[0]})
        if d.is_main:
            print(json.dumps(rows[-1]), flush=True)
    if d.is_main and args.json:
        path = Path(args.json)
        if path.exists():
            run = json.loads(path.read_text())
        else:
            cuda = torch.cuda.is_available()
            run = {"env": {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if cuda else "cpu",
                           "torch": torch.__version__, "cuda": torch.version.cuda, "gpus": d.world_size}, "rows": []}
        run["rows"] += rows
        path.write_text(json.dumps(run, indent=1))
    shutdown(d)


if __name__ == "__main__":
    main()
