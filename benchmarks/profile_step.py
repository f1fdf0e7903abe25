"""Where a training step's GPU time goes: ``torch.profiler`` over the timed steps of a ``ditforge bench`` row
(``bench.run_steps``, so exactly what the row runs: its optimizer, the one-pass step of row f included), kernels
grouped by kind (matrix products, attention, adaLN kernels, other element-wise, optimizer + EMA), the GPU's idle
share of the wall time, and the host synchronisations in those steps (``torch.cuda.set_sync_debug_mode``: each
is a blocking copy or wait that leaves the GPU idle while the host catches up).

    PYTHONPATH=. python benchmarks/profile_step.py --model DiT-XL/2 --rows bcdef [--batch_size 64]

``--rows`` picks the row's settings as in ``ditforge bench`` (cumulative); the last letter is profiled.

    PYTHONPATH=. python benchmarks/profile_step.py --model DiT-B/2 --rows bc --guarded

``--guarded``: instead of the profile, one table over the optimizer paths (``GUARDED``, each on top of the
rows' settings): the median step time and the host syncs per step of ``train_step``, whose divergence guard
hands every optimizer its skip flag on the device (0 expected everywhere but torch's Adafactor, which reads two
norms per parameter on the host itself, guarded or not: the step counters that bitsandbytes, torchao and
Adafactor keep on the host are put back one step late, ``optim.skip.SkipUndo``).
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
from ditforge.config.sections import BenchConfig
from ditforge.errors import UserError
from timing import cuda_kernels, host_syncs, kernel_kind

GUARDED = [  # (optimizer path, its settings)
    ("adamw fp32, torch fused AdamW", dict(fused_optimizer=False)),
    ("adamw fp32, one-pass", dict(fused_optimizer=True)),
    ("adamw8bit, one-pass", dict(fused_optimizer=True, optimizer="adamw8bit")),
    ("adamw8bit + Kahan bf16, one-pass", dict(fused_optimizer=True, optimizer="adamw8bit", master_weights="bf16")),
    ("adamw + stochastic bf16, one-pass", dict(fused_optimizer=True, master_weights="bf16_sr")),
    ("adamw fp32, fused backward, one-pass", dict(fused_optimizer=True, fused_backward_pass=True)),
    ("adamw8bit + stochastic bf16, fused backward", dict(fused_optimizer=True, optimizer="adamw8bit",
                                                         master_weights="bf16_sr", fused_backward_pass=True)),
    ("adamw8bit + stochastic bf16, states offloaded", dict(fused_optimizer=True, optimizer="adamw8bit",
                                                           master_weights="bf16_sr", cpu_offload=True)),
    ("adamw + Kahan bf16, libraries' path", dict(fused_optimizer=False, master_weights="bf16")),
    ("adamw + stochastic bf16, libraries' path", dict(fused_optimizer=False, master_weights="bf16_sr")),
    ("adamw8bit (bitsandbytes), libraries' path", dict(fused_optimizer=False, optimizer="adamw8bit")),
    ("adamw fp32, fused backward, libraries' path", dict(fused_optimizer=False, fused_backward_pass=True)),
    ("adamw4bit (torchao), selected back on the device", dict(fused_optimizer=False, optimizer="adamw4bit")),
    ("adamw_fp8 (torchao), selected back on the device", dict(fused_optimizer=False, optimizer="adamw_fp8")),
    ("adafactor (torch), selected back on the device", dict(fused_optimizer=False, optimizer="adafactor")),
    ("adamw4bit (torchao), unguarded", dict(fused_optimizer=False, optimizer="adamw4bit", unguarded=True)),
    ("adamw_fp8 (torchao), unguarded", dict(fused_optimizer=False, optimizer="adamw_fp8", unguarded=True)),
    ("adafactor (torch), unguarded", dict(fused_optimizer=False, optimizer="adafactor", unguarded=True)),
]


def guarded(cfg: BenchConfig, base: Settings, steps: int, device: torch.device) -> None:
    """Print, per optimizer path of ``GUARDED`` over ``base``: median ms per guarded step and host syncs per step
    in the timed steps (``host_syncs``; the warm-up's one-off syncs, such as a first step's state set-up, are
    not counted), with the three lines behind most of them."""
    print(f"{cfg.model} batch {cfg.batch_size}, base settings {base}\n"
          "| optimizer path | ms/step | host syncs/step | from |\n|---|---:|---:|---|")
    from ditforge.train import step as step_module

    guarded_step = step_module.step_skipping_on_device
    try:
        _guarded_rows(cfg, base, steps, device, step_module, guarded_step)
    finally:
        step_module.step_skipping_on_device = guarded_step


def _guarded_rows(cfg: BenchConfig, base: Settings, steps: int, device: torch.device, step_module, guarded_step) -> None:
    for name, change in GUARDED:
        # unguarded: the library optimizer's own step, whatever the flag (what the select-back costs)
        change = dict(change)
        unguarded = change.pop("unguarded", False)
        step_module.step_skipping_on_device = (lambda opt, flag: opt.step()) if unguarded else guarded_step
        s = replace(base, **change)
        if s.master_weights != "fp32" and s.precision == "fp32":
            s = replace(s, precision="bf16")  # bf16 weights need bf16 compute (--master_weights)
        found: list[str] = []

        @contextlib.contextmanager
        def counted():
            with host_syncs() as syncs:
                yield
            found.extend(syncs)

        try:
            m = run_steps(cfg, s, device, cfg.batch_size, steps, warmup=5, timed=counted())
        except UserError as e:  # a library missing here (bitsandbytes)
            print(f"| {name} | | | not run: {e} |", flush=True)
            continue
        where = ", ".join(f"{w} ({n / steps:g})" for w, n in Counter(found).most_common(3))
        print(f"| {name} | {m['step_time_s'] * 1e3:.1f} | {len(found) / steps:g} | {where} |", flush=True)


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
    p.add_argument("--guarded", action="store_true", help="the table of optimizer paths instead (docstring)")
    args = p.parse_args()
    cfg = BenchConfig(model=args.model, image_size=args.image_size, num_frames=args.num_frames,
                      batch_size=args.batch_size, grad_checkpoint=args.grad_checkpoint, text_dim=args.text_dim,
                      text_tokens=args.text_tokens, fp8_recipe=args.fp8_recipe)
    s = Settings()
    for key, _, change in ROWS:
        if key in args.rows:
            s = replace(s, **change)
    device = torch.device("cuda")
    if args.guarded:
        guarded(cfg, s, args.steps, device)
        return
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
        per_kind[kernel_kind(name)] += ms
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
        print(f"| {name[:90]} | {kernel_kind(name)} | {ms:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(settings=str(s), total_ms=total, wall_ms=wall, host_syncs_per_step=len(syncs) / args.steps,
                           host_syncs=Counter(syncs), per_kind=per_kind, top=top), f, indent=1)


if __name__ == "__main__":
    main()
