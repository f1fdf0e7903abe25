"""Apply data parallelism and activation checkpointing to a model from outside (as torchtitan does):
the model code knows nothing of them."""

from __future__ import annotations

import contextlib
import functools
import logging
import math

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import OffloadWrapper, checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ditforge.config.sections import SHARDED_PLUGINS
from ditforge.config.values import parse_checkpoint_policy
from ditforge.errors import UserError
from ditforge.models import block_paths, replace_block
from ditforge.models.adapters import DiffusersDenoiser
from ditforge.ops.attention import set_attention_backend, set_frame_exchange, set_sequence_attention
from ditforge.ops.modulate import set_kernels
from ditforge.parallel.context import apply_context_parallel
from ditforge.parallel.ema import canonical_name
from ditforge.parallel.mesh import Dist
from ditforge.parallel.tensor import apply_tensor_parallel, local_part

log = logging.getLogger(__name__)


def resolve_plugin(plugin: str, world_size: int, cpu_offload: str = "none") -> str:
    """The plugin that runs: ``none`` in one process whatever was asked (there is nothing to distribute);
    with several processes ``auto`` or ``none`` become ``zero2`` (OpenDiT's default). ``--cpu_offload all``
    offloads through FSDP2: ``auto`` / ``none`` become ``fsdp`` (the weights leave the GPU after each block's
    forward) at any world size, one process included."""
    if cpu_offload == "all":
        return "fsdp" if plugin in ("auto", "none") else plugin
    if world_size == 1:
        return "none"
    return "zero2" if plugin in ("auto", "none") else plugin


# Ops whose outputs selective checkpointing keeps. ``op``: the matrix products and attention (expensive to
# recompute); LayerNorm, modulate, GELU and residuals are recomputed (cheap, and most of the activations).
# ``attn``: attention alone, whose cost grows with the square of the sequence (at a 480p video model's 32,760
# video tokens most of a block's FLOPs); the matrix products are recomputed, so only the attention outputs stay (a
# block's width each).
_ATTENTION_OPS = {
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
_SAVED_CUSTOM_OPS = {"ditforge::flash4_forward"}  # registered on first use (ops.flash4): matched by name
_SAVED_OPS = {"op": _ATTENTION_OPS | {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                                     torch.ops.aten.bmm.default},
              "attn": _ATTENTION_OPS}


def _selective_context(kind: str):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _SAVED_OPS[kind]

    def policy(ctx, op, *args, **kwargs):
        keep = op in saved or op.name() in _SAVED_CUSTOM_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _pack_to_host(tensor: torch.Tensor) -> torch.Tensor | tuple[torch.device, torch.Tensor]:
    """Saved-tensor pack hook of ``ActivationOffload``: a parameter, or a view of one (the transposed weight that a
    linear layer saves), stays where it is, since the module holds it anyway; any other tensor is copied into
    pinned host memory (non-blocking, on the current stream), as torch's ``save_on_cpu(pin_memory=True)`` does."""
    if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
        return tensor
    pinned = tensor.device.type == "cuda" and not tensor.is_sparse
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
    host.copy_(tensor, non_blocking=pinned)
    return tensor.device, host


def _unpack_from_host(packed: torch.Tensor | tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    if torch.is_tensor(packed):
        return packed
    device, host = packed
    return host.to(device, non_blocking=host.is_pinned())


class ActivationOffload(OffloadWrapper):
    """torch's ``offload_wrapper`` with parameters left out: ``save_on_cpu`` packs every saved tensor, and a block
    saves its weights (or, in bf16 weights, the parameters themselves) for the backward, which would cross PCIe
    twice per step for nothing and come back as a second copy. The state-dict keys are those of the wrapped
    block."""

    def forward(self, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(_pack_to_host, _unpack_from_host):
            return self._checkpoint_wrapped_module(*args, **kwargs)


def apply_grad_checkpoint(model: nn.Module, policy: str, offload: bool = False) -> None:
    """Wrap the model's repeated blocks (``block_paths``) for activation checkpointing (Chen et al. 2016) by
    ``policy`` (see ``parse_checkpoint_policy``), and with ``offload`` (``--offload_activations``) every block
    for activation offload (``ActivationOffload``): each tensor the block saves for its backward,
    parameters excepted, is copied to pinned host memory in the forward (non-blocking, on the compute stream) and
    back in the backward; a checkpointed block saves only its inputs (and, selectively, the kept ops' outputs,
    which stay on the device). The state-dict keys do not change.
    """
    kind, k = parse_checkpoint_policy(policy)
    for i, path in enumerate(block_paths(model)):
        block = model.get_submodule(path)
        if kind in _SAVED_OPS:
            block = checkpoint_wrapper(block, context_fn=functools.partial(_selective_context, kind))
        elif kind != "none" and i % k == 0:
            block = checkpoint_wrapper(block)
        # a checkpointed block saves its inputs (torch's non-reentrant checkpoint saves them for the backward
        # outside its own hooks), so under these hooks they go to host memory too; what it saves inside it
        # recomputes (or, selectively, keeps on the device)
        replace_block(model, path, ActivationOffload(block) if offload else block)


FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper or newer


def fp8_unavailable(device: torch.device, inference: bool = False) -> str | None:
    """Why float8 matrix products cannot run on ``device`` ("needs ..."), or None. Training needs torchao (its
    float8 training linears); sampling (``inference``) needs Triton instead (``ditforge.ops.fp8``'s quantization
    kernel)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        return (f"needs a CUDA GPU with FP8 tensor cores (compute capability >= {FP8_MIN_CAPABILITY[0]}."
                f"{FP8_MIN_CAPABILITY[1]}, e.g. H100)")
    try:
        if inference:
            import triton  # noqa: F401
        else:
            import torchao.float8  # noqa: F401
    except ImportError:
        return "needs Triton (pip install triton)" if inference else "needs torchao (pip install 'ditforge[fp8]')"
    return None


def fp8_layer(module: nn.Module, fqn: str, blocks: tuple[str, ...] = ("blocks",), min_width: int = 16) -> bool:
    """A linear layer of one of the repeated blocks (``blocks``: their qualified names' common prefixes,
    ``models.block_paths``) worth float8: not the per-sample regressions (ditforge's ``adaLN``, diffusers' ``norm*``
    layers and the UNet's ``time_emb_proj``; M = batch rows) or the embedders, too small to gain; not a layer whose
    weight is stored in float8 already (``--fp8_base``: it upcasts for a bf16 product); both sides multiples of 16,
    as the float8 GEMMs require, and at least ``min_width`` (training's policy, ``FP8_MIN_WIDTH``)."""
    parts = fqn.split(".")
    return (isinstance(module, nn.Linear) and fqn.startswith(tuple(p + "." for p in blocks))
            and "adaLN" not in fqn and not any(part.startswith("norm") or part == "time_emb_proj" for part in parts)
            and module.weight.element_size() > 1
            and module.in_features % 16 == 0 and module.out_features % 16 == 0
            and min(module.in_features, module.out_features) >= min_width)


def apply_fp8(model: nn.Module, device: torch.device, inference: bool = False, recipe: str = "tensorwise",
              min_width: int = 16) -> int:
    """Run the repeated blocks' big linear layers (qkv, proj, fc1, fc2, cross-attention; ``fp8_layer``) of
    ``model`` (a ditforge model, or an adapter of a diffusers one: its ``block_classes``) as float8 matrix
    products. Returns the number of layers changed (0 where none is ``min_width`` wide).

    - training (default): torchao's float8 training linears with dynamic scaling by ``recipe``
      (``Float8LinearConfig.from_recipe_name``): ``tensorwise`` (one scale per tensor; e4m3 forward, e5m2
      gradients; Micikevicius et al. 2022, "FP8 Formats for Deep Learning"), ``rowwise`` (one scale per row of
      each GEMM operand along its contraction, e4m3 throughout) or ``rowwise_with_gw_hp`` (rowwise, the weight
      gradient's product in bf16). Parameter names, shapes and fp32 master weights do not change. Training
      passes ``min_width`` = ``--fp8_min_width``: layers narrower than that stay bf16 (``FP8_MIN_WIDTH``).
    - ``inference``: ``ditforge.ops.fp8.RowwiseFloat8Linear`` in place of each layer: its bf16 weight
      (D_out, D_in) stored once as e4m3 with one scale per output channel, each activation row scaled by its
      own absolute maximum at run time by one Triton pass (for fc2, with the MLP's GELU in the same pass);
      ``torch._scaled_mm`` accumulates in fp32 and returns bf16. The model must already be bf16. The weights
      become float8 buffers, so the state dict is no longer that of the bf16 model.

    Raises:
        UserError: no CUDA device with FP8 tensor cores, or torchao (training) / Triton (inference) missing.
    """
    reason = fp8_unavailable(device, inference)
    if reason:
        raise UserError(f"--mixed_precision fp8: {reason}")
    from ditforge.models import block_paths

    blocks = tuple(block_paths(model))  # ditforge's blocks.i, or an adapter's diffusers blocks
    if inference:
        from ditforge.ops.fp8 import to_rowwise_float8

        return to_rowwise_float8(model, lambda m, fqn: fp8_layer(m, fqn, blocks))
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    before = sum(type(m) is nn.Linear for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fp8_layer(m, fqn, blocks, min_width),
                               config=Float8LinearConfig.from_recipe_name(recipe))
    return before - sum(type(m) is nn.Linear for m in model.modules())


def parallelize(
    model: nn.Module,
    dist: Dist,
    plugin: str = "none",
    grad_checkpoint: str = "none",
    compile: str = "none",
    attention: str = "auto",
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    enable_modulate_kernel: bool = False,
    enable_layernorm_kernel: bool = False,
    fp8: str | None = None,
    fp8_min_width: int = 16,
    sequence_parallel_type: str = "auto",
    batch_size: int = 1,
    fused_backward_pass: bool = False,
    cpu_offload: bool = False,
    offload_activations: bool = False,
) -> nn.Module:
    """Prepare ``model`` for (distributed) training without touching its code.

    Args:
        model: a denoiser with repeated blocks (``ditforge.models.block_paths``: a DiT's ``blocks``, or the
            blocks an adapter of a diffusers model declares), fp32, on ``dist.device``; under zero2 / fsdp a DiT
            may be on the meta device, to be materialised shard by shard afterwards (``init_sharded``).
        plugin: ``none`` (one process), ``ddp`` (DistributedDataParallel: all replicated, gradients
            all-reduced), ``zero2`` (FSDP2 ``fully_shard`` with ``reshard_after_forward=False``: gradients
            and optimizer states sharded, parameters gathered once per step and kept through the backward),
            ``fsdp`` (ZeRO-3: parameters resharded after the forward and gathered again for the backward).
        grad_checkpoint: activation checkpointing policy, ``none | full | every-K | op | attn``
            (``parse_checkpoint_policy``).
        Under tensor parallelism (``dist.tp_mesh``) every block's attention and MLP are split over it first
        (``parallel.tensor``), then the rest applies as without it; zero2 / fsdp shard over ``dist.mesh``.
        offload_activations: every block saves what it keeps for its backward (a checkpointed block its inputs)
            in pinned host memory (``apply_grad_checkpoint``).
        compile: ``torch.compile`` mode for each block, compiled in place (after checkpointing, before
            sharding, as torchtitan orders them; every block has the same code, so it compiles once), or
            ``none``. ``reduce-overhead`` / ``max-autotune`` add CUDA graphs (static shapes). A model that sets
            ``compile_whole`` (the adapters of diffusers image models) compiles as one module instead, under the
            none / ddp plugins.
        attention: SDPA kernels behind ``ops.attention``: ``auto`` | ``fast`` (``--enable_flashattn``) |
            ``math``.
        enable_modulate_kernel, enable_layernorm_kernel: fused Triton adaLN kernels (``ops.set_kernels``).
        fp8: float8 matrix products in the blocks' big linear layers with this torchao recipe (``apply_fp8``),
            or None; only in those whose input and output are both at least ``fp8_min_width`` wide
            (``--fp8_min_width``; the rest stay in the compute dtype).
        param_dtype: dtype of the gathered parameters under zero2/fsdp (the compute dtype); the sharded fp32
            parameters stay the optimizer's master weights.
        reduce_dtype: dtype of the gradient reduction (fp32 by default; bf16 halves its traffic).
        sequence_parallel_type: with ``dist.sp_mesh`` (``--sequence_parallel_size`` > 1), how the split
            sequence attends (``apply_sequence_parallel``): ulysses | ring | fastseq | fastseq_kv | usp | auto
            (the fastest at this shape, measured on one attention layer: ``choose_sequence_parallel_type``).
            A diffusers video transformer (the adapter of a pipeline) splits its tokens by its own context-parallel
            plan instead (``parallel.context``: ulysses | ring | usp | auto).
            Under tensor parallelism Ulysses runs over the heads each process holds (``auto`` takes it where the
            sequence-parallel size divides them, else ring; ``tensor_parallel_sequence_type``); FastSeq and USP
            are refused in one line (``config``).
        batch_size: samples per process in one forward; sizes ``auto``'s measurement.
        fused_backward_pass: the optimizer steps inside the backward block by block
            (``optim.backward.StepInBackward``): the blocks compile one by one even where the model sets
            ``compile_whole``, since one graph's
            backward would hand out every gradient at once.
        cpu_offload: under zero2/fsdp, FSDP2's ``CPUOffloadPolicy`` (``--cpu_offload all``): the fp32 shards and
            their gradients live in host memory (pinned on a GPU); each block's shards are copied to the GPU and
            cast to ``param_dtype`` when it is gathered, its reduced gradients copied back. ``model`` may then be
            on the CPU: fully_shard moves one module's parameters at a time to the device, shards and offloads
            them.

    Returns:
        The model to train: the same module (fully_shard works in place) or a DDP wrapper around it.
        State-dict keys of the plain model are reachable through torch.distributed.checkpoint.state_dict.
    """
    log.info("attention: %s", set_attention_backend(attention, dist.device))
    if attention == "fast" and isinstance(model, DiffusersDenoiser) and dist.sp_mesh is None:
        from ditforge.models.adapters.dispatch import route_exact_attention

        for expert in model.expert_models():  # its processors call diffusers' code, not the seam; both experts'
            route_exact_attention(expert, dist.device)
    set_sequence_attention(None)
    set_frame_exchange(None)
    if dist.tp_mesh is not None:
        apply_tensor_parallel(model, [model.get_submodule(path) for path in block_paths(model)], dist.tp_mesh)
    if dist.sp_mesh is not None and isinstance(model, DiffusersDenoiser):
        apply_context_parallel(model, dist, sequence_parallel_type)  # the diffusers model's own plan
    elif dist.sp_mesh is not None:
        if dist.tp_mesh is not None:  # the heads are split over tp already
            sequence_parallel_type = tensor_parallel_sequence_type(sequence_parallel_type, model.num_heads,
                                                                   dist.tp_size, dist.sp_size)
        _apply_sequence_parallel(model, dist, sequence_parallel_type, batch_size, param_dtype)
    _set_adaln_kernels(dist.device, enable_modulate_kernel, enable_layernorm_kernel)
    if fp8:
        changed = apply_fp8(model, dist.device, recipe=fp8, min_width=fp8_min_width)
        if changed:
            log.info("fp8: %d linear layers run float8 matrix products (%s)", changed, fp8)
        else:
            log.warning("--mixed_precision fp8: no linear layer of the blocks is --fp8_min_width %d wide, where "
                        "float8 pays; all run in bf16", fp8_min_width)
    apply_grad_checkpoint(model, grad_checkpoint, offload_activations)
    blocks = [model.get_submodule(path) for path in block_paths(model)]
    if compile != "none":
        whole = getattr(model, "compile_whole", False) and plugin in ("none", "ddp") and not fused_backward_pass
        _apply_compile(model, blocks, None if compile == "default" else compile, whole)
    if plugin == "ddp":
        return _apply_ddp(model, dist, reduce_dtype)
    if plugin in SHARDED_PLUGINS:
        _apply_fsdp(model, blocks, dist, plugin != "zero2", param_dtype, reduce_dtype, cpu_offload)
    return model


def tensor_parallel_sequence_type(kind: str, num_heads: int, tp: int, sp: int) -> str:
    """The sequence-parallel variant under tensor parallelism, where each process holds num_heads / tp heads:
    ``ulysses`` (all-to-all over those heads: the tp and sp splits multiply) where sp divides them, else ``ring``
    (whole heads, rotating K/V); ``auto`` takes Ulysses where it can (an all-to-all of a quarter of q, k, v and o
    each against ring's P - 1 exchanges of K and V: docs/multi-gpu.md's table).

    Raises:
        UserError: ``ulysses`` asked for when sp does not divide the heads each process holds.
    """
    local = num_heads // tp
    if kind in ("auto", "ulysses") and local % sp == 0:
        return "ulysses"
    if kind == "ulysses":
        raise UserError(f"--sequence_parallel_type ulysses: --tensor_parallel {tp} leaves {local} of the "
                        f"{num_heads} heads on each process, which --sequence_parallel_size {sp} does not divide; "
                        "use ring or auto")
    return "ring"


def _apply_sequence_parallel(model: nn.Module, dist: Dist, sequence_parallel_type: str, batch_size: int,
                             param_dtype: torch.dtype | None) -> None:
    """The split sequence's attention over ``dist.sp_mesh`` (``parallelize``'s ``sequence_parallel_type``)."""
    from ditforge.parallel.sequence.shard import apply_sequence_parallel, choose_sequence_parallel_type

    variant, ms, usp_group = choose_sequence_parallel_type(sequence_parallel_type, model, dist, batch_size,
                                                           param_dtype)
    if ms:
        log.info("sequence parallelism auto: ms per attention layer at this shape: %s",
                 ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))
    apply_sequence_parallel(model, dist, variant, usp_group)
    log.info("sequence parallelism: %s over %d processes (x %d data-parallel)", variant, dist.sp_size,
             dist.dp_size)


def _set_adaln_kernels(device: torch.device, enable_modulate_kernel: bool, enable_layernorm_kernel: bool) -> None:
    """The adaLN operators' fused Triton kernels, if asked (UserError naming the flag where Triton cannot run)."""
    if enable_modulate_kernel or enable_layernorm_kernel:
        from ditforge.ops.triton import check_triton

        try:
            check_triton(device)
        except RuntimeError as e:
            flag = "--enable_modulate_kernel" if enable_modulate_kernel else "--enable_layernorm_kernel"
            raise UserError(f"{flag}: {e}") from None
    log.info("adaLN: %s", set_kernels(enable_modulate_kernel, enable_layernorm_kernel))


def _apply_compile(model: nn.Module, blocks: list[nn.Module], mode: str | None, whole: bool) -> None:
    """``torch.compile`` in place with ``mode`` (None: the default): the whole model if ``whole``, else each block."""
    if whole:
        # A diffusers UNet or transformer: its step is bound by the host (~2,000 small ops forward, an SD UNet step
        # at 512px spent 190 ms on the host for 62 ms of kernels on an H100), and blocks compiled one by one leave
        # the glue between them eager. One graph for the whole denoiser (and, with reduce-overhead, one CUDA graph
        # for its forward and one for its backward) removes that.
        model.compile(mode=mode)
    else:
        for block in blocks:
            block.compile(mode=mode)


def _apply_ddp(model: nn.Module, dist: Dist, reduce_dtype: torch.dtype) -> DistributedDataParallel:
    """DDP around ``model``; bf16 ``reduce_dtype`` compresses the gradients' all-reduce. A model of two experts
    trained one a step (``expert_models``, ``train.experts``): the idle expert's parameters get no gradient (found
    unused each step), and the frozen weights, the same on every process and perhaps waiting in host memory, are
    left out of DDP."""
    two = len(model.expert_models()) > 1 if hasattr(model, "expert_models") else False
    if two:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [name for name, p in model.named_parameters() if not p.requires_grad])
    ddp = DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
                                  find_unused_parameters=two)
    if reduce_dtype == torch.bfloat16:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        ddp.register_comm_hook(None, bf16_compress_hook)
    return ddp


def _apply_fsdp(model: nn.Module, blocks: list[nn.Module], dist: Dist, reshard: bool, param_dtype: torch.dtype | None,
                reduce_dtype: torch.dtype, cpu_offload: bool) -> None:
    """FSDP2 ``fully_shard`` of each block, then of the root, over ``dist.shard_mesh``; ``reshard`` (fsdp,
    ZeRO-3; hsdp) frees the gathered parameters after the forward, else (zero2) they stay through the backward.
    Under hsdp the mesh is 2-D (``dp_replicate``, ``dp_shard``): FSDP2's HSDP, each parameter ``Replicate()`` over
    the copies and ``Shard(0)`` within one; the gradients are reduce-scattered within a copy, then all-reduced
    across the copies (the only traffic between nodes). A denoiser of two experts: each expert's parameters
    outside its blocks one unit more, and each one's blocks prefetched among themselves alone."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=dist.device.type == "cuda") if cpu_offload else OffloadPolicy()
    # Two experts (an adapter's ``expert_models``, called one at a time): each one's blocks a chain of their own, so
    # that a backward through one expert never prefetches the other's (the idle expert's units are never gathered).
    experts = model.expert_models() if isinstance(model, DiffusersDenoiser) else []
    chains = [blocks]
    if len(experts) > 1:
        chains = [[b for b in blocks if any(b is m for m in expert.modules())] for expert in experts]
    for chain in chains:
        for i, block in enumerate(chain):
            # The last block is the first one the backward needs: resharding it would only gather it again.
            fully_shard(block, mesh=dist.shard_mesh, reshard_after_forward=reshard and i < len(chain) - 1,
                        mp_policy=mp, offload_policy=offload)
        if reshard:  # gather two blocks ahead in the backward, so each gather hides behind more compute
            for i, block in enumerate(chain):
                block.set_modules_to_backward_prefetch(chain[max(0, i - 2) : i][::-1])
    # Each expert's own parameters (embedders, final layer) a unit of its own, gathered only for its calls.
    for expert in experts if len(experts) > 1 else ():
        fully_shard(expert, mesh=dist.shard_mesh, reshard_after_forward=reshard, mp_policy=mp,
                    offload_policy=offload)
    # The root's own parameters (embedders, final layer) are used last in the forward: keep them.
    fully_shard(model, mesh=dist.shard_mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)


@torch.no_grad()
def init_sharded(model: nn.Module, skeleton: nn.Module, dist: Dist) -> None:
    """Materialise and initialise a model that ``parallelize`` sharded on the meta device (zero2 / fsdp), as
    torchtitan does (``to_empty``, then initialise), without the model ever being whole on a device: each
    process initialises ``skeleton`` (an unsharded meta copy of the model, ``initialize_weights``) one block at a
    time on its device, copies its own shard of each block (``parallel.tensor.local_part``: the tensor-parallel
    slice, then FSDP2's ``torch.chunk`` along dim 0) into the model's DTensors and frees the block before the next.
    Every process makes the same draws, so the shards are those of the single-process model built after the same
    seed (tested: 2 processes equal 1)."""
    model.to_empty(device=dist.device)
    targets = {canonical_name(n): p for n, p in model.named_parameters()}

    def copy(named) -> None:  # (name, full tensor) pairs of the skeleton
        for name, full in named:
            target = targets[name]
            if isinstance(target, DTensor):
                target.to_local().copy_(local_part(name, full, target))
            else:
                target.copy_(full)

    index = {id(block): i for i, block in enumerate(skeleton.blocks)}

    def block_ready(block: nn.Module) -> None:
        copy(block.named_parameters(prefix=f"blocks.{index[id(block)]}"))
        block.to_empty(device="meta")  # its shard is copied: the full block is not needed any more

    skeleton.initialize_weights(dist.device, block_ready)
    copy((n, p) for n, p in skeleton.named_parameters() if not n.startswith("blocks."))
    skeleton.to_empty(device="meta")


def squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the tensors' squared L2 norms, a 0-dim fp32 tensor on their device (one multi-tensor norm on a GPU;
    on the CPU one BLAS dot product per tensor: over a 2.6B UNet's 10 GB of host gradients on an H100 machine's 16
    cores, torch 2.11's CPU norm took 1.13 s and the dot products 0.23 s,
    benchmarks/results/lowmem/host_step_h100.txt)."""
    if tensors[0].device.type == "cpu":
        return torch.stack([torch.dot(t.reshape(-1), t.reshape(-1)) for t in tensors]).float().sum()
    return torch.stack(torch._foreach_norm(tensors, 2.0)).float().pow(2).sum()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that clips gradients of global norm ``norm`` to at most ``max_norm``: min(1, max_norm / (norm +
    1e-6)), torch.nn.utils.clip_grad_norm_'s formula; a 0-dim tensor on ``norm``'s device."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module | list[nn.Parameter], max_norm: float, dist: Dist) -> torch.Tensor:
    """Scale the gradients of ``model``'s parameters (or of the parameters listed: one network of several on one
    module, as distillation's adapters) so that their global L2 norm is at most ``max_norm``; returns the norm
    before (0-dim fp32).

    Under zero2/fsdp or tensor parallelism gradients are DTensor shards: the squared norms of the local shards
    are summed and all-reduced once, instead of one reduction per parameter as a DTensor-generic clip does
    (torchtitan does the same). A gradient that several processes hold alike (replicated over ``tp``, or every
    plain gradient beside DTensors) counts once: weighted by 1 / its copies. Under DDP or one process the
    gradients are whole and identical on every rank. ``max_norm`` <= 0 only measures.
    """
    params = model.parameters() if isinstance(model, nn.Module) else model
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if not any(isinstance(g, DTensor) for g in grads):
        squares = squared_norm(local)
    else:
        by_copies: dict[int, list[torch.Tensor]] = {}
        for g, t in zip(grads, local):
            by_copies.setdefault(dist.world_size // _shards(g), []).append(t)
        # host shards (--cpu_offload all) reduce on the process group's device
        squares = sum(squared_norm(ts).to(dist.device) / copies for copies, ts in by_copies.items())
        torch.distributed.all_reduce(squares)
    total = squares.sqrt()
    if max_norm > 0:
        torch._foreach_mul_(local, clip_coefficient(total, max_norm).to(local[0].device))
    return total


def _shards(t: torch.Tensor) -> int:
    """Into how many pieces a DTensor is cut (the product of its sharded mesh dimensions); 1 for a plain tensor."""
    if not isinstance(t, DTensor):
        return 1
    sizes = [t.device_mesh.size(i) for i, p in enumerate(t.placements) if not (p.is_replicate() or p.is_partial())]
    return math.prod(sizes)


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 modules are the model itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient reduction on all but the last micro-batch of an accumulated step."""
    if enabled:
        return contextlib.nullcontext()
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if isinstance(model, FSDPModule):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
