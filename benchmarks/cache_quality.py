"""Step-level reuse (FORA, PAB) on a *trained* image DiT (issue 18), where ``sampling.py --images`` times DiT-XL/2
with random weights and so cannot tell what reuse costs in quality:

    python benchmarks/cache_quality.py --out benchmarks/results/cache_quality_cpu.json      # 2 CPU cores, ~10 min

The model is the main job's: ``ditforge train`` with no arguments (a class-conditional DiT on the built-in 8x8
digits, on the CPU; kept under ``--work`` and reused). Each mode then runs ``ditforge sample`` for 20 samples per
class with DDIM (``--num_sampling_steps``, default 50) and guidance 4 from the same seed: plain, ``--fora 2``,
``--fora 3`` and ``--pab``; and fewer solver steps: DDIM at 25 and 20 steps, DPM-Solver++ (2M) at 20. Per mode:
PSNR and SSIM (scikit-image) of each sample's uint8 pixels against the plain one's (for another step count this is
how far the images moved, not an error), and ``ditforge eval`` against the real digits (digits-FID, precision,
recall and class accuracy with the built-in extractor); and the wall time of the ``ditforge sample`` command.
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

MODES = {"plain": [], "fora2": ["--fora", "2"], "fora3": ["--fora", "3"], "pab": ["--pab"],
         # fewer solver steps (the later --num_sampling_steps wins)
         "ddim25": ["--num_sampling_steps", "25"], "ddim20": ["--num_sampling_steps", "20"],
         "dpm++20": ["--sampler", "dpm++", "--num_sampling_steps", "20"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--samples_per_class", type=int, default=20)
    p.add_argument("--sampling_steps", type=int, default=50)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "ditforge-cache-quality"))
    p.add_argument("--out")
    args = p.parse_args()
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


if __name__ == "__main__":
    main()
