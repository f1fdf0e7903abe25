"""``ditforge sample`` for Wan2.1-VACE (``models/adapters/wan_vace.py``, ``sample.video``): ditforge's loop against
diffusers' ``WanVACEPipeline`` from the same noise on the tiny random pipeline of ``tiny_pipelines.make_vace``
(float32 on the CPU: latents within 1e-5, the CLI's frames within one uint8 level) with one and two reference images
and with a control video and mask; and the one-line errors (exit 2) of the reference flags."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ditforge import cli
from ditforge.data.sampler import derive_seed
from ditforge.data.video import read_clip, write_video

from test_sample_video import PROMPT, _pipeline, _tiny_pipelines

pytestmark = pytest.mark.usefixtures("one_thread")

H, W, FRAMES, STEPS = 16, 32, 5, 2


@pytest.fixture(scope="module")
def vace(tmp_path_factory, one_thread_module):
    root = tmp_path_factory.mktemp("vace")
    tiny = _tiny_pipelines()
    folder, wan = tiny.make_vace(root / "vace"), tiny.make_wan(root / "wan")
    rng = np.random.default_rng(5)
    refs = []
    for i, size in enumerate(((24, 40), (40, 24))):  # scaled to fit 16 x 32, letter- and pillar-boxed in white
        refs.append(root / f"ref{i}.png")
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(refs[-1])
    video = write_video(rng.integers(0, 256, (FRAMES, H, W, 3), dtype=np.uint8), root / "control.mp4")
    mask = np.zeros((FRAMES, H, W, 3), dtype=np.uint8)
    mask[1:] = 255  # first-frame control: keep frame 0, generate the others
    mask = write_video(mask, root / "mask.mp4")
    return {"folder": folder, "wan": wan, "refs": refs, "video": video, "mask": mask, "pipe": _pipeline(folder)}


def _frames(path) -> list:
    """A clip's first FRAMES frames as PIL images, as ``read_control`` reads them (the pipeline then gets the same)."""
    return [Image.fromarray(f) for f in read_clip(path, FRAMES, 1, lambda _: 0)[0]]


def _argv(folder, out, *extra) -> list[str]:
    return ["sample", "--ckpt", str(folder), "--prompt", PROMPT, "--height", str(H), "--width", str(W),
            "--num_frames", str(FRAMES), "--num_sampling_steps", str(STEPS), "--cfg_scale", "4.5", "--device", "cpu",
            "--out", str(out), *extra]


@pytest.mark.parametrize("case", ["one_reference", "two_references", "video_and_mask", "video_and_mask_alone"])
def test_loop_equals_the_pipeline(case, vace, tmp_path):
    """``VideoSampler.denoise`` on the adapter's ``encode_control`` equals ``WanVACEPipeline``'s
    ``output_type="latent"`` (all R + T' latent frames, the references' first) within 1e-5 from the same generator;
    the CLI's frames (``--save_npz``, the R reference frames dropped before decoding) equal the pipeline's
    ``output_type="np"`` to one uint8 level. ``video_and_mask``: one reference, a 5-frame control clip and a mask
    clip keeping its first frame (first-frame control); ``video_and_mask_alone``: the same without a reference (masked
    video-to-video, R = 0)."""
    from ditforge.models.adapters.pipeline import load_pretrained
    from ditforge.parallel.mesh import Dist
    from ditforge.sample.load import SampleConfig
    from ditforge.sample.video import VideoSampler

    pipe = vace["pipe"]
    paths = vace["refs"][:{"two_references": 2, "video_and_mask_alone": 0}.get(case, 1)]
    refs = [Image.open(p).convert("RGB") for p in paths]
    video = mask = None
    flags = [a for p in paths for a in ("--reference_image", str(p))]
    if case.startswith("video_and_mask"):
        video, mask = _frames(vace["video"]), _frames(vace["mask"])
        flags += ["--video", str(vace["video"]), "--mask", str(vace["mask"])]
    seed = derive_seed(0, 0)
    call = dict(prompt=PROMPT, height=H, width=W, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=4.5,
                reference_images=refs or None, video=video, mask=mask)
    expected = pipe(**call, output_type="latent", generator=torch.Generator("cpu").manual_seed(seed)).frames

    pre = load_pretrained(vace["folder"], torch.device("cpu"), flag="--ckpt", sampling=True)
    assert pre.denoiser.family == "vace"
    control, prepended = pre.denoiser.encode_control(pipe, refs, video, mask, H, W, FRAMES, torch.device("cpu"))
    assert prepended == len(refs)
    sampler = VideoSampler(pre, pre.denoiser.eval(), Dist(), SampleConfig(ckpt=str(vace["folder"]),
                                                                           mixed_precision="fp32"))
    got = sampler.denoise(pre.encode_prompt([PROMPT]), pre.encode_prompt([""]), tuple(expected.shape), seed, STEPS,
                          4.5, control)
    assert got.shape == expected.shape == (1, 16, 2 + len(refs), H // 8, W // 8)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    uncontrolled = {"reference_images": None} if refs else {"video": None, "mask": None}
    unreferenced = pipe(**{**call, **uncontrolled}, output_type="latent",
                        generator=torch.Generator("cpu").manual_seed(seed)).frames
    assert (got[:, :, len(refs):] - unreferenced).abs().max() > 1e-3  # the references / the control act

    npz = tmp_path / "s.npz"
    assert cli.main(_argv(vace["folder"], tmp_path / "clip.mp4", "--save_npz", str(npz), *flags)) == 0
    frames = pipe(**call, output_type="np", generator=torch.Generator("cpu").manual_seed(seed)).frames
    want = np.round(frames * 255).astype(np.int16)
    have = np.load(npz)["samples"].astype(np.int16)
    assert have.shape == want.shape == (1, FRAMES, H, W, 3)
    assert np.abs(have - want).max() <= 1


def test_bad_reference_inputs_are_one_line(vace, tmp_path, capsys):
    """Exit 2 and one line naming the flag: ``--reference_image`` for a pipeline without references (Wan 2.1
    text-to-video), a reference file that does not exist, a mask whose size differs from the video's (3 frames
    against 5; and one 16 x 16 image against the clip's frames)."""
    short = write_video(np.zeros((3, H, W, 3), dtype=np.uint8), tmp_path / "short.mp4")
    narrow = tmp_path / "narrow.png"
    Image.new("RGB", (16, 16), "white").save(narrow)
    ref = str(vace["refs"][0])
    height, width = read_clip(vace["video"], 1, 1, lambda _: 0)[0].shape[1:3]  # write_video enlarges tiny clips
    size = f"{width}x{height}"
    cases = [((vace["wan"], "--reference_image", ref), f"--reference_image: {vace['wan']} is a WanPipeline"),
             ((vace["folder"], "--reference_image", str(tmp_path / "none.png")),
              f"--reference_image {tmp_path / 'none.png'}: no such file"),
             ((vace["folder"], "--reference_image", ref, "--video", str(vace["video"]), "--mask", str(short)),
              f"--mask {short}: 3 frames of {size}; expected the video's size, 5 frames of {size}"),
             ((vace["folder"], "--reference_image", ref, "--video", str(vace["video"]), "--mask", str(narrow)),
              f"--mask {narrow}: 5 frames of 16x16; expected the video's size, 5 frames of {size}"),
             ((vace["folder"], "--reference_image", ref, "--first_block_cache", "0.05"),
              "--first_block_cache: WanVACETransformer3DModel adds to its hidden states between its blocks"),
]
    for (folder, *flags), message in cases:
        capsys.readouterr()
        assert cli.main(_argv(folder, tmp_path / "x.mp4", *flags)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
