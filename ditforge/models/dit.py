"""DiT: Diffusion Transformer with adaLN-Zero blocks (Peebles & Xie, "Scalable Diffusion Models with
Transformers", ICCV 2023).

Parameter names, shapes and initialisation equal facebookresearch/DiT ``models.py``, so official checkpoints
(e.g. DiT-XL-2-256x256.pt) load with ``strict=True`` and give the same outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ditforge.models.layers import (
    Attention,
    CaptionEmbedder,
    CrossAttention,
    LabelEmbedder,
    Mlp,
    PatchEmbed,
    TimestepEmbedder,
    patch_grid,
    sincos_2d,
    unpatchify,
)
from ditforge.ops import GatedSum, gated_residual, layernorm_modulate, residual_layernorm_modulate
from ditforge.ops.attention import Packed

NORM_EPS = 1e-6  # LayerNorm epsilon of the reference code


def modulation(layer: nn.Module, c: torch.Tensor, packed: Packed | None) -> torch.Tensor:
    """adaLN parameters ``layer(c)`` (B, k D), one row per sample; for packed rows gathered to every token,
    (R, L, k D), after the regression (computed once per sample, not once per token)."""
    mods = layer(c)
    return mods if packed is None else mods[packed.sample]


class DiTBlock(nn.Module):
    """adaLN-Zero transformer block (paper section 3.2, figure 3).

    The conditioning vector c regresses shift/scale/gate for the attention and MLP branches;
    ``x = x + gate_msa * attn(modulate(LN(x), shift_msa, scale_msa))``, likewise for the MLP.
    The regression layer is zero-initialised, so every block starts as the identity. The LayerNorms have no
    parameters (as in the reference), so they are calls of ``ops.layernorm_modulate``, which fused kernels can
    replace, not modules. Each names the layer its output goes to (``into``), so that a float8 layer gets its
    input quantized by the same pass.

    ``cross_attention``: text-conditioned blocks add ``x = x + cross_attn(x, caption tokens)`` between the
    self-attention and the MLP, without modulation, as Chen et al. 2023's blocks do. ``qk_norm``: see ``Attention``.
    """

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0, cross_attention: bool = False,
                 qk_norm: bool = False):
        super().__init__()
        self.attn = Attention(hidden_size, num_heads=num_heads, qkv_bias=True, qk_norm=qk_norm)
        self.cross_attn = CrossAttention(hidden_size, num_heads, qk_norm) if cross_attention else None
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    def forward(self, x: torch.Tensor, c: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor] | None = None, packed: Packed | None = None,
                mods: torch.Tensor | None = None) -> torch.Tensor | GatedSum:
        """x: (B, N, D) tokens (or the previous block's ``GatedSum``), c: (B, D) conditioning, context: (caption
        tokens (B, L, D), mask (B, L) bool) for text-conditioned blocks -> (B, N, D); at inference (grad mode off)
        a ``GatedSum`` of (B, N, D) tensors instead, whose MLP residual the next LayerNorm sums (the next block's,
        or ``FinalLayer``'s). Packed rows (``packed``): x (R, L, D), c (S, D) per sample,
        context as ``CrossAttention`` takes packed rows. ``mods``: this block's adaLN output ``adaLN_modulation(c)``
        (B, 6D) computed beforehand (``DiT.adaln_tables``), used instead of regressing it from c here (c is then
        unused, and may be None)."""
        if mods is None:
            mods = modulation(self.adaLN_modulation, c, packed)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods.chunk(6, dim=-1)
        x, h = residual_layernorm_modulate(x, shift_msa, scale_msa, NORM_EPS, into=self.attn.qkv)
        y = self.attn(h, packed)
        if self.cross_attn is None:
            x, h = residual_layernorm_modulate(GatedSum(x, y, gate_msa), shift_mlp, scale_mlp, NORM_EPS,
                                               into=self.mlp.fc1)
        else:
            x = gated_residual(x, y, gate_msa)
            x = x + self.cross_attn(x, *context)
            h = layernorm_modulate(x, shift_mlp, scale_mlp, NORM_EPS, into=self.mlp.fc1)
        out = GatedSum(x, self.mlp(h), gate_mlp)
        # Under autograd the sum is done here: gradient checkpointing keeps a block's input, which as a GatedSum
        # would hold y as well as x.
        return gated_residual(*out) if torch.is_grad_enabled() else out


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm then a linear map to P*C_out values per token; (B, N, D) -> (B, N, P*C_out).

    ``patch_size`` is the official square patch edge p (P = p*p), or a sequence of patch edges such as (p, p) or
    a video patch (t, h, w), whose product is the patch volume P.
    """

    def __init__(self, hidden_size: int, patch_size: int | Sequence[int], out_channels: int):
        super().__init__()
        volume = patch_size * patch_size if isinstance(patch_size, int) else math.prod(patch_size)
        self.linear = nn.Linear(hidden_size, volume * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x: torch.Tensor, c: torch.Tensor, packed: Packed | None = None,
                mods: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, N, D) tokens or the last block's ``GatedSum``. ``mods``: ``adaLN_modulation(c)`` (B, 2D) computed
        beforehand, as ``DiTBlock``'s (c then unused)."""
        shift, scale = (modulation(self.adaLN_modulation, c, packed) if mods is None else mods).chunk(2, dim=-1)
        return self.linear(residual_layernorm_modulate(x, shift, scale, NORM_EPS)[1])


class DiT(nn.Module):
    """Class-conditional Diffusion Transformer.

    Subclasses for other inputs (``ditforge.models.video.VideoDiT``) override the two hooks
    ``_build_x_embedder`` (patch embedding: its ``num_patches``, ``grid_shape`` and ``patch_shape`` drive the
    position embedding, final layer, ``unpatchify`` and ``flops_per_sample``) and ``_fixed_pos_embed``; the
    blocks, conditioning, initialisation, forward and FLOP count are shared, written once here.

    Variable shapes: ``forward`` takes any input size the patch divides, not only ``input_size``. The token grid
    is the input's; its sin-cos positions are the stored ``pos_embed`` at the configured grid (so outputs there
    are those of the official layout, whatever a checkpoint stored) and are computed for any other grid
    (``pos_embed_for``, cached per grid, device and dtype); every other weight is independent of the grid.

    Args:
        input_size: spatial size H = W of the input (latent or pixel), divisible by ``patch_size`` (passed as is
            to ``_build_x_embedder``; VideoDiT passes (T, H, W)).
        patch_size: patch edge p; the sequence has (H/p)^2 tokens.
        in_channels: C of the input.
        hidden_size, depth, num_heads, mlp_ratio: transformer width, number of blocks, heads, MLP ratio.
        class_dropout_prob: label (or caption) dropout for classifier-free guidance; > 0 adds the null label row.
        num_classes: number of classes; label ``num_classes`` is the null (unconditional) label.
        learn_sigma: predict the variance too, so C_out = 2 C (Nichol & Dhariwal 2021).
        text_dim: None for class conditioning (the paper's DiT, official layout); the width D_text of text-encoder
            states for text conditioning (Chen et al. 2023's style: ``y_embedder`` is a ``CaptionEmbedder``, every
            block cross-attends to the caption tokens; c is the timestep embedding plus the masked mean of the
            caption tokens, a pooled text vector in adaLN as Esser et al. 2024 (section 3.1) and Li et al. 2024
            use; Chen et al. 2023 has none: on the built-in clips, a vDiT-T without it had not learned to follow
            the captions after 1,000 steps, with it the samples matched their captions under every sampler and seed
            tried after 1,000 (after 500, under some).
        qk_norm: LayerNorm on queries and keys in every attention (adds ``q_norm``/``k_norm`` parameters).
    """

    def __init__(
        self,
        input_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
        text_dim: int | None = None,
        qk_norm: bool = False,
    ):
        super().__init__()
        self.learn_sigma = learn_sigma
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.num_classes = num_classes

        self.x_embedder = self._build_x_embedder(input_size, patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.text_dim = text_dim
        if text_dim is None:
            self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        else:
            self.y_embedder = CaptionEmbedder(text_dim, hidden_size, class_dropout_prob)
        num_patches = self.x_embedder.num_patches
        # Fixed sin-cos embedding, kept as a frozen parameter (not a buffer) to match the official state dict.
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, hidden_size), requires_grad=False)
        self._pos_cache: dict[tuple, torch.Tensor] = {}  # other grids' tables: (name, grid, device, dtype) -> table
        self.blocks = nn.ModuleList([DiTBlock(hidden_size, num_heads, mlp_ratio, text_dim is not None, qk_norm)
                                     for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, self.x_embedder.patch_shape, self.out_channels)
        if not self.pos_embed.is_meta:  # a meta build (create_model(device=)) initialises as it materialises
            self.initialize_weights()

    def _build_x_embedder(self, input_size, patch_size, in_channels: int, hidden_size: int) -> nn.Module:
        """The patch embedding (hook): ``PatchEmbed``, a Conv2d of kernel = stride = p."""
        return PatchEmbed(input_size, patch_size, in_channels, hidden_size, bias=True)

    def _fixed_pos_embed(self, grid: Sequence[int] | None = None) -> torch.Tensor:
        """The fixed position embedding (hook) of token grid ``grid`` (default: the configured one): 2-D sin-cos
        of MAE / DiT, float32 (N, D)."""
        return sincos_2d(self.pos_embed.shape[-1], grid or self.x_embedder.grid_shape)

    def _fixed_table(self, param: nn.Parameter, grid: tuple[int, ...], stored_grid: tuple[int, ...],
                    compute) -> torch.Tensor:
        """A fixed (frozen) position table for token grid ``grid``: ``param`` itself where ``grid`` is the grid it
        was made for, ``stored_grid``; otherwise ``compute(grid)`` (float32 (N, D)) as (1, N, D) in ``param``'s
        device and dtype, computed once per (table, grid, device, dtype)."""
        if grid == stored_grid:
            return param
        key = (compute.__name__, grid, param.device, param.dtype)
        if key not in self._pos_cache:
            self._pos_cache[key] = compute(grid).to(param.device, param.dtype).unsqueeze(0)
        return self._pos_cache[key]

    def pos_embed_for(self, grid: Sequence[int]) -> torch.Tensor:
        """(1, N, D) position embedding of token grid ``grid`` ((H', W'); (T', H', W') for video models): the
        stored ``pos_embed`` at the configured grid, else ``_fixed_pos_embed(grid)`` (cached)."""
        return self._fixed_table(self.pos_embed, tuple(grid), tuple(self.x_embedder.grid_shape), self._fixed_pos_embed)

    def initialize_weights(self, device: torch.device | str | None = None,
                           block_ready: Callable[[nn.Module], None] | None = None) -> None:
        """Initialise every parameter as the reference code does (facebookresearch/DiT ``initialize_weights``):
        xavier-uniform linears with zero biases, N(0, 0.02) embedders, the fixed sin-cos tables, and adaLN-Zero
        (zero modulation regressions, cross-attention outputs and final layer). Affine LayerNorms (``qk_norm``)
        get ones and zeros; a text model's null caption N(0, 1 / D_text) when materialised (its constructor draws it
        otherwise).

        Built on the meta device (``create_model(..., device=)``), ``device`` materialises the model as it goes
        (torchtitan's ``to_empty`` + ``init_weights``): the parameters outside the blocks first (embedders and
        final layer, small), then one block at a time, each passed to ``block_ready`` once initialised (e.g. to
        cast it to bf16 before the next block exists). So a model never is whole in fp32, nor ever in host
        memory when ``device`` is a GPU. The random draws come in the same order either way: a meta build
        materialised on the CPU equals this method run on an ordinary model after the same seed, bit for bit.
        """

        def _basic_init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)
            elif isinstance(module, nn.LayerNorm) and module.elementwise_affine:
                module.reset_parameters()

        if device is not None:  # everything but the blocks: embedders, final layer, position tables
            self.to_empty(device=device, recurse=False)
            for name, child in self.named_children():
                if name != "blocks":
                    child.to_empty(device=device)
        for name, child in self.named_children():  # the reference's self.apply(_basic_init), in module order
            if name != "blocks":
                child.apply(_basic_init)
                continue
            for block in child:
                if device is not None:
                    block.to_empty(device=device)
                block.apply(_basic_init)
                self._init_block(block)
                if block_ready is not None:
                    block_ready(block)
        self._init_tables()
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        nn.init.constant_(self.x_embedder.proj.bias, 0)
        if self.text_dim is None:
            nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        else:  # Chen et al. 2023: N(0, 0.02) caption projection; zero cross-attention output: blocks start as identity
            nn.init.normal_(self.y_embedder.y_proj.fc1.weight, std=0.02)
            nn.init.normal_(self.y_embedder.y_proj.fc2.weight, std=0.02)
            if device is not None:  # materialised: its constructor's draw was on the meta device
                nn.init.normal_(self.y_embedder.null_caption, std=self.text_dim**-0.5)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].weight, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.linear.weight, 0)
        nn.init.constant_(self.final_layer.linear.bias, 0)

    def _init_block(self, block: nn.Module) -> None:
        """adaLN-Zero for one block (hook): zero modulation regression and cross-attention output, so the block
        starts as the identity."""
        nn.init.constant_(block.adaLN_modulation[-1].weight, 0)
        nn.init.constant_(block.adaLN_modulation[-1].bias, 0)
        if block.cross_attn is not None:
            nn.init.constant_(block.cross_attn.proj.weight, 0)
            nn.init.constant_(block.cross_attn.proj.bias, 0)

    def _init_tables(self) -> None:
        """The fixed position tables (hook): the sin-cos ``pos_embed``."""
        self.pos_embed.data.copy_(self._fixed_pos_embed().unsqueeze(0))

    def flops_per_sample(self, text_tokens: int = 0, grid: Sequence[int] | None = None) -> int:
        """Forward FLOPs for one sample (a multiply-add counts 2), matrix products only, at token grid ``grid``
        (default: the configured one; e.g. (H/p, W/p), or (T/t, H/h, W/w) for a video model).

        Text models add, for L = ``text_tokens`` caption tokens of width D_t: per block 4 N D^2 (q, output
        projections) + 4 L D^2 (k, v) + 4 N L D (cross-attention), and 2 L (D_t D + D^2) for the caption projection.

        With N tokens, width D, patch volume P (p*p, or t*h*w for VideoDiT), C in / C_out out channels:
        per block 24 N D^2 (qkv, proj, 4x MLP) + 4 N^2 D (q k^T and attention x v) + 12 D^2 (adaLN);
        patch embedding 2 N P C D; timestep MLP 2 (256 D + D^2); final layer 2 N D P C_out + 4 D^2 (its adaLN).
        DiT-XL/2 at 32x32 latents (N = 256): ~237 GFLOP (the paper's 118.6 "Gflops" counts multiply-adds once).
        vDiT-XL/222 at 16x32x32 latents (N = 8 * 16 * 16 = 2048): 2,368,508,166,144 ~ 2.37 TFLOP (10x DiT-XL/2
        for 8x the tokens: the attention term grows with N^2).
        Training is ~3x the forward.
        """
        D, N = self.pos_embed.shape[-1], math.prod(grid or self.x_embedder.grid_shape)
        P, C = math.prod(self.x_embedder.patch_shape), self.in_channels
        block = 24 * N * D * D + 4 * N * N * D + 12 * D * D
        embed = 2 * N * P * C * D + 2 * (self.t_embedder.frequency_embedding_size * D + D * D)
        final = 2 * N * D * P * self.out_channels + 4 * D * D
        if self.text_dim is not None:
            L = text_tokens
            block += 4 * N * D * D + 4 * L * D * D + 4 * N * L * D
            embed += 2 * L * (self.text_dim * D + D * D)
        return len(self.blocks) * block + embed + final

    def unpatchify(self, x: torch.Tensor, grid: Sequence[int] | None = None) -> torch.Tensor:
        """(B, N, P*C_out) -> (B, C_out, H, W) (VideoDiT: (B, C_out, T, H, W)) for token grid ``grid`` (default:
        the configured one); inverse of the patch embedding's token order (``layers.unpatchify``). Raises
        ValueError for tokens of another grid or width."""
        return unpatchify(x, grid or self.x_embedder.grid_shape, self.x_embedder.patch_shape, self.out_channels)

    def embed_conditions(
        self, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
        y_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The conditioning vector c and the cross-attention context (dropout as in ``forward``).

        Class models: c = timestep embedding + label embedding (B, D), context None. Text models: c = timestep
        embedding + the masked mean of the caption tokens (B, D), context = (caption tokens (B, L, D), mask
        (B, L) bool) from ``CaptionEmbedder``.
        """
        label, context = self._embed_labels(y, force_drop_ids, y_mask)
        return self.t_embedder(t) + label, context

    def _embed_labels(
        self, y: torch.Tensor, force_drop_ids: torch.Tensor | None, y_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``embed_conditions`` without the timestep: the label embedding, or the pooled caption (B, D), and the
        context."""
        if self.text_dim is None:
            return self.y_embedder(y, self.training, force_drop_ids), None
        if y_mask is None:
            raise ValueError("text-conditioned DiT needs y_mask, the (B, L) bool mask of the caption tokens")
        tokens, mask = self.y_embedder(y, y_mask, self.training, force_drop_ids)
        w = mask.to(tokens.dtype)[..., None]
        return (tokens * w).sum(1) / w.sum(1).clamp_min(1), (tokens, mask)

    def _conditioning(
        self, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None, y_mask: torch.Tensor | None,
        adaln: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None, list[torch.Tensor | None]]:
        """What one forward conditions its layers on: c, the context (``embed_conditions``) and per layer (blocks,
        then the final layer) its adaLN output from ``adaln`` or None (the layer regresses it from c). With
        ``adaln`` every regression of c is given, so c is not computed (None); a text model's context still is.

        Raises:
            ValueError: ``adaln`` not one tensor per block plus the final layer's.
        """
        depth = len(self.blocks)
        if adaln is None:
            return (*self.embed_conditions(t, y, force_drop_ids, y_mask), [None] * (depth + 1))
        if len(adaln) != depth + 1:
            raise ValueError(f"adaln: expected {depth + 1} tensors (one per block, then the final layer's), "
                             f"got {len(adaln)}")
        context = None if self.text_dim is None else self._embed_labels(y, force_drop_ids, y_mask)[1]
        return None, context, adaln

    @torch.no_grad()
    def adaln_tables(
        self, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
        y_mask: torch.Tensor | None = None, max_bytes: int | None = None,
    ) -> list[torch.Tensor] | None:
        """Every adaLN regression of S model calls at once, for a sampling loop that knows its timesteps up front:
        per block ``adaLN_modulation(c)`` and last the final layer's, each (S, B, k D) in the model's dtype, where
        c is ``embed_conditions(t[s], y, force_drop_ids, y_mask)`` of call s. ``forward(..., adaln=[table[s] for
        table in tables])`` then equals call s of the plain forward (up to the float rounding of a matrix product
        over S B rows instead of B). One product per layer over S B rows reads each regression's weights once
        instead of S times: DiT-XL/2's 28 blocks hold 446 MB of them in bf16, read at every step of a plain loop.

        Args:
            t: (S, B) timesteps, row s those of call s; y, force_drop_ids, y_mask: as ``forward``'s, one per row.
            max_bytes: the most memory the tables may take; None: no limit.

        Returns:
            ``len(blocks) + 1`` tensors: (S, B, 6D) per block, then (S, B, 2D); None if they would take more than
            ``max_bytes``.
        """
        S, B = t.shape
        layers = [block.adaLN_modulation for block in self.blocks] + [self.final_layer.adaLN_modulation]
        weights = [layer[-1].weight for layer in layers]
        if max_bytes is not None and S * B * sum(w.shape[0] * w.element_size() for w in weights) > max_bytes:
            return None
        label, _ = self._embed_labels(y, force_drop_ids, y_mask)
        c = (self.t_embedder(t.flatten()).unflatten(0, (S, B)) + label).flatten(0, 1)
        return [layer(c).unflatten(0, (S, B)) for layer in layers]

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
        y_mask: torch.Tensor | None = None, packed: Packed | None = None, adaln: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Predict noise (and the variance interpolation when ``learn_sigma``).

        With ``packed`` (samples of any shapes packed into rows, ``data.packing.pack``) x is patch values and
        the result too: see ``forward_packed``. ``adaln``: this call's adaLN outputs, per block and then the final
        layer's ((B, 6D) ... (B, 2D), e.g. one step of ``adaln_tables``), instead of computing them from t and y.

        Args:
            x: (B, C, H, W) noisy input; (B, C, T, H, W) for VideoDiT; any size the patch divides.
            t: (B,) int64 diffusion timesteps.
            y: (B,) int64 class labels (``num_classes`` is the null label); for text models the text-encoder
                states (B, L, D_text).
            force_drop_ids: optional (B,) bool, labels (captions) to replace by the null label (caption) (dropout
                decided outside the model, e.g. from a per-step generator); otherwise dropout draws its own coins
                in training mode.
            y_mask: (B, L) bool, the real caption tokens (text models only).

        Returns:
            (B, C_out, H, W) ((B, C_out, T, H, W) for VideoDiT), C_out = 2C when ``learn_sigma`` (first C:
            epsilon, last C: variance values).

        Raises:
            ValueError: an input size the patch does not divide.
        """
        if packed is not None:
            if adaln is not None:
                raise ValueError("adaln tables are for unpacked rows")
            return self.forward_packed(x, t, y, packed, force_drop_ids, y_mask)
        x, c, mods, grid = self._blocks(x, t, y, force_drop_ids, y_mask, adaln, len(self.blocks))
        return self.unpatchify(self.final_layer(x, c, mods=mods[-1]), grid)

    def features(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, depth: int,
                 force_drop_ids: torch.Tensor | None = None, y_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens (B, N, D) after the first ``depth`` blocks (1..depth of the model), in the blocks' dtype: the
        intermediate features a discriminator head reads (DMD2's ``return_bottleneck``, Yin et al. 2024 sec. 4.3).
        Arguments as ``forward``'s (unpacked rows)."""
        x = self._blocks(x, t, y, force_drop_ids, y_mask, None, depth)[0]
        return gated_residual(*x) if isinstance(x, GatedSum) else x

    def _blocks(self, x, t, y, force_drop_ids, y_mask, adaln, depth: int):
        """(the tokens after the first ``depth`` blocks (a tensor or a pending ``GatedSum``), c, the adaLN outputs,
        the token grid) of ``forward``'s unpacked path."""
        grid = patch_grid(x.shape[2:], self.x_embedder.patch_shape)
        x = self.x_embedder(x) + self.pos_embed_for(grid)
        c, context, mods = self._conditioning(t, y, force_drop_ids, y_mask, adaln)
        for block, m in zip(self.blocks[:depth], mods):
            x = block(x, c, context, mods=m)
        return x, c, mods, grid

    def forward_packed(
        self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, packed: Packed,
        force_drop_ids: torch.Tensor | None = None, y_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward`` of S samples of any shapes packed into rows (call it through ``forward(..., packed=)`` so
        that wrappers' hooks run): per sample, the same output as ``forward`` on that sample alone (up to float
        rounding; tested).

        The patch embedding is its convolution as a matrix product on each token's patch values; positions are
        each sample's own grid's (``pos_embed_for``); timestep and condition embeddings and every adaLN
        regression are per sample, gathered to their tokens; self-attention is block-diagonal
        (``ops.packed_attention``); text models: each sample's queries attend to its own caption only.

        Args:
            x: (M, C, P) patch values of the M real tokens (``data.packing.patchify``: per token its C channels
                times the P = prod(patch) values of its patch, in (t, h, w) order), sample by sample.
            t: (S,) timesteps; y: (S,) labels, or (S, L, D_text) caption states with ``y_mask`` (S, L) bool.
            packed: the layout (``ops.attention.Packed``).
            force_drop_ids: optional (S,) bool.

        Returns:
            (M, C_out, P), the tokens' predictions in the layout of ``x``.
        """
        w = self.x_embedder.proj.weight
        tokens = F.linear(x.flatten(1).to(w.dtype), w.flatten(1), self.x_embedder.proj.bias)  # (M, D)
        tokens = tokens + torch.cat([self.pos_embed_for(g)[0] for g in packed.grids])
        h = tokens.new_zeros(packed.rows * packed.length, tokens.shape[1]).index_copy(0, packed.index, tokens)
        h = h.view(packed.rows, packed.length, -1)
        c, context = self.embed_conditions(t, y, force_drop_ids, y_mask)
        if context is not None:  # all captions end to end; a sample's tokens see its own (padding sees all)
            caption, mask = context
            owner = torch.arange(len(caption), device=mask.device).repeat_interleave(caption.shape[1])
            mine = (packed.sample[..., None] == owner) | ~packed.valid[..., None]
            context = caption.reshape(1, -1, caption.shape[-1]), mine & mask.reshape(-1)
        for block in self.blocks:
            h = block(h, c, context, packed)
        out = self.final_layer(h, c, packed).flatten(0, 1)[packed.index]  # (M, P * C_out), (P, C_out) order
        return out.unflatten(1, (-1, self.out_channels)).transpose(1, 2)
