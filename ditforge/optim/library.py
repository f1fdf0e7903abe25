"""``--optimizer adamw4bit | adamw_fp8 | adafactor`` are the libraries' optimizers, whole (``library_optimizer``),
stepped after the backward: nothing of ours but the choice. adamw4bit and adamw_fp8 are torchao's ``AdamW4bit``
(Li et al. 2023, "Memory Efficient Optimizers with 4-bit States": both moments as 4-bit codes in blocks of 128,
1 byte per parameter with the scales) and ``AdamWFp8`` (both moments as float8 e4m3 in blocks of 256: 2 bytes);
bitsandbytes has neither. adafactor is torch's ``Adafactor`` (Shazeer & Stern 2018, "Adafactor: Adaptive Learning
Rates with Sublinear Memory Cost", Algorithm 4 without momentum: a matrix keeps one row and one column of second
moments, so its state is O(rows + columns), not O(rows x columns)); ``--lr`` is then its maximum relative step size.
"""

from __future__ import annotations

import torch
from torch import nn

from ditforge.errors import UserError


def library_optimizer(params: list[nn.Parameter], optimizer: str, lr: float, weight_decay: float,
                      betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """The maintained library's optimizer for ``--optimizer adamw4bit | adamw_fp8 | adafactor`` (module
    docstring), over fp32 parameters: torchao's ``AdamW4bit`` / ``AdamWFp8`` (``betas``, eps 1e-8) or
    ``torch.optim.Adafactor`` (its defaults: beta2 decay -0.8, eps (dtype eps, 1e-3), update clipping d = 1).
    torchao keeps each group's lr as a 0-dim tensor (``set_lr``). torchao's own bf16 stochastic rounding is not
    offered (``config.checks.validate``): it draws from the global generator, and its unquantized small tensors would
    keep bf16 moments.

    Raises:
        UserError: torchao is not installed.
    """
    if optimizer == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay)
    try:
        from torchao.optim import AdamW4bit, AdamWFp8
    except ImportError:
        raise UserError(f"--optimizer {optimizer} needs torchao: pip install 'ditforge[lowmem]'") from None
    kind = AdamW4bit if optimizer == "adamw4bit" else AdamWFp8
    return kind(params, lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate to ``lr``: in place where a group keeps it as a tensor (torchao's low-bit
    AdamW, whose compiled step would otherwise recompile for each new value), else as a number."""
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
