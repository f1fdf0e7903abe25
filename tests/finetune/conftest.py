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
