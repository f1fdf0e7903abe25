"""CLIP score of text-to-image samples against their prompts: ``max(100 * cos(E_image, E_text), 0)`` per sample,
averaged (Hessel et al. 2021, CLIPScore, eq. 1, with w = 100 as torchmetrics and the diffusers evaluation guide
report it); of videos, every frame's against its video's prompt, averaged over the frames (Wu et al. 2021,
GODIVA's CLIPSIM), with transformers' ``CLIPModel`` and ``CLIPProcessor`` read from a local folder (e.g. a copy of
openai/clip-vit-large-patch14; nothing is downloaded). torchmetrics' ``clip_score`` would be the library for it,
but its 1.9 release breaks on transformers 5, whose ``get_image_features`` returns an output object."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ditforge.errors import UserError


def clip_score(images: np.ndarray, prompts: list[str], clip: str | Path, device: torch.device | str = "cpu",
               batch_size: int = 64) -> float:
    """The CLIP score of images against their prompts.

    Args:
        images: (N, H, W, C) uint8, C 1 (repeated to RGB) or 3; CLIP's processor resizes and crops them. Videos:
            (N, T, H, W, C), each of the T frames scored against its video's prompt.
        prompts: N strings, prompt i for image (video) i.
        clip: a local folder holding a ``CLIPModel`` and its ``CLIPProcessor`` (``save_pretrained`` layout).
        batch_size: images (frames) per CLIP batch.

    Returns:
        The score, in [0, 100]: the mean over the N images, or over the N x T frames (every video has T).

    Raises:
        UserError: no such folder, no CLIP model or processor in it, transformers missing, or a number of prompts
            other than N.
    """
    if len(prompts) != len(images):
        raise UserError(f"--clip: {len(prompts)} prompts for {len(images)} images")
    if images.ndim == 5:  # videos: their frames, each with its video's prompt
        prompts = [p for p in prompts for _ in range(images.shape[1])]
        images = images.reshape(-1, *images.shape[2:])
    folder = Path(clip)
    if not (folder / "config.json").is_file():
        raise UserError(f"--clip {clip}: not a local CLIP folder (expected config.json and the processor's files, as "
                        "CLIPModel.save_pretrained and CLIPProcessor.save_pretrained write them)")
    try:
        from transformers import CLIPModel, CLIPProcessor
    except ImportError as e:
        raise UserError(f"--clip needs transformers: pip install 'ditforge[eval]' ({e})") from None
    try:
        model = CLIPModel.from_pretrained(folder).to(device).eval()
        processor = CLIPProcessor.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise UserError(f"--clip {clip}: not a CLIP model and processor ({str(e).splitlines()[0]})") from None
    scores = []
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            batch = images[start : start + batch_size]
            batch = np.repeat(batch, 3, axis=-1) if batch.shape[-1] == 1 else batch
            inputs = processor(text=list(prompts[start : start + batch_size]), images=list(batch),
                               return_tensors="pt", padding=True, truncation=True).to(device)
            out = model(**inputs)  # image_embeds, text_embeds: projected and L2-normalised
            cos = (out.image_embeds.double() * out.text_embeds.double()).sum(-1)
            scores.append((100 * cos).clamp_min(0).cpu())
    return torch.cat(scores).mean().item()
