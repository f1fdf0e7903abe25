"""8-bit attention for sampling (``--quantized_attention``): softmax(Q K^T / sqrt(D)) V with Q K^T in int8 and
P V in float8 (e4m3).

At a video model's sequence lengths attention is most of a sampling step (a 1.3B video model at 480 x 832 x 81:
32,760 tokens, 70% of the compiled step on an H200, in cuDNN's bf16 kernel at 550 TFLOPS;
``benchmarks/results/sampling/wan13_h200_profile.json``). Hopper's int8 and float8 tensor cores run twice bf16's
rate.

The inputs are quantized in PyTorch (``quantize_attention_inputs``, fused by inductor into the block's compiled
code), the products run in one Triton kernel (``ditforge.ops.triton.attention``). Scaling, after SageAttention
(Zhang et al. 2025, sections 3.2-3.4) and SageAttention2 (Zhang et al. 2025, section 4):
- Q: int8 with one scale per query row, a = max(amax_row |q|, 1e-12), q8 = round(q 127 / a); the softmax scale and
  log2(e) are folded into the row's scale.
- K: the head's mean key is subtracted first (softmax is unchanged by adding q . mean to every score of a row,
  and the rest has no shared offset to waste the range on), then int8 with one scale per block of 128 keys.
  int8, not e4m3: its 127 uniform steps a sign against e4m3's 3 mantissa bits keep the scores' error near 1%, where
  e4m3 gave 4% (random Gaussian inputs, D = 128) -- SageAttention's finding.
- V: e4m3 with one scale per channel (over the tokens); stored transposed (D, S), the layout Hopper's float8 MMA
  reads.
- P: rounded to e4m3 after scaling by 448 (its values are in [0, 1]); the row sums use P before rounding.

Inference only (no backward). Approximate: see ``benchmarks/sample_wan.py`` for the PSNR of a whole clip.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from ditforge.ops.triton import AMAX_EPS, E4M3_MAX, check_triton, interpreting

__all__ = ["HEAD_DIMS", "KEY_BLOCK", "quantize_attention_inputs", "quantized_attention",
           "quantized_attention_reference"]

KEY_BLOCK = 128  # keys per K scale; the kernel's key blocks divide it
HEAD_DIMS = (32, 64, 128)  # head widths the kernel takes (a power of two: its tiles; >= 32: Triton's 8-bit dot's K)
INT8_MAX = 127.0
LOG2E = 1.4426950408889634


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """x zero-padded at the end of ``dim`` to ``size``."""
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return torch.nn.functional.pad(x, pad)


def quantize_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
                              ) -> tuple[torch.Tensor, ...]:
    """The kernel's 8-bit inputs from q, k, v (B, S, H, D) (any float dtype), padded to S_PAD = S rounded up to
    ``KEY_BLOCK``; scales as the module says.

    Returns:
        q8 (B, H, S_PAD, D) int8; k8 (B, H, S_PAD, D) int8 (mean key subtracted); vt8 (B, H, D, S_PAD) e4m3;
        sq (B, H, S_PAD) float32 = a_q / 127 * scale * log2(e) (0 on padding); sk (B, H, S_PAD / KEY_BLOCK) float32;
        sv (B, H, D) float32. So q.k ~= (q8 * sq).(k8 * sk) / (scale log2 e) + q.mean_k and v ~= vt8^T * sv.
    """
    B, S, H, D = q.shape
    s_pad = -(-S // KEY_BLOCK) * KEY_BLOCK
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf = q.float()
    aq = qf.abs().amax(-1, keepdim=True).clamp_min(AMAX_EPS)  # (B, S, H, 1)
    q8 = (qf * (INT8_MAX / aq)).round().to(torch.int8)
    sq = aq.squeeze(-1) * (scale * LOG2E / INT8_MAX)
    kf = k.float()
    kf = _pad(kf - kf.mean(1, keepdim=True), 1, s_pad)
    ak = kf.view(B, s_pad // KEY_BLOCK, KEY_BLOCK, H, D).abs().amax((2, 4)).clamp_min(AMAX_EPS)  # (B, blocks, H)
    k8 = (kf.view(B, s_pad // KEY_BLOCK, KEY_BLOCK, H, D) * (INT8_MAX / ak)[:, :, None, :, None]).round().to(
        torch.int8).view(B, s_pad, H, D)
    vf = v.float()
    av = vf.abs().amax(1, keepdim=True).clamp_min(AMAX_EPS)  # (B, 1, H, D)
    v8 = (vf * (E4M3_MAX / av)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (_pad(q8, 1, s_pad).transpose(1, 2).contiguous(), k8.transpose(1, 2).contiguous(),
            _pad(v8.permute(0, 2, 3, 1), 3, s_pad).contiguous(), _pad(sq, 1, s_pad).transpose(1, 2).contiguous(),
            (ak / INT8_MAX).transpose(1, 2).contiguous(), (av.squeeze(1) / E4M3_MAX).contiguous())


# from ``benchmarks/kernel_speed.py attention8`` at 2 x 32,760 tokens x 12 heads of 128 (H200, 2026-11-28,
# ``results/sampling/attention8_h200.json``): 18.05 ms against 20.40 with 3 stages, 19.05 with Hopper's imprecise
# float8 accumulation (no PV_PRECISE_K), 21.78 with 64-key blocks, 25.60 with 128-query blocks and 8 warps, 18.22
# with Triton's warp_specialize; cuDNN's bf16 kernel took 23.16 ms
CONFIG = dict(block_m=64, block_n=128, num_warps=4, num_stages=2, pv_precise_k=128, warp_specialize=False)


def launch(q8: torch.Tensor, k8: torch.Tensor, vt8: torch.Tensor, sq: torch.Tensor, sk: torch.Tensor,
           sv: torch.Tensor, seq_len: int, config: dict | None = None) -> torch.Tensor:
    """The kernel over ``quantize_attention_inputs``' outputs -> out (B, S, H, D) bf16, S = ``seq_len``.
    ``config`` (default ``CONFIG``): BLOCK_M and BLOCK_N (each dividing ``KEY_BLOCK``), warps, pipeline stages,
    and the keys between exact float32 additions of P V (``PV_PRECISE_K``), as ``benchmarks/kernel_speed.py
    attention8`` chose them."""
    check_triton(q8.device)
    # imported here, not at the top: Triton's interpreter must be chosen (TRITON_INTERPRET) before kernels are built
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ditforge.ops.triton import attention as _k

    c = CONFIG if config is None else config
    B, H, s_pad, D = q8.shape
    out = torch.empty((B, seq_len, H, D), dtype=torch.bfloat16, device=q8.device)
    q_desc = TensorDescriptor.from_tensor(q8.view(B * H * s_pad, D), [c["block_m"], D])
    k_desc = TensorDescriptor.from_tensor(k8.view(B * H * s_pad, D), [c["block_n"], D])
    vt_desc = TensorDescriptor.from_tensor(vt8.view(B * H * D, s_pad), [D, c["block_n"]])
    _k.quantized_attention_fwd_kernel[(-(-seq_len // c["block_m"]), B * H)](
        q_desc, k_desc, vt_desc, sq, sk, sv, out, seq_len, s_pad, H, out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=D, BLOCK_M=c["block_m"], BLOCK_N=c["block_n"], KEY_BLOCK=KEY_BLOCK,
        PV_PRECISE_K=c["pv_precise_k"], WARP_SPECIALIZE=c["warp_specialize"], INTERPRETED=interpreting(),
        num_warps=c["num_warps"],
        num_stages=c["num_stages"],
    )
    return out


_OPS: SimpleNamespace | None = None


def ops() -> SimpleNamespace:
    """The launcher as a ``torch.library.custom_op`` (``ditforge::quantized_attention``), opaque to ``torch.compile``
    (it takes tensor descriptors, which a traced launch does not), registered on the first call; make that call
    before compiling a model that uses the op (dynamo cannot trace the registration)."""
    global _OPS
    if _OPS is None:
        def run(q8: torch.Tensor, k8: torch.Tensor, vt8: torch.Tensor, sq: torch.Tensor, sk: torch.Tensor,
                sv: torch.Tensor, seq_len: int) -> torch.Tensor:
            return launch(q8, k8, vt8, sq, sk, sv, seq_len)

        op = torch.library.custom_op("ditforge::quantized_attention", run, mutates_args=())

        @op.register_fake
        def _(q8, k8, vt8, sq, sk, sv, seq_len):
            B, H, _, D = q8.shape
            return q8.new_empty((B, seq_len, H, D), dtype=torch.bfloat16)

        _OPS = SimpleNamespace(quantized_attention=op)
    return _OPS


def quantized_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
                        ) -> torch.Tensor:
    """softmax(q k^T * scale) v over q, k, v (B, S, H, D) (diffusers' attention layout; scale 1 / sqrt(D) by
    default) with 8-bit products, no mask. Returns (B, S, H, D) bf16.

    Raises:
        RuntimeError: Triton cannot run here (no CUDA GPU for the tensors and no ``TRITON_INTERPRET=1``).
    """
    parts = quantize_attention_inputs(q, k, v, scale)
    return ops().quantized_attention(*parts, q.shape[1])


def quantized_attention_reference(q8, k8, vt8, sq, sk, sv, seq_len: int, block_n: int = CONFIG["block_n"]
                                  ) -> torch.Tensor:
    """The kernel's algorithm unfused in PyTorch, float32 like the kernel, over its quantized inputs (the reference of
    the tests): the online softmax over blocks of ``block_n`` keys with P rounded to e4m3 after scaling by 448.
    Returns (B, S, H, D) float32 (the kernel rounds its output to bf16)."""
    S, s_pad, D = seq_len, q8.shape[2], q8.shape[3]
    q, row_scale = q8.float()[:, :, :S], sq[:, :, :S, None]
    m = torch.full_like(row_scale, float("-inf"))
    l = torch.zeros_like(row_scale)
    acc = torch.zeros(*q.shape[:3], D, dtype=torch.float32, device=q.device)
    for start in range(0, S, block_n):
        s = q @ k8.float()[:, :, start:start + block_n].transpose(-1, -2)  # exact: int8 products, sums < 2^24
        s = s[..., :S - start]  # keys past S are masked
        c = row_scale * sk[:, :, start // KEY_BLOCK, None, None]
        m_new = torch.maximum(m, s.amax(-1, keepdim=True) * c)
        p = torch.exp2(s * c - m_new)
        alpha = torch.exp2(m - m_new)
        l = l * alpha + p.sum(-1, keepdim=True)
        p8 = (p * E4M3_MAX).to(torch.float8_e4m3fn).float()
        acc = acc * alpha + p8 @ vt8.float()[..., start:start + p.shape[-1]].transpose(-1, -2)
        m = m_new
    return (acc * (sv[:, :, None, :] / E4M3_MAX) / l).transpose(1, 2)
