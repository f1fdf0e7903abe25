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


@pytest.fixture(scope="session")
def sd_pipeline(tmp_path_factory) -> Path:
    """SD-1.5-like ``StableDiffusionPipeline`` folder (PNDM, epsilon): ``tiny_pipelines.make_sd``."""
    return _build(tmp_path_factory, "sd")


@pytest.fixture(scope="session")
def sd_v_pipeline(tmp_path_factory) -> Path:
    """SD-2.1-like ``StableDiffusionPipeline`` folder (DDIM, v_prediction): ``make_sd(prediction_type=...)``."""
    return _build(tmp_path_factory, "sd_v")


@pytest.fixture(scope="session")
def pixart_pipeline(tmp_path_factory) -> Path:
    """``PixArtAlphaPipeline`` folder: ``tiny_pipelines.make_pixart``."""
    return _build(tmp_path_factory, "pixart")


@pytest.fixture(scope="session")
def pixart_sigma_pipeline(tmp_path_factory) -> Path:
    """``PixArtSigmaPipeline`` folder: ``tiny_pipelines.make_pixart(sigma=True)``."""
    return _build(tmp_path_factory, "pixart_sigma")


@pytest.fixture(scope="session")
def sd3_pipeline(tmp_path_factory) -> Path:
    """``StableDiffusion3Pipeline`` folder: ``tiny_pipelines.make_sd3``."""
    return _build(tmp_path_factory, "sd3")


@pytest.fixture(scope="session")
def dit_pipeline(tmp_path_factory) -> Path:
    """``DiTPipeline`` folder (3 named classes, null label 1000): ``tiny_pipelines.make_dit``."""
    return _build(tmp_path_factory, "dit")
