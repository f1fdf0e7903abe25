"""The EMA lives where the weights live: under zero2 / fsdp every rank holds and updates only its shard (a
DTensor, about 1/world of each parameter), under ddp a full plain copy; ``full_state_dict`` gathers the whole
model on every rank. Two gloo ranks spawned from this test (no torchrun), DiT-T/2.

Reference: the unsharded model built under the same seed, and the float64 closed form of one EMA update.
"""

from __future__ import annotations

import pytest
import torch

from dist_helpers import free_port, gloo_dp, spawn

WORLD = 2


def _worker(rank: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from ditforge.models import create_model
    from ditforge.parallel import parallelize
    from ditforge.parallel.ema import EMA

    with gloo_dp(rank, port, WORLD) as d:
        for plugin in ("zero2", "fsdp", "ddp"):
            torch.manual_seed(0)
            model = create_model("DiT-T/2", 8, 1, 10)
            full = {k: v.detach().clone() for k, v in model.state_dict().items()}
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            model = parallelize(model, d, plugin)
            ema = EMA(model)
            shadow = ema.state_dict()
            assert shadow.keys() == full.keys(), plugin  # the plain model's names, no wrapper prefixes
            for k, v in shadow.items():
                if plugin == "ddp":
                    assert not isinstance(v, DTensor) and torch.equal(v, full[k]), (plugin, k)
                    continue
                assert isinstance(v, DTensor), (plugin, k)
                assert v.placements == (Shard(0),) and v.shape == full[k].shape, (plugin, k)
                local = v.to_local()
                numels = [None] * WORLD
                dist.all_gather_object(numels, local.numel())
                # the shards partition the parameter: ~1/2 each (dim 0 split in ceil-sized chunks)
                assert sum(numels) == full[k].numel(), (plugin, k, numels)
                rows = -(-full[k].shape[0] // WORLD)
                assert local.numel() == full[k][rank * rows : (rank + 1) * rows].numel(), (plugin, k)
                assert torch.equal(local, full[k][rank * rows : (rank + 1) * rows]), (plugin, k)
            total = sum(v.numel() for v in full.values())
            local_total = sum((v.to_local() if isinstance(v, DTensor) else v).numel() for v in shadow.values())
            if plugin != "ddp":
                assert 0.45 * total < local_total < 0.55 * total, (plugin, local_total, total)
            gathered = ema.full_state_dict()
            assert gathered.keys() == full.keys()
            assert all(torch.equal(gathered[k], full[k]) for k in full), plugin

            # one update, on each rank's shard only: ema <- d * ema + (1 - d) * weights
            with torch.no_grad():
                for p in model.parameters():
                    (p.to_local() if isinstance(p, DTensor) else p).add_(1.0)
            decay = 0.75
            ema.update(model, decay)
            gathered = ema.full_state_dict()
            for k in full:
                if k in trainable:
                    want = decay * full[k].double() + (1 - decay) * (full[k].double() + 1)
                    torch.testing.assert_close(gathered[k].double(), want, rtol=0, atol=1e-6)
                else:  # pos_embed: the fixed sin-cos table is not averaged
                    assert torch.equal(gathered[k], full[k]), (plugin, k)


@pytest.mark.slow
def test_ema_is_sharded_like_the_weights():
    spawn(_worker, args=(free_port(),), nprocs=WORLD)
