"""A video VAE's decode split over processes, equal to one process's decode.

**Patch parallelism** (``split_decoder``; the default under torchrun): every call of the VAE's ``decoder`` module
(a whole clip, one latent frame of diffusers' causal loop, or one tile of its ``tiled_decode``) is cut into
horizontal bands of latent rows, one a process, and each process runs the decoder on its band:

- a convolution with a kernel of k rows first receives (k - 1) / 2 rows of each neighbour's band (a halo
  exchange; the frame's own top and bottom keep the layer's padding), and gives back only its band's rows;
- a group norm normalises with the statistics of all bands together (two all-reduces: the sum, then the squared
  deviations from the joint mean);
- a module that sees the whole frame (the VAE's attention) runs on the bands gathered, and each keeps its rows;
- the decoder's output bands are gathered, so diffusers' own code around the decoder (the per-frame loop, tile
  blending, clamping) runs on the whole on every process.

Every output pixel is then the same arithmetic as in one process's decode (the convolutions see the same inputs; only
the order of the sums in a convolution of another shape, and in the group norms' reductions, can differ), so the
frames agree to one uint8 level for any number of processes, tiled (``--vae_tile``) or not. This is xDiT's DistVAE
(Fang et al. 2024, "xDiT: an Inference Engine for Diffusion Transformers (DiTs) with Massive Parallelism",
arXiv 2411.01738, Sec. 4.4: patch-parallel convolutions with halo exchange and a distributed group norm), on the
module tree of diffusers' VAEs. The family's adapter names the modules that need more than that rule
(``vae_halo_modules``: a layer that pads its own input before an unpadded convolution; ``vae_whole_modules``);
a decoder with anything the rule cannot split exactly (a strided or transposed convolution, an undeclared attention
or pre-padded convolution, spatial noise) is refused (``NotSplittable``) and decoded whole.

**Column strips** (``use_strips`` + ``decode_tiles_split``, opt-in: ``--vae_split strips``): one tile per process,
no exchange during the decode, blended by diffusers' ``tiled_decode`` over ``STRIP_OVERLAP`` pixels. Approximate:
the blend of two strips is not the whole-frame decode (up to tens of uint8 levels on random weights).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


class NotSplittable(Exception):
    """The decoder holds a layer that the row split cannot compute exactly (the message names it)."""


@dataclass
class _Bands:
    """The row split of one decoder call: ``rows[p]`` latent rows for process p, ``rank`` this process's index in
    ``group``; ``active`` is False while a whole module runs on the gathered bands (its layers then run plainly)."""

    group: object
    rank: int
    world: int
    rows: list[int] = field(default_factory=list)
    active: bool = False

    def scale(self, x: torch.Tensor) -> int:
        """This band's rows in ``x`` (dim -2) per latent row: the decoder's upsampling so far."""
        s, rest = divmod(x.shape[-2], self.rows[self.rank])
        if rest:
            raise RuntimeError(f"a band of {x.shape[-2]} rows is no multiple of its {self.rows[self.rank]} latent rows")
        return s

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every process's band of ``x`` (..., rows, W), concatenated along dim -2 in process order."""
        s = self.scale(x)
        sizes = [r * s for r in self.rows]
        padded = torch.zeros(*x.shape[:-2], max(sizes), x.shape[-1], dtype=x.dtype, device=x.device)
        padded[..., :x.shape[-2], :] = x
        bufs = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(bufs, padded.contiguous(), group=self.group)
        return torch.cat([b[..., :n, :] for b, n in zip(bufs, sizes)], dim=-2)

    def mine(self, full: torch.Tensor) -> torch.Tensor:
        """This process's band of the whole ``full`` (..., sum(rows) x s, W)."""
        s, rest = divmod(full.shape[-2], sum(self.rows))
        if rest:
            raise RuntimeError(f"{full.shape[-2]} rows are no multiple of the {sum(self.rows)} latent rows")
        start = sum(self.rows[:self.rank]) * s
        return full[..., start:start + self.rows[self.rank] * s, :]

    def with_halo(self, tensors: list[torch.Tensor], h: int) -> list[torch.Tensor]:
        """Each of ``tensors`` (..., rows, W) with ``h`` rows of the band above prepended and of the band below
        appended (none at the frame's top and bottom): one all-gather of every process's edge rows."""
        edges = torch.cat([torch.cat([t[..., :h, :], t[..., -h:, :]], dim=-2).reshape(-1) for t in tensors])
        bufs = [torch.empty_like(edges) for _ in range(self.world)]
        dist.all_gather(bufs, edges, group=self.group)
        out, offset = [], 0
        for t in tensors:
            shape = (*t.shape[:-2], 2 * h, t.shape[-1])
            n = int(np.prod(shape))
            parts = [t]
            if self.rank > 0:  # the last h rows of the band above
                parts.insert(0, bufs[self.rank - 1][offset:offset + n].view(shape)[..., h:, :])
            if self.rank < self.world - 1:  # the first h rows of the band below
                parts.append(bufs[self.rank + 1][offset:offset + n].view(shape)[..., :h, :])
            out.append(torch.cat(parts, dim=-2))
            offset += n
        return out

    def crop(self, y: torch.Tensor, h: int) -> torch.Tensor:
        """``y`` computed on a band with its halo (``with_halo``) -> the rows of the band itself."""
        top = h if self.rank > 0 else 0
        bottom = h if self.rank < self.world - 1 else 0
        return y[..., top:y.shape[-2] - bottom, :]


def _first_conv(module: nn.Module) -> nn.modules.conv._ConvNd | None:
    return next((m for m in module.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)


def _halo_rows(conv: nn.modules.conv._ConvNd, where: str, padded: bool) -> int:
    """The rows of each neighbour a convolution needs: dilation x (k - 1) / 2 for k rows of kernel and stride 1.
    ``padded``: the convolution pads its rows itself (its ``padding`` must then be the same-size padding).

    Raises:
        NotSplittable: a transposed or row-strided convolution, an even kernel, or one whose rows are padded by
            a layer the adapter does not name (``vae_halo_modules``).
    """
    if conv.transposed or len(conv.kernel_size) < 2:
        raise NotSplittable(f"{where}: a transposed or 1-D convolution")
    k, stride, dilation = conv.kernel_size[-2], conv.stride[-2], conv.dilation[-2]
    if k == 1 and stride == 1:
        return 0
    if stride != 1 or k % 2 == 0:
        raise NotSplittable(f"{where}: a convolution of {k} rows at stride {stride}")
    h = dilation * (k - 1) // 2
    if padded and (isinstance(conv.padding, str) or conv.padding[-2] != h):
        raise NotSplittable(f"{where}: a convolution of {k} rows padded by {conv.padding}, not {h} (a layer around "
                            "it pads its rows: the adapter's vae_halo_modules)")
    return h


def plan(decoder: nn.Module, halo: tuple[str, ...] = (),
         whole: tuple[str, ...] = ()) -> list[tuple[nn.Module, str, int]]:
    """The decoder's layers the row split changes: (module, "halo" | "norm" | "whole", halo rows), in module
    order. ``halo``, ``whole``: class names the family's adapter declares (``vae_halo_modules``,
    ``vae_whole_modules``); below a named module nothing else is changed.

    Raises:
        NotSplittable: naming the first layer the split cannot compute exactly.
    """
    found: list[tuple[nn.Module, str, int]] = []

    def visit(module: nn.Module, where: str) -> None:
        name = type(module).__name__
        if name in whole:
            found.append((module, "whole", 0))
            return
        if name in halo or isinstance(module, nn.modules.conv._ConvNd):
            conv = _first_conv(module)
            h = _halo_rows(conv, f"{where} ({name})", padded=name not in halo) if conv is not None else 0
            if h:
                found.append((module, "halo", h))
            return
        if isinstance(module, nn.GroupNorm):
            found.append((module, "norm", 0))
        elif "attention" in name.lower() or getattr(module, "per_channel_scale1", None) is not None:
            raise NotSplittable(f"{where} ({name}): attention or spatial noise the adapter does not name")
        for child_name, child in module.named_children():
            visit(child, f"{where}.{child_name}" if where else child_name)

    visit(decoder, "decoder")
    return found


def _group_norm(norm: nn.GroupNorm, x: torch.Tensor, bands: _Bands) -> torch.Tensor:
    """``norm(x)`` of the whole frame, on this process's band: the mean and variance of each group over all bands
    (float32, the sums in float64), as ``torch.nn.functional.group_norm`` computes them on the whole."""
    b, c = x.shape[:2]
    xf = x.float().reshape(b, norm.num_groups, -1)
    count = xf.shape[-1] // x.shape[-2] * sum(bands.rows) * bands.scale(x)
    total = xf.sum(-1, dtype=torch.float64)
    dist.all_reduce(total, group=bands.group)
    mean = (total / count).float()[..., None]
    centred = xf - mean
    squares = centred.square().sum(-1, dtype=torch.float64)
    dist.all_reduce(squares, group=bands.group)
    y = (centred * torch.rsqrt((squares / count).float()[..., None] + norm.eps)).reshape(x.shape)
    if norm.affine:
        view = (1, c) + (1,) * (x.ndim - 2)
        y = y * norm.weight.float().view(view) + norm.bias.float().view(view)
    return y.to(x.dtype)


def _wrap(module: nn.Module, kind: str, h: int, bands: _Bands):
    """The replacement ``forward`` of a planned layer (plain while ``bands.active`` is False)."""
    original = module.forward

    def forward(x, *args, **kwargs):
        if not bands.active:
            return original(x, *args, **kwargs)
        if kind == "norm":
            return _group_norm(module, x, bands)
        if kind == "whole":
            bands.active = False
            try:
                return bands.mine(original(bands.gather(x), *args, **kwargs))
            finally:
                bands.active = True
        # halo: the input and any tensor of its rows among the arguments (a causal convolution's cached frames)
        rows = x.shape[-2]
        same = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.ndim == x.ndim and a.shape[-2] == rows]
        x, *extended = bands.with_halo([x, *(args[i] for i in same)], h)
        args = list(args)
        for i, a in zip(same, extended):
            args[i] = a
        y = original(x, *args, **kwargs)
        if y.shape[-2] != x.shape[-2]:
            raise RuntimeError(f"{type(module).__name__}: {y.shape[-2]} rows out of {x.shape[-2]} in; the split "
                               "needs a same-size convolution")
        return bands.crop(y, h)

    return forward


@contextlib.contextmanager
def split_decoder(vae, group, halo: tuple[str, ...] = (), whole: tuple[str, ...] = ()):
    """Within the block, every call of ``vae.decoder`` on the processes of ``group`` is split into bands of latent
    rows (module docstring) and returns the whole output on every process; a call of fewer latent rows than
    processes (or than a convolution's halo) runs whole on each. Every process of ``group`` must make the same
    decoder calls (all call ``vae.decode`` with the same latents).

    Args:
        vae: a diffusers video VAE with a ``decoder`` module (every video family's; the adapters declare theirs).
        group: the process group (gloo or NCCL).
        halo, whole: the adapter's ``vae_halo_modules``, ``vae_whole_modules``.

    Raises:
        NotSplittable: from ``plan``, before anything is changed.
    """
    layers = plan(vae.decoder, halo, whole)
    bands = _Bands(group, dist.get_rank(group), dist.get_world_size(group))
    need = max([h for _, kind, h in layers if kind == "halo"], default=1)
    decoder = vae.decoder
    saved = [(m, m.__dict__.get("forward")) for m, _, _ in layers] + [(decoder, decoder.__dict__.get("forward"))]
    for module, kind, h in layers:
        module.forward = _wrap(module, kind, h, bands)
    whole_call = decoder.forward

    def entry(x, *args, **kwargs):
        base, extra = divmod(x.shape[-2], bands.world)
        rows = [base + (p < extra) for p in range(bands.world)]
        if min(rows) < need:
            return whole_call(x, *args, **kwargs)
        bands.rows = rows
        bands.active = True
        try:
            out = whole_call(bands.mine(x), *args, **kwargs)
        finally:
            bands.active = False
        if isinstance(out, tuple):  # (frames, the decoder's caches: each process keeps its own bands')
            return (bands.gather(out[0]), *out[1:])
        return bands.gather(out)

    decoder.forward = entry
    try:
        yield
    finally:
        for module, before in saved:
            if before is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = before


STRIP_OVERLAP = 64  # pixels two neighbouring strips share and blend: diffusers' default tiles overlap so much


def use_strips(vae, shape: tuple[int, ...], parts: int) -> None:
    """Set ``vae``'s tiling to ``parts`` column strips of the latents ``shape`` (B, C, T', h, w): each strip the full
    height and ceil(w / parts) latent columns wide plus ``STRIP_OVERLAP`` pixels of its right neighbour, blended
    by ``tiled_decode`` as its tiles are. Against diffusers' default 256-pixel squares overlapping by a quarter
    (1.66x the frame's area at 480 x 832 in 15 tiles), strips decode 1.08x (2 parts) or 1.23x (4 parts) of it, so a
    process's share of the decode shrinks nearly as 1 / parts."""
    ratio = vae.spatial_compression_ratio
    h, w = shape[-2:]
    stride = -(-w // parts)
    vae.enable_tiling(tile_sample_min_height=h * ratio, tile_sample_stride_height=h * ratio,
                      tile_sample_min_width=stride * ratio + STRIP_OVERLAP, tile_sample_stride_width=stride * ratio)


class _Router(torch.nn.Module):
    """Stands in for ``vae.decoder`` during ``decode_tiles_split``: each call goes to ``route(decoder, ...)``."""

    def __init__(self, decoder: torch.nn.Module, route):
        super().__init__()
        self.decoder, self.route = decoder, route

    def forward(self, x, **kwargs):
        return self.route(self.decoder, x, **kwargs)


@contextlib.contextmanager
def _routed(vae, route):
    decoder = vae.decoder
    vae.decoder = _Router(decoder, route)
    try:
        yield
    finally:
        vae.decoder = decoder


class _Decoded(Exception):
    """Ends ``tiled_decode`` after a process's last tile: what it would blend is not this process's to return."""


def _tile_calls(vae, z: torch.Tensor) -> list[tuple[int, tuple[int, ...]]]:
    """The decoder calls diffusers' ``tiled_decode`` makes for ``z`` (B, C, T', h, w), in order: (tile index, output
    shape) for each tile (row by row, the tiles at the strides of ``vae.tile_sample_stride_*``) and each latent
    frame of it (the first decodes to 1 frame, each other to ``scale_factor_temporal``)."""
    b, _, frames, h, w = z.shape
    ratio = vae.spatial_compression_ratio
    tile_h, tile_w = vae.tile_sample_min_height // ratio, vae.tile_sample_min_width // ratio
    stride_h, stride_w = vae.tile_sample_stride_height // ratio, vae.tile_sample_stride_width // ratio
    up_t, up_s, channels = vae.config.scale_factor_temporal, vae.config.scale_factor_spatial, vae.config.out_channels
    calls = []
    for i in range(0, h, stride_h):
        for j in range(0, w, stride_w):
            size = (min(tile_h, h - i) * up_s, min(tile_w, w - j) * up_s)
            calls += [(len(calls) // frames, (b, channels, 1 if k == 0 else up_t, *size)) for k in range(frames)]
    return calls


def decode_tiles_split(vae, z: torch.Tensor, group) -> torch.Tensor | None:
    """The VAE's own ``tiled_decode`` (of a family whose ``vae_split_decode`` holds ``"strips"``) of ``z``
    (B, C, T', h, w) with its tiles split over the processes of ``group`` (``--vae_parallel strips``: one column
    strip each, ``use_strips``; ParaAttention's tile split): tile k (in diffusers' order, row by row) is decoded,
    all its frames, by process k mod P. Each process runs ``tiled_decode`` up to its last
    tile, the decoder calls of other processes' tiles answered by zeros of their shape (``_tile_calls``; each
    decoded shape is checked against it); the decoded calls go to process 0 (point to point), which runs
    ``tiled_decode`` again with every decoder call answered by its recorded output: the blending, cropping and
    clamping are diffusers' own, so the result equals the one-process tiled decode (each tile is the same
    computation). Returns (B, 3, T, H, W) on process 0, None elsewhere.

    The decoder's caches are cleared at each tile by ``tiled_decode`` itself, so skipping another process's tile
    leaves this process's tiles unchanged. Needs a VAE without ``patch_size``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    calls = _tile_calls(vae, z)
    owner = [tile % world for tile, _ in calls]
    last = max((n for n in range(len(calls)) if owner[n] == rank), default=-1)
    mine, seen = {}, iter(range(len(calls)))

    def split(decoder, x, **kwargs):
        n = next(seen)
        if owner[n] != rank:
            return x.new_zeros(calls[n][1])
        out = mine[n] = decoder(x, **kwargs)
        if tuple(out.shape) != calls[n][1]:
            raise RuntimeError(f"decoder call {n} gave {tuple(out.shape)}, _tile_calls expected {calls[n][1]}")
        if n == last:
            raise _Decoded
        return out

    if last >= 0:
        with _routed(vae, split), contextlib.suppress(_Decoded):
            vae.tiled_decode(z, return_dict=False)
    if rank != 0:
        if mine:  # a process with no tile (more processes than tiles) sends nothing
            dist.send(torch.cat([mine[n].flatten() for n in sorted(mine)]), group=group, group_dst=0)
        return None
    outputs = dict(mine)
    for src in range(1, world):
        theirs = [n for n in range(len(calls)) if owner[n] == src]
        if not theirs:
            continue
        sizes = [int(np.prod(calls[n][1])) for n in theirs]
        flat = z.new_empty(sum(sizes))
        dist.recv(flat, group=group, group_src=src)
        for n, part in zip(theirs, flat.split(sizes)):
            outputs[n] = part.view(calls[n][1])
    replay = iter(range(len(calls)))
    with _routed(vae, lambda decoder, x, **kwargs: outputs[next(replay)]):
        return vae.tiled_decode(z, return_dict=False)[0]
