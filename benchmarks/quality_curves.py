"""What the loss-curve quality checks share (``lowmem_quality.py``, ``speed_quality.py``): their common options, one
``ditforge train`` run per mode in a subprocess (kept in ``--work``: a finished mode is not run again), the per-step
losses, and the verdict of each mode against a reference and a second seed.

A mode is "within run-to-run noise" when the mean loss of its last ``window`` steps differs from the reference's by
no more than the second seed's does. ``report`` prints that, writes JSON (curves every step, window means) and a
plot of the curves, smoothed over 100 steps, in one figure (matplotlib).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch


def parser(doc: str, work: str, modes: dict[str, list[str]]) -> argparse.ArgumentParser:
    """The options of both scripts: --work, --steps (2000), --window (500), --device, --json, --plot, --modes."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--work", default=work)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--window", type=int, default=500)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--modes", default=",".join(modes), help="comma-separated names of MODES")
    return ap


def run_modes(modes: dict[str, list[str]], chosen: set[str], work: Path, window: int, steps: int,
              *common: str) -> dict[str, list[float]]:
    """Train each chosen mode (``ditforge train COMMON --outputs WORK/NAME FLAGS``, ``steps`` steps logged every
    step) unless ``WORK/NAME`` already holds a finished run of ``steps`` steps (another run there is replaced);
    returns its per-step losses by name, printing the mean of the last ``window``."""
    curves = {}
    for name, flags in modes.items():
        if name not in chosen:
            continue
        out = work / name
        if not finished(out, steps):
            shutil.rmtree(out, ignore_errors=True)
            train(*common, "--outputs", str(out), *flags)
        curves[name] = losses(out)
        print(f"{name:16s} last-{window} mean loss {np.mean(curves[name][-window:]):.5f}", flush=True)
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


def report(curves: dict[str, list[float]], reference: str, seed: str, window: int, title: str,
           json_path: str | None, plot_path: str | None, **meta) -> dict:
    """Judge every curve against ``curves[reference]`` with the noise |mean(seed) - mean(reference)| over the last
    ``window`` steps; print the verdicts, write ``json_path`` and ``plot_path`` (each optional). Returns the
    verdicts: per mode its window mean, its difference to the reference and whether it is within the noise."""
    means = {k: float(np.mean(v[-window:])) for k, v in curves.items()}
    noise = abs(means[seed] - means[reference])
    verdict = {k: {"mean": means[k], "diff_vs_reference": means[k] - means[reference],
                   "within_noise": abs(means[k] - means[reference]) <= noise} for k in curves}
    print(f"run-to-run noise ({reference} vs {seed}): {noise:.5f}")
    for k, v in verdict.items():
        print(f"{k:14s} {v['mean']:.5f}  vs {reference} {v['diff_vs_reference']:+.5f}  "
              f"within noise: {v['within_noise']}")
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "window": window, **meta}
    if json_path:
        Path(json_path).write_text(json.dumps({"meta": meta, "reference": reference, "noise": noise,
                                               "modes": verdict, "curves": curves}))
    if plot_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        k = min(100, min(len(c) for c in curves.values()))
        for name, curve in curves.items():
            smooth = np.convolve(curve, np.ones(k) / k, mode="valid")
            ax.plot(np.arange(k, len(curve) + 1), smooth, label=f"{name} ({means[name]:.4f})")
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (mean of {k} steps)")
        ax.set_title(f"{title} ({meta['device']}, {meta['date']})")
        ax.legend()
        fig.savefig(plot_path, dpi=100, bbox_inches="tight")
    return verdict
