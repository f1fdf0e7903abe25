"""Sharded initialisation (``parallel.init_sharded``): a model sharded by ``parallelize`` (zero2 / fsdp) on the meta
device, then materialised and initialised shard by shard on each rank, equals the whole model built after the
same seed in one process, bit for bit, and no rank ever holds the whole model. Two gloo ranks spawned from this test.
"""

from __future__ import annotations

import copy

import torch

from dist_helpers import free_port, gloo_dp, spawn

WORLD = 2


def _worker(rank: int, port: int) -> None:
    from ditforge.models import create_model
    from ditforge.parallel import init_sharded, parallelize
    from ditforge.parallel.ema import EMA

    with gloo_dp(rank, port, WORLD) as d:
        for name, kw, plugin, ckpt in [("DiT-T/2", dict(text_dim=24, qk_norm=True), "fsdp", "full"),
                                       ("STDiT-T/2", dict(num_frames=2), "zero2", "none")]:
            torch.manual_seed(3)
            want = create_model(name, 8, 4, 10, device="cpu", **kw).state_dict()
            skeleton = create_model(name, 8, 4, 10, device="meta", **kw)
            model = parallelize(copy.deepcopy(skeleton), d, plugin, grad_checkpoint=ckpt)
            torch.manual_seed(3)
            init_sharded(model, skeleton, d)
            assert all(p.is_meta for p in skeleton.parameters())  # the full blocks were freed
            local = sum(p.to_local().numel() for p in model.parameters())
            total = sum(v.numel() for v in want.values())
            assert local < 0.6 * total, (name, local, total)  # this rank holds about half
            got = EMA(model).full_state_dict()  # gathers the shards (a collective)
            assert got.keys() == want.keys(), name
            for k, v in want.items():
                assert torch.equal(got[k], v), (name, k)


def test_sharded_initialisation_equals_the_single_process_model():
    spawn(_worker, args=(free_port(),), nprocs=WORLD)
