"""``ditforge sample`` of a Wan pipeline folder under torchrun equals one process: 2 gloo processes with the tokens
split (diffusers' context parallelism, Ulysses over the 2 heads) and with ``--cfg_parallel``, and 4 processes with
both (CFG-parallel x Ulysses 2), on the tiny random ``WanPipeline`` of ``tests/finetune/tiny_pipelines.py``; the
tiny pipeline of every text-to-video row of the fine-tuning suite (``tests/finetune/families.VIDEO``: Wan 2.1,
CogVideoX, LTX-Video, HunyuanVideo) and LTX-Video's image to video with their video tokens split (diffusers' plan or
ditforge's: the text whole on every process); CogVideoX with ``--cfg_parallel``.
Tolerance: the frames (uint8) within one level; the one-process run draws the same noise from the same seed."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_helpers import finetune_module, free_port, gloo_dp, spawn, torchrun_cli_many

pytestmark = pytest.mark.slow

H, W, FRAMES = 16, 48, 5  # 2 latent frames x 2 x 6 = 24 tokens: 12 (or 6) a process
FAMILIES = finetune_module("families")
# one row a family (``families.VIDEO``), and LTX-Video's image to video (an ``families.I2V`` row): their tokens split
SPLIT = [*FAMILIES.VIDEO, "ltx_i2v"]


@pytest.fixture(scope="module")
def folder(video_folders) -> Path:
    return video_folders["wan"]


PROMPTS = ("a heron in the reeds", "rain on a window")


def _argv(folder: Path, npz: Path, *extra: str) -> list[str]:
    return ["sample", "--ckpt", str(folder), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
            "--height", str(H), "--width", str(W), "--num_frames", str(FRAMES), "--num_sampling_steps", "3",
            "--cfg_scale", "5", "--seed", "7", "--device", "cpu", "--out", str(npz.with_suffix("")),
            "--save_npz", str(npz), *extra]


@pytest.fixture(scope="module")
def want(folder, tmp_path_factory) -> np.ndarray:
    """The one-process videos, (2, T, H, W, 3)."""
    npz = tmp_path_factory.mktemp("one") / "one.npz"
    return _one_process(_argv(folder, npz), npz)


TAYLORSEER = ("--taylorseer_cache", "2", "--num_sampling_steps", "6")  # full steps 0, 1, 2, 4; 3 and 5 forecast


def _one_process(argv: list[str], npz: Path) -> np.ndarray:
    """``ditforge ARGV`` in this process on one thread (as each torchrun process runs); the videos it saved to
    ``npz``, int16."""
    from ditforge import cli

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main(argv) == 0
    finally:
        torch.set_num_threads(before)
    return np.load(npz)["samples"].astype(np.int16)


def _assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape == (2, FRAMES, H, W, 3) and want.std() > 5  # two non-constant videos
    assert np.abs(got.astype(np.int16) - want).max() <= 1


def _strips_reference(folder: Path, parts: int) -> np.ndarray:
    """The videos of ``_argv`` drawn in this process (``VideoSampler``) and decoded by diffusers' ``tiled_decode``
    in the column strips ``use_strips`` cuts for ``parts`` processes: what the torchrun runs' ``--vae_parallel
    strips`` must give. (2, T, H, W, 3) int16."""
    from ditforge.data.images import to_uint8
    from ditforge.data.sampler import derive_seed
    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.parallel.mesh import Dist
    from ditforge.sample.load import SampleConfig
    from ditforge.parallel.vae_decode import use_strips
    from ditforge.sample.video import VideoSampler

    pre = load_pretrained(folder, torch.device("cpu"), flag="--ckpt", sampling=True)
    sampler = VideoSampler(pre, pre.denoiser.eval(), Dist(), SampleConfig(ckpt=str(folder)))
    uncond, vae = pre.encode_prompt([""]), pre.pipe.vae
    out = []
    for i, prompt in enumerate(PROMPTS):
        latents = sampler.denoise(pre.encode_prompt([prompt]), uncond, (1, 16, 2, H // 8, W // 8),
                                  derive_seed(7, i), 3, 5.0)
        z = sampler.vae.unscale(latents)
        use_strips(vae, z.shape, parts)
        with torch.no_grad():
            out.append(to_uint8(vae.tiled_decode(z, return_dict=False)[0])[0])
    return np.stack(out).astype(np.int16)


def test_two_processes_equal_one(folder, want, two_processes, tmp_path):
    """2 processes, in one launch, each run writing the videos of one process:

    - ``--sequence_parallel_size 2`` (Ulysses: each process holds 12 of the 24 tokens and 1 of the 2 heads in
      attention) and ``--cfg_parallel`` (conditional and unconditional passes apart), each decoding by default in
      bands of rows (``parallel.vae_decode.split_decoder``: one of the 2 latent rows a process): the one-process
      whole-frame decode;
    - ``--cfg_parallel --vae_tile 32`` (tiles of 32 px every 24 px: two tiles across the frames, blended over 8 px),
      each tile split in bands: the one-process tiled decode, which differs from the whole-frame decode (the tiles
      are really used);
    - ``--cfg_parallel --vae_parallel strips``: one column strip per process (``use_strips``), equal to the
      one-process strips, which differ from the whole-frame decode (approximate);
    - ``--sequence_parallel_size 2 --plugin fsdp``: the transformer's weights sharded over the two (FSDP2)."""
    from ditforge import cli

    work, err = two_processes
    assert "ulysses 2 x ring 1" in err[0]
    assert "VAE decode over 2 processes: bands of rows (exact)" in err[0]
    assert "VAE decode over 2 processes: column strips (approximate)" in err[3]
    held, total = map(int, re.search(r"fsdp: (\d+) of the transformer's (\d+) weights", err[4]).groups())
    assert held <= total // 2 + 1000  # sharded: about half each (a few small tensors are cut unevenly)
    for name in ("sp", "cfg", "sp_fsdp"):
        _assert_same(np.load(work / f"{name}.npz")["samples"], want)
    assert cli.main(_argv(folder, tmp_path / "one_tiled.npz", "--vae_tile", "32")) == 0
    tiled = np.load(tmp_path / "one_tiled.npz")["samples"].astype(np.int16)
    _assert_same(np.load(work / "tiles.npz")["samples"], tiled)
    assert np.abs(tiled - want).max() > 2
    strips = _strips_reference(folder, 2)
    _assert_same(np.load(work / "strips.npz")["samples"], strips)
    assert np.abs(strips - want).max() > 2


def test_taylorseer_under_cfg_parallel_and_split_tokens_equals_one_process(folder, two_processes, tmp_path):
    """``--taylorseer_cache 2`` over 6 steps on 2 processes: with ``--cfg_parallel`` each process forecasts its own
    guidance half, as one process forecasts each half of its batch; with ``--sequence_parallel_size 2`` both skip
    the same steps and forecast the gathered output. Either way the videos are one process's, to one uint8 level;
    and the forecast steps changed them (they differ from the exact 6-step videos). First Block Cache with the
    tokens split is one line."""
    npz = tmp_path / "one.npz"
    want = _one_process(_argv(folder, npz, *TAYLORSEER), npz)
    for name in ("cfg_ts", "sp_ts"):
        _assert_same(np.load(two_processes[0] / f"{name}.npz")["samples"].astype(np.int16), want)
    # First Block Cache decides on each process's own tokens: a skip on one alone would hang the other
    assert "--first_block_cache: not with --sequence_parallel_size > 1" in two_processes[1][7]
    exact = _one_process(_argv(folder, tmp_path / "exact.npz", "--num_sampling_steps", "6"), tmp_path / "exact.npz")
    assert np.abs(exact - want).max() > 2


def test_four_processes_cfg_parallel_times_ulysses_equal_one(folder, want, split_folders, split_one, tmp_path):
    """4 processes: ``--cfg_parallel --sequence_parallel_size 2`` (two pairs, one per guidance half, each splitting
    the tokens over Ulysses 2; the decode in bands of rows), with the transformer's
    weights sharded over all four (``--plugin fsdp``), write the one-process videos; ring attention is refused on
    the CPU in one line. LTX-Video: text-to-video with its tokens split 4 ways (32 a process, one of its 4 heads
    each in Ulysses), image-to-video with ``--cfg_parallel --sequence_parallel_size 2``, each the one-process
    videos to one uint8 level."""
    err = torchrun_cli_many(4, tmp_path, [
        _argv(folder, tmp_path / "both.npz", "--cfg_parallel", "--sequence_parallel_size", "2", "--plugin", "fsdp"),
        _argv(folder, tmp_path / "ring.npz", "--sequence_parallel_size", "4", "--sequence_parallel_type", "ring"),
        _split_argv("ltx", split_folders["ltx"], tmp_path / "ltx.npz", "--sequence_parallel_size", "4"),
        _split_argv("ltx_i2v", split_folders["ltx_i2v"], tmp_path / "ltx_i2v.npz", "--cfg_parallel",
                    "--sequence_parallel_size", "2")],
        fails=(1,))
    _assert_same(np.load(tmp_path / "both.npz")["samples"], want)
    for name in ("ltx", "ltx_i2v"):
        _assert_like(np.load(tmp_path / f"{name}.npz")["samples"], split_one[name], name)
    held, total = map(int, re.search(r"fsdp: (\d+) of the transformer's (\d+) weights", err[0]).groups())
    assert held <= total // 4 + 1000
    assert "ring attention over a diffusers transformer runs on CUDA only" in err[1]


def _row(name: str):
    """The row ``name`` of ``families.VIDEO`` or ``families.I2V``."""
    return FAMILIES.VIDEO[name] if name in FAMILIES.VIDEO else FAMILIES.I2V[name]


def _split_argv(name: str, folder: Path, npz: Path, *extra: str) -> list[str]:
    """``ditforge sample`` of the row ``name``'s tiny pipeline (``families.VIDEO`` or ``families.I2V``; an
    image-to-video row's first frame ``_first_png``): both prompts at 32 x 32 px, the row's frame count and
    guidance, 3 steps, seed 7. Tokens: Wan 2 latent frames x 2 x 2 patches (8), CogVideoX 9 frames: 3 x 2 x 2 (12),
    LTX-Video 2 x 8 x 8 (128), HunyuanVideo 2 x 4 x 4 (32)."""
    image = ("--image", str(_first_png(npz.parent))) if name in FAMILIES.I2V else ()
    row = _row(name)
    return ["sample", "--ckpt", str(folder), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--height", "32",
            "--width", "32", "--num_frames", str(row.frames), "--num_sampling_steps", "3", "--cfg_scale",
            str(row.cfg), "--seed", "7", "--device", "cpu", "--out", str(npz.with_suffix("")), "--save_npz", str(npz),
            *image, *extra]


@pytest.fixture(scope="module")
def split_folders(video_folders, tmp_path_factory) -> dict[str, Path]:
    """{name: folder} of ``SPLIT``: the text-to-video rows' folders and LTX-Video's image-to-video one."""
    i2v = finetune_module("tiny_pipelines").BUILDERS["ltx_i2v"](tmp_path_factory.mktemp("ltx_i2v") / "pipe")
    return {**video_folders, "ltx_i2v": i2v}


def _first_png(folder: Path) -> Path:
    from PIL import Image

    png = folder / "first.png"
    if not png.exists():
        Image.fromarray(np.random.default_rng(3).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(png)
    return png


@pytest.fixture(scope="module")
def two_processes(folder, split_folders, tmp_path_factory) -> tuple[Path, list[str]]:
    """Every 2-process run of this module, in one launch (``torchrun_cli_many``: one start-up of the two
    processes, which import diffusers, for the Wan and the rows' cases): (the folder of their .npz files, each
    run's stderr). Runs 0-4: Wan (``test_two_processes_equal_one``); 5-6: Wan with TaylorSeer under CFG-parallel
    and with its tokens split; 7: First Block Cache with the tokens split, refused; then CogVideoX with
    ``--cfg_parallel``, and each of ``SPLIT`` with its tokens split (``<name>_sp.npz``)."""
    work = tmp_path_factory.mktemp("two")
    err = torchrun_cli_many(2, work, [
        _argv(folder, work / "sp.npz", "--sequence_parallel_size", "2"),
        _argv(folder, work / "cfg.npz", "--cfg_parallel"),
        _argv(folder, work / "tiles.npz", "--cfg_parallel", "--vae_tile", "32"),
        _argv(folder, work / "strips.npz", "--cfg_parallel", "--vae_parallel", "strips"),
        _argv(folder, work / "sp_fsdp.npz", "--sequence_parallel_size", "2", "--plugin", "fsdp"),
        _argv(folder, work / "cfg_ts.npz", "--cfg_parallel", *TAYLORSEER),
        _argv(folder, work / "sp_ts.npz", "--sequence_parallel_size", "2", *TAYLORSEER),
        _argv(folder, work / "sp_fbc.npz", "--sequence_parallel_size", "2", "--first_block_cache", "0.1"),
        _split_argv("cogvideox", split_folders["cogvideox"], work / "cogvideox_cfg.npz", "--cfg_parallel"),
        *(_split_argv(name, split_folders[name], work / f"{name}_sp.npz", "--sequence_parallel_size", "2")
          for name in SPLIT)],
        fails=(7,))
    return work, err


@pytest.fixture(scope="module")
def split_one(split_folders, tmp_path_factory) -> dict[str, np.ndarray]:
    """{name: the one-process videos of ``_split_argv(name)``} for ``SPLIT``, (2, T, 32, 32, 3) int16."""
    work = tmp_path_factory.mktemp("split_one")
    return {name: _one_process(_split_argv(name, split_folders[name], work / f"{name}.npz"), work / f"{name}.npz")
            for name in SPLIT}


def _assert_like(got: np.ndarray, want: np.ndarray, name: str) -> None:
    """``got`` is the one-process videos ``want`` of ``_split_argv(name)``, two non-constant videos, to one uint8
    level."""
    assert got.shape == want.shape == (2, _row(name).frames, 32, 32, 3) and want.std() > 5
    assert np.abs(got.astype(np.int16) - want).max() <= 1


@pytest.mark.parametrize("name", SPLIT)
def test_video_tokens_split_over_two_processes_equal_one(name, split_one, two_processes):
    """``--sequence_parallel_size 2``: each process holds half of every clip's video tokens, the text whole on both,
    and the videos are the one process's, to one uint8 level.

    - Wan 2.1: diffusers' own plan (``_cp_plan``), Ulysses over its heads.
    - CogVideoX (frames-first latents, its stochastic DPM scheduler drawing the same noise in both processes;
      ``text_first_plan``): 12 video tokens, 6 a process, the 226 caption tokens on both; its attention's SDPA
      caught by ``intercept_sdpa``.
    - LTX-Video (``models.adapters.ltx.whole_text_plan``: the 128 packed video tokens split, 64 a process, with the
      image-to-video model's per-token timesteps; the masked caption whole on both, each cross-attention local).
      diffusers' own plan split the text and failed on the cross-attention mask's shape.
    - HunyuanVideo: the video tokens split, 16 a process; the text, cropped to each prompt's length, on both. The
      attention itself is held to 1e-5 below.

    The decode is split too, in bands of rows (LTX-Video's 32 px frames are one latent row: that call runs whole)."""
    _assert_like(np.load(two_processes[0] / f"{name}_sp.npz")["samples"], split_one[name], name)
    assert "VAE decode over 2 processes: bands of rows (exact)" in two_processes[1][9 + SPLIT.index(name)]


def test_cogvideox_cfg_parallel_equals_one(split_one, two_processes):
    """CogVideoX under 2 gloo processes with ``--cfg_parallel`` (the conditional and unconditional passes apart, its
    stochastic DPM scheduler drawing the same noise in both processes) equals one process, to one uint8 level."""
    _assert_like(np.load(two_processes[0] / "cogvideox_cfg.npz")["samples"], split_one["cogvideox"], "cogvideox")


def _joint_model(family: str):
    """(a tiny transformer of ``family``, its adapter, a fresh input of the adapter's ``denoise``): 48 video tokens
    (2 latent frames of 4 x 6; 3 frames for the image-to-video model) and 9 text tokens; 4 heads (HunyuanVideo) or
    2 (CogVideoX)."""
    import diffusers

    from ditforge.models.adapters.cogvideox import CogVideoXDenoiser
    from ditforge.models.adapters.hunyuan import HunyuanVideoDenoiser, HunyuanVideoI2VDenoiser

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if family == "cogvideox":  # the 5B model's rotary positions; x (B, C, T, h, w), 2 x 2 patches
        model = diffusers.CogVideoXTransformer3DModel(
            num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=8,
            text_embed_dim=16, num_layers=2, sample_width=12, sample_height=8, sample_frames=5, patch_size=2,
            temporal_compression_ratio=4, max_text_seq_length=9, use_rotary_positional_embeddings=True)
        return model, CogVideoXDenoiser(model), dict(
            x=torch.randn(1, 4, 2, 8, 12, generator=g), t=torch.tensor([700]),
            encoder_hidden_states=3 * torch.randn(1, 9, 16, generator=g))
    condition = {"hunyuan": None, "hunyuan_i2v": "token_replace"}[family]
    model = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8, num_layers=2, num_single_layers=2,
        num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True, text_embed_dim=16,
        pooled_projection_dim=8, rope_axes_dim=(2, 2, 4), **({"image_condition_type": condition} if condition else {}))
    adapter = HunyuanVideoI2VDenoiser(model) if condition else HunyuanVideoDenoiser(model)
    image = {"first_frame": torch.randn(1, 4, 1, 4, 6, generator=g)} if condition else {}
    return model, adapter, dict(
        x=torch.randn(1, 4, 3 if condition else 2, 4, 6, generator=g), t=torch.tensor([700.0]),
        encoder_hidden_states=3 * torch.randn(1, 9, 16, generator=g),
        encoder_attention_mask=torch.arange(9)[None] < 6, pooled_projections=torch.randn(1, 8, generator=g),
        guidance=torch.tensor([6000.0]), **image)  # the caption's last 3 tokens padding


def _joint_text_worker(rank: int, port: int, family: str) -> None:
    import copy
    from unittest import mock

    import torch.distributed as dist
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    from ditforge.models.adapters.dispatch import unmask_full_attention
    from ditforge.models.adapters.hunyuan import joint_text_plan
    from ditforge.parallel.context import split_tokens

    with gloo_dp(rank, port, 2) as d:
        model, adapter, inputs = _joint_model(family)
        weights = torch.randn(inputs["x"].shape, generator=torch.Generator().manual_seed(2))
        naive = copy.deepcopy(model)

        def run(adapter):
            out = adapter.denoise(**{k: v.clone() for k, v in inputs.items()})
            model.zero_grad()
            (out * weights).sum().backward()
            return out.detach(), {k: p.grad.clone() for k, p in adapter.named_parameters() if p.grad is not None}

        want, want_grads = run(adapter)
        if family == "hunyuan":  # the same without padding, for diffusers' own split below
            unpadded = inputs | {"encoder_attention_mask": torch.ones(1, 9, dtype=torch.bool)}
            with torch.no_grad():
                want_unpadded = adapter.denoise(**unpadded)
        mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("outer", "ring", "ulysses"))
        split_tokens(adapter, d, mesh)
        got, grads = run(adapter)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert grads.keys() == want_grads.keys() and len(grads) > 20
        for name, grad in grads.items():  # each process holds its tokens' share: the shares sum to the whole
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-5, msg=name)
        if family == "hunyuan":  # diffusers' own Ulysses over [video; text] with the same split: the text enters twice
            with mock.patch.object(torch.accelerator, "device_count", lambda: 1):  # as split_tokens on the CPU
                naive.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2,
                                                                      mesh=mesh["ring", "ulysses"]),
                                         cp_plan=joint_text_plan())
            for marker in unmask_full_attention(naive):
                marker.full = True  # no padding: what the sampler sets
            with torch.no_grad():
                wrong = type(adapter)(naive).denoise(**unpadded)
            assert (wrong - want_unpadded).abs().max() > 1e-3 * want_unpadded.abs().max()


@pytest.mark.parametrize("family", ["hunyuan", "hunyuan_i2v", "cogvideox"])
def test_joint_attention_split_equals_one_process(family):
    """A joint text-video transformer with its video tokens split over 2 gloo processes (ditforge's plans:
    Ulysses on the video tokens, each process's heads of the text kept, the text's output gathered over the heads)
    equals the unsplit transformer: the output within 1e-5, and the parameter gradients of a weighted sum of it,
    summed over the processes, within 1e-4 relative.

    - HunyuanVideo (4 heads, 2 double- and 2 single-stream blocks, 48 video and 9 text tokens of which 3 are masked
      padding; ``joint_text_plan``, at diffusers' dispatcher). diffusers' own Ulysses over the same split (each
      process's copy of the text exchanged with the video) does not equal it: the text would count twice in every
      softmax.
    - HunyuanVideo-I2V's token_replace model (3 latent frames: 72 tokens, 36 a process): the first frame's 24 tokens
      modulated at t = 0, the first 24 of process 0's 36 (``first_frame_tokens``).
    - CogVideoX with 3-D rotary positions ([text; video], ``text_first_plan``; its processor calls PyTorch's SDPA,
      caught by ``intercept_sdpa``)."""
    spawn(_joint_text_worker, args=(free_port(), family), nprocs=2)
