"""Sequence parallelism on several GPUs: a DiT-XL-size video model (vDiT-XL/122: width 1152, 28 blocks, 16 heads)
trained on one long sample per step, by variant and sequence length, in one torchrun:

    torchrun --nproc_per_node 4 benchmarks/sequence_parallel.py --out results.json
    for v in none fastseq ulysses auto; do torchrun --nproc_per_node 2 benchmarks/sequence_parallel.py \
        --tokens 32768,65536 --variants $v --out $v.json; done    # one process per variant, as measured

(On 2x H200, 2026-11-23, one run of every variant in one process died with a CUDA illegal memory access in the
32k model rows, unexplained; one process per variant did not.)

Rows: ``none`` (every GPU trains its own sample: data parallelism, the per-GPU baseline; out of memory where
one GPU cannot hold the sequence) and each sequence-parallel variant over all GPUs. Columns: median step time,
tokens/s per GPU, peak memory per GPU, and the time NCCL kernels ran per step (torch.profiler; they may overlap
compute). bf16 autocast, fast attention, fused adaLN kernels, FSDP over all GPUs, no compile.

First, per variant, one attention layer alone (``--layer_tokens``): its bf16 exactness against SDPA on the
whole sequence, its time and the NCCL time in it (no FSDP traffic mixed in: the per-layer communication).
"""

from __future__ import annotations

import argparse
import logging
import itertools
import json
import os
from collections.abc import Callable
from datetime import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile, schedule
from timing import cuda_median_ms, print_top_kernels

from ditforge.diffusion import create_diffusion
from ditforge.models import create_model
from ditforge.parallel import parallelize
from ditforge.parallel.mesh import Dist
from ditforge.train.step import step_randomness, train_step

SHAPES = {8192: (32, 32), 32768: (32, 64), 65536: (64, 64)}  # tokens -> (latent frames, latent side); patch 1x2x2


def timed(fn, warmup: int, steps: int):
    """``warmup`` calls of fn, then the median of ``steps`` calls timed with CUDA events (ms), then one call under
    torch.profiler: (median ms, the profile, the NCCL kernel ms of the profiled call). The profiler runs one
    unrecorded call and a barrier first: starting it takes each process a different time, and an NCCL kernel's
    time includes waiting for its peers, so a cold start would be counted as communication."""
    ms = cuda_median_ms(fn, steps, warmup)
    with profile(activities=[ProfilerActivity.CUDA], schedule=schedule(wait=0, warmup=1, active=1, repeat=1)) as prof:
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        prof.step()  # the recorded call
        fn()
        torch.cuda.synchronize()
        prof.step()
    comm = sum(e.device_time_total for e in prof.key_averages() if "nccl" in e.key.lower()) / 1e3
    return ms, prof, comm


def record_collectives(fn) -> Callable[[], None]:
    """Call fn once, recording the torch.distributed collectives it issues (all-to-all, all-gather,
    reduce-scatter, batched point-to-point) with their tensors; returns a function that issues the same
    collectives again on those buffers, one after another and nothing else: the communication alone,
    without the compute it overlaps or contends with."""
    calls = []
    originals = {n: getattr(dist, n) for n in ("all_to_all_single", "all_gather_into_tensor", "all_gather_single",
                                                "reduce_scatter_tensor", "reduce_scatter_single",
                                                "batch_isend_irecv") if hasattr(dist, n)}

    def detached(a):  # the replay writes into the buffers again, outside autograd
        if isinstance(a, torch.Tensor):
            return a.detach()
        if isinstance(a, list):
            return [dist.P2POp(o.op, o.tensor.detach(), o.peer, o.group, o.tag) for o in a]
        return a

    def recording(orig):
        def call(*args, **kwargs):
            calls.append((orig, [detached(a) for a in args], kwargs))
            return orig(*args, **kwargs)
        return call

    try:
        for name, orig in originals.items():
            setattr(dist, name, recording(orig))
        fn()
    finally:
        for name, orig in originals.items():
            setattr(dist, name, orig)

    def replay() -> None:
        for orig, args, kwargs in calls:
            works = orig(*args, **kwargs)
            for w in works if isinstance(works, list) else [works]:
                if w is not None:
                    w.wait()

    return replay


def run(d: Dist, variant: str, tokens: int, steps: int, warmup: int, top: int = 0) -> dict:
    frames, side = SHAPES[tokens]
    torch.manual_seed(0)
    model = create_model("vDiT-XL/122", side, 4, 1000, num_frames=frames).to(d.device).train()
    model = parallelize(model, d, "fsdp", attention="fast", param_dtype=torch.bfloat16, enable_modulate_kernel=True,
                        sequence_parallel_type=variant if variant != "none" else "auto")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    diffusion = create_diffusion(None).to(d.device)  # tables on the GPU, as the trainer's: no sync per step
    shape = (4, frames, side, side)
    x = torch.randn((1, *shape), device=d.device)
    y = torch.zeros(1, dtype=torch.long, device=d.device)

    counter = itertools.count()

    def step() -> None:
        rnd = step_randomness(0, next(counter), d.dp_size, shape, diffusion, 0.1, d.device, d.dp_rank, d.dp_size)
        train_step(model, diffusion, opt, None, [(x, {"y": y}, rnd)], torch.bfloat16, 1.0, d)

    torch.cuda.reset_peak_memory_stats()
    ms, prof, comm = timed(step, warmup, steps)
    if top and d.rank == 0:  # where the profiled step's GPU time went
        print_top_kernels(prof, top, f"{variant} {tokens}")
    t = ms / 1e3
    per_gpu = tokens / t / d.sp_size  # one sample of `tokens` per sp group per step
    return dict(variant=variant, tokens=tokens, step_s=t, tokens_per_s_per_gpu=per_gpu,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30, nccl_ms=comm)


def attention_layer(variant: str, group, rank: int, world: int, device: torch.device, tokens: int) -> dict:
    """One attention layer of vDiT-XL's width (16 heads of 72; qkv projection included, FastSeq gathers its
    input) in bf16, forward and backward, on ``tokens`` tokens split over the group: first the exactness of this
    rank's output and input gradient against SDPA on the whole sequence (max |error| / max |reference|), then
    the median time of the layer, the NCCL kernel time in one profiled call (overlapped with compute, so
    slowed by it, and including waits for the peer) and the median time of the layer's collectives issued
    alone (ms): the communication time per layer that issue 4 compares."""
    import torch.nn.functional as F

    from ditforge.models.layers import Attention
    from ditforge.parallel.sequence.shard import SequenceShard

    torch.manual_seed(0)
    layer = Attention(1152, 16).to(device, torch.bfloat16)
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(1, tokens, 1152, generator=g, device=device, dtype=torch.bfloat16)
    dout = torch.randn(1, 16, tokens, 72, generator=g, device=device, dtype=torch.bfloat16)
    whole = x.clone().requires_grad_()
    ref = F.scaled_dot_product_attention(*layer.project(whole))
    ref.backward(dout)
    n = tokens // world
    rows = slice(rank * n, (rank + 1) * n)
    shard = SequenceShard(dist.group.WORLD, variant, 16, group)  # what the model's attention calls

    def split() -> tuple[torch.Tensor, torch.Tensor]:
        local = x[:, rows].clone().requires_grad_()
        out = shard.attention(local, layer.project)
        out.backward(dout[:, :, rows])
        return out, local

    out, local = split()
    errs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for a, b in ((out, ref[:, :, rows]), (local.grad, whole.grad[:, rows]))]
    del ref, whole
    ms, _, comm = timed(split, 3, 10)
    alone = cuda_median_ms(record_collectives(split), 10, 3)
    return dict(variant=variant, check=f"bf16 attention layer vs SDPA, {tokens} tokens", tokens=tokens,
                out_rel_err=errs[0], grad_rel_err=errs[1], layer_ms=ms, layer_nccl_ms=comm, comm_alone_ms=alone)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="8192,32768,65536")
    p.add_argument("--variants", default="none,fastseq,fastseq_kv,ulysses,ring,usp")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out")
    p.add_argument("--top", type=int, default=0, help="print the N slowest kernels of each profiled step")
    p.add_argument("--layer_tokens", type=int, default=32768, help="tokens of the one-layer check and timing")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")  # auto's choice
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp",))
    rows = []
    for variant in args.variants.split(","):
        if variant in ("none", "auto"):
            continue
        group = init_device_mesh("cuda", (world // 2, 2), mesh_dim_names=("ring", "ulysses")) if variant == "usp" \
            else mesh
        row = attention_layer(variant, group, rank, world, device, args.layer_tokens)
        if rank == 0:
            print(json.dumps(row), flush=True)
        rows.append(row)
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for variant in args.variants.split(","):
            sp = 1 if variant == "none" else world
            sp_mesh = init_device_mesh("cuda", (world // sp, sp), mesh_dim_names=("dp", "sp")) if sp > 1 else None
            d = Dist(rank=rank, world_size=world, local_rank=rank, device=device, mesh=mesh, sp_mesh=sp_mesh)
            try:
                row = run(d, variant, tokens, args.steps, args.warmup, args.top)
            except torch.OutOfMemoryError:
                row = dict(variant=variant, tokens=tokens, error="out of memory")
            except (ValueError, RuntimeError) as e:
                row = dict(variant=variant, tokens=tokens, error=" ".join(str(e).split())[:120])
            torch.cuda.empty_cache()
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        print(f"\nvDiT-XL/122, {world} x {torch.cuda.get_device_name(device)}, torch {torch.__version__}\n")
        print(f"One attention layer (qkv projection + attention, forward + backward), {args.layer_tokens:,} tokens:\n")
        print("| variant | output rel. error | dx rel. error | layer ms | NCCL kernel ms in the layer | "
              "its collectives alone, ms |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            if "check" in r:
                print(f"| {r['variant']} | {r['out_rel_err']:.2e} | {r['grad_rel_err']:.2e} | {r['layer_ms']:.2f} | "
                      f"{r['layer_nccl_ms']:.2f} | {r['comm_alone_ms']:.2f} |")
        print("\nWhole model, one sample per step:\n")
        print("| tokens | variant | step (s) | tokens/s per GPU | peak GiB per GPU | NCCL ms/step |")
        print("|---:|---|---:|---:|---:|---:|")
        for r in rows:
            if "check" in r:
                continue
            if "error" in r:
                print(f"| {r['tokens']:,} | {r['variant']} | {r['error']} | | | |")
            else:
                print(f"| {r['tokens']:,} | {r['variant']} | {r['step_s']:.3f} | {r['tokens_per_s_per_gpu']:,.0f} | "
                      f"{r['peak_gib']:.1f} | {r['nccl_ms']:.1f} |")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(date=datetime.now().isoformat(timespec="seconds"), world=world,
                               gpu=torch.cuda.get_device_name(device), torch=torch.__version__, rows=rows), f,
                          indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
