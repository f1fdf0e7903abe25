"""A background (``--async_checkpoint``) save is published between steps as soon as its writes have ended, not by
the next save: a kill after that moment loses at most ``--ckpt_every`` steps (tests/train/test_chaos.py kills at
random moments; this pins the moment down).

The steps are made to last until the write has ended (each step waits for the background future), which is the
case the trainer must handle: a save written while training goes on. Before the change the checkpoint of step 2
appeared only inside the save of step 4."""

from __future__ import annotations

from ditforge.train import checkpoint, trainer
from ditforge.weights.read import list_checkpoints


def test_background_save_is_published_before_the_next_save(train_run, tmp_path, monkeypatch):
    seen = {}  # step being saved -> checkpoints published when its save began
    saving = []

    real_save = checkpoint.Checkpointer.save

    def save(self, step, state, meta):
        seen[step] = [p.name for p in list_checkpoints(self.root.parent)]
        saving.append(self)
        return real_save(self, step, state, meta)

    real_step = trainer.train_step

    def slow_step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        if saving and saving[-1].pending is not None:
            saving[-1].pending[0].result(timeout=60)  # this step outlasts the write in flight
        return out

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
    monkeypatch.setattr(trainer, "train_step", slow_step)
    run = train_run(tmp_path / "run", "--max_steps", "4", "--ckpt_every", "2", "--keep_last", "5",
                    "--async_checkpoint")
    assert seen[2] == []
    assert seen[4] == ["step-0000002"]  # published by the loop between steps 2 and 4, not by this save's wait
    assert [p.name for p in list_checkpoints(run)] == ["step-0000002", "step-0000004"]
