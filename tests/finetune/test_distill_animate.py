"""``ditforge distill`` of a character pipeline driven by videos (Wan2.2-Animate's ``WanAnimatePipeline``, the tiny
random ``tiny_pipelines.make_animate`` folder) from ``--driving_csv`` rows (character image, pose and face videos),
one segment of 5 frames: the guided teacher of both generator steps against ``WanAnimatePipeline.__call__`` itself,
one step at each row's t (its own conditioning of the row's first frames, and its negative branch: empty prompt,
face frames -1); the rows' captions as prompts; exact resume; the LoRA export through the pipeline's
``load_lora_weights``; ``sample --ckpt RUN`` (the pipeline's call, the student's sampler as its scheduler) against
ditforge's K-step student loop (``student_latents``) on one segment; the one-line refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from ditforge import cli
from ditforge.data.sampler import derive_seed
from ditforge.data.video import read_clip, write_video, write_video_csv
from families import assert_one_line_error
from test_distill_experts import OneStep
from test_distill_video import (BATCH, PROMPTS, SEED, STEPS, assert_resume_exact, distill_argv, export_loads,
                                prompt_file, recorded_run)
from tiny_pipelines import make_animate

__all__ = ["prompt_file"]  # a fixture of test_distill_video's, used here
FRAMES, SCALE = 5, 3.0  # one segment (segment_frame_length 5); the call's default guidance_scale 1 guides nothing
COLUMNS = ("image", "pose_video", "face_video", "text")


@pytest.fixture(scope="module")
def animate(tmp_path_factory, one_thread_module):
    """The tiny Animate folder and a driving CSV of 3 rows of fresh random files: a 24 x 40 character PNG (the
    pipeline resizes it), pose and face MP4s of 16 px (row 2's of 7 frames: its first 5 are the segment's), a
    caption; and the same CSV with row 1's pose_video cell empty."""
    root = tmp_path_factory.mktemp("distill_animate")
    rng = np.random.default_rng()
    rows = []
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(root / f"char{i}.png")
        for name in ("pose", "face"):
            frames = rng.integers(0, 256, (FRAMES + 2 * (i == 2), 16, 16, 3), dtype=np.uint8)
            write_video(frames, root / f"{name}{i}.mp4")
        rows.append({"image": f"char{i}.png", "pose_video": f"pose{i}.mp4", "face_video": f"face{i}.mp4",
                     "text": f"a dancer {i}"})
    csv = write_video_csv(rows, root / "driving.csv", COLUMNS)
    bad = write_video_csv([rows[0], {**rows[1], "pose_video": ""}], root / "bad.csv", COLUMNS)
    return make_animate(root / "pipe"), csv, bad


def inputs_of(csv, row: int) -> dict:
    """Row ``row``'s call inputs as the pipeline takes them: the character as PIL RGB, each video's first
    ``FRAMES`` frames as PIL images."""
    folder = csv.parent
    out = {"image": Image.open(folder / f"char{row}.png").convert("RGB")}
    for name in ("pose", "face"):
        frames, _ = read_clip(str(folder / f"{name}{row}.mp4"), FRAMES, 1, lambda _: 0)
        out[f"{name}_video"] = [Image.fromarray(f) for f in frames]
    return out


def transformer_log(monkeypatch, seen: list) -> None:
    """Record the timesteps of every call of diffusers' ``WanAnimateTransformer3DModel.forward``."""
    from diffusers import WanAnimateTransformer3DModel

    forward = WanAnimateTransformer3DModel.forward

    def recorded(self, *args, **kwargs):
        seen.append(kwargs["timestep"].tolist())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(WanAnimateTransformer3DModel, "forward", recorded)


@pytest.fixture(scope="module")
def runs(animate, prompt_file, tmp_path_factory):
    """4 iterations (generator steps at 1 and 3) with ``--prompt_file`` (its prompts and the rows drawn apart), and 1
    without (each row's caption its prompt), each recording its teacher calls."""
    root = tmp_path_factory.mktemp("distill_animate_runs")
    out = {"prompts": recorded_run(animate[0], prompt_file, root / "prompts", "--driving_csv", str(animate[1]),
                                   "--cfg_scale", str(SCALE), log_calls=transformer_log)}
    out["captions"] = recorded_run(animate[0], None, root / "captions", "--driving_csv", str(animate[1]),
                                   "--cfg_scale", str(SCALE), "--max_steps", "1", log_calls=transformer_log)
    return out


@pytest.mark.parametrize("name", ["prompts", "captions"])
def test_teacher_is_the_pipelines_guided_velocity(name, runs, animate):
    """Each generator step's teacher equals ``WanAnimatePipeline.__call__`` (guidance_scale 3, mode animate, one
    segment) one step at each row's t, with that row's prompt (a ``--prompt_file`` line, or the row's caption) and
    driving row, float32, 1e-5, in two transformer calls: the call's last latents are de-standardised (``latents /
    latents_recip_std + latents_mean``) and undone here. The latents carry the call's leading frame (1 + 2 latent
    frames); the driving row matters (another row's call differs)."""
    from diffusers import WanAnimatePipeline

    folder, csv, _ = animate
    pipe = WanAnimatePipeline.from_pretrained(str(folder), local_files_only=True)
    view = (1, pipe.vae.config.z_dim, 1, 1, 1)
    mean, std = (torch.tensor(pipe.vae.config[k]).view(view) for k in ("latents_mean", "latents_std"))
    captions = [f"a dancer {i}" for i in range(3)]
    teacher = runs[name][1]["teacher"]
    assert len(teacher) == (2 if name == "prompts" else 1)
    for step, (x, t, got, calls) in zip((1, 3), teacher):
        assert x.shape == (BATCH, 16, 3, 2, 2) and calls == 2
        g = torch.Generator().manual_seed(derive_seed(SEED, step))
        if name == "prompts":
            rows = torch.randint(len(PROMPTS), (BATCH,), generator=g).tolist()
            texts, picks = [PROMPTS[r] for r in rows], torch.randint(3, (BATCH,), generator=g).tolist()
        else:
            picks = torch.randint(3, (BATCH,), generator=g).tolist()
            texts = [captions[p] for p in picks]

        def call(i, pick):
            pipe.scheduler = OneStep(t[i])
            out = pipe(prompt=texts[i], height=16, width=16, segment_frame_length=FRAMES, num_inference_steps=1,
                       guidance_scale=SCALE, latents=x[i:i + 1], output_type="latent", **inputs_of(csv, pick)).frames
            return (out - mean) / std

        with torch.no_grad():
            want = torch.cat([call(i, picks[i]) for i in range(BATCH)])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert (call(0, (picks[0] + 1) % 3) - want[:1]).abs().max() > 1e-4


def test_resume_equals_uninterrupted(runs, animate, prompt_file, tmp_path, one_thread):
    assert_resume_exact(runs["prompts"][0], animate[0], prompt_file, tmp_path, "--driving_csv", str(animate[1]),
                        "--cfg_scale", str(SCALE))


def test_export_loads_and_samples_in_the_students_steps(runs, animate, tmp_path, monkeypatch):
    """The LoRA loads through ``WanAnimatePipeline.load_lora_weights`` with the student's tensors; ``sample --ckpt
    RUN`` runs the pipeline's call in the student's 2 steps (t = 1000, 750; one transformer call each, no guidance)
    on segments of the 5 frames it learnt, and its frames are those of ditforge's student loop (``student_latents``:
    the same student, conditioning and seed) decoded as the call decodes, uint8 within 1."""
    from diffusers import WanAnimatePipeline

    from ditforge.cli import build_parser
    from ditforge.data.images import to_uint8
    from ditforge.diffusion.dmd import flow_student_sigmas
    from ditforge.sample.command import sample
    from ditforge.sample.load import SampleConfig
    from ditforge.sample.student import student_latents
    from ditforge.weights.finetuned import load_finetuned
    from ditforge.weights.read import load_weights

    folder, csv, _ = animate
    run = runs["prompts"][0]
    export_loads(run, WanAnimatePipeline, folder, tmp_path, flow_student_sigmas(3.0, STEPS).tolist(), comfyui=False)
    config = json.loads((run / "checkpoints" / "step-0000004" / "meta.json").read_text())["config"]
    assert config["distill"]["driving_csv"] == str(csv) and config["distill"]["segment_frame_length"] == FRAMES
    calls: list = []
    transformer_log(monkeypatch, calls)
    args = vars(build_parser().parse_args([
        "sample", "--ckpt", str(run), "--prompt", PROMPTS[1], "--device", "cpu", "--image",
        str(csv.parent / "char0.png"), "--pose_video", str(csv.parent / "pose0.mp4"), "--face_video",
        str(csv.parent / "face0.mp4"), "--seed", "4", "--out", str(tmp_path / "out")]))
    args.pop("command", None)
    ours = sample(SampleConfig(**args))
    assert calls == [[1000.0], [750.0]] and ours.shape == (1, FRAMES, 16, 16, 3)
    pre, den, _ = load_finetuned(*load_weights(str(run)), torch.device("cpu"))
    pipe = pre.pipe
    with torch.no_grad():
        row = inputs_of(csv, 0)
        cond = pre.encode_prompt([PROMPTS[1]]) | den.encode_driving(pipe, row.pop("image"), row, 16, 16,
                                                                    torch.device("cpu"))[0]
        x0 = student_latents(pre, den, lambda x, t, given: den(x, t, **cond), None, (1, 16, 3, 2, 2),
                             derive_seed(4, 0), STEPS, torch.device("cpu"))
        view = (1, pipe.vae.config.z_dim, 1, 1, 1)
        mean, std = (torch.tensor(pipe.vae.config[k]).view(view) for k in ("latents_mean", "latents_std"))
        frames = pipe.vae.decode(x0[:, :, 1:] * std + mean, return_dict=False)[0]
        video = pipe.video_processor.postprocess_video(frames, output_type="pt")  # (1, T, 3, H, W) in [0, 1]
    want = to_uint8(video.transpose(1, 2).float() * 2 - 1)
    assert np.abs(ours.astype(int) - want.astype(int)).max() <= 1


def test_bad_input_one_line(animate, wan_pipeline, prompt_file, tmp_path, capsys):
    """Exit 2 and one line naming the flag: a CSV row without its pose_video; the flag for a text-to-video teacher; a
    driven teacher without it, or with neither --prompt_file nor a text column; ``sample --sampler`` other than the
    pipeline's scheduler or the student's, and the student's with guidance."""
    folder, csv, bad = animate
    out = tmp_path / "bad"
    assert_one_line_error(capsys, distill_argv(folder, prompt_file, out, "--driving_csv", str(bad)),
                          f"--driving_csv {bad}, line 3: no pose_video")
    assert_one_line_error(capsys, distill_argv(wan_pipeline, prompt_file, out, "--driving_csv", str(csv)),
                          f"--driving_csv {csv}", "WanPipeline", "leave --driving_csv out")
    assert_one_line_error(capsys, distill_argv(folder, prompt_file, out), "--driving_csv:", "driven by videos")
    uncaptioned = write_video_csv([{"image": "char0.png", "pose_video": "pose0.mp4", "face_video": "face0.mp4"}],
                                  csv.parent / "uncaptioned.csv", COLUMNS[:3])
    assert_one_line_error(capsys, distill_argv(folder, None, out, "--driving_csv", str(uncaptioned)),
                          "--prompt_file:", "no text column")
    given = ["sample", "--ckpt", str(folder), "--prompt", "a dancer", "--image", str(csv.parent / "char0.png"),
             "--pose_video", str(csv.parent / "pose0.mp4"), "--face_video", str(csv.parent / "face0.mp4")]
    assert_one_line_error(capsys, [*given, "--sampler", "euler"], "--sampler euler: WanAnimatePipeline steps with its "
                          "own scheduler")
    assert_one_line_error(capsys, [*given, "--sampler", "student", "--cfg_scale", "3"],
                          "--sampler student: a student samples without guidance")
