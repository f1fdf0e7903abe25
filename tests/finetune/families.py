"""The video families of the shared fine-tuning suite: the text-to-video rows (``VIDEO``, ``test_video_families.py``:
each family's tiny pipeline geometry, the diffusers class that loads its folder, what its runs record, and how its
LoRA file is checked) and the image-to-video rows (``I2V``, ``test_i2v_families.py``); and the helpers of the video
tests (argv, one-line errors, config entries, frames against a pipeline's). The first-step references are in
``references.py``; the runs are ``video_runs`` and ``i2v_runs`` of conftest.py."""

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



def assert_lora_file_loads(pipe, ours, lora, inputs: dict, margin: float) -> None:
    """``pipe.load_lora_weights(lora)`` (a ``--format lora`` export) gives ditforge's LoRA model ``ours``'s
    transformer output on ``inputs`` (the transformer's keywords) within 1e-5 of its largest magnitude; the base
    transformer, before the load, is off by more than ``margin`` times that."""
    with torch.no_grad():
        before = pipe.transformer(**inputs)[0]
        pipe.load_lora_weights(str(lora))
        theirs, mine = pipe.transformer(**inputs)[0], ours.inner(**inputs)[0]
    tol = 1e-5 * mine.abs().max()
    assert (theirs - mine).abs().max() <= tol
    assert (before - mine).abs().max() > margin * tol

def assert_frames_match(npz, frames, shape: tuple[int, ...]) -> None:
    """The videos ``ditforge sample --save_npz npz`` wrote equal a pipeline's ``output_type="np"`` frames (floats in
    [0, 1]) to one uint8 level, both of ``shape`` (N, T, H, W, 3)."""
    import numpy as np

    expected = np.round(frames * 255).astype(np.int16)
    got = np.load(npz)["samples"].astype(np.int16)
    assert got.shape == expected.shape == shape
    assert np.abs(got - expected).max() <= 1


def config_entry(config: dict, key: str):
    """The entry ``section.key`` of a run's ``config.yaml`` (loaded)."""
    section, name = key.split(".")
    return config[section][name]


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
class Geometry:
    """A tiny pipeline's run geometry: pixels, frames, frame interval, batch (``video_train_argv``)."""

    size: int
    frames: int
    interval: int
    batch: int

    def argv(self, folder, out, *extra: str) -> list[str]:
        return video_train_argv(folder, out, self.size, self.frames, self.interval, self.batch, *extra)


@dataclass(frozen=True)
class VideoFamily(Geometry):
    """A text-to-video family of the shared suite: its tiny pipeline's run geometry (``Geometry``), the diffusers
    class loading its folder, the ``config.yaml`` entries its runs record
    (``section.key``), the kinds whose resume is tested, ``ditforge sample``'s steps and guidance against the
    pipeline's own call (``gif``: into a folder with ``--gif``; ``generator_list``: the call takes ``[g]``), and
    ``lora_outputs(pipe, ours, load)`` -> (base, after ``load()`` of the LoRA file, ditforge's LoRA model)."""

    pipeline: str
    config: dict
    resume: tuple[str, ...]
    sample_steps: int
    cfg: float
    lora_outputs: Callable
    gif: bool = False
    generator_list: bool = False


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


@dataclass(frozen=True)
class ImageToVideoFamily(Geometry):
    """An image-to-video row of the shared suite (``test_i2v_families.py``), keyed by its tiny pipeline's builder
    (``tiny_pipelines.BUILDERS``; fixture ``<name>_pipeline``): the run geometry (``Geometry``), the diffusers class
    loading its folder, its one run (``i2v_runs``: ``steps`` steps of ``KINDS[kind]``) and the ``config.yaml``
    entries it records, and ``ditforge sample --image``'s guidance against the pipeline's own call (3 steps), which
    returns ``returned`` frames (None: ``frames``). The first-step reference is
    ``references.image_to_video_first_loss``."""

    pipeline: str
    kind: str
    steps: int
    config: dict
    cfg: float
    returned: int | None = None


I2V = {
    # Wan 2.1 I2V, 16 px: the first frame and 4 zero frames through the VAE, a mask and the CLIP image states
    # (16 + 4 + 16 = 36 channels); its LoRA run is also test_wan.py's (caption dropout, features, errors)
    "wan_i2v": ImageToVideoFamily(16, 5, 2, 2, "WanImageToVideoPipeline", "lora", 3,
                                  {"model.family": "wan_i2v", "model.in_channels": 16, "data.random_flip": False},
                                  4.0),
    # Wan 2.2 TI2V-5B, 32 px (its VAE folds 2 x 2 pixels: spatial factor 16): the first latent frame given
    "wan22_ti2v_i2v": ImageToVideoFamily(32, 5, 2, 2, "WanImageToVideoPipeline", "full", 1,
                                         {"model.family": "wan_i2v", "model.in_channels": 48}, 4.0),
    # CogVideoX 1.0 I2V, 32 px, 9 frames: the noised first frame's latents concatenated to the channels
    "cogvideox_i2v": ImageToVideoFamily(32, 9, 1, 2, "CogVideoXImageToVideoPipeline", "full", 2,
                                        {"model.family": "cogvideox_i2v", "model.objective": "v"}, 4.0),
    # LTX-Video I2V, 32 px: the first latent frame given at timestep 0
    "ltx_i2v": ImageToVideoFamily(32, 5, 2, 2, "LTXImageToVideoPipeline", "full", 1,
                                  {"model.family": "ltx_i2v", "model.objective": "flow"}, 3.0),
    # HunyuanVideo-I2V (token_replace), 16 px: the first latent frame given, the prompt encoded with the image,
    # guidance embedded at 6
    "hunyuan_video_i2v": ImageToVideoFamily(16, 5, 2, 2, "HunyuanVideoImageToVideoPipeline", "full", 1,
                                            {"model.family": "hunyuan_video_i2v", "model.flow_shift": 7.0}, 6.0),
    # the 33-channel model (latent_concat), LoRA: the image latents and a mask concatenated to the channels; its
    # pipeline drops the first latent frame's 4 decoded frames
    "hunyuan_video_i2v_33ch": ImageToVideoFamily(16, 5, 2, 2, "HunyuanVideoImageToVideoPipeline", "lora", 1,
                                                 {"model.family": "hunyuan_video_i2v"}, 1.0, returned=1),
}
