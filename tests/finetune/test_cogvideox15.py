"""CogVideoX 1.5 (a transformer with ``patch_size_t`` 2: latent frames patched in pairs; I2V with the ``ofs``
embedding) on the tiny random folders ``tiny_pipelines.make_cogvideox(..., patch_size_t=2)`` (32 px, 9 frames: 3
latent frames, which its pipelines pad in front to 4): the denoiser's output against the transformer as the
pipelines' own loops call it, ``ditforge sample`` of the folders against the pipelines' ``__call__``, a LoRA step
against diffusers' arithmetic and its checkpoint sampled as the pipeline with its LoRA file samples, and ``ditforge
distill`` of the text-to-video teacher (its teacher call, exact resume, its student sampled) and of the
image-to-video one (a smoke run). What 1.0 and 1.5 share is in test_cogvideox.py and the shared suites."""

from __future__ import annotations

import pytest
import torch

from ditforge import cli
from ditforge.data.sampler import derive_seed
from ditforge.train.logging import read_metrics
from families import KINDS, VIDEO, assert_frames_match
from references import _first_batch, cogvideox_loss
from test_distill_video import (COG_SIZE, SEED, assert_resume_exact, distill_argv, prompt_file,  # noqa: F401
                                recorded_run)

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE, FRAMES, STEPS, CFG, PROMPT = 32, 9, 3, 4.0, "a rabbit on a green hill"
PIPELINES = {"cogvideox15": "CogVideoXPipeline", "cogvideox15_i2v": "CogVideoXImageToVideoPipeline"}


def _pipeline(name: str, folder):
    import diffusers

    pipe = getattr(diffusers, PIPELINES[name]).from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(tmp_path):
    """A random 24-bit first frame, written as ``first.png``: (its path, the PIL image)."""
    import numpy as np
    from PIL import Image

    png = tmp_path / "first.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(png)
    return png, Image.open(png).convert("RGB")


def _record_calls(monkeypatch, calls: list) -> None:
    """Every call of ``CogVideoXTransformer3DModel.forward``: (its keywords, its output), appended to ``calls``."""
    from diffusers import CogVideoXTransformer3DModel

    forward = CogVideoXTransformer3DModel.forward

    def recorded(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        calls.append((dict(kwargs), out[0].detach().clone()))
        return out

    monkeypatch.setattr(CogVideoXTransformer3DModel, "forward", recorded)


@pytest.mark.parametrize("name", list(PIPELINES))
def test_denoiser_is_the_transformer_as_the_pipeline_calls_it(name, request, tmp_path, monkeypatch):
    """The pipeline's own call (2 steps, guidance 4) records its transformer's inputs: latents frames first, 4 latent
    frames (9 frames' 3 padded in front), the pipeline's rotary tables, I2V's image latents on the channels and
    ``ofs`` 2.0. ditforge's denoiser on the same latents (channels first, the image latents as ``image_condition``)
    gives the recorded output within 1e-6 (float32, the same transformer). On 3 latent frames (a training clip's)
    it equals the transformer on the first frame repeated in front, that frame's output dropped (THUDM/CogVideo's 1.5
    fine-tuning's padding), I2V's image conditioning (an image latent, then zeros) that of 4 frames, 1e-6; I2V's
    ``ofs`` matters (1.0 in its place moves the output by over 1e-3)."""
    from ditforge.models.adapters.pipeline import load_pretrained

    folder = request.getfixturevalue(f"{name}_pipeline")
    pipe, image = _pipeline(name, folder), {}
    if name.endswith("i2v"):
        image = {"image": _image(tmp_path)[1]}
    calls: list = []
    _record_calls(monkeypatch, calls)
    with torch.no_grad():
        pipe(prompt=[PROMPT], num_inference_steps=2, guidance_scale=CFG, height=SIZE, width=SIZE, num_frames=FRAMES,
             generator=torch.Generator().manual_seed(0), output_type="latent", **image)
    monkeypatch.undo()
    assert len(calls) == 2
    den = load_pretrained(folder, torch.device("cpu")).denoiser.eval()
    assert (den.padding_frames(3), den.padding_frames(4), den.fps) == (1, 0, 16)
    kwargs, want = calls[-1]
    x = kwargs["hidden_states"].transpose(1, 2)  # (B, C, T', h, w)
    assert x.shape == (2, pipe.transformer.config.in_channels, 4, 4, 4)
    split = {"image_condition": x[:, 4:]} if image else {}
    with torch.no_grad():
        got = den(x[:, :4], kwargs["timestep"], encoder_hidden_states=kwargs["encoder_hidden_states"], **split)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=1e-6)
    g = torch.Generator().manual_seed(5)
    x, latent = torch.randn(2, 4, 3, 4, 4, generator=g), torch.randn(2, 4, 1, 4, 4, generator=g)
    t, states = torch.randint(0, 1000, (2,), generator=g), torch.randn(2, 226, 32, generator=g)
    ofs = {"ofs": torch.tensor([2.0])} if image else {}

    def transformer(extra):
        padded = torch.cat([x[:, :, :1], x], dim=2)
        if image:
            padded = torch.cat([padded, torch.cat([latent, torch.zeros(2, 4, 3, 4, 4)], dim=2)], dim=1)
        return pipe.transformer(hidden_states=padded.transpose(1, 2), encoder_hidden_states=states, timestep=t,
                                image_rotary_emb=pipe._prepare_rotary_positional_embeddings(SIZE, SIZE, 4, x.device),
                                return_dict=False, **extra)[0].transpose(1, 2)[:, :, 1:]

    split = {"image_condition": torch.cat([latent, torch.zeros(2, 4, 2, 4, 4)], dim=2)} if image else {}
    with torch.no_grad():
        got = den(x, t, encoder_hidden_states=states, **split)
        torch.testing.assert_close(got, transformer(ofs), rtol=0, atol=1e-6)
        if image:
            assert (got - transformer({"ofs": torch.tensor([1.0])})).abs().max() > 1e-3


@pytest.mark.parametrize("name", list(PIPELINES))
def test_sample_of_the_folder_is_the_pipelines_call(name, request, tmp_path, monkeypatch):
    """``ditforge sample --ckpt FOLDER`` (3 steps, guidance 4, 32 x 32 x 9) decodes the latents the pipeline's own
    call steps from the same seed (its ``output_type="latent"``: 4 latent frames, the first one its padding) less
    their first frame, within 1e-5; and writes its frames (the pipeline's decode of those latents) to one uint8
    level. I2V: the same first frame (``--image``), its latents drawn from the seed's generator before the noise."""
    from ditforge.sample.video import VideoSampler

    folder = request.getfixturevalue(f"{name}_pipeline")
    png, image = _image(tmp_path)
    extra, call = (["--image", str(png)], {"image": image}) if name.endswith("i2v") else ([], {})
    decoded: list = []
    decode = VideoSampler.decode
    monkeypatch.setattr(VideoSampler, "decode", lambda self, z: decoded.append(z.clone()) or decode(self, z))
    npz = tmp_path / "s.npz"
    assert cli.main(["sample", "--ckpt", str(folder), "--prompt", PROMPT, "--num_sampling_steps", str(STEPS),
                     "--cfg_scale", str(CFG), "--image_size", str(SIZE), "--num_frames", str(FRAMES), "--device",
                     "cpu", "--out", str(tmp_path / "clip.mp4"), "--save_npz", str(npz), *extra]) == 0
    pipe = _pipeline(name, folder)
    with torch.no_grad():
        latents = pipe(prompt=[PROMPT], num_inference_steps=STEPS, guidance_scale=CFG, height=SIZE, width=SIZE,
                       num_frames=FRAMES, generator=torch.Generator().manual_seed(derive_seed(0, 0)),
                       output_type="latent", **call).frames
        assert latents.shape == (1, 4, 4, 4, 4) and len(decoded) == 1
        torch.testing.assert_close(decoded[0], latents[:, 1:].transpose(1, 2), rtol=0, atol=1e-5)
        frames = pipe.video_processor.postprocess_video(pipe.decode_latents(latents[:, 1:]), output_type="np")
    assert_frames_match(npz, frames, (1, FRAMES, SIZE, SIZE, 3))


@pytest.mark.parametrize("name", list(PIPELINES))
def test_lora_step_and_its_checkpoint_samples(name, request, tmp_path):
    """One LoRA step (rank 4) of each folder on the clips (32 px, 9 frames; I2V: each clip's noised first frame). The
    text-to-video loss equals ``references.cogvideox_loss`` (diffusers' scheduler and transformer, the v-prediction
    MSE weighted as ``train_cogvideox_lora.py``) with the noisy latents' first frame repeated in front and its output
    dropped, within 1e-5 relative. ``sample --ckpt RUN`` (2 steps; I2V ``--image``) draws the video the pipeline draws
    with the run's LoRA file (``--format lora``, ``load_lora_weights``) from the same seed, to one uint8 level."""
    folder, run = request.getfixturevalue(f"{name}_pipeline"), tmp_path / "run"
    spec = VIDEO["cogvideox"]  # the 1.0 rows' geometry: 32 px, 9 frames, batch 2
    assert cli.main(spec.argv(folder, run, "--max_steps", "1", *KINDS["lora"])) == 0
    pipe, loss = _pipeline(name, folder), read_metrics(run / "metrics.jsonl")[0]["loss"]
    if name.endswith("i2v"):
        png, image = _image(tmp_path)
        extra, call = ["--image", str(png)], {"image": image}
        assert loss == loss and loss > 0
    else:
        extra, call = [], {}
        forward = pipe.transformer.forward

        def padded(hidden_states, **kwargs):  # frames first: the first latent frame repeated in front, then dropped
            out = forward(hidden_states=torch.cat([hidden_states[:, :1], hidden_states], dim=1), **kwargs)
            return (out[0][:, 1:],)

        pipe.transformer.forward = padded
        items = _first_batch("clips", spec.size, spec.frames, spec.interval, spec.batch)
        reference = cogvideox_loss(pipe, torch.stack([it["video"] for it in items]), [it["text"] for it in items])
        del pipe.transformer.forward
        assert loss == pytest.approx(reference, rel=1e-5)
    lora, npz = tmp_path / "lora", tmp_path / "s.npz"
    assert cli.main(["export", "--ckpt", str(run), "--format", "lora", "--out", str(lora)]) == 0
    assert cli.main(["sample", "--ckpt", str(run), "--prompt", PROMPT, "--num_sampling_steps", "2", "--cfg_scale",
                     str(CFG), "--device", "cpu", "--out", str(tmp_path / "clip.mp4"), "--save_npz", str(npz),
                     *extra]) == 0
    pipe.load_lora_weights(str(lora))
    video = pipe(prompt=[PROMPT], num_inference_steps=2, guidance_scale=CFG, height=SIZE, width=SIZE,
                 num_frames=FRAMES, generator=torch.Generator().manual_seed(derive_seed(0, 0)), output_type="np",
                 **call).frames
    assert_frames_match(npz, video, (1, FRAMES, SIZE, SIZE, 3))


@pytest.fixture(scope="module")
def cog15_run(cogvideox15_pipeline, prompt_file, tmp_path_factory):  # noqa: F811
    """4 iterations of ``ditforge distill`` of the tiny CogVideoX 1.5 (test_distill_video's recipe, 32 x 32 x 9)."""
    return recorded_run(cogvideox15_pipeline, prompt_file, tmp_path_factory.mktemp("distill_cog15") / "run",
                        *COG_SIZE)


def test_distill_teacher_is_the_pipelines_guided_v(cog15_run, cogvideox15_pipeline):
    """Iteration 1's teacher, on the student's latents (B, 4, 4, 4, 4): the clip's 3 latent frames and the one the
    pipeline pads them with in front (``additional_frames``), what its own call draws; diffusers' transformer on them
    (frames first, the pipeline's rotary tables of 4 latent frames, [negative; prompt] states), guided ``uncond + 6
    (text - uncond)`` (CogVideoXPipeline's default), 1e-5; every logged loss finite."""
    from test_distill_video import BATCH, COG_SCALE, PROMPTS

    run, seen = cog15_run
    pipe = _pipeline("cogvideox15", cogvideox15_pipeline)
    g = torch.Generator().manual_seed(derive_seed(SEED, 1))
    rows = torch.randint(len(PROMPTS), (BATCH,), generator=g).tolist()
    x, t, got, _ = seen["teacher"][0]
    assert x.shape == (BATCH, 4, 4, 4, 4)
    with torch.no_grad():
        embeds, negative = pipe.encode_prompt([PROMPTS[i] for i in rows], do_classifier_free_guidance=True,
                                              max_sequence_length=226)
        latents = x.transpose(1, 2)
        out = pipe.transformer(hidden_states=torch.cat([latents] * 2), encoder_hidden_states=torch.cat(
            [negative, embeds]), timestep=torch.cat([t, t]), return_dict=False,
            image_rotary_emb=pipe._prepare_rotary_positional_embeddings(SIZE, SIZE, 4, x.device))[0].float()
    uncond, text = out.chunk(2)
    torch.testing.assert_close(got, (uncond + COG_SCALE * (text - uncond)).transpose(1, 2), rtol=1e-5, atol=1e-5)
    lines = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and lines[0]["dmd_grad_norm"] > 0
    assert all(torch.isfinite(torch.tensor(v)) for r in lines for v in r.values())


def test_distilled_student_samples(cog15_run, tmp_path):
    """``sample --ckpt RUN`` runs the student's 2 steps on the 4 latent frames it was distilled on (the clip's 3 and
    the pipeline's padding frame, dropped before decoding) and writes 9 frames."""
    import numpy as np

    npz = tmp_path / "s.npz"
    assert cli.main(["sample", "--ckpt", str(cog15_run[0]), "--prompt", PROMPT, "--device", "cpu", "--num_frames",
                     str(FRAMES), "--out", str(tmp_path / "a.mp4"), "--save_npz", str(npz)]) == 0
    assert np.load(npz)["samples"].shape == (1, FRAMES, SIZE, SIZE, 3)


def test_distill_resume_equals_uninterrupted(cog15_run, cogvideox15_pipeline, prompt_file, tmp_path):  # noqa: F811
    assert_resume_exact(cog15_run[0], cogvideox15_pipeline, prompt_file, tmp_path, *COG_SIZE)


def test_i2v_distils_and_its_student_samples(cogvideox15_i2v_pipeline, prompt_file, tmp_path):  # noqa: F811
    """The image-to-video folder as ``--teacher`` (one first frame, ``--image``): two iterations (a generator step,
    then a critic step) with finite losses, and ``sample --ckpt RUN --image IMG`` in the student's steps writes 9
    frames."""
    import numpy as np

    png, _ = _image(tmp_path)
    run, npz = tmp_path / "run", tmp_path / "s.npz"
    assert cli.main(distill_argv(cogvideox15_i2v_pipeline, prompt_file, run, "--max_steps", "2", "--image", str(png),
                                 *COG_SIZE)) == 0
    lines = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2] and "generator_loss" in lines[0]
    assert all(torch.isfinite(torch.tensor(v)) for r in lines for v in r.values())
    assert cli.main(["sample", "--ckpt", str(run), "--prompt", PROMPT, "--image", str(png), "--device", "cpu",
                     "--num_frames", str(FRAMES), "--out", str(tmp_path / "a.mp4"), "--save_npz", str(npz)]) == 0
    assert np.load(npz)["samples"].shape == (1, FRAMES, SIZE, SIZE, 3)
