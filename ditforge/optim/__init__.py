"""Memory of training: the optimizer's placement and precision: fp32, Kahan-compensated or stochastically rounded
bf16 weights, fp32 or 8-bit AdamW states, and the optimizer step fused into the backward. ``compensated.py``
(``CompensatedAdamW``), ``library.py`` (the libraries' optimizers, ``set_lr``), ``skip.py`` (a non-finite step
skipped on the device), ``backward.py`` (``StepInBackward``), ``placement.py`` (the GPU memory cap and the placement
under ``--gpu_memory_budget``).

``build_optimizer`` picks one of:
  * ``--optimizer adamw --master_weights fp32`` (the default): ``torch.optim.AdamW`` (fused: CUDA and CPU) over fp32
    parameters; 16 bytes per trainable parameter (weights, gradients, two moments) before the EMA.
  * ``CompensatedAdamW`` for everything else: AdamW with the moments in fp32 or as bitsandbytes' 8-bit blockwise
    codes (``--optimizer adamw8bit``: Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization";
    blocks of 256, the dynamic signed map for the first moment and the unsigned one for the second, tensors under
    4,096 elements kept in fp32 as bitsandbytes does), over fp32 parameters or bf16 parameters with a bf16 Kahan
    compensation buffer (``--master_weights bf16``). bf16 weights + compensation + bf16 gradients + 8-bit moments
    take 8 bytes per parameter instead of 16; ``--master_weights bf16_sr`` (stochastic rounding, no compensation)
    6; with ``--fused_backward_pass`` (``StepInBackward``) the gradients live one block at a time: 4.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ditforge.config.sections import LIBRARY_OPTIMIZERS, OPTIMIZERS
from ditforge.errors import UserError
from ditforge.ops.fused_adamw import on_gpu_with_triton
from ditforge.optim.compensated import CompensatedAdamW, _sharded_by_rows
from ditforge.optim.library import library_optimizer
from ditforge.parallel.offload import DelayedAdamW


def build_optimizer(params: list[nn.Parameter], optimizer: str, lr: float, weight_decay: float,
                    device: torch.device, master_weights: str = "fp32",
                    in_backward: bool = False, fused: bool = True, offload: str = "none",
                    delayed_update: bool = False, betas: tuple[float, float] = (0.9, 0.999)
                    ) -> torch.optim.Optimizer:
    """The optimizer for ``--optimizer`` over ``params`` (bf16 ones take their updates as ``master_weights``
    says: ``bf16`` Kahan-compensated, ``bf16_sr`` stochastically rounded): ``CompensatedAdamW`` with the one-pass
    Triton step where ``fused`` (``--fused_optimizer auto``) and it runs (a CUDA device; fully_shard's DTensors
    stepped shard by shard, not tensor parallelism's); otherwise ``torch.optim.AdamW`` (fused, CUDA and CPU) for ``adamw`` over fp32
    weights stepped after the backward, else ``CompensatedAdamW`` with the libraries' kernels;
    ``LIBRARY_OPTIMIZERS``: the library's own (``library_optimizer``; ``config.checks.validate`` keeps them to the step
    after the backward). ``betas`` (default (0.9, 0.999): DiT's and diffusers' training scripts'; adafactor keeps
    no first moment and takes none), eps 1e-8. ``offload``
    ``optimizer`` (``--cpu_offload optimizer``): the states in pinned host memory; ``all``: the parameters are
    FSDP2's host shards, stepped by torch's fused AdamW on the CPU (``DelayedAdamW`` with ``delayed_update``).

    Raises:
        UserError: an unknown ``optimizer``, ``adamw8bit`` without bitsandbytes, adamw4bit / adamw_fp8 without
            torchao, or ``offload`` where the one-pass
            step does not run.
    """
    if optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer: expected one of {', '.join(OPTIMIZERS)}, got {optimizer}")
    if optimizer in LIBRARY_OPTIMIZERS:
        return library_optimizer(params, optimizer, lr, weight_decay, betas)
    if offload == "all":  # ZeRO-Offload's CPU step, with torch's fused (vectorised, multi-threaded) CPU kernel
        kind = DelayedAdamW if delayed_update else functools.partial(torch.optim.AdamW, fused=True)
        return kind(params, lr=lr, weight_decay=weight_decay, betas=betas)
    fused = fused and on_gpu_with_triton(device) and all(_sharded_by_rows(p) for p in params)
    if offload == "optimizer" and not fused:
        raise UserError(f"--cpu_offload optimizer: needs the one-pass optimizer step (a CUDA GPU with Triton, "
                        f"--fused_optimizer auto, --plugin none or ddp); here the device is {device}")
    if not fused and optimizer == "adamw" and not in_backward and all(p.dtype == torch.float32 for p in params):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas,
                                 fused=device.type in ("cuda", "cpu"))
    return CompensatedAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                            states="8bit" if optimizer == "adamw8bit" else "fp32",
                            rounding="stochastic" if master_weights == "bf16_sr" else "kahan", fused=fused,
                            offload=offload == "optimizer")
