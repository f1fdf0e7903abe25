"""GPU timing shared by the benchmark scripts (METHOD.md: warm up, CUDA events, medians)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_median_ms(fn: Callable[[], object], steps: int = 20, warmup: int = 5, inner: int = 1) -> float:
    """Median milliseconds per ``fn()``: ``warmup`` untimed calls, then ``steps`` samples, each CUDA events
    around ``inner`` back-to-back calls (inner > 1 times the GPU rather than the Python launch path, as in a
    training step where the CPU runs ahead) divided by ``inner``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)
