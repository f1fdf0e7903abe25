"""Shard data across a world-size change: 2 gloo processes train 3 steps on latent shards and save; one process
resumes from that checkpoint for 20 more steps. Every step's global batch holds the sample ids, in order, of the
uninterrupted single-process loader (the reference, ``build_shard_loader`` at world size 1)."""

from __future__ import annotations

import json

import pytest
from dist_helpers import TINY, run_single, torchrun

from ditforge.data.shards.loader import ShardData, build_shard_loader


@pytest.mark.slow
def test_shards_resume_from_two_processes_in_one(tmp_path, monkeypatch, latent_shards):
    latent_shards(tmp_path / "d", [45, 52, 38, 61, 40, 47])
    keys = tmp_path / "keys.jsonl"
    monkeypatch.setenv("DITFORGE_SHARD_KEYS", str(keys))
    flags = [*TINY, "--data", str(tmp_path / "d"), "--data_streams", "4", "--shuffle_shards", "2",
             "--plugin", "ddp"]
    run = torchrun(2, tmp_path / "run", *flags, "--max_steps", "3", "--ckpt_every", "1000")
    meta = json.loads((run / "checkpoints" / "step-0000003" / "meta.json").read_text())
    assert meta["world_size"] == 2 and sorted(meta["loader"]["states"]) == ["0", "1", "2", "3"]
    first = keys.read_text().splitlines()
    keys.unlink()
    run_single(run, *flags, "--resume", "auto", "--max_steps", "23", "--plugin", "none")
    got: dict[int, dict[int, list]] = {}
    # each run's prefetcher reads one batch past its last step: the cut run's step 3 is the resumed run's
    for r in map(json.loads, first):
        if r["step"] < 3:
            got.setdefault(r["step"], {})[r["rank"]] = r["keys"]
    for r in map(json.loads, keys.read_text().splitlines()):
        if r["step"] < 23:
            got.setdefault(r["step"], {})[r["rank"]] = r["keys"]
    it = iter(build_shard_loader(ShardData(str(tmp_path / "d"), None, None), 16, 4, 2, 0, 0, 1, 0, 0, None))
    ref = [next(it)["key"] for _ in range(23)]
    assert sorted(got) == list(range(23))
    assert all(sorted(got[s]) == [0, 1] for s in range(3)) and all(list(got[s]) == [0] for s in range(3, 23))
    assert [sum((got[s][r] for r in sorted(got[s])), []) for s in range(23)] == ref
