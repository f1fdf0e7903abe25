"""Triton kernel of 8-bit attention for sampling: softmax(Q K^T * scale) V with Q K^T in int8 and P V in float8
(e4m3), and FlashAttention's online softmax. Only the ``@triton.jit`` function lives here; the quantization of Q, K
and V and the ``torch.library`` op are in ``ditforge.ops.quant_attention``.

Math (sources):
- The online softmax over key blocks: Dao et al. 2022, "FlashAttention", algorithm 1; with base-2 exponentials and
  the softmax scale folded into the scores, as FlashAttention-2 (Dao 2023, section 3.1) and Triton's fused-attention
  tutorial do.
- 8-bit products with a scale per query row (Q, int8), per block of 128 keys (K, int8, after subtracting the mean
  key of the head) and per channel (V, e4m3), and P quantized with the static scale 448: SageAttention (Zhang et
  al. 2025, "SageAttention", sections 3.2-3.4: smoothing K, int8 Q K^T with per-block scales) and SageAttention2
  (Zhang et al. 2025, section 4: FP8 P V, P scaled by 448, e4m3's largest finite value). The row sums use P before
  rounding.

Per (batch x head, block of BLOCK_M queries) program, for each block of BLOCK_N keys j:
  s = q8 k8_j^T; c = sq * sk_j         # int32 products; scale * log2(e) is folded into sq
  m' = max(m, c rowmax(s)); p = 2^(c s - m'); l = l 2^(m - m') + rowsum(p)
  acc = acc 2^(m - m') + e4m3(448 p) v8t_j^T
and at the end out = acc * sv / (448 l). Keys past S (the last block's padding) get s = -1e30 (p = 0).
"""

import triton
import triton.language as tl

from ditforge.ops import triton as common
from ditforge.ops.triton.quant import _round_to_e4m3

P_SCALE = tl.constexpr(common.E4M3_MAX)


@triton.jit
def _key_block(acc, l_i, m_i, q, row_scale, k_desc, vt_desc, sk_ptr, bh, start_n, S, S_PAD,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, KEY_BLOCK: tl.constexpr, MASKED: tl.constexpr,
               PV_PRECISE_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """One key block of the online softmax: (acc, l, m) updated with keys start_n .. start_n + BLOCK_N."""
    k = k_desc.load([bh * S_PAD + start_n, 0])  # (BLOCK_N, D) int8
    sk = tl.load(sk_ptr + bh * (S_PAD // KEY_BLOCK) + start_n // KEY_BLOCK)  # the block's K scale
    # the scores stay unscaled integers until the exponential: c > 0, so max(c s) = c max(s), and c s - m is one
    # fused multiply-add a score
    s = tl.dot(q, k.T, out_dtype=tl.int32).to(tl.float32)
    c = row_scale * sk
    if MASKED:
        # finite: padding query rows have c = 0, and -inf * 0 would be NaN there (those rows are not stored)
        s = tl.where((start_n + tl.arange(0, BLOCK_N))[None, :] < S, s, -1e30)
    m_new = tl.maximum(m_i, tl.max(s, 1) * c)
    p = tl.math.exp2(s * c[:, None] - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    vt = vt_desc.load([bh * HEAD_DIM, start_n])  # (D, BLOCK_N) e4m3: V transposed, keys contiguous
    p8 = p * P_SCALE
    if INTERPRETED:  # the interpreter's cast rounds wrongly where rounding carries into the exponent (quant.py)
        p8 = _round_to_e4m3(p8)
    # PV_PRECISE_K: Hopper's float8 MMA accumulates with fewer bits than float32; Triton adds the partial sums of
    # every PV_PRECISE_K keys into the float32 accumulator exactly
    acc = tl.dot(p8.to(tl.float8e4nv), vt.T, acc * alpha[:, None], max_num_imprecise_acc=PV_PRECISE_K)
    return acc, l_i, m_new


@triton.jit
def quantized_attention_fwd_kernel(q_desc, k_desc, vt_desc, sq_ptr, sk_ptr, sv_ptr, out_ptr, S, S_PAD, H,
                                stride_ob, stride_os, stride_oh,
                                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                KEY_BLOCK: tl.constexpr, PV_PRECISE_K: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                                INTERPRETED: tl.constexpr):
    """Attention of one (batch x head, query block): grid (ceil(S / BLOCK_M), B x H).

    Inputs (see ``ditforge.ops.quant_attention.quantize_attention_inputs``): tensor descriptors of q8 and k8
    (B H S_PAD, D) int8 and vt8 (B H D, S_PAD) e4m3; sq (B H S_PAD) float32 (row scale x softmax scale x log2 e),
    sk (B H, S_PAD / KEY_BLOCK) float32, sv (B H, D) float32. Output: (B, S, H, D) bf16 at the given strides
    (unit stride over D). BLOCK_N divides KEY_BLOCK, which divides S_PAD.
    """
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = q_desc.load([bh * S_PAD + start_m, 0])  # (BLOCK_M, D) int8
    row_scale = tl.load(sq_ptr + bh * S_PAD + offs_m)  # 0 on padding rows, which are not stored
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full = S // BLOCK_N
    for j in tl.range(0, full, warp_specialize=WARP_SPECIALIZE):
        acc, l_i, m_i = _key_block(acc, l_i, m_i, q, row_scale, k_desc, vt_desc, sk_ptr, bh, j * BLOCK_N, S, S_PAD,
                                   HEAD_DIM, BLOCK_N, KEY_BLOCK, False, PV_PRECISE_K, INTERPRETED)
    if full * BLOCK_N < S:  # the last, partly padded block
        acc, l_i, m_i = _key_block(acc, l_i, m_i, q, row_scale, k_desc, vt_desc, sk_ptr, bh, full * BLOCK_N, S,
                                   S_PAD, HEAD_DIM, BLOCK_N, KEY_BLOCK, True, PV_PRECISE_K, INTERPRETED)
    offs_d = tl.arange(0, HEAD_DIM)
    sv = tl.load(sv_ptr + bh * HEAD_DIM + offs_d)
    out = acc * (sv / P_SCALE)[None, :] / l_i[:, None]
    b = bh // H
    h = bh % H
    ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    tl.store(ptrs, out.to(tl.bfloat16), mask=offs_m[:, None] < S)
