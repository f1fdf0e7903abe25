"""``--cpu_offload all`` (FSDP2's CPUOffloadPolicy, torch's fused AdamW stepping host shards) equals the plain
single-process run, in one process and over 2 gloo processes; with ``--delayed_update`` 2 processes equal 1, and a
run resumed from a checkpoint equals the uninterrupted one (issue 22's "done when").

On the CPU the host shards are where the weights would be anyway: what is tested is the path (FSDP2 with the offload
policy in a process group of one or two, the CPU step over DTensor shards, the delayed step's state in DCP
checkpoints). Tolerances are dist_helpers.py's: fp32, runs that differ in the order of reductions and in torch's
fused CPU AdamW against the reference's foreach AdamW (an ulp per step).
"""

from __future__ import annotations

import pytest

from dist_helpers import (
    TINY,
    assert_same_losses,
    assert_same_weights,
    read_run,
    run_single,
    torchrun_many,
)

OFFLOAD = ["--cpu_offload", "all"]
DELAYED = [*OFFLOAD, "--delayed_update"]
STEPS = ["--max_steps", "5", "--ckpt_every", "1000"]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """The 2-process runs of this module, "offload" (``OFFLOAD``) and "delayed" (``DELAYED``), 5 steps each, made
    by one launch that runs their command lines in turn (``torchrun_many``)."""
    root = tmp_path_factory.mktemp("x2")
    runs = torchrun_many(2, [(root / "offload", [*TINY, *STEPS, *OFFLOAD]),
                             (root / "delayed", [*TINY, *STEPS, *DELAYED])])
    return dict(zip(("offload", "delayed"), runs))


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_offload_all_equals_plain_single_process(tiny_reference, request, tmp_path, nproc):
    _, ref = tiny_reference
    args = [*TINY, *STEPS, *OFFLOAD]
    run = run_single(tmp_path / "run", *args) if nproc == 1 else request.getfixturevalue("two_process_runs")["offload"]
    got = read_run(run, "DiT-T/2")
    assert got.meta["plugin"] == "fsdp" and got.meta["world_size"] == nproc
    assert_same_losses(got.records, ref.records, steps=[1, 2, 3, 4, 5])
    worst = assert_same_weights(got.model, ref.model), assert_same_weights(got.ema, ref.ema)
    print(f"--cpu_offload all x{nproc}: max abs diff model {worst[0]:.2g}, EMA {worst[1]:.2g}")


@pytest.fixture(scope="module")
def delayed_reference(tmp_path_factory):
    """One process, --delayed_update, 5 steps, checkpoints at 2 and 5."""
    run = run_single(tmp_path_factory.mktemp("delayed") / "run", *TINY, *DELAYED, "--max_steps", "5",
                     "--ckpt_every", "2", "--keep_last", "5")
    return run, read_run(run, "DiT-T/2")


@pytest.mark.slow
def test_delayed_update_two_processes_equal_one(delayed_reference, tiny_reference, two_process_runs):
    _, ref = delayed_reference
    got = read_run(two_process_runs["delayed"], "DiT-T/2")
    assert_same_losses(got.records, ref.records, steps=[1, 2, 3, 4, 5])
    worst = assert_same_weights(got.model, ref.model), assert_same_weights(got.ema, ref.ema)
    print(f"--delayed_update x2: max abs diff model {worst[0]:.2g}, EMA {worst[1]:.2g}")
    # not vacuous: the lag changes the losses from step 2 on (step 1's forward is at the initial weights in both)
    plain = tiny_reference[1].losses()
    assert got.losses()[1] == pytest.approx(plain[1], rel=1e-6)
    assert all(abs(got.losses()[s] - plain[s]) > 1e-3 * plain[s] for s in (2, 3, 4, 5))


@pytest.mark.slow
def test_delayed_update_resumes_exactly(delayed_reference, tmp_path):
    run, ref = delayed_reference
    resumed = run_single(tmp_path / "run", *TINY, *DELAYED, "--max_steps", "5", "--ckpt_every", "1000",
                         "--resume", str(run / "checkpoints" / "step-0000002"))
    got = read_run(resumed, "DiT-T/2")
    assert [r["step"] for r in got.records] == [3, 4, 5]
    ref_losses = ref.losses()
    assert all(r["loss"] == ref_losses[r["step"]] for r in got.records)  # bit for bit: same process, same order
    assert_same_weights(got.model, ref.model, atol=0.0)
    assert_same_weights(got.ema, ref.ema, atol=0.0)


def test_resume_needs_the_same_delayed_update(delayed_reference, tiny_reference, tmp_path, capsys):
    """A checkpoint of the delayed update holds the masters one update ahead of its weights: a resume keeps the
    saved flag, and one that turns it off (or on, for a checkpoint without it) is refused in one line, exit 2."""
    from ditforge import cli
    from dist_helpers import COMMON

    for ckpt, flags, saved in ((delayed_reference[0] / "checkpoints" / "step-0000002", ["--no-delayed_update"],
                                "with"),
                               (tiny_reference[0] / "checkpoints" / "step-0000003", DELAYED, "without")):
        assert cli.main(["train", *COMMON, "--outputs", str(tmp_path / saved), *TINY, *OFFLOAD, *flags,
                         "--max_steps", "5", "--resume", str(ckpt)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"--resume {ckpt}: saved {saved} --delayed_update; resume it {saved} the flag"), err
        assert len(err.splitlines()) == 1
