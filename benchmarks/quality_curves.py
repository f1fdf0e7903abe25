"""Quality checks: does a speed or memory mode train as well as the plain one, does step-level reuse sample alike?

Loss curves: one ``ditforge train`` run per mode in a subprocess (kept in ``--work``: a finished mode is not run
again), the per-step losses, and the verdict of each mode against a reference and a second seed. Three suites:

``speed``: a DiT-S/2 trained from scratch for ``--steps`` steps (batch 64, lr 1e-4, EMA) on an ImageFolder made from
    the built-in digits (scikit-learn's 1,797 real 8x8 handwritten digits), upsampled to ``--image_size`` (bicubic,
    one folder per class; pixel space, 10 classes). Every mode starts from the same initialisation with the same
    data order, noise and timesteps (``--seed 0``):

    bf16        --mixed_precision bf16 --fused_optimizer off (the reference: bench row b, torch's fused AdamW)
    bf16_seed1  the same with --seed 1 (initialisation, data order, noise): the run-to-run noise
    fast        + --enable_flashattn --enable_modulate_kernel --compile, the one-pass optimizer step (bench row f)
    fast_no_kernels  + --enable_flashattn --compile (inductor's own norm fusion, the one-pass step)
    fp8         fast_no_kernels + --mixed_precision fp8 --fp8_min_width 16 (torchao's float8 linears in every
                block linear, below the width where they pay too: this checks their numerics; bench row g without
                the kernels). Issue 45's check at width 4096: ``--model DiT-7B/2 --depth 2 --image_size 16``

``memory``: DiT-T/2 trained ``--base_steps`` steps on the built-in digits at lr 1e-3 (the base), then fine-tuned
    (``--init_from`` the base run) for ``--steps`` steps at lr 1e-4 in each mode (where bf16 weights without
    compensation would lose most updates: 1e-4 is 1/40 of a bf16 ulp at weights of size 1), bf16 compute, no EMA,
    the same data order and noise:

    fp32        --optimizer adamw --master_weights fp32 (the reference)
    fp32_seed1  the same with another --seed (data order, noise, dropout): the run-to-run noise
    adamw8bit   --optimizer adamw8bit
    bf16        --master_weights bf16 (Kahan-compensated bf16 weights)
    bf16_8bit   both (the 8 GiB rows of docs/memory.md)
    sr_8bit_fused  --optimizer adamw8bit --master_weights bf16_sr --fused_backward_pass (4 bytes per parameter;
                clipping by the previous step's norm)
    sr_8bit     --optimizer adamw8bit --master_weights bf16_sr (the 8 GiB DiT-XL/2 and 16 GiB SDXL rows)
    fp32_library  the reference with the libraries' kernels (--fused_optimizer off): on a GPU every other mode
                runs the one-pass Triton step
    delayed     --cpu_offload all --delayed_update (ZeRO-Offload's one-step delayed update; --cpu_offload all
                alone equals fp32 to fp32 rounding, tested)
    adamw4bit, adamw_fp8  --optimizer adamw4bit | adamw_fp8 (torchao's 4-bit and float8 moments)
    adafactor   --optimizer adafactor --lr 1e-2 (torch's Adafactor at its documented default: lr is its maximum
                relative step size, so the reference's 1e-4 does not carry over)

``video``: LoRA (rank 32 on the attention projections, lr 1e-4, batch 3: the three clips, each a random window)
    on a Wan2.1-T2V-1.3B folder (the published config with random weights, ``finetune.build_wan``; or ``--pipe``
    an existing folder) for ``--steps`` steps on the built-in clips (real videos, ``--image_size`` px x
    ``--num_frames``), bf16 compute; issue 42's quality check of the fp8-stored base:

    bf16        the frozen base stored in bf16 (the reference)
    bf16_seed1  the same with --seed 1 (data order, noise, timesteps, caption dropout): the run-to-run noise
    fp8_base    --fp8_base: the frozen base's linear layers stored in float8 e4m3 (a scale per output channel),
                upcast for each product

``--modes`` picks some; the reference and its second seed always run.

    PYTHONPATH=. python benchmarks/quality_curves.py speed --work /tmp/sq --jobs 5 --json OUT.json --plot OUT.png
    PYTHONPATH=. python benchmarks/quality_curves.py speed --model DiT-7B/2 --depth 2 --image_size 16 --modes fp8 \
        --jobs 3 --work /tmp/fq --json OUT.json --plot OUT.png
    PYTHONPATH=. python benchmarks/quality_curves.py memory --work /tmp/q --json OUT.json --plot OUT.png
    PYTHONPATH=. python benchmarks/quality_curves.py video --steps 1000 --window 200 --jobs 3 --json OUT.json \
        --plot OUT.png

(one GPU: speed's fast, fast_no_kernels and fp8 modes need it; on a CPU ``speed --steps 20 --modes bf16`` or
``memory --steps 20 --base_steps 20``, or ``video --pipe TINY_WAN --steps 4 --window 2 --modes bf16 --image_size 16
--num_frames 5``, checks the script.)

The verdict compares the mean loss of each mode's last ``window`` steps with the reference's:

- **within run-to-run noise**: the difference is at most 2 standard errors of the difference between two
  independent runs' window means, sqrt(se_ref^2 + se_seed^2), each se from the window's batch means (``BLOCKS``
  blocks of consecutive steps: neighbouring steps share nearly the same weights, so their losses are correlated,
  0.1-0.3 between neighbours in the stored runs, and a per-step standard error would be too small). This
  counts the spread of the losses within a run; it assumes that the seed changes the expected loss by no more
  than that, which the second seed checks only once (its own difference is printed beside it). The seed's
  difference alone is one draw of the noise, too few to be the threshold (2026-11-27: 0.00003, against a
  standard error of 0.00054).
- **shift**: a mode that shares the reference's seed (same initialisation, data order, noise and timesteps) is
  compared step by step: the mean of the per-step differences and its batch-means standard error. This finds
  small systematic changes (FP8's rounding, an optimizer's lag) that are far below the run-to-run noise.

``report`` prints both, writes JSON (curves every step, window means) and a plot of the curves, smoothed over 100
steps, in one figure (matplotlib).

Samples of step-level reuse (FORA, PAB) and fewer solver steps on *trained* models, where ``sampling.py`` times random
weights and so cannot tell what reuse costs in quality. Two suites:

``cache-images``: the main job's model (``ditforge train`` with no arguments: a class-conditional DiT on the built-in
    8x8 digits, on the CPU; kept under ``--work`` and reused). Each mode runs ``ditforge sample`` for
    ``--samples_per_class`` samples per class with DDIM (``--sampling_steps``, default 50) and guidance 4 from the
    same seed: plain, ``--fora 2``, ``--fora 3`` and ``--pab``; and fewer solver steps: DDIM at 25 and 20 steps,
    DPM-Solver++ (2M) at 20. Per mode: PSNR and SSIM (scikit-image) of each sample's uint8 pixels against the plain
    one's (for another step count this is how far the images moved, not an error), ``ditforge eval`` against the
    real digits (digits-FID, precision, recall and class accuracy with the built-in extractor), and the wall time
    of the ``ditforge sample`` command.
``cache-video``: Pyramid Attention Broadcast on trained video models. Per model: ``ditforge train --data clips`` (the
    built-in captioned videos; text-conditioned, pixel space at the default sizes), then ``ditforge sample`` of every
    caption with DDIM, once plain and once with ``--pab`` (the VideoSys default schedule), same seed; PSNR and SSIM
    of each PAB video's uint8 frames against the plain one, and the wall time of each ``ditforge sample`` command.
    (A random-weights control of these tiny pixel-space models is degenerate: with ``sampling.py``'s
    ``random_weights`` 96% of the pixels came out 0 or 255, with or without PAB: 72 dB.)

    python benchmarks/quality_curves.py cache-images --out benchmarks/results/cache_quality_cpu.json  # 2 cores, ~10 min
    python benchmarks/quality_curves.py cache-video --out benchmarks/results/pab_quality_cpu.json     # 2 cores, minutes
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import torch
from timing import psnr, ssim


def add_options(ap: argparse.ArgumentParser, work: str, modes: dict[str, list[str]]) -> None:
    """The options of both suites: --work, --steps (2000), --window (500), --device, --json, --plot, --modes,
    --jobs."""
    ap.add_argument("--work", default=work)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--window", type=int, default=500)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--modes", default=",".join(modes), help="comma-separated names of the suite's modes")
    ap.add_argument("--jobs", type=int, default=1, help="modes trained at once (on one GPU: small models leave it "
                    "mostly idle, and only the losses are compared, not the speed)")


def run_modes(modes: dict[str, list[str]], chosen: set[str], work: Path, window: int, steps: int, *common: str,
              jobs: int = 1) -> dict[str, list[float]]:
    """Train each chosen mode (``ditforge train COMMON --outputs WORK/NAME FLAGS``, ``steps`` steps logged every
    step), ``jobs`` at a time, unless ``WORK/NAME`` already holds a finished run of ``steps`` steps (another run
    there is replaced); returns its per-step losses by name, printing the mean of the last ``window``. Raises
    RuntimeError naming every mode that failed, after the others end; each failure's error is printed when it
    happens."""
    names = [name for name in modes if name in chosen]
    todo = [name for name in names if not finished(work / name, steps)]
    for name in todo:
        shutil.rmtree(work / name, ignore_errors=True)
    failed = []
    with ThreadPoolExecutor(max(1, jobs)) as pool:  # each thread waits on its own subprocess
        runs = {pool.submit(train, *common, "--outputs", str(work / name), *modes[name]): name for name in todo}
        for run in as_completed(runs):
            if run.exception() is not None:  # said at once: the other modes may run on for minutes
                print(f"mode {runs[run]}: {run.exception()}", file=sys.stderr, flush=True)
                failed.append(runs[run])
    if failed:
        raise RuntimeError(f"modes failed: {', '.join(failed)} (their errors above)")
    curves = {name: losses(work / name) for name in names}
    for name, curve in curves.items():
        print(f"{name:16s} last-{window} mean loss {np.mean(curve[-window:]):.5f}", flush=True)
    return curves


def train(*argv: str) -> None:
    """``python -m ditforge train ARGV``; raises RuntimeError with the end of its stderr when it fails."""
    proc = subprocess.run([sys.executable, "-m", "ditforge", "train", *argv], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"ditforge train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def finished(run: Path, steps: int) -> bool:
    """Whether ``run`` is a finished run of ``steps`` steps logged every step (its final checkpoint and one loss per
    step)."""
    return (run / "checkpoints" / f"step-{steps:07d}").is_dir() and len(losses(run)) == steps


def losses(run: Path) -> list[float]:
    """The training loss of every step of a run logged with ``--log_every 1``."""
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


BLOCKS = 20  # batch means per window (25 steps each at the default window of 500)


def batch_se(x: np.ndarray, blocks: int = BLOCKS) -> float:
    """Standard error of ``x.mean()`` from the means of ``blocks`` equal blocks of consecutive values (the method
    of batch means; the first len(x) % blocks values are left out), for serially correlated ``x``. A window of
    fewer values than ``blocks`` (a short smoke run) takes one value per block."""
    blocks = min(blocks, len(x))
    size = len(x) // blocks
    means = x[len(x) - size * blocks:].reshape(blocks, size).mean(axis=1)
    return float(means.std(ddof=1) / np.sqrt(blocks))


def report(curves: dict[str, list[float]], reference: str, seed: str, window: int, title: str,
           json_path: str | None, plot_path: str | None, **meta) -> dict:
    """Judge every curve against ``curves[reference]`` over the last ``window`` steps (module docstring): print
    the verdicts, write ``json_path`` and ``plot_path`` (each optional). Returns per mode its window mean,
    ``diff_vs_reference``, ``within_noise`` (|diff| <= 2 ``noise``) and, for every mode but ``seed``, the paired
    ``shift`` and its standard error ``shift_se``; the JSON adds ``noise`` (the standard error of the difference
    between two independent runs' window means) and ``seed_diff`` (the second seed's observed difference)."""
    last = {k: np.asarray(v[-window:], dtype=np.float64) for k, v in curves.items()}
    ref = last[reference]
    noise = float(np.hypot(batch_se(ref), batch_se(last[seed])))
    verdict = {}
    for k, x in last.items():
        diff = float(x.mean() - ref.mean())
        verdict[k] = {"mean": float(x.mean()), "diff_vs_reference": diff, "within_noise": abs(diff) <= 2 * noise}
        if k != seed:
            paired = x - ref
            verdict[k] |= {"shift": float(paired.mean()), "shift_se": batch_se(paired)}
    seed_diff = verdict[seed]["diff_vs_reference"]
    print(f"run-to-run noise: standard error {noise:.5f} ({seed} differs by {seed_diff:+.5f})")
    for k, v in verdict.items():
        shift = f"  shift {v['shift']:+.5f} +- {v['shift_se']:.5f} (paired)" if "shift" in v else ""
        print(f"{k:16s} {v['mean']:.5f}  vs {reference} {v['diff_vs_reference']:+.5f}  "
              f"within noise: {v['within_noise']}{shift}")
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "window": window, **meta}
    if json_path:
        Path(json_path).write_text(json.dumps({"meta": meta, "reference": reference, "noise": noise,
                                               "seed_diff": seed_diff, "modes": verdict, "curves": curves}))
    if plot_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        k = min(100, min(len(c) for c in curves.values()))
        for name, curve in curves.items():
            smooth = np.convolve(curve, np.ones(k) / k, mode="valid")
            ax.plot(np.arange(k, len(curve) + 1), smooth, label=f"{name} ({verdict[name]['mean']:.4f})")
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (mean of {k} steps)")
        ax.set_title(f"{title} ({meta['device']}, {meta['date']})")
        ax.legend()
        fig.savefig(plot_path, dpi=100, bbox_inches="tight")
    return verdict


SPEED_MODES = {
    "bf16": ["--fused_optimizer", "off"],
    "bf16_seed1": ["--fused_optimizer", "off", "--seed", "1"],
    "fast": ["--enable_flashattn", "--enable_modulate_kernel", "--compile"],
    "fast_no_kernels": ["--enable_flashattn", "--compile"],
    "fp8": ["--enable_flashattn", "--compile", "--mixed_precision", "fp8", "--fp8_min_width", "16"],
}

MEMORY_MODES = {
    "fp32": [],
    "fp32_seed1": ["--seed", "1"],
    "adamw8bit": ["--optimizer", "adamw8bit"],
    "bf16": ["--master_weights", "bf16"],
    "bf16_8bit": ["--optimizer", "adamw8bit", "--master_weights", "bf16"],
    "sr_8bit_fused": ["--optimizer", "adamw8bit", "--master_weights", "bf16_sr", "--fused_backward_pass"],
    "sr_8bit": ["--optimizer", "adamw8bit", "--master_weights", "bf16_sr"],
    "fp32_library": ["--fused_optimizer", "off"],
    "delayed": ["--cpu_offload", "all", "--delayed_update"],
    "adamw4bit": ["--optimizer", "adamw4bit"],
    "adamw_fp8": ["--optimizer", "adamw_fp8"],
    "adafactor": ["--optimizer", "adafactor", "--lr", "1e-2"],
}

VIDEO_MODES = {
    "bf16": [],
    "bf16_seed1": ["--seed", "1"],
    "fp8_base": ["--fp8_base"],
}


def write_digits_folder(root: Path, size: int) -> Path:
    """The built-in digits as ``root/<label>/<index>.png``, (size, size) 8-bit grey, bicubic; written once (a
    finished folder holds a ``.done`` marker)."""
    from PIL import Image

    from ditforge.data.digits import load_digits_arrays

    if (root / ".done").exists():
        return root
    images, labels = load_digits_arrays()
    pixels = ((images[:, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    for i, (image, label) in enumerate(zip(pixels, labels.tolist())):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, "L").resize((size, size), Image.BICUBIC).save(root / str(label) / f"{i:04d}.png")
    (root / ".done").touch()
    return root


def speed(args) -> None:
    work = Path(args.work)
    data = write_digits_folder(work / f"digits{args.image_size}", args.image_size)
    # every mode after these: a later --mixed_precision (fp8) wins
    curves = run_modes(SPEED_MODES, {"bf16", "bf16_seed1", *args.modes.split(",")}, work, args.window, args.steps,
                       "--data", str(data), "--image_size", str(args.image_size), "--model", args.model,
                       *(["--depth", str(args.depth)] if args.depth else []), "--batch_size", "64", "--max_steps",
                       str(args.steps), "--lr", "1e-4", "--mixed_precision", "bf16", "--sample_every", "0",
                       "--log_every", "1", "--device", args.device, jobs=args.jobs)
    model = f"{args.model}, {args.depth} blocks" if args.depth else args.model
    report(curves, "bf16", "bf16_seed1", args.window,
           f"{model} on digits upsampled to {args.image_size}px, from scratch, lr 1e-4", args.json, args.plot,
           model=args.model, depth=args.depth, image_size=args.image_size, steps=args.steps)


def memory(args) -> None:
    work = Path(args.work)
    common = ["--data", "digits", "--model", "DiT-T/2", "--batch_size", "64", "--sample_every", "0",
              "--log_every", "1", "--device", args.device]
    base = work / "base"  # trained once, like a mode
    run_modes({"base": ["--max_steps", str(args.base_steps), "--lr", "1e-3"]}, {"base"}, work, args.window,
              args.base_steps, *common)
    curves = run_modes(MEMORY_MODES, {"fp32", "fp32_seed1", *args.modes.split(",")}, work, args.window, args.steps,
                       *common, "--init_from", str(base), "--max_steps", str(args.steps), "--lr", "1e-4",
                       "--mixed_precision", "bf16", "--ema_decay", "0", jobs=args.jobs)
    report(curves, "fp32", "fp32_seed1", args.window, "DiT-T/2 digits fine-tune, lr 1e-4, bf16 compute", args.json,
           args.plot, base_steps=args.base_steps, steps=args.steps)


def video(args) -> None:
    work = Path(args.work)
    pipe = Path(args.pipe) if args.pipe else work / "wan13"
    if not args.pipe and not (pipe / "model_index.json").exists():
        from finetune import build_wan  # benchmarks/ is the script's folder, first on sys.path

        build_wan(pipe)
    curves = run_modes(VIDEO_MODES, {"bf16", "bf16_seed1", *args.modes.split(",")}, work, args.window, args.steps,
                       "--init_from", str(pipe), "--data", "clips", "--num_frames", str(args.num_frames),
                       "--frame_interval", "2", "--image_size", str(args.image_size), "--batch_size", "3",
                       "--lora_rank", "32", "--max_steps", str(args.steps), "--lr", "1e-4", "--mixed_precision",
                       "bf16", "--sample_every", "0", "--log_every", "1", "--device", args.device, jobs=args.jobs)
    report(curves, "bf16", "bf16_seed1", args.window,
           f"Wan2.1-T2V-1.3B config LoRA r32 on clips {args.image_size}px x {args.num_frames}, lr 1e-4", args.json,
           args.plot, pipe=str(pipe), image_size=args.image_size, num_frames=args.num_frames, steps=args.steps)


CACHE_MODES = {"plain": [], "fora2": ["--fora", "2"], "fora3": ["--fora", "3"], "pab": ["--pab"],
               # fewer solver steps (the later --num_sampling_steps wins)
               "ddim25": ["--num_sampling_steps", "25"], "ddim20": ["--num_sampling_steps", "20"],
               "dpm++20": ["--sampler", "dpm++", "--num_sampling_steps", "20"]}


def write_rows(args, rows: list[dict]) -> None:
    """A reuse suite's rows to ``--out`` (if given) with the date, torch's version and the arguments."""
    if args.out:
        Path(args.out).write_text(json.dumps(dict(date=datetime.datetime.now().isoformat(timespec="minutes"),
                                                  torch=torch.__version__, args=vars(args), rows=rows), indent=1))


def cache_images(args) -> None:
    """The ``cache-images`` suite: each of ``--modes`` sampled from the default digits run, scored, timed."""
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
                        "--save_npz", str(npz), *CACHE_MODES[mode]], check=True)
        seconds = time.perf_counter() - t0
        samples = np.load(npz)["samples"]
        plain = samples if plain is None else plain
        scores = subprocess.run([sys.executable, "-m", "ditforge", "eval", "--samples", str(npz), "--ref", "digits"],
                                check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        per_sample = [(psnr(a, b), ssim(a, b)) for a, b in zip(plain, samples)]
        finite = [v for v, _ in per_sample if np.isfinite(v)]
        rows.append(dict(mode=mode, flags=CACHE_MODES[mode], sample_s=seconds, samples=len(samples),
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
    write_rows(args, rows)


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


def cache_video(args) -> None:
    """The ``cache-video`` suite: each of ``--models`` trained on the built-in clips, sampled plain and with PAB."""
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
        print(f"| {r['model']} | {r['train_steps']} | {r['videos']} | {min(r['psnr_db']):.1f} / "
              f"{np.mean(finite):.1f} | {min(r['ssim']):.4f} / {np.mean(r['ssim']):.4f} | {r['sampling_s']:.1f} / "
              f"{r['sampling_pab_s']:.1f} |")
    write_rows(args, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="suite", required=True)
    s = sub.add_parser("speed", help="the training speed-ups from scratch")
    add_options(s, "/tmp/ditforge-speed-quality", SPEED_MODES)
    s.add_argument("--model", default="DiT-S/2")
    s.add_argument("--image_size", type=int, default=32)
    s.add_argument("--depth", type=int, default=None, help="blocks in place of the size's (train's --depth)")
    m = sub.add_parser("memory", help="the memory modes as fine-tunes")
    add_options(m, "/tmp/ditforge-lowmem-quality", MEMORY_MODES)
    m.add_argument("--base_steps", type=int, default=1000)
    v = sub.add_parser("video", help="a video pipeline's LoRA with its base stored in fp8")
    add_options(v, "/tmp/ditforge-video-quality", VIDEO_MODES)
    v.add_argument("--pipe", default=None, help="a WanPipeline folder (default: the 1.3B config built in --work)")
    v.add_argument("--image_size", type=int, default=128)
    v.add_argument("--num_frames", type=int, default=9)
    ci = sub.add_parser("cache-images", help="FORA, PAB and fewer steps on the default digits run")
    ci.add_argument("--modes", default=",".join(CACHE_MODES))
    ci.add_argument("--samples_per_class", type=int, default=20)
    ci.add_argument("--sampling_steps", type=int, default=50)
    ci.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "ditforge-cache-quality"))
    ci.add_argument("--out")
    cv = sub.add_parser("cache-video", help="PAB on video models trained on the built-in clips")
    cv.add_argument("--models", default="STDiT-T/2,vDiT-T/122")
    cv.add_argument("--image_size", type=int, default=8)
    cv.add_argument("--num_frames", type=int, default=4)
    cv.add_argument("--frame_interval", type=int, default=8)
    cv.add_argument("--train_steps", type=int, default=2000)
    cv.add_argument("--sampling_steps", type=int, default=50)
    cv.add_argument("--device", default="auto")
    cv.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "ditforge-pab-quality"))
    cv.add_argument("--out")
    args = ap.parse_args()
    {"speed": speed, "memory": memory, "video": video, "cache-images": cache_images,
     "cache-video": cache_video}[args.suite](args)


if __name__ == "__main__":
    main()
