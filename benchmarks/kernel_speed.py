"""ditforge's own GPU kernels and steps alone, each against what it replaces, mostly at DiT-XL's shapes (width 1152):

``adaln``: the fused adaLN Triton kernels (LayerNorm + modulate, gated residual) against PyTorch eager and
    ``torch.compile`` of the same reference, at DiT-XL/2 (64 x 256 tokens) and vDiT-XL/222 (8 x 2048) shapes, as
    they run under bf16 autocast (fp32 residual stream, bf16 modulation and branch outputs): forward and forward +
    backward time (CUDA events, ``inner`` calls a sample), the forward's effective bandwidth (bytes the op must
    move / time) and its error against eager.
``fp8``: the row-wise float8 quantization kernel (``ops.triton.quant.rowwise_e4m3_kernel``, behind
    ``ops.fp8.quantize_rows``) over its launch configurations at DiT-XL/2's sampling shapes: M = 16 x 256 rows
    (batch 8 under guidance) and 2 x 256 (batch 1); D = 1152 (the qkv, proj and fc1 inputs) and 4608 with the GELU
    (fc2's input; and without it), against PyTorch's plain cast of the same tensor to e4m3 (the same bytes, without
    the row maximum). Then the fused LayerNorm pass of the float8 blocks (``layernorm_modulate_e4m3_kernel``: the
    gated residual, LayerNorm, modulate and the quantization in one pass; and without the residual) over its
    configurations, against the same PyTorch ops compiled by inductor (multi-kernel reductions on, as sampling
    compiles them) followed by ``quantize_rows``. Each launch timed inside a CUDA graph (``timing.graph_us``).
``fp8-train``: is float8 training worth it at a width? One DiT block (``models.dit.DiTBlock``: qkv, attention,
    proj, MLP 4x, adaLN-Zero; heads of 128, 72 at 1152 as DiT-XL's), fp32 weights under bf16 autocast, compiled,
    forward + backward over B = 1 x ``--tokens`` tokens through the fast attention, in bf16 and with its linear
    layers as torchao's float8 training linears (``parallel.apply_fp8``, each ``--recipes``), for each width of
    ``--widths``. The ratio bf16 / float8 per width is what ``--fp8_min_width`` (``config.sections.FP8_MIN_WIDTH``) is
    set from: float8 where it is above 1. Median of 10 (CUDA events, 3 calls each) after 5 warm-up calls; the
    float8 outputs' relative error against bf16 is printed beside them, and the GPU kernel time of each by kind
    (``timing.kernel_kind``: matrix products, attention, inductor's fused kernels, which hold the float8 casts).
``ring-attention``: one block of ring attention (``parallel.sequence.ring``), forward and backward, through each
    fused kernel the ring can call (FlashAttention-2's and cuDNN's aten ops with the log-sum-exp), B = 1, bf16, for
    Nq = Nk in ``--tokens``. Checks first, per length: the kernels' outputs and lse against each other, and the
    cuDNN backward fed the FlashAttention-2 forward's O and L (as the ring feeds every block the merged O and L)
    against the FlashAttention-2 backward. Median of 10 after 3 calls; "sdpa" is ``F.scaled_dot_product_attention``
    on the cuDNN backend alone, the forward the ring's kernel competes with.
``attention8``: the 8-bit attention kernel (``ops.quant_attention``: int8 Q K^T, e4m3 P V) at Wan2.1-1.3B's
    480 x 832 x 81 self-attention (B = 2 under guidance, 12 heads of 128, 32,760 tokens) over its launch
    configurations, against SDPA's cuDNN and FlashAttention-2 kernels in bf16 (what diffusers and the anchor run).
    Forward time (CUDA events, median of 10 after 3) of the kernel alone and with the compiled quantization of
    its inputs; TFLOPS as 4 B H S^2 D / time. Error of each against float32 attention (SDPA's memory-efficient
    kernel) on 2 heads, for Gaussian q, k, v and for keys with a shared offset (which the kernel's smoothing
    removes): max abs and relative RMS.

``exact-attention``: the exact attention kernels at Wan2.1-1.3B's 480 x 832 x 81 self-attention (B = 2, 12 heads of
    128, 32,760 tokens, bf16; ``--tokens``, ``--heads``, ``--head_dim`` another shape), forward and forward +
    backward: SDPA's cuDNN and FlashAttention-2 kernels (what diffusers and the anchors run) against FlashAttention-4's SM90 kernels (``flash_attn.cute.flash_attn_func`` of the
    ``flash-attn-4`` wheel, CuTe DSL) where it imports. Median of 10 CUDA-event samples after 3 calls; TFLOPS as
    4 B H S^2 D / time (forward; the backward counted as 2.5 forwards). Error of each output and input gradient
    against float32 attention (SDPA's memory-efficient kernel) on 2 heads: max abs and relative RMS.

``packing``: sequence packing against padding to the longest sample: useful tokens per second of training steps.
    A mixed stream of 256px images (latents 4x1x32x32: 256 tokens on vDiT-XL/222, the frame repeated for the
    temporal patch) and 16-frame 256px videos (latents 4x16x32x32: 2,048 tokens), half and half, drawn in windows
    of ``--window`` samples. Each window is one training step (forward + backward + AdamW) of vDiT-XL/222 under
    bf16 autocast (fp32 weights, fused AdamW), DDPM with learned sigma (the trainer's loss,
    ``data.packing.packed_training_losses``):

    * packed: first-fit decreasing into rows of ``--pack_tokens`` tokens, block-diagonal attention by FlexAttention
      (document mask, compiled) and, where this torch has it, the flash variable-length kernel (``varlen``) (the
      ``--tiny`` CPU run: the dense reference, FlexAttention has no CPU backward);
    * padded: one sample per row, every row padded to the window's longest sample, attention by SDPA with the
      boolean mask (padding keys masked out): what training mixed sizes without packing costs.

    Useful tokens/s = the window's real tokens / the step's median time (CUDA events after warm-up; on the CPU,
    wall clock). Prints a table and writes JSON (date, device, versions) to benchmarks/results/ (``--out``).

``optimizer-step``: time of one optimizer step over DiT-XL/2's parameters (675M) on a GPU. Default: the libraries'
    kernels against the one-pass Triton step (``--fused_optimizer``), for each placement. Each row: clipping
    (global norm, then scaling) + AdamW + EMA where the row has one. CUDA events, median of 20 steps after 5
    warm-up steps.

    ``--offload``: what ``--cpu_offload optimizer`` costs on this machine instead: pinned host <-> GPU copy
    bandwidth (each way alone, both at once on two streams), and one step (bf16 weights, stochastic rounding, 8-bit
    moments) with the states resident on the GPU against streamed from pinned host memory. A step alone has
    nothing to overlap its transfers with, so the offloaded row is about the state's bytes over the bandwidth;
    inside a backward (``--fused_backward_pass``) the transfers overlap the blocks' compute.

    ``--sharded``: the one-pass step over FSDP2's shards (each DiT block and the model under ``fully_shard`` on a
    one-GPU mesh: DTensor parameters and states, stepped shard by shard) against the same step over plain
    tensors, with whether the weights after the timed steps are equal bit for bit.

Their code is in ``parts/training_steps.py``.

    PYTHONPATH=. python benchmarks/kernel_speed.py adaln --out benchmarks/results/single_gpu/adaln_kernels.json
    PYTHONPATH=. python benchmarks/kernel_speed.py fp8 --out benchmarks/results/sampling/quant_kernel_h100.json
    PYTHONPATH=. python benchmarks/kernel_speed.py fp8-train --out benchmarks/results/single_gpu/fp8_train_widths.json
    PYTHONPATH=. python benchmarks/kernel_speed.py ring-attention --out benchmarks/results/attention_blocks_h100.json
    PYTHONPATH=. python benchmarks/kernel_speed.py attention8 --out benchmarks/results/sampling/attention8_h200.json
    PYTHONPATH=. python benchmarks/kernel_speed.py exact-attention --out benchmarks/results/sampling/exact_attention_h200.json
    PYTHONPATH=. python benchmarks/kernel_speed.py packing --out benchmarks/results/packing_h100.json  # vDiT-XL/222
    PYTHONPATH=. python benchmarks/kernel_speed.py packing --tiny          # CPU smoke test: vDiT-T/222, small latents
    PYTHONPATH=. python benchmarks/kernel_speed.py optimizer-step [--offload | --sharded] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from timing import cuda_median_ms, graph_us, kernel_ms_by_kind

from parts.training_steps import optimizer_step, packing

from ditforge.atomic import atomic_path
from ditforge.ops.modulate import gated_residual_reference, layernorm_modulate_reference


def adaln_case(name: str, B: int, N: int, D: int) -> list[dict]:
    """Rows of the ``adaln`` table for one (B, N, D): each op by eager, compiled and Triton."""
    from ditforge.ops import fused

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

                t_f, t_fb = (cuda_median_ms(g, steps=20, warmup=10, inner=10) for g in (fwd, fwd_bwd))
            rows.append(dict(shape=name, op=op, impl=impl, fwd_ms=t_f, fwd_bwd_ms=t_fb,
                             fwd_gbps=nbytes / t_f / 1e6, max_rel_err_vs_eager=err, out_dtype=str(out.dtype)))
    return rows


def adaln(args) -> dict:
    import triton

    rows = adaln_case("DiT-XL/2 64x256x1152", 64, 256, 1152) + adaln_case("vDiT-XL/222 8x2048x1152", 8, 2048, 1152)
    env = dict(date=datetime.now().isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(),
               torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
               python=platform.python_version())
    print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}")
    print("| shape | op | impl | fwd (ms) | fwd GB/s | fwd+bwd (ms) | out dtype | max rel err vs eager |")
    print("|---|---|---|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['op']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_gbps']:.0f} | "
              f"{r['fwd_bwd_ms']:.3f} | {r['out_dtype']} | {r['max_rel_err_vs_eager']:.1e} |")
    return dict(env=env, rows=rows)


QUANT_SHAPES = ((4096, 1152, False), (4096, 4608, True), (4096, 4608, False), (512, 1152, False), (512, 4608, True))


def fp8(args) -> dict:
    from ditforge.ops import fp8 as ops_fp8
    from ditforge.ops.triton import quant

    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    rows_out = []
    print("| M x D | GELU | config now (ROWS, warps) | us | best (ROWS, warps) | us | GB/s | plain cast us | GB/s |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|")
    for M, D, gelu in QUANT_SHAPES:
        x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(M, D, device="cuda", dtype=torch.float8_e4m3fn)
        s = torch.empty(M, 1, device="cuda", dtype=torch.float32)
        block_a, block_b, rows_now, warps_now = ops_fp8._config(D)
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
    fused_rows = [fp8_layernorm(B, residual) for B in (16, 2) for residual in (True, False)]
    return dict(date=datetime.now().isoformat(timespec="minutes"), device=torch.cuda.get_device_name(),
                torch=torch.__version__, rows=rows_out, fused_layernorm=fused_rows)


def fp8_layernorm(B: int, residual: bool, N: int = 256, D: int = 1152) -> dict:
    """One row of the fused-LayerNorm table: the kernel's configurations against compiled PyTorch + quantize_rows."""
    from ditforge.ops import fp8 as ops_fp8
    from ditforge.ops.triton import quant

    if B == 16 and residual:
        print("\n| B x N x D | residual | config now (ROWS, warps) | us | best (ROWS, warps) | us | "
              "compiled ops + quantize_rows us |\n|---|---|---|---:|---|---:|---:|")
    x, y = (torch.randn(B, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mods = torch.randn(B, 6 * D, device="cuda", dtype=torch.bfloat16)
    shift, scale, gate = mods[:, :D], mods[:, D:2 * D], mods[:, 2 * D:3 * D]
    x_out, q = torch.empty_like(x), torch.empty(B, N, D, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty(B, N, 1, device="cuda", dtype=torch.float32)
    block_a, block_b, rows_now, warps_now = ops_fp8._layernorm_config(D)
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
    plain = graph_us(lambda: ops_fp8.quantize_rows(compiled(x, y)[1]))
    row = dict(B=B, N=N, D=D, residual=residual, config_now=(rows_now, warps_now), us_now=timed[rows_now, warps_now],
               best=best, us_best=timed[best], compiled_then_quantize_us=plain,
               all={f"{r}x{w}": t for (r, w), t in timed.items()})
    print(f"| {B} x {N} x {D} | {residual} | {rows_now}, {warps_now} | {row['us_now']:.1f} | {best[0]}, {best[1]} | "
          f"{row['us_best']:.1f} | {plain:.1f} |", flush=True)
    return row


HEADS, DH = 16, 72


def fp8_train(args) -> dict:
    import copy

    from torch import nn

    from ditforge.models.dit import DiTBlock
    from ditforge.ops.attention import set_attention_backend
    from ditforge.parallel import apply_fp8

    dev = torch.device("cuda")
    set_attention_backend("fast", dev)
    recipes = args.recipes.split(",")
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        torch.manual_seed(0)
        base = nn.Module()  # apply_fp8 converts the layers under "blocks."
        base.blocks = nn.ModuleList([DiTBlock(width, 16 if width == 1152 else width // 128)]).to(dev)
        for p in base.parameters():  # adaLN-Zero's zeros would leave the MLP and attention without gradients
            nn.init.normal_(p, std=width ** -0.5)
        x = torch.randn(1, args.tokens, width, device=dev, requires_grad=True)
        c, dy = torch.randn(1, width, device=dev), torch.randn(1, args.tokens, width, device=dev)
        row, ref = dict(width=width, tokens=args.tokens), None
        for mode in ["bf16", *recipes]:
            model = copy.deepcopy(base)
            if mode != "bf16":
                row[f"{mode}_layers"] = apply_fp8(model, dev, recipe=mode)
            block = torch.compile(model.blocks[0])

            def fwd_bwd():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = block(x, c)
                y.backward(dy)
                return y

            out = fwd_bwd().detach().float()
            if ref is None:
                ref = out
            row[f"{mode}_ms"] = cuda_median_ms(fwd_bwd, steps=10, warmup=5, inner=3)
            row[f"{mode}_rel_err"] = ((out - ref).norm() / ref.norm()).item()
            row[f"{mode}_kernel_ms"] = kernel_ms_by_kind(fwd_bwd, calls=3)
            if mode != "bf16":
                row[f"{mode}_speedup"] = row["bf16_ms"] / row[f"{mode}_ms"]
            torch._dynamo.reset()
        rows.append(row)
        print(f"| {width} GPU kernel ms by kind | " + " | ".join(
            ", ".join(f"{k} {v:.2f}" for k, v in row[f"{m}_kernel_ms"].items())
            for m in ["bf16", *recipes]) + " |", flush=True)
        print(f"| {width} | {row['bf16_ms']:.2f} | " + " | ".join(
            f"{row[r + '_ms']:.2f} ({row[r + '_speedup']:.2f}x, err {row[r + '_rel_err']:.3f})" for r in recipes)
            + " |", flush=True)
    import torchao

    env = dict(date=datetime.now().isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(),
               torch=torch.__version__, torchao=torchao.__version__, cuda=torch.version.cuda)
    return dict(env=env, rows=rows)


def ring_block(n: int) -> dict:
    """One row of the ``ring-attention`` table: n query and key tokens."""
    from ditforge.parallel.sequence.ring import fused_block_backward, fused_block_forward

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


def ring_attention(args) -> dict:
    from ditforge.ops.attention import cudnn_attention_preferred

    dev = torch.device("cuda", torch.cuda.current_device())
    meta = dict(date=datetime.now().isoformat(timespec="minutes"), device=torch.cuda.get_device_name(),
                torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                ring_uses_cudnn=cudnn_attention_preferred(dev))
    print(json.dumps(meta))
    rows = [ring_block(int(n)) for n in args.tokens.split(",")]
    print("| tokens | FA2 fwd ms | cuDNN fwd ms | FA2 bwd ms | cuDNN bwd ms | SDPA cuDNN fwd ms | max diff out / lse / grads |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['tokens']:,} | {r['flash_fwd_ms']:.2f} | {r['cudnn_fwd_ms']:.2f} | {r['flash_bwd_ms']:.2f} | "
              f"{r['cudnn_bwd_ms']:.2f} | {r['sdpa_cudnn_fwd_ms']:.2f} | {r['out_max_diff']:.1e} / "
              f"{r['lse_max_diff']:.1e} / {r['grad_max_diff']:.1e} (of {r['grad_max']:.2f}) |")
    return dict(meta=meta, rows=rows)


ATTENTION8_CONFIGS = [dict(block_m=m, block_n=n, num_warps=w, num_stages=st, pv_precise_k=pk, warp_specialize=ws)
                      for m, n, w, st, pk, ws in (
                          (64, 128, 4, 2, 128, False), (64, 128, 4, 3, 128, False), (64, 128, 4, 2, None, False),
                          (64, 64, 4, 2, 64, False), (128, 128, 8, 2, 128, False), (64, 128, 4, 2, 128, True),
                          (128, 128, 4, 2, 128, True), (128, 128, 8, 2, 128, True), (128, 64, 4, 3, 64, True),
                          (128, 128, 4, 3, 128, True))]


def attention8(args) -> dict:
    from ditforge.ops import quant_attention as qa

    B, S, H, D = 2, args.tokens, args.heads, args.head_dim
    meta = dict(date=datetime.now().isoformat(timespec="minutes"), device=torch.cuda.get_device_name(),
                torch=torch.__version__, cudnn=torch.backends.cudnn.version(), shape=[B, S, H, D])
    print(json.dumps(meta))
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    flops = 4 * B * H * S * S * D
    sdpa = lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    rows = []
    for name, backend in (("cudnn bf16", SDPBackend.CUDNN_ATTENTION), ("flash2 bf16", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel([backend]):
            ms = cuda_median_ms(sdpa, 10, 3)
        rows.append(dict(kernel=name, ms=ms, tflops=flops / ms / 1e9))
    prep = torch.compile(qa.quantize_attention_inputs, dynamic=False)
    parts = prep(q, k, v)
    rows.append(dict(kernel="quantization (compiled)", ms=cuda_median_ms(lambda: prep(q, k, v), 10, 3)))
    for c in ATTENTION8_CONFIGS:
        try:
            ms = cuda_median_ms(lambda c=c: qa.launch(*parts, S, config=c), 10, 3)
            rows.append(dict(kernel="8-bit " + ",".join(f"{k_}={v_}" for k_, v_ in c.items()), config=c, ms=ms,
                             tflops=flops / ms / 1e9))
        except Exception as e:  # a configuration the compiler refuses (shared memory) is a row, not the end
            rows.append(dict(kernel="8-bit " + str(c), error=f"{type(e).__name__}: {str(e)[:200]}"))
    timed = [r for r in rows if r.get("config") and "ms" in r]
    best = min(timed, key=lambda r: r["ms"])
    whole = torch.compile(lambda: qa.launch(*prep(q, k, v), S, config=best["config"]))
    rows.append(dict(kernel="8-bit best + quantization", ms=cuda_median_ms(whole, 10, 3)))
    rows[-1]["tflops"] = flops / rows[-1]["ms"] / 1e9
    errors = {}
    for case, offset in (("gaussian", 0.0), ("key offset 3", 3.0)):
        qs, ks, vs = (x[:1, :, :2].contiguous() for x in (q, k, v))
        ks = ks + offset * torch.randn(1, 1, 2, D, device="cuda", generator=g, dtype=torch.bfloat16)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            ref = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (qs, ks, vs))).transpose(1, 2)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            cud = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (qs, ks, vs))).transpose(1, 2)
        ours = qa.launch(*qa.quantize_attention_inputs(qs, ks, vs), S, config=best["config"])
        errors[case] = {name: dict(max_abs=(o.float() - ref).abs().max().item(),
                                   rel_rms=((o.float() - ref).norm() / ref.norm()).item())
                        for name, o in (("cudnn bf16", cud), ("8-bit", ours))}
    print("| kernel | ms | TFLOPS |")
    print("|---|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r.get('ms', float('nan')):.3f} | {r.get('tflops', float('nan')):.0f} |"
              + (f" {r['error']}" if "error" in r else ""))
    print(json.dumps(errors))
    return dict(meta=meta, rows=rows, errors=errors)


def exact_attention(args) -> dict:
    B, S, H, D = 2, args.tokens, args.heads, args.head_dim
    meta = dict(date=datetime.now().isoformat(timespec="minutes"), device=torch.cuda.get_device_name(),
                torch=torch.__version__, cudnn=torch.backends.cudnn.version(), shape=[B, S, H, D])
    kernels = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash2", SDPBackend.FLASH_ATTENTION)):
        def sdpa(q, k, v, backend=backend):  # (B, S, H, D) as the flash kernels take it
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                      v.transpose(1, 2)).transpose(1, 2)
        kernels[name] = sdpa
    try:
        import flash_attn.cute as fa4
        from importlib.metadata import version

        meta["flash_attn_4"] = version("flash-attn-4")
        meta["cutlass_dsl"] = version("nvidia-cutlass-dsl")
        kernels["fa4"] = lambda q, k, v: fa4.flash_attn_func(q, k, v)
    except Exception as e:  # the reason it does not run here is the row
        meta["fa4_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    print(json.dumps(meta))
    g = torch.Generator("cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    small = [x[:1, :, :2].detach().clone().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        f32 = [x.detach().float().requires_grad_() for x in small]
        ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in f32)).transpose(1, 2)
        ref.backward(dout[:1, :, :2].float())
    flops = 4 * B * H * S * S * D
    rows = []
    for name, fn in kernels.items():
        row = dict(kernel=name)
        try:
            out = fn(*small)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(dout[:1, :, :2])
            for what, a, b in [("out", out, ref)] + [(f"d{n}", x.grad, y.grad) for n, x, y in zip("qkv", small, f32)]:
                row[f"{what}_max_abs"] = (a.float() - b).abs().max().item()
                row[f"{what}_rel_rms"] = ((a.float() - b).norm() / b.norm()).item()
            for x in small:
                x.grad = None
            row["fwd_ms"] = cuda_median_ms(lambda fn=fn: fn(q, k, v), 10, 3)
            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

            def step(fn=fn):
                o = fn(qg, kg, vg)
                (o[0] if isinstance(o, tuple) else o).backward(dout)
            row["fwd_bwd_ms"] = cuda_median_ms(step, 10, 3)
            row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
            row["fwd_bwd_tflops"] = 3.5 * flops / row["fwd_bwd_ms"] / 1e9
        except Exception as e:  # a kernel that fails at this shape is a row, not the end
            row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
        rows.append(row)
    print("| kernel | fwd ms | fwd TFLOPS | fwd+bwd ms | fwd+bwd TFLOPS | out rel RMS | dq rel RMS |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kernel']} | {r['error']} |")
            continue
        print(f"| {r['kernel']} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | {r['fwd_bwd_ms']:.2f} | "
              f"{r['fwd_bwd_tflops']:.0f} | {r['out_rel_rms']:.1e} | {r['dq_rel_rms']:.1e} |")
    return dict(meta=meta, rows=rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="kernel", required=True)
    for name in ("adaln", "fp8", "fp8-train", "ring-attention", "attention8", "exact-attention", "packing",
                 "optimizer-step"):
        s = sub.add_parser(name)
        s.add_argument("--out", help="JSON file" + (" (default benchmarks/results/packing_<device>.json)"
                                                    if name == "packing" else ""))
        if name == "ring-attention":
            s.add_argument("--tokens", default="4096,16384,32768")
        if name in ("attention8", "exact-attention"):
            s.add_argument("--tokens", type=int, default=32760)
        if name == "exact-attention":  # Wan-1.3B's by default; CogVideoX-5B's: --tokens 17776 --heads 48 --head_dim 64
            s.add_argument("--heads", type=int, default=12)
            s.add_argument("--head_dim", type=int, default=128)
        if name == "fp8-train":
            s.add_argument("--widths", default="1152,2048,3072,4096")
            s.add_argument("--recipes", default="tensorwise,rowwise")
            s.add_argument("--tokens", type=int, default=8192)
        if name == "packing":
            s.add_argument("--tiny", action="store_true",
                           help="CPU smoke test: vDiT-T/222 on 4x1x8x8 / 4x4x8x8 latents")
            s.add_argument("--window", type=int, default=16, help="samples per step")
            s.add_argument("--pack_tokens", type=int, default=4096, help="tokens per packed row")
            s.add_argument("--windows", type=int, default=3, help="different random windows, each timed")
            s.add_argument("--steps", type=int, default=10)
            s.add_argument("--warmup", type=int, default=3)
        if name == "optimizer-step":
            s.add_argument("--offload", action="store_true",
                           help="copy bandwidth and the step resident against streamed")
            s.add_argument("--sharded", action="store_true", help="the one-pass step over FSDP2's shards against plain")
    args = p.parse_args()
    result = {"adaln": adaln, "fp8": fp8, "fp8-train": fp8_train, "ring-attention": ring_attention,
              "attention8": attention8, "exact-attention": exact_attention, "packing": packing,
              "optimizer-step": optimizer_step}[args.kernel](args)
    if args.out:  # packing sets its default
        with atomic_path(args.out) as tmp:
            Path(tmp).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
