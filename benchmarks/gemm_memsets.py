"""What cuBLASLt's workspace costs DiT-XL/2 sampling: the model's forward with and without one.

Each setting runs in a process of its own (PyTorch reads ``CUBLASLT_WORKSPACE_SIZE``, in KiB, once, at the first
cuBLASLt GEMM): unset (PyTorch's default workspace), 0, and 1. In each, DiT-XL/2 with random weights, prepared as
``ditforge sample --mixed_precision fp8 --compile --enable_flashattn`` prepares it (compiled without CUDA graphs),
at 16 x 256 tokens (batch 8 under guidance) and 2 x 256 (batch 1): the memsets and GEMM kernel time of one
forward (torch.profiler), and the forward's time inside a CUDA graph, as the sampling loop runs it
(``quant_kernel.graph_us``: 50 forwards in one graph, median of 20 replays). ``prepare_model`` sets the
variable to 0 where it is unset, so the default's child runs a GEMM first.

    PYTHONPATH=. TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python benchmarks/gemm_memsets.py \
        --out benchmarks/results/sampling/gemm_memsets.json

(Inductor's on-disk cache off: a second process loading the first one's multi-kernel reductions failed in
``MultiKernelCall.load_cache``, torch 2.11.0.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import datetime

import torch

SETTINGS = ("default", "0", "1")


def measure(setting: str) -> list[dict]:
    from ditforge.models import create_model
    from ditforge.parallel.mesh import Dist
    from ditforge.sample import prepare_model
    from quant_kernel import graph_us

    torch.manual_seed(0)
    dev = torch.device("cuda")
    if setting == "default":  # a first cuBLASLt GEMM fixes PyTorch's default before prepare_model would set 0
        a = torch.ones(16, 16, device=dev).to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    model = prepare_model(create_model("DiT-XL/2", 32, 4, 1000, True, 0.1), Dist(device=dev), mixed_precision="fp8",
                          compile="default", enable_flashattn=True, batch_size=16)
    cuda = torch.autograd.DeviceType.CUDA
    rows = []
    for n in (16, 2):
        x = torch.randn(n, 4, 32, 32, device=dev)
        t, y = torch.randint(0, 1000, (n,), device=dev), torch.randint(0, 1000, (n,), device=dev)
        with torch.no_grad():
            for _ in range(3):
                model(x, t, y)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                model(x, t, y)
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == cuda]
            ms = graph_us(lambda: model(x, t, y)) / 1e3
        rows.append({"workspace_kib": setting, "rows": n, "forward_ms": ms,
                     "memsets": sum("memset" in e.name.lower() for e in kernels),
                     "gemm_kernel_us": sum(e.device_time for e in kernels if "gemm" in e.name or "nvjet" in e.name)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        measure(args.child)
        return
    rows = []
    for setting in SETTINGS:
        env = {k: v for k, v in os.environ.items() if k != "CUBLASLT_WORKSPACE_SIZE"}
        if setting != "default":
            env["CUBLASLT_WORKSPACE_SIZE"] = setting
        out = subprocess.run([sys.executable, __file__, "--child", setting], env=env, check=True, text=True,
                             stdout=subprocess.PIPE).stdout
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    print("| CUBLASLT_WORKSPACE_SIZE | rows | forward ms (CUDA graph) | memsets a forward | GEMM kernels us |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workspace_kib']} | {r['rows']} | {r['forward_ms']:.3f} | {r['memsets']} | "
              f"{r['gemm_kernel_us']:.0f} |")
    if args.out:
        meta = {"date": datetime.now().isoformat(timespec="minutes"), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
