"""Fine-tuning pretrained models (``--init_from``: a local diffusers pipeline folder, an official DiT ``.pt``, or a
ditforge run / checkpoint / export, read by ``train.build.load_init``): DreamBooth's prior preservation, sample grids
from the pipeline, and the frozen base stored in float8. LoRA itself is ``ditforge.weights.lora``; DiT weights into
ditforge's ``DiT`` and a fine-tuned pipeline loaded back for sampling (``ditforge.export`` writes it as a pipeline
folder or a LoRA file) are ``ditforge.weights.finetuned``.

Nothing is downloaded: pipelines load with ``from_pretrained(folder, local_files_only=True)``.

Families (``ditforge.models.adapters``): the image and video families keep diffusers'
model code behind an adapter; DiT weights (official ``.pt``, ``DiTPipeline`` folders, ditforge's own runs) load
into ditforge's ``DiT``, which is the same network in the official layout. The pipeline's scheduler config decides
the objective (``ditforge.diffusion.objective``); its VAE and text encoders encode the data.
"""

from __future__ import annotations

import torch
from torch import nn

from ditforge.errors import UserError
from ditforge.models.adapters import DiffusersDenoiser
from ditforge.models.adapters.pipeline import FLAG, Pretrained, generate_with_pipeline
from ditforge.models.adapters.single_file import FP8, load_component
from ditforge.weights.lora import add_lora_to_denoiser, train_text_encoder


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
    """A second copy of the run's denoiser as it started: the pipeline's weights read again from its folder (or the
    single files that replaced its components), with the run's LoRA adapters injected (their weights are then
    loaded by the caller)."""

    def again(name: str, module: nn.Module, library: str) -> nn.Module:
        if name in pre.files:
            return load_component(pre.folder, name, (library, type(module).__name__), pre.files[name],
                                  type(pre.denoiser), torch.float32)
        return type(module).from_pretrained(str(pre.folder), subfolder=name, local_files_only=True)

    inner = again(pre.denoiser.component, pre.denoiser.inner, "diffusers")
    denoiser = type(pre.denoiser)(inner, pre.denoiser.vae_scale)
    if cfg.model.train_text_encoder:
        encoder = again("text_encoder", pre.pipe.text_encoder, "transformers")
        train_text_encoder(denoiser, encoder, pre.pipe, cfg)
    else:
        denoiser.set_null_condition({k: getattr(pre.denoiser, f"null_{k}") for k in pre.denoiser.cond_keys})
    if cfg.model.lora_rank:
        add_lora_to_denoiser(denoiser, cfg)
    return denoiser


def fp8_base_pays(frozen: int, budget: int) -> bool:
    """``--gpu_memory_budget`` of a LoRA run on a pipeline: store the base in fp8 (``--fp8_base``) where ``frozen``
    parameters in bf16 would take over a quarter of ``budget`` bytes, the rest being for the activations (a 1.3B video
    transformer at 480x832x81 frames: a 2.8 GB base beside about 6.7 GB of them under gradient checkpointing, the anchor's
    9.57 GiB peak)."""
    return 2 * frozen > budget / 4


_SCALED_HOOK = "scaled_fp8"


def _scaled_weight_hook(scale: torch.Tensor):
    """A diffusers ``ModelHook`` applying a kept ComfyUI scaled-float8 weight's scale (``single_file``: the layer's
    ``scale_weight``) inside diffusers' layerwise casting: around the layer's forward its weight is the exact upcast
    times the scale (what ComfyUI computes, ``comfy/ops.py``), and the upcast again after it, which the casting then
    stores back in float8 bit for bit."""
    from diffusers.hooks import ModelHook  # diffusers: imported where a pipeline is fine-tuned

    class ScaledWeight(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            self.upcast = module.weight.data
            if self.scale.device != self.upcast.device:  # once: the scale follows the weight to its device
                self.scale = self.scale.to(self.upcast.device)
            module.weight.data = self.upcast * self.scale.to(self.upcast.dtype)
            return args, kwargs

        def post_forward(self, module, output):
            module.weight.data = self.upcast
            del self.upcast
            return output

    hook = ScaledWeight()
    hook.scale = scale
    return hook


def store_base_in_fp8(model: nn.Module, compute_dtype: torch.dtype, plugin: str) -> None:
    """``--fp8_base``: the frozen layers of a diffusers denoiser's transformer stored in float8 e4m3 and upcast to
    ``compute_dtype`` around each one's forward (diffusers' ``ModelMixin.enable_layerwise_casting``, whose default
    skips keep peft's adapters, the model's norms and embedders and its ``_skip_layerwise_casting_patterns`` as they
    are). A stored weight w becomes ``w.to(float8_e4m3fn)``: 3 mantissa bits, a relative rounding of at most 2^-4;
    one read as float8 from a single file stays as it was, a scaled one (``scale_weight``) upcast times its scale.
    A denoiser of two experts (``expert_models``) stores both so. Call after ``add_lora_to_denoiser``.

    Raises:
        UserError: a DiT (not a diffusers pipeline's transformer), or a sharded ``plugin`` (zero2 / fsdp).
    """
    if not isinstance(model, DiffusersDenoiser):
        raise UserError(f"--fp8_base: for the diffusers pipelines of {FLAG} (the adapted families); a DiT's LoRA "
                        "keeps its base in bf16")
    if plugin not in ("none", "ddp"):
        raise UserError(f"--fp8_base: with --plugin none or ddp (each process holds the whole base), got {plugin}")
    for inner in model.expert_models():  # a pipeline of two experts: both
        _store_in_fp8(inner, compute_dtype)


def _store_in_fp8(inner: nn.Module, compute_dtype: torch.dtype) -> None:
    """``store_base_in_fp8`` of one diffusers model ``inner``."""
    from diffusers.hooks import HookRegistry

    scaled = [m for m in inner.modules() if getattr(m, "scale_weight", None) is not None]
    for module in scaled:  # registered first, so that it runs inside the casting, on the upcast weight
        HookRegistry.check_if_exists_or_initialize(module).register_hook(_scaled_weight_hook(module.scale_weight),
                                                                         _SCALED_HOOK)
    inner.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute_dtype)
    # A float8 file's tensors are float8 in the layers the casting skips too (norms, embedders): nothing would
    # upcast them, so they are stored in the compute dtype (their scale applied) as the casting keeps those layers.
    for module in inner.modules():
        hooks = getattr(module, "_diffusers_hook", None)
        if hooks is None or hooks.get_hook("layerwise_casting") is None:
            if hooks is not None and hooks.get_hook(_SCALED_HOOK) is not None:
                hooks.remove_hook(_SCALED_HOOK, recurse=False)
                module.weight.data = module.weight.data.to(compute_dtype) * module.scale_weight.to(compute_dtype)
            for p in module.parameters(recurse=False):
                if p.dtype in FP8:
                    p.data = p.data.to(compute_dtype)
