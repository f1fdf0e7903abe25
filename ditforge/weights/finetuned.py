"""A fine-tuned model back from its run: DiT weights into ditforge's own DiT (``--init_from``: the label table
resized, the position table rebuilt), a fine-tuned pipeline's denoiser, and a DiT LoRA run merged into a plain DiT.
Nothing is downloaded: pipelines load with ``from_pretrained(folder, local_files_only=True)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ditforge.errors import UserError
from ditforge.models.adapters import DiffusersDenoiser
from ditforge.models.adapters.pipeline import FLAG, Pretrained, encoder_dtype, load_pretrained
from ditforge.models.adapters.single_file import component_files
from ditforge.weights.lora import add_lora_to_denoiser, merge_lora, train_text_encoder


def resize_label_table(table: torch.Tensor, num_classes: int, null_row: bool = True,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """A DiT label-embedding table (K_old + 1, D) (the last row the null label) for ``num_classes`` K classes:
    (K + 1, D) with ``null_row`` (a model trained with label dropout), else (K, D).

    Rule: rows 0 .. min(K, K_old) - 1 keep their class's embedding; classes beyond K_old get fresh rows drawn
    from N(0, 0.02^2) (DiT's initialisation of the table, ``initialize_weights`` in facebookresearch/DiT); the
    null row moves to index K and keeps its trained value (guidance keeps working from step 0).
    """
    old = table.shape[0] - 1
    out = torch.empty((num_classes + int(null_row), table.shape[1]), dtype=table.dtype)
    keep = min(num_classes, old)
    out[:keep] = table[:keep]
    if num_classes > old:
        out[old:num_classes] = torch.randn((num_classes - old, table.shape[1]), generator=generator) * 0.02
    if null_row:
        out[num_classes] = table[old]
    return out


def load_dit_weights(model: nn.Module, state: dict[str, torch.Tensor], seed: int = 0) -> list[str]:
    """Copy DiT weights (official layout) into ``model`` for fine-tuning: the label table is resized to the
    model's class count (``resize_label_table``); the fixed sin-cos position table is left as the model built it
    when the input size differs (it is a function of the grid, not learned). Returns the keys that were adapted.

    Raises:
        UserError: any other tensor whose shape differs (another depth, width, patch or channel count).
    """
    own = model.state_dict()
    adapted = []
    state = dict(state)
    key = "y_embedder.embedding_table.weight"
    if key in state and key in own and state[key].shape != own[key].shape:
        null_row = model.y_embedder.dropout_prob > 0
        state[key] = resize_label_table(state[key], model.num_classes, null_row, torch.Generator().manual_seed(seed))
        adapted.append(key)
    if "pos_embed" in state and state["pos_embed"].shape != own["pos_embed"].shape:
        state["pos_embed"] = own["pos_embed"]
        adapted.append("pos_embed")
    for k, v in state.items():
        if k in own and own[k].shape != v.shape:
            raise UserError(f"{FLAG}: {k} has shape {tuple(v.shape)} in the weights, {tuple(own[k].shape)} in the "
                            "model (another DiT size, patch or channel count)")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"{FLAG}: the weights do not fit the model (missing {', '.join(missing[:3]) or '-'}; "
                        f"unexpected {', '.join(unexpected[:3]) or '-'})")
    return adapted


def read_dit_init(cfg) -> tuple[dict[str, torch.Tensor] | Path, dict]:
    """DiT weights for ``--init_from`` (an official ``.pt``, a ``DiTPipeline`` folder, or a ditforge run, checkpoint
    or ``.safetensors`` export, as ``ditforge sample --ckpt`` reads them) and their model settings, checked against
    the flags of ``cfg`` (a ``RunConfig``, read only); ``dit_settings`` gives what they fill in.

    Returns:
        (state dict, or a DCP checkpoint folder for ``dit_init_weights``; the settings).

    Raises:
        UserError: unreadable weights; a checkpoint of a fine-tuned pipeline (another family); ``--model``,
            ``--condition`` or ``--depth`` other than the weights'.
    """
    from ditforge.models import infer_dit_config
    from ditforge.weights.read import load_weights

    m = cfg.model
    try:
        state, config = load_weights(m.init_from)
        spec = dict(config["model"]) if config else infer_dit_config(state)
    except UserError as e:
        raise UserError(str(e).replace("--ckpt", FLAG, 1)) from None
    if spec.get("family"):
        raise UserError(f"{FLAG} {m.init_from}: a checkpoint of a fine-tuned {spec['family']} pipeline, not a DiT; "
                        "continue it with --resume, or start from its `ditforge export --format diffusers` folder")
    if m.model not in (None, spec["model"]):
        raise UserError(f"--model {m.model}: {FLAG} {m.init_from} holds a {spec['model']}; leave --model out")
    cond = spec.get("condition") or "class"
    if m.condition not in ("auto", cond):
        raise UserError(f"--condition {m.condition}: {FLAG} {m.init_from} is {cond}-conditioned")
    if m.depth not in (None, spec.get("depth")):
        raise UserError(f"--depth {m.depth}: {FLAG} {m.init_from} has {spec.get('depth') or 'its size'}'s blocks; "
                        "leave --depth out")
    return state, spec


def dit_settings(spec: dict, m) -> dict[str, Any]:
    """The run's model settings that ``read_dit_init``'s ``spec`` decides, given the flags of ``m`` (a
    ``ModelConfig``, read only): model name, learned sigma, QK-norm, condition and depth; the text encoder and
    its length where the flags leave them; the VAE where ``--vae`` is none. Keys ``"model.<field>"``
    (``config.sections.assign``)."""
    cond = spec.get("condition") or "class"
    found = {"model.model": spec["model"], "model.learn_sigma": spec["learn_sigma"],
             "model.qk_norm": spec.get("qk_norm", False), "model.condition": cond, "model.depth": spec.get("depth")}
    if cond == "text":
        found["model.text_encoder"] = m.text_encoder or spec.get("text_encoder")
        found["model.text_max_length"] = m.text_max_length or spec.get("text_max_length")
    if m.vae == "none" and spec.get("vae") not in (None, "none"):
        found["model.vae"] = spec["vae"]
    return found


def dit_init_weights(dit_init: tuple[dict | Path, dict], cfg) -> dict[str, torch.Tensor]:
    """The state dict of ``read_dit_init``'s weights (a DCP checkpoint's EMA, read into a model of the checkpoint's
    own settings), after checking their input channels against the run's.

    Raises:
        UserError: the weights take other input channels than the data (through ``--vae``) gives.
    """
    from ditforge.models import create_model_from_spec
    from ditforge.weights.read import read_checkpoint_weights

    state, spec = dit_init
    if spec["in_channels"] != cfg.model.in_channels:
        raise UserError(f"{FLAG} {cfg.model.init_from}: the weights take {spec['in_channels']} input channels, the "
                        f"data gives {cfg.model.in_channels} (--vae {cfg.model.vae})")
    if isinstance(state, Path):
        skeleton = create_model_from_spec(spec)
        state = read_checkpoint_weights(state, skeleton.state_dict())
    return state


def load_finetuned(state: dict[str, torch.Tensor] | Path, config: dict, device: torch.device,
                   use_ema: bool = True, flag: str = "--ckpt", denoiser_device: torch.device | None = None
                   ) -> tuple[Pretrained, DiffusersDenoiser, Any]:
    """A fine-tuned pipeline back from its run: the ``--init_from`` folder loaded again, the run's LoRA adapters
    injected, and the checkpoint's EMA (or raw) weights loaded into the denoiser (the adapters alone for LoRA).
    Returns (the pipeline, the denoiser in eval mode on ``denoiser_device`` (default ``device``; the CPU for
    ``ditforge sample --plugin fsdp``, which shards it from there), the run's ``RunConfig``).

    Args:
        state: a DCP checkpoint folder, or a state dict (``load_weights``); config: the run's config dict.

    Raises:
        UserError: the ``--init_from`` folder is gone or incomplete; weights that do not fit it.
    """
    from ditforge.config.load import build_config
    from ditforge.weights.read import read_checkpoint_weights

    cfg = build_config(base=config)
    pre = load_pretrained(cfg.model.init_from, device, encoder_dtype(device), flag=f"{flag} (the run's --init_from)",
                          denoiser_device=denoiser_device, expert=cfg.model.expert, files=component_files(cfg.model))
    denoiser = pre.denoiser
    if cfg.model.train_text_encoder:
        train_text_encoder(denoiser, pre.pipe.text_encoder, pre.pipe, cfg)
    if cfg.model.lora_rank:
        add_lora_to_denoiser(denoiser, cfg)
    # What the checkpoint's EMA holds: the parameters (buffers are the folder's), for LoRA the adapters alone.
    names = {n for n, p in denoiser.named_parameters() if p.requires_grad}
    trainable = {k: v for k, v in denoiser.state_dict().items() if k in names}
    weights = read_checkpoint_weights(state, trainable, use_ema) if isinstance(state, Path) else state
    missing = names - set(weights)
    unexpected = set(weights) - names
    if missing or unexpected:
        raise UserError(f"{flag}: the checkpoint does not fit {cfg.model.init_from} (missing "
                        f"{', '.join(sorted(missing)[:3]) or '-'}; unexpected {', '.join(sorted(unexpected)[:3]) or '-'})")
    denoiser.load_state_dict(weights, strict=False)
    return pre, denoiser.to(denoiser_device or device).eval(), cfg


def load_dit_lora(model: nn.Module, run_config: dict, state: dict[str, torch.Tensor] | Path,
                  use_ema: bool = True, flag: str = "--ckpt") -> nn.Module:
    """A DiT LoRA run back as a plain DiT: ``model`` (built from the run's settings) gets the ``--init_from``
    weights as the run started from them, the run's adapters (and label table) from the checkpoint, and the
    adapters merged into the weights. Returns ``model``.

    Raises:
        UserError: the ``--init_from`` weights are gone, or the checkpoint does not fit them.
    """
    from ditforge.config.load import build_config
    from ditforge.weights.read import read_checkpoint_weights

    cfg = build_config(base=run_config)
    load_dit_weights(model, dit_init_weights(read_dit_init(cfg), cfg), cfg.train.seed)
    add_lora_to_denoiser(model, cfg)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    trainable = {k: v for k, v in model.state_dict().items() if k in names}
    weights = read_checkpoint_weights(state, trainable, use_ema) if isinstance(state, Path) else state
    if set(weights) != names:
        raise UserError(f"{flag}: the checkpoint's adapters do not fit {cfg.model.init_from} (expected "
                        f"{len(names)} LoRA tensors, got {len(weights)})")
    model.load_state_dict(weights, strict=False)
    return merge_lora(model)
