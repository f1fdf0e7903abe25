"""``ditforge export``: a checkpoint as one safetensors file (the run config in its metadata), as a diffusers
``DiTPipeline`` folder (image class-conditional DiTs), or, for a run that fine-tuned a diffusers pipeline
(``--init_from``), as a complete pipeline folder, a diffusers LoRA file, or ComfyUI's single-file layout (a LoRA or
the whole denoiser in the original release's names)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import types
from pathlib import Path

import torch

from ditforge.atomic import atomic_dir, atomic_path
from ditforge.errors import UserError
from ditforge.interop import PIPELINE_NULL_LABEL, SPEC_FILE, ddim_scheduler_config, official_to_diffusers
from ditforge.models.adapters import DiffusersDenoiser, families
from ditforge.models.adapters.pipeline import ONE_EXPERT, Pretrained, read_model_index
from ditforge.models.adapters.single_file import component_files
from ditforge.sample import load_model
from ditforge.weights.finetuned import load_finetuned
from ditforge.weights.lora import TEXT_LORA_TARGETS, lora_config, lora_state_dict, merge_lora
from ditforge.weights.original import lora_to_original, to_original
from ditforge.weights.read import load_weights

log = logging.getLogger(__name__)


def export_safetensors(state: dict[str, torch.Tensor], config: dict | None, out: Path) -> None:
    """Write one consolidated safetensors file (the run config in its metadata), atomically."""
    from safetensors.torch import save_file

    with atomic_path(out) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"config": json.dumps(config)})


def export(ckpt: str, out: str, fmt: str = "safetensors", use_ema: bool = True, vae: str | None = None) -> Path:
    """``ditforge export``: ``fmt`` safetensors (``consolidate``), diffusers (``export_diffusers``; a fine-tuned
    pipeline run: ``export_pretrained``), lora (a LoRA fine-tune of a pipeline: ``export_pretrained``) or comfyui
    (a fine-tuned pipeline run: ``export_comfyui``).
    ``vae``: for diffusers, the local AutoencoderKL folder to put in a ``DiTPipeline``. Returns what was written.

    Raises:
        UserError: an unreadable checkpoint; lora for a run that is no LoRA fine-tune of a pipeline; ``vae`` with
            another format than diffusers; the errors of the writer.
    """
    state, config = load_weights(ckpt, use_ema)
    if config is not None and config["model"].get("family"):  # a fine-tuned diffusers pipeline
        return export_pretrained(state, config, out, fmt, use_ema)
    if fmt in ("lora", "comfyui"):
        raise UserError(f"--format {fmt}: the checkpoint is no fine-tune of a diffusers pipeline (--init_from)")
    if fmt == "diffusers":
        model, spec = load_model(ckpt, use_ema=use_ema)
        return export_diffusers(model, spec, out, vae)
    if vae is not None:
        raise UserError("--vae: only --format diffusers puts a VAE in the export")
    return consolidate(ckpt, out, use_ema)


def consolidate(ckpt: str, out: str, use_ema: bool = True) -> Path:
    """``ditforge export``'s default: consolidate a checkpoint (sharded or not) into one safetensors file for sampling,
    with the run config in its metadata. Returns the file written."""
    model, spec = load_model(ckpt, use_ema=use_ema)
    config = spec.pop("run_config") or {"model": spec}
    export_safetensors(model.state_dict(), config, Path(out))
    log.info("wrote %s weights of %s to %s", "EMA" if use_ema else "raw", spec["model"], out)
    return Path(out)


def export_diffusers(model: torch.nn.Module, spec: dict, out_dir: str | os.PathLike,
                     vae_path: str | os.PathLike | None = None) -> Path:
    """Write a folder that ``diffusers.DiTPipeline.from_pretrained(out_dir, local_files_only=True)`` loads.

    Layout: ``model_index.json``, ``transformer/`` (``DiTTransformer2DModel``, fp32 safetensors), ``scheduler/``
    (``DDIMScheduler``, ``ddim_scheduler_config``), ``vae/`` (the ``AutoencoderKL`` of ``vae_path``, else of
    ``spec["vae"]``, loaded and saved again) and ``ditforge.json`` (``spec`` without its run config: the class
    count and model name the import needs). Written under ``.NAME.tmp`` beside ``out_dir`` and renamed when
    complete; an existing ``out_dir`` is replaced only then.

    Args:
        model: an image class-conditional ``DiT`` (official layout), any device; its weights are copied to CPU.
        spec: ``load_model``'s settings dict (model, input_size, in_channels, num_classes, learn_sigma, vae,
            condition, num_frames, ...).
        out_dir: the folder to write.
        vae_path: a local diffusers ``AutoencoderKL`` folder (or a pipeline folder with ``vae/``).

    Returns:
        ``Path(out_dir)``.

    Raises:
        UserError: a text-conditioned or video model, a model whose heads or patch are not a square DiT's,
            more than 1000 classes, no VAE (pixel-space models included: DiTPipeline always decodes with one),
            or a VAE whose latent channels differ from the model's.
    """
    from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    if spec.get("condition", "class") != "class" or getattr(model, "text_dim", None) is not None:
        raise UserError(f"--format diffusers: {spec.get('model')} is text-conditioned; DiTPipeline takes class "
                        "labels only (use --format safetensors)")
    if spec.get("num_frames") is not None or type(model).__name__ != "DiT":
        raise UserError(f"--format diffusers: {spec.get('model')} is a video model; DiTPipeline makes images "
                        "(use --format safetensors)")
    if any(k.endswith(("q_norm.weight", "k_norm.weight")) for k in model.state_dict()):
        raise UserError("--format diffusers: the model uses QK-norm, which DiTTransformer2DModel lacks "
                        "(use --format safetensors)")
    path = vae_path if vae_path is not None else spec.get("vae")
    if path is None or str(path).lower() == "none":
        raise UserError("--vae: DiTPipeline decodes latents with an AutoencoderKL; pass --vae FOLDER (a local "
                        "diffusers AutoencoderKL, e.g. sd-vae-ft-ema)" +
                        (" -- a pixel-space model cannot be exported as a DiTPipeline"
                         if spec["in_channels"] in (1, 3) else ""))
    p = Path(path)
    sub = "vae" if (p / "vae" / "config.json").is_file() else None
    try:
        vae = AutoencoderKL.from_pretrained(str(p), subfolder=sub, local_files_only=True)
    except (OSError, ValueError, EnvironmentError) as e:
        raise UserError(f"--vae {path}: not a local diffusers AutoencoderKL folder ({' '.join(str(e).split())[:200]})"
                        ) from None
    if vae.config.latent_channels != spec["in_channels"]:
        raise UserError(f"--vae {path}: its latents have {vae.config.latent_channels} channels, the model's "
                        f"{spec['in_channels']}")

    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    hidden = state["x_embedder.proj.weight"].shape[0]
    transformer = DiTTransformer2DModel(
        num_attention_heads=model.num_heads, attention_head_dim=hidden // model.num_heads,
        in_channels=model.in_channels, out_channels=model.out_channels, num_layers=len(model.blocks),
        sample_size=spec["input_size"], patch_size=model.patch_size, norm_eps=1e-6,
        num_embeds_ada_norm=PIPELINE_NULL_LABEL)
    missing, unexpected = transformer.load_state_dict(official_to_diffusers(state, spec["num_classes"]), strict=True)
    assert not missing and not unexpected
    pipe = DiTPipeline(transformer=transformer.eval(), vae=vae.eval(),
                       scheduler=DDIMScheduler(**ddim_scheduler_config()))

    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        pipe.save_pretrained(str(tmp), safe_serialization=True)
        keep = {k: v for k, v in spec.items() if k != "run_config"}
        keep["vae"] = "vae"  # relative: the folder's own vae/
        (tmp / SPEC_FILE).write_text(json.dumps(keep, indent=2, default=str))
    log.info("wrote a diffusers DiTPipeline of %s to %s", spec.get("model"), out)
    return out


def export_pretrained(state: dict[str, torch.Tensor] | Path, config: dict, out: str | Path, fmt: str,
                      use_ema: bool = True) -> Path:
    """``ditforge export`` of a fine-tuned pipeline run: ``diffusers`` writes a complete pipeline folder (LoRA
    merged; ``write_pipeline``), ``lora`` the adapters as a diffusers LoRA file (``write_lora``), ``comfyui`` the
    original layout (``export_comfyui``).

    Raises:
        UserError: ``lora`` for a full fine-tune or a family without a LoRA loader; another format.
    """
    if fmt == "comfyui":
        return export_comfyui(state, config, out, use_ema)
    if fmt not in ("diffusers", "lora"):
        raise UserError(f"--format {fmt}: a fine-tuned {config['model']['family']} pipeline exports as diffusers (a "
                        "pipeline folder), lora (a LoRA file) or comfyui (ComfyUI's single file)")
    if fmt == "lora":
        import diffusers

        replaced = tuple(component_files(types.SimpleNamespace(**config["model"])))  # the run's single files
        pipeline_class = read_model_index(config["model"]["init_from"], "--ckpt (the run's --init_from)",
                                          replaced)["_class_name"]
        if not config["model"].get("lora_rank"):
            raise UserError("--format lora: the run fine-tuned all weights (no --lora_rank); export --format diffusers")
        if not hasattr(getattr(diffusers, pipeline_class), "save_lora_weights"):
            raise UserError(f"--format lora: diffusers' {pipeline_class} has no LoRA loader (load_lora_weights); "
                            "export --format diffusers for a pipeline with the LoRA merged")
    pre, denoiser, cfg = load_finetuned(state, config, torch.device("cpu"), use_ema)
    if fmt == "lora":
        return write_lora(pre, denoiser, cfg, out)
    if cfg.model.lora_rank:
        merge_lora(denoiser)
    return write_pipeline(pre, denoiser, out)


def write_pipeline(pre: Pretrained, denoiser: DiffusersDenoiser, out: str | Path) -> Path:
    """A complete pipeline folder at ``out``: the fine-tuned (LoRA merged) denoiser and, when it trained, text
    encoder saved with their ``save_pretrained``, and so the components single files replaced (``pre.files``),
    every other component copied untouched from the folder the run started from, so the family's pipeline class
    loads it offline. Written under a temporary name and renamed when
    complete."""
    # the components the denoiser trained: its own (transformer, unet) or, for a two-expert pipeline's second expert,
    # transformer_2, or both experts
    trained = {name: module for name, module in pre.pipe.components.items()
               if any(module is model for model in denoiser.expert_models())}
    if denoiser.tokenize is not None:  # --train_text_encoder
        trained["text_encoder"] = denoiser.text_encoder
    for name in pre.files:  # read from a single file: the folder may not hold its weights
        trained.setdefault(name, pre.pipe.components[name])
    with atomic_dir(out) as tmp:
        for item in pre.folder.iterdir():
            if item.name not in trained:
                (shutil.copytree if item.is_dir() else shutil.copy2)(item, tmp / item.name)
        for name, module in trained.items():
            module.save_pretrained(str(tmp / name), safe_serialization=True)
    return Path(out)


def write_lora(pre: Pretrained, denoiser: DiffusersDenoiser, cfg, out: str | Path) -> Path:
    """The adapters as a diffusers LoRA file, ``OUT/pytorch_lora_weights.safetensors``, which the family's
    ``pipe.load_lora_weights(OUT)`` loads (with the rank and alpha in its metadata; the text encoder's adapters too
    when it trained); a run of both experts, one such file each, ``OUT/high_noise/`` (``transformer``) and
    ``OUT/low_noise/`` (``transformer_2``, loaded with ``load_lora_weights(OUT / "low_noise",
    load_into_transformer_2=True)``). The pipeline class must have a LoRA loader (``load_lora_weights``;
    ``export_pretrained`` refuses a class without one first)."""
    import diffusers

    m = cfg.model
    cls = getattr(diffusers, pre.pipeline_class)
    config = lora_config(m.lora_rank, m.lora_alpha, m.lora_target_modules.split(","))
    metadata = {**config.to_dict(), "base_model_name_or_path": None}
    with atomic_dir(out) as tmp:
        if pre.denoiser.component == "unet":
            from diffusers.utils import convert_state_dict_to_diffusers

            extra = {}
            if denoiser.tokenize is not None:
                text_config = lora_config(m.lora_rank, m.lora_alpha, list(TEXT_LORA_TARGETS))
                extra = {"text_encoder_lora_layers": convert_state_dict_to_diffusers(
                             lora_state_dict(denoiser.text_encoder)),
                         "text_encoder_lora_adapter_metadata": {**text_config.to_dict(),
                                                                "base_model_name_or_path": None}}
            cls.save_lora_weights(str(tmp), unet_lora_layers=convert_state_dict_to_diffusers(
                                      lora_state_dict(denoiser.inner)),
                                  unet_lora_adapter_metadata=metadata, safe_serialization=True, **extra)
        elif len(experts := denoiser.expert_models()) == 2:  # both experts: a LoRA folder each
            for name, model in zip(ONE_EXPERT, experts):  # high_noise, low_noise
                (tmp / name).mkdir()
                cls.save_lora_weights(str(tmp / name), transformer_lora_layers=lora_state_dict(model),
                                      transformer_lora_adapter_metadata=metadata, safe_serialization=True)
        else:
            cls.save_lora_weights(str(tmp), transformer_lora_layers=lora_state_dict(denoiser.inner),
                                  transformer_lora_adapter_metadata=metadata, safe_serialization=True)
    return Path(out)


def export_comfyui(state: dict[str, torch.Tensor] | Path, config: dict, out: str | Path, use_ema: bool = True
                   ) -> Path:
    """A fine-tuned pipeline run in ComfyUI's single-file layout: the original release's parameter names (the
    family adapter's ``original_layouts``, ``weights.original``), one safetensors file written atomically (the run
    config in its metadata). A run of one expert of a two-expert pipeline writes ``OUT_STEM_<expert>.safetensors``
    (``..._high_noise``, ``..._low_noise``), so that the files of the two say which is which; a run of both writes
    both files.

    * A LoRA run: ``diffusion_model.<original module>.lora_A.weight`` (r x in), ``.lora_B.weight`` (out x r) and
      ``.alpha`` (a 0-d float32, the run's ``--lora_alpha``, so that ComfyUI's scale alpha / rank is peft's), the
      names ComfyUI's LoRA loader maps onto its model (``comfy/lora.py``, ``model_lora_keys_unet``: the
      ``diffusion_model.`` key of every weight) and diffusers' ``load_lora_weights`` converts
      (``lora_conversion_utils.py``); a fused original weight (q, k, v in one) gets the exact block form
      (``lora_to_original``). float32: the adapters train in float32, a LoRA is small, and ComfyUI casts a patch to
      the model's dtype as it applies it; the file then holds what the run holds.
    * A full fine-tune: the whole denoiser in bfloat16 (the releases' and ComfyUI's repackaged files' dtype), its
      names without a prefix: ComfyUI's ``Load Diffusion Model`` (``comfy/sd.py``, ``load_diffusion_model_state_dict``)
      strips a ``model.diffusion_model.`` prefix when it finds one and reads bare names as they are, and the bare
      names are also what diffusers' ``from_single_file`` reads for every family with a layout (one family's
      converter does not strip the prefix; its adapter's docstring says which).

    Returns:
        The file written (the last: the low-noise one of a run of both).

    Raises:
        UserError: a family without an original layout (the message names the families that have one); the errors
            of ``load_finetuned``.
    """
    family = config["model"]["family"]
    adapter = families()[family]
    layout = adapter.original_layouts.get(adapter.component)
    if layout is None:
        known = sorted(name for name, cls in families().items() if cls.component in cls.original_layouts)
        raise UserError(f"--format comfyui: no original layout is known for a {family} pipeline (known for: "
                        f"{', '.join(known)}); export --format diffusers or lora")
    pre, denoiser, cfg = load_finetuned(state, config, torch.device("cpu"), use_ema)
    m = cfg.model
    # (expert, model): the run's one denoiser, or each of two experts trained in one run (--expert both)
    experts = zip(ONE_EXPERT, denoiser.expert_models()) if m.expert == "both" else [(m.expert, denoiser.inner)]
    for expert, model in experts:
        if m.lora_rank:
            rows = {k.replace(".base_layer.", "."): v.shape[0] for k, v in model.state_dict().items() if v.ndim}
            tensors = {f"diffusion_model.{k}": v.float() for k, v in lora_to_original(
                lora_state_dict(model), layout, m.lora_alpha if m.lora_alpha is not None else m.lora_rank,
                rows).items()}
        else:
            tensors = {k: v.to(torch.bfloat16) for k, v in to_original(model.state_dict(), layout).items()}
        path = Path(out)
        if expert:
            path = path.with_name(f"{path.stem}_{expert}{path.suffix}")
        export_safetensors(tensors, config, path)
        log.info("wrote %s of the %s run in the original layout (%s) to %s",
                 "the LoRA" if m.lora_rank else "the weights", family, layout.name, path)
    return path


def pipeline_teacher(teacher: str, outputs: str | None) -> str:
    """``ditforge distill --teacher RUN`` of a run that fine-tuned a diffusers pipeline: the run written once as a
    pipeline folder ``OUTPUTS/teacher`` (``export_pretrained`` as ``--format diffusers``: the LoRA merged, the other
    components copied), whose path it returns; any other teacher as it is.

    Raises:
        UserError: a fine-tuned run without ``--outputs``; under torchrun, a run not yet written as that folder;
            ``export_pretrained``'s.
    """
    if (Path(teacher) / "model_index.json").is_file() or not Path(teacher).is_dir():
        return teacher
    try:
        state, config = load_weights(teacher)
    except UserError:
        return teacher  # distill names what is wrong with it
    if not (config and config["model"].get("family")):
        return teacher
    if outputs is None:
        raise UserError("--outputs: required")
    out = Path(outputs) / "teacher"
    if not (out / "model_index.json").is_file() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError(f"--teacher {teacher}: under torchrun every process would write {out}; write it first "
                        f"(ditforge export --ckpt {teacher} --format diffusers --out {out}) or run once in one process")
    if not (out / "model_index.json").is_file():
        log.info("writing the fine-tuned teacher %s as the pipeline folder %s", teacher, out)
        export_pretrained(state, config, out, "diffusers")
    return str(out)
