"""``ditforge sample`` for the diffusers video families (``sample.video``): ditforge's loop against diffusers'
``WanPipeline`` / ``WanImageToVideoPipeline`` from the same noise on the tiny random pipelines of
``tests/finetune/tiny_pipelines.py`` (float32 on the CPU: latents within 1e-5, frames within one uint8 level), the
file it writes (an MP4 of the asked frame count, read back with PyAV), resuming a folder, First Block Cache, and the
one-line errors. The 2-process runs (context parallelism, CFG-parallel) are in
``tests/distributed/test_dist_sample_video.py``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from ditforge import cli
from ditforge.data.sampler import derive_seed

pytestmark = pytest.mark.usefixtures("one_thread")

H, W, FRAMES, STEPS = 16, 32, 5, 3  # latents 16 x 2 x 2 x 4: 16 tokens of 1 x 2 x 2 patches
PROMPT = "a red fox running through snow"


def _tiny_pipelines():
    spec = importlib.util.spec_from_file_location("tiny_pipelines",
                                                  Path(__file__).parent / "finetune" / "tiny_pipelines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def folders(tmp_path_factory, one_thread_module) -> dict[str, Path]:
    tiny = _tiny_pipelines()
    root = tmp_path_factory.mktemp("video_pipelines")
    return {"t2v": tiny.make_wan(root / "wan"), "i2v": tiny.make_wan_i2v(root / "wan_i2v"),
            "t2v32": tiny.make_wan(root / "wan32", attention_head_dim=32),  # heads the 8-bit kernel takes
            "t2v22": tiny.make_wan22(root / "wan22"), "i2v22": tiny.make_wan22(root / "wan22_i2v", image_to_video=True)}


def _pipeline(folder: Path):
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _sample(folder: Path, out: Path, *extra: str) -> int:
    return cli.main(["sample", "--ckpt", str(folder), "--prompt", PROMPT, "--height", str(H), "--width", str(W),
                     "--num_frames", str(FRAMES), "--num_sampling_steps", str(STEPS), "--cfg_scale", "4.5",
                     "--device", "cpu", "--out", str(out), *extra])


def _first_frame(tmp_path: Path) -> Path:
    from PIL import Image

    png = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(png)
    return png


@pytest.mark.parametrize("kind", ["t2v", "i2v", "t2v22", "i2v22"])
def test_loop_equals_the_pipeline(kind, folders, tmp_path):
    """The latents of ``VideoSampler.denoise`` (conditional and unconditional passes in one batch, guidance in
    float32) equal the pipeline's ``output_type="latent"`` from the same generator within 1e-5, and the CLI's
    frames (``--save_npz``) equal the pipeline's to one uint8 level. The I2V cases condition on a 24 x 40 image
    (resized by the pipeline's video processor; Wan 2.1's CLIP sees the original, Wan 2.2 has none). Wan 2.2 A14B
    (``*22``): the 3 steps run at t = 999 (high-noise expert, guidance 4.5), 857 and 600 (low-noise expert, its own
    guidance 3 through ``--cfg_scale_2``)."""
    from PIL import Image

    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.parallel.mesh import Dist
    from ditforge.sample.load import SampleConfig
    from ditforge.sample.video import VideoSampler

    folder = folders[kind]
    pipe = _pipeline(folder)
    image = None
    extra: dict = {}
    if kind.startswith("i2v"):
        png = _first_frame(tmp_path)
        image = Image.open(png).convert("RGB")
        extra = {"image": image}
    seed = derive_seed(0, 0)
    two = kind.endswith("22")
    if two:
        extra["guidance_scale_2"] = 3.0
    call = dict(prompt=PROMPT, height=H, width=W, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=4.5,
                **extra)
    expected = pipe(**call, output_type="latent", generator=torch.Generator("cpu").manual_seed(seed)).frames

    pre = load_pretrained(folder, torch.device("cpu"), flag="--ckpt", sampling=True)
    cfg = SampleConfig(ckpt=str(folder), mixed_precision="fp32")
    sampler = VideoSampler(pre, pre.denoiser.eval(), Dist(), cfg)
    image_cond = None
    if kind.startswith("i2v"):
        first = pipe.video_processor.preprocess(image, height=H, width=W)
        image_cond = pre.encode_image(first, FRAMES, images=[image])
    got = sampler.denoise(pre.encode_prompt([PROMPT]), pre.encode_prompt([""]), tuple(expected.shape), seed, STEPS,
                          4.5, image_cond, guidance_2=3.0 if two else None)
    assert len(sampler.experts) == (2 if two else 1)
    assert got.shape == expected.shape == (1, 16, 2, H // 8, W // 8)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    unguided = pipe(**{**call, "guidance_scale": 1.0, **({"guidance_scale_2": 1.0} if two else {})},
                    output_type="latent",
                    generator=torch.Generator("cpu").manual_seed(seed)).frames
    assert (got - unguided).abs().max() > 1e-3  # guidance acts

    npz, clip = tmp_path / "s.npz", tmp_path / "out" / "clip.mp4"
    flags = (("--image", str(png)) if kind.startswith("i2v") else ()) + (("--cfg_scale_2", "3") if two else ())
    assert _sample(folder, clip, "--save_npz", str(npz), *flags) == 0
    frames = pipe(**call, output_type="np", generator=torch.Generator("cpu").manual_seed(seed)).frames
    want = np.round(frames * 255).astype(np.int16)
    have = np.load(npz)["samples"].astype(np.int16)
    assert have.shape == want.shape == (1, FRAMES, H, W, 3)
    assert np.abs(have - want).max() <= 1
    assert sorted(p.name for p in clip.parent.iterdir()) == ["clip.mp4"]


def test_mp4_holds_the_frames_and_a_folder_resumes(folders, tmp_path):
    """``--out clip.mp4`` holds ``--num_frames`` frames of the asked size at Wan's 16 fps (read back with PyAV); two
    prompts into a
    folder write NNN-<slug>.mp4 (and a GIF with ``--gif``), and a re-run after one file is deleted draws that one
    alone, the same video again."""
    import av

    clip = tmp_path / "clip.mp4"
    assert _sample(folders["t2v"], clip, "--num_frames", "9") == 0
    with av.open(str(clip)) as f:
        rate = f.streams.video[0].average_rate
        decoded = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
    assert len(decoded) == 9 and decoded[0].shape[:2] == (64, 128)  # 16 x 32 shown 4x enlarged (write_video)
    assert rate == 16  # Wan's frame rate unless --fps says otherwise

    folder = tmp_path / "videos"
    argv = ["--prompt", "a second prompt", "--gif", "--save_npz", str(tmp_path / "a.npz")]
    assert _sample(folders["t2v"], folder, *argv) == 0
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["000-a-red-fox-running-through-snow.gif", "000-a-red-fox-running-through-snow.mp4",
                     "001-a-second-prompt.gif", "001-a-second-prompt.mp4"]
    first = np.load(tmp_path / "a.npz")["samples"]
    (folder / names[3]).unlink()
    argv[-1] = str(tmp_path / "b.npz")
    assert _sample(folders["t2v"], folder, *argv) == 0
    again = np.load(tmp_path / "b.npz")
    assert list(again["prompts"]) == ["a second prompt"] and np.array_equal(again["samples"][0], first[1])
    assert sorted(p.name for p in folder.iterdir()) == names


def test_first_block_cache_skips_passes_and_stays_close(folders, tmp_path):
    """diffusers' First Block Cache through ``--first_block_cache``: at a threshold no step reaches (1e-9) the
    video equals the exact one bit for bit; at 10 (every step after the first reuses the cached residual) it
    differs, but only by the tail blocks' change (a bounded difference, not noise)."""
    runs = {}
    for name, extra in (("exact", ()), ("never", ("--first_block_cache", "1e-9")),
                        ("always", ("--first_block_cache", "10"))):
        npz = tmp_path / f"{name}.npz"
        assert _sample(folders["t2v"], tmp_path / f"{name}.mp4", "--save_npz", str(npz), *extra) == 0
        runs[name] = np.load(npz)["samples"].astype(np.int16)
    assert np.array_equal(runs["never"], runs["exact"])
    diff = np.abs(runs["always"] - runs["exact"])
    assert diff.max() > 0 and diff.mean() < 20


def test_taylorseer_cache_equals_the_pipeline_with_the_same_hook(folders, tmp_path):
    """``--taylorseer_cache 2`` (``sample.video.step_cache``) over 7 steps: ditforge's loop (the guided pair in one
    call) equals diffusers' ``WanPipeline`` with the same ``TaylorSeerCacheConfig`` on its transformer (the pair in
    two calls, each its own cache context) within 1e-5; the blocks compute at steps 0, 1, 2, 4 and 6 alone (5 of 7
    calls reach the first block's self-attention); the latents move away from the exact ones (the forecast steps
    are not the model's). With ``--compile`` each block's compiled forward sits inside the cache's hook, so the
    cache's decision stays on the host (compiling is left to the GPU benchmark)."""
    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.parallel.mesh import Dist
    from ditforge.sample.load import SampleConfig
    from ditforge.sample.video import VideoSampler, step_cache

    steps, seed = 7, derive_seed(0, 0)
    folder = folders["t2v"]
    cfg = SampleConfig(ckpt=str(folder), mixed_precision="fp32", taylorseer_cache=2)
    pipe = _pipeline(folder)
    call = dict(prompt=PROMPT, height=H, width=W, num_frames=FRAMES, num_inference_steps=steps, guidance_scale=4.5,
                output_type="latent")
    exact = pipe(**call, generator=torch.Generator("cpu").manual_seed(seed)).frames
    pipe.transformer.enable_cache(step_cache(cfg)[1])
    expected = pipe(**call, generator=torch.Generator("cpu").manual_seed(seed)).frames

    pre = load_pretrained(folder, torch.device("cpu"), flag="--ckpt", sampling=True)
    sampler = VideoSampler(pre, pre.denoiser.eval(), Dist(), cfg)
    calls = []
    pre.denoiser.inner.blocks[0].attn1.register_forward_pre_hook(lambda *_: calls.append(1))
    got = sampler.denoise(pre.encode_prompt([PROMPT]), pre.encode_prompt([""]), tuple(expected.shape), seed, steps,
                          4.5)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert len(calls) == 5
    assert (got - exact).abs().max() > 1e-3

    compiled = load_pretrained(folder, torch.device("cpu"), flag="--ckpt", sampling=True)
    VideoSampler(compiled, compiled.denoiser, Dist(), SampleConfig(ckpt="-", compile="default", taylorseer_cache=2))
    for block in compiled.denoiser.inner.blocks:
        hooked = block._diffusers_hook.get_hook("taylorseer_cache")
        assert hasattr(hooked.fn_ref.original_forward, "_torchdynamo_orig_callable")


def test_quantized_attention_runs_the_self_attention_through_the_kernel(folders, tmp_path, capsys, monkeypatch):
    """``--quantized_attention`` (``models.adapters.dispatch``, ``ops.quant_attention``) on a Wan transformer with
    heads 32 wide. Routed to exact attention, the transformer's output is unchanged (1e-6) and the route saw only
    the self-attention calls: one a block, q, k and v (B, tokens, heads, 32); the cross-attention to the 512 text
    tokens stays diffusers'. Through the CLI every self-attention call of the 3 steps (2 blocks, the guided batch in
    one call) runs the 8-bit kernel (Triton's interpreter here), and the frames stay within one uint8 level of the
    exact ones on average (the kernel's own error is tested against float64 attention in
    tests/kernels/test_quant_attention.py); heads it cannot take (12 wide) are one line."""
    import torch.nn.functional as F
    from diffusers import WanTransformer3DModel

    from ditforge.models.adapters.dispatch import route_self_attention
    from ditforge.ops import quant_attention

    transformer = WanTransformer3DModel.from_pretrained(folders["t2v32"] / "transformer").eval()
    g = torch.Generator().manual_seed(0)
    x, t, text = torch.randn(1, 16, 2, 4, 4, generator=g), torch.tensor([500.0]), torch.randn(1, 512, 32, generator=g)
    with torch.no_grad():
        plain = transformer(x, t, text, return_dict=False)[0]
    calls = []

    def exact(q, k, v, scale=None):
        calls.append(q.shape)
        return F.scaled_dot_product_attention(*(a.transpose(1, 2) for a in (q, k, v)), scale=scale).transpose(1, 2)

    assert route_self_attention(transformer, exact, (32,)) == 2
    with torch.no_grad():
        routed = transformer(x, t, text, return_dict=False)[0]
    torch.testing.assert_close(routed, plain, rtol=0, atol=1e-6)
    assert calls == [torch.Size([1, 2 * 2 * 2, 2, 32])] * 2  # 2 frames x 2 x 2 patches of 2 x 2, 2 heads

    kernel_calls = []
    kernel = quant_attention.quantized_attention
    monkeypatch.setattr(quant_attention, "quantized_attention",
                        lambda q, k, v, scale=None: kernel_calls.append(q.shape) or kernel(q, k, v, scale))
    runs = {}
    for name, extra in (("exact", ()), ("quantized", ("--quantized_attention",))):
        npz = tmp_path / f"{name}.npz"
        assert _sample(folders["t2v32"], tmp_path / f"{name}.mp4", "--save_npz", str(npz), *extra) == 0
        runs[name] = np.load(npz)["samples"].astype(np.int16)
    assert kernel_calls == [torch.Size([2, 4, 2, 32])] * (2 * STEPS)  # 2 frames x 1 x 2 patches, 2 heads; cond + uncond
    assert np.abs(runs["quantized"] - runs["exact"]).mean() < 1
    capsys.readouterr()
    assert _sample(folders["t2v"], tmp_path / "c.mp4", "--quantized_attention") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "heads 32, 64, 128 wide; WanTransformer3DModel's are 12" in err[0], err


def test_ti2v_image_to_video_equals_the_pipeline(tmp_path):
    """Wan 2.2 TI2V-5B's image-to-video (``WanImageToVideoPipeline`` with ``expand_timesteps``, 48-channel latents of
    32 x 32 frames): the first frame's latents stand in for the first latent frame at timestep 0 in every pass and
    in the result; ``VideoSampler.denoise`` equals the pipeline's ``output_type="latent"`` within 1e-5 (float32), and
    the CLI's frames its frames to one uint8 level."""
    from PIL import Image

    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.parallel.mesh import Dist
    from ditforge.sample.load import SampleConfig
    from ditforge.sample.video import VideoSampler

    folder = _tiny_pipelines().make_wan22_ti2v(tmp_path / "ti2v", image_to_video=True)
    pipe = _pipeline(folder)
    png = _first_frame(tmp_path)
    image = Image.open(png).convert("RGB")
    seed, size = derive_seed(0, 0), 32
    call = dict(image=image, prompt=PROMPT, height=size, width=size, num_frames=FRAMES, num_inference_steps=STEPS,
                guidance_scale=4.5)
    expected = pipe(**call, output_type="latent", generator=torch.Generator("cpu").manual_seed(seed)).frames
    pre = load_pretrained(folder, torch.device("cpu"), flag="--ckpt", sampling=True)
    sampler = VideoSampler(pre, pre.denoiser.eval(), Dist(), SampleConfig(ckpt=str(folder), mixed_precision="fp32"))
    first = pipe.video_processor.preprocess(image, height=size, width=size)
    got = sampler.denoise(pre.encode_prompt([PROMPT]), pre.encode_prompt([""]), tuple(expected.shape), seed, STEPS,
                          4.5, pre.encode_image(first, FRAMES, images=[image]))
    assert got.shape == (1, 48, 2, 2, 2)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    npz = tmp_path / "s.npz"
    assert cli.main(["sample", "--ckpt", str(folder), "--prompt", PROMPT, "--image", str(png), "--height", "32",
                     "--width", "32", "--num_frames", str(FRAMES), "--num_sampling_steps", str(STEPS), "--cfg_scale",
                     "4.5", "--device", "cpu", "--out", str(tmp_path / "c.mp4"), "--save_npz", str(npz)]) == 0
    frames = pipe(**call, output_type="np", generator=torch.Generator("cpu").manual_seed(seed)).frames
    have, want = np.load(npz)["samples"].astype(np.int16), np.round(frames * 255).astype(np.int16)
    assert have.shape == want.shape == (1, FRAMES, 32, 32, 3)
    assert np.abs(have - want).max() <= 1


@pytest.mark.parametrize("flags, needle", [
    (("--height", "20"), "--height 20: WanPipeline takes frame sides that are multiples of 16"),
    (("--num_frames", "6"), "--num_frames 6"),
    (("--pab",), "--pab/--fora"),
    (("--image", "x.png"), "--image x.png"),
    (("--first_block_cache", "0"), "--first_block_cache: expected a threshold > 0"),
    (("--taylorseer_cache", "1"), "--taylorseer_cache: expected a full-pass interval N >= 2"),
    (("--taylorseer_cache", "2", "--first_block_cache", "0.1"), "with --first_block_cache"),
    (("--cfg_parallel",), "--cfg_parallel"),
    (("--vae_tile", "40"), "--vae_tile: expected a multiple of 32"),
    (("--plugin", "fsdp"), "--plugin fsdp: shards the transformer over the processes of torchrun"),
])
def test_bad_input_is_one_line(flags, needle, folders, tmp_path, capsys):
    assert _sample(folders["t2v"], tmp_path / "c.mp4", *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "c.mp4").exists()


@pytest.mark.parametrize("setting, needle", [({"boundary_ratio": 0.875}, "needs both transformer_2")])
def test_variants_it_cannot_sample_are_one_line(setting, needle, folders, tmp_path, capsys):
    """A boundary_ratio without a second expert: one line, exit 2."""
    import json
    import shutil

    folder = tmp_path / "wan"
    shutil.copytree(folders["t2v"], folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, **setting}))
    assert _sample(folder, tmp_path / "c.mp4") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_flags_a_pipeline_does_not_take_are_one_line(folders, tmp_path, capsys):
    """``--lora`` on Wan 2.2's two experts, and the video loop's flags on an image pipeline folder (SD, drawn by
    its own pipeline): one line each, exit 2."""
    sd = _tiny_pipelines().make_sd(tmp_path / "sd")
    cases = [(["--ckpt", str(folders["t2v22"]), "--lora", str(tmp_path)], "has two experts"),
             (["--ckpt", str(sd), "--height", "32"], "--height: StableDiffusionPipeline samples through its own"),
             (["--ckpt", str(sd), "--compile"], "--compile: StableDiffusionPipeline")]
    for argv, needle in cases:
        capsys.readouterr()
        assert cli.main(["sample", *argv, "--prompt", PROMPT, "--device", "cpu", "--out",
                         str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_fsdp_shards_and_compiles_every_expert(folders):
    """``--plugin fsdp --compile`` on Wan 2.2's two experts, in a process group of one: every block of both is
    sharded (FSDP2 renames its class) and has its forward compiled (sharding once hid the blocks from the compile
    loop), and each root frees its gathered weights after a forward (``reshard_after_forward``; FSDP2 keeps a
    root's for a backward by default). The frames of such runs are checked against one process on 2 and 4 gloo
    processes (tests/distributed/test_dist_sample_video.py); compiling is left to the GPU benchmark."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.parallel.mesh import init_distributed, shutdown
    from ditforge.sample.load import SampleConfig
    from ditforge.sample.video import VideoSampler

    d = init_distributed("cpu", group_of_one=True)
    try:
        pre = load_pretrained(folders["t2v22"], d.device, flag="--ckpt", sampling=True,
                              denoiser_device=torch.device("cpu"))
        sampler = VideoSampler(pre, pre.denoiser, d, SampleConfig(ckpt="-", plugin="fsdp", compile="default"))
        assert len(sampler.experts) == 2
        for expert in sampler.experts:
            blocks = list(expert.inner.blocks)
            assert blocks and all(isinstance(b, FSDPModule) for b in blocks)
            assert all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks)
            assert expert.inner._get_fsdp_state()._auto_reshard_after_forward is False  # None: the root keeps them
    finally:
        shutdown(d)
    assert not dist.is_initialized()


def test_vae_dtype_casts_the_vae_and_its_bf16_decode_stays_near_float32(folders):
    """``--vae_dtype bfloat16`` (``VideoSampler``): every weight of the pipeline's VAE is bf16, and the loop's decode
    of normalised latents, bf16 frames, is within 40 dB PSNR (issue 66's bar; on [-1, 1], 10 log10(4 / MSE); 48.6
    dB here) of diffusers' own float32 decode of the same latents (``latents * latents_std + latents_mean`` into
    ``AutoencoderKLWan.decode``, as ``WanPipeline``), and not equal to it (the cast took). Under ``--compile`` the
    decoder is compiled too (``VAE.compile``; not run here: inductor's CPU compile takes minutes). A value outside
    ``VAE_DTYPES`` given through the API is one line naming the flag."""
    from ditforge.errors import UserError
    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.parallel.mesh import Dist
    from ditforge.sample import sample
    from ditforge.sample.load import SampleConfig
    from ditforge.sample.video import VideoSampler

    pre = load_pretrained(folders["t2v"], torch.device("cpu"), flag="--ckpt", sampling=True)
    vae = pre.pipe.vae
    latents = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    view = (1, -1, 1, 1, 1)
    mean, std = (torch.tensor(vae.config.latents_mean).view(view), torch.tensor(vae.config.latents_std).view(view))
    with torch.no_grad():
        want = vae.decode(latents * std + mean).sample.double()
    sampler = VideoSampler(pre, pre.denoiser.eval(), Dist(), SampleConfig(ckpt="-", vae_dtype="bfloat16"))
    assert {p.dtype for p in vae.parameters()} == {torch.bfloat16}
    got = sampler.decode(latents)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (1, 3, 5, 32, 32)
    error = got.double() - want
    psnr = 10 * np.log10(4.0 / float((error ** 2).mean()))
    assert 40.0 <= psnr < 200.0, psnr
    assert vae.decoder._compiled_call_impl is None
    VideoSampler(pre, pre.denoiser, Dist(), SampleConfig(ckpt="-", compile="default"))
    assert vae.decoder._compiled_call_impl is not None
    with pytest.raises(UserError, match="^--vae_dtype: expected one of float32, bfloat16, float16, got bf16$"):
        sample(SampleConfig(ckpt=str(folders["t2v"]), prompt=[PROMPT], vae_dtype="bf16", device="cpu"))


def test_student_sampler_equals_the_k_step_recipe(folders, tmp_path):
    """``--sampler student`` (4 steps, no guidance) equals DMD2's multi-step recipe computed here with diffusers'
    own transformer and prompt encoder: sigma_k = shift s / (1 + (shift - 1) s), s = 1 - k / 4, with the
    scheduler's ``flow_shift``; x0 = x - sigma_k v at t = 1000 sigma_k, re-noised to sigma_{k+1} with fresh noise of
    the same generator; 1e-5 on the latents. An image-to-video pipeline samples so too, with its image conditioning
    (its latents are checked against diffusers in tests/finetune/test_distill_i2v.py)."""
    import inspect

    from diffusers.utils.torch_utils import randn_tensor

    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.parallel.mesh import Dist
    from ditforge.sample.load import SampleConfig
    from ditforge.sample.video import VideoSampler

    folder, steps, seed = folders["t2v"], 4, derive_seed(5, 0)
    pipe = _pipeline(folder)
    shape = (1, 16, 2, H // 8, W // 8)
    shift = pipe.scheduler.config.flow_shift
    with torch.no_grad():
        length = inspect.signature(pipe.__call__).parameters["max_sequence_length"].default  # as the pipeline pads
        text = pipe.encode_prompt(PROMPT, do_classifier_free_guidance=False, device="cpu",
                                  max_sequence_length=length)[0]
        generator = torch.Generator("cpu").manual_seed(seed)
        x = randn_tensor(shape, generator=generator, dtype=torch.float32)
        for k in range(steps):
            s = 1 - k / steps
            sigma = shift * s / (1 + (shift - 1) * s)
            v = pipe.transformer(x, torch.tensor([sigma * 1000.0]), text, return_dict=False)[0]
            x0 = x - sigma * v
            if k + 1 < steps:
                s = 1 - (k + 1) / steps
                after = shift * s / (1 + (shift - 1) * s)
                x = (1 - after) * x0 + after * randn_tensor(shape, generator=generator, dtype=torch.float32)
    pre = load_pretrained(folder, torch.device("cpu"), flag="--ckpt", sampling=True)
    sampler = VideoSampler(pre, pre.denoiser.eval(), Dist(), SampleConfig(ckpt=str(folder), mixed_precision="fp32",
                                                                          sampler="student"))
    got = sampler.denoise(pre.encode_prompt([PROMPT]), None, shape, seed, steps, 1.0)
    torch.testing.assert_close(got, x0, rtol=0, atol=1e-5)
    assert _sample(folders["i2v"], tmp_path / "c.mp4", "--sampler", "student", "--cfg_scale", "1",
                   "--image", str(_first_frame(tmp_path))) == 0
    assert (tmp_path / "c.mp4").is_file()
