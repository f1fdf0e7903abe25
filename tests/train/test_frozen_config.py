"""The run's settings are written once, by their resolution (``train.resolve.resolve``), and then frozen: a write
raises, from the model's build on; the phases before the resolution write nothing."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest

from ditforge.config.load import build_config
from ditforge.config.sections import freeze
from ditforge.parallel.mesh import init_distributed
from ditforge.train import build, trainer
from ditforge.train.resolve import resolve


def test_a_frozen_config_refuses_writes_and_saves_as_before():
    """Every section and the config itself refuse a write once frozen; the saved form (``to_dict``, which
    config.yaml and the checkpoints hold) is the same as before freezing, and a copy made by ``replace`` is
    writable again (not frozen)."""
    cfg = build_config(None, {"model": "DiT-T/2"})
    before = cfg.to_dict()
    freeze(cfg)
    for section, name, value in ((cfg.train, "lr", 1.0), (cfg.model, "num_classes", 3), (cfg.data, "random_flip", True),
                                 (cfg.parallel, "plugin", "ddp"), (cfg, "train", cfg.train)):
        with pytest.raises(dataclasses.FrozenInstanceError, match="frozen once resolved"):
            setattr(section, name, value)
    assert cfg.to_dict() == before and "_frozen" not in str(before)
    copy = dataclasses.replace(cfg.train, lr=2.0)
    copy.lr = 3.0
    assert copy.lr == 3.0 and cfg.train.lr is None


class _Built(Exception):
    pass


TINY = dict(batch_size=8, num_workers=0, sample_every=0, max_steps=1, mixed_precision="fp32", device="cpu")


def test_the_run_freezes_its_resolved_config_before_the_model(tmp_path, monkeypatch):
    """By the time the model is built the run's config holds what the resolution decided (the tiny model's
    learning rate, the digits' 10 classes and their flips (off), the DDPM objective) and a write to it raises:
    ``build_model``, and every phase after it, gets a frozen config."""
    seen = {}

    def check(run):
        cfg = seen["cfg"] = run.cfg
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.train.lr = 0.5
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.model.fp8_base = True
        raise _Built

    monkeypatch.setattr(trainer, "build_model", check)
    cfg = build_config(None, dict(model="DiT-T/2", outputs=str(tmp_path / "run"), **TINY))
    with pytest.raises(_Built):
        trainer.train(cfg)
    resolved = seen["cfg"]
    assert (resolved.train.lr, resolved.model.num_classes, resolved.data.random_flip, resolved.model.objective) == (
        1e-3, 10, False, "ddpm")


def test_the_phases_before_the_resolution_only_report_what_they_found(tmp_path):
    """``open_run``, ``load_init`` and ``build_data`` run on a frozen config (any write would raise) and report
    the run folder, the plugin, the default model and the digits' shapes (pixel space: 1 x 8 x 8, class labels)
    in ``Run.found``; the resolution writes them into the config (``assign``), as a run without ``--model``
    records them."""
    flags = dict(outputs=str(tmp_path / "run"), **TINY)
    d = init_distributed("cpu")
    with contextlib.ExitStack() as held:
        run = build.open_run(freeze(build_config(None, flags)), d, held)
        build.load_init(run)
        build.build_data(run)
    assert run.found == {"train.outputs": str(tmp_path / "run"), "parallel.plugin": "none", "model.model": "DiT-T/2",
                         "model.condition": "class", "model.text_max_length": None, "model.text_dim": None,
                         "data.image_size": 8, "data.num_frames": None, "model.in_channels": 1, "model.input_size": 8,
                         "model.num_frames": None, "data.frame_interval": 3}
    run.cfg = build_config(None, flags)  # writable: resolve writes the found settings first
    resolved = resolve(run).to_dict()
    assert {key: resolved[key.split(".")[0]][key.split(".")[1]] for key in run.found} == run.found


def test_a_dit_loras_budget_is_counted_on_its_meta_twin_as_built(tmp_path, counted_budget, tiny_argv):
    """A DiT LoRA's ``--gpu_memory_budget`` choices are made on the DiT built on the meta device
    (``model_on_meta``): its trainable count and frozen bytes equal the built model's (rank 4 on official-layout
    weights' qkv and proj, the patch embedder's conv ``proj`` included, the label table trained whole), and the
    trainable count is peft's r * (in + out) per adapted layer (a conv's in x kernel) plus the table."""
    import torch
    from peft.tuners.lora import LoraLayer

    from ditforge.models import create_model

    torch.save(create_model("DiT-T/2", 8, 1, 10).state_dict(), tmp_path / "dit.pt")
    counted, model = counted_budget(tiny_argv(tmp_path / "run", "--gpu_memory_budget", "1GiB", "--init_from",
                                              str(tmp_path / "dit.pt"), "--lora_rank", "4"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    assert counted == [(trainable, frozen)]
    base = [m.base_layer for m in model.modules() if isinstance(m, LoraLayer)]
    sizes = [(b.in_features, b.out_features) if isinstance(b, torch.nn.Linear)
             else (b.in_channels * math.prod(b.kernel_size), b.out_channels) for b in base]
    assert sum(isinstance(b, torch.nn.Linear) for b in base) == 2 * len(model.blocks)  # qkv, proj
    assert trainable == sum(4 * (i + o) for i, o in sizes) + model.y_embedder.embedding_table.weight.numel()
