"""``CompensatedAdamW`` over FSDP2's sharded parameters (``--plugin zero2 | fsdp`` with ``--optimizer adamw8bit``
and ``--master_weights bf16 | bf16_sr``): 2 gloo processes, each stepping its shard, equal one process stepping
the whole tensors with the same gradients, bit for bit: the bf16 weights, the 8-bit codes and their blocks' absmax,
the fp32 moments of the small tensors and the Kahan compensation. The states are DTensors placed like their
parameter, so the gathered optimizer state dict loads into one process's optimizer, which then steps as the
uninterrupted one. Then the command line: 3 steps under ``--plugin fsdp`` on 2 processes, resumed in one.

Reference: ``CompensatedAdamW`` on plain tensors in one process (the libraries' kernels: bitsandbytes' 8-bit
blockwise update, torch's AdamW), itself tested against its closed forms in ``tests/optim/test_optim.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_helpers import COMMON, TINY, free_port, gloo_dp, read_run, spawn, torchrun_cli_many

pytestmark = pytest.mark.slow

STEPS = 3


def _model() -> nn.Module:
    """Weights of 128 x 64 and 64 x 128 (8-bit: 8,192 elements, 16 blocks of 256 a shard of 2); biases of 128 and
    64 and a 48 x 64 weight (3,072 elements: fp32 moments, as bitsandbytes keeps tensors under 4,096)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 48))


def _worker(rank: int, port: int, rounding: str, fused: bool) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    from ditforge.optim.compensated import CompensatedAdamW

    def build(module: nn.Module, ema: bool = True) -> CompensatedAdamW:
        opt = CompensatedAdamW(module.parameters(), lr=3e-2, weight_decay=0.1, states="8bit", rounding=rounding,
                               fused=fused)
        if fused and ema:  # the one-pass step updates an fp32 EMA too (sharded like the weights)
            opt.attach_ema({p: p.detach().float().clone() for p in module.parameters()})
            opt.ema_decay = 0.9
        return opt

    with gloo_dp(rank, port, 2) as d:
        ref = _model().to(torch.bfloat16)
        sharded = _model().to(torch.bfloat16)
        for layer in sharded:
            fully_shard(layer, mesh=d.mesh)
        fully_shard(sharded, mesh=d.mesh)
        opt, ref_opt = build(sharded), build(ref)
        names = [n for n, _ in ref.named_parameters()]

        def step(k: int) -> None:
            g = torch.Generator().manual_seed(100 + k)  # the same gradients on both processes and the reference
            for (_, p), (_, q) in zip(sharded.named_parameters(), ref.named_parameters()):
                grad = torch.randn(q.shape, generator=g).to(torch.bfloat16)
                q.grad = grad
                p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
            opt.step()
            ref_opt.step()

        for k in range(STEPS):
            step(k)
        for (name, p), q in zip(sharded.named_parameters(), ref.parameters()):
            assert isinstance(p, DTensor), name
            if rounding == "kahan":
                assert torch.equal(p.full_tensor(), q), name
            else:  # a rounding up instead of down, at most once a step: 3 ulps, each under 2^-7 of the largest weight
                bound = 3 * 2**-7 * q.abs().max().item()
                assert (p.full_tensor() - q).abs().max() <= bound and not torch.equal(p.full_tensor(), q), name
            if fused and rounding == "kahan":
                assert torch.equal(opt._ema[p].full_tensor(), ref_opt._ema[q]), name
            mine, want = opt.state[p], ref_opt.state[q]
            assert mine.keys() == want.keys(), (name, mine.keys(), want.keys())
            assert ("state1" in want) == (q.numel() >= 4096), name  # 8-bit where bitsandbytes would be
            for key, value in want.items():
                got = mine[key].full_tensor() if isinstance(mine[key], DTensor) else mine[key]
                assert torch.equal(got, value), (name, key)
        start = _model().to(torch.bfloat16)
        assert all((q - q0).abs().max() > 0.05 for q, q0 in zip(ref.parameters(), start.parameters()))  # moved

        if fused:  # on a GPU the one-pass step takes row shards, and leaves tensor parallelism's to torch's AdamW
            from unittest import mock

            from torch.distributed.tensor import Shard

            from ditforge import optim

            columns = nn.Parameter(distribute_tensor(torch.randn(8, 4), d.mesh, [Shard(1)]))
            with mock.patch.object(optim, "on_gpu_with_triton", lambda device: True):
                cpu = torch.device("cpu")
                assert type(optim.build_optimizer([columns], "adamw", 1e-3, 0.0, cpu)) is torch.optim.AdamW
                assert optim.build_optimizer(list(sharded.parameters()), "adamw", 1e-3, 0.0, cpu).fused

        # the gathered state dict (what DCP reshards) into one process's optimizer, stepped on as the uninterrupted
        full = get_optimizer_state_dict(sharded, opt, options=StateDictOptions(full_state_dict=True))
        ref_state = ref_opt.state_dict()
        alone = _model().to(torch.bfloat16)
        with torch.no_grad():
            for q, r in zip(alone.parameters(), ref.parameters()):
                q.copy_(r)
        alone_opt = build(alone, ema=False)
        set_optimizer_state_dict(alone, alone_opt, full)
        ref_opt = build(ref, ema=False)  # the reference goes on from its state, without the EMA
        ref_opt.load_state_dict(ref_state)
        step(STEPS)
        g = torch.Generator().manual_seed(100 + STEPS)
        for q in alone.parameters():
            q.grad = torch.randn(q.shape, generator=g).to(torch.bfloat16)
        alone_opt.step()
        for name, q, r in zip(names, alone.parameters(), ref.parameters()):
            assert torch.equal(q, r), name
            for key, value in ref_opt.state[r].items():
                assert torch.equal(alone_opt.state[q][key].cpu(), value), (name, key)


@pytest.mark.parametrize("rounding,fused", [("kahan", False), ("stochastic", False), ("kahan", True)])
def test_sharded_steps_equal_one_process(rounding, fused):
    """Kahan-compensated bf16 weights, and stochastically rounded ones (whose random stream, drawn in the order of
    the local shard's elements, then differs from one process's on process 1: held to one bf16 ulp a step
    instead), with 8-bit moments; by the libraries' kernels, and by the one-pass Triton step (under Triton's CPU
    interpreter here) with the EMA it updates, sharded too."""
    spawn(_worker, args=(free_port(), rounding, fused), nprocs=2)


def test_fsdp_run_with_8bit_moments_and_bf16_weights_resumes_in_one_process(tmp_path):
    """``ditforge train --plugin fsdp --optimizer adamw8bit --master_weights bf16`` (bf16 compute) on 2 processes
    for 3 steps, then ``--resume auto`` to 5 steps in one process from its checkpoint (DCP resharding the states
    from 2 shards to 1): the same losses as 5 uninterrupted steps in one process, to bf16 rounding of the reduced
    gradients (FSDP2 sums the two halves in fp32 then rounds to bf16; one process rounds the whole batch's
    gradient once)."""
    from dist_helpers import run_single

    flags = [*TINY, "--mixed_precision", "bf16", "--optimizer", "adamw8bit", "--master_weights", "bf16",
             "--ckpt_every", "3"]
    run = tmp_path / "run"
    err = torchrun_cli_many(2, tmp_path, [["train", *COMMON, *flags, "--outputs", str(run), "--max_steps", "3",
                                           "--plugin", "fsdp"]])
    assert "plugin fsdp" in err[0]
    run_single(run, *flags, "--resume", "auto", "--max_steps", "5", "--plugin", "none")
    ref = run_single(tmp_path / "ref", *flags, "--max_steps", "5", "--plugin", "none")
    got, want = read_run(run, "DiT-T/2"), read_run(ref, "DiT-T/2")
    assert sorted(got.losses()) == sorted(want.losses()) == [1, 2, 3, 4, 5]
    for step, loss in want.losses().items():
        assert got.losses()[step] == pytest.approx(loss, rel=2e-2), step
