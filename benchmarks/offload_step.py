"""What ``--cpu_offload optimizer`` costs on this machine: pinned host <-> GPU copy bandwidth (each way alone, both
at once on two streams), and one optimizer step over DiT-XL/2's parameters (675M; bf16 weights, stochastic
rounding, 8-bit moments) with the states resident on the GPU against streamed from pinned host memory. A step
alone has nothing to overlap its transfers with, so the offloaded row is about the state's bytes over the
bandwidth; inside a backward (``--fused_backward_pass``) the transfers overlap the blocks' compute. CUDA events,
medians.

    PYTHONPATH=. python benchmarks/offload_step.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import cuda_median_ms

from ditforge.models import create_model
from ditforge.parallel.optim import CompensatedAdamW

MIB = 256


def bandwidth() -> dict:
    n = MIB * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host2, dev2 = torch.empty_like(host).pin_memory(), torch.empty_like(dev)
    side = torch.cuda.Stream()

    def both():
        side.wait_stream(torch.cuda.current_stream())
        dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(side):
            host2.copy_(dev2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    rows = {"h2d": lambda: dev.copy_(host, non_blocking=True), "d2h": lambda: host2.copy_(dev2, non_blocking=True),
            "both": both}
    return {k: round(n / (cuda_median_ms(f, steps=10, warmup=3) / 1e3) / 1e9, 1) for k, f in rows.items()}


def step_ms(offload: bool) -> float:
    torch.manual_seed(0)
    model = create_model("DiT-XL/2", 32, 4, 1000).cuda()
    params = list(model.parameters())
    for p in params:
        p.data = p.data.bfloat16()
        p.grad = torch.randn_like(p)
    opt = CompensatedAdamW(params, lr=1e-4, states="8bit", rounding="stochastic", fused=True, offload=offload)
    return cuda_median_ms(opt.step, steps=5, warmup=3, inner=3)  # inner: downloads of a step end in the next


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    bw = bandwidth()
    print(f"pinned copies of {MIB} MiB: host->GPU {bw['h2d']} GB/s, GPU->host {bw['d2h']} GB/s, both at once "
          f"{bw['both']} GB/s each", flush=True)
    resident, offloaded = step_ms(False), step_ms(True)
    state_gb = 675e6 * (2 + 8 / 256) / 1e9
    print(f"| DiT-XL/2 step, 8-bit moments, SR bf16 | resident {resident:.2f} ms | offloaded {offloaded:.2f} ms | "
          f"{state_gb:.2f} GB each way: {state_gb / (offloaded / 1e3):.1f} GB/s |", flush=True)
    if args.out:
        env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)
        with open(args.out, "w") as f:
            json.dump(dict(env=env, bandwidth_gb_s=bw, resident_ms=round(resident, 2),
                           offloaded_ms=round(offloaded, 2)), f, indent=1)


if __name__ == "__main__":
    main()
