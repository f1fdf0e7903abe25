"""Sequence parallelism on whole models (gloo, CPU): a small text-conditioned vDiT whose token count does not
divide by the number of processes, split by ``parallelize`` (hooks + the self-attention seam), against the
same model run whole in one process; and ``ditforge train`` with dp=2 x sp=2 against one process.

Tolerances (float32): outputs and parameter gradients within 1e-5 relative to their largest entry (the split
only reorders sums: attention over blocks of keys, gradients summed over the group).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_helpers import COMMON, free_port, read_run, run_single, spawn, torchrun_cli_many

from ditforge.models import STDiT, VideoDiT, create_model
from ditforge.parallel import parallelize
from ditforge.parallel.mesh import Dist

# A vDiT with (1, 2, 2) patches and 6 heads (as vDiT-S; Ulysses needs the heads to divide among the processes: 2
# does, 4 does not), 2 blocks of width 96, on 3 frames of 6x6 latents: 3 x 3 x 3 = 27 tokens = 2 * 14 - 1 =
# 4 * 7 - 1, so the last process holds one padding token.
FRAMES, SIZE = 3, 6


# An STDiT with 2 x 2 patches, 6 heads, 2 blocks of width 96 on 4 frames of 4x4 latents: 4 frames x 4 tokens, split
# by whole frames and by token columns.
STDIT_FRAMES, STDIT_SIZE = 4, 4


def _model(kind: str = "vdit") -> torch.nn.Module:
    torch.manual_seed(0)
    small = dict(depth=2, hidden_size=96, num_heads=6, in_channels=4, num_classes=10, text_dim=16)
    if kind == "stdit":
        model = STDiT(input_size=STDIT_SIZE, num_frames=STDIT_FRAMES, patch_size=2, **small)
    elif kind == "vdit4":  # 4 heads, which Ulysses and OpenDiT's FastSeq can split over 4 processes
        model = VideoDiT(input_size=SIZE, num_frames=FRAMES, patch_size=(1, 2, 2), depth=2, hidden_size=64,
                         num_heads=4, in_channels=4, num_classes=10, text_dim=16)
    else:
        model = VideoDiT(input_size=SIZE, num_frames=FRAMES, patch_size=(1, 2, 2), **small)
    with torch.no_grad():  # every parameter random, so adaLN-Zero's zeros cannot hide a wrong path
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 / max(1, p.shape[-1]) ** 0.5 if p.dim() > 1 else 0.1))
    return model


def _inputs(kind: str = "vdit"):
    frames, size = (STDIT_FRAMES, STDIT_SIZE) if kind == "stdit" else (FRAMES, SIZE)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, frames, size, size, generator=g)
    t = torch.randint(0, 1000, (2,), generator=g)
    y = torch.randn(2, 5, 16, generator=g)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    up = torch.randn(2, 8, frames, size, size, generator=g)
    return x, t, y, mask, up


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _split_run(d: Dist, world: int, kind: str, variant: str) -> dict:
    """One case on this process: the model split by ``variant``, its forward and backward; rank 0's output, the
    averaged gradients and the token counts the blocks saw (every rank: the measured figures of ``auto``)."""
    model = _model(kind)
    out = {}
    if variant == "auto" and kind == "vdit":  # the measurement behind auto, which must not move the RNG
        from ditforge.parallel.sequence.shard import measure_sequence_parallel_types, usp_attention_group

        rng = torch.get_rng_state()
        usp = usp_attention_group(d, model.num_heads) if world == 4 else None  # 6 heads: U 2 x R 2
        ms = measure_sequence_parallel_types(model.train(), d, batch_size=2, usp_group=usp)
        assert torch.equal(torch.get_rng_state(), rng)
        figures = [None] * world
        dist.all_gather_object(figures, ms)
        out.update(measured=figures)
    model = parallelize(model, d, "none", sequence_parallel_type=variant)
    seen = []  # the split is really on: later blocks see this process's slice of the tokens
    model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    x, t, y, mask, up = _inputs(kind)
    y_out = model(x, t, y, y_mask=mask)
    (y_out * up).sum().backward()
    grads = _grads(model)
    for g in grads.values():  # what the data-parallel average over dp x sp does, for dp = 1
        dist.all_reduce(g)
        g /= world
    out.update(output=y_out.detach(), grads=grads, local_tokens=seen)
    return out


def _worker(rank: int, world: int, port: int, cases: list[tuple[str, str]], out: dict) -> None:
    """Every case of ``world`` processes in one process group, one after the other: starting the processes
    (each imports torch and ditforge) costs far more than a case does."""
    from ditforge.ops.attention import set_frame_exchange, set_sequence_attention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        sp_mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "sp"))
        d = Dist(rank=rank, world_size=world, sp_mesh=sp_mesh)
        for kind, variant in cases:
            try:
                result = _split_run(d, world, kind, variant)
            finally:  # the next case starts from the unsplit attention, as a fresh process would
                set_sequence_attention(None)
                set_frame_exchange(None)
            if rank == 0:
                out[kind, variant] = result
    finally:
        dist.destroy_process_group()


@functools.cache  # one per model kind, shared by its cases (read only)
def _reference(kind: str):
    model = _model(kind)
    x, t, y, mask, up = _inputs(kind)
    y_out = model(x, t, y, y_mask=mask)
    (y_out * up).sum().backward()
    return y_out.detach(), _grads(model)


SPLIT_CASES = [("vdit", "ulysses", 2), ("vdit", "ring", 2), ("vdit", "fastseq", 2), ("vdit", "ring", 4),
               ("vdit", "fastseq", 4), ("vdit", "usp", 4), ("vdit4", "ulysses", 4), ("vdit4", "fastseq", 4),
               ("vdit", "auto", 2), ("vdit", "auto", 4), ("stdit", "auto", 2), ("stdit", "auto", 4)]


@pytest.fixture(scope="module")
def split_runs():
    """``split_runs(world)``: the results of every case of ``SPLIT_CASES`` at ``world`` processes, keyed by
    (kind, variant), from one spawn of ``world`` processes (made on first use)."""
    results = {}

    def get(world: int) -> dict:
        if world not in results:
            cases = [(kind, variant) for kind, variant, w in SPLIT_CASES if w == world]
            # the manager's server spawned, not forked: a fork of this multi-threaded pytest process can inherit
            # a held lock, and once hung CI on a futex while serving the workers' tensors (2026-11-27)
            with mp.get_context("spawn").Manager() as manager:
                out = manager.dict()
                spawn(_worker, args=(world, free_port(), cases, out), nprocs=world)
                results[world] = dict(out)
        return results[world]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("kind,variant,world", SPLIT_CASES)
def test_split_model_equals_whole(split_runs, kind, variant, world):
    """vDiT: 27 tokens, the last process padded (vdit4: a 4-head vDiT, for the head-splitting variants at 4
    processes). STDiT: whole frames per process, columns for the temporal
    attention (its temporal projections are random here, so the exchange is exercised). vDiT with ``auto``:
    every process measured the same figures for the variants its 6 heads allow, and runs the fastest."""
    out = split_runs(world)[kind, variant]
    output, grads = out["output"], dict(out["grads"])
    tokens = STDIT_FRAMES * (STDIT_SIZE // 2) ** 2 if kind == "stdit" else FRAMES * (SIZE // 2) ** 2
    assert out["local_tokens"] == [-(-tokens // world)]  # the blocks see this process's slice
    if "measured" in out:
        figures = out["measured"]
        assert all(f == figures[0] for f in figures), figures
        allowed = ["ulysses", "fastseq", "fastseq_kv", "ring"] if world == 2 else ["fastseq_kv", "ring", "usp"]
        assert list(figures[0]) == allowed and all(0 < v < 1e4 for v in figures[0].values()), figures
    ref_out, ref_grads = _reference(kind)
    torch.testing.assert_close(output, ref_out, rtol=0, atol=1e-5 * ref_out.abs().max().item())
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-5 * max(g.abs().max().item(), 1e-12),
                                   msg=lambda m: f"{name}: {m}")


def test_named_sequence_parallel_types():
    """Names other than ``auto`` are not measured: OpenDiT's FastSeq splits the heads and becomes the K/V form
    when they do not divide (6 heads); an STDiT is split by frames whatever the name."""
    from types import SimpleNamespace

    from ditforge.parallel.sequence.shard import choose_sequence_parallel_type as choose

    vdit, stdit = _model(), _model("stdit")
    two, four = SimpleNamespace(sp_size=2), SimpleNamespace(sp_size=4)
    assert choose("fastseq", vdit, two)[:2] == ("fastseq", {})
    assert choose("fastseq", vdit, four)[:2] == ("fastseq_kv", {})
    for name in ("ring", "usp", "ulysses", "fastseq_kv"):
        assert choose(name, vdit, four) == (name, {}, None)
    assert choose("auto", stdit, two) == choose("ring", stdit, four) == ("frames", {}, None)


@pytest.mark.slow
def test_train_dp2_sp2_equals_one_process(tmp_path):
    """5 steps of `ditforge train` on 4 processes as 2 data-parallel x 2 sequence-parallel (fastseq, whose
    head-sliced projection reads the parameters FSDP gathers; DiT-S/2's 6 heads, cut to 2 blocks, on
    the 8x8 digits: 16 tokens, 8 per process) give the loss curve of one process, and the same weights."""
    args = ["--model", "DiT-S/2", "--depth", "2", "--batch_size", "8", "--max_steps", "5"]
    single = read_run(run_single(tmp_path / "single", *args), "DiT-S/2", depth=2)
    sp = ["--sequence_parallel_size", "2", "--sequence_parallel_type", "fastseq", "--plugin", "fsdp"]
    err = torchrun_cli_many(4, tmp_path, [["train", *COMMON, "--outputs", str(tmp_path / "split"), *args, *sp]])
    assert "sequence parallelism: fastseq over 2 processes (x 2 data-parallel)" in err[0]
    split = read_run(tmp_path / "split", "DiT-S/2", depth=2)
    for step, loss in single.losses().items():
        assert split.losses()[step] == pytest.approx(loss, rel=1e-5)
    for name, w in single.model.items():
        torch.testing.assert_close(split.model[name], w, rtol=0, atol=1e-5)


def _sample_one(tmp_path, model_spec: dict, data: dict, seed: int, args: list[str], out_suffix: str = ""):
    """Export a checkpoint of ``model_spec``'s model with random weights (every trainable parameter N(0, 0.05^2),
    seeded) into ``tmp_path`` and run `ditforge sample` with ``args`` in this process. Returns (its samples (uint8),
    the `ditforge sample` command line for 2 processes, which write ``tmp_path / "two.npz"``)."""
    import numpy as np

    from ditforge import cli
    from ditforge.export import export_safetensors

    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = dict(condition="class", text_encoder=None, text_max_length=None, vae="none", qk_norm=False,
                num_classes=10, learn_sigma=True, class_dropout_prob=0.1, in_channels=3, text_dim=None, **model_spec)
    model = create_model(spec["model"], spec["input_size"], 3, 10, num_frames=spec["num_frames"])
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ckpt = tmp_path / "m.safetensors"
    export_safetensors(model.state_dict(), {"model": spec, "data": data}, ckpt)
    common = ["sample", "--ckpt", str(ckpt), "--num_sampling_steps", "4", "--device", "cpu", *args]
    one_out, two_out = tmp_path / f"one{out_suffix}", tmp_path / f"two{out_suffix}"
    assert cli.main([*common, "--out", str(one_out), "--save_npz", str(tmp_path / "one.npz")]) == 0
    return np.load(tmp_path / "one.npz")["samples"], [*common, "--out", str(two_out), "--save_npz",
                                                      str(tmp_path / "two.npz")]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """The sampling cases of this module: each one-process sample, and the 2-process runs, all from one
    launch that runs their command lines in turn (``torchrun_cli_many``): "sp2" (--sequence_parallel_size 2),
    "cfg" (--cfg_parallel), "compiled" (--cfg_parallel --compile default) and "refused" (the cfg case's
    command without --cfg_parallel, which must exit non-zero). Values: (one-process samples or None, 2-process
    samples or None, stderr of the 2-process run)."""
    import numpy as np

    root = tmp_path_factory.mktemp("sample")
    # vDiT-T/122 in pixel space (3 channels), 27 tokens: odd, so the second process holds a padding token
    sp_one, sp_two = _sample_one(root / "sp2", dict(model="vDiT-T/122", input_size=SIZE, num_frames=FRAMES),
                                 dict(image_size=SIZE, num_frames=FRAMES, frame_interval=1), 3,
                                 ["--class_labels", "1,2", "--seed", "5"])
    cfg_one, cfg_two = _sample_one(root / "cfg", dict(model="DiT-T/2", input_size=8, num_frames=None),
                                   dict(image_size=8), 4,
                                   ["--class_labels", "1,2,3", "--seed", "6", "--cfg_scale", "4"], out_suffix=".png")
    compiled = root / "cfg" / "compiled.npz"
    argvs = [[*sp_two, "--sequence_parallel_size", "2", "--sequence_parallel_type", "ring"],
             [*cfg_two, "--cfg_parallel"],
             [*cfg_two[:-2], "--save_npz", str(compiled), "--cfg_parallel", "--compile", "default"],
             cfg_two]  # without --cfg_parallel, 2 processes would each need half a sequence-parallel sample
    err = torchrun_cli_many(2, root, argvs, fails=(3,))
    return {"sp2": (sp_one, np.load(root / "sp2" / "two.npz")["samples"], err[0]),
            "cfg": (cfg_one, np.load(root / "cfg" / "two.npz")["samples"], err[1]),
            "compiled": (cfg_one, np.load(compiled)["samples"], err[2]),
            "refused": (None, None, err[3])}


def test_sample_sp2_equals_sp1(sampled):
    """`ditforge sample` under torchrun with --sequence_parallel_size 2 writes the video one process writes for
    the same seed (uint8 after decoding: equal up to a rounding flip of 1 on a few values)."""
    import numpy as np

    one, two, stderr = sampled["sp2"]
    assert "sequence parallelism: ring over 2 processes" in stderr
    assert one.shape == two.shape == (2, FRAMES, SIZE, SIZE, 3)
    diff = np.abs(one.astype(int) - two.astype(int))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99


@pytest.mark.slow
def test_sample_cfg_parallel_equals_one_process(sampled):
    """`ditforge sample --cfg_parallel` under torchrun (2 processes: conditional and unconditional halves apart),
    eager and with --compile (the model compiled on each process, the halves gathered outside it), writes the
    one-process samples (uint8, a rounding flip of 1 allowed on a few values)."""
    import numpy as np

    one, two, _ = sampled["cfg"]
    assert one.shape == two.shape == (3, 8, 8, 3) and one.std() > 5  # non-constant images
    diff = np.abs(one.astype(int) - two.astype(int))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99
    one, compiled, _ = sampled["compiled"]
    diff = np.abs(one.astype(int) - compiled.astype(int))
    assert diff.max() <= 1 and (diff == 0).mean() > 0.99
    # without --cfg_parallel, 2 processes would each need half a sequence-parallel sample: refused (non-zero exit,
    # torchrun_cli_many's check)
    assert "--sequence_parallel_size 1" in sampled["refused"][2]
