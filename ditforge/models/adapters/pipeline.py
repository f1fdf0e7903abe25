"""Pipeline folders of the adapted families, loaded offline: ``read_model_index`` checks a folder (one line naming
the missing file), ``load_pretrained`` loads it with the family's diffusers pipeline class and wraps its denoiser in
the family's adapter; ``Pretrained`` holds the result (the pipeline's text encoders and VAE encode the data).
``generate_with_pipeline`` samples with the family's own pipeline around a (fine-tuned) denoiser, for ``ditforge
sample`` and for training's sample grids."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ditforge.errors import UserError
from ditforge.models.adapters import DiffusersDenoiser, as_images, family_of_pipeline, supported_pipelines
from ditforge.models.adapters.limits import CaptionCheck, quiet_truncation
from ditforge.models.adapters.single_file import FP8, load_component

FLAG = "--init_from"
_WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin", "model.safetensors",
                 "pytorch_model.bin", "diffusion_pytorch_model.safetensors.index.json",
                 "model.safetensors.index.json", "pytorch_model.bin.index.json")


def read_model_index(folder: str | Path, flag: str = FLAG, replaced: tuple[str, ...] = ()) -> dict:
    """``model_index.json`` of a pipeline folder, after checking that every component it lists is there (of a
    ``replaced`` one, a single file given in its place, only the config).

    Raises:
        UserError (one line, naming ``flag`` and the missing file): no such folder, no ``model_index.json``, a
            pipeline class ditforge does not fine-tune, or a component folder / config / weights file missing.
    """
    p = Path(folder)
    index = p / "model_index.json"
    if not index.is_file():
        raise UserError(f"{flag} {folder}: expected a local diffusers pipeline folder with model_index.json, an "
                        "official DiT .pt, or a ditforge run, checkpoint or export"
                        + ("" if p.exists() else " (it does not exist)"))
    try:
        spec = json.loads(index.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{flag} {index}: unreadable ({e})") from None
    cls = spec.get("_class_name")
    if cls not in supported_pipelines():
        raise UserError(f"{flag} {folder}: a {cls} pipeline is not supported (expected one of "
                        f"{', '.join(supported_pipelines())})")
    for name, value in spec.items():
        if name.startswith("_") or not isinstance(value, list) or value[0] is None:
            continue
        sub = p / name
        kind = value[1]
        if kind.endswith("Scheduler"):
            needed = [sub / "scheduler_config.json"]
        elif "Tokenizer" in kind:
            needed = [sub]
        elif "Processor" in kind or "FeatureExtractor" in kind:  # Wan I2V's CLIPImageProcessor
            needed = [sub / "preprocessor_config.json"]
        else:
            needed = [sub / "config.json"]
            if name not in replaced and not any((sub / f).is_file() for f in _WEIGHT_FILES):
                needed.append(sub / _WEIGHT_FILES[0])
        for f in needed:
            if not f.exists():
                raise UserError(f"{flag} {folder}: {f.relative_to(p)} is missing (model_index.json lists the "
                                f"{name} component, a {kind})")
    return spec


def is_adapted_pipeline(path: str | Path, replaced: tuple[str, ...] = ()) -> bool:
    """True for a pipeline folder of a family behind an adapter (SD, PixArt, SD3, Wan); False for anything else
    (DiT weights in any form, or a path that is no pipeline folder). Raises UserError for a pipeline folder
    that is incomplete (but for the weights of the ``replaced`` components) or of an unsupported family
    (``read_model_index``)."""
    if not (Path(path) / "model_index.json").is_file():
        return False
    return read_model_index(path, replaced=replaced)["_class_name"] != "DiTPipeline"


def pipeline_defaults(pipe) -> dict:
    """The defaults of the pipeline's ``__call__`` that ``ditforge sample`` falls back on: height, width,
    num_frames, num_inference_steps, guidance_scale, and a two-expert pipeline's guidance_scale_2 (a signature
    default, or for a default the signature leaves None (or a call without the argument: a driven pipeline's
    num_frames) what the pipeline's body computes, the adapter's ``call_defaults``; None where neither gives one: a
    two-expert pipeline's guidance_scale_2 then takes guidance_scale's)."""
    params = inspect.signature(pipe.__call__).parameters
    names = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale", "guidance_scale_2")
    out = {n: params[n].default for n in names if n in params}
    family = family_of_pipeline(type(pipe).__name__)
    computed = family.call_defaults(pipe) if family is not None else {}
    return {n: computed.get(n) if v is None else v for n, v in out.items()} | {
        n: v for n, v in computed.items() if n in names and n not in out}


@dataclass
class Pretrained:
    """A loaded pipeline of a supported family (not DiT).

    Attributes:
        folder: where it was loaded from. pipeline_class: e.g. ``StableDiffusionPipeline``.
        pipe: the diffusers pipeline (text encoders and VAE on the device; the denoiser still inside).
        denoiser: the adapter around the pipeline's denoiser (``DiffusersDenoiser``), float32.
        scheduler_config: the scheduler's config dict (decides the objective).
        files: component -> the single file it was read from, in place of the folder's (``load_pretrained``).
    """

    folder: Path
    pipeline_class: str
    pipe: Any
    denoiser: DiffusersDenoiser
    scheduler_config: dict
    files: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        self.check_captions = CaptionCheck(self.denoiser, self.pipe)  # the one warning of a truncated caption

    def refuse_size(self, height: int | None, width: int | None, num_frames: int, flags: str) -> None:
        """Raises UserError (one line: ``flags``, the caller's flags and values, then the family's reason) when the
        family's model cannot take frames of ``height`` x ``width`` px, ``num_frames`` of them
        (``DiffusersDenoiser.size_refused``). A side of None (the pipeline's own default) is not checked."""
        if height is None or width is None:
            return
        why = self.denoiser.size_refused(self.pipe, height, width, num_frames)
        if why is not None:
            raise UserError(f"{flags}: {self.pipeline_class} at {self.folder} takes {why}")

    @property
    def side_multiple(self) -> int:
        """Pixels a frame's height and width must be a multiple of: the VAE's downsample x the denoiser's own (a
        UNet's 2^(levels - 1), a transformer's patch side)."""
        inner, patch = self.denoiser.inner, self.denoiser.inner.config.get("patch_size", None)
        return self.denoiser.vae_scale * (2 ** (len(inner.config.block_out_channels) - 1)
                                          if self.denoiser.component == "unet"
                                          else int(patch[-1] if isinstance(patch, (list, tuple)) else patch))

    @property
    def device(self) -> torch.device:
        """Where the denoiser runs: its running expert's (``inner``) device. A two-expert denoiser's idle expert may
        wait in host memory (``train/experts.py``), so its first parameter does not say."""
        return next(self.denoiser.inner.parameters()).device

    def encode_prompt(self, texts: list[str], images=None) -> dict[str, torch.Tensor]:
        """Prompts -> the denoiser's conditioning tensors (float32, batch-first, on the denoiser's device), with
        the pipeline's encoders (wherever they are); the token ids when the denoiser trains its text encoder.
        ``images``: a ``prompt_sees_image`` family's first frames, one per prompt ((B, 3, H, W) in [-1, 1] or PIL
        images; None: its black image). Captions longer than the model takes (``text_limits``) are truncated to it,
        with one warning line a process (``limits.CaptionCheck``)."""
        self.check_captions(list(texts))
        if getattr(self.denoiser, "tokenize", None) is not None:
            out = self.denoiser.tokenize(list(texts))
            return {k: v.to(self.device) for k, v in out.items()}
        encoder = next(m for n, m in self.pipe.components.items() if n.startswith("text_encoder") and m is not None)
        extra = {"images": images} if images is not None else {}
        with torch.no_grad(), quiet_truncation(self.pipe):
            out = self.denoiser.encode_prompt(self.pipe, list(texts), encoder.device, **extra)
        return {k: (v.float() if v.is_floating_point() else v).to(self.device) for k, v in out.items()}

    def encode_image(self, first: torch.Tensor, num_frames: int, images: list | None = None,
                     generator: torch.Generator | None = None, noise_seeds: list[int] | None = None
                     ) -> dict[str, torch.Tensor]:
        """Image-to-video (``denoiser.image_to_video``): first frames (B, 3, H, W) float in [-1, 1] of clips of
        ``num_frames`` frames -> the denoiser's image conditioning tensors (float32, on the denoiser's device),
        with the pipeline's VAE and image encoder (``DiffusersDenoiser.encode_image``; ``images``: the PIL images
        for the image encoder, where they are not the frames; ``generator``: a family that samples its image latents,
        ``image_from_generator``, draws them from it; ``noise_seeds``: one per frame, a family with an
        ``image_noise`` recipe noises the frames for training)."""
        extra = {"generator": generator} if generator is not None else {}
        if noise_seeds is not None:
            extra["noise_seeds"] = noise_seeds
        out = self.denoiser.encode_image(self.pipe, first, num_frames, images=images, **extra)
        return {k: v.float().to(self.device) for k, v in out.items()}

    def encode_references(self, clips: torch.Tensor, references: torch.Tensor) -> tuple[dict[str, torch.Tensor],
                                                                                      torch.Tensor]:
        """Reference-image families (``denoiser.takes_references``) in training: clips (B, 3, T, H, W) and their
        references (B, R, 3, H', W') float in [-1, 1] -> (the denoiser's control conditioning, stacked by row, and
        the references' clean latent frames (B, C, R, h, w) float32 that lead the clip's latents x0), through the
        adapter's ``encode_control`` with the references alone (no control video: the pipeline's zeros; no mask:
        all ones). The leading latents are the first ``in_channels`` channels of the control at its R reference
        frames: the references' normalised VAE posterior modes (``WanVACEPipeline.prepare_video_latents``), as
        DiffSynth-Studio's Wan VACE training puts them before the clip's (``WanVideoUnit_InputVideoEmbedder``)."""
        _, _, T, H, W = clips.shape
        rows, leads = [], []
        for refs in references:  # as uint8 PIL images, the pipeline's input (a decoded image's bytes back)
            cond, r = self.denoiser.encode_control(self.pipe, as_images(refs), None, None, H, W, T, self.device)
            rows.append(cond)
            leads.append(next(iter(cond.values()))[:, :self.denoiser.in_channels, :r])
        return {k: torch.cat([c[k] for c in rows]) for k in rows[0]}, torch.cat(leads).float()

    def encode_driving(self, clips: torch.Tensor, images: torch.Tensor, batch: dict
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Driven families (``denoiser.trained_videos``) in training: clips (B, 3, T, H, W), their character images
        (B, 3, H', W') and the batch's driving videos (``batch[name]`` (B, 3, T, H'', W'') for each name of
        ``trained_videos``, a video CSV's columns), float in [-1, 1] -> (the denoiser's conditioning, stacked by
        row, float32 on the denoiser's device; the character's clean latent frames (B, C, 1, h, w) float32 that lead
        the clips' latents x0), through the adapter's ``encode_driving``, each image and frame given as uint8 PIL
        (``as_images``: a decoded frame's bytes back, the pipeline's input).

        Raises:
            UserError: a batch without one of those videos (one line naming the columns)."""
        from ditforge.models.adapters import as_images

        names = self.denoiser.trained_videos
        missing = [k for k in names if k not in batch]
        if missing:
            raise UserError(f"--data: a {self.pipeline_class} trains on a video CSV with the columns "
                            f"{', '.join(names)} (its driving videos, frame-aligned with each clip) and optionally "
                            f"image (the character); this data has no {missing[0]}")
        _, _, T, H, W = clips.shape
        rows, leads = [], []
        for i in range(len(clips)):
            frames = {k: as_images(batch[k][i].transpose(0, 1)) for k in names}
            cond, lead = self.denoiser.encode_driving(self.pipe, as_images(images[i:i + 1])[0], frames, H, W,
                                                      self.device)
            rows.append(cond)
            leads.append(lead)
        return {k: torch.cat([c[k] for c in rows]) for k in rows[0]}, torch.cat(leads)

ONE_EXPERT = ("high_noise", "low_noise")  # --expert of one expert (config.sections.EXPERTS less "both")


def expert_component(component: str, expert: str) -> str:
    """The pipeline component of a Wan 2.2 A14B expert: ``transformer`` (high_noise) or ``transformer_2``
    (low_noise)."""
    return component if expert == "high_noise" else f"{component}_2"


def encoder_dtype(device: torch.device) -> torch.dtype:
    """The dtype of a pipeline's frozen text and image encoders outside training: bf16 on a GPU (UMT5-XXL is 11 GB
    so), float32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_pretrained(folder: str | Path, device: torch.device, text_dtype: torch.dtype = torch.float32,
                    flag: str = FLAG, text_device: torch.device | None = None,
                    vae_device: torch.device | None = None, denoiser_device: torch.device | None = None,
                    denoiser_dtype: torch.dtype = torch.float32, sampling: bool = False, expert: str | None = None,
                    other_expert_device: torch.device | None = None, files: dict[str, str] | None = None,
                    keep_fp8: bool = False) -> Pretrained:
    """Load a pipeline folder of a supported family offline; its text encoders go to ``text_device`` (default
    ``device``) in ``text_dtype``, its VAE to ``vae_device`` (default ``device``) and the denoiser to
    ``denoiser_device`` (default ``device``; the CPU under ``--cpu_offload all``) with its parameters in
    ``denoiser_dtype``, cast in host memory before the move (bf16 weights: the fp32 model never is on the GPU, which
    SDXL's 10.3 GB would overflow under an 8 GiB budget; a second expert, Wan 2.2's ``transformer_2``, likewise); all
    are frozen but the denoiser. ``sampling``: the folder is for ``ditforge sample``, which takes variants that
    fine-tuning refuses (the family's ``unsupported``). ``expert`` (Wan 2.2 A14B, ``config.sections.EXPERTS``): the
    denoiser wraps ``transformer`` (high_noise) or ``transformer_2`` (low_noise), and the other expert goes to
    ``other_expert_device`` (default: the denoiser's), frozen; ``both``, or None outside ``sampling``: the denoiser
    wraps ``transformer`` and holds ``transformer_2`` beside it (``DiffusersDenoiser.add_expert``), both in
    ``denoiser_dtype``, the second on ``other_expert_device`` when given (the build places it,
    ``train.experts``). The adapter's null condition (the empty prompt) is set.
    ``files``: component -> a single-file checkpoint replacing the folder's (``single_file.COMPONENTS``; the folder
    still gives its config), read tensor by tensor in the component's dtype; ``keep_fp8``: the denoiser's float8
    tensors stay float8 (``--fp8_base``), not cast to ``denoiser_dtype``.

    Raises:
        UserError: see ``read_model_index``; a DiT pipeline (load it with ``load_dit_weights``); a load failure
            from diffusers / transformers; a variant the family's adapter refuses (``unsupported``); a single file
            for a component the folder has not, or of an unknown layout (``single_file.load_component``); one line
            each.
    """
    files = files or {}
    spec = read_model_index(folder, flag, tuple(files))
    family = family_of_pipeline(spec["_class_name"])
    if family is None:
        raise UserError(f"{flag} {folder}: a {spec['_class_name']} loads into ditforge's own DiT, not an adapter")
    replaced = {}
    for name, file in files.items():
        if not isinstance(spec.get(name), list) or spec[name][0] is None:
            raise UserError(f"--{name} {file}: {folder} has no {name} component to replace")
        trained = name.startswith(family.component)
        dtype = denoiser_dtype if trained else text_dtype if name.startswith("text_encoder") else torch.float32
        replaced[name] = load_component(Path(folder), name, tuple(spec[name]), file, family, dtype,
                                        keep_fp8=keep_fp8 and trained)
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()  # loading bars of every component: noise around ditforge's own
    transformers.utils.logging.disable_progress_bar()
    try:
        pipe = getattr(diffusers, spec["_class_name"]).from_pretrained(str(folder), local_files_only=True,
                                                                        **replaced)
    except Exception as e:  # diffusers and transformers raise many types for a bad folder
        raise UserError(f"{flag} {folder}: could not load the pipeline ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]})") from None
    pipe.set_progress_bar_config(disable=True)
    if (why := family.unsupported(pipe, sampling, expert)) is not None:
        raise UserError(f"{flag} {folder}: {why}")
    first = expert_component(family.component, expert) if expert in ONE_EXPERT else family.component  # trained
    for name, module in pipe.components.items():
        if isinstance(module, nn.Module):
            module.requires_grad_(False).eval()
            if name.startswith("text_encoder") or name == "image_encoder":  # Wan I2V's CLIP vision model
                module.to(text_device or device, text_dtype)
            elif name == "vae":
                module.to(vae_device or device)
            elif name == family.component or name.startswith(family.component + "_"):  # Wan 2.2's transformer_2
                for p in module.parameters():
                    if not (keep_fp8 and p.dtype in FP8):
                        p.data = p.data.to(denoiser_dtype)
                if name == first or other_expert_device is None:
                    module.to(denoiser_device or device)
                elif expert in ONE_EXPERT:  # frozen, unused until sampling: bf16 on the host
                    module.to(other_expert_device, torch.bfloat16)
                else:  # both trained: the second waits there for the build to place it (train/experts.py)
                    module.to(other_expert_device)
            else:
                module.to(device)
    # pixels per latent pixel, as the pipeline states it (SD, PixArt, SD3: vae_scale_factor; LTX-Video:
    # vae_spatial_compression_ratio; Wan, CogVideoX, HunyuanVideo: vae_scale_factor_spatial)
    vae_scale = next(int(getattr(pipe, name)) for name in ("vae_scale_factor_spatial", "vae_spatial_compression_ratio",
                                                           "vae_scale_factor") if hasattr(pipe, name))
    denoiser = family(getattr(pipe, first), vae_scale)
    denoiser.pipeline_slots = (first,)
    second = getattr(pipe, f"{family.component}_2", None)
    if second is not None and (expert == "both" or (expert is None and not sampling)):
        denoiser.add_expert(second)
    denoiser.requires_grad_(True)
    denoiser.attach_pipeline(pipe)
    pre = Pretrained(Path(folder), spec["_class_name"], pipe, denoiser, dict(pipe.scheduler.config), files)
    denoiser.set_null_condition(family.null_condition(pipe, pre.encode_prompt([""])))
    return pre


def generate_with_pipeline(pre: Pretrained, denoiser: DiffusersDenoiser, prompts: list[str], seeds: list[int],
                           image_size: int | tuple[int, int], num_steps: int, guidance_scale: float,
                           batch_size: int = 8, num_frames: int | None = None, images: list | None = None,
                           negative: str | None = None, call_inputs: dict | None = None,
                           guidance_scale_2: float | None = None, scheduler: Callable | None = None) -> torch.Tensor:
    """Images for ``prompts`` from the family's own pipeline and scheduler with ``denoiser`` (an adapter of the
    fine-tuned diffusers model; its text encoder too when it trained one) in it: row i starts from the noise of
    ``torch.Generator(device).manual_seed(seeds[i])``, so it depends on its prompt and seed only. The prompts are
    encoded (``pre.encode_prompt``, or the denoiser's own text encoder) and handed over as embeddings, the
    ``negative`` prompt's (default: the empty prompt's) as the negative ones: what the pipeline does with the
    prompt strings. ``image_size``: the side S, or (height H, width W) in pixels. Returns (N, 3, H, W) float32 in
    [-1, 1] on the CPU; a video family's (Wan) videos of ``num_frames`` frames, (N, 3, T, H, W). A VAE kept on
    the CPU (training from features) visits the denoiser's device meanwhile. An image-to-video family
    (``WanImageToVideoPipeline``) takes ``images``, one PIL image per prompt, passed as the pipeline's ``image``;
    its rows are drawn one per call (the pipeline takes one image a call, ``pipeline_wan_i2v.py``). ``call_inputs``:
    more arguments of every call, for a ``driving_videos`` family (its ``driving_inputs`` and ``image``; its rows
    are drawn one per call, and the frame count is its videos', not ``num_frames``). ``guidance_scale_2``: a
    two-expert pipeline's low-noise scale (the call's argument; None: its default). ``scheduler``: a function of a
    row's generator giving the scheduler its call steps with in place of the pipeline's (``dmd.StudentScheduler``: a
    distilled student's sampler, whose re-noising draws follow the call's noise from that generator; rows then one
    per call), the pipeline's own put back after; None: the pipeline's."""
    pipe = pre.pipe
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    for slot, model in zip(denoiser.pipeline_slots, denoiser.expert_models()):  # one expert of two: in its own slot
        setattr(pipe, slot, model)
    device = next(denoiser.inner.parameters()).device
    vae_home = pipe.vae.device
    pipe.vae.to(device)
    out, first_images = [], images  # ``images`` is the loop's output below

    def encode(texts: list[str], seen: dict) -> dict[str, torch.Tensor]:
        if denoiser.tokenize is not None:  # its own text encoder, trained
            return {k: v.to(device) for k, v in denoiser.tokenize(texts).items()}
        return pre.encode_prompt(texts, **seen)

    if denoiser.image_to_video or call_inputs is not None or scheduler is not None:
        batch_size = 1
    own = pipe.scheduler
    try:
        for start in range(0, len(prompts), batch_size):
            rows = slice(start, start + batch_size)
            gens = [torch.Generator(device).manual_seed(int(s)) for s in seeds[rows]]
            if scheduler is not None:
                pipe.scheduler = scheduler(gens[0])
            with torch.no_grad():
                seen = {"images": [first_images[start]]} if denoiser.prompt_sees_image else {}
                cond = encode(prompts[rows], seen)
                against = encode([negative], seen) if negative is not None else None
                video = {"num_frames": num_frames} if denoiser.video and call_inputs is None else {}
                if denoiser.image_to_video:
                    video["image"] = first_images[start]
                if guidance_scale_2 is not None:
                    video["guidance_scale_2"] = guidance_scale_2
                result = pipe(num_inference_steps=num_steps, guidance_scale=guidance_scale, height=height,
                              width=width, generator=gens, output_type="pt",
                              **denoiser.pipeline_inputs(cond, against), **denoiser.pipeline_kwargs, **video,
                              **(call_inputs or {}))
                # videos come as frames (N, T, 3, H, W)
                images = result.frames.transpose(1, 2) if denoiser.video else result.images
            out.append(images.float().cpu() * 2 - 1)
    finally:
        pipe.vae.to(vae_home)
        pipe.scheduler = own
    return torch.cat(out)
