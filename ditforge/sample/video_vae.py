"""The VAE side of ``ditforge sample`` for video pipelines (``sample.video.VideoSampler``): the decode of the
latents, one process or split over the torchrun processes (``parallel.vae_decode``), and the VAE's dtype, layout and
tiles (``--vae_dtype``, ``--vae_tile``, ``--vae_parallel``)."""

from __future__ import annotations

import inspect
import logging

import torch
import torch.distributed as dist

from ditforge.encoders.vae import VAE
from ditforge.errors import UserError
from ditforge.parallel.mesh import Dist
from ditforge.parallel.vae_decode import NotSplittable, decode_tiles_split, plan, split_decoder, use_strips
from ditforge.sample.load import SampleConfig

log = logging.getLogger(__name__)


def decode(wrapper: VAE, vae, latents: torch.Tensor, split: str | None, group, modules: tuple,
           is_main: bool) -> torch.Tensor | None:
    """Latents (B, C, T', h, w) -> frames (B, 3, T, H, W) float in [-1, 1], as the pipeline decodes them: the
    VAE's ``latents_mean`` / ``latents_std`` undone (``VAE.unscale``), ``vae.decode`` in the VAE's dtype; in
    spatial tiles where ``vae_tile`` is set (diffusers' ``tiled_decode``: tiles of that side overlapping by a
    quarter, blended). Under torchrun every process calls it and process 0 returns the frames, the others None:
    each decoder call split into bands of rows over the processes (``parallel.vae_decode.split_decoder``: the
    frames of the one-process decode), or with ``--vae_parallel strips`` one column strip a process
    (``use_strips``, ``decode_tiles_split``); a VAE the adapter does not declare splittable on process 0.
    ``wrapper``: the ``encoders.VAE`` of the pipeline's ``vae``; ``split``, ``group``: ``decode_split``'s answer and
    the processes' group; ``modules``: the adapter's (``vae_halo_modules``, ``vae_whole_modules``)."""
    z = wrapper.unscale(latents)
    # a decoder conditioned on the decode timestep (timestep_conditioning), the call's default 0 (its decode
    # noise, scaled by that timestep, then changes nothing)
    temb = (z.new_zeros(z.shape[0]),) if getattr(vae.config, "timestep_conditioning", False) else ()
    with torch.no_grad():
        if split == "strips":
            use_strips(vae, z.shape, dist.get_world_size(group))
            return decode_tiles_split(vae, z, group)
        if split == "patch":
            with split_decoder(vae, group, *modules):
                frames = vae.decode(z, *temb, return_dict=False)[0]
            return frames if is_main else None
        if not is_main:
            return None
        return vae.decode(z, *temb, return_dict=False)[0]


def enable_vae_tiles(vae, px: int) -> None:
    """diffusers' tiled decode for ``vae``: tiles of ``px`` pixels overlapping by a quarter (``--vae_tile``),
    through the VAE's own ``enable_tiling``, which states either the tiles' strides or their overlap; its decode
    tiles only frames larger than a tile."""
    if "tile_sample_stride_height" in inspect.signature(vae.enable_tiling).parameters:
        vae.enable_tiling(tile_sample_min_height=px, tile_sample_min_width=px, tile_sample_stride_height=px * 3 // 4,
                          tile_sample_stride_width=px * 3 // 4)
    else:
        vae.enable_tiling(tile_sample_min_height=px, tile_sample_min_width=px, tile_overlap_factor_height=0.25,
                          tile_overlap_factor_width=0.25)


def decode_split(d: Dist, denoiser, vae, cfg: SampleConfig) -> str | None:
    """How the torchrun processes share the VAE decode: ``"patch"`` (``parallel.vae_decode.split_decoder``, the
    default), ``"strips"`` (``--vae_parallel strips``: a VAE without ``patch_size``, whose ``tiled_decode``
    ``decode_tiles_split`` replays), or None: one process, or a VAE the adapter does not declare splittable
    (``vae_split_decode``) or whose decoder the patch split cannot compute exactly (said in one warning line:
    process 0 decodes).

    Raises:
        UserError: ``--vae_parallel strips`` with ``--vae_tile`` (the strips are its tiles), or for a VAE that
            cannot take them.
    """
    if cfg.vae_parallel == "strips":
        if cfg.vae_tile is not None:
            raise UserError("--vae_parallel strips: cuts the frames into its own tiles, one a process; drop --vae_tile")
        if "strips" not in denoiser.vae_split_decode or getattr(vae.config, "patch_size", None) is not None:
            raise UserError(f"--vae_parallel strips: not for {type(vae).__name__}"
                            + (" with patch_size" if "strips" in denoiser.vae_split_decode else "")
                            + " (decode_tiles_split does not know its tiled decode); use --vae_parallel patch")
    if d.world_size == 1 or "patch" not in denoiser.vae_split_decode:
        return None
    if cfg.vae_parallel == "strips":
        return "strips"
    try:
        plan(vae.decoder, denoiser.vae_halo_modules, denoiser.vae_whole_modules)
    except NotSplittable as e:
        if d.is_main:
            log.warning("the VAE decode runs on process 0: the patch split cannot compute %s exactly", e)
        return None
    return "patch"
def cast_vae(vae: torch.nn.Module, name: str) -> None:
    """``--vae_dtype name`` (``config.sections.VAE_DTYPES``): the VAE's weights and buffers cast in place to
    ``torch.<name>`` by ``nn.Module.to`` (diffusers' ``ModelMixin.to`` casts the same, and warns at every cast that
    the modules its ``_keep_in_fp32_modules`` names, none for the video VAEs, should stay float32). A 16-bit VAE's
    convolution weights are also laid out channels-last (``to_channels_last``: a video VAE decode of 480 x 832 x 81
    on an H200 in bf16, 1.64 s against 1.84 s contiguous, the same output to 0.01 dB; benchmarks/vae_decode.py)."""
    torch.nn.Module.to(vae, getattr(torch, name))
    if name != "float32":
        to_channels_last(vae)


def to_channels_last(vae: torch.nn.Module) -> None:
    """The convolution weights of ``vae`` in place: 5-D (Conv3d) in ``torch.channels_last_3d``, 4-D (Conv2d) in
    ``torch.channels_last``, so cuDNN runs its NDHWC kernels (the activations follow the weights' layout)."""
    for p in vae.parameters():
        if p.ndim in (4, 5):
            p.data = p.data.contiguous(memory_format=torch.channels_last_3d if p.ndim == 5 else torch.channels_last)
