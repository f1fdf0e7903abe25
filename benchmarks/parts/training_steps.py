"""The training-step subcommands of ``kernel_speed.py`` (``packing``, ``optimizer-step``; what each measures is in
``kernel_speed.py``'s docstring): sequence packing against padding in whole training steps of vDiT-XL/222, and one
optimizer step over DiT-XL/2's parameters by placement, offloaded and over FSDP2's shards."""

from __future__ import annotations

import platform
import statistics
import time
from datetime import datetime
from pathlib import Path

import torch
from timing import cuda_median_ms
from torch.distributed.tensor import DTensor

from ditforge.data.packing import fill_rate, packed_training_losses, patchify, plan_packing
from ditforge.diffusion.gaussian import create_diffusion
from ditforge.models import create_model
from ditforge.ops.attention import set_packed_attention_backend
from ditforge.optim.compensated import CompensatedAdamW
from ditforge.parallel import clip_coefficient, squared_norm
from ditforge.parallel.ema import EMA, local_shard

def windows(count: int, size: int, image: tuple, video: tuple, seed: int) -> list[list[tuple]]:
    """``count`` windows of ``size`` latent shapes, each an image or a video with probability 1/2."""
    g = torch.Generator().manual_seed(seed)
    return [[video if torch.rand((), generator=g) < 0.5 else image for _ in range(size)] for _ in range(count)]


def step_ms(model, optimizer, diffusion, shapes, capacity, plan, device, steps, warmup) -> float:
    """Median ms of one training step on latents of ``shapes`` laid out by ``plan`` (rows of ``capacity``)."""
    g = torch.Generator(device).manual_seed(0)
    x = [torch.randn(s, generator=g, device=device) for s in shapes]
    noise = [torch.randn(s, generator=g, device=device) for s in shapes]
    t = torch.randint(0, 1000, (len(shapes),), generator=g, device=device)
    y = torch.randint(0, 1000, (len(shapes),), generator=g, device=device)
    patch = model.x_embedder.patch_shape

    def step():
        with torch.autocast(device.type, torch.bfloat16):
            terms = packed_training_losses(diffusion, lambda xt, tt, **p: model(xt, tt, y, **p), x, t, noise,
                                           capacity, patch, plan)
        terms["loss"].mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        return cuda_median_ms(step, steps=steps, warmup=warmup)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def packing(args) -> dict:
    """The ``packing`` table: each window's step packed (by each attention backend) and padded. ``--out`` defaults
    to benchmarks/results/packing_cpu_tiny.json (``--tiny``) or packing_cuda.json."""
    if args.tiny:
        name, size, frames, device = "vDiT-T/222", 8, 4, torch.device("cpu")
        args.pack_tokens, args.steps, args.warmup, args.windows = min(args.pack_tokens, 64), 2, 1, 1
    else:
        name, size, frames, device = "vDiT-XL/222", 32, 16, torch.device("cuda")
    image, video = (4, 1, size, size), (4, frames, size, size)
    torch.manual_seed(0)
    model = create_model(name, size, 4, 1000, num_frames=frames).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    diffusion = create_diffusion(None, True).to(device)  # tables on the device, as the trainer's: no sync per step
    # FlexAttention has no backward on the CPU: the smoke test packs with the dense reference there
    backends = ["flex"] + (["varlen"] if _has_varlen() else []) if device.type == "cuda" else ["dense"]
    rows = []
    for shapes in windows(args.windows, args.window, image, video, seed=1):
        lengths = [len(patchify(torch.empty(s, device="meta"), model.x_embedder.patch_shape)[0]) for s in shapes]
        useful = sum(lengths)
        layouts = {f"packed {b}": (b, args.pack_tokens, plan_packing(lengths, args.pack_tokens)) for b in backends}
        layouts["padded"] = ("dense", max(lengths), [[i] for i in range(len(shapes))])
        for method, (backend, capacity, plan) in layouts.items():
            set_packed_attention_backend(backend)
            ms = step_ms(model, optimizer, diffusion, shapes, capacity, plan, device, args.steps, args.warmup)
            rows.append(dict(method=method, videos=sum(s == video for s in shapes), samples=len(shapes),
                             useful_tokens=useful, rows=len(plan), row_tokens=capacity,
                             fill=fill_rate(lengths, capacity, plan), step_ms=ms,
                             useful_tokens_per_s=useful / ms * 1e3))
    set_packed_attention_backend("auto")
    env = dict(date=datetime.now().isoformat(timespec="seconds"), model=name, window=args.window,
               pack_tokens=args.pack_tokens, device=torch.cuda.get_device_name() if device.type == "cuda" else
               platform.processor() or "cpu", torch=torch.__version__, cuda=torch.version.cuda,
               python=platform.python_version())
    print(f"{env['model']} on {env['device']}, torch {env['torch']}, window {args.window}, rows of "
          f"{args.pack_tokens}")
    print("| method | videos/samples | rows x tokens | fill | step (ms) | useful tokens/s | vs padded |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        padded = next(q for q in rows if q["method"] == "padded" and q["useful_tokens"] == r["useful_tokens"]
                      and q["videos"] == r["videos"])
        r["speedup_vs_padded"] = r["useful_tokens_per_s"] / padded["useful_tokens_per_s"]
        print(f"| {r['method']} | {r['videos']}/{r['samples']} | {r['rows']} x {r['row_tokens']} | {r['fill']:.0%} | "
              f"{r['step_ms']:.1f} | {r['useful_tokens_per_s']:,.0f} | {r['speedup_vs_padded']:.2f}x |")
    args.out = args.out or str(Path(__file__).parents[1] / "results" /
                               f"packing_{'cpu_tiny' if args.tiny else 'cuda'}.json")
    return dict(env=env, rows=rows)


def _has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


OPTIMIZER_ROWS = [  # name, weights dtype, states, ema
    ("fp32 + EMA", torch.float32, "fp32", True),
    ("8-bit moments, Kahan bf16, no EMA", torch.bfloat16, "8bit", False),
    ("8-bit moments, fp32 + EMA", torch.float32, "8bit", True),
]


def optimizer_step_ms(dtype, states, ema_on, fused, sharded=False, weights=None):
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
    """Each OPTIMIZER_ROWS placement with the libraries' kernels and with the one-pass step."""
    rows = []
    for name, dtype, states, ema_on in OPTIMIZER_ROWS:
        lib = optimizer_step_ms(dtype, states, ema_on, fused=False)
        one = optimizer_step_ms(dtype, states, ema_on, fused=True)
        rows.append(dict(row=name, library_ms=round(lib, 2), one_pass_ms=round(one, 2), speedup=round(lib / one, 2)))
        print(f"| {name} | {lib:.2f} ms | {one:.2f} ms | {lib / one:.2f}x |", flush=True)
    return rows


def sharded() -> list[dict]:
    """Each OPTIMIZER_ROWS placement's one-pass step over plain tensors and over FSDP2's shards (one GPU)."""
    rows = []
    for name, dtype, states, ema_on in OPTIMIZER_ROWS:
        plain_w, shard_w = [], []
        plain = optimizer_step_ms(dtype, states, ema_on, fused=True, weights=plain_w)
        shard = optimizer_step_ms(dtype, states, ema_on, fused=True, sharded=True, weights=shard_w)
        same = len(plain_w) == len(shard_w) and all(torch.equal(a, b) for a, b in zip(plain_w, shard_w))
        rows.append(dict(row=name, plain_ms=round(plain, 2), sharded_ms=round(shard, 2), same_weights=same))
        print(f"| {name} | {plain:.2f} ms | {shard:.2f} ms | {'equal' if same else 'DIFFERENT'} |", flush=True)
    return rows


def optimizer_step(args) -> dict:
    """The ``optimizer-step`` table: the placements (default), ``--offload`` or ``--sharded``."""
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)
    if args.offload:
        return dict(env=env, **offload())
    return dict(env=env, rows=sharded() if args.sharded else placements())
