"""Process group and DeviceMesh set-up from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ditforge.config.values import resolve_device
from ditforge.errors import UserError


@dataclass
class Dist:
    """Where this process stands: its rank, the world size, its device, the 1-D mesh ``mesh`` over which
    parameters, gradients and checkpoints are sharded or reduced (every process; under tensor parallelism, the
    processes that hold the same slices of the weights: one per ``tp`` group), and, under sequence parallelism,
    its place on the 2-D mesh ``sp_mesh`` (dims ``dp``, ``sp``): processes of one ``sp`` group share each sample,
    split along its tokens; the ``dp`` coordinate picks the samples. Under tensor parallelism ``tp_mesh`` (1-D,
    dim ``tp``) holds the processes that split each block's weights and see the same samples. ``shard_mesh`` is
    the mesh FSDP2 shards over: ``mesh`` itself, or under HSDP the 2-D (``dp_replicate``, ``dp_shard``) one.

    ``mesh`` is None in a single process (no process group is created then).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: DeviceMesh | None = None
    sp_mesh: DeviceMesh | None = None
    tp_mesh: DeviceMesh | None = None
    shard_mesh: DeviceMesh | None = None
    timeout: timedelta | None = None  # of every collective (``--collective_timeout``); None: torch's defaults

    @property
    def sp_size(self) -> int:
        return self.sp_mesh["sp"].size() if self.sp_mesh is not None else 1

    @property
    def tp_size(self) -> int:
        return self.tp_mesh.size() if self.tp_mesh is not None else 1

    @property
    def dp_size(self) -> int:
        """Data-parallel width: how many different slices of the global batch are processed at once."""
        return self.world_size // (self.sp_size * self.tp_size)

    @property
    def dp_rank(self) -> int:
        if self.sp_mesh is not None:
            return self.sp_mesh["dp"].get_local_rank()
        return self.mesh.get_local_rank() if self.tp_mesh is not None else self.rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.mesh is not None:
            dist.barrier()

    def gloo_group(self) -> dist.ProcessGroup | None:
        """A new gloo group of every process (collective: all must call it), with the run's timeout; None in one
        process. For the host-side control messages that must not queue behind the device's collectives."""
        return dist.new_group(backend="gloo", timeout=self.timeout) if self.mesh is not None else None


def init_distributed(device: str = "auto", sequence_parallel_size: int = 1, group_of_one: bool = False,
                     tensor_parallel_size: int = 1, dp_replicate: int = 1,
                     collective_timeout: float | None = None) -> Dist:
    """Join the process group torchrun set up (NCCL on GPUs, gloo on CPUs) and build a 1-D ``dp`` mesh, and
    with ``sequence_parallel_size`` > 1 the 2-D (``dp``, ``sp``) mesh, consecutive ranks in one ``sp`` group
    (on one host first: sequence parallelism communicates every layer). With ``tensor_parallel_size`` > 1 the
    world is the 3-D mesh (``dp``, ``sp``, ``tp``), consecutive ranks in one ``tp`` group (it communicates twice
    per block); ``mesh`` is then its (``dp``, ``sp``) part flattened, over which FSDP2 shards. With
    ``dp_replicate`` > 1 (HSDP, ``hsdp_replicas``) FSDP2 shards over the 2-D ``shard_mesh`` (``dp_replicate``,
    ``dp_shard``) instead: the world cut into ``dp_replicate`` blocks of consecutive ranks (one node each), each
    holding a whole copy of the weights sharded over its ``dp_shard`` (x ``sp``) processes. Every mesh derives
    from the one world mesh (``DeviceMesh._unflatten``), as FSDP2 over tensor-parallel DTensors requires.

    ``collective_timeout`` (seconds; None: torch's defaults) bounds every collective of the default process group
    (``init_process_group``'s ``timeout``; NCCL's watchdog then aborts a hung one).

    Without torchrun (WORLD_SIZE unset or 1) returns a single-process ``Dist`` and starts nothing, unless
    ``group_of_one`` (FSDP2 in one process, for ``--cpu_offload all``): then a process group of this process
    alone (an in-memory store) and its mesh.

    Raises:
        UserError: a sequence-parallel size that does not divide the number of processes.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % sequence_parallel_size:
        raise UserError(f"--sequence_parallel_size {sequence_parallel_size} does not divide the {world} processes")
    if world % (sequence_parallel_size * tensor_parallel_size):
        raise UserError(f"--tensor_parallel {tensor_parallel_size} x --sequence_parallel_size "
                        f"{sequence_parallel_size} does not divide the {world} processes")
    if world == 1 and not group_of_one:
        return Dist(device=resolve_device(device))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index if world == 1 and dev.index is not None else local_rank)
        torch.cuda.set_device(dev)
    timeout = timedelta(seconds=collective_timeout) if collective_timeout is not None else None
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if world == 1:  # no torchrun: nothing to rendezvous with
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    sp, tp = sequence_parallel_size, tensor_parallel_size
    world_mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    grid = world_mesh._unflatten(0, (world // (sp * tp), sp, tp), ("dp", "sp", "tp")) if sp * tp > 1 else None
    if tp > 1:
        mesh = grid["dp", "sp"]._flatten("dp_sp") if sp > 1 else grid["dp"]
    else:
        mesh = world_mesh
    shard_mesh = mesh
    if dp_replicate > 1:
        shard_mesh = world_mesh._unflatten(0, (dp_replicate, world // (dp_replicate * tp), tp),
                                           ("dp_replicate", "dp_shard", "tp"))["dp_replicate", "dp_shard"]
    return Dist(rank=rank, world_size=world, local_rank=local_rank, device=dev, mesh=mesh,
                sp_mesh=grid["dp", "sp"] if sp > 1 else None, tp_mesh=grid["tp"] if tp > 1 else None,
                shard_mesh=shard_mesh, timeout=timeout)


def hsdp_replicas(dp_shard: int, dp_replicate: int, world: int, local_world: int, sp: int = 1, tp: int = 1) -> int:
    """The number of weight copies of ``--plugin hsdp`` (``--dp_replicate``) over ``world`` processes, of which
    ``local_world`` run on each node (torchrun's LOCAL_WORLD_SIZE). ``dp_shard`` (0: the processes of one node,
    ``local_world`` / (``sp`` x ``tp``)) is the number of processes that shard one copy; ``dp_replicate`` (0: the
    rest of the world) the copies. torchtitan's ``data_parallel_replicate_degree`` / ``_shard_degree``.

    Raises:
        UserError: a layout whose product is not the world size, or a negative degree.
    """
    if dp_shard < 0 or dp_replicate < 0:
        raise UserError(f"--dp_shard {dp_shard} --dp_replicate {dp_replicate}: expected integers >= 0 (0: default)")
    shard = dp_shard or max(1, local_world // (sp * tp))
    replicate = dp_replicate or max(1, world // (shard * sp * tp))
    if replicate * shard * sp * tp != world:
        raise UserError(f"--plugin hsdp: --dp_replicate {replicate} x --dp_shard {shard} x --sequence_parallel_size "
                        f"{sp} x --tensor_parallel {tp} is {replicate * shard * sp * tp}, not the {world} processes")
    return replicate


def shutdown(d: Dist) -> None:
    """Leave the process group (if this process joined one)."""
    if d.mesh is not None and dist.is_initialized():
        dist.destroy_process_group()
