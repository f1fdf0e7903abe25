"""Tensor parallelism (``--tensor_parallel``, ``parallel.tensor``) against one process: 4 gloo processes, a 2 x 2
``dp`` x ``tp`` mesh under FSDP2, the model built on the meta device and initialised shard by shard, split every
block's attention heads and MLP units and train the same model on the same global batch as one process does: after
two AdamW steps with gradient clipping they hold the same weights (gathered back into the canonical q, k, v order),
AdamW moments and EMA to fp32 tolerance, with the same losses and gradient norms. Checkpoints reshard across
tensor-parallel sizes: the one-process run's checkpoint resumes under tensor parallelism, one more step stays
equal, and the tensor-parallel checkpoint of that step loads back into one process. In the same processes, a
2 x 2 ``sp`` x ``tp`` mesh (sequence parallelism by ring attention over the heads each process holds, and by Ulysses
over them where the sequence-parallel size divides them; FSDP2 over the sequence-parallel pair) trains the same two
steps equal to one process. The text-conditioned DiT with
qk-norm covers the fused ``qkv``, cross-attention's fused ``kv_linear`` and the head-split qk-norms (STDiT's temporal
attention is the same ``Attention`` class).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from dist_helpers import free_port, spawn

# fp32 on the CPU: the split products sum in another order (~1e-7), and AdamW turns a gradient near 0 into a step of
# up to lr (1e-3) whatever its rounding, so a weight may differ by a small part of one step: 1e-5 is 1% of it
ATOL, RTOL = 1e-5, 1e-5
GLOBAL_BATCH = 4


def _data(kw: dict):
    """A global batch of latents and caption states of ``kw["text_dim"]`` with a random number of valid tokens."""
    g = torch.Generator().manual_seed(7)
    shape = (4, 8, 8)
    x = torch.randn((GLOBAL_BATCH, *shape), generator=g)
    mask = torch.arange(5) < torch.randint(1, 6, (GLOBAL_BATCH, 1), generator=g)
    cond = {"y": torch.randn(GLOBAL_BATCH, 5, kw["text_dim"], generator=g) * mask[..., None], "y_mask": mask}
    return x, cond, shape


def _trainer(model):
    from ditforge.diffusion import create_diffusion
    from ditforge.parallel.ema import EMA

    return create_diffusion(None), torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01), EMA(model)


def _train(model, parts, d, x, cond, shape, steps):
    from ditforge.train.step import step_randomness, train_step

    diffusion, opt, ema = parts
    b = GLOBAL_BATCH // d.dp_size
    rows = slice(d.dp_rank * b, (d.dp_rank + 1) * b)
    terms = []
    for step in steps:
        rnd = step_randomness(0, step, GLOBAL_BATCH, shape, diffusion, 0.1, d.device, d.dp_rank, d.dp_size)
        out = train_step(model, diffusion, opt, None, [(x[rows], {k: v[rows] for k, v in cond.items()}, rnd)],
                         torch.float32, 0.05, d)  # max norm 0.05: the clipping scales every step
        ema.update(model, 0.9)
        terms.append((out["loss"], out["grad_norm"]))
    return terms


def _full_state(model, parts) -> dict[str, torch.Tensor]:
    """Weights, AdamW moments and EMA, gathered whole in canonical layout (a collective under parallelism)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from ditforge.parallel.ema import canonical_name
    from ditforge.parallel.tensor import full_tensor

    state = {f"w.{canonical_name(n)}": full_tensor(canonical_name(n), p.detach()) for n, p in model.named_parameters()}
    for n, s in get_optimizer_state_dict(model, parts[1])["state"].items():
        state.update({f"{k}.{n}": full_tensor(n, v) for k, v in s.items() if k.startswith("exp_avg")})
    return state | {f"ema.{k}": v for k, v in parts[2].full_state_dict().items()}


def _assert_states_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=ATOL, rtol=RTOL, msg=lambda m: f"{k}: {m}")


def _create(name, kw, device):
    """The model with two blocks (the split is per block), built on the meta device and, unless ``device`` is
    meta, materialised there as ``create_model(device=)`` does."""
    from ditforge.models import create_model

    model = create_model(name, 8, 4, 10, depth=2, device="meta", **kw)
    if device != "meta":
        model.initialize_weights(device)
    return model


def _build(name, kw, d, seed, variant="auto"):
    """The model split by ``parallelize`` (FSDP2, HSDP where ``d`` has copies, and ``d``'s tensor and sequence
    parallelism, ``variant``) on the meta device, each process initialising only its shards."""
    from ditforge.parallel import init_sharded, parallelize

    skeleton = _create(name, kw, "meta")
    plugin = "hsdp" if d.shard_mesh.ndim == 2 else "fsdp"
    model = parallelize(copy.deepcopy(skeleton), d, plugin, sequence_parallel_type=variant)
    torch.manual_seed(seed)
    init_sharded(model, skeleton, d)
    return model


def _reference_file(tmp: str, name: str) -> Path:
    return Path(tmp) / f"reference-{name.replace('/', '')}.pt"


def _references(names: set[str], kw: dict, tmp: str, checkpointed: str) -> None:
    """The one-process run of each model of ``names``, trained once here for every process and mesh: its two
    steps' (loss, gradient norm) and ``_full_state`` after them, to ``_reference_file``; for ``checkpointed``,
    also its step-2 checkpoint (``tmp``/one) and its state after a third step."""
    from ditforge.parallel.mesh import Dist
    from ditforge.train import checkpoint as ckpt_io

    for name in sorted(names):
        x, cond, shape = _data(kw)
        torch.manual_seed(3)
        reference = _create(name, kw, "cpu")  # drawn as a meta build draws
        parts = _trainer(reference)
        terms = _train(reference, parts, Dist(), x, cond, shape, range(2))
        # cloned: one process's full state is its live tensors, which the third step changes
        out = {"terms": terms, "state2": {k: v.clone() for k, v in _full_state(reference, parts).items()}}
        if name == checkpointed:
            ckpt_io.Checkpointer(Path(tmp) / "one", 1, False, Dist()).save(
                2, ckpt_io.training_state(reference, parts[1], parts[2]), {})
            _train(reference, parts, Dist(), x, cond, shape, [2])
            out["state3"] = _full_state(reference, parts)
        torch.save(out, _reference_file(tmp, name))


def _case(rank: int, world: int, sp: int, tp: int, name: str, kw: dict, tmp: str, variant: str = "auto",
          replicate: int = 1) -> None:
    """One mesh on this process: dp x sp x tp = world, FSDP2 over dp x sp (HSDP with ``replicate`` > 1: that many
    copies, each sharded over the rest of dp x sp), the model meta-built, sequence parallelism ``variant``,
    against the one-process run ``_references`` saved."""
    import torch.distributed as dist

    from ditforge.parallel.mesh import init_distributed, shutdown
    from ditforge.train import checkpoint as ckpt_io

    d = init_distributed("cpu", sequence_parallel_size=sp, tensor_parallel_size=tp, dp_replicate=replicate)
    try:
        assert d.tp_size == tp and d.dp_size == world // (sp * tp)
        assert d.shard_mesh.shape == ((replicate, world // (replicate * tp)) if replicate > 1 else (world // tp,))
        x, cond, shape = _data(kw)
        want = torch.load(_reference_file(tmp, name))
        model = _build(name, kw, d, 3, variant)
        if sp > 1:  # the variant auto took: Ulysses where sp divides the heads each process holds
            import importlib

            took = importlib.import_module("ditforge.ops.attention")._split_sequence_attention.__self__.variant
            assert took == ("ulysses" if (model.num_heads // tp) % sp == 0 else "ring"), took
        parts = _trainer(model)
        local = sum(p.to_local().numel() for p in model.parameters())
        assert local < 0.8 * sum(p.numel() for p in _create(name, kw, "meta").parameters()), local  # sharded
        seen = []  # under sequence parallelism the blocks see this process's half of the 16 tokens
        model.blocks[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
        got = _train(model, parts, d, x, cond, shape, range(2))
        assert seen == [16 // sp] * 2, seen
        for (loss, norm), (loss_1, norm_1) in zip(got, want["terms"], strict=True):
            loss = loss.clone()
            dist.all_reduce(loss)  # every process's mean over its samples; tp and sp copies are alike
            torch.testing.assert_close(loss / world, loss_1, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(norm, norm_1, atol=1e-6, rtol=1e-5)
        _assert_states_equal(_full_state(model, parts), want["state2"])
        if sp > 1 or replicate > 1:
            return

        # one process's checkpoint -> a fresh tensor-parallel model (other seed), one more step, as one more
        # step of the one-process run
        model = _build(name, kw, d, 11)
        parts = _trainer(model)
        ckpt_io.load_training_state(Path(tmp) / "one" / "checkpoints" / "step-0000002", model, parts[1], parts[2])
        _assert_states_equal(_full_state(model, parts), want["state2"])
        _train(model, parts, d, x, cond, shape, [2])
        _assert_states_equal(_full_state(model, parts), want["state3"])
        # ... and its checkpoint, for the parent to load into one process
        ckpt_io.Checkpointer(Path(tmp) / "tp", 1, False, d).save(3, ckpt_io.training_state(model, *parts[1:]), {})
    finally:
        shutdown(d)


def _worker(rank: int, ports: list[int], world: int, meshes: list[tuple], kw: dict, tmp: str) -> None:
    """Every mesh of ``meshes`` (sp, tp, model name, sequence-parallel variant, HSDP copies) in turn, each in a
    process group of its own (its own port), in one start-up of the processes."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    for port, (sp, tp, name, variant, replicate) in zip(ports, meshes):
        os.environ["MASTER_PORT"] = str(port)
        _case(rank, world, sp, tp, name, kw, tmp, variant, replicate)


def test_tensor_parallel_training_and_checkpoints_equal_one_process(tmp_path, one_thread):
    """dp 2 x tp 2 (with the checkpoints both ways), then sp 2 x tp 2: tensor parallelism with ring attention
    over the sequence halves (DiT-S: 3 heads a process, which 2 do not divide, so ``auto`` takes ring), and with
    Ulysses over the heads each process holds (DiT-B: 6 of its 12; ``auto`` takes Ulysses), FSDP2 over the
    sequence-parallel pair. Then HSDP composed with each: 2 copies x tp 2 (each copy's one data-parallel process
    holds it whole: FSDP2 over a shard of 1, the tensor-parallel DTensors replicated across the copies), and 2
    copies x sp 2 (each copy sharded over its sequence-parallel pair; Ulysses named: `auto` measures on real
    weights, which a meta-built model has not)."""
    world, kw = 4, dict(text_dim=16, qk_norm=True)
    meshes = [(1, 2, "DiT-S/2", "auto", 1), (2, 2, "DiT-S/2", "auto", 1), (2, 2, "DiT-B/2", "auto", 1),
              (1, 2, "DiT-S/2", "auto", 2), (2, 1, "DiT-S/2", "ulysses", 2)]
    from ditforge.errors import UserError
    from ditforge.parallel import tensor_parallel_sequence_type

    assert [tensor_parallel_sequence_type("auto", heads, 2, 2) for heads in (6, 12)] == ["ring", "ulysses"]
    with pytest.raises(UserError, match="leaves 3 of the 6 heads"):
        tensor_parallel_sequence_type("ulysses", 6, 2, 2)
    from ditforge.train import checkpoint as ckpt_io

    name = meshes[0][2]
    _references({mesh[2] for mesh in meshes}, kw, str(tmp_path), name)
    ports = [free_port() for _ in meshes]
    spawn(_worker, args=(ports, world, meshes, kw, str(tmp_path)), nprocs=world)
    model = _create(name, kw, "cpu")
    parts = _trainer(model)
    ckpt_io.load_training_state(tmp_path / "tp" / "checkpoints" / "step-0000003", model, parts[1], parts[2])
    _assert_states_equal(_full_state(model, parts), torch.load(_reference_file(str(tmp_path), name))["state3"])


@pytest.mark.parametrize("fields,flag", [({"parallel.sequence_parallel_size": 2,
                                           "parallel.sequence_parallel_type": "fastseq"},
                                          "--sequence_parallel_type fastseq"),
                                         ({"train.optimizer": "adamw8bit"}, "--optimizer adamw8bit"),
                                         ({"model.lora_rank": 4}, "--lora_rank"),
                                         ({"parallel.plugin": "ddp"}, "--plugin ddp")])
def test_tensor_parallel_refuses_what_it_does_not_split_in_one_line(fields, flag):
    from ditforge.config.checks import validate
    from ditforge.config.sections import RunConfig
    from ditforge.errors import UserError

    cfg = RunConfig()
    cfg.model.model, cfg.parallel.tensor_parallel = "DiT-S/2", 2
    for field, value in fields.items():
        section, name = field.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(UserError) as e:
        validate(cfg)
    assert str(e.value).startswith("--tensor_parallel 2") and flag in str(e.value) and "\n" not in str(e.value)
