"""Sequence packing against padding to the longest sample: useful tokens per second of training steps.

A mixed stream of 256px images (latents 4x1x32x32: 256 tokens on vDiT-XL/222, the frame repeated for the
temporal patch) and 16-frame 256px videos (latents 4x16x32x32: 2,048 tokens), half and half, drawn in windows
of ``--window`` samples. Each window is one training step (forward + backward + AdamW) of vDiT-XL/222 under
bf16 autocast (fp32 weights, fused AdamW), DDPM with learned sigma (the trainer's loss,
``data.packing.packed_training_losses``):

* packed: first-fit decreasing into rows of ``--pack_tokens`` tokens, block-diagonal attention by FlexAttention
  (document mask, compiled) and, where this torch has it, the flash variable-length kernel (``varlen``) (the
  ``--tiny`` CPU run: the dense reference, FlexAttention has no CPU backward);
* padded: one sample per row, every row padded to the window's longest sample, attention by SDPA with the
  boolean mask (padding keys masked out): what training mixed sizes without packing costs.

Useful tokens/s = the window's real tokens / the step's median time (CUDA events after warm-up; on the CPU,
wall clock). Prints a table and writes JSON (date, device, versions) to benchmarks/results/.

    PYTHONPATH=. python benchmarks/packing.py                 # H100: vDiT-XL/222
    PYTHONPATH=. python benchmarks/packing.py --tiny          # CPU smoke test: vDiT-T/222, small latents
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime
from pathlib import Path

import torch

from ditforge.data.packing import fill_rate, packed_training_losses, patchify, plan_packing
from ditforge.diffusion.gaussian import create_diffusion
from ditforge.models import create_model
from ditforge.ops.attention import set_packed_attention_backend


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

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: vDiT-T/222 on 4x1x8x8 / 4x4x8x8 latents")
    p.add_argument("--window", type=int, default=16, help="samples per step")
    p.add_argument("--pack_tokens", type=int, default=4096, help="tokens per packed row")
    p.add_argument("--windows", type=int, default=3, help="different random windows, each timed")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", help="JSON file (default benchmarks/results/packing_<device>.json)")
    args = p.parse_args()
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
                             fill=fill_rate(lengths, capacity, plan), step_ms=ms, useful_tokens_per_s=useful / ms * 1e3))
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
    out = Path(args.out or Path(__file__).parent / "results" / f"packing_{'cpu_tiny' if args.tiny else 'cuda'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(env=env, rows=rows), indent=1) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")


def _has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
