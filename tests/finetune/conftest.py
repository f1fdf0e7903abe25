"""Session fixtures of the fine-tuning tests: tiny random diffusers pipeline folders (``tiny_pipelines``), each built
once (well under a second after the imports) and shared read-only; tests that change a folder copy it first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_pipelines import BUILDERS  # tests/finetune is on sys.path (rootdir-relative "prepend" import mode)


def _build(tmp_path_factory, family: str) -> Path:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return BUILDERS[family](tmp_path_factory.mktemp(f"{family}_pipeline") / "pipe")
    finally:
        torch.set_num_threads(before)


def _fixture(family: str):
    """A session fixture ``<family>_pipeline``: the folder ``BUILDERS[family]`` writes (sd: SD-1.5-like, PNDM,
    epsilon; sd_v: SD-2.1-like, DDIM, v_prediction; pixart / pixart_sigma; sd3; sdxl; dit: 3 named classes, null label
    1000)."""

    @pytest.fixture(scope="session", name=f"{family}_pipeline")
    def pipeline(tmp_path_factory) -> Path:
        return _build(tmp_path_factory, family)

    return pipeline


for _family in BUILDERS:
    globals()[f"{_family}_pipeline"] = _fixture(_family)


@pytest.fixture(scope="session")
def video_runs(request, tmp_path_factory):
    """``video_runs(family)`` -> {"full": run, "lora": run}: 4 steps of full (lr 1e-3) and of LoRA (rank 4, lr 1e-2)
    fine-tuning of the family's tiny pipeline (``<family>_pipeline``) on the clips (``families.VIDEO``'s geometry),
    checkpoints every 2 steps; made once a session (under pytest-xdist: once a worker) and shared read-only by the
    shared suite and the family's own tests."""
    from ditforge import cli
    from families import KINDS, VIDEO

    made: dict[str, dict[str, Path]] = {}

    def runs(family: str) -> dict[str, Path]:
        if family not in made:
            folder = request.getfixturevalue(f"{family}_pipeline")
            root = tmp_path_factory.mktemp(f"{family}_runs")
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                for kind, extra in KINDS.items():
                    argv = VIDEO[family].argv(folder, root / kind, "--max_steps", "4", "--ckpt_every", "2", *extra)
                    assert cli.main(argv) == 0
            finally:
                torch.set_num_threads(before)
            made[family] = {kind: root / kind for kind in KINDS}
        return made[family]

    return runs


@pytest.fixture(scope="session")
def i2v_runs(request, tmp_path_factory):
    """``i2v_runs(name)`` -> the run of the image-to-video row ``families.I2V[name]``: its ``steps`` steps of
    ``KINDS[kind]`` on the clips (their first frames the images), from its tiny pipeline (``<name>_pipeline``); made
    once a session (under pytest-xdist: once a worker), inside a test holding ``one_thread``, and shared read-only by
    the shared suite and the family's own tests."""
    from ditforge import cli
    from families import I2V, KINDS

    made: dict[str, Path] = {}

    def run(name: str) -> Path:
        if name not in made:
            spec, out = I2V[name], tmp_path_factory.mktemp(f"{name}_run") / "run"
            folder = request.getfixturevalue(f"{name}_pipeline")
            assert cli.main(spec.argv(folder, out, "--max_steps", str(spec.steps), *KINDS[spec.kind])) == 0
            made[name] = out
        return made[name]

    return run
