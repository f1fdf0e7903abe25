"""The GPU memory cap, and the optimizer's placement under ``--gpu_memory_budget``: the bytes each placement
keeps on the GPU, the fastest one that fits, and the states kept on the device once the first steps' peak is
measured."""

from __future__ import annotations

import math

import torch

from ditforge.errors import UserError
from ditforge.parallel.offload import RING_BYTES


RESIDENCY_MARGIN = 2**28  # bytes under the budget left free beyond the measured peak (at least; or 5% of it)


def keep_states_within(optimizer: torch.optim.Optimizer, budget: int, device: torch.device) -> tuple[int, int]:
    """Measured placement for ``--gpu_memory_budget`` with ``--cpu_offload optimizer``, called after the first
    steps (their compilation, CUDA graph pools and every transient included): the GPU memory the caching
    allocator has reserved at its peak so far is measured, and the optimizer states that fit in what the budget
    leaves, less ``max(RESIDENCY_MARGIN, budget / 20)``, move to the GPU (``CompensatedAdamW.keep_on_device``);
    the rest keep streaming. Returns (bytes moved, the measured peak in bytes)."""
    peak = torch.cuda.max_memory_reserved(device)
    spare = budget - peak - max(RESIDENCY_MARGIN, budget // 20)
    return (optimizer.keep_on_device(spare) if spare > 0 else 0), peak


def cap_gpu_memory(budget: int | None, device: torch.device) -> None:
    """Cap this process's GPU memory at ``budget`` bytes, as a GPU of that size would
    (``torch.cuda.set_per_process_memory_fraction``; allocations beyond it raise ``torch.OutOfMemoryError``); None
    lifts the cap. The CUDA context (about 0.5 GiB) is outside the cap, as it is outside a smaller card's free
    memory."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if budget is None else min(1.0, budget / total), index)


def out_of_memory(step: int, budget: str | None, device: torch.device) -> UserError:
    """The one-line error for an out-of-memory at ``step``: the cap, the peak, and the flags that save memory."""
    where = f"--gpu_memory_budget {budget}" if budget else "the GPU's memory"
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return UserError(f"out of memory at step {step}: {where} (peak {peak:.2f} GiB allocated); save memory with "
                     "--optimizer adamw8bit, --master_weights bf16_sr, --fused_backward_pass, --cpu_offload "
                     "optimizer, --ema_decay 0, --grad_checkpoint, --offload_activations, --lora_rank or a smaller "
                     "--batch_size")


# Placements from fastest to smallest: (--optimizer, --master_weights, --fused_backward_pass, --cpu_offload).
PLACEMENTS = (("adamw", "fp32", False, "none"), ("adamw8bit", "fp32", False, "none"),
              ("adamw8bit", "bf16", False, "none"), ("adamw8bit", "bf16_sr", False, "none"),
              ("adamw8bit", "bf16_sr", True, "none"), ("adamw8bit", "bf16_sr", True, "optimizer"))
STATE_BYTES = {"adamw": 8, "adamw8bit": 2, "adamw4bit": 1, "adamw_fp8": 2, "adafactor": 0}  # moments per parameter
ACTIVATION_RESERVE = 2**29  # 0.5 GiB kept free for activations, workspaces and the step's transient buffers


def bytes_per_parameter(optimizer: str, master_weights: str, fused_backward_pass: bool, cpu_offload: str) -> int:
    """GPU bytes per trainable parameter, as CompensatedAdamW and torch's AdamW allocate them: the weight (4 fp32,
    2 bf16), its gradient (as the weight; none with the fused backward pass, where only one block's gradients
    exist at a time), the moments (``STATE_BYTES``: 8 fp32, 2 as 8-bit codes or fp8, 1 as 4-bit codes, about 0 for
    Adafactor's factored second moments; scales not counted) and Kahan's bf16 compensation (2), these two on the
    host with ``cpu_offload`` "optimizer" (the ring is a fixed ``RING_BYTES``); none with "all", where all of them
    live on the host and each block's weights visit the GPU for its forward and backward."""
    if cpu_offload == "all":
        return 0
    weight = 4 if master_weights == "fp32" else 2
    states = STATE_BYTES[optimizer] + (2 if master_weights == "bf16" else 0)
    return weight + (0 if fused_backward_pass else weight) + (0 if cpu_offload == "optimizer" else states)


def state_bytes(trainable: int, frozen_bytes: int, placement: tuple[str, str, bool, str], ema: bool) -> int:
    """GPU bytes of the training state: ``trainable`` parameters under ``placement`` (``bytes_per_parameter``), the
    fp32 EMA (4 bytes each) when kept, ``frozen_bytes`` of frozen weights and the offload ring. Activations not
    included. With ``--cpu_offload all`` the EMA and the frozen weights are host shards too."""
    if placement[3] == "all":
        return 0
    ring = RING_BYTES if placement[3] == "optimizer" else 0
    return trainable * (bytes_per_parameter(*placement) + 4 * ema) + frozen_bytes + ring


def plan_placement(budget: int, trainable: int, frozen_bytes: int, ema: bool, placement: tuple[str, str, bool, str],
                   bf16: bool, lowmem: bool = True, fused_ok: bool = True, offload_ok: bool = True
                   ) -> tuple[str, str, bool, str]:
    """The placement (--optimizer, --master_weights, --fused_backward_pass, --cpu_offload) for
    ``--gpu_memory_budget``: the given one if its state (``state_bytes``) plus 0.5 GiB for activations fits
    ``budget``; otherwise, when the flags were left at their defaults, the fastest of ``PLACEMENTS`` that fits
    (bf16 weights only with ``bf16`` compute; ``lowmem``: CompensatedAdamW's placements allowed, i.e. plugin none
    or ddp; ``fused_ok``: the fused backward pass allowed, i.e. one process without fp16; ``offload_ok``: the
    one-pass optimizer step runs, which offload needs). Activations beyond the reserve are the user's
    (``--grad_checkpoint``, ``--batch_size``); an out-of-memory during training says so. The count is one
    process's whole state (DDP's gradient buckets and sample grids not included).

    Raises:
        UserError: nothing fits; the line names the smallest budget that would hold the state.
    """
    gib = 2**30
    chosen = [placement]
    if placement == PLACEMENTS[0]:
        chosen = [p for p in PLACEMENTS if (bf16 or p[1] == "fp32") and (lowmem or p == PLACEMENTS[0])
                  and (fused_ok or not p[2]) and (offload_ok or p[3] == "none")]
    for p in chosen:
        if state_bytes(trainable, frozen_bytes, p, ema) + ACTIVATION_RESERVE <= budget:
            return p
    opt, master, fused, offload = chosen[-1]
    need = state_bytes(trainable, frozen_bytes, chosen[-1], ema) + ACTIVATION_RESERVE
    ema = ema and offload != "all"  # on the host too
    hint = "" if offload == "all" else ("; --ema_decay 0 drops the EMA's 4 bytes per parameter" if ema else "") + \
        "; --cpu_offload all keeps all of it in host memory"
    raise UserError(f"--gpu_memory_budget {budget / gib:.2f} GiB: {trainable / 1e6:.0f}M trainable parameters "
                    f"with --optimizer {opt} --master_weights {master}{' --fused_backward_pass' if fused else ''}"
                    f"{' --cpu_offload ' + offload if offload != 'none' else ''}{' and an EMA' if ema else ''} need "
                    f"{math.ceil(need / gib * 100) / 100:.2f} GiB (state + 0.5 GiB for activations); give at least "
                    f"that{hint}")
