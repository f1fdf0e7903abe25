"""Identity score of generated images or videos against reference images: the cosine similarity of image-encoder
embeddings, averaged over every (frame, reference) pair of a sample, then over samples. This is DreamBooth's CLIP-I /
DINO metric (Ruiz et al. 2023, sec. 4.1: "average pairwise cosine similarity between ViT embeddings of generated and
real images"), applied per frame; the mean (not the max) over references, as DreamBooth averages all pairs.

The encoder is read from a local folder and picked by its config (``AutoConfig``): CLIP
(``CLIPVisionModelWithProjection``, ``image_embeds``) or DINOv2 (``Dinov2Model``, the CLS token of
``last_hidden_state``), with the folder's image processor (``AutoImageProcessor``). Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ditforge.errors import UserError

ENCODERS = ("clip", "clip_vision_model", "dinov2")  # config.model_type values read


def load_encoder(folder: str | Path, device: torch.device | str = "cpu"):
    """``(embed, processor)``: ``embed(pixel_values) -> (B, D) float64`` L2-normalised, and the folder's image
    processor. Raises UserError: not a local folder, transformers missing, or a model neither CLIP nor DINOv2."""
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise UserError(f"--image_encoder {folder}: not a local model folder (expected config.json and "
                        "preprocessor_config.json, as save_pretrained writes them)")
    try:
        from transformers import AutoConfig, AutoImageProcessor, CLIPVisionModelWithProjection, Dinov2Model
    except ImportError as e:
        raise UserError(f"--image_encoder needs transformers: pip install 'ditforge[eval]' ({e})") from None
    kind = AutoConfig.from_pretrained(path).model_type
    if kind not in ENCODERS:
        raise UserError(f"--image_encoder {folder}: a {kind!r} model; expected CLIP or DINOv2 (model_type clip, "
                        "clip_vision_model or dinov2)")
    try:
        processor = AutoImageProcessor.from_pretrained(path)
        if kind == "dinov2":
            model = Dinov2Model.from_pretrained(path).to(device).eval()
            features = lambda pixels: model(pixel_values=pixels).last_hidden_state[:, 0]  # noqa: E731 CLS token
        else:
            model = CLIPVisionModelWithProjection.from_pretrained(path).to(device).eval()
            features = lambda pixels: model(pixel_values=pixels).image_embeds  # noqa: E731
    except (OSError, ValueError) as e:
        raise UserError(f"--image_encoder {folder}: no model or image processor ({str(e).splitlines()[0]})") from None

    @torch.no_grad()
    def embed(pixels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(features(pixels.to(device)).double(), dim=-1)

    return embed, processor


def _embed_images(images: np.ndarray, embed, processor, batch_size: int) -> torch.Tensor:
    """(N, H, W, C) uint8 (C 1 or 3) -> (N, D) float64 unit embeddings."""
    images = np.repeat(images, 3, axis=-1) if images.shape[-1] == 1 else images
    return torch.cat([embed(processor(images=list(images[s : s + batch_size]), return_tensors="pt")["pixel_values"])
                      for s in range(0, len(images), batch_size)]).cpu()


def identity_scores(samples: np.ndarray, references: np.ndarray, encoder: str | Path,
                    device: torch.device | str = "cpu", batch_size: int = 64) -> list[float]:
    """Per-sample identity scores: ``mean_t mean_r cos(E(frame_t), E(ref_r))``.

    Args:
        samples: images (N, H, W, C) or videos (N, T, H, W, C), uint8.
        references: reference images (R, H', W', C) uint8 (sizes need not match the samples: the processor
            resizes both).
        encoder: a local CLIP or DINOv2 folder (``load_encoder``).

    Returns:
        N floats in [-1, 1].

    Raises:
        UserError: see ``load_encoder``.
    """
    embed, processor = load_encoder(encoder, device)
    videos = samples if samples.ndim == 5 else samples[:, None]
    ref = _embed_images(references, embed, processor, batch_size)  # (R, D)
    frames = _embed_images(videos.reshape(-1, *videos.shape[2:]), embed, processor, batch_size)  # (N*T, D)
    cos = (frames @ ref.T).reshape(len(videos), videos.shape[1], len(ref))
    return cos.mean(dim=(1, 2)).tolist()


def read_references(files: list[str]) -> np.ndarray:
    """``--reference_image`` files, each read as RGB (``data.images.open_rgb``, the one reader of a conditioning
    image) and resized to the first one's size (the processor resizes them all again): (R, H, W, 3) uint8.
    Raises UserError: a missing or unreadable file."""
    from PIL import Image

    from ditforge.data.images import open_rgb

    images = [open_rgb(f, f"--reference_image {f}") for f in files]
    size = images[0].size
    return np.stack([np.asarray(i if i.size == size else i.resize(size, Image.BICUBIC)) for i in images])


def read_identity_samples(source: str, num_frames: int) -> np.ndarray:
    """``--samples`` for ``--metrics identity``: videos (an .npz of (N, T, H, W, C) or a folder of videos, the
    first ``num_frames`` frames: ``fvd.read_videos``) or images (``readers.read_images``)."""
    from ditforge.data.video import VIDEO_EXTENSIONS
    from ditforge.eval.fvd import read_videos
    from ditforge.eval.readers import read_images, read_npz

    path = Path(source)
    is_video = (path.is_dir() and any(f.suffix.lower() in VIDEO_EXTENSIONS for f in path.rglob("*"))) or (
        path.is_file() and path.suffix == ".npz" and any(a.ndim == 5 for a in read_npz(path, "--samples").values()))
    return read_videos(source, "--samples", num_frames) if is_video else read_images(source, "--samples")[0]
