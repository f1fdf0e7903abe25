"""LoRA through peft: adapters injected into a denoiser (and into SD's text encoder, ``--train_text_encoder``),
folded into the base weights, and their weights in diffusers' naming."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ditforge.errors import UserError
from ditforge.models.adapters import DiffusersDenoiser
from ditforge.models.adapters.single_file import FP8


TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")  # CLIP's attention, as diffusers' LoRA scripts


def check_lora_targets(model: nn.Module, targets: list[str]) -> None:
    """Every target must name at least one module (``name == target`` or ``name`` ending in ``.target``, peft's
    rule for a list of names).

    Raises:
        UserError: naming ``--lora_target_modules``, the target and a few linear layers of the model.
    """
    names = [n for n, _ in model.named_modules()]
    for target in targets:
        if not any(n == target or n.endswith("." + target) for n in names):
            linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise UserError(f"--lora_target_modules: {target!r} matches no module of the denoiser (its linear "
                            f"layers are named {', '.join(linears[:12])})")


def lora_config(rank: int, alpha: float | None, targets: list[str]):
    """peft ``LoraConfig`` as diffusers' LoRA training scripts make it: Gaussian A, zero B (the adapted model
    starts equal to the base), scale alpha / rank."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, init_lora_weights="gaussian",
                      target_modules=list(targets))


def add_lora(model: nn.Module, rank: int, alpha: float | None, targets: list[str],
             adapter_name: str = "default") -> nn.Module:
    """Freeze ``model`` and inject LoRA adapters (peft ``inject_adapter_in_model``) named ``adapter_name`` into the
    modules named by ``targets``; only the adapters' A and B (float32) train. Returns ``model`` (changed in place).
    A second name adds a second adapter beside the first (``train/distill_pipeline.py``'s student and critic).

    Raises:
        UserError: a target that matches no module; peft not installed.
    """
    check_lora_targets(model, targets)
    try:
        from peft import inject_adapter_in_model
    except ImportError:
        raise UserError("--lora_rank: needs peft (pip install peft)") from None
    model.requires_grad_(False)
    # peft makes the adapters in their base weight's dtype: a float8 base (a float8 file under --fp8_base) would
    # round the initial A to 3 mantissa bits; it sees a float32 stand-in of no storage meanwhile
    fp8 = {m: m.weight.data for m in model.modules()
           if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dtype in FP8}
    for m, w in fp8.items():
        m.weight.data = torch.empty((), dtype=torch.float32, device=w.device).expand(w.shape)
    try:
        with warnings.catch_warnings():  # peft warns of a second adapter, which is what a second name asks for
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            inject_adapter_in_model(lora_config(rank, alpha, targets), model, adapter_name=adapter_name)
    finally:
        for m, w in fp8.items():
            m.weight.data = w
    for name, p in model.named_parameters():  # peft makes the adapters in the base layer's dtype: a bf16 base gives
        if p.requires_grad or f".{adapter_name}." in name and ".lora_" in name:  # bf16 ones
            p.data = p.data.float()
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter into its base layer (W + alpha/r B A) and remove the adapter layers, in place."""
    from diffusers.utils.peft_utils import recurse_remove_peft_layers
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    recurse_remove_peft_layers(model)
    return model


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights in peft's naming (``...to_q.lora_A.weight``), as diffusers' LoRA files store them."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def train_text_encoder(denoiser: DiffusersDenoiser, encoder: nn.Module, pipe, cfg) -> None:
    """``--train_text_encoder``: the pipeline's text encoder (float32) trains with the denoiser (all of it, or LoRA
    adapters on its attention projections ``TEXT_LORA_TARGETS`` with ``--lora_rank``); the conditioning becomes
    the token ids, and caption dropout the empty prompt's ids.

    Raises:
        UserError: a family whose text encoder ditforge does not train (only SD 1.x / 2.x: one CLIP), or
            features (their prompts are encoded already).
    """
    m = cfg.model
    if not denoiser.text_encoder_trainable:
        raise UserError(f"--train_text_encoder: supported for Stable Diffusion 1.x / 2.x (one CLIP encoder), not a "
                        f"{denoiser.family} pipeline")
    encoder = encoder.float().requires_grad_(True)
    denoiser.attach_text_encoder(encoder, lambda texts: denoiser.token_ids(pipe, texts))
    denoiser.set_null_condition(denoiser.tokenize([""]))
    if m.lora_rank:
        add_lora(encoder, m.lora_rank, m.lora_alpha, list(TEXT_LORA_TARGETS))


def lora_targets(model: nn.Module | None, cfg) -> str:
    """``--lora_target_modules`` resolved: the flag's modules, else ``model``'s ``default_lora_targets`` (a
    diffusers family's), else ``qkv``, ``proj`` (a DiT's attention projections); comma-separated, stripped."""
    m = cfg.model
    targets = m.lora_target_modules.split(",") if m.lora_target_modules else list(
        getattr(model, "default_lora_targets", ("qkv", "proj")))
    return ",".join(t.strip() for t in targets)


def add_lora_to_denoiser(model: nn.Module, cfg) -> None:
    """LoRA (``add_lora``) on the run's denoiser with the run's ``--lora_rank``, ``--lora_alpha`` and
    ``--lora_target_modules`` (default: the family's ``default_lora_targets``; ``qkv``, ``proj`` for a DiT, its
    attention projections; a DiT's label table trains whole beside them, as peft's ``modules_to_save``): the
    targets ``lora_targets`` gives, which a training run's resolution records in its config. A denoiser of two
    experts (``add_expert``) gets adapters in both, the first's drawn first."""
    m = cfg.model
    for inner in model.expert_models() if hasattr(model, "expert_models") else [model]:
        add_lora(inner, m.lora_rank, m.lora_alpha, lora_targets(model, cfg).split(","))
    label_table = getattr(getattr(model, "y_embedder", None), "embedding_table", None)
    if label_table is not None:  # a DiT's class table trains too: new classes have fresh rows (resize_label_table)
        label_table.requires_grad_(True)
