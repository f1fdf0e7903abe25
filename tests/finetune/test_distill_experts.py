"""``ditforge distill`` of a two-expert pipeline (Wan 2.2 A14B: ``transformer`` at t >= boundary_ratio x 1000,
``transformer_2`` below) on the tiny random ``tiny_pipelines.make_wan22`` folder (boundary_ratio 0.875, flow shift 3):
the guided teacher of every generator step against ``WanPipeline.__call__`` itself (its own expert choice and
guidance, one step at that t); every transformer call on the expert owning its t, a batch straddling the boundary
split; each expert's student adapter trained by the student's steps on its side alone; exact resume across both
experts (one expert's student first stepping after the cut); the export as a LoRA fine-tune of both writes it;
``sample --ckpt RUN`` against the K-step recipe on diffusers' transformers with those LoRAs; a student whose steps
all fall on one side; the two-expert image-to-video layout (Wan 2.2 I2V A14B) against
``WanImageToVideoPipeline.__call__``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ditforge import cli
from ditforge.data.sampler import derive_seed
from test_distill_video import (BATCH, PROMPTS, STEPS, assert_resume_exact, distill_argv, lora_tensors, prompt_file,
                                read_part, recorded_run)
from test_clip_score import tiny_clip
from test_distill_placement import assert_fp8_run_is_the_rounded_teachers, rounded_teacher
from tiny_pipelines import make_wan22

__all__ = ["prompt_file", "tiny_clip"]  # fixtures of test_distill_video's and test_clip_score's, used here
SCALE, BOUNDARY = 5.0, 875.0  # WanPipeline's default guidance_scale (guidance_scale_2 None: the same); 0.875 x 1000
SCALE_2 = 2.0  # the run's --cfg_scale_2: the low-noise expert guided at another scale than the high-noise one
# seed 7: iterations 1 and 3 (the generator steps) both evaluate the teacher on a batch straddling t = 875, and the
# student's step k is 0 (t = 1000, the high-noise expert) at 1 and 1 (t = 750, the low-noise one) at 3, so the
# low-noise student first steps after the resume test's cut at 2 (``test_student_steps_train_their_experts_only``)
ARGS = ("--seed", "7", "--cfg_scale_2", str(SCALE_2))
SEED = 7


@pytest.fixture(scope="module")
def wan22(tmp_path_factory, one_thread_module):
    return make_wan22(tmp_path_factory.mktemp("distill_wan22") / "pipe")


def expert_sums(folder) -> tuple[float, float]:
    """Each expert's fingerprint: the sum of its patch embedding (no LoRA target), ``transformer`` first."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(folder), local_files_only=True)
    return tuple(float(m.patch_embedding.weight.detach().double().sum())
                 for m in (pipe.transformer, pipe.transformer_2))


def expert_log(monkeypatch, seen: list) -> None:
    """Record (the expert's fingerprint, the timesteps) of every call of ``WanTransformer3DModel.forward``."""
    from diffusers import WanTransformer3DModel

    forward = WanTransformer3DModel.forward

    def recorded(self, *args, **kwargs):
        seen.append((float(self.patch_embedding.weight.detach().double().sum()), kwargs["timestep"].detach().clone()))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(WanTransformer3DModel, "forward", recorded)


@pytest.fixture(scope="module")
def run(wan22, prompt_file, tmp_path_factory):
    """4 iterations (generator steps at 1 and 3), a 2-step student, recording each teacher call and the expert and
    timesteps of every transformer call."""
    return recorded_run(wan22, prompt_file, tmp_path_factory.mktemp("distill_wan22_run") / "run", *ARGS,
                        log_calls=expert_log)


class OneStep:
    """The scheduler ``WanPipeline.__call__`` runs, stripped to one step at the model timestep ``t`` whose ``step``
    returns the model output it is given: the call then returns its guided prediction at (latents, t)."""

    order = 1

    def __init__(self, t: torch.Tensor):
        self.t, self.config = t, SimpleNamespace(num_train_timesteps=1000)

    def set_timesteps(self, steps, device=None):
        self.timesteps, self.sigmas = self.t.view(1), self.t.view(1) / 1000

    def set_begin_index(self, index):
        pass

    def step(self, out, t, latents, return_dict=False):
        return (out,)


def pipeline_guided(pipe, x: torch.Tensor, t: torch.Tensor, texts: list[str], scale_2: float | None = None
                    ) -> torch.Tensor:
    """``WanPipeline.__call__``'s guided prediction for each row of latents x (B, 16, 2, 2, 2) at its model timestep
    t_i, one call a row: the pipeline picks the expert of t_i (its ``boundary_ratio``) and guides with its
    ``guidance_scale`` (5) on the high-noise expert and its ``guidance_scale_2`` (``scale_2``; None: the call's
    default, the same 5) on the low-noise one, against the negative prompt "" (``encode_prompt``, 512 tokens)."""
    rows = []
    for i, text in enumerate(texts):
        pipe.scheduler = OneStep(t[i])
        rows.append(pipe(prompt=text, height=16, width=16, num_frames=5, latents=x[i:i + 1], guidance_scale=SCALE,
                         guidance_scale_2=scale_2, output_type="latent").frames)
    return torch.cat(rows)


def test_teacher_is_the_pipelines_expert_and_guidance(run, wan22):
    """Both generator steps' teacher, each on a batch straddling t = 875 (four transformer calls: two passes on
    each expert), equals ``WanPipeline.__call__`` at each row's t with ``guidance_scale`` 5 and ``guidance_scale_2``
    2, the run's ``--cfg_scale_2`` (float32, 1e-5); the two experts differ there, so a row on the wrong expert would
    not, and so does the call with one scale on both, so the low-noise rows at the high-noise scale would not."""
    from diffusers import WanPipeline

    _, seen = run
    pipe = WanPipeline.from_pretrained(str(wan22), local_files_only=True)
    assert len(seen["teacher"]) == 2
    for step, (x, t, got, calls) in zip((1, 3), seen["teacher"]):
        assert (t >= BOUNDARY).any() and (t < BOUNDARY).any() and calls == 4
        g = torch.Generator().manual_seed(derive_seed(SEED, step))
        rows = torch.randint(len(PROMPTS), (BATCH,), generator=g).tolist()
        with torch.no_grad():
            want = pipeline_guided(pipe, x, t, [PROMPTS[i] for i in rows], SCALE_2)
            one_scale = pipeline_guided(pipe, x, t, [PROMPTS[i] for i in rows])
            states = torch.randn(BATCH, 512, 32, generator=torch.Generator().manual_seed(step))
            high, low = (m(hidden_states=x, timestep=t, encoder_hidden_states=states, return_dict=False)[0]
                         for m in (pipe.transformer, pipe.transformer_2))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (high - low).abs().max() > 1e-2
        low_rows = t < BOUNDARY
        # (100 x the tolerance)
        assert (one_scale - want)[low_rows].abs().max() > 1e-3 and (one_scale - want)[~low_rows].abs().max() == 0


def test_every_call_runs_on_the_expert_of_its_timesteps(run, wan22):
    """Every transformer call of the run (student, critic, teacher) has all its rows on one side of t = 875 and runs
    on that side's expert; both experts run."""
    high, low = expert_sums(wan22)
    calls = run[1]["calls"]
    assert {s for s, _ in calls} == {high, low}
    for expert, t in calls:
        assert bool((t >= BOUNDARY).all()) if expert == high else bool((t < BOUNDARY).all())


def adapter_parts(ckpt, part: str) -> dict[str, dict[str, torch.Tensor]]:
    """``part``'s (``student``, ``critic``) LoRA B tensors of a checkpoint, by expert (``transformer``,
    ``transformer_2``: the names' first part)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    got = read_part(ckpt, part, [k.split(".", 1)[1] for k in meta if k.startswith(f"{part}.") and ".lora_B." in k])
    return {e: {k: v for k, v in got.items() if k.split(".")[0] == e} for e in ("transformer", "transformer_2")}


def test_student_steps_train_their_experts_only(run):
    """Iteration 1's student step (k = 0, t = 1000) trains the high-noise expert's student alone: at step 2 the
    low-noise expert's student is untouched (B = 0) and has no optimizer state; iteration 3's (k = 1, t = 750)
    then trains it. The critic, evaluated at times on both sides, trains both experts' adapters."""
    ckpts = run[0] / "checkpoints"
    at2, at4 = (adapter_parts(ckpts / s, "student") for s in ("step-0000002", "step-0000004"))
    assert at2["transformer"] and all(bool(v.any()) for v in at2["transformer"].values())
    assert not any(bool(v.any()) for v in at2["transformer_2"].values())
    assert all(bool(v.any()) for part in at4.values() for v in part.values())
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpts / "step-0000002")).read_metadata().state_dict_metadata
    stepped = {k.split(".")[2] for k in meta if k.startswith("optimizer.state.")}
    assert stepped == {"transformer"}
    critic = adapter_parts(ckpts / "step-0000004", "critic")
    assert all(any(bool(v.any()) for v in part.values()) for part in critic.values())
    config = json.loads((ckpts / "step-0000004" / "meta.json").read_text())["config"]
    assert config["model"]["expert"] == "both"
    assert (config["distill"]["teacher_cfg_scale"], config["distill"]["teacher_cfg_scale_2"]) == (SCALE, SCALE_2)


def test_resume_equals_uninterrupted(run, wan22, prompt_file, tmp_path, one_thread):
    assert_resume_exact(run[0], wan22, prompt_file, tmp_path, *ARGS)


def test_fp8_base_and_block_swap_place_both_experts(run, wan22, prompt_file, tmp_path, one_thread):
    """``--fp8_base --blocks_to_swap 1`` on two experts: both experts' frozen layers stored in float8 e4m3 and the
    last block of each swapped to host memory (a ``BlockSwap`` per expert). As fine-tuning's placement tests
    (``test_distill_placement``): 2 iterations equal the unplaced run of a teacher folder whose two transformers were
    rounded to float8 beforehand (metrics to 1e-5, adapters to 1e-5 / 1e-6; the swap changes no number), while the
    rounding moves the critic's losses off ``run``'s, the unrounded teacher's (a low-noise expert left unrounded in
    the placed run, which every critic step calls, would put it off the rounded run's)."""
    from ditforge.parallel.offload import BlockSwap

    folder, _ = rounded_teacher(wan22, tmp_path / "rounded", ("transformer", "transformer_2"))
    out, ref, swaps = tmp_path / "placed", tmp_path / "ref", []
    init = BlockSwap.__init__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BlockSwap, "__init__", lambda self, blocks, device: swaps.append(len(blocks)) or init(
            self, blocks, device))
        assert cli.main(distill_argv(wan22, prompt_file, out, *ARGS, "--max_steps", "2", "--fp8_base",
                                     "--blocks_to_swap", "1")) == 0
    assert swaps == [1, 1]
    assert cli.main(distill_argv(folder, prompt_file, ref, *ARGS, "--max_steps", "2")) == 0
    assert_fp8_run_is_the_rounded_teachers(out, ref, run[0], 2)


def test_export_writes_a_lora_of_both_experts(run, wan22, tmp_path):
    """``export --format lora`` writes what a LoRA fine-tune of both experts writes, ``OUT/high_noise`` and
    ``OUT/low_noise``, loaded by ``WanPipeline.load_lora_weights`` (the second ``load_into_transformer_2``) with each
    expert's student tensors exactly; ``--format comfyui`` writes ``OUT_high_noise`` / ``OUT_low_noise``."""
    from diffusers import WanPipeline

    out = tmp_path / "lora"
    assert cli.main(["export", "--ckpt", str(run[0]), "--out", str(out), "--format", "lora"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["high_noise", "low_noise"]
    assert cli.main(["export", "--ckpt", str(run[0]), "--out", str(tmp_path / "c.safetensors"), "--format",
                     "comfyui"]) == 0
    assert (tmp_path / "c_high_noise.safetensors").is_file() and (tmp_path / "c_low_noise.safetensors").is_file()
    pipe = WanPipeline.from_pretrained(str(wan22), local_files_only=True)
    pipe.load_lora_weights(str(out / "high_noise"))
    pipe.load_lora_weights(str(out / "low_noise"), load_into_transformer_2=True)
    for name in ("transformer", "transformer_2"):
        loaded = lora_tensors(getattr(pipe, name), "default_0")
        names = [f"{name}.{n}".replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
                 for n in loaded]
        student = read_part(run[0] / "checkpoints" / "step-0000004", "ema", names)
        assert len(loaded) == 2 * 4 * 2 * 2
        for n, k in zip(loaded, names):
            torch.testing.assert_close(loaded[n], student[k], rtol=0, atol=0)


def test_sample_runs_each_step_on_its_expert(run, wan22, tmp_path, monkeypatch):
    """``sample --ckpt RUN``'s student latents equal the 2-step recipe written on diffusers' transformers with the
    exported LoRAs (t = 1000 on ``transformer``, x0 = x - v, re-noised to sigma 0.75, t = 750 on
    ``transformer_2``; 1e-5), and the CLI's sample runs exactly those two calls."""
    from diffusers import WanPipeline
    from diffusers.utils.torch_utils import randn_tensor

    from ditforge.parallel.mesh import Dist
    from ditforge.sample.load import SampleConfig
    from ditforge.sample.video import VideoSampler
    from ditforge.weights.finetuned import load_finetuned
    from ditforge.weights.read import load_weights

    out = tmp_path / "lora"
    assert cli.main(["export", "--ckpt", str(run[0]), "--out", str(out), "--format", "lora"]) == 0
    pipe = WanPipeline.from_pretrained(str(wan22), local_files_only=True)
    pipe.load_lora_weights(str(out / "high_noise"))
    pipe.load_lora_weights(str(out / "low_noise"), load_into_transformer_2=True)
    shape, seed = (1, 16, 2, 2, 2), 11
    with torch.no_grad():
        text = pipe.encode_prompt(PROMPTS[2], do_classifier_free_guidance=False, max_sequence_length=512)[0]
        generator = torch.Generator().manual_seed(seed)
        x = randn_tensor(shape, generator=generator, dtype=torch.float32)
        for k, (sigma, model) in enumerate(((1.0, pipe.transformer), (0.75, pipe.transformer_2))):
            v = model(hidden_states=x, timestep=torch.tensor([sigma * 1000]), encoder_hidden_states=text,
                      return_dict=False)[0].double()
            x0 = x.double() - sigma * v
            if k == 0:
                x = (0.25 * x0 + 0.75 * randn_tensor(shape, generator=generator)).float()
        pre, ours, _ = load_finetuned(*load_weights(str(run[0])), torch.device("cpu"))
        sampler = VideoSampler(pre, ours, Dist(), SampleConfig(ckpt=str(run[0]), mixed_precision="fp32",
                                                               sampler="student"))
        got = sampler.denoise(pre.encode_prompt([PROMPTS[2]]), None, shape, seed, STEPS, 1.0)
    torch.testing.assert_close(got, x0.float(), rtol=0, atol=1e-5)
    calls: list = []
    expert_log(monkeypatch, calls)
    assert cli.main(["sample", "--ckpt", str(run[0]), "--prompt", PROMPTS[2], "--device", "cpu", "--num_frames",
                     "5", "--out", str(tmp_path / "a.mp4"), "--save_npz", str(tmp_path / "a.npz")]) == 0
    high, low = expert_sums(wan22)
    assert [(s, t.tolist()) for s, t in calls] == [(high, [1000.0]), (low, [750.0])]
    assert np.load(tmp_path / "a.npz")["samples"].shape == (1, 5, 16, 16, 3)


def test_clip_evaluation_draws_the_teacher_at_both_scales(wan22, prompt_file, tiny_clip, tmp_path, one_thread):
    """``--eval_every`` of the two-expert teacher at ``--cfg_scale_2`` 100 (the tiny experts' guided videos move by
    less than a level of 255 below 20): the teacher's videos the run scores are ``WanPipeline.__call__``'s own with
    ``guidance_scale`` 5 and ``guidance_scale_2`` 100 (exactly), and not its videos at one scale."""
    from diffusers import WanPipeline
    from test_distill_eval import pipeline_videos, scored_run

    _, _, scored = scored_run(wan22, prompt_file, tiny_clip, tmp_path, "--max_steps", "1", *ARGS, "--cfg_scale_2",
                              "100")
    pipe = WanPipeline.from_pretrained(str(wan22), local_files_only=True)
    want = pipeline_videos(pipe, SEED, guidance_scale=SCALE, guidance_scale_2=100.0)
    np.testing.assert_array_equal(scored[0], want)
    assert (want != pipeline_videos(pipe, SEED, guidance_scale=SCALE)).mean() > 0.1


def test_student_on_one_side_still_uses_both_experts(wan22, prompt_file, tmp_path, monkeypatch, one_thread):
    """A 1-step student (t = 1000: the high-noise expert alone): the low-noise expert still serves teacher and
    critic below t = 875 (its critic adapter trains), its student adapter stays untrained (B = 0), and the sample
    runs on ``transformer`` alone."""
    calls: list = []
    expert_log(monkeypatch, calls)
    out = tmp_path / "run"
    assert cli.main(distill_argv(wan22, prompt_file, out, "--student_steps", "1", "--max_steps", "2", *ARGS)) == 0
    high, low = expert_sums(wan22)
    assert low in {s for s, _ in calls}
    ckpt = out / "checkpoints" / "step-0000002"
    student, critic = adapter_parts(ckpt, "student"), adapter_parts(ckpt, "critic")
    assert not any(bool(v.any()) for v in student["transformer_2"].values())
    assert all(bool(v.any()) for v in student["transformer"].values())
    assert any(bool(v.any()) for v in critic["transformer_2"].values())
    calls.clear()
    assert cli.main(["sample", "--ckpt", str(out), "--prompt", PROMPTS[0], "--device", "cpu", "--num_frames", "5",
                     "--out", str(tmp_path / "a.mp4")]) == 0
    assert [(s, t.tolist()) for s, t in calls] == [(high, [1000.0])]


# Wan 2.2 I2V A14B's layout: a WanImageToVideoPipeline of two 36-channel experts without CLIP, boundary_ratio 0.9
I2V_ARGS = ("--seed", "3", "--max_steps", "3")  # seed 3: both generator steps' teacher batches straddle t = 900


@pytest.fixture(scope="module")
def i2v_run(prompt_file, tmp_path_factory, one_thread_module):
    """3 iterations (generator steps at 1 and 3) of the tiny two-expert image-to-video folder from two first
    frames, recording each teacher call and the expert and timesteps of every transformer call."""
    from PIL import Image

    root = tmp_path_factory.mktemp("distill_wan22_i2v")
    folder, images = make_wan22(root / "pipe", image_to_video=True), root / "images"
    images.mkdir()
    g = torch.Generator().manual_seed(5)
    for name in ("a.png", "b.png"):
        Image.fromarray(torch.randint(0, 256, (16, 16, 3), generator=g, dtype=torch.uint8).numpy()).save(images / name)
    out, seen = recorded_run(folder, prompt_file, root / "run", "--image", str(images), *I2V_ARGS,
                             log_calls=expert_log)
    return folder, images, out, seen


def test_i2v_teacher_is_the_pipelines_expert_and_guidance(i2v_run, tmp_path, monkeypatch):
    """Both generator steps' teacher (batches straddling t = 900) equals ``WanImageToVideoPipeline.__call__`` run
    one step at each row's t with that row's prompt and first frame (its own ``prepare_latents`` condition, expert
    choice and guidance; float32, 1e-5); ``sample --ckpt RUN --image IMG`` runs t = 1000 on ``transformer`` and
    t = 750 on ``transformer_2``."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    folder, images, out, seen = i2v_run
    pipe = WanImageToVideoPipeline.from_pretrained(str(folder), local_files_only=True)
    files = sorted(images.iterdir())
    for step, (x, t, got, calls) in zip((1, 3), seen["teacher"]):
        assert (t >= 900.0).any() and (t < 900.0).any() and calls == 4
        g = torch.Generator().manual_seed(derive_seed(3, step))
        rows = torch.randint(len(PROMPTS), (BATCH,), generator=g).tolist()
        picks = torch.randint(len(files), (BATCH,), generator=g).tolist()
        want = []
        with torch.no_grad():
            for i in range(BATCH):
                pipe.scheduler = OneStep(t[i])
                want.append(pipe(image=Image.open(files[picks[i]]).convert("RGB"), prompt=PROMPTS[rows[i]],
                                 height=16, width=16, num_frames=5, latents=x[i:i + 1], guidance_scale=SCALE,
                                 output_type="latent").frames)
        torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)
    # no --cfg_scale_2: the call's default guidance_scale_2, None, which takes guidance_scale's value
    distill = json.loads(sorted((out / "checkpoints").iterdir())[-1].joinpath("meta.json").read_text())["config"]
    assert (distill["distill"]["teacher_cfg_scale"], distill["distill"]["teacher_cfg_scale_2"]) == (SCALE, SCALE)
    calls: list = []
    expert_log(monkeypatch, calls)
    assert cli.main(["sample", "--ckpt", str(out), "--prompt", PROMPTS[0], "--image", str(files[0]), "--device",
                     "cpu", "--num_frames", "5", "--out", str(tmp_path / "a.mp4")]) == 0
    high, low = expert_sums(folder)
    assert [(s, t.tolist()) for s, t in calls] == [(high, [1000.0]), (low, [750.0])]
