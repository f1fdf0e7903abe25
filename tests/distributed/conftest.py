"""Session fixtures of the multi-process tests (helpers are in dist_helpers.py)."""

from __future__ import annotations

import pytest

from dist_helpers import TINY, finetune_module, read_run, run_single


# Single-process DiT-T/2 reference of 5 steps, checkpoints at steps 3 and 5 (the resharding tests resume from
# step 3 of it). Shared by the gradient-accumulation and resharding tests.
@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory):
    run = run_single(tmp_path_factory.mktemp("ref_tiny") / "run", *TINY, "--max_steps", "5",
                     "--ckpt_every", "3", "--keep_last", "5")
    return run, read_run(run, "DiT-T/2")


@pytest.fixture(scope="session")
def video_folders(tmp_path_factory) -> dict:
    """{family: its tiny pipeline folder} for every text-to-video row of the fine-tuning suite
    (``tests/finetune/families.VIDEO``, built by ``tiny_pipelines.BUILDERS``): the families whose tokens the
    multi-process tests split. Shared read-only."""
    builders, rows = finetune_module("tiny_pipelines").BUILDERS, finetune_module("families").VIDEO
    root = tmp_path_factory.mktemp("video_folders")
    return {family: builders[family](root / family) for family in rows}
