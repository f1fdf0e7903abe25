"""How far two float32 AdamW implementations, run for the same steps from the same weights, may drift apart."""

import torch


def fp32_adamw_drift(z: torch.Tensor, roundings: int, steps: int, lr: float) -> torch.Tensor:
    """Per element of ``z`` (a weight, or its EMA), the worst-case difference of two float32 AdamW runs of ``steps``
    steps with learning rate ``lr`` (betas 0.9, 0.999; u = 2^-24). Each run rounds a value of size |z| ``roundings``
    times a step, by at most u |z| each (a weight: its decay and its update, 2; its EMA follows it and rounds twice
    more, 4); and their steps differ: Adam's step is at most lr (1 - beta1) / sqrt(1 - beta2) = 3.2 lr (Kingma & Ba
    2015, section 2.1), and a float32 bias correction 1 - beta2^k (the Triton kernel's exp2, torchao's power of a
    float32 step counter) is off by up to ~3u / (1 - beta2^k) <= 3000u relative, 1500u after the square root:
    1600u of the step with the other roundings."""
    u = 2.0**-24
    return steps * (2 * roundings * u * z.abs() + 3.2 * lr * 1600 * u)
