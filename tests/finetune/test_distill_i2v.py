"""``ditforge distill`` of an image-to-video pipeline (``train/distill_pipeline.py``) on the tiny random Wan 2.1 I2V
folder (``wan_i2v_pipeline``): the first frames from ``--image DIR``, drawn as the prompts are. The teacher of the
first iteration against diffusers' transformer called as ``WanImageToVideoPipeline.__call__``'s loop calls it (its
``prepare_latents`` condition, its CLIP ``encode_image``, its negative branch), exact resume, the export through the
I2V pipeline's ``load_lora_weights``, ``sample --ckpt RUN --image IMG`` in the student's steps against the K-step
recipe written here on diffusers' transformer, and the one-line refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from ditforge import cli
from ditforge.data.sampler import derive_seed
from families import assert_one_line_error
from test_distill_video import (BATCH, PROMPTS, SEED, STEPS, assert_resume_exact, distill_argv, export_loads,
                                prompt_file, recorded_run)

__all__ = ["prompt_file"]  # a fixture of test_distill_video's, used here
SCALE = 5.0  # WanImageToVideoPipeline's default guidance_scale
SIZES = {"a.png": (16, 16), "b.jpg": (24, 20), "c.PNG": (16, 16)}  # (width, height); b is resized to 16 x 16


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """Three random first frames (one JPEG, one not at the frame size) and a text file the folder's reader skips."""
    folder = tmp_path_factory.mktemp("distill_images")
    g = torch.Generator().manual_seed(5)
    for name, (w, h) in SIZES.items():
        pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / name, quality=95)
    (folder / "notes.txt").write_text("not an image")
    return folder


@pytest.fixture(scope="module")
def i2v_run(wan_i2v_pipeline, prompt_file, image_dir, tmp_path_factory):
    """4 iterations (generator steps at 1 and 3), a checkpoint after each, recording each teacher call."""
    return recorded_run(wan_i2v_pipeline, prompt_file, tmp_path_factory.mktemp("distill_i2v") / "run", "--image",
                        str(image_dir), log_calls=transformer_log)


def transformer_log(monkeypatch, seen: list) -> None:
    """Record every call of diffusers' ``WanTransformer3DModel.forward`` (its input channels)."""
    from diffusers import WanTransformer3DModel

    forward = WanTransformer3DModel.forward

    def recorded(self, *args, **kwargs):
        seen.append(kwargs["hidden_states"].shape[1])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(WanTransformer3DModel, "forward", recorded)


def pipeline_guided(pipe, x, t, texts: list[str], images: list, scale: float = SCALE) -> torch.Tensor:
    """``WanImageToVideoPipeline.__call__``'s guided prediction at latents x (B, 16, T', h, w) and model timestep t,
    one row a call of the pipeline (prompt i with image i): ``encode_prompt`` with CFG (negative ""), CLIP
    ``encode_image`` of the image as given, ``prepare_latents`` of the image after ``video_processor.preprocess``
    (the condition), ``cat([latents, condition])`` for both passes, ``uncond + scale (cond - uncond)``."""
    rows = []
    for i, (text, image) in enumerate(zip(texts, images)):
        embeds, negative = pipe.encode_prompt([text], do_classifier_free_guidance=True, max_sequence_length=512)
        states = pipe.encode_image(image, torch.device("cpu"))
        first = pipe.video_processor.preprocess(image, height=16, width=16).float()
        latents, condition = pipe.prepare_latents(first, 1, 16, 16, 16, 5, torch.float32, torch.device("cpu"),
                                                  None, x[i:i + 1])
        inputs = torch.cat([latents, condition], dim=1)

        def call(text_states):
            return pipe.transformer(hidden_states=inputs, timestep=t[i:i + 1], encoder_hidden_states=text_states,
                                    encoder_hidden_states_image=states, return_dict=False)[0]

        cond, uncond = call(embeds), call(negative)
        rows.append(uncond + scale * (cond - uncond))
    return torch.cat(rows)


def test_teacher_is_the_i2v_pipelines_guided_prediction(i2v_run, wan_i2v_pipeline, image_dir):
    """The teacher of iteration 1 equals ``pipeline_guided`` on its latents and timestep with the prompts and the
    first frames iteration 1 drew (prompt indices, then image indices, from the iteration's generator) to 1e-5 in
    float32, in two transformer calls of 36 channels; another image changes it, so the image is in the teacher."""
    from diffusers import WanImageToVideoPipeline

    run, seen = i2v_run
    assert [n for *_, n in seen["teacher"]] == [2, 2] and set(seen["calls"]) == {36}
    pipe = WanImageToVideoPipeline.from_pretrained(str(wan_i2v_pipeline), local_files_only=True)
    files = sorted(p for p in image_dir.iterdir() if p.suffix.lower() in (".png", ".jpg"))
    g = torch.Generator().manual_seed(derive_seed(SEED, 1))
    rows = torch.randint(len(PROMPTS), (BATCH,), generator=g).tolist()
    picks = torch.randint(len(files), (BATCH,), generator=g).tolist()
    texts, images = [PROMPTS[i] for i in rows], [Image.open(files[i]).convert("RGB") for i in picks]
    x, t, got, _ = seen["teacher"][0]
    assert x.shape == (BATCH, 16, 2, 2, 2)
    with torch.no_grad():
        torch.testing.assert_close(got, pipeline_guided(pipe, x, t, texts, images), rtol=1e-5, atol=1e-5)
        other = [Image.open(files[(i + 1) % len(files)]).convert("RGB") for i in picks]
        assert (got - pipeline_guided(pipe, x, t, texts, other)).abs().max() > 1e-4
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and lines[2]["dmd_grad_norm"] > 0
    assert all(np.isfinite(v) for r in lines for v in r.values())
    config = json.loads((run / "checkpoints" / "step-0000004" / "meta.json").read_text())["config"]
    assert config["distill"]["teacher_cfg_scale"] == SCALE and config["distill"]["image"] == str(image_dir)


def test_i2v_resume_equals_uninterrupted(i2v_run, wan_i2v_pipeline, prompt_file, image_dir, tmp_path, one_thread):
    assert_resume_exact(i2v_run[0], wan_i2v_pipeline, prompt_file, tmp_path, "--image", str(image_dir))


def test_i2v_export_loads_and_samples_with_an_image_in_its_k_steps(i2v_run, wan_i2v_pipeline, image_dir, tmp_path):
    """The LoRA loads through ``WanImageToVideoPipeline.load_lora_weights``; ``sample --ckpt RUN --image IMG`` draws
    the latents of DMD2's K-step recipe written here on the pipeline's transformer with that LoRA (its condition
    and CLIP states, no guidance, flow sigmas at its shift 3, noise then each eps from the seed's generator), 1e-5."""
    from diffusers import WanImageToVideoPipeline
    from diffusers.utils.torch_utils import randn_tensor

    from ditforge.diffusion.dmd import flow_student_sigmas

    run = i2v_run[0]
    sigmas = flow_student_sigmas(3.0, STEPS).float().tolist()
    pipe, _ = export_loads(run, WanImageToVideoPipeline, wan_i2v_pipeline, tmp_path, sigmas)
    image = image_dir / "b.jpg"
    shape, seed = (1, 16, 2, 2, 2), 0  # sample's seed 0, prompt 0: derive_seed(0, 0)
    pil = Image.open(image).convert("RGB")
    with torch.no_grad():
        text = pipe.encode_prompt([PROMPTS[2]], do_classifier_free_guidance=False, max_sequence_length=512)[0]
        states = pipe.encode_image(pil, torch.device("cpu"))
        first = pipe.video_processor.preprocess(pil, height=16, width=16).float()
        generator = torch.Generator().manual_seed(derive_seed(seed, 0))
        x = randn_tensor(shape, generator=generator, dtype=torch.float32)
        _, condition = pipe.prepare_latents(first, 1, 16, 16, 16, 5, torch.float32, torch.device("cpu"), None, x)
        for k, s in enumerate(sigmas):
            v = pipe.transformer(hidden_states=torch.cat([x, condition], 1), timestep=torch.tensor([1000 * s]),
                                 encoder_hidden_states=text, encoder_hidden_states_image=states,
                                 return_dict=False)[0]
            x0 = x - s * v
            if k + 1 < len(sigmas):
                x = (1 - sigmas[k + 1]) * x0 + sigmas[k + 1] * randn_tensor(shape, generator=generator)
    import ditforge.sample.video as video

    drawn = []
    finish = video.VideoSampler._student

    def kept(self, *args, **kwargs):
        drawn.append(finish(self, *args, **kwargs))
        return drawn[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(video.VideoSampler, "_student", kept)
        assert cli.main(["sample", "--ckpt", str(run), "--image", str(image), "--prompt", PROMPTS[2], "--device",
                         "cpu", "--num_frames", "5", "--seed", str(seed), "--out", str(tmp_path / "a.mp4")]) == 0
    assert len(drawn) == 1
    torch.testing.assert_close(drawn[0], x0, rtol=0, atol=1e-5)


def test_i2v_bad_input_one_line(wan_i2v_pipeline, wan_pipeline, prompt_file, image_dir, tmp_path, capsys):
    out = tmp_path / "bad"
    assert_one_line_error(capsys, distill_argv(wan_i2v_pipeline, prompt_file, out), "--image", "image-to-video",
                          "WanImageToVideoPipeline")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("no images here")
    assert_one_line_error(capsys, distill_argv(wan_i2v_pipeline, prompt_file, out, "--image", str(empty)),
                          "--image", str(empty), "PNG / JPEG")
    assert_one_line_error(capsys, distill_argv(wan_i2v_pipeline, prompt_file, out, "--image", str(tmp_path / "no")),
                          "--image", "no such folder")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "x.png").write_bytes(b"not a png")
    assert_one_line_error(capsys, distill_argv(wan_i2v_pipeline, prompt_file, out, "--image", str(broken)),
                          "--image", "x.png", "not a readable image")
    assert_one_line_error(capsys, distill_argv(wan_pipeline, prompt_file, out, "--image", str(image_dir)),
                          "--image", "takes no image")
    assert not (out / "checkpoints").exists()


OTHER_FAMILIES = {  # family -> its size flags (32 px for the families whose tiny VAE downsamples by 8 with 2 x 2
    # patches, or folds 2 x 2 pixels as Wan 2.2 TI2V-5B's) and whether it takes a first frame (--image)
    "cogvideox_i2v": (("--height", "32", "--width", "32", "--num_frames", "9"), True),
    "ltx_i2v": (("--height", "32", "--width", "32", "--num_frames", "9"), True),
    "hunyuan_video_i2v": ((), True),
    "hunyuan_video_i2v_33ch": ((), True),
    "ltx": (("--height", "32", "--width", "32", "--num_frames", "9"), False),
    "wan22_ti2v": (("--height", "32", "--width", "32", "--num_frames", "9"), False),
}


@pytest.mark.parametrize("family", list(OTHER_FAMILIES))
def test_other_families_distil_and_sample(request, family, prompt_file, image_dir, tmp_path, one_thread):
    """The same code path for the other image-to-video families, and the text-to-video ones no other test distils
    (no code of theirs outside their adapters): two iterations (a generator step, then a critic step) with finite
    losses, and ``sample --ckpt RUN [--image IMG]`` in the student's steps. A family whose first latent frame is
    given (``given_frames``) leaves it out of the DMD loss (``DMD2.given_frames``) and the student's sample ends
    with the image's frame (``finish``)."""
    folder = request.getfixturevalue(f"{family}_pipeline")
    sizes, takes_image = OTHER_FAMILIES[family]
    image = ("--image", str(image_dir)) if takes_image else ()
    out = tmp_path / "run"
    argv = distill_argv(folder, prompt_file, out, "--max_steps", "2", *image, *sizes)
    assert cli.main(argv) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and "generator_loss" in lines[0]
    assert all(np.isfinite(v) for r in lines for v in r.values())
    size = dict(zip(sizes[::2], sizes[1::2]))
    first = ("--image", str(image_dir / "a.png")) if takes_image else ()
    assert cli.main(["sample", "--ckpt", str(out), *first, "--prompt", PROMPTS[0], "--device", "cpu",
                     "--num_frames", size.get("--num_frames", "5"), "--out", str(tmp_path / "a.mp4"),
                     "--save_npz", str(tmp_path / "a.npz")]) == 0
    video = np.load(tmp_path / "a.npz")["samples"]
    assert video.ndim == 5 and video.shape[0] == 1
