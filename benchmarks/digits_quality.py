"""The main job, end to end, as a newcomer runs it: `ditforge train` with no arguments (CPU, built-in
digits), then `ditforge sample` with 20 samples per class; a classifier trained on scikit-learn's real
digits labels the samples, and we report how often it agrees with the requested class. The training run also
evaluates itself at its end (`--eval_every 1000`: digits-FID, precision, recall and accuracy of 1,000 EMA samples
with the built-in extractor), which changes nothing in its training.

Usage: python benchmarks/digits_quality.py [--workdir DIR] [--json OUT.json] [-- extra train flags]
Prints wall times and accuracy; exits 1 if the accuracy is under --min_accuracy (default 0.8).

``--sweep`` shows why `ditforge train`'s defaults are what they are instead: class accuracy of 20 samples per class
(the same classifier) against optimizer steps (a checkpoint every ``--every`` up to ``--max_steps``), for the
``--grid`` of model:batch:lr settings, each sampled with DDPM 250 at guidance 4 and 2 and DDIM 50 at guidance 4.
Runs fast on a GPU; the CPU default run must finish in 10 minutes on 2 cores, so the defaults are the cheapest
setting that clears 80% with margin.

    python benchmarks/digits_quality.py --sweep --json benchmarks/results/digits_sweep.json

``--train_extractor`` retrains the built-in digits feature extractor (``ditforge.eval.digits.DigitsCNN``, the
instrument of the digits-FID above) on scikit-learn's real digits and writes it as
``ditforge/eval/digits_cnn.safetensors`` (or ``--out``), with its held-out accuracy in ``--json`` (default
``benchmarks/results/digits_extractor.json``). Deterministic on the CPU (one thread, fixed seed, deterministic
algorithms): a rerun on the same torch build writes the same file. About half a minute on 2 CPU cores.

    python benchmarks/digits_quality.py --train_extractor

``--student TEACHER_RUN`` distils the default run (``ditforge distill --teacher TEACHER_RUN --student_steps 4``, its
wall and CPU time), then draws ``--samples_per_class`` x 10 samples from the teacher at 250 DDPM steps (guidance 4),
the teacher at 4 DDIM steps (guidance 4) and the 4-step student (no guidance), and reports each one's SVM class
accuracy and digits-FID (the built-in extractor, against the 1,797 real digits); exits 1 unless the student's accuracy
is at least 0.98 and its digits-FID at most 1.25x the teacher's at 250 steps. ``--grid_png`` (docs/distill_grid.png)
gets 10 samples of each class from each: the teacher at 250 steps, at 4 DDIM steps, the student, left to right.
``--student_run RUN`` evaluates a finished distillation instead of distilling; ``--reuse_teacher`` takes the
teacher's samples already in ``--workdir``. The child processes' CPU time is reported beside the wall time.

    python benchmarks/digits_quality.py --student /work/wt/distill_runs/teacher --samples_per_class 100 \
        --json benchmarks/results/digits_distill.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def real_digits_classifier():
    """An RBF SVM on all 1,797 real 8x8 digits (pixel values 0..16); ~99% on held-out real digits."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.svm import SVC

    d = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(d.data, d.target, test_size=0.25, random_state=0)
    held_out = SVC(gamma=0.001).fit(x_tr, y_tr).score(x_te, y_te)
    return SVC(gamma=0.001).fit(d.data, d.target), held_out


EPOCHS, BATCH, LR, WEIGHT_DECAY = 40, 64, 2e-3, 1e-4  # --train_extractor


def shift(x, gen):
    """Each image moved by up to one pixel in each direction (padded with -1, the background): generated
    digits are not always centred exactly like the real ones."""
    import torch

    padded = torch.nn.functional.pad(x, (1, 1, 1, 1), value=-1.0)
    dy, dx = torch.randint(0, 3, (2, len(x)), generator=gen)
    return torch.stack([padded[i, :, dy[i] : dy[i] + 8, dx[i] : dx[i] + 8] for i in range(len(x))])


def train_extractor(args) -> None:
    """``--train_extractor``: train ``DigitsCNN`` on the training split, report the held-out accuracy."""
    import torch
    from safetensors.torch import save_file

    from ditforge.atomic import atomic_path
    from ditforge.eval.digits import (WEIGHTS, DigitsCNN, class_accuracy, held_out_split, real_digits_uint8,
                                      to_model_input)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    images, labels = real_digits_uint8()
    x = to_model_input(torch.from_numpy(images).permute(0, 3, 1, 2))
    y = torch.from_numpy(labels)
    train, held_out = (torch.from_numpy(i) for i in held_out_split(len(y)))
    model = DigitsCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, EPOCHS * -(-len(train) // BATCH))
    start = time.perf_counter()
    for _ in range(EPOCHS):
        for idx in train[torch.randperm(len(train), generator=gen)].split(BATCH):
            loss = torch.nn.functional.cross_entropy(model(shift(x[idx], gen))[1], y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    with torch.no_grad():
        accuracy = class_accuracy(model(x[held_out])[1].numpy(), y[held_out].numpy())
    with atomic_path(args.out or WEIGHTS) as tmp:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
    result = {"held_out_accuracy": accuracy, "num_train": len(train), "num_held_out": len(held_out),
              "epochs": EPOCHS, "seconds": round(time.perf_counter() - start, 1), "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d")}
    with atomic_path(args.json or "benchmarks/results/digits_extractor.json") as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


def sweep(args) -> None:
    """The ``--sweep`` table: one JSON row per (setting, checkpoint, sampler), printed as it comes."""
    import logging
    import tempfile

    from ditforge.config.load import build_config
    from ditforge.sample import SampleConfig, sample
    from ditforge.weights.read import list_checkpoints
    from ditforge.train.trainer import train

    logging.basicConfig(level=logging.WARNING)
    clf, _ = real_digits_classifier()
    labels = [i % 10 for i in range(200)]
    rows = []
    for item in args.grid.split(","):
        model, batch, lr = item.split(":")
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            cfg = build_config(overrides=dict(model=model, batch_size=int(batch), lr=float(lr),
                                              max_steps=args.max_steps, ckpt_every=args.every, keep_last=100,
                                              sample_every=0, outputs=tmp, num_workers=0))
            train(cfg)
            train_s = time.perf_counter() - t0
            for ckpt in list_checkpoints(Path(tmp)):
                for cfg_scale, steps, sampler in ((4.0, 250, "ddpm"), (2.0, 250, "ddpm"), (4.0, 50, "ddim")):
                    images = sample(SampleConfig(ckpt=str(ckpt), class_labels=labels, cfg_scale=cfg_scale,
                                                 num_sampling_steps=steps, sampler=sampler,
                                                 out=f"{tmp}/grid.png"))
                    x = images[..., 0].reshape(len(images), -1).astype(np.float64) * (16 / 255)
                    acc = float((clf.predict(x) == np.asarray(labels)).mean())
                    row = dict(model=model, batch=int(batch), lr=float(lr), step=int(ckpt.name.split("-")[1]),
                               cfg_scale=cfg_scale, sampler=f"{sampler}{steps}", accuracy=acc,
                               train_s_total=round(train_s, 1))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def classify(npz: Path, clf) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the SVM's predicted classes, uint8 samples, labels) of a ``--save_npz`` file."""
    data = np.load(npz)
    x = data["samples"][..., 0].reshape(len(data["samples"]), -1).astype(np.float64) * (16.0 / 255.0)
    return clf.predict(x), data["samples"], data["labels"]


def comparison_grid(npzs: list[Path], png: str, per_class: int = 10) -> None:
    """One small PNG: for each ``--save_npz`` file, its first ``per_class`` rows of the ten classes (samples are
    drawn for labels i % 10, so a row is 0..9) as a grid, the grids side by side with a grey gap, 4x enlarged."""
    from PIL import Image

    from ditforge.data.images import make_grid

    grids = [make_grid(np.load(f)["samples"][: 10 * per_class], nrow=10)[..., 0] for f in npzs]
    gap = np.full((grids[0].shape[0], 4), 128, dtype=np.uint8)
    row = np.concatenate([part for g in grids for part in (g, gap)][:-1], axis=1)
    Image.fromarray(row.repeat(4, axis=0).repeat(4, axis=1)).save(png, format="PNG")


def student(args) -> int:
    """``--student``: distil, then the three samplings side by side (see the module docstring)."""
    import resource

    from ditforge.eval.digits import evaluate_digits

    work = Path(args.workdir)
    run = Path(args.student_run) if args.student_run else work / "student"
    result = {"date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs",
              "torch": __import__("torch").__version__, "distill_flags": args.train_flags}
    if not args.student_run:
        t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(["ditforge", "distill", "--teacher", args.student, "--outputs", str(run), *args.train_flags],
                       check=True)
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        result |= {"distill_wall_s": round(time.perf_counter() - t0, 1),
                   "distill_cpu_s": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 1)}
    clf, held_out = real_digits_classifier()
    n = str(10 * args.samples_per_class)
    # the cheap rows first; the JSON is rewritten after each row, so a run cut short keeps what it measured
    rows = {"student_4_steps": [str(run)],
            "teacher_ddim4_cfg4": [args.student, "--sampler", "ddim", "--num_sampling_steps", "4"],
            "teacher_ddpm250_cfg4": [args.student]}
    for name, (ckpt, *flags) in rows.items():
        npz, t0, cpu0 = work / f"{name}.npz", time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        png = str(work / f"{name}.png")
        if not (args.reuse_teacher and name.startswith("teacher") and npz.exists()):
            subprocess.run(["ditforge", "sample", "--ckpt", ckpt, "--num_samples", n, "--out", png, "--save_npz",
                            str(npz), *flags], check=True)
        pred, samples, labels = classify(npz, clf)
        acc = float((pred == labels).mean())
        fid = evaluate_digits(samples, labels, metrics=("fid", "accuracy"))
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        result[name] = {"svm_accuracy": acc, "digits_fid": fid["fid"], "cnn_accuracy": fid["accuracy"],
                        "sample_wall_s": round(time.perf_counter() - t0, 1),
                        "sample_cpu_s": round(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime, 1)}
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    result["classifier_held_out_accuracy_on_real_digits"] = held_out
    if args.grid_png:
        comparison_grid([work / f"{name}.npz" for name in reversed(rows)], args.grid_png)
    ok = (result["student_4_steps"]["svm_accuracy"] >= 0.98
          and result["student_4_steps"]["digits_fid"] <= 1.25 * result["teacher_ddpm250_cfg4"]["digits_fid"])
    result["targets_met"] = ok
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="outputs/digits-quality")
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--min_accuracy", type=float, default=0.8)
    p.add_argument("--samples_per_class", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="accuracy against steps for each --grid setting instead")
    p.add_argument("--grid", default="DiT-T/2:128:3e-4,DiT-T/2:64:3e-4,DiT-T/2:128:1e-3,DiT-T/2:64:1e-3",
                   help="--sweep: comma-separated model:batch:lr")
    p.add_argument("--max_steps", type=int, default=2400, help="--sweep: steps of each setting")
    p.add_argument("--every", type=int, default=400, help="--sweep: steps between the checkpoints sampled")
    p.add_argument("--train_extractor", action="store_true", help="retrain the built-in digits extractor instead")
    p.add_argument("--out", help="--train_extractor: where to write the weights (default: the built-in file)")
    p.add_argument("--student", metavar="TEACHER_RUN", help="distil TEACHER_RUN and compare the student instead")
    p.add_argument("--student_run", help="--student: evaluate this finished distillation run instead of distilling")
    p.add_argument("--reuse_teacher", action="store_true",
                   help="--student: reuse the teacher's samples already in --workdir (same seed, same flags)")
    p.add_argument("--grid_png", help="--student: where to write the student's grid (e.g. docs/distill_grid.png)")
    p.add_argument("train_flags", nargs="*", help="extra flags for ditforge train (after --; with --student, for "
                   "ditforge distill)")
    args = p.parse_args()
    if args.student:
        return student(args)
    if args.train_extractor:
        train_extractor(args)
        return 0
    if args.sweep:
        sweep(args)
        return 0
    work = Path(args.workdir)
    run = work / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    t0 = time.perf_counter()
    subprocess.run(["ditforge", "train", "--outputs", str(run), "--eval_every", "1000", *args.train_flags], check=True)
    train_s = time.perf_counter() - t0
    npz = work / "samples.npz"
    t0 = time.perf_counter()
    subprocess.run(["ditforge", "sample", "--ckpt", str(run), "--num_samples", str(10 * args.samples_per_class),
                    "--out", str(work / "samples.png"), "--save_npz", str(npz)], check=True)
    sample_s = time.perf_counter() - t0
    clf, held_out = real_digits_classifier()
    pred, _, labels = classify(npz, clf)
    acc = float((pred == labels).mean())
    per_class = {int(c): float((pred[labels == c] == c).mean()) for c in np.unique(labels)}
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs",
              "torch": __import__("torch").__version__, "train_wall_s": round(train_s, 1),
              "sample_wall_s": round(sample_s, 1), "accuracy": acc, "per_class_accuracy": per_class,
              "classifier_held_out_accuracy_on_real_digits": held_out, "grid": str(work / "samples.png"),
              "eval_at_end": {k: v for k, v in json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]).items()
                              if k == "step" or k.startswith("digits_")}}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if acc >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
