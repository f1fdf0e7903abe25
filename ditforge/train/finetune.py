"""Fine-tuning pretrained models: ``--init_from`` (a local diffusers pipeline folder, an official DiT ``.pt``, or a
ditforge run / checkpoint / export), LoRA through peft, DreamBooth's prior preservation, and a fine-tuned
pipeline loaded back for sampling (``ditforge.export`` writes it as a pipeline folder or a LoRA file).

Nothing is downloaded: pipelines load with ``from_pretrained(folder, local_files_only=True)``.

Families (``ditforge.models.adapters``): Stable Diffusion 1.x / 2.x, PixArt-alpha / sigma and SD3 keep diffusers'
model code behind an adapter; DiT weights (official ``.pt``, ``DiTPipeline`` folders, ditforge's own runs) load
into ditforge's ``DiT``, which is the same network in the official layout. The pipeline's scheduler config decides
the objective (``ditforge.diffusion.objective``); its VAE and text encoders encode the data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ditforge.errors import UserError
from ditforge.models.adapters import DiffusersDenoiser
from ditforge.models.adapters.pipeline import FLAG, Pretrained, encoder_dtype, load_pretrained

# ---------------------------------------------------------------------------------------------------------------
# DiT weights into ditforge's own DiT


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


# ---------------------------------------------------------------------------------------------------------------
# LoRA


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


def add_lora(model: nn.Module, rank: int, alpha: float | None, targets: list[str]) -> nn.Module:
    """Freeze ``model`` and inject LoRA adapters (peft ``inject_adapter_in_model``) into the modules named by
    ``targets``; only the adapters' A and B (float32) train. Returns ``model`` (changed in place).

    Raises:
        UserError: a target that matches no module; peft not installed.
    """
    check_lora_targets(model, targets)
    try:
        from peft import inject_adapter_in_model
    except ImportError:
        raise UserError("--lora_rank: needs peft (pip install peft)") from None
    model.requires_grad_(False)
    inject_adapter_in_model(lora_config(rank, alpha, targets), model)
    for p in model.parameters():  # peft makes the adapters in the base layer's dtype: a bf16 base gives bf16 ones
        if p.requires_grad:
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


# ---------------------------------------------------------------------------------------------------------------
# DreamBooth


def interleave_prior(batch: dict, prior_loss_weight: float) -> tuple[dict, torch.Tensor]:
    """A DreamBooth batch with class images (``x``, ``text``, ``class_x``, ``class_text``) as one batch of 2B rows,
    instance and class images alternating (row 2i instance i, row 2i + 1 its class image), and the per-row loss
    weights (1 for instance rows, ``prior_loss_weight`` for class rows).

    With the trainer's normalisation by the number of samples B, the loss is diffusers' train_dreambooth.py's
    ``mse(instance) + prior_loss_weight * mse(prior)`` (Ruiz et al. 2023, eq. 2). Alternating rows keep each
    process's slice of the global batch a whole set of pairs. The weights (2B,) float32 are made on the images'
    device (filled there: no copy from the host, which would synchronise a GPU's stream every step).
    """
    x = torch.stack([batch["x"], batch["class_x"]], dim=1).flatten(0, 1)
    texts = [t for pair in zip(batch["text"], batch["class_text"]) for t in pair]
    weights = torch.full((len(x),), float(prior_loss_weight), device=x.device)
    weights[0::2] = 1.0
    rest = {k: v for k, v in batch.items() if k not in ("x", "text", "class_x", "class_text")}
    return {**rest, "x": x, "text": texts}, weights


# ---------------------------------------------------------------------------------------------------------------
# Back to diffusers


def _component(pre: Pretrained) -> str:
    return pre.denoiser.component


def generate_with_pipeline(pre: Pretrained, denoiser: DiffusersDenoiser, prompts: list[str], seeds: list[int],
                           image_size: int, num_steps: int, guidance_scale: float,
                           batch_size: int = 8, num_frames: int | None = None, images: list | None = None
                           ) -> torch.Tensor:
    """Images for ``prompts`` from the family's own pipeline and scheduler with ``denoiser`` (an adapter of the
    fine-tuned diffusers model; its text encoder too when it trained one) in it: row i starts from the noise of
    ``torch.Generator(device).manual_seed(seeds[i])``, so it depends on its prompt and seed only. The prompts are
    encoded (``pre.encode_prompt``, or the denoiser's own text encoder) and handed over as embeddings, the empty
    prompt's as the negative ones: what the pipeline does with the prompt strings. Returns (N, 3, S, S) float32 in
    [-1, 1] on the CPU; a video family's (Wan) videos of ``num_frames`` frames, (N, 3, T, S, S). A VAE kept on
    the CPU (training from features) visits the denoiser's device meanwhile. An image-to-video family
    (``WanImageToVideoPipeline``) takes ``images``, one PIL image per prompt, passed as the pipeline's ``image``;
    its rows are drawn one per call (the pipeline takes one image a call, ``pipeline_wan_i2v.py``)."""
    pipe = pre.pipe
    setattr(pipe, _component(pre), denoiser.inner)
    device = next(denoiser.inner.parameters()).device
    vae_home = pipe.vae.device
    pipe.vae.to(device)
    out, first_images = [], images  # ``images`` is the loop's output below
    if denoiser.image_to_video:
        batch_size = 1
    try:
        for start in range(0, len(prompts), batch_size):
            rows = slice(start, start + batch_size)
            gens = [torch.Generator(device).manual_seed(int(s)) for s in seeds[rows]]
            with torch.no_grad():
                seen = {"images": [first_images[start]]} if denoiser.prompt_sees_image else {}
                cond = ({k: v.to(device) for k, v in denoiser.tokenize(prompts[rows]).items()}
                        if denoiser.tokenize is not None else pre.encode_prompt(prompts[rows], **seen))
                video = {"num_frames": num_frames} if denoiser.video else {}
                if denoiser.image_to_video:
                    video["image"] = first_images[start]
                result = pipe(num_inference_steps=num_steps, guidance_scale=guidance_scale, height=image_size,
                              width=image_size, generator=gens, output_type="pt", **denoiser.pipeline_inputs(cond),
                              **denoiser.pipeline_kwargs, **video)
                # videos come as frames (N, T, 3, S, S)
                images = result.frames.transpose(1, 2) if denoiser.video else result.images
            out.append(images.float().cpu() * 2 - 1)
    finally:
        pipe.vae.to(vae_home)
    return torch.cat(out)


def sample_grid(pre: Pretrained, cfg, weights: dict[str, torch.Tensor], dataset, denoiser=None,
                num_steps: int = 25, guidance_scale: float = 4.5, *, device: torch.device
                ) -> tuple[torch.Tensor, DiffusersDenoiser]:
    """The trainer's periodic samples of a fine-tuned pipeline: the first 8 distinct captions of the data (each
    repeated to 8 images), ``weights`` (the EMA, as ``EMA.full_state_dict``) in a second denoiser (built on the first
    call from the folder, on the run's ``device``, and passed back in later), drawn by the family's pipeline with
    per-image seeds ``derive_seed(seed, i)``. Returns ((8, 3, S, S) pixels in [-1, 1], or (8, 3, T, S, S) videos
    of ``--num_frames`` frames for a video family, the denoiser)."""
    from ditforge.data.sampler import derive_seed

    if denoiser is None:
        denoiser = fresh_denoiser(pre, cfg).to(device).eval()
    denoiser.load_state_dict(weights, strict=False)  # the EMA holds trainable parameters; the rest is the folder's
    images = None
    if denoiser.image_to_video:  # the data's first 8 clips: their captions and first frames
        items = [dataset[i % len(dataset)] for i in range(8)]
        prompts, images = [it["text"] for it in items], [first_frame_image(it) for it in items]
    else:
        captions = list(dict.fromkeys(getattr(dataset, "texts", None) or dataset.class_captions))[:8]
        prompts = (captions * 8)[:8]
    seeds = [derive_seed(cfg.train.seed, i) for i in range(len(prompts))]
    pixels = generate_with_pipeline(pre, denoiser, prompts, seeds, cfg.data.image_size, num_steps, guidance_scale,
                                    num_frames=cfg.data.num_frames, images=images)
    return pixels, denoiser


def first_frame_image(item: dict):
    """The conditioning image of a video data set's item as a PIL RGB image: its ``image`` (a video CSV's
    ``image`` column) where it has one, else the first frame of its ``video`` (3, T, S, S) in [-1, 1], as uint8
    (``data.images.to_uint8``: ``round((x + 1) * 127.5)``, a decoded frame's bytes back).

    Raises:
        UserError: an item without pixels (stored features: the trainer's periodic image-to-video samples need
            clips; pass --sample_every 0).
    """
    from PIL import Image

    from ditforge.data.images import to_uint8

    if "image" in item:
        x = item["image"]
    elif "video" in item:
        x = item["video"][:, 0]
    else:
        raise UserError("--sample_every: the periodic samples of an image-to-video run need clips, not stored "
                        "features; pass --sample_every 0")
    return Image.fromarray(to_uint8(x[None])[0])


def fresh_denoiser(pre: Pretrained, cfg) -> DiffusersDenoiser:
    """A second copy of the run's denoiser as it started: the pipeline's weights read again from its folder, with
    the run's LoRA adapters injected (their weights are then loaded by the caller)."""
    inner = type(pre.denoiser.inner).from_pretrained(str(pre.folder), subfolder=pre.denoiser.component,
                                                     local_files_only=True)
    denoiser = type(pre.denoiser)(inner, pre.denoiser.vae_scale)
    if cfg.model.train_text_encoder:
        encoder = type(pre.pipe.text_encoder).from_pretrained(str(pre.folder), subfolder="text_encoder",
                                                              local_files_only=True)
        train_text_encoder(denoiser, encoder, pre.pipe, cfg)
    else:
        denoiser.set_null_condition({k: getattr(pre.denoiser, f"null_{k}") for k in pre.denoiser.cond_keys})
    if cfg.model.lora_rank:
        add_lora_to_denoiser(denoiser, cfg)
    return denoiser


TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")  # CLIP's attention, as diffusers' LoRA scripts


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
    targets ``lora_targets`` gives, which a training run's resolution records in its config."""
    m = cfg.model
    add_lora(getattr(model, "inner", model), m.lora_rank, m.lora_alpha, lora_targets(model, cfg).split(","))
    label_table = getattr(getattr(model, "y_embedder", None), "embedding_table", None)
    if label_table is not None:  # a DiT's class table trains too: new classes have fresh rows (resize_label_table)
        label_table.requires_grad_(True)


def fp8_base_pays(frozen: int, budget: int) -> bool:
    """``--gpu_memory_budget`` of a LoRA run on a pipeline: store the base in fp8 (``--fp8_base``) where ``frozen``
    parameters in bf16 would take over a quarter of ``budget`` bytes, the rest being for the activations (Wan-1.3B
    at 480x832x81 frames: a 2.8 GB base beside about 6.7 GB of them under gradient checkpointing, the anchor's
    9.57 GiB peak)."""
    return 2 * frozen > budget / 4


def store_base_in_fp8(model: nn.Module, compute_dtype: torch.dtype, plugin: str) -> None:
    """``--fp8_base``: the frozen layers of a diffusers denoiser's transformer stored in float8 e4m3 and upcast to
    ``compute_dtype`` around each one's forward (diffusers' ``ModelMixin.enable_layerwise_casting``, whose default
    skips keep peft's adapters, the model's norms and embedders and its ``_skip_layerwise_casting_patterns`` as they
    are). A stored weight w becomes ``w.to(float8_e4m3fn)``: 3 mantissa bits, a relative rounding of at most 2^-4.
    Call after ``add_lora_to_denoiser``.

    Raises:
        UserError: a DiT (not a diffusers pipeline's transformer), or a sharded ``plugin`` (zero2 / fsdp).
    """
    if not isinstance(model, DiffusersDenoiser):
        raise UserError(f"--fp8_base: for the diffusers pipelines of {FLAG} (Wan, SD3, PixArt, SD); a DiT's LoRA "
                        "keeps its base in bf16")
    if plugin not in ("none", "ddp"):
        raise UserError(f"--fp8_base: with --plugin none or ddp (each process holds the whole base), got {plugin}")
    model.inner.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute_dtype)


def read_dit_init(cfg) -> tuple[dict[str, torch.Tensor] | Path, dict]:
    """DiT weights for ``--init_from`` (an official ``.pt``, a ``DiTPipeline`` folder, or a ditforge run, checkpoint
    or ``.safetensors`` export, as ``ditforge sample --ckpt`` reads them) and their model settings, which fill in
    the run's: model name, learned sigma, QK-norm, condition, text encoder and VAE (where the flags leave them).

    Returns:
        (state dict, or a DCP checkpoint folder for ``dit_init_weights``; the settings).

    Raises:
        UserError: unreadable weights; a checkpoint of a fine-tuned pipeline (another family); ``--model`` or
            ``--condition`` other than the weights'.
    """
    from ditforge.models import infer_dit_config
    from ditforge.train.checkpoint import load_weights

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
    m.model, m.learn_sigma, m.qk_norm, m.condition = spec["model"], spec["learn_sigma"], spec.get("qk_norm", False), cond
    m.depth = spec.get("depth")
    if cond == "text":
        m.text_encoder = m.text_encoder or spec.get("text_encoder")
        m.text_max_length = m.text_max_length or spec.get("text_max_length")
    if m.vae == "none" and spec.get("vae") not in (None, "none"):
        m.vae = spec["vae"]
    return state, spec


def dit_init_weights(dit_init: tuple[dict | Path, dict], cfg) -> dict[str, torch.Tensor]:
    """The state dict of ``read_dit_init``'s weights (a DCP checkpoint's EMA, read into a model of the checkpoint's
    own settings), after checking their input channels against the run's.

    Raises:
        UserError: the weights take other input channels than the data (through ``--vae``) gives.
    """
    from ditforge.models import create_model_from_spec
    from ditforge.train.checkpoint import read_checkpoint_weights

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
    from ditforge.train.checkpoint import read_checkpoint_weights

    cfg = build_config(base=config)
    pre = load_pretrained(cfg.model.init_from, device, encoder_dtype(device), flag=f"{flag} (the run's --init_from)",
                          denoiser_device=denoiser_device, expert=cfg.model.expert)
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
    from ditforge.train.checkpoint import read_checkpoint_weights

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
