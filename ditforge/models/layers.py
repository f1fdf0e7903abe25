"""Building blocks shared by the DiT family: embedders, patchify, position embeddings, attention and MLP.

Module and parameter names follow facebookresearch/DiT (which uses timm's ``Attention``, ``Mlp`` and
``PatchEmbed``) so that state dicts are interchangeable with the official checkpoints.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ditforge.ops import attention


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal timestep features ``[cos(t * f_i), sin(t * f_i)]`` with ``f_i = max_period^(-i / half)``.

    Source: ``TimestepEmbedder.timestep_embedding`` in facebookresearch/DiT (after ADM / GLIDE).

    Args:
        t: (B,) timesteps, integer or fractional.
        dim: output width; odd widths get one zero column.

    Returns:
        (B, dim) float32.
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding


class TimestepEmbedder(nn.Module):
    """Timestep embedder: sinusoidal features (256 wide) -> Linear -> SiLU -> Linear. (B,) -> (B, hidden)."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t_freq = timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class-label embedder with label dropout for classifier-free guidance (Ho & Salimans 2022).

    The table has ``num_classes + 1`` rows when ``dropout_prob > 0``; row ``num_classes`` is the null label.
    """

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        use_cfg_embedding = int(dropout_prob > 0)
        self.embedding_table = nn.Embedding(num_classes + use_cfg_embedding, hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def token_drop(self, labels: torch.Tensor, force_drop_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replace dropped labels by the null label. ``force_drop_ids`` (B,) bool/int overrides the coin flips."""
        if force_drop_ids is None:
            drop_ids = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop_ids = force_drop_ids == 1
        return torch.where(drop_ids, self.num_classes, labels)

    def forward(self, labels: torch.Tensor, train: bool, force_drop_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) int64 labels -> (B, hidden). Drops labels when training with dropout, or where forced."""
        if (train and self.dropout_prob > 0) or force_drop_ids is not None:
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)


class PatchEmbed(nn.Module):
    """Patchify: (B, C, H, W) -> (B, (H/p)(W/p), D) with a stride-p convolution (ViT, Dosovitskiy et al. 2021)."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int, bias: bool = True):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"input size {img_size} is not divisible by patch size {patch_size}")
        self.grid_size = img_size // patch_size
        self.num_patches = self.grid_size**2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (timm layout: ``qkv``, ``proj``).

    (B, N, D) -> (B, N, D); the softmax attention itself goes through ``ditforge.ops.attention``.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by {num_heads} heads")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        out = attention(qkv[0], qkv[1], qkv[2])
        return self.proj(out.transpose(1, 2).reshape(B, N, D))


class Mlp(nn.Module):
    """Transformer MLP: fc1 -> GELU (tanh approximation, as DiT) -> fc2. (B, N, D) -> (B, N, D)."""

    def __init__(self, in_features: int, hidden_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def sincos_1d(embed_dim: int, pos: torch.Tensor) -> torch.Tensor:
    """1-D sin-cos position embedding ``[sin(p w_i), cos(p w_i)]``, ``w_i = 10000^(-2i/D)``; float64 (M, D).

    Source: ``get_1d_sincos_pos_embed_from_grid`` in facebookresearch/DiT (after MAE).
    """
    if embed_dim % 2:
        raise ValueError(f"sin-cos embedding width must be even, got {embed_dim}")
    omega = torch.arange(embed_dim // 2, dtype=torch.float64) / (embed_dim / 2.0)
    omega = 1.0 / 10000**omega
    out = pos.reshape(-1).to(torch.float64)[:, None] * omega[None]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def sincos_2d(embed_dim: int, grid_size: int) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding for a square grid, row-major tokens; float32 (grid^2, D).

    Half the channels encode the column (w) index, half the row (h) index, in the order of
    ``get_2d_sincos_pos_embed`` in facebookresearch/DiT (its meshgrid puts w first).
    """
    coords = torch.arange(grid_size, dtype=torch.float64)
    grid_h, grid_w = torch.meshgrid(coords, coords, indexing="ij")
    emb = torch.cat([sincos_1d(embed_dim // 2, grid_w), sincos_1d(embed_dim // 2, grid_h)], dim=1)
    return emb.float()
