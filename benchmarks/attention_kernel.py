"""A Triton attention kernel for inference at DiT-XL's head size, timed over its launch configurations against
PyTorch's SDPA backends (cuDNN, Flash) on the same strided inputs: a measured idea, not adopted.

Shapes: DiT-XL's self-attention, 16 heads of 72, q, k and v views of the qkv layer's output (B, N, 3, H, Dh), as
``Attention.project`` hands them on. B x N = 16 x 256 (DiT-XL/2 at batch 8 under guidance), 2 x 256 (batch 1),
2 x 2048 (vDiT-XL/222, 16 frames, batch 1), and 64 x 256 (a training batch's forward).

The idea: cuDNN's kernel pads a 72-wide head to 128 (it tiles 64 x 128 x 128 on an H100), so 44% of its
products are on zeros; here a head is two tiles, its first 64 columns and its last 16 (80 columns). On an H200
(2026-11-27 16:23, ``results/sampling/attention_kernel_h200.json``) it took 7.0 us at 2 x 256 against cuDNN's 9.1,
25.2 at 16 x 256 against 24.8, and lost at 2 x 2048 (131 against 108) and 64 x 256 (99 against 81). Put in
cuDNN's place for inference in the batch-8 float8 sampling loop on an H100 it took 41.8 ms against cuDNN's 36.8
in the next job (``h100_images_fp8_triton_attention_b8.log``), so it was not adopted; batch 1, where it led on the
H200, was not measured on an H100.

Two Triton 3.6 miscompiles on H100 and H200, found by checking every configuration against float32 (as this
script does before timing one): where Triton could not infer that a head's offset was a multiple of 16 bytes
(a head stride of 72 elements), and where a row stride was a multiple of 8 elements but not 16 (3 heads of 72 a
row) even with the hint, the second tile's outputs came out wrong, some as NaN. ``ALIGN`` (``tl.multiple_of`` on
the offsets) avoids the first; only row strides of 16k elements were verified.

Timing: ``quant_kernel.graph_us``, each call launched 50 times inside one CUDA graph, median per launch. Error:
max |out - reference| over max |reference|, the reference being float32 math attention of the same bf16 inputs.

    cd benchmarks && PYTHONPATH=..:. python attention_kernel.py --out results/sampling/attention_kernel.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from datetime import datetime

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from ditforge.ops.fp8 import _tiles
from quant_kernel import graph_us


@triton.jit
def attention_fwd_kernel(
    Q, K, V, O, N_Q, N_K, H,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    QK_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_A: tl.constexpr, HEAD_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
):
    """One program: BLOCK_M queries of one (batch, head) against all N_K keys, BLOCK_N at a time.

    Q (B, H, N_Q, HEAD_DIM), K and V (B, H, N_K, HEAD_DIM), O like Q, each with the given strides (the last dim
    unit-stride); QK_SCALE = log2(e) / sqrt(HEAD_DIM) (a constant: inductor passed a float argument as float64,
    which promoted the scores). A head is the tile of its first HEAD_A columns and, if HEAD_B > 0, the tile of
    its last HEAD_B (HEAD_A + HEAD_B >= HEAD_DIM >= HEAD_B); where they overlap, the second tile's queries are
    zeroed (each product counted once) and its outputs not stored, so no load masks columns. ALIGN: a number of
    elements that every (batch, head) offset is a multiple of (8 here: 16 bytes; see the module's docstring).
    Grid (cdiv(N_Q, BLOCK_M), B * H). Math: FlashAttention's running maximum and sum (Dao et al. 2022,
    algorithm 1) in base 2, float32 scores and sums, the probabilities rounded to the inputs' dtype before the
    product with v, as FlashAttention and cuDNN do.
    """
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_a = tl.arange(0, HEAD_A)
    rows_q = offs_m[:, None] < N_Q
    q_rows = Q + tl.multiple_of(b * stride_qb + h * stride_qh, ALIGN) + offs_m[:, None] * stride_qn
    q_a = tl.load(q_rows + offs_a[None, :], mask=rows_q, other=0.0)
    k_base = K + tl.multiple_of(b * stride_kb + h * stride_kh, ALIGN)
    v_base = V + tl.multiple_of(b * stride_vb + h * stride_vh, ALIGN)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, HEAD_A], tl.float32)
    if HEAD_B > 0:
        offs_b = HEAD_DIM - HEAD_B + tl.arange(0, HEAD_B)
        fresh = offs_b[None, :] >= HEAD_A  # the second tile's columns that the first does not hold
        q_b = tl.load(q_rows + offs_b[None, :], mask=rows_q, other=0.0)
        q_b = tl.where(fresh, q_b, tl.zeros_like(q_b))
        acc_b = tl.zeros([BLOCK_M, HEAD_B], tl.float32)
    for start in range(0, N_K, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        keys = offs_n[:, None] < N_K
        k_rows = k_base + offs_n[:, None] * stride_kn
        v_rows = v_base + offs_n[:, None] * stride_vn
        s = tl.dot(q_a, tl.trans(tl.load(k_rows + offs_a[None, :], mask=keys, other=0.0)))
        if HEAD_B > 0:
            s += tl.dot(q_b, tl.trans(tl.load(k_rows + offs_b[None, :], mask=keys, other=0.0)))
        s = tl.where(offs_n[None, :] < N_K, s * QK_SCALE, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(Q.dtype.element_ty)
        acc_a = acc_a * alpha[:, None] + tl.dot(p, tl.load(v_rows + offs_a[None, :], mask=keys, other=0.0))
        if HEAD_B > 0:
            v_b = tl.load(v_rows + offs_b[None, :], mask=keys, other=0.0)
            acc_b = acc_b * alpha[:, None] + tl.dot(p, v_b)
        m_i = m_new
    o_rows = O + tl.multiple_of(b * stride_ob + h * stride_oh, ALIGN) + offs_m[:, None] * stride_on
    inv_l = 1.0 / l_i[:, None]
    tl.store(o_rows + offs_a[None, :], (acc_a * inv_l).to(O.dtype.element_ty), mask=rows_q)
    if HEAD_B > 0:
        tl.store(o_rows + offs_b[None, :], (acc_b * inv_l).to(O.dtype.element_ty), mask=rows_q & fresh)


SHAPES = ((16, 256), (2, 256), (2, 2048), (64, 256))
HEADS, HEAD_DIM = 16, 72
CONFIGS = list(itertools.product((64, 128), (64, 128, 256), (4, 8), (2, 3)))  # BLOCK_M, BLOCK_N, warps, stages


def launch(q, k, v, o, block_m, block_n, warps, stages):
    B, H, N, D = q.shape
    head_a, head_b = _tiles(D)  # the quantization kernels' split of a row, with a dot's minimum of 16
    head_b = head_b and max(16, head_b)
    attention_fwd_kernel[(triton.cdiv(N, block_m), B * H)](
        q, k, v, o, N, k.shape[2], H, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        QK_SCALE=math.log2(math.e) / math.sqrt(D), HEAD_DIM=D, HEAD_A=head_a, HEAD_B=head_b, BLOCK_M=block_m,
        BLOCK_N=block_n, ALIGN=8, num_warps=warps, num_stages=stages)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuDNN", torch.backends.cudnn.version())
    rows = []
    print("| B x N | path | us | TFLOP/s (72-wide heads) | rel. error |")
    print("|---|---|---:|---:|---:|")
    for B, N in SHAPES:
        qkv = torch.randn(B, N, 3, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        flops = 4 * B * HEADS * N * N * HEAD_DIM

        def rel_err(out):
            return ((out.float() - ref).abs().max() / ref.abs().max()).item()

        def record(path, us, out):
            err = rel_err(out)
            rows.append({"batch": B, "tokens": N, "path": path, "us": us, "tflops": flops / us / 1e6, "rel_err": err})
            print(f"| {B} x {N} | {path} | {us:.1f} | {flops / us / 1e6:.0f} | {err:.1e} |", flush=True)

        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v)
            record(f"SDPA {backend.name.lower()}", graph_us(sdpa), sdpa())
        o = torch.empty(B, N, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        best = None
        for cfg in CONFIGS:
            try:
                launch(q, k, v, o, *cfg)
                err = rel_err(o)
                if not err < 1e-2:
                    print(f"  {cfg}: wrong, error {err:.2e}")
                    continue
                us = graph_us(lambda cfg=cfg: launch(q, k, v, o, *cfg))
            except Exception as e:  # a config that does not fit (shared memory, registers) is skipped
                print(f"  {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                continue
            if best is None or us < best[0]:
                best = (us, cfg)
        launch(q, k, v, o, *best[1])
        record(f"triton (BLOCK_M, BLOCK_N, warps, stages) = {best[1]}", best[0], o)
    if args.out:
        meta = {"date": datetime.now().isoformat(timespec="minutes"), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
