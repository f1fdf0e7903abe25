"""Building blocks shared by the DiT family: embedders, patchify, position embeddings, attention and MLP.

Module and parameter names follow facebookresearch/DiT (which uses timm's ``Attention``, ``Mlp`` and
``PatchEmbed``) so that state dicts are interchangeable with the official checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ditforge.ops import attention, self_attention
from ditforge.ops.attention import Packed
from ditforge.ops.linear import gelu_mlp


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
        rows = num_classes + use_cfg_embedding
        # the table's values come from DiT.initialize_weights; nn.Embedding's own N(0, 1) draw is skipped, since on
        # the meta device (create_model(device=)) torch's normal_ imports torch._dynamo: ~2 s of a process's start
        self.embedding_table = nn.Embedding(rows, hidden_size, _weight=torch.empty(rows, hidden_size))
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


def patch_grid(size: Sequence[int], patch: Sequence[int]) -> tuple[int, ...]:
    """The token grid (H/p, W/p) or (T/t, H/h, W/w) of an input of size ``size`` cut into ``patch`` patches.

    Raises:
        ValueError: sizes and patches of different lengths, or a size its patch edge does not divide (a strided
            convolution would silently drop the remainder).
    """
    size, patch = tuple(int(n) for n in size), tuple(int(p) for p in patch)
    if len(size) != len(patch):
        raise ValueError(f"input size {size} and patch size {patch} have different numbers of axes")
    axes = ("height", "width") if len(size) == 2 else ("frames", "height", "width")
    for axis, n, p in zip(axes, size, patch):
        if p < 1 or n < 1 or n % p:
            raise ValueError(f"input {axis} {n} is not divisible by patch size {p}")
    return tuple(n // p for n, p in zip(size, patch))


class PatchEmbed(nn.Module):
    """Patchify: (B, C, H, W) -> (B, (H/p)(W/p), D) with a stride-p convolution (ViT, Dosovitskiy et al. 2021).

    Tokens are in row-major (H', W') order. ``grid_shape`` = (H/p, W/p) of the configured size and
    ``patch_shape`` = (p, p) describe the layout for ``unpatchify``; ``grid_size`` = H/p is the square grid's
    edge. The call takes any (H, W) that p divides (``patch_grid`` gives its grid).

    Raises:
        ValueError: ``img_size`` not divisible by ``patch_size``.
    """

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int, bias: bool = True):
        super().__init__()
        self.patch_shape = (patch_size, patch_size)
        self.grid_shape = patch_grid((img_size, img_size), self.patch_shape)
        self.grid_size = self.grid_shape[0]
        self.num_patches = self.grid_size**2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype)).flatten(2).transpose(1, 2)  # float32 noise, bf16 model


class PatchEmbed3D(nn.Module):
    """3-D patchify: (B, C, T, H, W) -> (B, (T/t)(H/h)(W/w), D) with a Conv3d of kernel = stride = (t, h, w).

    The video counterpart of ``PatchEmbed`` (tubelet embedding of ViViT, Arnab et al. 2021; the patch embedding
    of OpenDiT's vDiT). Tokens are in row-major (T', H', W') order: token ``(i * H' + j) * W' + k`` is the patch
    starting at frame ``i t``, row ``j h``, column ``k w``. ``grid_shape`` = (T', H', W') of the configured size,
    ``patch_shape`` = (t, h, w), ``num_patches`` = T' H' W'. The call takes any (T, H, W) the patch divides.

    Args:
        input_size: (T, H, W) of the input.
        patch_size: (t, h, w) patch edges.
        in_chans, embed_dim: C and D.

    Raises:
        ValueError: sizes that are not 3-tuples, or a size its patch edge does not divide.
    """

    def __init__(
        self,
        input_size: Sequence[int],
        patch_size: Sequence[int],
        in_chans: int,
        embed_dim: int,
        bias: bool = True,
    ):
        super().__init__()
        input_size, patch_size = tuple(int(n) for n in input_size), tuple(int(p) for p in patch_size)
        if len(input_size) != 3 or len(patch_size) != 3:
            raise ValueError(f"expected (T, H, W) input and (t, h, w) patch sizes, got {input_size}, {patch_size}")
        self.grid_shape = patch_grid(input_size, patch_size)
        self.patch_shape = patch_size
        self.num_patches = math.prod(self.grid_shape)
        self.proj = nn.Conv3d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, T, H, W) -> (B, T' H' W', D), in the weights' dtype."""
        return self.proj(x.to(self.proj.weight.dtype)).flatten(2).transpose(1, 2)


def unpatchify(x: torch.Tensor, grid_shape: Sequence[int], patch_shape: Sequence[int], channels: int) -> torch.Tensor:
    """Inverse of the patch embeddings' token order, in any number of dimensions.

    Token ``n`` (row-major over ``grid_shape``) holds its patch's values in (``*patch_shape``, C) order, i.e.
    value ``[(dt h + dh) w + dw] C + c`` of a 3-D token, ``(dh p + dw) C + c`` of a 2-D one. For 2-D this is the
    official DiT ``unpatchify`` (``einsum('nhwpqc->nchpwq')``); for 3-D it is OpenDiT's vDiT layout.

    Args:
        x: (B, prod(grid_shape), prod(patch_shape) * channels), any dtype.
        grid_shape: token grid, (H', W') or (T', H', W').
        patch_shape: patch edges, (p, p) or (t, h, w).
        channels: C.

    Returns:
        (B, C, *(g * p for each axis)), e.g. (B, C, T, H, W); same dtype.

    Raises:
        ValueError: ``x`` does not have the token count or width the shapes imply.
    """
    k = len(grid_shape)
    if len(patch_shape) != k or x.dim() != 3:
        raise ValueError(f"unpatchify: grid {tuple(grid_shape)}, patch {tuple(patch_shape)}, tokens {tuple(x.shape)}")
    if x.shape[1] != math.prod(grid_shape) or x.shape[2] != math.prod(patch_shape) * channels:
        raise ValueError(
            f"unpatchify: tokens {tuple(x.shape)} do not match grid {tuple(grid_shape)}, "
            f"patch {tuple(patch_shape)} and {channels} channels"
        )
    x = x.reshape(x.shape[0], *grid_shape, *patch_shape, channels)
    # axes: 0 batch, 1..k grid, k+1..2k patch, 2k+1 channel -> (B, C, g_0, p_0, g_1, p_1, ...)
    x = x.permute(0, 2 * k + 1, *(a for i in range(k) for a in (1 + i, 1 + k + i)))
    return x.reshape(x.shape[0], channels, *(g * p for g, p in zip(grid_shape, patch_shape)))


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (timm layout: ``qkv``, ``proj``).

    (B, N, D) -> (B, N, D); the softmax attention itself goes through ``ditforge.ops.self_attention`` (the seam
    where sequence parallelism and packed sequences plug in: ``forward(x, packed)`` with packed rows attends
    within each sample).
    ``qk_norm``: LayerNorm over each head's queries and keys before the product (``q_norm``, ``k_norm``, as
    timm; Dehghani et al. 2023, ViT-22B), which keeps attention logits bounded in long video training.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, qk_norm: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by {num_heads} heads")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm, self.k_norm = _qk_norms(dim // num_heads, qk_norm)
        self.proj = nn.Linear(dim, dim)

    def project(self, x: torch.Tensor, heads: slice | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v, each (B, h, N, Dh) (q and k normed), of tokens x (B, N, D) for the heads in the slice
        ``heads``: None = all H through the fused ``qkv`` layer; a slice = those heads' rows of its weight
        and bias, three products on views of them (FastSeq projects one head group of the whole sequence; not with a
        float8 ``qkv``, whose weight is an e4m3 buffer: sampling refuses fp8 with sequence parallelism)."""
        B, N, D = x.shape
        dh = self.head_dim
        if heads is None:  # -1: the heads this process holds (all, or its share under tensor parallelism)
            q, k, v = self.qkv(x).reshape(B, N, 3, -1, dh).permute(2, 0, 3, 1, 4)
        else:
            w = self.qkv.weight.unflatten(0, (3, self.num_heads, dh))[:, heads]  # (3, h, Dh, D); w[i] contiguous
            b = self.qkv.bias
            b = [None] * 3 if b is None else b.unflatten(0, (3, self.num_heads, dh))[:, heads].flatten(1)
            q, k, v = (F.linear(x, w[i].flatten(0, 1), b[i]).unflatten(-1, (-1, dh)).transpose(1, 2) for i in range(3))
        return self.q_norm(q), self.k_norm(k), v

    def forward(self, x: torch.Tensor, packed: Packed | None = None) -> torch.Tensor:
        B, N, _ = x.shape
        out = self_attention(x, self.project, packed)
        return self.proj(out.transpose(1, 2).reshape(B, N, -1))


def _qk_norms(head_dim: int, enabled: bool) -> tuple[nn.Module, nn.Module]:
    if not enabled:
        return nn.Identity(), nn.Identity()
    return nn.LayerNorm(head_dim, eps=1e-6), nn.LayerNorm(head_dim, eps=1e-6)


class CrossAttention(nn.Module):
    """Multi-head cross-attention from image/video tokens to text tokens (Chen et al. 2023,
    section 2.3; ``MultiHeadCrossAttention`` of its reference code): q from x, k and v from the context.

    ``forward(x, context, mask)``: x (B, N, D), context (B, L, D) (caption tokens already projected to D),
    mask (B, L) bool (True = a real token) -> (B, N, D). ``qk_norm`` as in ``Attention``. Packed rows: context
    (1, L', D), every caption of the batch end to end, shared by the B rows, and mask (B, N, L') per query.
    """

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by {num_heads} heads")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_linear = nn.Linear(dim, dim)
        self.kv_linear = nn.Linear(dim, dim * 2)
        self.q_norm, self.k_norm = _qk_norms(dim // num_heads, qk_norm)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        dh, L = self.head_dim, context.shape[1]
        q = self.q_linear(x).unflatten(-1, (-1, dh)).transpose(1, 2)  # -1: the heads held, as in Attention
        k, v = self.kv_linear(context).reshape(context.shape[0], L, 2, -1, dh).permute(2, 0, 3, 1, 4)
        k, v = self.k_norm(k).expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)  # shared captions of packed rows
        out = attention(self.q_norm(q), k, v, mask)
        return self.proj(out.transpose(1, 2).reshape(B, N, -1))


class CaptionEmbedder(nn.Module):
    """Text-encoder states -> caption tokens of width D, with caption dropout for classifier-free guidance.

    Projection: Linear -> GELU(tanh) -> Linear (Chen et al. 2023's ``CaptionEmbedder``). In a dropped caption (coin
    flip with ``dropout_prob`` in training, or ``force_drop_ids``) every token becomes one learned null token
    (``null_caption``, (1, D_text)); softmax attention over copies of one token equals attention to it alone,
    so the unconditional branch does not depend on the text encoder, the caption or its length (Chen et al. 2023
    learn a full-length null sequence instead).

    ``forward(states, mask, train, force_drop_ids)``: states (B, L, D_text) float, mask (B, L) bool ->
    (tokens (B, L, D), mask (B, L) bool).
    """

    def __init__(self, text_dim: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.y_proj = Mlp(text_dim, hidden_size, out_features=hidden_size)
        null = torch.randn(1, text_dim)  # a meta build draws it as it materialises (initialize_weights); scaling
        # it here would import torch._dynamo, as any arithmetic on meta tensors does: ~2 s of a process's start
        self.null_caption = nn.Parameter(null if null.is_meta else null / text_dim**0.5)
        self.dropout_prob = dropout_prob

    def forward(
        self, states: torch.Tensor, mask: torch.Tensor, train: bool, force_drop_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if force_drop_ids is not None:
            drop = force_drop_ids == 1
        elif train and self.dropout_prob > 0:
            drop = torch.rand(states.shape[0], device=states.device) < self.dropout_prob
        else:
            drop = None
        states = states.to(self.null_caption.dtype)  # float32 encoder states into a model cast to bf16
        if drop is not None:  # attending to any number of identical null tokens is attending to one
            states = torch.where(drop[:, None, None], self.null_caption, states)
        return self.y_proj(states), mask


class Mlp(nn.Module):
    """Transformer MLP: fc1 -> GELU (tanh approximation, as DiT) -> fc2. (B, N, D_in) -> (B, N, D_out),
    D_out = ``out_features`` or D_in."""

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.fc2 = nn.Linear(hidden_features, out_features or in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_mlp(x, self.fc1, self.fc2)


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


def sincos_2d(embed_dim: int, grid_size: int | Sequence[int]) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding for an (H', W') grid (an int: a square one), row-major tokens;
    float32 (H' W', D).

    Half the channels encode the column (w) index, half the row (h) index, in the order of
    ``get_2d_sincos_pos_embed`` in facebookresearch/DiT (its meshgrid puts w first); a non-square grid takes
    each axis's own indices 0..H'-1 and 0..W'-1 (no interpolation to the square grid of training).

    Raises:
        ValueError: a grid that is not one or two positive sizes.
    """
    height, width = (grid_size, grid_size) if isinstance(grid_size, int) else tuple(int(g) for g in grid_size)
    if min(height, width) < 1:
        raise ValueError(f"2-D sin-cos embedding needs a grid of positive sizes, got {grid_size}")
    grid_h, grid_w = torch.meshgrid(torch.arange(height, dtype=torch.float64),
                                    torch.arange(width, dtype=torch.float64), indexing="ij")
    emb = torch.cat([sincos_1d(embed_dim // 2, grid_w), sincos_1d(embed_dim // 2, grid_h)], dim=1)
    return emb.float()


def sincos_3d(embed_dim: int, grid: Sequence[int]) -> torch.Tensor:
    """Fixed 3-D sin-cos position embedding for a (T', H', W') token grid, row-major tokens; float32 (T'H'W', D).

    Channel split (OpenDiT's ``get_3d_sincos_pos_embed``, after MAE's 2-D embedding): the first D/4 channels
    encode the frame index i, the next 3D/8 the column index k, the last 3D/8 the row index j (the 3D/4
    spatial channels are ``sincos_2d(3D/4, ...)``'s layout, w first). Each part is ``sincos_1d`` of its width:
    token ``(i H' + j) W' + k`` gets ``[sincos_1d(D/4, i) | sincos_1d(3D/8, k) | sincos_1d(3D/8, j)]``.
    Computed in float64, returned as float32.

    Raises:
        ValueError: ``grid`` is not three positive sizes, or D is not a multiple of 16 (each of the three
            parts needs an even width: D/4 and 3D/8 even).
    """
    grid = tuple(int(g) for g in grid)
    if len(grid) != 3 or min(grid) < 1:
        raise ValueError(f"3-D sin-cos embedding needs a (T', H', W') grid of positive sizes, got {grid}")
    if embed_dim % 16:
        raise ValueError(
            f"3-D sin-cos embedding width must be a multiple of 16 (D/4 time, 3D/8 width and 3D/8 height "
            f"channels, each even), got {embed_dim}"
        )
    d_time, d_space = embed_dim // 4, embed_dim // 4 * 3
    axes = [torch.arange(g, dtype=torch.float64) for g in grid]
    grid_t, grid_h, grid_w = torch.meshgrid(*axes, indexing="ij")
    emb = torch.cat(
        [sincos_1d(d_time, grid_t), sincos_1d(d_space // 2, grid_w), sincos_1d(d_space // 2, grid_h)], dim=1
    )
    return emb.float()
