"""``ditforge distill`` of the tiny random Wan 2.1 folder in two processes (gloo on the CPU) against one process with
the same global batch of two rows, in one launch of both processes (``torchrun_cli_many``) shared by the tests:

- data parallel (``--plugin ddp``, the default): each process one row of the global draws, the gradients averaged;
- FSDP2 (``--plugin fsdp``): the frozen teacher, both adapters on it, the full-copy student sharded per transformer
  block, each process one row, the gradients reduce-scattered and clipped to the global norm; a LoRA student and
  critic, and a full student with a LoRA critic; that run cut after iteration 2 and resumed under FSDP;
- Ulysses (``--sequence_parallel_size 2``): both processes the same two rows, each row's two video tokens split one a
  process (``parallel.context``), for teacher, critic and student; with LoRA student and critic, and a full student
  with a LoRA critic under FSDP (the shards over both processes of the one sequence-parallel group).

The tiny two-expert Wan 2.2 A14B folder (``make_wan22``: a student and a critic LoRA on each expert, every row on
the expert of its t) under DDP, FSDP2 (both experts sharded) and Ulysses, each against its one process; its FSDP run cut
after iteration 2 and resumed in one process, and the one-process run cut there resumed in two under FSDP (DCP
reshards the checkpoint to the other process count).

The LoRA runs of both teachers read real clips (``--data``: a folder of three tiny captioned clips) for DMD2's GAN
head on the critic's middle-block features, which is then under DDP, FSDP2 (the head an FSDP2 unit of its own) and
Ulysses (each row's tokens split, the head's token logits gathered before their mean), on both experts (its calls'
rows straddling the boundary) and in every resume above; the LoRA FSDP run is also cut after iteration 2 and resumed
under FSDP. The mixed runs stay data-free.

The same metrics and networks to float32 rounding (tolerances at each assert); the resumed run equals the
uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dist_helpers import finetune_module, torchrun_cli_many

pytestmark = pytest.mark.slow  # two processes that import diffusers, 15 runs in them; three one-process references

PROMPTS = ["a red ball rolls", "a blue cube spins", "a cat walks"]
LR = 1e-3
MAX_GRAD_NORM = 1e-3  # below every gradient norm of these runs (the LoRA student's first: 1.5e-3): all are clipped
MIXED = ("--lora_rank", "0", "--critic_lora_rank", "4")  # a full-copy student (FSDP-sharded) and a LoRA critic
# the two-process runs (each against its one-process reference) and the cut and resumed one
ULYSSES = ("--sequence_parallel_size", "2", "--sequence_parallel_type", "ulysses")
RUNS = {"ddp": ("lora", ()), "fsdp": ("lora", ("--plugin", "fsdp")), "fsdp_mixed": ("mixed", ("--plugin", "fsdp")),
        "ulysses": ("lora", ULYSSES), "ulysses_fsdp_mixed": ("mixed", (*ULYSSES, "--plugin", "fsdp")),
        "experts_ddp": ("experts", ()), "experts_fsdp": ("experts", ("--plugin", "fsdp")),
        "experts_ulysses": ("experts", ULYSSES)}
WEIGHT = "0.5"  # --gen_cls_loss_weight: large, so that the GAN term moves the student's gradients measurably
BOUNDARY = 875.0  # make_wan22's boundary_ratio 0.875 x 1000


def distill_argv(folder, prompts, out, *extra: str) -> list[str]:
    return ["distill", "--teacher", str(folder), "--prompt_file", str(prompts), "--student_steps", "2",
            "--lora_rank", "4", "--height", "16", "--width", "16", "--num_frames", "5", "--batch_size", "2",
            "--critic_steps", "2", "--max_steps", "3", "--lr", str(LR), "--log_every", "1", "--ckpt_every", "3",
            "--max_grad_norm", str(MAX_GRAD_NORM), "--device", "cpu", "--outputs", str(out), *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread_module):
    """{name: run folder}: the one-process references (``lora``: LoRA student and critic; ``mixed``; ``experts``:
    the two-expert teacher's, checkpointed at 2 and 3; ``lora`` and ``experts`` with ``--data`` and the GAN head;
    each run's transformer calls' timesteps recorded in ``calls[name]``, its ``features`` calls' in ``gan[name]``),
    then in one launch of 2 processes the ``RUNS``, ``resumed`` (the mixed FSDP run to 2 iterations, then on to 3),
    ``lora_resumed`` (the LoRA FSDP run's, likewise),
    ``refused``, the output of a refused run (float8 storage of the sharded teacher), ``experts_up`` (``experts``
    cut at 2, resumed under FSDP) and ``experts_cut`` (the two-expert FSDP run to 2), which one process then resumes
    to 3 (``experts_down``, the networks and optimizers right after its resume in ``loaded``), as it resumes the
    DDP run's checkpoint at 2 (``experts_ddp_down``)."""
    import shutil

    from ditforge import cli
    from ditforge.models.adapters import DiffusersDenoiser
    from ditforge.train.distill_nets import Networks

    root = tmp_path_factory.mktemp("dist_distill")
    pipes = finetune_module("tiny_pipelines")
    teachers = {"lora": pipes.make_wan(root / "wan"), "experts": pipes.make_wan22(root / "wan22")}
    teachers["mixed"] = teachers["lora"]
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    real = ("--data", str(pipes.captioned_clips(root / "clips", 6, 32)), "--gen_cls_loss_weight", WEIGHT)
    argv = {"lora": real, "mixed": MIXED, "experts": ("--ckpt_every", "2", *real)}
    calls, gan, forward, features = {}, {}, DiffusersDenoiser.forward, DiffusersDenoiser.features
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DiffusersDenoiser, "forward", lambda self, x, t, *a, **k: (
            len(self.expert_models()) == 2 and calls[name].append(t)) or forward(self, x, t, *a, **k))
        mp.setattr(DiffusersDenoiser, "features", lambda self, x, t, **k: gan[name].append(t) or features(
            self, x, t, **k))
        for name, extra in argv.items():
            calls[name], gan[name] = [], []
            assert cli.main(distill_argv(teachers[name], prompts, root / name, *extra)) == 0
    up = root / "experts_up"
    shutil.copytree(root / "experts", up)
    shutil.rmtree(up / "checkpoints" / "step-0000003")
    resumed = ("--plugin", "fsdp", *MIXED)
    wan, wan22 = teachers["lora"], teachers["experts"]
    outs = torchrun_cli_many(2, root / "work", [
        *(distill_argv(teachers[ref], prompts, root / name, *argv[ref], *extra) for name, (ref, extra) in RUNS.items()),
        distill_argv(wan, prompts, root / "resumed", *resumed, "--max_steps", "2"),
        distill_argv(wan, prompts, root / "resumed", *resumed, "--resume", "auto"),
        distill_argv(wan, prompts, root / "refused", "--plugin", "fsdp", "--fp8_base"),
        distill_argv(wan22, prompts, up, *real, "--plugin", "fsdp", "--resume", "auto"),
        distill_argv(wan22, prompts, root / "experts_cut", *real, "--plugin", "fsdp", "--max_steps", "2"),
        distill_argv(wan, prompts, root / "lora_resumed", *real, "--plugin", "fsdp", "--max_steps", "2"),
        distill_argv(wan, prompts, root / "lora_resumed", *real, "--plugin", "fsdp", "--resume", "auto")],
        fails=(len(RUNS) + 2,))
    down, ddp_down = root / "experts_down", root / "experts_ddp_down"
    shutil.copytree(root / "experts_cut", down)
    shutil.copytree(root / "experts_ddp", ddp_down)
    shutil.rmtree(ddp_down / "checkpoints" / "step-0000003")
    assert cli.main(distill_argv(wan22, prompts, ddp_down, *real, "--resume", "auto")) == 0
    loaded, resume = {}, Networks.resume

    def spied(self, ckpt, opts):
        step = resume(self, ckpt, opts)
        loaded.update({k: v.clone() if torch.is_tensor(v) else v for k, v in flat(self.state(opts)).items()})
        return step

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Networks, "resume", spied)
        assert cli.main(distill_argv(wan22, prompts, down, *real, "--resume", "auto")) == 0
    cut = ("experts_up", "experts_cut", "experts_down", "experts_ddp_down")
    return ({name: root / name for name in (*argv, *RUNS, "resumed", "lora_resumed", *cut)}
            | {"refused": outs[len(RUNS) + 2], "calls": calls, "gan": gan, "loaded": loaded})


def flat(state: dict, prefix: str = "") -> dict:
    """A nested state dict's leaves by their dotted names (DCP's flattening)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out |= flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def saved(run, step: int = 3) -> dict[str, torch.Tensor]:
    """The tensors of the run's checkpoint at ``step``: student, critic, ``ema`` and both optimizers' states."""
    ckpt = run / "checkpoints" / f"step-{step:07d}"
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items() if hasattr(v, "size")}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)
    return state


# Float32 rounding (batch 1 against 2 in each matrix product, another token split, gathered parameters in another
# memory layout: 1e-7 in a prediction) shows most in the DMD gradient, the difference of two close predictions, and
# through it in the student's gradients: their norms and the generator's loss to 1.3e-4 (measured, the full
# student's FSDP run; DDP's 7e-5); the student's weights then differ (below) and the critic's loss and gradient norm
# of iterations 2-3 with them, to 9e-6 (measured, the full student's Ulysses run; 6e-7 with a LoRA student). The GAN
# head's losses and realisms: 1.3e-7 (measured, the LoRA runs); a head's mean over one process's tokens alone, or
# the generator's GAN gradient in its sample kept per process (Ulysses), moves them or the gradient norms by 1e-6
# to 1 (measured: the student's gradient norm by 110% without ``mean_gradient``)
REL = {"generator_loss": 4e-4, "dmd_grad_norm": 2e-4, "critic_loss": 3e-5, "generator_grad_norm": 2e-4,
       "critic_grad_norm": 3e-5, "gen_cls_loss": 1e-5, "guidance_cls_loss": 1e-5, "pred_realism_on_real": 1e-5,
       "pred_realism_on_fake": 1e-5, "step": 0}


@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_equal_one(runs, name):
    """3 iterations (generator steps at 1 and 3), every gradient clipped: the losses and the gradient norms before
    clipping to ``REL``; the student's and critic's weights to 1e-6 but for at most 5% of them (measured: 1.1% of a
    LoRA student's and critic's, 3.1% of a full student's and its critic's), those to a quarter of the learning
    rate (AdamW at beta1 0 steps lr g / sqrt(v), about lr sign(g) in a first step, whose size the rounding decides
    where g is near 0; measured 0.07 lr, in the full student). Every draw made otherwise (another row, another token
    split) would move the critic's loss by far more, and a norm of one shard the gradient norms by about 2^-1/2."""
    ref = RUNS[name][0]
    got, want = metrics(runs[name]), metrics(runs[ref])
    assert [r["step"] for r in got] == [1, 2, 3] and "generator_grad_norm" in got[2]
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for k in a.keys() - {"steps_per_sec"}:
            assert a[k] == pytest.approx(b[k], rel=REL[k]), (a["step"], k)
    got, want = saved(runs[name]), saved(runs[ref])
    nets = [k for k in want if k.startswith(("student.", "critic.", "ema."))]
    assert got.keys() == want.keys() and len(nets) > 2 * 32
    off = 0
    for k in nets:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=0.25 * LR)
        off += int(((got[k] - want[k]).abs() > 1e-6).sum())
    assert off <= 0.05 * sum(want[k].numel() for k in nets)


@pytest.mark.parametrize("name, ref", [("resumed", "fsdp_mixed"), ("lora_resumed", "fsdp")])
def test_fsdp_resume_equals_the_uninterrupted_run(runs, name, ref):
    """The mixed FSDP run (and the LoRA one, with the GAN head) cut after iteration 2 (its checkpoint:
    each process's shards) and resumed under FSDP: iteration 3's metrics and the student, the critic (its head) and
    both optimizers' states (AdamW's moments and step counts, the head's) at step 3 equal the uninterrupted run's
    exactly (the same processes, the same order of operations)."""
    got, want = metrics(runs[name]), metrics(runs[ref])
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [{k: v for k, v in r.items() if k != "steps_per_sec"} for r in got] == \
        [{k: v for k, v in r.items() if k != "steps_per_sec"} for r in want]
    got, want = saved(runs[name]), saved(runs[ref])
    assert got.keys() == want.keys() and any(k.startswith("critic_optimizer.") for k in want)
    assert ref != "fsdp" or any(k.startswith("critic_optimizer.state.gan_head.") for k in want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_fsdp_refuses_the_whole_teacher_placements(runs):
    """``--fp8_base`` (and ``--blocks_to_swap``, the same check) place a whole teacher on each process: refused under
    ``--plugin fsdp`` with one line on each process."""
    lines = [line for line in runs["refused"].splitlines() if "--fp8_base" in line]
    assert len(lines) == 2 and all("--plugin fsdp shards it instead" in line for line in lines), lines


def test_two_expert_batches_straddle_the_processes(runs):
    """The two-expert runs' batches put the processes' rows on different experts (row 0 on one side of t = 875, row
    1 on the other) in some call: the process without rows for an expert calls it on a stand-in row
    (``adapters.by_expert``'s ``agree``), else FSDP2's gathers would hang and DDP's all-reduce of the gradients would
    differ in size; ``test_two_processes_equal_one`` checks those runs. The GAN head's features calls straddle too."""
    for seen in (runs["calls"], runs["gan"]):
        assert any(len(t) == 2 and bool((t[0] >= BOUNDARY) != (t[1] >= BOUNDARY)) for t in seen["experts"])


def test_resume_on_another_process_count(runs):
    """A two-expert distillation checkpointed at iteration 2 under FSDP (``experts_down``) or DDP
    (``experts_ddp_down``) in 2 processes and resumed in 1, and one checkpointed in 1 process and resumed under FSDP
    in 2 (``experts_up``): DCP reshards the checkpoint, the GAN head's FSDP2 shards and their AdamW state included.
    Right after the resume in 1 process, both networks and both optimizers' states (moments, step counts) equal the
    saved ones bit for bit; the iteration after it is the global
    batch's, whose draws derive from (seed, 3) alone and are split into each process's rows (``DMD2.shard``), so the
    resumed run equals the uninterrupted run at the other process count to float32 rounding (``REL``, the networks
    as ``test_two_processes_equal_one`` compares them): exact is bit for bit only against a run of the same process
    count from the same state, as the gradients of one process's batch and of its rows reduced over processes round
    apart."""
    want = saved(runs["experts_cut"], 2)
    loaded = runs["loaded"]
    assert want.keys() <= loaded.keys() and any(k.startswith("critic_optimizer.state.gan_head.") for k in want)
    for k in want:
        assert torch.equal(loaded[k], want[k]), k
    pairs = (("experts_down", "experts_fsdp"), ("experts_ddp_down", "experts_ddp"), ("experts_up", "experts"))
    for name, ref in pairs:
        got, want = metrics(runs[name]), metrics(runs[ref])
        assert [r["step"] for r in got] == [1, 2, 3]
        for k in got[2].keys() - {"steps_per_sec"}:
            assert got[2][k] == pytest.approx(want[2][k], rel=REL[k]), (name, k)
        got, want = saved(runs[name]), saved(runs[ref])
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=0.25 * LR)
