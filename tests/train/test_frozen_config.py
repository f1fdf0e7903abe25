"""The run's settings are resolved once (``train.resolve.resolve``) and then frozen: a write raises."""

from __future__ import annotations

import dataclasses

import pytest

from ditforge.config.load import build_config
from ditforge.config.sections import freeze
from ditforge.train import trainer


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


def test_the_run_freezes_its_resolved_config_before_the_optimizer(tmp_path, monkeypatch):
    """By the time the optimizer is built the run's config holds what the resolution decided (the tiny model's
    learning rate, the digits' 10 classes and their flips (off), the DDPM objective) and a write to it raises."""
    seen = {}

    def check(run):
        cfg = seen["cfg"] = run.cfg
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.train.lr = 0.5
        raise _Built

    monkeypatch.setattr(trainer, "build_ema_and_optimizer", check)
    cfg = build_config(None, dict(model="DiT-T/2", batch_size=8, num_workers=0, sample_every=0, max_steps=1,
                                  mixed_precision="fp32", device="cpu", outputs=str(tmp_path / "run")))
    with pytest.raises(_Built):
        trainer.train(cfg)
    resolved = seen["cfg"]
    assert (resolved.train.lr, resolved.model.num_classes, resolved.data.random_flip, resolved.model.objective) == (
        1e-3, 10, False, "ddpm")
