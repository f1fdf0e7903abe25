"""``ditforge distill`` of a reference-image pipeline (Wan2.1-VACE's ``WanVACEPipeline``, the tiny random
``tiny_pipelines.make_vace`` folder): text-to-video with no control inputs (the call's zero control video and
all-ones mask), and with one reference image a sample from ``--image DIR`` (its latent frame prepended). The
guided teacher of both generator steps against ``WanVACEPipeline.__call__`` itself, one step at each row's t (its
own control, ``preprocess_conditions`` / ``prepare_video_latents`` / ``prepare_masks``, and its negative branch,
which keeps the control); exact resume; the LoRA export through the pipeline's ``load_lora_weights``; ``sample
--ckpt RUN --reference_image IMG`` in the student's steps as the pipeline with that LoRA samples under ``--sampler
student``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from ditforge import cli
from ditforge.data.sampler import derive_seed
from test_distill_experts import OneStep
from test_distill_video import (BATCH, PROMPTS, SEED, STEPS, assert_resume_exact, export_loads, prompt_file,
                                recorded_run)
from tiny_pipelines import make_vace

__all__ = ["prompt_file"]  # a fixture of test_distill_video's, used here
SCALE = 5.0  # WanVACEPipeline's default guidance_scale


@pytest.fixture(scope="module")
def vace(tmp_path_factory, one_thread_module):
    """The tiny VACE folder and a folder of two random 16 x 16 reference images."""
    root = tmp_path_factory.mktemp("distill_vace")
    images = root / "images"
    images.mkdir()
    g = torch.Generator().manual_seed(5)
    for name in ("a.png", "b.png"):
        Image.fromarray(torch.randint(0, 256, (16, 16, 3), generator=g, dtype=torch.uint8).numpy()).save(images / name)
    return make_vace(root / "pipe"), images


def transformer_log(monkeypatch, seen: list) -> None:
    """Record (timestep, control frames) of every call of diffusers' ``WanVACETransformer3DModel.forward``."""
    from diffusers import WanVACETransformer3DModel

    forward = WanVACETransformer3DModel.forward

    def recorded(self, *args, **kwargs):
        seen.append((kwargs["timestep"].tolist(), kwargs["control_hidden_states"].shape[2]))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(WanVACETransformer3DModel, "forward", recorded)


@pytest.fixture(scope="module")
def runs(vace, prompt_file, tmp_path_factory):
    """4 iterations (generator steps at 1 and 3) without control inputs and with ``--image``, each recording its
    teacher calls and every transformer call."""
    folder, images = vace
    root = tmp_path_factory.mktemp("distill_vace_runs")
    return {name: recorded_run(folder, prompt_file, root / name, *extra, log_calls=transformer_log)
            for name, extra in (("plain", ()), ("references", ("--image", str(images))))}


@pytest.mark.parametrize("name", ["plain", "references"])
def test_teacher_is_the_pipelines_guided_velocity(name, runs, vace):
    """Each generator step's teacher equals ``WanVACEPipeline.__call__`` one step at each row's t, with that row's
    prompt (and reference image: ``reference_images=[image]``, the latents then one frame longer), float32, 1e-5,
    in two transformer calls; the control matters (the call with another reference differs)."""
    from diffusers import WanVACEPipeline

    folder, images = vace
    files = sorted(images.iterdir())
    pipe = WanVACEPipeline.from_pretrained(str(folder), local_files_only=True)
    teacher = runs[name][1]["teacher"]
    assert len(teacher) == 2
    for step, (x, t, got, calls) in zip((1, 3), teacher):
        assert x.shape == (BATCH, 16, 3 if name == "references" else 2, 2, 2) and calls == 2
        g = torch.Generator().manual_seed(derive_seed(SEED, step))
        rows = torch.randint(len(PROMPTS), (BATCH,), generator=g).tolist()
        picks = torch.randint(len(files), (BATCH,), generator=g).tolist() if name == "references" else None

        def call(i, pick):
            pipe.scheduler = OneStep(t[i])
            refs = {} if pick is None else {"reference_images": [Image.open(files[pick]).convert("RGB")]}
            return pipe(prompt=PROMPTS[rows[i]], height=16, width=16, num_frames=5, latents=x[i:i + 1],
                        guidance_scale=SCALE, output_type="latent", **refs).frames

        with torch.no_grad():
            want = torch.cat([call(i, None if picks is None else picks[i]) for i in range(BATCH)])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if picks is not None:
                assert (call(0, 1 - picks[0]) - want[:1]).abs().max() > 1e-4


def test_resume_equals_uninterrupted(runs, vace, prompt_file, tmp_path, one_thread):
    assert_resume_exact(runs["references"][0], vace[0], prompt_file, tmp_path, "--image", str(vace[1]))


def test_export_loads_and_samples_with_a_reference(runs, vace, tmp_path, monkeypatch):
    """The LoRA loads through ``WanVACEPipeline.load_lora_weights`` with the student's tensors; ``sample --ckpt RUN
    --reference_image IMG`` runs the student's 2 steps (t = 1000, 750; the control one reference frame longer) and
    draws the clip the pipeline with that LoRA draws under ``--sampler student``; without a reference too."""
    from diffusers import WanVACEPipeline

    from ditforge.diffusion.dmd import flow_student_sigmas

    folder, images = vace
    run = runs["references"][0]
    _, out = export_loads(run, WanVACEPipeline, folder, tmp_path, flow_student_sigmas(3.0, STEPS).tolist(),
                          comfyui=False)
    config = json.loads((run / "checkpoints" / "step-0000004" / "meta.json").read_text())["config"]
    assert config["distill"]["image"] == str(images)
    calls: list = []
    transformer_log(monkeypatch, calls)
    reference = ["--reference_image", str(sorted(images.iterdir())[0])]
    common = ["--prompt", PROMPTS[1], "--device", "cpu", "--num_frames", "5", *reference]
    assert cli.main(["sample", "--ckpt", str(run), "--out", str(tmp_path / "a.mp4"), "--save_npz",
                     str(tmp_path / "a.npz"), *common]) == 0
    assert calls == [([1000.0], 3), ([750.0], 3)]
    assert cli.main(["sample", "--ckpt", str(folder), "--lora", str(out), "--sampler", "student",
                     "--num_sampling_steps", str(STEPS), "--cfg_scale", "1", "--image_size", "16", "--out",
                     str(tmp_path / "b.mp4"), "--save_npz", str(tmp_path / "b.npz"), *common]) == 0
    a, b = (np.load(tmp_path / f"{n}.npz")["samples"].astype(int) for n in "ab")
    assert a.shape == (1, 5, 16, 16, 3) and np.abs(a - b).max() <= 1
    calls.clear()
    assert cli.main(["sample", "--ckpt", str(runs["plain"][0]), "--out", str(tmp_path / "c.mp4"), *common[:-2]]) == 0
    assert calls == [([1000.0], 2), ([750.0], 2)]
