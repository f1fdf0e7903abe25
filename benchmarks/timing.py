"""What the benchmark scripts share: GPU timing (warm up, CUDA events or CUDA graphs, medians; kernel time from
torch.profiler; the slowest rank's figure), the host-sync counter, and the image fidelity measures (PSNR, SSIM) of
the sampling rows."""

from __future__ import annotations

import contextlib
import statistics
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import torch


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` over the processes of the default group (``value`` itself without one)."""
    t = torch.tensor([value], device=device, dtype=torch.float64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t)


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


def graph_us(launch: Callable[[], object], launches: int = 50, replays: int = 20) -> float:
    """Median GPU time of one ``launch()`` in microseconds, from ``launches`` launches captured in one CUDA graph
    and the graph replayed ``replays`` times: host and launch overhead are not counted, as in a sampling loop's
    graph. (An eager loop around a small op measures Python dispatch instead: about 165 us a call on an H100,
    whatever the size.)"""
    launch()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            launch()
    return cuda_median_ms(graph.replay, steps=replays, warmup=1) * 1e3 / launches


def kernel_ms(fn: Callable[[], object], rounds: int = 5, calls: int = 4, warmup: int = 5) -> float:
    """Median over ``rounds`` of the GPU kernel time of one ``fn()`` in milliseconds: the device time of every
    kernel torch.profiler records over ``calls`` calls, divided by ``calls``. For work too small to keep the GPU
    busy from Python (one layer's compiled forward + backward: CUDA events then time the host's launches, not
    the kernels): what the same kernels cost inside a step that is GPU-bound. Gaps between kernels are not
    counted."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        times.append(sum(ms for ms, _ in cuda_kernels(prof)) / calls)
    return statistics.median(times)


def cuda_kernels(prof: torch.profiler.profile) -> list[tuple[float, str]]:
    """(ms, name) of each GPU kernel a torch.profiler profile recorded, summed over its calls."""
    return [(e.device_time_total / 1e3, e.key) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA]


KERNEL_KINDS = [  # first match wins; names of cuBLAS/cuDNN/Triton/inductor/NCCL kernels on Hopper
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa", "softmax")),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul", "splitk")),
    ("adaln kernels", ("layernorm_modulate", "gated_residual")),
    ("optimizer + ema", ("adam", "lerp", "foreach", "multi_tensor", "norm_kernel")),
    ("layernorm", ("layer_norm", "layernorm")),
    ("inductor fused", ("triton_",)),
]


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel by its name (``KERNEL_KINDS``; "other element-wise" if none matches)."""
    low = name.lower()
    return next((k for k, keys in KERNEL_KINDS if any(s in low for s in keys)), "other element-wise")


def kernel_ms_by_kind(fn: Callable[[], object], calls: int = 2) -> dict[str, float]:
    """GPU kernel time per ``fn()`` in milliseconds by ``kernel_kind``, largest first, over ``calls`` profiled
    calls. Kernels of one stream add up, so with communication overlapping compute the kinds can add to more
    than the call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    for ms, name in cuda_kernels(prof):
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms / calls
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def print_top_kernels(prof: torch.profiler.profile, n: int, title: str) -> None:
    """Print where a torch.profiler profile's GPU time went: the total and its ``n`` largest kernels (ms, share)."""
    kernels = sorted(cuda_kernels(prof), reverse=True)
    total = sum(ms for ms, _ in kernels)
    print(f"{title}: GPU kernel time {total:.1f} ms", flush=True)
    for ms, name in kernels[:n]:
        print(f"  {ms:8.2f} ms {100 * ms / max(total, 1e-9):5.1f}%  {name[:100]}", flush=True)


@contextlib.contextmanager
def host_syncs() -> Iterator[list[str]]:
    """Record every host synchronisation inside the block (``torch.cuda.set_sync_debug_mode("warn")``: a blocking
    copy or wait, after which the GPU idles while the host catches up): yields a list that receives, on exit, the
    ``file:line`` of the Python code behind each. CUDA only; the mode's one-off "prototype feature" notice is not
    a sync and is not counted."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found.extend(f"{w.filename}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message))


def psnr(ref: np.ndarray, img: np.ndarray) -> float:
    """PSNR in dB of uint8 ``img`` against ``ref`` (scikit-image, data range 255); inf when they are equal."""
    from skimage.metrics import peak_signal_noise_ratio

    return float(peak_signal_noise_ratio(ref, img, data_range=255)) if not np.array_equal(ref, img) else float("inf")


def ssim(ref: np.ndarray, img: np.ndarray) -> float:
    """Mean SSIM (scikit-image) over the frames of (..., H, W, C) uint8 arrays."""
    from skimage.metrics import structural_similarity

    ref, img = ref.reshape(-1, *ref.shape[-3:]), img.reshape(-1, *img.shape[-3:])
    return float(np.mean([structural_similarity(a, b, channel_axis=-1, data_range=255) for a, b in zip(ref, img)]))
