"""The VAE decode split into bands of rows over gloo processes (``parallel.vae_decode.split_decoder``) equals the
one-process decode of the same VAE, for tiny random VAEs of every video family (diffusers' own classes: Wan 2.1,
Wan 2.2's with ``patch_size`` 2, CogVideoX with its group norms, LTX-Video, HunyuanVideo with its mid-block
attention), on 2 and 4 processes; whole frames, and diffusers' tiled decode with tiles smaller than the frames (whose
sides are no multiples of the tile), as tall as them, and larger. Tolerance: 2e-5 on the [-1, 1] frames (float32; the
convolutions of a band and the split group norms sum in another order), far below one uint8 level (0.0078).
A decode that did not split would pass that, so each process's decoder must also have seen fewer rows than the
whole frame's."""

from __future__ import annotations

import pytest
import torch

from dist_helpers import free_port, gloo_dp, spawn

pytestmark = pytest.mark.slow

TOLERANCE = 2e-5


def _vaes():
    """(name, adapter class, VAE, latent shape (C, T', h, w), tiles to try in pixels (None: whole frames)), seeded."""
    import diffusers

    from ditforge.models.adapters.cogvideox import CogVideoXDenoiser
    from ditforge.models.adapters.hunyuan import HunyuanVideoDenoiser
    from ditforge.models.adapters.ltx import LTXDenoiser
    from ditforge.models.adapters.wan import WanDenoiser

    def seeded(build):
        torch.manual_seed(0)
        return build().eval()

    yield "hunyuan", HunyuanVideoDenoiser, seeded(lambda: diffusers.AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        act_fn="silu", norm_num_groups=4, spatial_compression_ratio=8, temporal_compression_ratio=4,
        mid_block_add_attention=True)), (4, 2, 5, 7), (None, 32)
    # 5 x 7 latent rows x columns (40 x 56 px): tiles of 32 overlap, 64 cover them; 4 x 7 (32 px tall) with 32: one
    # tile high, two across
    yield "wan", WanDenoiser, seeded(lambda: diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])), \
        (4, 2, 5, 7), (None, 32, 64)
    yield "wan_tall", WanDenoiser, seeded(lambda: diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])), \
        (4, 2, 4, 7), (32,)
    yield "wan22", WanDenoiser, seeded(lambda: diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=8, in_channels=12, out_channels=12, is_residual=True, patch_size=2, dim_mult=[1, 1, 1, 1],
        num_res_blocks=1, scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True])), \
        (8, 2, 4, 3), (None,)
    yield "cogvideox", CogVideoXDenoiser, seeded(lambda: diffusers.AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), latent_channels=4,
        layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4)), (4, 3, 5, 7), (None, 32)
    yield "ltx", LTXDenoiser, seeded(lambda: diffusers.AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5)), \
        (8, 2, 5, 3), (None,)



def _worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from ditforge.parallel.vae_decode import split_decoder
    from ditforge.sample.video_vae import enable_vae_tiles

    with gloo_dp(rank, port, 4):
        pair = dist.new_group([0, 1])
        for name, family, vae, shape, tiles in _vaes():
            z = torch.randn(1, *shape, generator=torch.Generator().manual_seed(1))
            conv = next(m for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv3d) and m.kernel_size[1] == 3)
            seen = []
            hook = conv.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[-2]))
            for tile in tiles:
                if tile is None:
                    vae.disable_tiling()
                else:
                    enable_vae_tiles(vae, tile)
                with torch.no_grad():
                    if rank == 0:  # the one-process decode, to compare against
                        want = vae.decode(z, return_dict=False)[0]
                        whole = max(seen)
                    for group, size in ((pair, 2), (dist.group.WORLD, 4)):
                        if rank >= size:
                            continue
                        seen.clear()
                        with split_decoder(vae, group, family.vae_halo_modules, family.vae_whole_modules):
                            got = vae.decode(z, return_dict=False)[0]
                        if rank == 0:
                            results.put((name, tile, size, tuple(got.shape), tuple(want.shape),
                                         (got - want).abs().max().item(), want.std().item(), min(seen), whole))
            hook.remove()


def test_split_decode_equals_one_process():
    """Each VAE and tiling on 2 and 4 processes: the one-process frames within ``TOLERANCE``, and the decoder's
    3x3 convolutions given fewer rows than one process gives them (bands, with 1 row of halo). A call of fewer latent
    rows than processes runs whole (Wan 2.2's 4 rows on 4 processes split 1 row each; LTX-Video's 5 rows on 4: 2, 1,
    1, 1)."""
    import torch.multiprocessing as mp

    results = mp.get_context("forkserver").Manager().Queue()
    spawn(_worker, args=(free_port(), results), nprocs=4)
    rows = []
    while not results.empty():
        rows.append(results.get())
    cases = {(name, tile) for name, _, _, _, tiles in _vaes() for tile in tiles}
    assert {(r[0], r[1]) for r in rows} == cases and len(rows) == 2 * len(cases)
    for name, tile, size, got, want, err, std, fewest, whole in rows:
        assert got == want and std > 0.05, (name, tile)
        assert err <= TOLERANCE, f"{name} tile {tile} on {size} processes: {err:.2e}"
        assert fewest < whole, f"{name} tile {tile} on {size} processes: not split ({fewest} of {whole} rows)"


def test_plan_refuses_what_it_cannot_split_exactly():
    """``plan`` names the first layer the row split cannot compute exactly, before anything changes: LTX-Video's
    decode noise (a random field of the whole frame's size), HunyuanVideo's replicate-padded convolutions and mid-block
    attention when the adapter's names are not given, a row-strided convolution; the adapters' own names pass."""
    import diffusers

    from ditforge.parallel.vae_decode import NotSplittable, plan

    name, family, hunyuan, _, _ = next(_vaes())  # the first built
    assert name == "hunyuan"
    kinds = [kind for _, kind, _ in plan(hunyuan.decoder, family.vae_halo_modules, family.vae_whole_modules)]
    assert kinds.count("whole") == 1 and kinds.count("norm") > 5 and kinds.count("halo") > 5
    with pytest.raises(NotSplittable, match=r"decoder\.conv_in\.conv \(Conv3d\): a convolution of 3 rows padded by"):
        plan(hunyuan.decoder)
    with pytest.raises(NotSplittable, match=r"attention"):
        plan(hunyuan.decoder, family.vae_halo_modules)
    torch.manual_seed(0)
    noisy = diffusers.AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1), decoder_inject_noise=(True,) * 5)
    with pytest.raises(NotSplittable, match="spatial noise"):
        plan(noisy.decoder)
    strided = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, stride=2, padding=1))
    with pytest.raises(NotSplittable, match="at stride 2"):
        plan(strided)
