"""The attention seam: every attention call in every model goes through `attention`.

Backends and sequence parallelism plug in here (set from outside by `parallelize`), so model code never
branches on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact softmax attention, softmax(q k^T / sqrt(d)) v (Vaswani et al. 2017, eq. 1).

    Args:
        q: (B, H, Nq, Dh) queries, any float dtype.
        k, v: (B, H, Nk, Dh) keys and values, same dtype as ``q``.

    Returns:
        (B, H, Nq, Dh) in the dtype of ``q``. Runs PyTorch's ``scaled_dot_product_attention``, which picks
        the fastest exact kernel it has for the device and dtype (math on the CPU).
    """
    return F.scaled_dot_product_attention(q, k, v)
