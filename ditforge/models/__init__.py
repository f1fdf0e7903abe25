"""Model registry: the paper's DiT configurations, OpenDiT's video DiT (vDiT) and Open-Sora v1.0's STDiT by name,
and ``create_model``.

Image models ``DiT-{T,S,B,L,XL}/{p}`` take (B, C, H, W); video models ``vDiT-{T,S,B,L,XL}/{t}{h}{w}`` and
``STDiT-{T,S,B,L,XL}/{p}`` take (B, C, T, H, W) (``is_video_model`` tells them apart).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ditforge.errors import UserError
from ditforge.models.dit import DiT
from ditforge.models.video import STDiT, VideoDiT, inflate_image_state_dict

# (depth, hidden_size, num_heads), from Table 1 of Peebles & Xie 2023. "T" (tiny) is ours, for CPU runs; "7B" is
# the shape of NeMo's DiT 7B (32 layers, width 4096, 32 heads; ../shared/REFERENCES.md), for the scale benchmark:
# with DiT's per-block adaLN-Zero regressions (6 D^2 each) it has 9.7B parameters, 6.4B of them in the blocks'
# attention and MLP (the FLOPs per token are those of a 7B transformer: adaLN runs once per sample).
DIT_SIZES = {
    "T": (6, 192, 3),
    "S": (12, 384, 6),
    "B": (12, 768, 12),
    "L": (24, 1024, 16),
    "XL": (28, 1152, 16),
    "7B": (32, 4096, 32),
}
PATCH_SIZES = (1, 2, 4, 8)
# Image models, all listed; video models (5 sizes x 64 patch shapes) are described by VIDEO_MODEL_PATTERN.
MODEL_NAMES = [f"DiT-{s}/{p}" for s in DIT_SIZES for p in PATCH_SIZES]
VIDEO_MODEL_PATTERN = "vDiT-{T,S,B,L,XL,7B}/{t}{h}{w} with t, h, w each in {1,2,4,8} (e.g. vDiT-XL/222, vDiT-T/122)"
STDIT_MODEL_PATTERN = "STDiT-{T,S,B,L,XL,7B}/{p} with p in {1,2,4,8} (e.g. STDiT-XL/2; patches (1, p, p))"
_SIZE = "(" + "|".join(DIT_SIZES) + ")"
_NAME = re.compile(rf"^DiT-{_SIZE}/(\d+)$")
_VIDEO_NAME = re.compile(rf"^vDiT-{_SIZE}/([1248])([1248])([1248])$")
_STDIT_NAME = re.compile(rf"^STDiT-{_SIZE}/([1248])$")


def model_spec(name: str) -> dict:
    """Constructor keyword arguments for a registered name.

    ``"DiT-XL/2"`` -> ``dict(depth=28, hidden_size=1152, num_heads=16, patch_size=2)`` (for ``DiT``);
    ``"vDiT-XL/222"`` -> the same with ``patch_size=(2, 2, 2)``, the (t, h, w) tuple (for ``VideoDiT``);
    ``"STDiT-XL/2"`` -> the same with ``patch_size=(1, 2, 2)`` (for ``STDiT``).
    Sizes from Table 1 of Peebles & Xie 2023 (plus our tiny T); vDiT after OpenDiT, STDiT after Open-Sora v1.0.

    Raises:
        UserError: unknown name (the message lists the DiT names and the vDiT and STDiT patterns).
    """
    m = _NAME.match(name)
    if m and int(m.group(2)) in PATCH_SIZES:
        patch_size = int(m.group(2))
    elif m := _VIDEO_NAME.match(name):
        patch_size = tuple(int(g) for g in m.groups()[1:])
    elif m := _STDIT_NAME.match(name):
        patch_size = (1, int(m.group(2)), int(m.group(2)))
    else:
        raise UserError(f"--model: unknown model {name!r}; expected one of {', '.join(MODEL_NAMES)}, or "
                        f"{VIDEO_MODEL_PATTERN}, or {STDIT_MODEL_PATTERN}")
    depth, hidden, heads = DIT_SIZES[m.group(1)]
    return dict(depth=depth, hidden_size=hidden, num_heads=heads, patch_size=patch_size)


def is_video_model(name: str) -> bool:
    """True for a registered video model (``vDiT-...``, ``STDiT-...``: input (B, C, T, H, W)), False for an image
    ``DiT-...``.

    Raises:
        UserError: unknown name, as ``model_spec``.
    """
    model_spec(name)
    return _VIDEO_NAME.match(name) is not None or _STDIT_NAME.match(name) is not None


def create_model(
    name: str,
    input_size: int,
    in_channels: int,
    num_classes: int,
    learn_sigma: bool = True,
    class_dropout_prob: float = 0.1,
    num_frames: int | None = None,
    text_dim: int | None = None,
    qk_norm: bool = False,
    depth: int | None = None,
    device: torch.device | str | None = None,
    block_ready: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Build a registered DiT, vDiT or STDiT.

    ``text_dim`` (the text encoder's width) makes it text-conditioned (cross-attention to caption tokens, caption
    dropout with ``class_dropout_prob``; see ``DiT``); ``qk_norm`` normalises queries and keys.

    Args:
        name: e.g. ``"DiT-XL/2"`` (sizes T, S, B, L, XL; patch 1, 2, 4, 8), ``"vDiT-XL/222"`` (patch (t, h, w),
            each 1, 2, 4 or 8) or ``"STDiT-XL/2"`` (patch (1, p, p)).
        input_size: spatial size H = W of the (latent or pixel) input, divisible by the (spatial) patch size.
        in_channels: input channels C; the output has 2C channels when ``learn_sigma``.
        num_classes: number of class labels (the null label is ``num_classes``).
        num_frames: T of the (latent) video, divisible by t (STDiT: any positive T); required for vDiT and
            STDiT, must be None for DiT.
        depth: the number of blocks in place of the size's (``--depth``), or None.
        device: build on the meta device, then materialise and initialise there one block at a time
            (``DiT.initialize_weights``); the model never is whole in host memory, nor whole in fp32 when
            ``block_ready`` casts each block. None: the ordinary build on the current default device.
        block_ready: with ``device``, called on each block as soon as it is initialised.

    Returns:
        A ``DiT`` (or ``VideoDiT``, ``STDiT``), initialised as the reference code does: fp32 (blocks as
        ``block_ready`` left them) on ``device``, or on the current default device (the CPU unless a
        ``torch.device`` context says otherwise).

    Raises:
        UserError: unknown name (``--model``); an input size the patch size does not divide (``--image_size``);
            a missing, non-positive or indivisible frame count for vDiT or STDiT, or a frame count for DiT
            (``--num_frames``).
    """
    spec = model_spec(name)
    if depth is not None:
        spec["depth"] = depth
    common = dict(input_size=input_size, in_channels=in_channels, num_classes=num_classes, learn_sigma=learn_sigma,
                  class_dropout_prob=class_dropout_prob, text_dim=text_dim, qk_norm=qk_norm, **spec)
    if is_video_model(name):
        t, h, w = spec["patch_size"]
        if num_frames is None:
            raise UserError(f"--num_frames: {name} is a video model; give the number of (latent) frames")
        if num_frames < 1 or num_frames % t:
            raise UserError(
                f"--num_frames: {num_frames} frames are not a positive multiple of the temporal patch size {t} "
                f"of {name}"
            )
        if input_size % h or input_size % w:
            raise UserError(f"--image_size: input size {input_size} is not divisible by the patch size of {name}")
        return _materialize(lambda: (STDiT if _STDIT_NAME.match(name) else VideoDiT)(num_frames=num_frames, **common),
                            device, block_ready)
    if num_frames is not None:
        raise UserError(f"--num_frames: {name} is an image model; frames apply to video models ({VIDEO_MODEL_PATTERN}; "
                        f"{STDIT_MODEL_PATTERN})")
    if input_size % spec["patch_size"]:
        raise UserError(f"--image_size: input size {input_size} is not divisible by the patch size of {name}")
    return _materialize(lambda: DiT(**common), device, block_ready)


def create_model_from_spec(spec: dict) -> nn.Module:
    """``create_model`` from a run's saved model settings (the ``model`` section of its config, or
    ``infer_dit_config``'s dict), the optional keys defaulted as a run defaults them: one place, so that a new
    setting (such as ``depth``) reaches every model rebuilt from a checkpoint.

    Raises:
        UserError: as ``create_model``.
    """
    return create_model(spec["model"], spec["input_size"], spec["in_channels"], spec["num_classes"],
                        spec["learn_sigma"], spec.get("class_dropout_prob", 0.1), num_frames=spec.get("num_frames"),
                        text_dim=spec.get("text_dim"), qk_norm=spec.get("qk_norm", False), depth=spec.get("depth"))


def _materialize(build: Callable[[], nn.Module], device, block_ready) -> nn.Module:
    if device is None:
        return build()
    with torch.device("meta"):
        model = build()
    model.initialize_weights(device, block_ready)
    return model


def is_block(module: nn.Module, classes: Iterable[str]) -> bool:
    """Whether ``module`` is a repeated block of a diffusers model: a class in its MRO is named in ``classes`` (an
    adapter's ``block_classes`` or ``swap_classes``, diffusers' class names). By the MRO, not the class's own name:
    FSDP2's ``fully_shard`` gives a sharded block a class of its own, ``FSDP<name>``, a subclass of the block's, and
    the blocks are looked for after sharding too (the critic's ``features``); diffusers subclasses none of the named
    blocks, so on an unsharded model the two tests agree."""
    return any(c.__name__ in classes for c in type(module).__mro__)


def block_paths(model: nn.Module) -> list[str]:
    """Qualified names of a denoiser's repeated blocks, the units activation checkpointing, compile and FSDP
    wrap: ``blocks.0 .. blocks.N-1`` for ditforge's models; for an adapter of a diffusers model
    (``ditforge.models.adapters``), every outermost module that ``is_block`` of its ``block_classes``."""
    classes = getattr(model, "block_classes", None)
    if classes is None:
        return [f"blocks.{i}" for i in range(len(model.blocks))]
    paths: list[str] = []
    for name, module in model.named_modules():
        if is_block(module, classes) and not any(name.startswith(p + ".") for p in paths):
            paths.append(name)
    return paths


def replace_block(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at ``path`` (a name from ``block_paths``) in place of the block there."""
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


__all__ = [
    "block_paths",
    "is_block",
    "replace_block",
    "DiT",
    "VideoDiT",
    "STDiT",
    "inflate_image_state_dict",
    "create_model",
    "create_model_from_spec",
    "model_spec",
    "is_video_model",
    "infer_dit_config",
    "MODEL_NAMES",
    "VIDEO_MODEL_PATTERN",
    "STDIT_MODEL_PATTERN",
]


def infer_dit_config(state_dict: dict) -> dict:
    """Recover ``create_model`` arguments from an official-layout DiT state dict (e.g. DiT-XL-2-256x256.pt).

    Shapes give depth, width, patch, channels, classes, learned sigma and input size; the head count (which
    no shape shows) comes from the registered size with that depth and width.

    Returns:
        dict(model, input_size, in_channels, num_classes, learn_sigma, class_dropout_prob).

    Raises:
        UserError: not a DiT state dict, a video (vDiT or STDiT: Conv3d patch embedding) state dict, or a
            depth/width that no registered size has.
    """
    try:
        proj = state_dict["x_embedder.proj.weight"]
        if proj.dim() != 4:  # a vDiT or STDiT (Conv3d) state dict: its frames and patch shape need the run's config
            kind = "STDiT" if "pos_embed_temporal" in state_dict else "vDiT"
            raise UserError(f"--ckpt: a video ({kind}) state dict; its run's config.yaml is needed to rebuild it")
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
