"""Why `ditforge train`'s defaults are what they are: class accuracy of 20 samples per class (judged by an SVM
trained on the real digits, as in digits_quality.py) against optimizer steps, for a few batch sizes and
learning rates. Runs fast on a GPU; the CPU default run must finish in 10 minutes on 2 cores, so this picks
the cheapest setting that clears 80% with margin.

Usage: python benchmarks/digits_sweep.py --json OUT.json [--max_steps 2400] [--every 400]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from digits_quality import real_digits_classifier  # noqa: E402

from ditforge.config import build_config  # noqa: E402
from ditforge.sample import SampleConfig, sample  # noqa: E402
from ditforge.train.checkpoint import list_checkpoints  # noqa: E402
from ditforge.train.trainer import train  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max_steps", type=int, default=2400)
    p.add_argument("--every", type=int, default=400)
    p.add_argument("--grid", default="DiT-T/2:128:3e-4,DiT-T/2:64:3e-4,DiT-T/2:128:1e-3,DiT-T/2:64:1e-3")
    p.add_argument("--json")
    args = p.parse_args()
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


if __name__ == "__main__":
    main()
