"""The video families of the shared fine-tuning suite (``test_video_families.py``): each family's tiny pipeline
geometry, the diffusers class that loads its folder, what its runs record, and how its LoRA file is checked; and the
helpers of the video tests (argv, one-line errors, frames against a pipeline's). The first-step references are in
``references.py``; the runs are ``video_runs`` of conftest.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ditforge import cli

def assert_one_line_error(capsys, argv: list[str], *needles: str) -> str:
    """``ditforge ARGV`` exits 2 with one line on stderr holding every needle (every fine-tuning module)."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def video_train_argv(folder, out, size: int, frames: int, interval: int, batch: int, *extra: str) -> list[str]:
    """``ditforge train`` of a video pipeline folder on the built-in clips for the video family tests (test_wan.py,
    test_cogvideox.py, test_ltx.py, ...): fp32 on the CPU, a loss logged every step, no sample grid, no caption
    dropout."""
    return ["train", "--init_from", str(folder), "--data", "clips", "--num_frames", str(frames), "--frame_interval",
            str(interval), "--image_size", str(size), "--batch_size", str(batch), "--log_every", "1",
            "--sample_every", "0", "--mixed_precision", "fp32", "--device", "cpu", "--num_workers", "0",
            "--class_dropout_prob", "0", "--outputs", str(out), *extra]


def assert_frames_match(npz, frames, shape: tuple[int, ...]) -> None:
    """The videos ``ditforge sample --save_npz npz`` wrote equal a pipeline's ``output_type="np"`` frames (floats in
    [0, 1]) to one uint8 level, both of ``shape`` (N, T, H, W, 3)."""
    import numpy as np

    expected = np.round(frames * 255).astype(np.int16)
    got = np.load(npz)["samples"].astype(np.int16)
    assert got.shape == expected.shape == shape
    assert np.abs(got - expected).max() <= 1


def assert_image_to_video_run_samples_like_its_export(run, tmp_path, pipeline_class: str, size: int, frames: int,
                                                      guidance: float, returned: int | None = None) -> None:
    """``ditforge sample --image`` of an image-to-video run draws what the run's ``--format diffusers`` export draws
    from the same seed, prompt and random 24-bit first frame (``pipeline_class`` of diffusers), to one uint8 level
    (test_wan.py, test_ltx.py, ...); a call for ``frames`` frames returns ``returned`` (default ``frames``)."""
    import diffusers
    import numpy as np
    from PIL import Image

    from ditforge.data.sampler import derive_seed

    assert cli.main(["export", "--ckpt", str(run), "--out", str(tmp_path / "exported"), "--format", "diffusers"]) == 0
    pipe = getattr(diffusers, pipeline_class).from_pretrained(str(tmp_path / "exported"), local_files_only=True)
    png = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(png)
    prompt, npz = "a rabbit on a green hill", tmp_path / "s.npz"
    assert cli.main(["sample", "--ckpt", str(run), "--prompt", prompt, "--image", str(png), "--num_sampling_steps",
                     "3", "--cfg_scale", str(guidance), "--out", str(tmp_path / "clip.mp4"), "--save_npz", str(npz),
                     "--device", "cpu"]) == 0
    video = pipe(image=Image.open(png).convert("RGB"), prompt=[prompt], num_inference_steps=3, guidance_scale=guidance,
                 height=size, width=size, num_frames=frames,
                 generator=torch.Generator("cpu").manual_seed(derive_seed(0, 0)), output_type="np").frames
    assert_frames_match(npz, video, (1, returned or frames, size, size, 3))


# The two runs every family shares (``video_runs``): full fine-tuning and LoRA, 4 steps each.
KINDS = {"full": ["--lr", "1e-3"], "lora": ["--lora_rank", "4", "--lr", "1e-2"]}


def _wan_lora_outputs(pipe, ours, load):
    """Wan: latents (2, 16, 2, 2, 2), times in [0, 1000), UMT5 states (2, 512, 32); ditforge's output is its
    wrapped transformer's."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2, 16, 2, 2, 2, generator=g)
    t = torch.rand(2, generator=g) * 1000
    states = torch.randn(2, 512, 32, generator=g)

    def call(model):
        with torch.no_grad():
            return model(hidden_states=x, timestep=t, encoder_hidden_states=states, return_dict=False)[0]

    base = call(pipe.transformer)
    load()
    return base, call(pipe.transformer), call(ours.inner)


def _cogvideox_lora_outputs(pipe, ours, load):
    """CogVideoX: latents (2, 4, 3, 4, 4), frames first for the transformer, integer timesteps, T5 states
    (2, 226, 32), the pipeline's rotary positions."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2, 4, 3, 4, 4, generator=g)
    t = torch.randint(0, 1000, (2,), generator=g)
    states = torch.randn(2, 226, 32, generator=g)
    rotary = pipe._prepare_rotary_positional_embeddings(32, 32, 3, torch.device("cpu"))

    def call(model):
        with torch.no_grad():
            return model(hidden_states=x.transpose(1, 2), timestep=t, encoder_hidden_states=states,
                         image_rotary_emb=rotary, return_dict=False)[0].transpose(1, 2)

    base = call(pipe.transformer)
    load()
    theirs = call(pipe.transformer)
    with torch.no_grad():
        mine = ours.denoise(x, t, states)
    return base, theirs, mine


def _ltx_lora_outputs(pipe, ours, load):
    """LTX-Video: latents (2, 8, 2, 8, 8), times in [0, 1000), T5 states (2, 128, 32) and their mask, through
    ditforge's denoiser around the pipeline's transformer (packing, rotary scale)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2, 8, 2, 8, 8, generator=g)
    t = torch.rand(2, generator=g) * 1000
    states = torch.randn(2, 128, 32, generator=g)
    mask = torch.arange(128).expand(2, 128) < torch.tensor([[9], [30]])
    base_model = type(ours)(pipe.transformer, ours.vae_scale)
    base_model.attach_pipeline(pipe)
    with torch.no_grad():
        base = base_model.denoise(x, t, states, mask)
        load()
        theirs, mine = base_model.denoise(x, t, states, mask), ours.denoise(x, t, states, mask)
    return base, theirs, mine


def _hunyuan_video_lora_outputs(pipe, ours, load):
    """HunyuanVideo: latents (2, 4, 2, 2, 2), times in [0, 1000), Llama states (2, 256, 16) and their mask, CLIP
    pooled states (2, 8), the embedded guidance 1000."""
    g = torch.Generator().manual_seed(1234)
    x, t = torch.randn(2, 4, 2, 2, 2, generator=g), torch.rand(2, generator=g) * 1000
    states, pooled = torch.randn(2, 256, 16, generator=g), torch.randn(2, 8, generator=g)
    mask = torch.arange(256).expand(2, 256) < torch.tensor([[7], [20]])
    guidance = torch.full((2,), 1000.0)

    def call(model):
        with torch.no_grad():
            return model(hidden_states=x, timestep=t, encoder_hidden_states=states, encoder_attention_mask=mask,
                         pooled_projections=pooled, guidance=guidance, return_dict=False)[0]

    base = call(pipe.transformer)
    load()
    theirs = call(pipe.transformer)
    with torch.no_grad():
        mine = ours.denoise(x, t, states, mask, pooled)
    return base, theirs, mine


@dataclass(frozen=True)
class VideoFamily:
    """A text-to-video family of the shared suite: its tiny pipeline's run geometry (pixels, frames, frame
    interval, batch), the diffusers class loading its folder, the ``config.yaml`` entries its runs record
    (``section.key``), the kinds whose resume is tested, ``ditforge sample``'s steps and guidance against the
    pipeline's own call (``gif``: into a folder with ``--gif``; ``generator_list``: the call takes ``[g]``), and
    ``lora_outputs(pipe, ours, load)`` -> (base, after ``load()`` of the LoRA file, ditforge's LoRA model)."""

    size: int
    frames: int
    interval: int
    batch: int
    pipeline: str
    config: dict
    resume: tuple[str, ...]
    sample_steps: int
    cfg: float
    lora_outputs: Callable
    gif: bool = False
    generator_list: bool = False

    def argv(self, folder, out, *extra: str) -> list[str]:
        return video_train_argv(folder, out, self.size, self.frames, self.interval, self.batch, *extra)


VIDEO = {
    # 16 px, 5 frames: latents 16 x 2 x 2 x 2; flips are off by default for a video pipeline (they acted on the
    # latents of a 3-D VAE, which are not the flipped clip's latents): step 0 of seed 0 draws a flip for its second
    # row, so the old default (on) fails the first loss
    "wan": VideoFamily(16, 5, 2, 2, "WanPipeline",
                       {"model.family": "wan", "model.objective": "flow", "model.flow_shift": 3.0,
                        "model.num_frames": 2, "data.num_frames": 5, "data.random_flip": False},
                       ("full", "lora"), 3, 4.0, _wan_lora_outputs, gif=True, generator_list=True),
    # 32 px, 9 = 8 x 1 + 1 frames: latents 4 x 3 x 4 x 4; the v objective read from the scheduler
    "cogvideox": VideoFamily(32, 9, 1, 2, "CogVideoXPipeline",
                             {"model.family": "cogvideox", "model.objective": "v", "model.num_frames": 3,
                              "data.num_frames": 9},
                             ("full", "lora"), 4, 4.0, _cogvideox_lora_outputs),
    # 32 px, 5 = 4 x 1 + 1 frames: latents 8 x 2 x 8 x 8; the dynamic shift is checked against the reference's
    "ltx": VideoFamily(32, 5, 2, 2, "LTXPipeline", {"model.family": "ltx", "model.objective": "flow"},
                       ("lora",), 4, 3.0, _ltx_lora_outputs),
    # 16 px, 5 frames: latents 4 x 2 x 2 x 2; the scheduler's shift 7, guidance embedded
    "hunyuan_video": VideoFamily(16, 5, 2, 2, "HunyuanVideoPipeline",
                                 {"model.family": "hunyuan_video", "model.objective": "flow",
                                  "model.flow_shift": 7.0},
                                 ("lora",), 4, 6.0, _hunyuan_video_lora_outputs),
}
