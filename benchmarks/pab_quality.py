"""Pyramid Attention Broadcast's quality cost on *trained* video models (issue 7), where ``sampling.py --video``
can only measure random weights:

    python benchmarks/pab_quality.py --out benchmarks/results/pab_quality_cpu.json          # 2 CPU cores, minutes

Per model: ``ditforge train --data clips`` (the built-in captioned videos; text-conditioned, pixel space at the
default sizes), then ``ditforge sample`` of every caption with DDIM, once plain and once with ``--pab`` (the
VideoSys default schedule), same seed; PSNR and SSIM (scikit-image) of each PAB video's uint8 frames against
the plain one, and the wall time of each ``ditforge sample`` command. The trained checkpoints are kept under
``--work`` and reused. (A random-weights control of these tiny pixel-space models is degenerate: with
``sampling.py``'s ``random_weights`` 96% of the pixels came out 0 or 255, with or without PAB: 72 dB.)
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from sampling import psnr, ssim

from ditforge.data.clips import clips_rows


def train(model: str, run: Path, args) -> None:
    if (run / "checkpoints" / f"step-{args.train_steps:07d}").exists():
        return
    subprocess.run([sys.executable, "-m", "ditforge", "train", "--data", "clips", "--model", model,
                    "--image_size", str(args.image_size), "--num_frames", str(args.num_frames), "--frame_interval",
                    str(args.frame_interval), "--batch_size", "3", "--max_steps", str(args.train_steps),
                    "--sample_every", "0", "--device", args.device, "--outputs", str(run), "--resume", "auto"],
                   check=True)


def sample(run: Path, prompts: list[str], pab: bool, args, work: Path) -> tuple[np.ndarray, float]:
    npz = work / f"{run.name}-{'pab' if pab else 'plain'}.npz"
    cmd = [sys.executable, "-m", "ditforge", "sample", "--ckpt", str(run), "--sampler", "ddim",
           "--num_sampling_steps", str(args.sampling_steps), "--seed", "0", "--device", args.device,
           "--out", str(work / f"{run.name}-videos"), "--save_npz", str(npz)]
    for p in prompts:
        cmd += ["--prompt", p]
    t0 = time.perf_counter()
    subprocess.run(cmd + (["--pab"] if pab else []), check=True)
    return np.load(npz)["samples"], time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="STDiT-T/2,vDiT-T/122")
    p.add_argument("--image_size", type=int, default=8)
    p.add_argument("--num_frames", type=int, default=4)
    p.add_argument("--frame_interval", type=int, default=8)
    p.add_argument("--train_steps", type=int, default=2000)
    p.add_argument("--sampling_steps", type=int, default=50)
    p.add_argument("--device", default="auto")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "ditforge-pab-quality"))
    p.add_argument("--out")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prompts = [r["text"] for r in clips_rows()]
    rows = []
    for model in args.models.split(","):
        run = work / model.replace("/", "_")
        train(model, run, args)
        plain, t_plain = sample(run, prompts, False, args, work)
        cached, t_pab = sample(run, prompts, True, args, work)
        per_video = [(psnr(a, b), ssim(a, b)) for a, b in zip(plain, cached)]
        rows.append(dict(model=model, train_steps=args.train_steps, videos=len(prompts), shape=list(plain.shape[1:]),
                         sampling_s=t_plain, sampling_pab_s=t_pab, psnr_db=[v[0] for v in per_video],
                         ssim=[v[1] for v in per_video]))
    print(f"\nclips, {args.image_size}px x {args.num_frames} frames, DDIM {args.sampling_steps}, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}\n")
    print("| model | trained steps | videos | PSNR dB (min / mean) | SSIM (min / mean) | sample s plain / PAB |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        finite = [v for v in r["psnr_db"] if np.isfinite(v)] or [float("inf")]
        print(f"| {r['model']} | {r['train_steps']} | {r['videos']} | {min(r['psnr_db']):.1f} / {np.mean(finite):.1f} | "
              f"{min(r['ssim']):.4f} / {np.mean(r['ssim']):.4f} | {r['sampling_s']:.1f} / {r['sampling_pab_s']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(date=datetime.now().isoformat(timespec="minutes"),
                                                  torch=torch.__version__, args=vars(args), rows=rows), indent=1))


if __name__ == "__main__":
    main()
