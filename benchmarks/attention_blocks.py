"""One block of ring attention (``ditforge.parallel.sequence.ring``), forward and backward, through each fused
kernel the ring can call: FlashAttention-2's and cuDNN's aten ops with the log-sum-exp, at DiT-XL's 16 heads of
72, bf16, B = 1, for Nq = Nk in --tokens:

    PYTHONPATH=. python benchmarks/attention_blocks.py --out results/attention_blocks_h100.json

Checks first, per length: the kernels' outputs and lse against each other, and the cuDNN backward fed the
FlashAttention-2 forward's O and L (as the ring feeds every block the merged O and L) against the
FlashAttention-2 backward. Times: median of 10 after 3 calls, CUDA events (benchmarks/timing.py); "sdpa" is
``F.scaled_dot_product_attention`` on the cuDNN backend alone, the forward the ring's kernel competes with.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ditforge.ops.attention import cudnn_attention_preferred
from ditforge.parallel.sequence.ring import fused_block_backward, fused_block_forward
from timing import cuda_median_ms

HEADS, DH = 16, 72


def block(n: int) -> dict:
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(1, HEADS, n, DH, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    scale = DH ** -0.5
    row = dict(tokens=n)
    outs = {kernel: fused_block_forward(kernel, q, k, v, scale) for kernel in ("flash", "cudnn")}
    (f_out, f_lse, f_aux), (c_out, c_lse, c_aux) = outs["flash"], outs["cudnn"]
    final = f_out.to(q.dtype)
    grads = {kernel: fused_block_backward(kernel, q, k, v, scale, final, f_lse, dout, aux)
             for kernel, aux in (("flash", f_aux), ("cudnn", c_aux))}
    row["out_max_diff"] = (f_out - c_out).abs().max().item()
    row["lse_max_diff"] = (f_lse - c_lse).abs().max().item()
    row["grad_max_diff"] = max((a - b).abs().max().item() for a, b in zip(grads["flash"], grads["cudnn"]))
    row["grad_max"] = max(a.abs().max().item() for a in grads["flash"])
    for kernel, aux in (("flash", f_aux), ("cudnn", c_aux)):
        row[f"{kernel}_fwd_ms"] = cuda_median_ms(lambda kernel=kernel: fused_block_forward(kernel, q, k, v, scale), 10, 3)
        row[f"{kernel}_bwd_ms"] = cuda_median_ms(
            lambda kernel=kernel, aux=aux: fused_block_backward(kernel, q, k, v, scale, final, f_lse, dout, aux), 10, 3)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        row["sdpa_cudnn_fwd_ms"] = cuda_median_ms(lambda: F.scaled_dot_product_attention(q, k, v), 10, 3)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096,16384,32768")
    p.add_argument("--out")
    args = p.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    meta = dict(date=datetime.now().isoformat(timespec="minutes"), device=torch.cuda.get_device_name(),
                torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                ring_uses_cudnn=cudnn_attention_preferred(dev))
    print(json.dumps(meta))
    rows = [block(int(n)) for n in args.tokens.split(",")]
    print("| tokens | FA2 fwd ms | cuDNN fwd ms | FA2 bwd ms | cuDNN bwd ms | SDPA cuDNN fwd ms | max diff out / lse / grads |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['tokens']:,} | {r['flash_fwd_ms']:.2f} | {r['cudnn_fwd_ms']:.2f} | {r['flash_bwd_ms']:.2f} | "
              f"{r['cudnn_bwd_ms']:.2f} | {r['sdpa_cudnn_fwd_ms']:.2f} | {r['out_max_diff']:.1e} / "
              f"{r['lse_max_diff']:.1e} / {r['grad_max_diff']:.1e} (of {r['grad_max']:.2f}) |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
