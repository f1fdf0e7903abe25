"""Time of one optimizer step over DiT-XL/2's parameters (675M) on a GPU.

Default: the libraries' kernels against the one-pass Triton step (``--fused_optimizer``), for each placement. Each
row: clipping (global norm, then scaling) + AdamW + EMA where the row has one. CUDA events, median of 20 steps
after 5 warm-up steps.

``--offload``: what ``--cpu_offload optimizer`` costs on this machine instead: pinned host <-> GPU copy bandwidth
(each way alone, both at once on two streams), and one step (bf16 weights, stochastic rounding, 8-bit moments) with
the states resident on the GPU against streamed from pinned host memory. A step alone has nothing to overlap its
transfers with, so the offloaded row is about the state's bytes over the bandwidth; inside a backward
(``--fused_backward_pass``) the transfers overlap the blocks' compute.

``--sharded``: the one-pass step over FSDP2's shards (each DiT block and the model under ``fully_shard`` on a
one-GPU mesh: DTensor parameters and states, stepped shard by shard) against the same step over plain tensors,
with whether the weights after the timed steps are equal bit for bit.

    PYTHONPATH=. python benchmarks/optimizer_step.py [--offload | --sharded] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import cuda_median_ms
from torch.distributed.tensor import DTensor

from ditforge.models import create_model
from ditforge.parallel import clip_coefficient, squared_norm
from ditforge.parallel.ema import EMA, local_shard
from ditforge.optim.compensated import CompensatedAdamW

ROWS = [  # name, weights dtype, states, ema
    ("fp32 + EMA", torch.float32, "fp32", True),
    ("8-bit moments, Kahan bf16, no EMA", torch.bfloat16, "8bit", False),
    ("8-bit moments, fp32 + EMA", torch.float32, "8bit", True),
]


def run(dtype, states, ema_on, fused, sharded=False, weights=None):
    """Median ms of one step; ``weights`` (a list) receives the weights after the timed steps."""
    torch.manual_seed(0)
    model = create_model("DiT-XL/2", 32, 4, 1000).cuda()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    if sharded:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29511", rank=0, world_size=1)
        mesh = init_device_mesh("cuda", (1,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    if not fused and states == "fp32" and dtype == torch.float32:
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    else:
        opt = CompensatedAdamW(params, lr=1e-4, states=states, fused=fused)
    ema = EMA(model, alias=not ema_on)
    if ema.fuse_into(model, opt):
        opt.ema_decay = 0.9999
    for p in params:  # the same gradient tensors every step, as the caching allocator mostly hands them back
        grad = torch.randn_like(local_shard(p))  # sharded: the plain run's draws, as the one shard of one GPU
        p.grad = DTensor.from_local(grad, p.device_mesh, p.placements) if isinstance(p, DTensor) else grad

    def step():
        coef = clip_coefficient(squared_norm([local_shard(p.grad) for p in params]).sqrt(), 1.0)
        if getattr(opt, "folds_clipping", False):
            opt.clip_coef = coef
        else:
            torch._foreach_mul_([p.grad for p in params], coef)
        opt.step()
        ema.update(model, 0.9999)

    ms = cuda_median_ms(step, steps=20, warmup=5)
    if weights is not None:
        weights.extend(local_shard(p).detach().clone() for p in params)
    return ms


MIB = 256


def bandwidth() -> dict:
    """GB/s of pinned copies of MIB MiB: host to GPU, GPU to host, and each way when both run at once."""
    n = MIB * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host2, dev2 = torch.empty_like(host).pin_memory(), torch.empty_like(dev)
    side = torch.cuda.Stream()

    def both():
        side.wait_stream(torch.cuda.current_stream())
        dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(side):
            host2.copy_(dev2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    rows = {"h2d": lambda: dev.copy_(host, non_blocking=True), "d2h": lambda: host2.copy_(dev2, non_blocking=True),
            "both": both}
    return {k: round(n / (cuda_median_ms(f, steps=10, warmup=3) / 1e3) / 1e9, 1) for k, f in rows.items()}


def offload_step_ms(offload: bool) -> float:
    """Median ms of one 8-bit, stochastically rounded bf16 step, its states resident or streamed."""
    torch.manual_seed(0)
    model = create_model("DiT-XL/2", 32, 4, 1000).cuda()
    params = list(model.parameters())
    for p in params:
        p.data = p.data.bfloat16()
        p.grad = torch.randn_like(p)
    opt = CompensatedAdamW(params, lr=1e-4, states="8bit", rounding="stochastic", fused=True, offload=offload)
    return cuda_median_ms(opt.step, steps=5, warmup=3, inner=3)  # inner: downloads of a step end in the next


def offload() -> dict:
    bw = bandwidth()
    print(f"pinned copies of {MIB} MiB: host->GPU {bw['h2d']} GB/s, GPU->host {bw['d2h']} GB/s, both at once "
          f"{bw['both']} GB/s each", flush=True)
    resident, offloaded = offload_step_ms(False), offload_step_ms(True)
    state_gb = 675e6 * (2 + 8 / 256) / 1e9
    print(f"| DiT-XL/2 step, 8-bit moments, SR bf16 | resident {resident:.2f} ms | offloaded {offloaded:.2f} ms | "
          f"{state_gb:.2f} GB each way: {state_gb / (offloaded / 1e3):.1f} GB/s |", flush=True)
    return dict(bandwidth_gb_s=bw, resident_ms=round(resident, 2), offloaded_ms=round(offloaded, 2))


def placements() -> list[dict]:
    """Each ROWS placement with the libraries' kernels and with the one-pass step."""
    rows = []
    for name, dtype, states, ema_on in ROWS:
        lib = run(dtype, states, ema_on, fused=False)
        one = run(dtype, states, ema_on, fused=True)
        rows.append(dict(row=name, library_ms=round(lib, 2), one_pass_ms=round(one, 2), speedup=round(lib / one, 2)))
        print(f"| {name} | {lib:.2f} ms | {one:.2f} ms | {lib / one:.2f}x |", flush=True)
    return rows


def sharded() -> list[dict]:
    """Each ROWS placement's one-pass step over plain tensors and over FSDP2's shards (one GPU)."""
    rows = []
    for name, dtype, states, ema_on in ROWS:
        plain_w, shard_w = [], []
        plain = run(dtype, states, ema_on, fused=True, weights=plain_w)
        shard = run(dtype, states, ema_on, fused=True, sharded=True, weights=shard_w)
        same = len(plain_w) == len(shard_w) and all(torch.equal(a, b) for a, b in zip(plain_w, shard_w))
        rows.append(dict(row=name, plain_ms=round(plain, 2), sharded_ms=round(shard, 2), same_weights=same))
        print(f"| {name} | {plain:.2f} ms | {shard:.2f} ms | {'equal' if same else 'DIFFERENT'} |", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--offload", action="store_true", help="copy bandwidth and the step resident against streamed")
    ap.add_argument("--sharded", action="store_true", help="the one-pass step over FSDP2's shards against plain")
    ap.add_argument("--out")
    args = ap.parse_args()
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)
    if args.offload:
        result = dict(env=env, **offload())
    elif args.sharded:
        result = dict(env=env, rows=sharded())
    else:
        result = dict(env=env, rows=placements())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
