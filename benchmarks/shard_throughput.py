"""Shard loader throughput on the CPU: samples/s of one process's ``ShardLoader`` over latent shards of DiT-XL/2
at 256 px (``latent.npy`` 4 x 32 x 32 float16 + ``cls`` per sample, as `extract-features --format wds` writes).

What is measured: wall time of ``next(loader)`` for whole step batches, each a dict of *decoded, collated torch
tensors* (``mean`` (B, 4, 32, 32) float16, ``label`` (B,) int64, plus the sample keys), the loader's stream
states tracked as in training; the shards are local (page cache warm after the first pass: this measures the
loader, not the disk), no GPU, no pinning. ``--num_workers 0`` reads in the process; ``1`` in one data-loader
worker process (the main process then only merges batches). Batch 256, --data_streams 16, --shuffle_shards 4.
Shard set: 100,000 samples in 100 shards of 1,000, written to a temporary folder first (not timed).

    python benchmarks/shard_throughput.py [--samples 100000] [--out benchmarks/results/shard_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ditforge.data.shards import ShardData, ShardWriter, build_shard_loader  # noqa: E402


def write_set(folder: Path, samples: int, shard_size: int) -> None:
    g = np.random.default_rng(0)
    writer = ShardWriter(folder, shard_size)
    for i in range(samples):
        writer.write({"__key__": f"{i:09d}", "latent.npy": g.standard_normal((4, 32, 32), dtype=np.float32)
                      .astype(np.float16), "cls": int(g.integers(1000))})
    writer.close({"kind": "latent", "condition": "class", "vae": "sd-vae-ft-ema", "text_encoder": None,
                  "text_max_length": None, "text_dim": None, "in_channels": 4, "input_size": 32, "num_frames": None,
                  "image_size": 256, "stochastic": False, "num_classes": 1000, "class_captions": None,
                  "random_flip": True, "texts": None})


def measure(data: ShardData, workers: int, batch: int, steps: int, warmup: int) -> float:
    it = iter(build_shard_loader(data, batch, 16, 4, 0, 0, 1, workers, 0, None))
    for _ in range(warmup):
        next(it)
    start = time.perf_counter()
    for _ in range(steps):
        b = next(it)
        assert b["mean"].shape == (batch, 4, 32, 32) and b["mean"].dtype == torch.float16
    return steps * batch / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=100_000)
    p.add_argument("--batch_size", type=int, default=256)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "shard_throughput.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "latents"
        t0 = time.perf_counter()
        write_set(folder, args.samples, 1000)
        written = time.perf_counter() - t0
        data = ShardData(str(folder), None, None)
        steps = args.samples // args.batch_size  # one pass over the set's size after the warm-up
        results = {f"num_workers_{w}": round(measure(data, w, args.batch_size, steps, 20)) for w in (0, 1)}
        size = sum(f.stat().st_size for f in folder.glob("*.tar"))
    record = {
        "what": "samples/s of decoded, collated torch tensors (mean (B,4,32,32) float16 + label) from one process's "
                "ShardLoader, local shards, page cache warm",
        "samples": args.samples, "shards": args.samples // 1000, "bytes": size, "batch_size": args.batch_size,
        "data_streams": 16, "shuffle_shards": 4, "samples_per_sec": results, "write_seconds": round(written, 1),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.machine(),
        "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "numpy": np.__version__,
        "webdataset": __import__("webdataset").__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
