"""Model registry: the paper's DiT configurations by name, and ``create_model``."""

from __future__ import annotations

import re

from torch import nn

from ditforge.errors import UserError
from ditforge.models.dit import DiT

# (depth, hidden_size, num_heads), from Table 1 of Peebles & Xie 2023. "T" (tiny) is ours, for CPU runs.
DIT_SIZES = {
    "T": (6, 192, 3),
    "S": (12, 384, 6),
    "B": (12, 768, 12),
    "L": (24, 1024, 16),
    "XL": (28, 1152, 16),
}
PATCH_SIZES = (1, 2, 4, 8)
MODEL_NAMES = [f"DiT-{s}/{p}" for s in DIT_SIZES for p in PATCH_SIZES]
_NAME = re.compile(r"^DiT-(T|S|B|L|XL)/(\d+)$")


def model_spec(name: str) -> dict:
    """Keyword arguments of ``DiT`` for a registered name such as ``"DiT-XL/2"``.

    Raises:
        UserError: unknown name (the message lists the known ones).
    """
    m = _NAME.match(name)
    if not m or int(m.group(2)) not in PATCH_SIZES:
        raise UserError(f"--model: unknown model {name!r}; expected one of {', '.join(MODEL_NAMES)}")
    depth, hidden, heads = DIT_SIZES[m.group(1)]
    return dict(depth=depth, hidden_size=hidden, num_heads=heads, patch_size=int(m.group(2)))


def create_model(
    name: str,
    input_size: int,
    in_channels: int,
    num_classes: int,
    learn_sigma: bool = True,
    class_dropout_prob: float = 0.1,
) -> nn.Module:
    """Build a registered DiT.

    Args:
        name: e.g. ``"DiT-XL/2"`` (sizes T, S, B, L, XL; patch 1, 2, 4, 8).
        input_size: spatial size of the (latent or pixel) input, divisible by the patch size.
        in_channels: input channels C; the output has 2C channels when ``learn_sigma``.
        num_classes: number of class labels (the null label is ``num_classes``).

    Returns:
        A ``DiT`` in fp32 on the CPU, initialised as the reference code does.

    Raises:
        UserError: unknown name, or an input size the patch size does not divide.
    """
    spec = model_spec(name)
    if input_size % spec["patch_size"]:
        raise UserError(f"--image_size: input size {input_size} is not divisible by the patch size of {name}")
    return DiT(
        input_size=input_size,
        in_channels=in_channels,
        num_classes=num_classes,
        learn_sigma=learn_sigma,
        class_dropout_prob=class_dropout_prob,
        **spec,
    )


__all__ = ["DiT", "create_model", "model_spec", "infer_dit_config", "MODEL_NAMES"]


def infer_dit_config(state_dict: dict) -> dict:
    """Recover ``create_model`` arguments from an official-layout DiT state dict (e.g. DiT-XL-2-256x256.pt).

    Shapes give depth, width, patch, channels, classes, learned sigma and input size; the head count (which
    no shape shows) comes from the registered size with that depth and width.

    Returns:
        dict(model, input_size, in_channels, num_classes, learn_sigma, class_dropout_prob).

    Raises:
        UserError: not a DiT state dict, or a depth/width that no registered size has.
    """
    try:
        proj = state_dict["x_embedder.proj.weight"]
        hidden, in_channels, patch = proj.shape[0], proj.shape[1], proj.shape[2]
        depth = len({k.split(".")[1] for k in state_dict if k.startswith("blocks.")})
        table_rows = state_dict["y_embedder.embedding_table.weight"].shape[0]
        out_channels = state_dict["final_layer.linear.weight"].shape[0] // (patch * patch)
        grid = int(round(state_dict["pos_embed"].shape[1] ** 0.5))
    except (KeyError, IndexError, AttributeError):
        raise UserError("--ckpt: not a DiT state dict (official key names such as x_embedder.proj.weight)") from None
    sizes = [s for s, (d, h, _) in DIT_SIZES.items() if (d, h) == (depth, hidden)]
    if not sizes:
        raise UserError(f"--ckpt: no registered DiT has depth {depth} and width {hidden}; pass --model")
    learn_sigma = out_channels == 2 * in_channels
    # A table with one row more than the classes has the null label (trained with label dropout).
    num_classes = table_rows - 1
    return dict(model=f"DiT-{sizes[0]}/{patch}", input_size=grid * patch, in_channels=in_channels,
                num_classes=num_classes, learn_sigma=learn_sigma, class_dropout_prob=0.1)
