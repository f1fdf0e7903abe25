"""Train the built-in digits feature extractor (``ditforge.eval.digits.DigitsCNN``) on scikit-learn's real
digits and write it as ``ditforge/eval/digits_cnn.safetensors``; prints and stores its held-out accuracy.

Deterministic on the CPU (one thread, fixed seed, deterministic algorithms): a rerun on the same torch build
writes the same file. About half a minute on 2 CPU cores.

Usage: python benchmarks/train_digits_extractor.py [--out FILE] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from safetensors.torch import save_file

from ditforge.atomic import atomic_path
from ditforge.eval.digits import (WEIGHTS, DigitsCNN, class_accuracy, held_out_split, real_digits_uint8,
                                  to_model_input)

EPOCHS, BATCH, LR, WEIGHT_DECAY = 40, 64, 2e-3, 1e-4


def shift(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Each image moved by up to one pixel in each direction (padded with -1, the background): generated
    digits are not always centred exactly like the real ones."""
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1), value=-1.0)
    dy, dx = torch.randint(0, 3, (2, len(x)), generator=gen)
    return torch.stack([padded[i, :, dy[i] : dy[i] + 8, dx[i] : dx[i] + 8] for i in range(len(x))])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(WEIGHTS))
    p.add_argument("--json", default="benchmarks/results/digits_extractor.json")
    args = p.parse_args()
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
    with atomic_path(args.out) as tmp:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp))
    result = {"held_out_accuracy": accuracy, "num_train": len(train), "num_held_out": len(held_out),
              "epochs": EPOCHS, "seconds": round(time.perf_counter() - start, 1), "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d")}
    with atomic_path(args.json) as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
