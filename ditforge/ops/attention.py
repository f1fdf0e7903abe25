"""The attention seam: every attention call in every model goes through `attention`.

Backends and sequence parallelism plug in here (set from outside, by ``parallelize``), so model code never
branches on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Fastest first on Hopper at DiT shapes (REFERENCES.md, H100, B64 x 16 heads x 256 tokens x 72, bf16
# forward: cuDNN 165, Flash 124, memory-efficient 50, math 11 TFLOP/s); math last so any input still runs.
FAST_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
ATTENTION_BACKENDS = ("auto", "fast", "math")
_preferred: list[SDPBackend] | None = None


def set_attention_backend(backend: str = "auto") -> str:
    """Choose the SDPA kernels behind ``attention``: ``fast`` (``--enable_flashattn``) the fastest exact kernel
    PyTorch has, in ``FAST_BACKENDS`` order; ``math`` the unfused reference computation (materialises the
    N x N scores, as the original DiT code did; the baseline row of ``ditforge bench``); ``auto`` PyTorch's
    default order. Returns a description for the log.

    Raises:
        ValueError: an unknown backend name.
    """
    global _preferred
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected one of {ATTENTION_BACKENDS}")
    _preferred = {"auto": None, "fast": FAST_BACKENDS, "math": [SDPBackend.MATH]}[backend]
    if _preferred is None:
        return "PyTorch's default SDPA order"
    return "SDPA, in order: " + ", ".join(b.name.lower() for b in _preferred)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exact softmax attention, softmax(q k^T / sqrt(d)) v (Vaswani et al. 2017, eq. 1).

    Args:
        q: (B, H, Nq, Dh) queries, any float dtype.
        k, v: (B, H, Nk, Dh) keys and values, same dtype as ``q``.
        mask: optional (B, Nk) bool, True for keys to attend to (padding of text tokens is False); every row
            needs at least one True.

    Returns:
        (B, H, Nq, Dh) in the dtype of ``q``. Runs PyTorch's ``scaled_dot_product_attention``, with the
        backend order set by ``set_attention_backend`` (every backend is exact; they differ in speed).
    """
    attn_mask = None if mask is None else mask[:, None, None, :]
    if _preferred is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    with sdpa_kernel(_preferred, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
