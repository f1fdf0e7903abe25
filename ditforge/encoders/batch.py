"""From a data loader's batch to what the denoiser trains on: the latent posterior and the condition.

One place for both ways of feeding a run (encoding pixels and captions on the fly, or reading features that
``ditforge extract-features`` stored), so that the two give the same training loss for the same seed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from ditforge.encoders.text import TextEncoder, pad_states
from ditforge.encoders.vae import VAE, IdentityVAE


def as_batch(raw) -> dict:
    """A loader batch as a dict: image data sets yield ``(pixels, labels)`` pairs; video and feature data sets
    yield dicts already (``video`` is renamed ``x``). Keys: see ``BatchEncoder``."""
    if isinstance(raw, Mapping):
        batch = dict(raw)
        if "video" in batch:
            batch["x"] = batch.pop("video")
        return batch
    x, label = raw
    return {"x": x, "label": label}


PREFIX = "x0_prefix"  # conditioning's latent frames that lead x0 (reference-image families), noised and learned as x0


class BatchEncoder:
    """Turns batches into the denoiser's inputs.

    A batch (``as_batch``) holds either pixels ``x`` (B, C, H, W) or (B, C, T, H, W) float in [-1, 1], or stored
    features ``mean`` and ``std`` (the scaled latent posterior, see ``VAE.encode_moments``); and either ``label``
    (B,) int64, ``text`` (B captions), or stored ``text_states`` (B, L, D_text) with ``text_mask`` (B, L) bool.

    Args:
        condition: "class" or "text".
        vae: the frozen autoencoder (``IdentityVAE`` for pixel space); None when only features are read.
        text_encoder: the frozen caption encoder (text condition with captions); None otherwise.
        text_length: L, the caption states are padded to (static shapes for compiled and CUDA-graphed steps);
            the encoder's ``max_length`` when None.
        class_captions: caption of each class label, for text conditioning on labelled images
            (e.g. "a handwritten digit seven").
        prompt_encoder: instead of ``text_encoder``, a function from captions to the denoiser's conditioning
            keywords (a pretrained pipeline's own encoders, ``Pretrained.encode_prompt``: e.g.
            ``{"encoder_hidden_states": (B, 77, 768)}``); ``conditioning`` then returns its dict.
        image_encoder: image-to-video pipelines (the adapter's ``image_to_video``; ``Pretrained.encode_image``): a function
            from first frames (B, 3, H, W) in [-1, 1], the clip's frame count and ``noise_seeds=`` (training noise
            seeds, or None) to more conditioning keywords, added to the prompt's; the first frame is the batch's
            ``image`` (a video CSV's ``image`` column) where it has one, else frame 0 of its pixels ``x``. Computed
            for every batch (the image differs per clip).
        prompt_sees_image: the prompt encoder takes the first frames too (``prompt_encoder(texts, images=first)``,
            the adapter's ``prompt_sees_image``): the captions are then encoded per batch, not cached.
        reference_encoder: reference-image pipelines (the adapter's ``takes_references``;
            ``Pretrained.encode_references``): a function from clips (B, 3, T, H, W) and references (B, R, 3, H, W)
            in [-1, 1] to (more conditioning keywords, the references' latent frames (B, C, R, h, w)); the
            references are the batch's ``references`` (a video CSV's ``reference_image`` column, a clip folder's
            ``clip.ref*.png``, else the step's ``data.video.default_reference``). The latent frames are returned
            under ``PREFIX``: they lead the clip's latents x0.
        driving_encoder: driven pipelines (the adapter's ``trained_videos``; ``Pretrained.encode_driving``): a
            function from clips (B, 3, T, H, W), character images (B, 3, H, W) (the batch's ``image``, a video CSV's
            ``image`` column, else frame 0 of the clip) and the batch (its driving videos, a video CSV's columns of
            those names) to (more conditioning keywords, the character's latent frames (B, C, 1, h, w)), returned
            under ``PREFIX`` as ``reference_encoder``'s.
    """

    def __init__(self, condition: str, vae: VAE | IdentityVAE | None = None, text_encoder: TextEncoder | None = None,
                 text_length: int | None = None, class_captions: Sequence[str] | None = None,
                 prompt_encoder: Callable[[list[str]], dict[str, torch.Tensor]] | None = None,
                 image_encoder: Callable[[torch.Tensor, int], dict[str, torch.Tensor]] | None = None,
                 prompt_sees_image: bool = False, reference_encoder: Callable | None = None,
                 driving_encoder: Callable | None = None):
        if condition not in ("class", "text"):
            raise ValueError(f"condition must be 'class' or 'text', got {condition!r}")
        self.condition = condition
        self.vae = vae
        self.text_encoder = text_encoder
        self.prompt_encoder = prompt_encoder
        self.image_encoder = image_encoder
        self.prompt_sees_image = prompt_sees_image
        self.reference_encoder = reference_encoder
        self.driving_encoder = driving_encoder
        self._prompts: dict[str, dict[str, torch.Tensor]] = {}
        self.text_length = text_length or (text_encoder.max_length if text_encoder is not None else None)
        self.class_captions = list(class_captions) if class_captions is not None else None
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def stochastic(self) -> bool:
        """Whether latents are drawn from a posterior with noise (a VAE), not given exactly (pixel space)."""
        return self.vae is not None and not isinstance(self.vae, IdentityVAE)

    @torch.no_grad()
    def moments(self, batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The scaled latent posterior: (mean, std) float32 on ``device``, std None in pixel space."""
        if "mean" in batch:
            std = batch.get("std")
            return batch["mean"].to(device, torch.float32), (std.to(device, torch.float32) if std is not None else None)
        if self.vae is None:
            raise ValueError("a batch of pixels needs a VAE (or IdentityVAE)")
        if not self.stochastic:
            return batch["x"].to(device, torch.float32), None
        mean, std = self.vae.encode_moments(batch["x"])
        return mean.to(device, torch.float32), std.to(device, torch.float32)

    @staticmethod
    def draw(mean: torch.Tensor, std: torch.Tensor | None, eps: torch.Tensor | None) -> torch.Tensor:
        """Latents x0 = mean + std * eps (the reparameterised posterior sample; ``mean`` when std is None)."""
        return mean if std is None else mean + std * eps

    @staticmethod
    def lead_with_prefix(mean: torch.Tensor, std: torch.Tensor | None, cond: dict[str, torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The posterior ``mean`` and ``std`` (B, C, T', h, w) with the conditioning's ``PREFIX`` frames (B, C, R, h,
        w; popped from ``cond``, a reference-image family's) leading them, clean (std 0): then noised and learned
        as x0 as the clip's are. Returns (mean, std, R); R = 0 and the inputs unchanged without a prefix."""
        prefix = cond.pop(PREFIX, None)
        if prefix is None:
            return mean, std, 0
        std = None if std is None else torch.cat([torch.zeros_like(prefix), std], dim=2)
        return torch.cat([prefix, mean], dim=2), std, prefix.shape[2]

    CACHE_SIZE = 1024  # captions; data sets with few distinct captions (UCF101: 101) are encoded once each

    @torch.no_grad()
    def encode_captions(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Captions -> (states (B, L, D_text) float32, mask (B, L) bool), padded to ``text_length``.

        The states of the first ``CACHE_SIZE`` distinct captions are kept (trimmed to their tokens), so data
        with repeated captions runs the text encoder once per caption; a caption's states do not depend on its
        batch (``TextEncoder.encode``), so cached and fresh states are equal.
        """
        if self.text_encoder is None:
            raise ValueError("text conditioning on captions needs a text encoder")
        missing = list(dict.fromkeys(t for t in texts if t not in self._cache))
        if missing:
            states, mask = self.text_encoder.encode(missing)
            fresh = {t: (s[:int(m.sum())].float(), m[:int(m.sum())]) for t, s, m in zip(missing, states, mask)}
            if len(self._cache) + len(fresh) > self.CACHE_SIZE:
                return self._pad([fresh.get(t) or self._cache[t] for t in texts])
            self._cache.update(fresh)
        return self._pad([self._cache[t] for t in texts])

    def _pad(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        padded = [pad_states(s[None], m[None], self.text_length) for s, m in items]
        return torch.cat([s for s, _ in padded]), torch.cat([m for _, m in padded])

    @torch.no_grad()
    def encode_prompts(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Captions -> ``prompt_encoder``'s dict, stacked by row; the rows of the first ``CACHE_SIZE`` distinct
        captions are kept (DreamBooth's one prompt, a data set's repeated captions are encoded once)."""
        missing = list(dict.fromkeys(t for t in texts if t not in self._prompts))
        fresh = {}
        if missing:
            out = self.prompt_encoder(missing)
            fresh = {t: {k: v[i:i + 1] for k, v in out.items()} for i, t in enumerate(missing)}
            if len(self._prompts) + len(fresh) <= self.CACHE_SIZE:
                self._prompts.update(fresh)
        rows = [fresh.get(t) or self._prompts[t] for t in texts]
        return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}

    @torch.no_grad()
    def conditioning(self, batch: dict, device: torch.device, noise_seeds: list[int] | None = None
                     ) -> dict[str, torch.Tensor]:
        """Keyword arguments of the denoiser for the condition: ``{"y": labels (B,) int64}``,
        ``{"y": states (B, L, D_text) float32, "y_mask": (B, L) bool}``, or ``prompt_encoder``'s dict (with
        ``image_encoder``'s added), on ``device``. ``noise_seeds``: B seeds for the image encoder's training noise
        (``Pretrained.encode_image``), or None. With ``reference_encoder`` (``driving_encoder``), also ``PREFIX``: the references' (character's) latent
        frames (B, C, R, h, w) float32, which the step puts before the clip's latents (not a denoiser keyword)."""
        if self.reference_encoder is not None and "x" in batch:
            cond = self._text_conditioning(batch, device)
            control, prefix = self.reference_encoder(batch["x"], batch["references"])
            return cond | {k: v.to(device) for k, v in control.items()} | {PREFIX: prefix.to(device)}
        if self.driving_encoder is not None and "x" in batch:
            cond = self._text_conditioning(batch, device)
            first = batch["image"] if "image" in batch else batch["x"][:, :, 0]
            control, prefix = self.driving_encoder(batch["x"], first, batch)
            return cond | {k: v.to(device) for k, v in control.items()} | {PREFIX: prefix.to(device)}
        if self.image_encoder is None or "cond" in batch:  # stored features hold it already
            return self._text_conditioning(batch, device)
        x = batch["x"]  # (B, 3, T, H, W)
        first = batch["image"] if "image" in batch else x[:, :, 0]
        if self.prompt_sees_image:  # per clip: the caption's encoding depends on its frame
            cond = {k: v.to(device) for k, v in self.prompt_encoder(list(batch["text"]), images=first).items()}
        else:
            cond = self._text_conditioning(batch, device)
        image = self.image_encoder(first, x.shape[2], noise_seeds=noise_seeds)
        cond.update({k: v.to(device) for k, v in image.items()})
        return cond

    def _text_conditioning(self, batch: dict, device: torch.device) -> dict[str, torch.Tensor]:
        if self.condition == "class":
            return {"y": torch.as_tensor(batch["label"]).to(device)}
        if "cond" in batch:  # stored features of a pretrained pipeline's prompt encoding
            return {k: v.to(device) for k, v in batch["cond"].items()}
        if "text_states" in batch:
            return {"y": batch["text_states"].to(device, torch.float32), "y_mask": batch["text_mask"].to(device)}
        texts = batch.get("text")
        if texts is None:
            if self.class_captions is None:
                raise ValueError("text conditioning needs captions, text states or class captions")
            texts = [self.class_captions[int(i)] for i in batch["label"]]
        if self.prompt_encoder is not None:
            return {k: v.to(device) for k, v in self.encode_prompts(texts).items()}
        states, mask = self.encode_captions(texts)
        return {"y": states.to(device, torch.float32), "y_mask": mask.to(device)}


def build_batch_encoder(cfg, dataset, device: torch.device, dtype: torch.dtype) -> tuple[BatchEncoder, dict]:
    """Load the encoders a run needs (``cfg``, a ``RunConfig``, read only) and say what follows from them and the
    data: the settings the run records (``"section.field"`` -> value, for ``config.sections.assign``; they are
    saved with the run, so sampling rebuilds the same model and encoders).

    Resolves ``--condition auto`` (text for video data and captioned images, class for labelled images), gives the
    model's ``in_channels``, ``input_size`` (image_size / the VAE's downsample), ``num_frames``, ``text_dim`` and
    ``text_max_length``, and the data's ``image_size`` and ``num_frames``. A features folder fixes all of them
    (its encoders are not loaded: the features are already encoded).

    Args:
        dataset: from ``ditforge.data.build_dataset``.
        device, dtype: where the encoders run, and the text encoder's weight dtype (the VAE stays float32).

    Returns:
        (the ``BatchEncoder``, the settings found).

    Raises:
        UserError: a VAE whose downsample does not divide ``--image_size``; ``--condition`` other than the
            features'; encoder loading errors (see ``load_vae``, ``load_text_encoder``).
    """
    from ditforge.encoders.text import load_text_encoder
    from ditforge.encoders.vae import load_vae
    from ditforge.errors import UserError

    m, data = cfg.model, cfg.data
    stored = getattr(dataset, "manifest", None)
    if stored is not None:  # features: everything was decided when they were extracted
        if m.condition not in ("auto", stored["condition"]):
            raise UserError(f"--condition {m.condition}: the features in {data.data} were extracted for "
                            f"{stored['condition']} conditioning")
        found = {f"model.{key}": stored[key] for key in ("condition", "vae", "text_encoder", "text_max_length",
                                                         "text_dim", "in_channels", "input_size", "num_frames")}
        found.update({"data.image_size": stored["image_size"], "data.num_frames": stored["num_frames"]})
        return BatchEncoder(stored["condition"], text_length=stored["text_max_length"]), found
    video = getattr(dataset, "num_frames", None) is not None
    condition = m.condition
    if condition == "auto":  # captioned images have no class labels (num_classes 0)
        condition = "text" if video or not dataset.num_classes else "class"
    vae = load_vae(m.vae, device, torch.float32, pixel_channels=dataset.in_channels)
    if dataset.image_size % vae.downsample:
        raise UserError(f"--image_size {dataset.image_size} is not divisible by the downsample factor "
                        f"{vae.downsample} of --vae {m.vae}")
    text_encoder = None
    if condition == "text":
        text_encoder = load_text_encoder(m.text_encoder, device, dtype, m.text_max_length)
    num_frames = dataset.num_frames if video else None
    found = {"model.condition": condition,
             "model.text_max_length": text_encoder.max_length if text_encoder is not None else None,
             "model.text_dim": text_encoder.hidden_size if text_encoder is not None else None,
             "data.image_size": dataset.image_size, "data.num_frames": num_frames,
             "model.in_channels": vae.latent_channels, "model.input_size": dataset.image_size // vae.downsample,
             "model.num_frames": num_frames}
    encoder = BatchEncoder(condition, vae, text_encoder, class_captions=getattr(dataset, "class_captions", None))
    return encoder, found


def pipeline_vae(pre):
    """A pretrained pipeline's VAE as ``encoders.vae.VAE``, with its family's frame rule (the adapter's
    ``vae_frame_factor``, ``vae_folds_pixels``)."""
    from ditforge.encoders.vae import VAE

    return VAE(pre.pipe.vae, path=str(pre.folder / "vae"), frame_factor=pre.denoiser.vae_frame_factor,
               folds_pixels=pre.denoiser.vae_folds_pixels)


def pipeline_batch_encoder(cfg, pre, dataset) -> tuple[BatchEncoder, dict]:
    """``build_batch_encoder`` for a pretrained pipeline (``pre``, a ``models.adapters.pipeline.Pretrained``): the
    ``BatchEncoder`` that feeds it (the pipeline's VAE, latents scaled by its config, and its own prompt encoding)
    and the run's model and data settings that follow from it (``"section.field"`` -> value: family, condition,
    VAE folder, channels, latent size and frames, pixel size and frames; no text encoder of ditforge's own).

    Raises:
        UserError: ``--model`` given (the folder decides the denoiser); class conditioning; video data for an image
            family or images for a video family; an ``--image_size`` the VAE and denoiser cannot take; a
            ``--num_frames`` the video VAE cannot take (the family's frame rule, e.g. 4k + 1), naming the nearest
            valid counts.
    """
    from ditforge.errors import UserError

    m, data = cfg.model, cfg.data
    where = f"--init_from {m.init_from}"
    stored = getattr(dataset, "init_from", False)
    if stored is not False and (stored is None or Path(stored).resolve() != Path(m.init_from).resolve()):
        raise UserError(f"--data {data.data}: its features were extracted "
                        + (f"with --init_from {stored}" if stored else "without --init_from") + f", not {where}")
    if m.model is not None:
        raise UserError(f"--model {m.model}: {where} decides the denoiser (a {pre.pipeline_class}); leave --model out")
    video = getattr(dataset, "num_frames", None) is not None
    if video != pre.denoiser.video:
        makes = "videos" if pre.denoiser.video else "images"
        short = (f" (a folder of clips reads so when every clip, taken at --frame_interval {data.frame_interval}, is "
                 "shorter than the VAE's frame rule allows: lower --frame_interval)" if pre.denoiser.video else "")
        raise UserError(f"--data {data.data} holds {'videos' if video else 'images'}{short}; {where} is a "
                        f"{pre.pipeline_class}, which makes {makes}")
    if m.condition == "class":
        raise UserError(f"--condition class: {where} is a text-to-{'video' if video else 'image'} "
                        f"{pre.pipeline_class}")
    scale, size, multiple = pre.denoiser.vae_scale, dataset.image_size, pre.side_multiple
    if size % multiple:
        raise UserError(f"--image_size {size}: {pre.pipeline_class} takes sides that are multiples of {multiple} "
                        f"(the VAE's downsample {scale} x the denoiser's own)")
    folder = pre.files.get("vae", str(pre.folder / "vae"))  # a --vae single file stays the run's record of it
    vae = pipeline_vae(pre)
    frames = dataset.num_frames if video else None
    if video and stored is not False:  # features store latents: their frames are the latent frames
        frames = (frames - 1) * vae.temporal + 1
    if video:
        vae.check_frames(frames, f"the VAE of {where}")
    pre.refuse_size(size, size, frames or 1, f"--image_size {size}" + (f" --num_frames {frames}" if video else ""))
    found = {"model.vae": folder, "model.family": pre.denoiser.family, "model.condition": "text",
             "model.in_channels": pre.denoiser.in_channels, "model.input_size": size // scale,
             "model.num_frames": vae.latent_frames(frames) if video else None,  # the denoiser's (latent) frames
             "model.learn_sigma": pre.denoiser.learn_sigma, "model.text_encoder": None, "model.text_dim": None,
             "model.text_max_length": None, "data.image_size": size, "data.num_frames": frames}
    return pipeline_encoder(pre, vae, getattr(dataset, "class_captions", None)), found


def pipeline_encoder(pre, vae=None, class_captions: Sequence[str] | None = None) -> BatchEncoder:
    """The ``BatchEncoder`` of a pretrained pipeline ``pre``: its VAE (``vae``, default ``pipeline_vae(pre)``), its
    own prompt encoding, and its family's image, reference or driving-video conditioning (the adapter's
    ``image_to_video``, ``takes_references``, ``trained_videos``), as fine-tuning encodes a batch; the one
    ``ditforge distill --data`` encodes real clips with (``train.distill_real``)."""
    den = pre.denoiser
    return BatchEncoder("text", vae or pipeline_vae(pre), prompt_encoder=pre.encode_prompt,
                        class_captions=class_captions,
                        image_encoder=pre.encode_image if den.image_to_video else None,
                        prompt_sees_image=den.prompt_sees_image,
                        reference_encoder=pre.encode_references if den.takes_references else None,
                        driving_encoder=pre.encode_driving if den.trained_videos else None)
