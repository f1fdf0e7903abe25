"""vDiT: the video DiT of OpenDiT (https://github.com/NUS-HPC-AI-Lab/OpenDiT, now VideoSys).

DiT (Peebles & Xie, ICCV 2023) applied to video latents with 3-D patches: "vDiT-XL/222" is DiT-XL with
(t, h, w) = (2, 2, 2) patches and full spatio-temporal self-attention over all T/t * H/h * W/w tokens, and a fixed
3-D sin-cos position embedding. Everything but the patch embedding and the position embedding is ``DiT``'s own code
(blocks, adaLN-Zero conditioning, label dropout, initialisation, forward, unpatchify, FLOP count).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ditforge.models.dit import DiT
from ditforge.models.layers import PatchEmbed3D, sincos_3d


class VideoDiT(DiT):
    """Class-conditional video Diffusion Transformer (OpenDiT's vDiT).

    ``forward(x, t, y, force_drop_ids=None)``: x (B, C, T, H, W) float, t (B,) int64 timesteps, y (B,) int64 class
    labels (``num_classes`` is the null label; dropout and ``force_drop_ids`` exactly as ``DiT.forward``) ->
    (B, C_out, T, H, W) with C_out = 2C when ``learn_sigma``. Conditioning goes through ``DiT.embed_conditions``
    (the place to extend, e.g. with pooled text features).

    Tokens: ``PatchEmbed3D`` (Conv3d, kernel = stride = (t, h, w)), row-major (T', H', W') order, N = T'H'W';
    position embedding ``sincos_3d`` (D/4 time, 3D/8 width, 3D/8 height channels, as OpenDiT), a frozen
    parameter ``pos_embed`` (1, N, D) like DiT's. The state-dict keys are DiT's; only ``x_embedder.proj.weight``
    (D, C, t, h, w) and the sizes of ``pos_embed`` and ``final_layer.linear`` (t h w C_out rows) differ.

    FLOPs (``flops_per_sample``, shared with DiT; P = t h w): per block 24 N D^2 + 4 N^2 D + 12 D^2, plus
    2 N P C D (patch embedding), 2 (256 D + D^2) (timestep MLP), 2 N D P C_out + 4 D^2 (final layer).
    vDiT-XL/222 at 16x32x32 latents, N = 2048: 2,368,508,166,144 ~ 2.37 TFLOP per sample forward.

    Args:
        input_size: spatial size H = W, divisible by h and w.
        num_frames: T (latent frames), divisible by t.
        patch_size: (t, h, w).
        Others as ``DiT``.

    Raises:
        ValueError: ``patch_size`` not three edges, sizes not divisible by the patch, or a width not a multiple of 16
            (``sincos_3d``) or of ``num_heads``.
    """

    def __init__(self, input_size: int = 32, num_frames: int = 16, patch_size: Sequence[int] = (2, 2, 2), **dit_kwargs):
        patch_size = tuple(int(p) for p in patch_size)
        if len(patch_size) != 3:
            raise ValueError(f"vDiT patch size must be (t, h, w), got {patch_size}")
        super().__init__(input_size=(num_frames, input_size, input_size), patch_size=patch_size, **dit_kwargs)
        self.num_frames = num_frames

    def _build_x_embedder(self, input_size, patch_size, in_channels: int, hidden_size: int) -> nn.Module:
        """``PatchEmbed3D`` over (T, H, W) with (t, h, w) patches."""
        return PatchEmbed3D(input_size, patch_size, in_channels, hidden_size, bias=True)

    def _fixed_pos_embed(self) -> torch.Tensor:
        """3-D sin-cos embedding over the (T', H', W') token grid, float32 (N, D)."""
        return sincos_3d(self.pos_embed.shape[-1], self.x_embedder.grid_shape)
