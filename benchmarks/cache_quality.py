"""Step-level reuse (FORA, PAB) and fewer solver steps on *trained* models, where ``sampling.py`` times random
weights and so cannot tell what reuse costs in quality.

``images``: the main job's model (``ditforge train`` with no arguments: a class-conditional DiT on the built-in 8x8
    digits, on the CPU; kept under ``--work`` and reused). Each mode runs ``ditforge sample`` for
    ``--samples_per_class`` samples per class with DDIM (``--sampling_steps``, default 50) and guidance 4 from the
    same seed: plain, ``--fora 2``, ``--fora 3`` and ``--pab``; and fewer solver steps: DDIM at 25 and 20 steps,
    DPM-Solver++ (2M) at 20. Per mode: PSNR and SSIM (scikit-image) of each sample's uint8 pixels against the plain
    one's (for another step count this is how far the images moved, not an error), ``ditforge eval`` against the
    real digits (digits-FID, precision, recall and class accuracy with the built-in extractor), and the wall time
    of the ``ditforge sample`` command.
``video``: Pyramid Attention Broadcast on trained video models. Per model: ``ditforge train --data clips`` (the
    built-in captioned videos; text-conditioned, pixel space at the default sizes), then ``ditforge sample`` of every
    caption with DDIM, once plain and once with ``--pab`` (the VideoSys default schedule), same seed; PSNR and SSIM
    of each PAB video's uint8 frames against the plain one, and the wall time of each ``ditforge sample`` command.
    (A random-weights control of these tiny pixel-space models is degenerate: with ``sampling.py``'s
    ``random_weights`` 96% of the pixels came out 0 or 255, with or without PAB: 72 dB.)

    python benchmarks/cache_quality.py images --out benchmarks/results/cache_quality_cpu.json   # 2 CPU cores, ~10 min
    python benchmarks/cache_quality.py video --out benchmarks/results/pab_quality_cpu.json      # 2 CPU cores, minutes
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
from timing import psnr, ssim

MODES = {"plain": [], "fora2": ["--fora", "2"], "fora3": ["--fora", "3"], "pab": ["--pab"],
         # fewer solver steps (the later --num_sampling_steps wins)
         "ddim25": ["--num_sampling_steps", "25"], "ddim20": ["--num_sampling_steps", "20"],
         "dpm++20": ["--sampler", "dpm++", "--num_sampling_steps", "20"]}


def images(args) -> None:
    work = Path(args.work)
    run = work / "run"
    if not (run / "checkpoints").exists():
        subprocess.run([sys.executable, "-m", "ditforge", "train", "--outputs", str(run)], check=True)
    rows, plain = [], None
    for mode in args.modes.split(","):
        npz = work / f"{mode}.npz"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ditforge", "sample", "--ckpt", str(run), "--sampler", "ddim",
                        "--num_sampling_steps", str(args.sampling_steps), "--seed", "0",
                        "--num_samples", str(10 * args.samples_per_class), "--out", str(work / f"{mode}.png"),
                        "--save_npz", str(npz), *MODES[mode]], check=True)
        seconds = time.perf_counter() - t0
        samples = np.load(npz)["samples"]
        plain = samples if plain is None else plain
        scores = subprocess.run([sys.executable, "-m", "ditforge", "eval", "--samples", str(npz), "--ref", "digits"],
                                check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        per_sample = [(psnr(a, b), ssim(a, b)) for a, b in zip(plain, samples)]
        finite = [v for v, _ in per_sample if np.isfinite(v)]
        rows.append(dict(mode=mode, flags=MODES[mode], sample_s=seconds, samples=len(samples),
                         psnr_db_min=min(v for v, _ in per_sample), psnr_db_mean=float(np.mean(finite or [np.inf])),
                         ssim_min=min(s for _, s in per_sample), ssim_mean=float(np.mean([s for _, s in per_sample])),
                         eval=json.loads(scores)))
    print(f"\ndigits 8x8, DDIM {args.sampling_steps}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}\n")
    print("| mode | PSNR dB vs plain (min / mean) | SSIM (min / mean) | digits-FID | accuracy | sample s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        e = r["eval"]
        print(f"| {r['mode']} | {r['psnr_db_min']:.1f} / {r['psnr_db_mean']:.1f} | {r['ssim_min']:.4f} / "
              f"{r['ssim_mean']:.4f} | {e['fid']:.2f} | {e['accuracy']:.3f} | {r['sample_s']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(date=datetime.now().isoformat(timespec="minutes"),
                                                  torch=torch.__version__, args=vars(args), rows=rows), indent=1))


def train_video(model: str, run: Path, args) -> None:
    """``ditforge train --data clips`` of ``model`` into ``run``, unless it has finished there."""
    if (run / "checkpoints" / f"step-{args.train_steps:07d}").exists():
        return
    subprocess.run([sys.executable, "-m", "ditforge", "train", "--data", "clips", "--model", model,
                    "--image_size", str(args.image_size), "--num_frames", str(args.num_frames), "--frame_interval",
                    str(args.frame_interval), "--batch_size", "3", "--max_steps", str(args.train_steps),
                    "--sample_every", "0", "--device", args.device, "--outputs", str(run), "--resume", "auto"],
                   check=True)


def sample_video(run: Path, prompts: list[str], pab: bool, args, work: Path) -> tuple[np.ndarray, float]:
    """(the videos of every prompt, (N, T, H, W, C) uint8; the command's wall time in s)."""
    npz = work / f"{run.name}-{'pab' if pab else 'plain'}.npz"
    cmd = [sys.executable, "-m", "ditforge", "sample", "--ckpt", str(run), "--sampler", "ddim",
           "--num_sampling_steps", str(args.sampling_steps), "--seed", "0", "--device", args.device,
           "--out", str(work / f"{run.name}-videos"), "--save_npz", str(npz)]
    for p in prompts:
        cmd += ["--prompt", p]
    t0 = time.perf_counter()
    subprocess.run(cmd + (["--pab"] if pab else []), check=True)
    return np.load(npz)["samples"], time.perf_counter() - t0


def video(args) -> None:
    from ditforge.data.clips import clips_rows

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prompts = [r["text"] for r in clips_rows()]
    rows = []
    for model in args.models.split(","):
        run = work / model.replace("/", "_")
        train_video(model, run, args)
        plain, t_plain = sample_video(run, prompts, False, args, work)
        cached, t_pab = sample_video(run, prompts, True, args, work)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="suite", required=True)
    i = sub.add_parser("images", help="FORA, PAB and fewer steps on the default digits run")
    i.add_argument("--modes", default=",".join(MODES))
    i.add_argument("--samples_per_class", type=int, default=20)
    i.add_argument("--sampling_steps", type=int, default=50)
    i.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "ditforge-cache-quality"))
    i.add_argument("--out")
    v = sub.add_parser("video", help="PAB on video models trained on the built-in clips")
    v.add_argument("--models", default="STDiT-T/2,vDiT-T/122")
    v.add_argument("--image_size", type=int, default=8)
    v.add_argument("--num_frames", type=int, default=4)
    v.add_argument("--frame_interval", type=int, default=8)
    v.add_argument("--train_steps", type=int, default=2000)
    v.add_argument("--sampling_steps", type=int, default=50)
    v.add_argument("--device", default="auto")
    v.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "ditforge-pab-quality"))
    v.add_argument("--out")
    args = p.parse_args()
    {"images": images, "video": video}[args.suite](args)


if __name__ == "__main__":
    main()
