"""Large DiTs on several GPUs (issue 45): training TFLOPS and tokens/s per GPU of one parallel plan, counted as
NeMo counts its rows (every matrix product, attention included, x 3 for training: ``flops_per_sample()``).

The model is built on the meta device and each process initialises its own shards (``parallel.init_sharded``), so
no process ever holds the whole model; it trains on synthetic latents of the row's shape through the trainer's own
``train_step`` (diffusion loss, AdamW, clipping; EMA unless ``--ema_decay 0``). The step time is the median over
``--steps`` timed steps (CUDA events, the slowest rank's), after ``--warmup`` steps. ``--batch_per_gpu`` is the
batch of each data-parallel group (the processes of one sequence- or tensor-parallel group share it).

Usage (one row per call; ``--json`` appends the row to a file):
    torchrun --nproc_per_node 4 benchmarks/scale.py --model vDiT-7B/222 --image_size 512 --num_frames 16 \
        --plugin zero2 --batch_per_gpu 1 --json OUT.json      (--tensor_parallel 2: dp 2 x tp 2)
    torchrun --nproc_per_node 4 benchmarks/scale.py --model vDiT-7B/222 --image_size 1024 --num_frames 32 \
        --plugin fsdp --sequence_parallel_size 4 --sequence_parallel_type ulysses --grad_checkpoint full
A row that does not fit is recorded with ``"status": "out of memory"``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch

from timing import max_over_ranks

from ditforge.bench import peak_flops
from ditforge.diffusion import create_diffusion
from ditforge.models import create_model
from ditforge.parallel import init_sharded, parallelize
from ditforge.parallel.ema import EMA
from ditforge.parallel.mesh import init_distributed, shutdown
from ditforge.train.trainer import step_randomness, train_step

def run(args) -> dict:
    d = init_distributed("auto", args.sequence_parallel_size, tensor_parallel_size=args.tensor_parallel)
    cuda = d.device.type == "cuda"
    side, frames = args.image_size // 8, args.num_frames  # latents: 4 channels, 8x smaller
    shape = (4, frames, side, side) if args.num_frames else (4, side, side)
    extra = {"num_frames": frames} if args.num_frames else {}
    torch.manual_seed(0)
    skeleton = create_model(args.model, side, 4, 1000, device=torch.device("meta"), **extra)
    flops, tokens = skeleton.flops_per_sample(), skeleton.x_embedder.num_patches
    params = sum(p.numel() for p in skeleton.parameters())
    model = parallelize(copy.deepcopy(skeleton), d, args.plugin, args.grad_checkpoint, args.compile,
                        "fast" if cuda else "auto", param_dtype=torch.bfloat16 if cuda else None,
                        sequence_parallel_type=args.sequence_parallel_type, batch_size=args.batch_per_gpu)
    init_sharded(model, skeleton, d)
    model.train()
    ema = EMA(model, alias=args.ema_decay == 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0, fused=cuda)
    diffusion = create_diffusion(None).to(d.device)
    g = torch.Generator(d.device).manual_seed(d.dp_rank)
    x = torch.randn((args.batch_per_gpu, *shape), generator=g, device=d.device)
    y = torch.randint(0, 1000, (args.batch_per_gpu,), generator=g, device=d.device)
    amp = torch.bfloat16 if cuda else torch.float32
    global_batch = args.batch_per_gpu * d.dp_size
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup + args.steps):
        rnd = step_randomness(0, i, global_batch, shape, diffusion, 0.1, d.device, d.dp_rank, d.dp_size)
        d.barrier()
        start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            start.record()
        terms = train_step(model, diffusion, opt, None, [(x, {"y": y}, rnd)], amp, 1.0, d)
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
    samples_per_gpu = global_batch / step_s / d.world_size  # an SP group shares its samples
    peak = peak_flops(d.device, None)  # dense bf16 of the datasheet
    tflops = 3 * flops * samples_per_gpu / 1e12
    row = {"model": args.model, "tokens_per_sample": tokens, "params_b": params / 1e9, "gpus": d.world_size,
           "plan": plan_name(args), "batch_per_gpu": args.batch_per_gpu, "step_s": step_s,
           "tokens_per_s_per_gpu": samples_per_gpu * tokens, "tflops_per_gpu": tflops,
           "mfu": tflops * 1e12 / peak if peak else None, "loss": float(terms["loss"]),
           "grad_norm": float(terms["grad_norm"]),
           "peak_memory_gib": max_over_ranks(torch.cuda.max_memory_allocated() / 2**30, d.device) if cuda else None}
    shutdown(d)
    return row


def plan_name(args) -> str:
    parts = [args.plugin]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vDiT-7B/222")
    p.add_argument("--image_size", type=int, default=512)
    p.add_argument("--num_frames", type=int, default=16, help="0: an image model")
    p.add_argument("--batch_per_gpu", type=int, default=1)
    p.add_argument("--plugin", default="zero2", choices=["zero2", "fsdp"])
    p.add_argument("--sequence_parallel_size", type=int, default=1)
    p.add_argument("--sequence_parallel_type", default="ulysses")
    p.add_argument("--tensor_parallel", type=int, default=1)
    p.add_argument("--grad_checkpoint", default="none")
    p.add_argument("--compile", default="default")
    p.add_argument("--ema_decay", type=float, default=0.9999)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    try:
        row = run(args)
    except torch.OutOfMemoryError as e:
        row = {"model": args.model, "plan": plan_name(args), "batch_per_gpu": args.batch_per_gpu,
               "status": "out of memory", "error": str(e).splitlines()[0]}
    if int(os.environ.get("RANK", "0")) == 0:
        row["env"] = {"date": time.strftime("%Y-%m-%dT%H:%M"), "torch": torch.__version__,
                      "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        print(json.dumps(row), flush=True)
        if args.json:
            path = Path(args.json)
            rows = json.loads(path.read_text()) if path.exists() else []
            path.write_text(json.dumps(rows + [row], indent=1))


if __name__ == "__main__":
    main()
