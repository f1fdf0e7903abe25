"""Cross-attention to padded caption tokens, forward + backward, by SDPA backend: does a key-padding mask push
SDPA onto a slow kernel? Shapes of vDiT-XL/222 at 16x32x32 latents: q (8, 16, 2048, 72), k/v (8, 16, 120, 72).

    PYTHONPATH=. python benchmarks/cross_attention.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from timing import cuda_median_ms


def main() -> None:
    B, H, N, L, Dh = 8, 16, 2048, 120, 72
    dev, dt = torch.device("cuda"), torch.bfloat16
    q = torch.randn(B, H, N, Dh, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, H, L, Dh, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, H, L, Dh, device=dev, dtype=dt, requires_grad=True)
    lengths = torch.randint(1, L + 1, (B, 1), device=dev)
    mask = (torch.arange(L, device=dev) < lengths)[:, None, None, :]
    print("| backend | mask | fwd+bwd ms |\n|---|---|---:|")
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):
        for m in (None, mask):
            def run():
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=m).sum().backward()
            try:
                ms = f"{cuda_median_ms(run):.2f}"
            except RuntimeError as e:
                ms = "unsupported (" + str(e).splitlines()[0][:60] + ")"
            print(f"| {backend.name.lower()} | {'bool (B,1,1,L)' if m is not None else 'none'} | {ms} |")


if __name__ == "__main__":
    main()
