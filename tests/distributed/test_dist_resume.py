"""Resharding: a checkpoint written by one world size and plugin resumes under another, and the run goes on
exactly as the uninterrupted single-process run (DiT-T/2 on digits, global batch 16).

Reference: ``tiny_reference`` (one process, 5 steps, checkpoints at 3 and 5). Tolerances: dist_helpers.py.
"""

from __future__ import annotations

import pytest

from dist_helpers import (TINY, assert_same_losses, assert_same_weights, read_run, run_single, torchrun,
                          torchrun_many)


@pytest.fixture(scope="module")
def fsdp4_run(tmp_path_factory):
    """Steps 1-3 under FSDP with 4 processes; its step-3 checkpoint is sharded 4 ways."""
    return torchrun(4, tmp_path_factory.mktemp("fsdp4") / "run", *TINY, "--max_steps", "3", "--ckpt_every", "1000",
                    "--plugin", "fsdp")


@pytest.mark.slow
def test_fsdp4_checkpoint_is_sharded(fsdp4_run, tiny_reference):
    ckpt = fsdp4_run / "checkpoints" / "step-0000003"
    # every rank wrote its own shard file; DCP's global metadata and the manifest are there once
    assert sorted(p.name for p in ckpt.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "meta.json"]
    sizes = [(ckpt / f"__{r}_0.distcp").stat().st_size for r in range(4)]
    assert min(sizes) > 0.15 * sum(sizes)  # sharded: no rank holds (nearly) everything
    got = read_run(fsdp4_run, "DiT-T/2")
    assert got.meta["step"] == 3 and got.meta["world_size"] == 4 and got.meta["plugin"] == "fsdp"
    ref_run, ref = tiny_reference
    assert_same_losses(got.records, ref.records[:3], steps=[1, 2, 3])
    at3 = read_run(ref_run, "DiT-T/2", step=3)
    assert_same_weights(got.model, at3.model)
    assert_same_weights(got.ema, at3.ema)


def _resume_args(plugin: str, ckpt) -> list[str]:
    return [*TINY, "--max_steps", "5", "--ckpt_every", "1000", "--plugin", plugin, "--resume", str(ckpt)]


@pytest.fixture(scope="module")
def two_process_resumes(fsdp4_run, tiny_reference, tmp_path_factory):
    """The 2-process resumes of this module, made by one launch that runs their command lines in turn
    (``torchrun_many``): "fsdp4" (zero2, from ``fsdp4_run``'s step 3) and "single" (ddp, from the single-process
    reference's step 3)."""
    root = tmp_path_factory.mktemp("resumed_x2")
    runs = torchrun_many(2, [
        (root / "fsdp4", _resume_args("zero2", fsdp4_run / "checkpoints" / "step-0000003")),
        (root / "single", _resume_args("ddp", tiny_reference[0] / "checkpoints" / "step-0000003"))])
    return dict(zip(("fsdp4", "single"), runs))


@pytest.mark.slow
@pytest.mark.parametrize("nproc,plugin", [(2, "zero2"), (1, "none")])
def test_resume_fsdp4_checkpoint_elsewhere(fsdp4_run, tiny_reference, request, tmp_path, nproc, plugin):
    args = _resume_args(plugin, fsdp4_run / "checkpoints" / "step-0000003")
    if nproc > 1:
        run = request.getfixturevalue("two_process_resumes")["fsdp4"]
    else:
        run = run_single(tmp_path / "resumed", *args)
    _, ref = tiny_reference
    got = read_run(run, "DiT-T/2")
    # the new run folder logs steps 4 and 5 only; they equal the uninterrupted run's, which needs the weights,
    # the EMA, Adam's moments and step counts, and the data position all restored across the resharding
    assert_same_losses(got.records, ref.records, steps=[4, 5])
    assert_same_weights(got.model, ref.model)
    assert_same_weights(got.ema, ref.ema)
    assert got.meta["step"] == 5 and got.meta["world_size"] == nproc and got.meta["plugin"] == plugin


@pytest.mark.slow
def test_resume_single_process_checkpoint_under_ddp(tiny_reference, two_process_resumes):
    ref_run, ref = tiny_reference
    run = two_process_resumes["single"]
    got = read_run(run, "DiT-T/2")
    assert_same_losses(got.records, ref.records, steps=[4, 5])
    assert_same_weights(got.model, ref.model)
    assert_same_weights(got.ema, ref.ema)
    assert got.meta["world_size"] == 2 and got.meta["plugin"] == "ddp"
