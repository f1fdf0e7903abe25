"""``ditforge distill`` of the tiny random Wan 2.1 folder (``wan_pipeline``) with a full-copy student (``--lora_rank
0``, ``train/distill_nets.py``) and under fine-tuning's memory placements (``--fp8_base``, ``--optimizer adamw8bit``,
``--blocks_to_swap``). The full student's first iteration is checked against ``test_distill_video.reference_step``
(diffusers' transformer, peft, float64 formulas) with whole copies trained; its resume is exact; its checkpoint is a
full fine-tune's, so ``sample`` and ``export --format diffusers`` take it. Each placement is checked against an
unplaced run of the same iterations: the swapped run bit for bit, the fp8 run against a teacher folder whose
float8-stored weights were rounded to float8 beforehand, the 8-bit run against fp32 AdamW within the 8-bit moments'
error."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from ditforge import cli
from families import assert_one_line_error
from test_distill_video import (RANK, STEPS, assert_resume_exact, distill_argv, lora_tensors, prompt_file,  # noqa: F401
                                read_part, reference_step, run)

FULL = ("--lora_rank", "0")
EPS = 1e-8  # AdamW's


def metrics(out) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "steps_per_sec"}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def saved(ckpt, part: str) -> dict[str, torch.Tensor]:
    """Every tensor ``part.<name>`` of a DCP checkpoint, by name."""
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return read_part(ckpt, part, [k.split(".", 1)[1] for k in meta if k.startswith(part + ".")
                                  and hasattr(meta[k], "size")])


def gradient_spy(mp, grads: dict) -> None:
    """Record in ``grads`` the student's gradients (by parameter name) after iteration 1's generator step."""
    import ditforge.train.distill_pipeline as distill_pipeline

    iteration = distill_pipeline.iteration

    def spied(dmd, step, cfg, pre, prompts, files, sizes, scale, amp, networks, *rest):
        out = iteration(dmd, step, cfg, pre, prompts, files, sizes, scale, amp, networks, *rest)
        if step == 1:
            grads.update({k: p.grad.clone() for k, p in networks.params("student").items()})
        return out

    mp.setattr(distill_pipeline, "iteration", spied)


def full_student_run(folder, prompts, out, *extra: str) -> dict[str, torch.Tensor]:
    """A full-student run of ``folder`` into ``out`` (under one thread, as ``run``); returns the student's gradients
    of iteration 1."""
    grads: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        gradient_spy(mp, grads)
        assert cli.main(distill_argv(folder, prompts, out, *FULL, *extra)) == 0
    return grads


@pytest.fixture(scope="module")
def full_run(wan_pipeline, prompt_file, tmp_path_factory, one_thread_module):  # noqa: F811
    """``run``'s 4 iterations with a full-copy student and (the default) a full-copy critic, and the student's
    gradients of iteration 1."""
    out = tmp_path_factory.mktemp("distill_full") / "run"
    return out, full_student_run(wan_pipeline, prompt_file, out, "--max_steps", "4")


@pytest.mark.parametrize("critic_rank", [0, RANK])
def test_full_student_one_step_equals_reference_dmd2(critic_rank, full_run, wan_pipeline,
                                                    prompt_file, tmp_path, one_thread):  # noqa: F811
    """Iteration 1 with the student a whole trainable copy of the teacher's transformer (the critic a whole copy,
    DMD2's, or ``--critic_lora_rank`` adapters on the teacher): both losses to 1e-5, the student's clipped DMD
    gradient to 1e-4 (1e-5 of its largest entry absolute) and the networks after their AdamW step to 1e-5 of the
    reference's. At beta1 0 a first step moves a weight by lr g / (|g| + eps), lr sign(g) where |g| > 100 eps;
    below, it amplifies the float32 rounding of the gradient (a weight of |g| ~ eps moved 0.026 lr off the float64
    reference's), so the student's weights are compared where |g| > 100 eps (over half of them)."""
    from diffusers import WanTransformer3DModel

    out, ours = full_run
    if critic_rank:
        out = tmp_path / "run"
        ours = full_student_run(wan_pipeline, prompt_file, out, "--max_steps", "1", "--critic_lora_rank",
                                str(critic_rank))
    gen_loss, critic_loss, student, critic = reference_step(wan_pipeline, 0, critic_rank)
    first = metrics(out)[0]
    assert first["generator_loss"] == pytest.approx(gen_loss, rel=1e-5)
    assert first["critic_loss"] == pytest.approx(critic_loss, rel=1e-5)
    ckpt = out / "checkpoints" / "step-0000001"
    got = saved(ckpt, "ema")  # a full fine-tune's layout: the student's weights by the denoiser's names
    want = {f"transformer.{n}": p.detach() for n, p in student.named_parameters()}
    assert got.keys() == want.keys() and "student" not in {k.split(".")[0] for k in
                                                           dcp.FileSystemReader(str(ckpt)).read_metadata()
                                                           .state_dict_metadata}
    grads = {f"transformer.{n}": p.grad for n, p in student.named_parameters()}
    assert ours.keys() == grads.keys()
    scale = max(g.abs().max() for g in grads.values())
    for k in grads:  # the DMD gradient after clipping
        torch.testing.assert_close(ours[k], grads[k], rtol=1e-4, atol=1e-5 * scale)
    flat = [grads[k].abs() > 100 * EPS for k in want]  # the step lr g / (|g| + eps) is flat in g there
    assert sum(int(m.sum()) for m in flat) > 0.5 * sum(m.numel() for m in flat)
    for k, m in zip(want, flat):
        torch.testing.assert_close(got[k][m], want[k][m], rtol=1e-5, atol=1e-6)
    teacher = WanTransformer3DModel.from_pretrained(str(wan_pipeline), subfolder="transformer").state_dict()
    assert sum(not torch.equal(got[f"transformer.{n}"], v) for n, v in teacher.items()) > len(teacher) // 2
    if critic_rank:
        want = lora_tensors(critic)
        names = [f"transformer.{n}".replace(".lora_A.", ".lora_A.critic.").replace(".lora_B.", ".lora_B.critic.")
                 for n in want]
        got = read_part(ckpt, "critic", names)
        ref = dict(zip(names, want.values()))
    else:
        got, ref = saved(ckpt, "critic"), {f"transformer.{n}": p.detach() for n, p in critic.named_parameters()}
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


def test_full_student_resume_equals_uninterrupted(full_run, wan_pipeline, prompt_file,
                                                  tmp_path, one_thread):  # noqa: F811
    assert_resume_exact(full_run[0], wan_pipeline, prompt_file, tmp_path, *FULL)


def test_full_student_exports_and_samples_as_a_full_fine_tune(full_run, wan_pipeline, tmp_path):
    """``export --format diffusers`` writes the pipeline with the student's transformer (its checkpoint's ``ema``,
    bit for bit; the rest the teacher folder's); ``sample --ckpt RUN`` (the student's 2 steps, no guidance) draws the
    clip that the exported folder draws under ``--sampler student`` (within one level of 255)."""
    from diffusers import WanTransformer3DModel

    run_dir = full_run[0]
    folder = tmp_path / "pipeline"
    assert cli.main(["export", "--ckpt", str(run_dir), "--out", str(folder), "--format", "diffusers"]) == 0
    got = WanTransformer3DModel.from_pretrained(str(folder), subfolder="transformer").state_dict()
    student = saved(run_dir / "checkpoints" / "step-0000004", "ema")
    assert {f"transformer.{k}" for k in got} == student.keys()
    for k, v in got.items():
        assert torch.equal(v, student[f"transformer.{k}"]), k
    common = ["--prompt", "a cat walks", "--device", "cpu", "--num_frames", "5"]
    assert cli.main(["sample", "--ckpt", str(run_dir), "--out", str(tmp_path / "a.mp4"), "--save_npz",
                     str(tmp_path / "a.npz"), *common]) == 0
    assert cli.main(["sample", "--ckpt", str(folder), "--sampler", "student", "--num_sampling_steps", str(STEPS),
                     "--cfg_scale", "1", "--image_size", "16", "--out", str(tmp_path / "b.mp4"), "--save_npz",
                     str(tmp_path / "b.npz"), *common]) == 0
    a, b = (np.load(tmp_path / f"{n}.npz")["samples"].astype(int) for n in "ab")
    assert a.shape == (1, 5, 16, 16, 3) and np.abs(a - b).max() <= 1


def networks_at(out, step: int) -> dict[str, dict[str, torch.Tensor]]:
    ckpt = out / "checkpoints" / f"step-{step:07d}"
    return {part: saved(ckpt, part) for part in ("student", "critic")}


def test_blocks_to_swap_equals_the_unplaced_run(run, wan_pipeline, prompt_file, tmp_path,
                                                one_thread):  # noqa: F811
    """``--blocks_to_swap 2`` (both blocks' frozen weights in host memory, a device copy for each block's forward
    and recomputation; on the CPU a copy in host memory) changes no number: metrics and both adapters after 4
    iterations equal ``run``'s bit for bit."""
    out = tmp_path / "swapped"
    assert cli.main(distill_argv(wan_pipeline, prompt_file, out, "--max_steps", "4", "--blocks_to_swap", "2")) == 0
    assert metrics(out) == metrics(run)
    a, b = networks_at(out, 4), networks_at(run, 4)
    for part in a:
        assert a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in a[part])


def rounded_teacher(folder, out, components: tuple[str, ...] = ("transformer",)):
    """A copy of the pipeline ``folder`` whose transformers' (``components``) weights that ``--fp8_base`` stores in
    float8 (those diffusers' ``enable_layerwise_casting`` casts) are rounded to float8 e4m3 and stored back in
    float32; returns (the copy, how many weights of the first are rounded)."""
    from diffusers import WanTransformer3DModel

    shutil.copytree(folder, out)
    counts = []
    for name in components:
        cast = WanTransformer3DModel.from_pretrained(str(folder), subfolder=name)
        cast.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        fp8 = {n for n, p in cast.named_parameters() if p.dtype == torch.float8_e4m3fn}
        model = WanTransformer3DModel.from_pretrained(str(folder), subfolder=name)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in fp8:
                    p.copy_(p.to(torch.float8_e4m3fn).float())
        shutil.rmtree(out / name)
        model.save_pretrained(str(out / name))
        counts.append(len(fp8))
    return out, counts[0]


def test_fp8_base_equals_the_run_of_a_float8_rounded_teacher(run, wan_pipeline, prompt_file, tmp_path,
                                                             one_thread):  # noqa: F811
    """``--fp8_base`` stores the frozen teacher's layers in float8 e4m3 and computes them in float32 from exactly
    the stored values: 4 iterations equal the unplaced run of a teacher folder rounded to those values beforehand
    (metrics to 1e-5, adapters to 1e-5 / 1e-6), while the rounding moves them off ``run``'s (the unrounded
    teacher's) by more than that."""
    folder, cast = rounded_teacher(wan_pipeline, tmp_path / "rounded")
    assert cast >= 2 * 8  # 2 blocks: the attentions' projections and the FFN at least
    out, ref = tmp_path / "fp8", tmp_path / "ref"
    assert cli.main(distill_argv(wan_pipeline, prompt_file, out, "--max_steps", "4", "--fp8_base")) == 0
    assert cli.main(distill_argv(folder, prompt_file, ref, "--max_steps", "4")) == 0
    assert_fp8_run_is_the_rounded_teachers(out, ref, run, 4)


def assert_fp8_run_is_the_rounded_teachers(out, ref, plain, step: int) -> None:
    """The ``--fp8_base`` run ``out`` against the run ``ref`` of the float8-rounded teacher (metrics to 1e-5, both
    networks at ``step`` to 1e-5 / 1e-6), while the rounding moves its critic's losses off the unrounded teacher's
    run ``plain`` by more."""
    got, want, unrounded = metrics(out), metrics(ref), metrics(plain)
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-9), (a["step"], k)
    assert any(abs(a["critic_loss"] - c["critic_loss"]) > 1e-4 * abs(c["critic_loss"]) for a, c in zip(got, unrounded))
    a, b = networks_at(out, step), networks_at(ref, step)
    for part in a:
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            torch.testing.assert_close(a[part][k], b[part][k], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def wide_wan(tmp_path_factory):
    """``wan_pipeline`` 128 wide (2 heads x 64): rank-32 adapters of 32 x 128 = 4,096 elements, the smallest that
    bitsandbytes' blockwise 8-bit states quantize (``optim.compensated.MIN_8BIT_SIZE``)."""
    from tiny_pipelines import make_wan

    return make_wan(tmp_path_factory.mktemp("wide_wan") / "wan", attention_head_dim=64)


def test_adamw8bit_follows_fp32_adamw(wide_wan, prompt_file, tmp_path, one_thread):  # noqa: F811
    """``--optimizer adamw8bit`` (``CompensatedAdamW``'s 8-bit blockwise moments, betas 0, 0.999): the checkpoint
    holds the student's and critic's first and second moments as uint8 codes with their blocks' absmax; the
    first step of each network equals fp32 AdamW's to 1e-6 (its update is computed from the unquantized new
    moments), and the losses of 4 iterations stay within 0.1% of the fp32 run's (the codes' rounding of the
    moments after); resumed after iteration 2, the run ends bit for bit as the uninterrupted one (codes, absmax and
    step counts through DCP)."""
    common = ("--max_steps", "4", "--lora_rank", "32")
    out, ref = tmp_path / "8bit", tmp_path / "fp32"
    assert cli.main(distill_argv(wide_wan, prompt_file, out, *common, "--optimizer", "adamw8bit")) == 0
    assert cli.main(distill_argv(wide_wan, prompt_file, ref, *common)) == 0
    ckpt = out / "checkpoints" / "step-0000004"
    for part in ("optimizer", "critic_optimizer"):
        state = saved(ckpt, part)
        codes = [k for k, v in state.items() if k.endswith(".state1") and v.dtype == torch.uint8]
        assert len(codes) == 2 * 2 * 4 * 2, part  # 2 blocks x 2 attentions x 4 targets x (A, B)
        assert all(state[k.replace(".state1", ".state2")].dtype == torch.uint8 for k in codes)
    a, b = networks_at(out, 1), networks_at(ref, 1)
    for part in a:
        for k in a[part]:
            torch.testing.assert_close(a[part][k], b[part][k], rtol=0, atol=1e-6)
    got, want = metrics(out), metrics(ref)
    assert got[0] == pytest.approx(want[0], rel=1e-6)
    for x, y in zip(got, want):  # measured: 1e-4 at most
        assert x.keys() == y.keys() and all(x[k] == pytest.approx(y[k], rel=1e-3) for k in x), x["step"]
    a, b = networks_at(out, 4), networks_at(ref, 4)
    assert any(not torch.equal(a["student"][k], b["student"][k]) for k in a["student"])  # the codes' rounding
    assert_resume_exact(out, wide_wan, prompt_file, tmp_path / "resumed", *common[2:], "--optimizer", "adamw8bit")


@pytest.mark.parametrize("flags, says", [
    (("--critic_lora_rank", "0"), ["--critic_lora_rank 0", "adapter on its base"]),
    (("--blocks_to_swap", "1", "--no-grad_checkpoint"), ["--blocks_to_swap", "--grad_checkpoint"]),
    (("--blocks_to_swap", "3"), ["--blocks_to_swap 3", "2 blocks"]),
    (("--critic_lora_rank", "-1"), ["--critic_lora_rank", ">= 0"]),
    (("--plugin", "zero2"), ["--plugin zero2", "distill takes auto | ddp | fsdp"]),
    (("--sequence_parallel_size", "2"), ["--sequence_parallel_size 2", "does not divide the 1 processes"]),
])
def test_bad_placement_flags_one_line(flags, says, wan_pipeline, prompt_file, tmp_path, capsys):  # noqa: F811
    argv = distill_argv(wan_pipeline, prompt_file, tmp_path / "bad", "--max_steps", "1", *flags)
    assert_one_line_error(capsys, argv, *says)


def test_two_expert_teacher_refuses_full_copies(prompt_file, tmp_path, capsys):  # noqa: F811
    """A full-copy student or critic of a two-expert teacher: one line naming the flag (its placements and parallel
    plans run: ``test_distill_experts``, ``test_dist_distill``)."""
    from tiny_pipelines import make_wan22

    folder = make_wan22(tmp_path / "wan22")
    capsys.readouterr()  # what building it printed
    for flags, says in ((FULL, "--lora_rank 0"), (("--critic_lora_rank", "0", *FULL), "--lora_rank 0")):
        argv = distill_argv(folder, prompt_file, tmp_path / "bad", "--max_steps", "1", *flags)
        assert_one_line_error(capsys, argv, says, "two experts", "give a LoRA rank")
