"""GPU time of the row-wise float8 quantization kernel (``ditforge.ops.triton.quant.rowwise_e4m3_kernel``, behind
``ditforge.ops.fp8.quantize_rows``) over its launch configurations, at DiT-XL/2's sampling shapes: M = 16 x 256
rows (batch 8 under guidance) and 2 x 256 (batch 1); D = 1152 (the qkv, proj and fc1 inputs) and 4608 with the
GELU (fc2's input; and without it, what fc2's input would cost after a bf16 fc1 with the GELU in its epilogue).
Against PyTorch's plain cast of the same tensor to e4m3 (``q.copy_(x)``: the same bytes read and written,
without the row maximum), the bandwidth such a pass can reach.

Then the fused LayerNorm pass of the float8 blocks (``layernorm_modulate_e4m3_kernel``: the gated residual,
LayerNorm, modulate and the quantization in one pass; and without the residual) over its launch configurations,
against what it replaces: the same PyTorch ops compiled by inductor (multi-kernel reductions on, as sampling
compiles) followed by ``quantize_rows``. B x N = 16 x 256 and 2 x 256, D = 1152, bf16.

Timing: each candidate launched 50 times inside one CUDA graph (so host and launch overhead are not counted, as
in the sampling loop's graph), the graph replayed 20 times, CUDA events, median per launch. An eager loop
around the op measures Python dispatch instead (about 165 us a call on an H100, whatever the size: how a first
version of this script misled).

    PYTHONPATH=. python benchmarks/quant_kernel.py --out benchmarks/results/sampling/quant_kernel.json
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime

import torch

from ditforge.ops import fp8
from ditforge.ops.modulate import gated_residual_reference, layernorm_modulate_reference
from ditforge.ops.triton import quant
from timing import cuda_median_ms

SHAPES = ((4096, 1152, False), (4096, 4608, True), (4096, 4608, False), (512, 1152, False), (512, 4608, True))
LAUNCHES, REPLAYS = 50, 20


def graph_us(launch) -> float:
    """Median GPU time of one ``launch()`` in microseconds, from LAUNCHES launches captured in a CUDA graph."""
    launch()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES):
            launch()
    return cuda_median_ms(graph.replay, steps=REPLAYS, warmup=1) * 1e3 / LAUNCHES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    rows_out = []
    print("| M x D | GELU | config now (ROWS, warps) | us | best (ROWS, warps) | us | GB/s | plain cast us | GB/s |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|")
    for M, D, gelu in SHAPES:
        x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(M, D, device="cuda", dtype=torch.float8_e4m3fn)
        s = torch.empty(M, 1, device="cuda", dtype=torch.float32)
        block_a, block_b, rows_now, warps_now = fp8._config(D)
        timed = {}
        for rows in (1, 2, 4, 8):
            for warps in (1, 2, 4, 8, 16):
                width = rows * (block_a + block_b)
                if width > 16384 or width > 64 * 32 * warps:  # over 64 values a thread: spills
                    continue
                timed[rows, warps] = graph_us(lambda: quant.rowwise_e4m3_kernel[(-(-M // rows),)](
                    x, q, s, M, D, x.stride(0), GELU=gelu, ROWS=rows, BLOCK_A=block_a, BLOCK_B=block_b,
                    INTERPRETED=False, num_warps=warps))
        best = min(timed, key=timed.get)
        copy = graph_us(lambda: q.copy_(x))  # a plain cast to e4m3: the same bytes read and written, no row maximum
        moved = M * D * 3 + M * 4  # bytes: bf16 in, e4m3 out, a float32 scale per row (the cast: M * D * 3)
        row = dict(M=M, D=D, gelu=gelu, config_now=(rows_now, warps_now), us_now=timed[rows_now, warps_now],
                   best=best, us_best=timed[best], gbs_best=moved / timed[best] / 1e3, copy_us=copy,
                   copy_gbs=M * D * 3 / copy / 1e3, all={f"{r}x{w}": t for (r, w), t in timed.items()})
        rows_out.append(row)
        print(f"| {M} x {D} | {gelu} | {rows_now}, {warps_now} | {row['us_now']:.1f} | {best[0]}, {best[1]} | "
              f"{row['us_best']:.1f} | {row['gbs_best']:.0f} | {copy:.1f} | {row['copy_gbs']:.0f} |", flush=True)
    fused_rows = [fused_layernorm(B, residual) for B in (16, 2) for residual in (True, False)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(date=datetime.now().isoformat(timespec="minutes"), device=torch.cuda.get_device_name(),
                           torch=torch.__version__, rows=rows_out, fused_layernorm=fused_rows), f, indent=1)


def fused_layernorm(B: int, residual: bool, N: int = 256, D: int = 1152) -> dict:
    """One row of the fused-LayerNorm table: the kernel's configurations against compiled PyTorch + quantize_rows."""
    if B == 16 and residual:
        print("\n| B x N x D | residual | config now (ROWS, warps) | us | best (ROWS, warps) | us | "
              "compiled ops + quantize_rows us |\n|---|---|---|---:|---|---:|---:|")
    x, y = (torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mods = torch.randn(B, 6 * D, device="cuda", dtype=torch.bfloat16)
    shift, scale, gate = mods[:, :D], mods[:, D:2 * D], mods[:, 2 * D:3 * D]
    x_out, q = torch.empty_like(x), torch.empty(B, N, D, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty(B, N, 1, device="cuda", dtype=torch.float32)
    block_a, block_b, rows_now, warps_now = fp8._layernorm_config(D)
    timed = {}
    for rows in (1, 2, 4, 8):
        for warps in (1, 2, 4, 8):
            if rows * (block_a + block_b) > 64 * 32 * warps:  # over 64 values a thread: spills
                continue
            timed[rows, warps] = graph_us(lambda: quant.layernorm_modulate_e4m3_kernel[(-(-N // rows), B)](
                x, y, gate, x_out, shift, scale, q, s, N, D, gate.stride(0), shift.stride(0), scale.stride(0), 1e-6,
                RESIDUAL=residual, ROWS=rows, BLOCK_A=block_a, BLOCK_B=block_b, INTERPRETED=False,
                num_warps=warps))
    best = min(timed, key=timed.get)

    def unfused(x, y):
        if residual:
            x = gated_residual_reference(x, y, gate)
        return x, layernorm_modulate_reference(x, shift, scale, 1e-6)

    compiled = torch.compile(unfused, options={"triton.multi_kernel": 1}, dynamic=False)
    plain = graph_us(lambda: fp8.quantize_rows(compiled(x, y)[1]))
    row = dict(B=B, N=N, D=D, residual=residual, config_now=(rows_now, warps_now), us_now=timed[rows_now, warps_now],
               best=best, us_best=timed[best], compiled_then_quantize_us=plain,
               all={f"{r}x{w}": t for (r, w), t in timed.items()})
    print(f"| {B} x {N} x {D} | {residual} | {rows_now}, {warps_now} | {row['us_now']:.1f} | {best[0]}, {best[1]} | "
          f"{row['us_best']:.1f} | {plain:.1f} |", flush=True)
    return row


if __name__ == "__main__":
    main()
