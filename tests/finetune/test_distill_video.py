"""``ditforge distill`` of a diffusers video pipeline (``train/distill_pipeline.py``) on the tiny random Wan 2.1
folder (``wan_pipeline``): a LoRA student and critic on one base, checked against an independent DMD2 step written
here on diffusers' ``WanPipeline`` and peft (three copies of the transformer, float64 formulas), exact resume, the
export through diffusers' ``load_lora_weights``, sampling the run in its steps, and the one-line refusals."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ditforge import cli
from ditforge.data.sampler import derive_seed
from families import assert_one_line_error

PROMPTS = ["a red ball rolls", "a blue cube spins", "a cat walks"]
RANK, STEPS, BATCH, LR, SEED, SCALE = 4, 2, 2, 1e-3, 0, 5.0  # WanPipeline's default guidance_scale is 5
SHAPE = (BATCH, 16, 2, 2, 2)  # 5 frames of 16 x 16: 2 latent frames of 2 x 2
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the Wan adapter's default LoRA targets


def distill_argv(folder, prompts, out, *extra: str) -> list[str]:
    """The tests' ``ditforge distill`` of ``folder`` from the file ``prompts`` (None: no ``--prompt_file``)."""
    return ["distill", "--teacher", str(folder), *(["--prompt_file", str(prompts)] if prompts else []),
            "--student_steps", str(STEPS), "--lora_rank", str(RANK), "--height", "16", "--width", "16", "--num_frames",
            "5", "--batch_size", str(BATCH), "--critic_steps", "2", "--lr", str(LR), "--seed", str(SEED),
            "--log_every", "1", "--ckpt_every", "1", "--keep_last", "4", "--device", "cpu", "--outputs", str(out),
            *extra]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("distill_prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def run(wan_pipeline, prompt_file, tmp_path_factory):
    """4 iterations (generator steps at 1 and 3, a critic step in each), a checkpoint after each."""
    out = tmp_path_factory.mktemp("distill_run") / "run"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main(distill_argv(wan_pipeline, prompt_file, out, "--max_steps", "4")) == 0
    finally:
        torch.set_num_threads(before)
    return out


def read_part(ckpt, part: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``part.<name>`` of a DCP checkpoint, in their saved shapes and dtypes."""
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    state = {part: {n: torch.empty(meta[f"{part}.{n}"].size, dtype=meta[f"{part}.{n}"].properties.dtype)
                    for n in names}}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)
    return state[part]


def trained(model, rank: int) -> list[torch.nn.Parameter]:
    """A reference network's trained parameters: its LoRA adapters (``rank`` > 0), else all of them."""
    return [p for n, p in model.named_parameters() if "lora_" in n or not rank]


def reference_step(folder, student_rank: int = RANK, critic_rank: int = RANK):
    """Iteration 1 of the run, independently: diffusers' ``WanPipeline`` for the prompts and the transformer, three
    copies of it (the teacher, and peft's adapter on the student's and the critic's, Gaussian A drawn after
    ``torch.manual_seed(SEED)`` in that order; a rank 0 network trains its whole copy instead), the generator's
    draws in the run's order, DMD (Yin et al. 2024 eqs. 7-8) and the flow loss in float64, AdamW (betas 0, 0.999).
    Returns (generator loss, critic loss, student, critic) after their step."""
    from diffusers import WanPipeline
    from peft import LoraConfig, inject_adapter_in_model

    pipe = WanPipeline.from_pretrained(str(folder), local_files_only=True)
    base = pipe.transformer.eval().requires_grad_(False)
    student, critic = copy.deepcopy(base), copy.deepcopy(base)
    torch.manual_seed(SEED)
    for m, rank in ((student, student_rank), (critic, critic_rank)):
        if rank:
            inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                               target_modules=TARGETS), m)
    shift = 3.0  # the folder's UniPC flow_shift
    warp = lambda s: shift * s / (1 + (shift - 1) * s)  # noqa: E731
    sigma = [float(torch.tensor(warp(1 - k / STEPS)).float()) for k in range(STEPS)]

    def encode(texts):
        with torch.no_grad():
            return pipe.encode_prompt(texts, do_classifier_free_guidance=False, max_sequence_length=512)[0]

    g = torch.Generator().manual_seed(derive_seed(SEED, 1))
    rows = torch.randint(len(PROMPTS), (BATCH,), generator=g).tolist()
    cond, null = encode([PROMPTS[i] for i in rows]), encode([""]).expand(BATCH, -1, -1)
    noise = torch.randn(SHAPE, generator=g)

    def v(model, x, t, c=cond):  # t: (B,) float32 sigmas
        return model(hidden_states=x, timestep=t * 1000, encoder_hidden_states=c, return_dict=False)[0].double()

    def at(t):
        return t.double().view(-1, 1, 1, 1, 1)

    k = int(torch.randint(STEPS, (), generator=g))
    x = noise
    with torch.no_grad():
        for j in range(k):
            t = torch.full((BATCH,), sigma[j])
            x0 = x.double() - at(t) * v(student, x, t)
            x = ((1 - sigma[j + 1]) * x0 + sigma[j + 1] * torch.randn(SHAPE, generator=g).double()).float()
    for p in trained(student, student_rank):
        p.requires_grad_(True)
    t = torch.full((BATCH,), sigma[k])
    gen = (x.double() - at(t) * v(student, x, t)).float()
    u = 0.02 + 0.96 * torch.rand(BATCH, generator=g, dtype=torch.float64)
    t = warp(u).float()
    x_t = ((1 - at(t)) * gen.detach().double() + at(t) * torch.randn(SHAPE, generator=g).double()).float()
    with torch.no_grad():
        c, un = v(base, x_t, t), v(base, x_t, t, null)
        x0_real = x_t.double() - at(t) * (un + SCALE * (c - un))
        x0_fake = x_t.double() - at(t) * v(critic, x_t, t)
        grad = (x0_fake - x0_real) / (gen.double() - x0_real).abs().mean(dim=(1, 2, 3, 4), keepdim=True)
    gen_loss = 0.5 * ((gen.double() - (gen.double() - grad).detach()) ** 2).mean()

    def step(model, loss, rank):
        params = trained(model, rank)
        opt = torch.optim.AdamW(params, lr=LR, betas=(0.0, 0.999), weight_decay=0.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    step(student, gen_loss, student_rank)
    t = warp(torch.sigmoid(torch.randn(BATCH, generator=g))).float()  # the flow loss's logit-normal times
    eps = torch.randn(SHAPE, generator=g)
    x0 = gen.detach()
    x_t = ((1 - at(t)) * x0.double() + at(t) * eps.double()).float()
    for p in trained(critic, critic_rank):
        p.requires_grad_(True)
    critic_loss = ((eps.double() - x0.double() - v(critic, x_t, t)) ** 2).mean()
    step(critic, critic_loss, critic_rank)
    return float(gen_loss.detach()), float(critic_loss.detach()), student, critic


def lora_tensors(model, adapter: str = "default") -> dict[str, torch.Tensor]:
    return {n.replace(f".{adapter}.", "."): p.detach() for n, p in model.named_parameters() if "lora_" in n}


def test_one_step_equals_reference_dmd2(run, wan_pipeline):
    gen_loss, critic_loss, student, critic = reference_step(wan_pipeline)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    assert first["generator_loss"] == pytest.approx(gen_loss, rel=1e-5, abs=1e-12)
    assert first["critic_loss"] == pytest.approx(critic_loss, rel=1e-5)
    ckpt = run / "checkpoints" / "step-0000001"
    for adapter, ref in (("student", student), ("critic", critic)):
        want = lora_tensors(ref)
        names = [f"transformer.{n}".replace(".lora_A.", f".lora_A.{adapter}.").replace(".lora_B.", f".lora_B.{adapter}.")
                 for n in want]
        got = read_part(ckpt, adapter, names)
        assert len(got) == len(want) == 2 * 4 * 2 * 2  # 2 blocks x 2 attentions x 4 targets x (A, B)
        for name, n in zip(names, want):
            torch.testing.assert_close(got[name], want[n], rtol=1e-5, atol=1e-6)
        assert any((got[name] != 0).any() for name in names if ".lora_B." in name)  # the step moved B


def assert_resume_exact(run, folder, prompt_file, tmp_path, *extra: str) -> None:
    """The 4-iteration ``run`` of ``folder`` cut after step 2 and resumed: adapters and metrics bit for bit. Called
    under ``one_thread``, the thread count the run was made with (float32 reductions split by the thread count
    differ in their last bits: HunyuanVideo's resumed student did at 2 threads against a 1-thread run)."""
    cut = tmp_path / "run"
    shutil.copytree(run, cut)
    for step in ("step-0000003", "step-0000004"):
        shutil.rmtree(cut / "checkpoints" / step)
    assert cli.main(distill_argv(folder, prompt_file, cut, "--max_steps", "4", "--resume", "auto", *extra)) == 0
    meta = dcp.FileSystemReader(str(run / "checkpoints" / "step-0000004")).read_metadata().state_dict_metadata
    names = [k for k in meta if hasattr(meta[k], "size")]
    parts = {k.split(".", 1)[0] for k in names}
    assert {"critic", "optimizer", "critic_optimizer"} <= parts and parts & {"student", "ema"}
    for part in parts:  # networks (a full student's as ``ema``), optimizer states
        keys = [k.split(".", 1)[1] for k in names if k.startswith(part + ".")]
        a, b = (read_part(r / "checkpoints" / "step-0000004", part, keys) for r in (run, cut))
        assert keys and all(torch.equal(a[k], b[k]) for k in keys), part
    strip = [{k: v for k, v in json.loads(line).items() if k != "steps_per_sec"}
             for line in (run / "metrics.jsonl").read_text().splitlines()]
    again = [{k: v for k, v in json.loads(line).items() if k != "steps_per_sec"}
             for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert again == strip and [r["step"] for r in again] == [1, 2, 3, 4]


def test_resume_equals_uninterrupted(run, wan_pipeline, prompt_file, tmp_path, one_thread):
    assert_resume_exact(run, wan_pipeline, prompt_file, tmp_path)


def export_loads(run, pipeline_class, folder, tmp_path, timesteps: list, comfyui: bool = True):
    """The run's saved timesteps are ``timesteps``; its ``export --format lora`` (and ``comfyui``: a family with an
    original layout) written,
    loaded by ``pipeline_class``'s ``load_lora_weights`` into ``folder``'s pipeline with the student's tensors
    exactly. Returns (that pipeline, the LoRA folder)."""
    config = json.loads((run / "checkpoints" / "step-0000004" / "meta.json").read_text())["config"]
    assert config["distill"]["timesteps"] == pytest.approx(timesteps)
    out = tmp_path / "lora"
    assert cli.main(["export", "--ckpt", str(run), "--out", str(out), "--format", "lora"]) == 0
    comfy = tmp_path / "c.safetensors"
    assert not comfyui or cli.main(["export", "--ckpt", str(run), "--out", str(comfy), "--format", "comfyui"]) == 0
    pipe = pipeline_class.from_pretrained(str(folder), local_files_only=True)
    pipe.load_lora_weights(str(out))
    student = read_part(run / "checkpoints" / "step-0000004", "ema", [f"transformer.{n}".replace(
        ".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.") for n in lora_tensors(pipe.transformer,
                                                                                                  "default_0")])
    loaded = {f"transformer.{n}".replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): p
              for n, p in lora_tensors(pipe.transformer, "default_0").items()}
    assert student and loaded.keys() == student.keys()
    for k in student:
        torch.testing.assert_close(loaded[k], student[k], rtol=0, atol=0)
    return pipe, out


def test_export_loads_in_diffusers_and_samples_in_its_steps(run, wan_pipeline, tmp_path):
    from diffusers import WanPipeline

    from ditforge.weights.finetuned import load_finetuned
    from ditforge.weights.read import load_weights

    from ditforge.diffusion.dmd import flow_student_sigmas

    # the folder's UniPC flow_shift 3
    pipe, out = export_loads(run, WanPipeline, wan_pipeline, tmp_path, flow_student_sigmas(3.0, STEPS).tolist())
    # the run samples as the pipeline with the exported LoRA does under --sampler student in the run's steps
    g = torch.Generator().manual_seed(3)
    x, states = torch.randn(1, 16, 2, 2, 2, generator=g), torch.randn(1, 512, 32, generator=g)
    _, ours, _ = load_finetuned(*load_weights(str(run)), torch.device("cpu"))
    with torch.no_grad():
        want = pipe.transformer(hidden_states=x, timestep=torch.tensor([750.0]), encoder_hidden_states=states,
                                return_dict=False)[0]
        torch.testing.assert_close(ours(x, torch.tensor([750.0]), encoder_hidden_states=states), want)
    common = ["--prompt", "a cat walks", "--device", "cpu", "--num_frames", "5"]
    assert cli.main(["sample", "--ckpt", str(run), "--out", str(tmp_path / "a.mp4"), "--save_npz",
                     str(tmp_path / "a.npz"), *common]) == 0
    assert cli.main(["sample", "--ckpt", str(wan_pipeline), "--lora", str(out), "--sampler", "student",
                     "--num_sampling_steps", str(STEPS), "--cfg_scale", "1", "--image_size", "16", "--out",
                     str(tmp_path / "b.mp4"), "--save_npz", str(tmp_path / "b.npz"), *common]) == 0
    import numpy as np

    a, b = (np.load(tmp_path / f"{n}.npz")["samples"].astype(int) for n in "ab")
    assert a.shape == (1, 5, 16, 16, 3) and np.abs(a - b).max() <= 1


def test_bad_input_one_line(wan_pipeline, prompt_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "bad"
    assert_one_line_error(capsys, distill_argv(wan_pipeline, prompt_file, out, "--student_steps", "0"),
                          "--student_steps", "0")
    assert_one_line_error(capsys, distill_argv(wan_pipeline, prompt_file, out, "--lora_target_modules", "nope"),
                          "--lora_target_modules", "nope")
    assert_one_line_error(capsys, distill_argv(wan_pipeline, prompt_file, out, "--cfg_scale_2", "3"),
                          "--cfg_scale_2", "two experts", "of one")
    import ditforge.models.adapters.pipeline as pipeline

    defaults = pipeline.pipeline_defaults
    monkeypatch.setattr(pipeline, "pipeline_defaults",
                        lambda pipe: {k: v for k, v in defaults(pipe).items() if k != "guidance_scale"})
    assert_one_line_error(capsys, distill_argv(wan_pipeline, prompt_file, out), "--teacher", "no guidance "
                          "information", "--cfg_scale")


def test_fine_tuned_run_as_teacher(video_runs, wan_pipeline, prompt_file, tmp_path):
    """A LoRA fine-tune as ``--teacher``: written as ``OUTPUTS/teacher``, whose transformer is diffusers' own fusion of
    the run's LoRA file into the base pipeline (``load_lora_weights`` then ``fuse_lora``), and distilled from there."""
    from diffusers import WanPipeline, WanTransformer3DModel

    tuned = video_runs("wan")["lora"]
    out = tmp_path / "student"
    assert cli.main(distill_argv(tuned, prompt_file, out, "--max_steps", "1")) == 0
    config = json.loads((out / "checkpoints" / "step-0000001" / "meta.json").read_text())["config"]
    assert config["model"]["init_from"] == str(out / "teacher")
    assert cli.main(["export", "--ckpt", str(tuned), "--out", str(tmp_path / "tuned_lora"), "--format", "lora"]) == 0
    pipe = WanPipeline.from_pretrained(str(wan_pipeline), local_files_only=True)
    pipe.load_lora_weights(str(tmp_path / "tuned_lora"))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    want = pipe.transformer.state_dict()
    got = WanTransformer3DModel.from_pretrained(str(out / "teacher"), subfolder="transformer").state_dict()
    assert got.keys() == want.keys()
    base = WanTransformer3DModel.from_pretrained(str(wan_pipeline), subfolder="transformer").state_dict()
    assert any(not torch.equal(got[k], base[k]) for k in got)  # the fine-tune is in the teacher
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


# HunyuanVideo: guidance-distilled (the scale embedded in one pass, HunyuanVideoPipeline's default 6)
HV_SCALE = 6.0


def forward_log(monkeypatch, model_class, argument: str, seen: list) -> None:
    """Record the keyword ``argument`` (a tensor) of every call of ``model_class.forward`` in ``seen``."""
    forward = model_class.forward

    def recorded(self, *args, **kwargs):
        seen.append(kwargs[argument].detach().clone())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(model_class, "forward", recorded)


def guidance_log(monkeypatch, seen: list) -> None:
    """Record the ``guidance`` tensor of every call of diffusers' ``HunyuanVideoTransformer3DModel.forward``."""
    from diffusers import HunyuanVideoTransformer3DModel

    forward_log(monkeypatch, HunyuanVideoTransformer3DModel, "guidance", seen)


def recorded_run(folder, prompt_file, out, *extra: str, log_calls=lambda mp, calls: None):
    """``run``'s 4 iterations of ``folder`` (one thread) into ``out``, recording each teacher call in
    ``seen["teacher"]`` (x_t, t, its output, how many entries ``log_calls`` (monkeypatch, list) added to
    ``seen["calls"]`` during it). Returns (out, seen)."""
    import ditforge.train.distill_pipeline as distill_pipeline

    seen = {"teacher": [], "calls": []}
    nets = distill_pipeline.nets

    def spy(model, cond, scale, amp, scale_2=None):
        student, critic, teacher = nets(model, cond, scale, amp, scale_2)

        def watched(x, t):
            before = len(seen["calls"])
            v = teacher(x, t)
            seen["teacher"].append((x.detach().clone(), t.detach().clone(), v.detach().clone(),
                                    len(seen["calls"]) - before))
            return v

        return student, critic, watched

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(distill_pipeline, "nets", spy)
            log_calls(mp, seen["calls"])
            assert cli.main(distill_argv(folder, prompt_file, out, "--max_steps", "4", *extra)) == 0
    finally:
        torch.set_num_threads(before)
    return out, seen


@pytest.fixture(scope="module")
def hv_run(hunyuan_video_pipeline, prompt_file, tmp_path_factory):
    """``run``'s 4 iterations on the tiny HunyuanVideo, the default --cfg_scale (the pipeline's), recording each
    teacher call and the guidance of every transformer call (``seen["calls"]``)."""
    return recorded_run(hunyuan_video_pipeline, prompt_file, tmp_path_factory.mktemp("distill_hv") / "run",
                        log_calls=guidance_log)


def test_hunyuan_teacher_is_one_pass_with_the_embedded_scale(hv_run, hunyuan_video_pipeline):
    """The teacher of iteration 1 equals diffusers' transformer called directly as ``HunyuanVideoPipeline.__call__``
    calls it (``guidance = torch.tensor([guidance_scale] * B) * 1000.0``, the prompts through the pipeline's own
    ``encode_prompt``) to 1e-5 in float32, in one transformer call; every call (student, critic, teacher) embeds
    6; the critic starts as the teacher (its LoRA B is 0), so the first DMD gradient is exactly 0, later ones not."""
    from diffusers import HunyuanVideoPipeline

    run, seen = hv_run
    assert seen["calls"] and all(torch.equal(g, torch.full((BATCH,), HV_SCALE * 1000.0)) for g in seen["calls"])
    assert [n for *_, n in seen["teacher"]] == [1] * len(seen["teacher"]) and len(seen["teacher"]) == 2
    pipe = HunyuanVideoPipeline.from_pretrained(str(hunyuan_video_pipeline), local_files_only=True)
    g = torch.Generator().manual_seed(derive_seed(SEED, 1))
    rows = torch.randint(len(PROMPTS), (BATCH,), generator=g).tolist()
    with torch.no_grad():
        embeds, pooled, mask = pipe.encode_prompt([PROMPTS[i] for i in rows], max_sequence_length=256)
        x, t, got, _ = seen["teacher"][0]

        def reference(scale):
            guidance = torch.tensor([scale] * BATCH, dtype=torch.float32) * 1000.0  # the pipeline's tensor
            return pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds,
                                    encoder_attention_mask=mask, pooled_projections=pooled, guidance=guidance,
                                    return_dict=False)[0]

        torch.testing.assert_close(got, reference(HV_SCALE), rtol=1e-5, atol=1e-5)
        assert (got - reference(1.0)).abs().max() > 1e-3  # the embedding matters in the tiny model
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert lines[0]["generator_loss"] == 0.0 and lines[0]["dmd_grad_norm"] == 0.0
    assert lines[2]["dmd_grad_norm"] > 0.0
    config = json.loads((run / "checkpoints" / "step-0000004" / "meta.json").read_text())["config"]
    assert config["distill"]["teacher_cfg_scale"] == config["distill"]["sample_cfg_scale"] == HV_SCALE


def test_hunyuan_resume_equals_uninterrupted(hv_run, hunyuan_video_pipeline, prompt_file, tmp_path, one_thread):
    assert_resume_exact(hv_run[0], hunyuan_video_pipeline, prompt_file, tmp_path)


def test_hunyuan_export_loads_and_samples_with_the_embedded_scale(hv_run, hunyuan_video_pipeline, tmp_path,
                                                                 monkeypatch):
    """The LoRA loads through ``HunyuanVideoPipeline.load_lora_weights``; ``sample --ckpt RUN`` and the pipeline
    with that LoRA under ``--sampler student`` (no --cfg_scale) both embed 6 in every call and draw the same clip."""
    import numpy as np
    from diffusers import HunyuanVideoPipeline

    from ditforge.diffusion.dmd import flow_student_sigmas

    _, out = export_loads(hv_run[0], HunyuanVideoPipeline, hunyuan_video_pipeline, tmp_path,
                          flow_student_sigmas(7.0, STEPS).tolist())  # its shift 7
    guidance: list = []
    guidance_log(monkeypatch, guidance)
    common = ["--prompt", "a cat walks", "--device", "cpu", "--num_frames", "5"]
    assert cli.main(["sample", "--ckpt", str(hv_run[0]), "--out", str(tmp_path / "a.mp4"), "--save_npz",
                     str(tmp_path / "a.npz"), *common]) == 0
    assert cli.main(["sample", "--ckpt", str(hunyuan_video_pipeline), "--lora", str(out), "--sampler", "student",
                     "--num_sampling_steps", str(STEPS), "--image_size", "16", "--out", str(tmp_path / "b.mp4"),
                     "--save_npz", str(tmp_path / "b.npz"), *common]) == 0
    assert len(guidance) == 2 * STEPS and all(torch.equal(g, torch.tensor([HV_SCALE * 1000.0])) for g in guidance)
    a, b = (np.load(tmp_path / f"{n}.npz")["samples"].astype(int) for n in "ab")
    assert a.shape == (1, 5, 16, 16, 3) and np.abs(a - b).max() <= 1


# CogVideoX: a DDPM v-prediction teacher (zero terminal SNR, SNR shift 3: the tiny pipeline's scheduler), its
# latents frames first in the pipeline, guided by CFG at CogVideoXPipeline's default guidance_scale 6
COG_SCALE, COG_SIZE = 6.0, ("--height", "32", "--width", "32", "--num_frames", "9")  # latents 4 x 3 x 4 x 4
COG_TIMES = [999, 499]  # DMD2's rule T-1 - k T / K at K = 2


def cog_rotary(pipe, frames: int):
    """The pipeline's own rotary tables of 32 x 32 frames, ``frames`` latent frames (its ``__call__``'s)."""
    return pipe._prepare_rotary_positional_embeddings(32, 32, frames, torch.device("cpu"))


def timestep_log(monkeypatch, seen: list) -> None:
    """Record the ``timestep`` of every call of diffusers' ``CogVideoXTransformer3DModel.forward``."""
    from diffusers import CogVideoXTransformer3DModel

    forward_log(monkeypatch, CogVideoXTransformer3DModel, "timestep", seen)


@pytest.fixture(scope="module")
def cog_run(cogvideox_pipeline, prompt_file, tmp_path_factory):
    """``run``'s 4 iterations on the tiny CogVideoX (LoRA student), the default --cfg_scale (the pipeline's)."""
    return recorded_run(cogvideox_pipeline, prompt_file, tmp_path_factory.mktemp("distill_cog") / "run", *COG_SIZE,
                        log_calls=timestep_log)


def test_cogvideox_teacher_is_the_pipelines_guided_v(cog_run, cogvideox_pipeline):
    """The teacher of iteration 1 equals diffusers' transformer called directly as ``CogVideoXPipeline.__call__``'s
    loop calls it: latents frames first, [negative; prompt] states of the pipeline's ``encode_prompt`` (negative
    "", 226 tokens), the pipeline's rotary tables, ``timestep`` for both halves, ``noise_pred.float()`` then
    ``uncond + 6 (text - uncond)``; 1e-5 in float32, in two transformer calls. x0 from v is the scheduler's
    ``sqrt(abar) x - sqrt(1 - abar) v`` (diffusers' ``alphas_cumprod``; -v at t = 999, zero terminal SNR), and every
    logged loss is finite; the checkpoint keeps DMD2's timesteps and the teacher's guidance."""
    from diffusers import CogVideoXPipeline

    from ditforge.diffusion.dmd import predicted_x0
    from ditforge.diffusion.objective import create_objective

    run, seen = cog_run
    pipe = CogVideoXPipeline.from_pretrained(str(cogvideox_pipeline), local_files_only=True)
    g = torch.Generator().manual_seed(derive_seed(SEED, 1))
    rows = torch.randint(len(PROMPTS), (BATCH,), generator=g).tolist()
    x, t, got, calls = seen["teacher"][0]
    assert x.shape == (BATCH, 4, 3, 4, 4) and t.dtype == torch.int64 and calls == 2 and len(seen["teacher"]) == 2
    with torch.no_grad():
        embeds, negative = pipe.encode_prompt([PROMPTS[i] for i in rows], do_classifier_free_guidance=True,
                                              max_sequence_length=226)
        latents = x.transpose(1, 2)  # the pipeline's (B, T', C, h, w)
        out = pipe.transformer(hidden_states=torch.cat([latents] * 2), encoder_hidden_states=torch.cat(
            [negative, embeds]), timestep=torch.cat([t, t]), image_rotary_emb=cog_rotary(pipe, 3),
            return_dict=False)[0].float()
    uncond, text = out.chunk(2)
    torch.testing.assert_close(got, (uncond + COG_SCALE * (text - uncond)).transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert (got - text.transpose(1, 2)).abs().max() > 1e-3  # the guidance matters in the tiny model
    objective = create_objective("auto", False, dict(pipe.scheduler.config))
    steps = torch.tensor([999, 499, 0, int(torch.randint(1, 999, ()))])
    x, v = torch.randn(2, 4, 4, 3, 4, 4, dtype=torch.float64)
    abar = pipe.scheduler.alphas_cumprod.double()[steps].view(-1, 1, 1, 1, 1)
    want = abar.sqrt() * x - (1 - abar).sqrt() * v
    torch.testing.assert_close(predicted_x0(objective, x, steps, v), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(predicted_x0(objective, x, steps, v)[0], -v[0])
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and lines[0]["dmd_grad_norm"] > 0
    assert all(torch.isfinite(torch.tensor(v)) for r in lines for v in r.values())
    config = json.loads((run / "checkpoints" / "step-0000004" / "meta.json").read_text())["config"]
    assert config["distill"]["teacher_cfg_scale"] == COG_SCALE and config["distill"]["sample_cfg_scale"] == 1.0


def test_cogvideox_resume_equals_uninterrupted(cog_run, cogvideox_pipeline, prompt_file, tmp_path, one_thread):
    assert_resume_exact(cog_run[0], cogvideox_pipeline, prompt_file, tmp_path, *COG_SIZE)


def test_cogvideox_export_loads_and_samples_in_its_k_steps(cog_run, cogvideox_pipeline, tmp_path, monkeypatch):
    """The LoRA loads through ``CogVideoXPipeline.load_lora_weights``; ``sample --ckpt RUN`` runs the student's 2
    steps at t = 999, 499 without guidance (one transformer call each) and draws the clip the pipeline with that
    LoRA draws under ``--sampler student``; its latents equal DMD2's K-step recipe written here on diffusers'
    transformer with the LoRA and the scheduler's ``alphas_cumprod`` (1e-5)."""
    import numpy as np
    from diffusers import CogVideoXPipeline
    from diffusers.utils.torch_utils import randn_tensor

    from ditforge.parallel.mesh import Dist
    from ditforge.sample.load import SampleConfig
    from ditforge.sample.video import VideoSampler
    from ditforge.weights.finetuned import load_finetuned
    from ditforge.weights.read import load_weights

    run = cog_run[0]
    pipe, out = export_loads(run, CogVideoXPipeline, cogvideox_pipeline, tmp_path, COG_TIMES, comfyui=False)
    shape, seed, abar = (1, 4, 3, 4, 4), 11, pipe.scheduler.alphas_cumprod.double()
    with torch.no_grad():
        text = pipe.encode_prompt(PROMPTS[2], do_classifier_free_guidance=False, max_sequence_length=226)[0]
        generator = torch.Generator().manual_seed(seed)
        x = randn_tensor(shape, generator=generator, dtype=torch.float32)
        for k, t in enumerate(COG_TIMES):
            v = pipe.transformer(hidden_states=x.transpose(1, 2), encoder_hidden_states=text, timestep=torch.tensor(
                [t]), image_rotary_emb=cog_rotary(pipe, 3), return_dict=False)[0].transpose(1, 2).double()
            x0 = abar[t].sqrt() * x.double() - (1 - abar[t]).sqrt() * v
            if k + 1 < len(COG_TIMES):
                a = abar[COG_TIMES[k + 1]]
                x = (a.sqrt() * x0 + (1 - a).sqrt() * randn_tensor(shape, generator=generator)).float()
        pre, ours, _ = load_finetuned(*load_weights(str(run)), torch.device("cpu"))
        sampler = VideoSampler(pre, ours, Dist(), SampleConfig(ckpt=str(run), mixed_precision="fp32",
                                                               sampler="student"))
        got = sampler.denoise(pre.encode_prompt([PROMPTS[2]]), None, shape, seed, len(COG_TIMES), 1.0)
    torch.testing.assert_close(got, x0.float(), rtol=0, atol=1e-5)
    times: list = []
    timestep_log(monkeypatch, times)
    common = ["--prompt", PROMPTS[2], "--device", "cpu", "--num_frames", "9"]
    assert cli.main(["sample", "--ckpt", str(run), "--out", str(tmp_path / "a.mp4"), "--save_npz",
                     str(tmp_path / "a.npz"), *common]) == 0
    assert cli.main(["sample", "--ckpt", str(cogvideox_pipeline), "--lora", str(out), "--sampler", "student",
                     "--num_sampling_steps", str(STEPS), "--cfg_scale", "1", "--image_size", "32", "--out",
                     str(tmp_path / "b.mp4"), "--save_npz", str(tmp_path / "b.npz"), *common]) == 0
    assert [t.tolist() for t in times] == [[t] for t in COG_TIMES] * 2
    a, b = (np.load(tmp_path / f"{n}.npz")["samples"].astype(int) for n in "ab")
    assert a.shape == (1, 9, 32, 32, 3) and np.abs(a - b).max() <= 1


def test_cogvideox_student_steps_beyond_its_timesteps_one_line(cogvideox_pipeline, prompt_file, tmp_path, capsys):
    assert_one_line_error(capsys, distill_argv(cogvideox_pipeline, prompt_file, tmp_path / "bad", *COG_SIZE,
                                               "--student_steps", "1001"), "--student_steps", "1..1000")
