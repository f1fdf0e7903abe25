"""Markdown table of benchmarks/multi_gpu.py results: python benchmarks/multi_gpu_table.py ONE.json MANY.json"""

import json
import sys

one, many = (json.load(open(p)) for p in sys.argv[1:3])
base = one["rows"][0]["images_per_sec_per_gpu"]
print(f"{many['env']}\n")
print("| plugin | GPUs | images/sec per GPU | scaling vs 1 GPU | peak memory (GiB) | weights + Adam + EMA (GiB) |"
      " save blocks (sync) | save blocks (async) |")
print("|---|---|---|---|---|---|---|---|")
for r in one["rows"] + many["rows"]:
    save = (f"{r['save_sync_blocking_s']:.2f} s | {r['save_async_blocking_s']:.2f} s "
            f"({100 * r['save_async_blocking_s'] / r['save_sync_blocking_s']:.0f}%)"
            if "save_sync_blocking_s" in r else "- | -")
    print(f"| {r['plugin']} | {r['gpus']} | {r['images_per_sec_per_gpu']:.1f} | "
          f"{100 * r['images_per_sec_per_gpu'] / base:.1f}% | {r['peak_memory_gib']:.1f} | "
          f"{r['weights_optimizer_ema_gib']:.1f} | {save} |")
