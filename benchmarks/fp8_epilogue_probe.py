"""Probe: what would fusing fc2's input quantization into fc1's GEMM epilogue save in float8 DiT-XL/2 sampling?

Today each float8 MLP runs fc1 (cuBLAS row-wise ``_scaled_mm``, bf16 out), then one Triton pass (GELU + row-wise
e4m3 quantization, 31.5 us at 4096 x 4608 on an H100, 44 ms of the batch-8 loop), then fc2. A row's scale needs
the row's maximum over all 4,608 columns, which no GEMM tile sees. With 1 x 128 block scales (one per row and
128 columns, DeepSeek-V3's activation recipe) the tile does see its block: fc1's epilogue could apply the GELU and
quantize, and fc2 would run as a block-scaled GEMM (``torch.nn.functional.scaled_mm``, BlockWise1x128 on both
sides; fc2's weight quantized per row and 128 columns).

This script times, at the batch-8 shapes (M = 16 x 256 rows, D = 1152, hidden 4608), e4m3, bf16 out:
- cuBLAS row-wise fc1 and fc2 (today's GEMMs) and today's GELU pass (``ops.fp8.quantize_rows(gelu=True)``);
- cuBLAS block-scaled fc2 (1 x 128 activations, 1 x 128 weights), if this PyTorch / cuBLAS has it;
- a plain Triton float8 GEMM for fc1 over a few tilings, with the bf16 epilogue and with GELU + 1 x 128 e4m3
  quantization in its epilogue (``_fc1_kernel`` below: a probe, not in the package);
and checks each against a float32 product of the dequantized operands. Timing as ``quant_kernel.py``: each call
50 times in a CUDA graph, replayed 20 times, median per call.

    PYTHONPATH=. python benchmarks/fp8_epilogue_probe.py --out benchmarks/results/sampling/fp8_epilogue_probe.json
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime

import torch
import triton
import triton.language as tl

from ditforge.ops import fp8
from quant_kernel import graph_us

M, D, H = 4096, 1152, 4608
TILINGS = ((128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 64, 4, 4), (64, 128, 128, 4, 4),
           (256, 128, 128, 8, 3), (128, 128, 128, 4, 3))  # BM, BN, BK, warps, stages


@triton.jit
def _fc1_kernel(A, W, SA, SW, BIAS, OUT, SQ, M, N, K, QUANT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, GROUP_M: tl.constexpr):
    """OUT = (A W^T) * SA SW + BIAS (A (M, K) e4m3 rows scaled by SA (M,), W (N, K) e4m3 scaled by SW (N,)): bf16;
    with QUANT, GELU_tanh of it as e4m3 with one scale per row and BN (= 128) columns, SQ (N / BN, M)."""
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), N // BN
    width = GROUP_M * n_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = A + rm[:, None].to(tl.int64) * K + rk[None, :]
    w_ptrs = W + rn[None, :].to(tl.int64) * K + rk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        acc = tl.dot(tl.load(a_ptrs, mask=rm[:, None] < M, other=0.0), tl.load(w_ptrs), acc)
        a_ptrs += BK
        w_ptrs += BK
    sa = tl.load(SA + rm, mask=rm < M, other=0.0)
    h = acc * sa[:, None] * tl.load(SW + rn)[None, :] + tl.load(BIAS + rn).to(tl.float32)[None, :]
    out_ptrs = OUT + rm[:, None].to(tl.int64) * N + rn[None, :]
    if QUANT:
        h = h / (1.0 + tl.exp(h * (-2.0 * 0.7978845608028654) * (1.0 + 0.044715 * h * h)))
        amax = tl.maximum(tl.max(tl.abs(h), axis=1), 1e-12)
        tl.store(out_ptrs, (h * (448.0 / amax)[:, None]).to(tl.float8e4nv), mask=rm[:, None] < M)
        tl.store(SQ + pid_n * M + rm, amax / 448.0, mask=rm < M)
    else:
        tl.store(out_ptrs, h.to(tl.bfloat16), mask=rm[:, None] < M)


def fc1_triton(a, sa, w, sw, bias, quant, tiling):
    BM, BN, BK, warps, stages = tiling
    N, K = w.shape
    out = torch.empty(M, N, device=a.device, dtype=torch.float8_e4m3fn if quant else torch.bfloat16)
    sq = torch.empty(N // BN, M, device=a.device, dtype=torch.float32)
    grid = (triton.cdiv(M, BM) * (N // BN),)
    _fc1_kernel[grid](a, w, sa, sw, bias, out, sq, M, N, K, QUANT=quant, BM=BM, BN=BN, BK=BK, GROUP_M=8,
                      num_warps=warps, num_stages=stages)
    return out, sq


def quantize_blocks(x):
    """x (R, C) -> e4m3 (R, C), float32 scales (R, C / 128) with stride (1, R): one scale per row and 128 columns."""
    R, C = x.shape
    blocks = x.float().view(R, C // 128, 128)
    s = blocks.abs().amax(-1).clamp_min(1e-12) / 448.0
    q = (blocks / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(R, C)
    return q, s.t().contiguous().t()


def linear(w, b) -> torch.nn.Linear:
    layer = torch.nn.Linear(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    return layer


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, D, device="cuda", generator=g).bfloat16()
    w1 = (torch.randn(H, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
    w2 = (torch.randn(D, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    b1, b2 = (torch.randn(n, device="cuda", generator=g).bfloat16() * 0.1 for n in (H, D))
    qx, sx = fp8.quantize_rows(x)
    fc1, fc2 = (fp8.RowwiseFloat8Linear.from_linear(linear(w, b)) for w, b in ((w1, b1), (w2, b2)))
    rows = []

    def record(name, us, err=None, note=""):
        rows.append(dict(name=name, us=us, rel_err=err, note=note))
        print(f"| {name} | {us:.1f} | {'' if err is None else f'{err:.4f}'} | {note} |", flush=True)

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print("| GEMM or pass | us | rel. error vs fp32 of dequantized | note |\n|---|---:|---:|---|")
    h_ref = (qx.float() * sx) @ (fc1.weight.float() * fc1.weight_scale.t()).t() + b1.float()
    h = fc1.forward_quantized(qx, sx)
    record("fc1 cuBLAS row-wise", graph_us(lambda: fc1.forward_quantized(qx, sx)), rel_err(h, h_ref))
    qh, sh = fp8.quantize_rows(h, gelu=True)
    gelu_ref = torch.nn.functional.gelu(h.float(), approximate="tanh")
    record("GELU + row-wise quantization pass (today)", graph_us(lambda: fp8.quantize_rows(h, gelu=True)),
           rel_err(qh.float() * sh, gelu_ref))
    y_ref = (qh.float() * sh) @ (fc2.weight.float() * fc2.weight_scale.t()).t() + b2.float()
    record("fc2 cuBLAS row-wise", graph_us(lambda: fc2.forward_quantized(qh, sh)),
           rel_err(fc2.forward_quantized(qh, sh), y_ref))
    qb, sb = quantize_blocks(gelu_ref)
    qw2, sw2 = quantize_blocks(w2)
    yb_ref = (qb.float().view(M, -1, 128) * sb[..., None]).view(M, H) @ \
        (qw2.float().view(D, -1, 128) * sw2[..., None]).view(D, H).t() + b2.float()
    scaling = torch.nn.functional.ScalingType.BlockWise1x128 if hasattr(torch.nn.functional, "ScalingType") else None
    for bias, fast in ((b2, True), (b2, False), (None, False)):
        label = f"fc2 cuBLAS 1x128 x 1x128 block-scaled, {'fast' if fast else 'precise'} accumulation" + \
            ("" if bias is not None else ", no bias")
        try:
            call = lambda: torch.nn.functional.scaled_mm(qb, qw2.t(), sb, scaling, sw2, scaling,  # noqa: E731
                                                         bias=bias, output_dtype=torch.bfloat16, use_fast_accum=fast)
            out = call()
            record(label, graph_us(call), rel_err(out, yb_ref if bias is not None else yb_ref - b2.float()))
        except Exception as e:  # noqa: BLE001 - a probe: report what this build lacks
            record(label, float("nan"), note=f"{type(e).__name__}: {str(e).splitlines()[0][:150]}")
    sw1 = fc1.weight_scale.view(-1).contiguous()
    sxv = sx.view(-1).contiguous()
    for tiling in TILINGS:
        for quant in (False, True):
            label = f"fc1 Triton {'x'.join(map(str, tiling[:3]))} w{tiling[3]} s{tiling[4]}" + \
                (" + GELU + 1x128 quant" if quant else "")
            try:
                out, sq = fc1_triton(qx, sxv, fc1.weight, sw1, b1, quant, tiling)
                err = rel_err((out.float().view(M, -1, 128) * sq.t()[..., None]).view(M, H), gelu_ref) if quant \
                    else rel_err(out, h_ref)
                record(label, graph_us(lambda: fc1_triton(qx, sxv, fc1.weight, sw1, b1, quant, tiling)), err)
            except Exception as e:  # noqa: BLE001
                record(label, float("nan"), note=f"{type(e).__name__}: {str(e).splitlines()[0][:150]}")
    result = dict(date=datetime.now().isoformat(timespec="minutes"), device=torch.cuda.get_device_name(),
                  torch=torch.__version__, cuda=torch.version.cuda, triton=triton.__version__, M=M, D=D, H=H,
                  rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
