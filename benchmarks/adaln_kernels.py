"""The fused adaLN kernels against PyTorch eager and torch.compile of the same reference, on the GPU.

For LayerNorm + modulate and for the gated residual, at DiT-XL/2 (64 x 256 tokens x 1152) and vDiT-XL/222
(8 x 2048 x 1152) shapes, as they run under bf16 autocast (fp32 residual stream, bf16 modulation and branch
outputs): forward time and forward + backward time (median of CUDA-event timings after warm-up), and the
forward's effective bandwidth (bytes the op must move / time).

    PYTHONPATH=. python benchmarks/adaln_kernels.py [--out results/adaln_kernels.json]
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime

import torch
import triton
from timing import cuda_median_ms

from ditforge.ops import fused
from ditforge.ops.modulate import gated_residual_reference, layernorm_modulate_reference


def case(name: str, B: int, N: int, D: int) -> list[dict]:
    dev = torch.device("cuda")
    x = (torch.randn(B, N, D, device=dev) * 3 + 1).requires_grad_()
    shift, scale, gate = (torch.randn(B, D, device=dev, dtype=torch.bfloat16).mul(0.5).requires_grad_()
                          for _ in range(3))
    y = torch.randn(B, N, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    ops = {
        "layernorm_modulate": (
            {"eager": layernorm_modulate_reference, "compile": torch.compile(layernorm_modulate_reference),
             "triton": fused.layernorm_modulate},
            lambda f: f(x, shift, scale, 1e-6),
            x.numel() * 4 + x.numel() * 2,  # read fp32 x, write bf16 h (shift/scale are negligible)
        ),
        "gated_residual": (
            {"eager": gated_residual_reference, "compile": torch.compile(gated_residual_reference),
             "triton": fused.gated_residual},
            lambda f: f(x, y, gate),
            x.numel() * (4 + 2 + 4),  # read fp32 x and bf16 y, write fp32
        ),
    }
    rows = []
    for op, (impls, call, nbytes) in ops.items():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref = call(impls["eager"])
        grad = torch.randn_like(ref)
        for impl, f in impls.items():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = call(f)
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

                def fwd():
                    with torch.no_grad():
                        call(f)

                def fwd_bwd():
                    call(f).backward(grad)

                t_f, t_fb = (cuda_median_ms(f, steps=20, warmup=10, inner=10) for f in (fwd, fwd_bwd))
            rows.append(dict(shape=name, op=op, impl=impl, fwd_ms=t_f, fwd_bwd_ms=t_fb,
                             fwd_gbps=nbytes / t_f / 1e6, max_rel_err_vs_eager=err, out_dtype=str(out.dtype)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    rows = case("DiT-XL/2 64x256x1152", 64, 256, 1152) + case("vDiT-XL/222 8x2048x1152", 8, 2048, 1152)
    env = dict(date=datetime.now().isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(),
               torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
               python=platform.python_version())
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}")
    print("| shape | op | impl | fwd (ms) | fwd GB/s | fwd+bwd (ms) | out dtype | max rel err vs eager |")
    print("|---|---|---|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['op']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_gbps']:.0f} | "
              f"{r['fwd_bwd_ms']:.3f} | {r['out_dtype']} | {r['max_rel_err_vs_eager']:.1e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
