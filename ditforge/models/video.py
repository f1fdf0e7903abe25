"""Video DiTs: vDiT, the video DiT of OpenDiT (https://github.com/NUS-HPC-AI-Lab/OpenDiT, now VideoSys), and STDiT,
the spatial-temporal DiT of Open-Sora v1.0 (https://github.com/hpcaitech/Open-Sora).

DiT (Peebles & Xie, ICCV 2023) applied to video latents with 3-D patches: "vDiT-XL/222" is DiT-XL with
(t, h, w) = (2, 2, 2) patches and full spatio-temporal self-attention over all T/t * H/h * W/w tokens, and a fixed
3-D sin-cos position embedding. Everything but the patch embedding and the position embedding is ``DiT``'s own code
(blocks, adaLN-Zero conditioning, label dropout, initialisation, forward, unpatchify, FLOP count).

STDiT ("STDiT-XL/2") keeps (1, p, p) patches and factorises attention: within each frame, then across frames at
each position (``STDiTBlock``, a ``DiTBlock`` with a temporal attention); ``inflate_image_state_dict`` starts it
from an image DiT's weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ditforge.models.dit import NORM_EPS, DiT, DiTBlock
from ditforge.models.layers import Attention, PatchEmbed3D, patch_grid, sincos_1d, sincos_2d, sincos_3d
from ditforge.ops import frames_to_positions, gated_residual, layernorm_modulate, positions_to_frames
from ditforge.ops.attention import Packed


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

    Shapes: any (T, H, W) the patch divides (``DiT``'s variable shapes). An image is a 1-frame video; with a
    temporal patch t > 1 it is the frame repeated t times (one clip of T' = 1), and the prediction is the mean
    of the t output frames, (B, C_out, 1, H, W). The repeated frames of x_t are equal, so the mean is the
    model's one estimate for that frame, and its squared error against the frame's target is what the loss of
    a 1-frame sample measures (``data.packing`` applies the same rule to packed sequences). Other frame counts
    that t does not divide are an error.

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

    def _fixed_pos_embed(self, grid: Sequence[int] | None = None) -> torch.Tensor:
        """3-D sin-cos embedding over the (T', H', W') token grid ``grid`` (default: the configured one), float32
        (N, D)."""
        return sincos_3d(self.pos_embed.shape[-1], grid or self.x_embedder.grid_shape)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
                y_mask: torch.Tensor | None = None, packed: Packed | None = None,
                adaln: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``DiT.forward`` with x (B, C, T, H, W) -> (B, C_out, T, H, W); a 1-frame input under a temporal patch
        t > 1 runs as t copies of its frame and returns their mean (see the class docstring). Packed rows and
        ``adaln``: as ``DiT.forward``.

        Raises:
            ValueError: a size the patch does not divide (other than T = 1).
        """
        repeat = self.x_embedder.patch_shape[0]
        if packed is not None or x.shape[2] != 1 or repeat == 1:
            return super().forward(x, t, y, force_drop_ids, y_mask, packed, adaln)
        out = super().forward(x.expand(-1, -1, repeat, -1, -1), t, y, force_drop_ids, y_mask, adaln=adaln)
        return out.mean(2, keepdim=True)

    def forward_packed(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, packed: Packed,
                       force_drop_ids: torch.Tensor | None = None, y_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``DiT.forward_packed``, with the image rule: tokens of 1-frame samples (``packed.repeated``) hold
        the frame t times; their predictions become the mean of the t copies (repeated), as ``forward``'s."""
        out = super().forward_packed(x, t, y, packed, force_drop_ids, y_mask)  # (M, C_out, t h w)
        copies = out.unflatten(2, (self.x_embedder.patch_shape[0], -1))
        return torch.where(packed.repeated[:, None, None], copies.mean(2, keepdim=True).expand_as(copies).flatten(2),
                           out)


class STDiTBlock(DiTBlock):
    """DiT block with factorised spatial and temporal self-attention (Open-Sora v1.0's ``STDiTBlock``).

    Tokens (B, N, D) are in (T', S) row-major order, N = T' S (T' frames after patching, S = H' W' tokens per
    frame); S is fixed at construction and T' = N / S, so the call is DiT's ``block(x, c, context)`` and
    ``parallelize`` wraps these blocks as it wraps DiT's. Under sequence parallelism a process holds whole
    frames (T' local): the attention within frames is local, and ``ops.frames_to_positions`` /
    ``positions_to_frames`` (identities otherwise) exchange frames for token columns around the attention
    across frames. With DiT's per-block adaLN-Zero
    (``adaLN_modulation`` (B, D) -> six (B, D) chunks) instead of Open-Sora's shared table (Chen et al. 2023's):

        x = x + gate_msa * attn(modulate(LN(x), shift_msa, scale_msa))     attention within each frame, (B T', S, D)
        x = x + gate_msa * attn_temp(x [+ tpe])                             attention across frames, (B S, T', D)
        x = x + cross_attn(x, caption tokens)                               text-conditioned blocks only
        x = x + gate_mlp * mlp(modulate(LN(x), shift_mlp, scale_mlp))

    The temporal branch reads the un-normalised residual stream and is gated by ``gate_msa`` too, as Open-Sora's
    ``STDiTBlock.forward`` does (opensora/models/stdit/stdit.py); ``tpe`` is the temporal position embedding
    (1, T', D), which the model passes to its first block only. ``attn_temp`` is the same ``Attention`` class as
    ``attn`` (through the ``ditforge.ops.attention`` seam; ``qk_norm`` honoured). The gated residuals and
    LayerNorm + modulate are the ``ditforge.ops`` calls that fused kernels replace.

    Args:
        hidden_size, num_heads, mlp_ratio, cross_attention, qk_norm: as ``DiTBlock``.
        num_frames: T', frames of the configured token grid.
        num_spatial: S, tokens per frame of the configured grid; ``forward``'s ``spatial`` overrides it for
            inputs of another height or width.

    Raises:
        ValueError (forward): x does not have N = T' S tokens.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_frames: int, num_spatial: int, mlp_ratio: float = 4.0,
                 cross_attention: bool = False, qk_norm: bool = False):
        super().__init__(hidden_size, num_heads, mlp_ratio, cross_attention, qk_norm)
        self.num_frames, self.num_spatial = num_frames, num_spatial
        self.attn_temp = Attention(hidden_size, num_heads=num_heads, qkv_bias=True, qk_norm=qk_norm)

    def forward(self, x: torch.Tensor, c: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor] | None = None,
                tpe: torch.Tensor | None = None, spatial: int | None = None,
                mods: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, N, D) tokens, c: (B, D) conditioning, context: (caption tokens (B, L, D), mask (B, L) bool) for
        text-conditioned blocks, tpe: optional (1, T', D) added to the temporal attention's input, spatial: S,
        tokens per frame (default ``num_spatial``), mods: ``adaLN_modulation(c)`` computed beforehand, as
        ``DiTBlock``'s (c then unused) -> (B, N, D)."""
        B, N, D = x.shape
        S = spatial or self.num_spatial
        if N % S:  # N = T' S, or this process's whole frames under sequence parallelism
            raise ValueError(f"STDiT block built for {S} tokens per frame got {N} tokens")
        T = N // S
        mods = self.adaLN_modulation(c) if mods is None else mods
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods.chunk(6, dim=1)
        h = layernorm_modulate(x, shift_msa, scale_msa, NORM_EPS)
        h = self.attn(h.reshape(B * T, S, D)).reshape(B, N, D)  # each frame attends within itself
        x = gated_residual(x, h, gate_msa)
        h = frames_to_positions(x.reshape(B, T, S, D))  # (B, T', S_local, D): whole columns of positions
        Tf, Sl = h.shape[1], h.shape[2]
        h = h.transpose(1, 2).reshape(B * Sl, Tf, D)  # each position attends across frames
        if tpe is not None:
            h = h + tpe
        h = self.attn_temp(h).reshape(B, Sl, Tf, D).transpose(1, 2)
        h = positions_to_frames(h).reshape(B, N, D)
        x = gated_residual(x, h, gate_msa)
        if self.cross_attn is not None:
            x = x + self.cross_attn(x, *context)
        return gated_residual(x, self.mlp(layernorm_modulate(x, shift_mlp, scale_mlp, NORM_EPS)), gate_mlp)


class STDiT(DiT):
    """Spatial-temporal video DiT (STDiT of Open-Sora v1.0: report "Open-Sora: Democratizing Efficient Video
    Production for All", hpcaitech 2024; code https://github.com/hpcaitech/Open-Sora,
    ``opensora/models/stdit/stdit.py``), with DiT's per-block adaLN-Zero and class or text conditioning.

    ``forward(x, t, y, force_drop_ids=None, y_mask=None)`` exactly as ``DiT.forward``, with x (B, C, T, H, W)
    float -> (B, C_out, T, H, W) (C_out = 2C when ``learn_sigma``).

    Tokens: ``PatchEmbed3D`` with (1, p, p) patches (Conv3d weight (D, C, 1, p, p)), row-major (T, H', W')
    order, N = T S with S = H' W'. Every block (``STDiTBlock``) attends within each frame (S tokens), then
    across the T frames at each position, so the attention cost is T S^2 + S T^2 instead of vDiT's (T S)^2.
    Position embeddings, both fixed and both frozen parameters (``requires_grad=False``):

    * ``pos_embed`` (1, N, D): the 2-D sin-cos table of the spatial grid (``sincos_2d``, DiT's) repeated for
      every frame, added to the patch tokens as in DiT.
    * ``pos_embed_temporal`` (1, T, D): 1-D sin-cos of the frame index (``sincos_1d``), added to the temporal
      attention's input in the first block only, as Open-Sora v1.0 does (its ``space_scale`` / ``time_scale``
      are 1 here, which makes the spatial table DiT's). A parameter rather than a buffer, like ``pos_embed``:
      then both tables take the same path through the state dict, checkpoints, the EMA (which copies
      parameters only, so its state dict stays loadable with strict=True) and FSDP.

    Initialisation: DiT's ``initialize_weights``, plus zero ``attn_temp.proj`` weight and bias (Open-Sora's
    ``initialize_temporal``), so every temporal branch starts as the identity and a fresh STDiT loaded with an
    image DiT's weights (``inflate_image_state_dict``) computes that DiT frame by frame.

    FLOPs: ``flops_per_sample``.

    Shapes: any (T, H, W) the (t, p, p) patch divides, as ``DiT``: both tables are the stored ones at the
    configured grid and computed (cached) for another grid or frame count.

    Args:
        input_size: spatial size H = W, divisible by p.
        num_frames: T (latent frames), any positive count (divisible by t for a (t, p, p) patch).
        patch_size: p, or (t, p, p) (the registry's names use t = 1).
        depth, hidden_size, num_heads, mlp_ratio, text_dim, qk_norm, others: as ``DiT``.

    Raises:
        ValueError: a patch that is not p or (t, p, p), sizes not divisible by the patch, a width not divisible
            by ``num_heads``, or a width that is not a multiple of 4 (sin-cos tables).
    """

    def __init__(self, input_size: int = 32, num_frames: int = 16, patch_size: int | Sequence[int] = 2,
                 depth: int = 28, hidden_size: int = 1152, num_heads: int = 16, mlp_ratio: float = 4.0,
                 text_dim: int | None = None, qk_norm: bool = False, **dit_kwargs):
        patch = (1, patch_size, patch_size) if isinstance(patch_size, int) else tuple(int(p) for p in patch_size)
        if len(patch) != 3 or patch[1] != patch[2]:
            raise ValueError(f"STDiT patch size must be p or (t, p, p), got {patch_size}")
        # DiT builds no blocks (depth 0): the STDiT blocks are made below and the whole model initialised again.
        super().__init__(input_size=(num_frames, input_size, input_size), patch_size=patch, depth=0,
                         hidden_size=hidden_size, num_heads=num_heads, mlp_ratio=mlp_ratio, text_dim=text_dim,
                         qk_norm=qk_norm, **dit_kwargs)
        self.num_frames = num_frames
        frames, height, width = self.x_embedder.grid_shape
        self.pos_embed_temporal = nn.Parameter(torch.zeros(1, frames, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList([
            STDiTBlock(hidden_size, num_heads, frames, height * width, mlp_ratio, text_dim is not None, qk_norm)
            for _ in range(depth)
        ])
        if not self.pos_embed.is_meta:  # a meta build (create_model(device=)) initialises as it materialises
            self.initialize_weights()

    def _build_x_embedder(self, input_size, patch_size, in_channels: int, hidden_size: int) -> nn.Module:
        """``PatchEmbed3D`` over (T, H, W) with (t, p, p) patches."""
        return PatchEmbed3D(input_size, patch_size, in_channels, hidden_size, bias=True)

    def _fixed_pos_embed(self, grid: Sequence[int] | None = None) -> torch.Tensor:
        """DiT's 2-D sin-cos table of the (H', W') grid repeated for each of the T' frames of ``grid`` (default:
        the configured one), float32 (N, D)."""
        frames, height, width = grid or self.x_embedder.grid_shape
        return sincos_2d(self.pos_embed.shape[-1], (height, width)).repeat(frames, 1)

    def _fixed_temporal_pos_embed(self, frames: tuple[int] | None = None) -> torch.Tensor:
        """1-D sin-cos of the frame index 0..T'-1 (Open-Sora's ``get_1d_sincos_pos_embed``) for ``frames`` = (T',)
        (default: the configured T'), float32 (T', D)."""
        count = frames[0] if frames else self.x_embedder.grid_shape[0]
        return sincos_1d(self.pos_embed.shape[-1], torch.arange(count)).float()

    def _init_block(self, block: nn.Module) -> None:
        """DiT's adaLN-Zero, and a zero temporal output projection (Open-Sora)."""
        super()._init_block(block)
        nn.init.constant_(block.attn_temp.proj.weight, 0)
        nn.init.constant_(block.attn_temp.proj.bias, 0)

    def _init_tables(self) -> None:
        """DiT's sin-cos table and the temporal one."""
        super()._init_tables()
        if "pos_embed_temporal" in self._parameters:  # absent while DiT.__init__ runs
            self.pos_embed_temporal.data.copy_(self._fixed_temporal_pos_embed().unsqueeze(0))

    def forward_packed(self, *args, **kwargs) -> torch.Tensor:
        """Not supported: the attention across frames would need per-column documents of strided tokens.

        Raises:
            ValueError: always (the config refuses ``--pack_tokens`` with STDiT first).
        """
        raise ValueError("STDiT does not take packed sequences (--pack_tokens); use a DiT or vDiT")

    def flops_per_sample(self, text_tokens: int = 0, grid: Sequence[int] | None = None) -> int:
        """Forward FLOPs for one sample (a multiply-add counts 2), matrix products only, at token grid ``grid``
        (default: the configured (T', H', W')).

        ``DiT.flops_per_sample`` with, per block, the attention scores 4 T S^2 D (spatial) + 4 S T^2 D (temporal)
        instead of 4 N^2 D, plus the temporal qkv and output projections 8 N D^2 (N = T S tokens, T frames and S
        tokens per frame after patching, width D). So per block 32 N D^2 + 4 T S^2 D + 4 S T^2 D + 12 D^2, plus
        DiT's patch embedding, timestep MLP, final layer and (text models) cross-attention terms.
        STDiT-XL/2 at 16x32x32 latents (T = 16, S = 256, N = 4096, C = 4, C_out = 8, P = 4): 5,015,147,544,576
        ~ 5.02 TFLOP per sample forward; 16 frames of DiT-XL/2 are 3.80 TFLOP, the temporal attentions add 1.22
        (vDiT-XL/222 at the same latents: 2.37 TFLOP, for 2,048 tokens).
        """
        D, (T, height, width) = self.pos_embed.shape[-1], grid or self.x_embedder.grid_shape
        S = height * width
        N = T * S
        per_block = 4 * T * S * S * D + 4 * S * T * T * D + 8 * N * D * D - 4 * N * N * D
        return super().flops_per_sample(text_tokens, grid) + len(self.blocks) * per_block

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
        y_mask: torch.Tensor | None = None, adaln: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``DiT.forward`` (same arguments, ``adaln`` and dropout) with x (B, C, T, H, W) -> (B, C_out, T, H, W), any
        size the patch divides; the only difference is that the first block also gets the temporal position
        embedding.

        Raises:
            ValueError: a size the patch does not divide.
        """
        grid = patch_grid(x.shape[2:], self.x_embedder.patch_shape)
        tpe = self._fixed_table(self.pos_embed_temporal, grid[:1], self.x_embedder.grid_shape[:1],
                                self._fixed_temporal_pos_embed)
        x = self.x_embedder(x) + self.pos_embed_for(grid)
        c, context, mods = self._conditioning(t, y, force_drop_ids, y_mask, adaln)
        for i, (block, m) in enumerate(zip(self.blocks, mods)):
            x = block(x, c, context, tpe if i == 0 else None, grid[1] * grid[2], mods=m)
        return self.unpatchify(self.final_layer(x, c, mods=mods[-1]), grid)


def inflate_image_state_dict(image_state_dict: Mapping[str, torch.Tensor], model: STDiT) -> dict[str, torch.Tensor]:
    """Map an image DiT's weights onto an STDiT, as Open-Sora v1.0 initialises STDiT from Chen et al. 2023's image DiT.

    The result computes the image DiT frame by frame (every temporal branch is the identity) and trains from
    there. ``image_state_dict`` is in the official facebookresearch/DiT layout (class-conditioned) or ditforge's
    text-conditioned DiT layout, with the same width, depth, channels, classes (or text width), patch edge p
    and conditioning as ``model``; its input size may differ. Key by key:

    * ``x_embedder.proj.weight`` Conv2d (D, C, p, p) -> Conv3d (D, C, 1, p, p) (a one-frame kernel).
    * ``pos_embed`` recomputed for the STDiT's grid (``STDiT._fixed_pos_embed``: DiT's 2-D sin-cos table for each
      frame), whatever the image model's resolution; ``pos_embed_temporal`` the 1-D sin-cos table.
    * ``blocks.i.attn_temp.*``: ``qkv`` (and q/k norms) as ``model`` holds them (its initialisation), ``proj``
      weight and bias zero, so the temporal branch adds nothing.
    * everything else (embedders, spatial attention, cross-attention, MLP, adaLN, ``final_layer``: the patch
      volume 1 p p = p^2 and the token value order are the image model's) unchanged.

    Args:
        image_state_dict: tensor per key, any float dtype and device (not modified).
        model: the target STDiT (patch (1, p, p)); only read.

    Returns:
        A new state dict with exactly ``model``'s keys and shapes, for ``model.load_state_dict(sd, strict=True)``
        (image tensors keep their dtype and device; load_state_dict copies them into the model's).

    Raises:
        ValueError: a temporal patch t != 1, keys missing from or unexpected in the image state dict (e.g. another
            depth or conditioning), or a shape that does not match after the mapping.
    """
    if model.x_embedder.patch_shape[0] != 1:
        raise ValueError(f"inflation needs (1, p, p) patches; the STDiT has {model.x_embedder.patch_shape}")
    target = model.state_dict()
    new = {k for k in target if k == "pos_embed_temporal" or ".attn_temp." in k}
    missing = sorted(k for k in target if k not in new and k not in image_state_dict)
    unexpected = sorted(k for k in image_state_dict if k not in target)
    if missing or unexpected:
        raise ValueError(f"image state dict does not fit this STDiT: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]} ({len(missing)} and {len(unexpected)} keys)")
    out = {}
    for key, ref in target.items():
        if key == "pos_embed":
            value = model._fixed_pos_embed().unsqueeze(0)
        elif key == "pos_embed_temporal":
            value = model._fixed_temporal_pos_embed().unsqueeze(0)
        elif key.endswith(".attn_temp.proj.weight") or key.endswith(".attn_temp.proj.bias"):
            value = torch.zeros(ref.shape, dtype=ref.dtype)
        elif key in new:
            value = ref.detach().clone()
        elif key == "x_embedder.proj.weight":
            value = image_state_dict[key].unsqueeze(2)
        else:
            value = image_state_dict[key]
        if tuple(value.shape) != tuple(ref.shape):
            raise ValueError(f"image state dict: {key} has shape {tuple(value.shape)} after inflation, the STDiT "
                             f"needs {tuple(ref.shape)}")
        out[key] = value
    return out
