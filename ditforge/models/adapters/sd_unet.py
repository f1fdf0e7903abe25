"""Stable Diffusion 1.x / 2.x and XL: diffusers' ``UNet2DConditionModel`` conditioned on CLIP text states."""

from __future__ import annotations

import torch

from ditforge.models.adapters import DiffusersDenoiser
from ditforge.models.adapters.limits import tokenizer_limit


class SDUNetDenoiser(DiffusersDenoiser):
    """``unet(x, t, encoder_hidden_states)``: x (B, 4, H/8, W/8) latents, t (B,) int64 in 0..999, condition
    ``encoder_hidden_states`` (B, 77, D_text) (CLIP's last hidden states, D_text 768 for SD 1.x, 1024 for 2.x).
    Repeated blocks: the transformer blocks and the ResNet blocks (diffusers checkpoints both)."""

    family = "sd"
    pipelines = ("StableDiffusionPipeline",)
    component = "unet"
    block_classes = ("BasicTransformerBlock", "ResnetBlock2D")
    pipeline_embeds = {"encoder_hidden_states": "prompt_embeds"}

    text_encoder_trainable = True  # CLIP, as diffusers' train_dreambooth.py --train_text_encoder

    def embed(self, cond):
        if "input_ids" not in cond:
            return cond
        return {"encoder_hidden_states": self.text_encoder(cond["input_ids"], return_dict=False)[0]}

    @staticmethod
    def token_ids(pipe, texts):
        """Prompts -> ``{"input_ids": (B, 77)}`` as the pipeline's ``encode_prompt`` tokenizes them."""
        tok = pipe.tokenizer
        ids = tok(list(texts), padding="max_length", max_length=tok.model_max_length, truncation=True,
                  return_tensors="pt").input_ids
        return {"input_ids": ids}

    @classmethod
    def text_limits(cls, pipe):
        """CLIP's tokenizer's ``model_max_length`` (77), to which the pipeline tokenizes; a UNet takes any length
        and size."""
        return (tokenizer_limit(pipe),)

    def denoise(self, x, t, encoder_hidden_states):
        return self.unet(x, t, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]

    @staticmethod
    def encode_prompt(pipe, texts, device):
        embeds, _ = pipe.encode_prompt(list(texts), device, 1, False)
        return {"encoder_hidden_states": embeds}


class SDXLUNetDenoiser(DiffusersDenoiser):
    """Stable Diffusion XL: ``unet(x, t, encoder_hidden_states, added_cond_kwargs)``: x (B, 4, H/8, W/8), t (B,)
    int64, conditions ``encoder_hidden_states`` (B, 77, 2048) (the penultimate states of CLIP-L and OpenCLIP-G,
    concatenated) and ``text_embeds`` (B, 1280) (OpenCLIP-G's projected pooled output). The micro-conditioning
    ``time_ids`` (Podell et al. 2023, "SDXL", section 2.2: original size, crop top-left, target size) are
    (H, W, 0, 0, H, W) of the image being denoised, what ``StableDiffusionXLPipeline`` passes by default: the
    data pipeline centre-crops and resizes, so every training image is an uncropped image of the target size.
    The text encoders stay frozen (``--train_text_encoder`` is for SD 1.x / 2.x). The unconditional input is
    zeros where the pipeline says ``force_zeros_for_empty_prompt`` (SDXL base's config), as its sampling uses."""

    family = "sdxl"
    pipelines = ("StableDiffusionXLPipeline",)
    component = "unet"
    block_classes = ("BasicTransformerBlock", "ResnetBlock2D")
    pipeline_embeds = {"encoder_hidden_states": "prompt_embeds", "text_embeds": "pooled_prompt_embeds"}

    @staticmethod
    def null_condition(pipe, empty):
        if pipe.config.get("force_zeros_for_empty_prompt", False):
            return {k: torch.zeros_like(v) for k, v in empty.items()}
        return empty

    @classmethod
    def text_limits(cls, pipe):
        """Both CLIP tokenizers' ``model_max_length`` (77 each)."""
        return tuple(tokenizer_limit(pipe, name) for name in ("tokenizer", "tokenizer_2")
                     if getattr(pipe, name, None) is not None)

    def denoise(self, x, t, encoder_hidden_states, text_embeds):
        h, w = x.shape[-2] * self.vae_scale, x.shape[-1] * self.vae_scale
        time_ids = torch.tensor([h, w, 0, 0, h, w], dtype=text_embeds.dtype, device=x.device).expand(len(x), 6)
        return self.unet(x, t, encoder_hidden_states=encoder_hidden_states,
                         added_cond_kwargs={"text_embeds": text_embeds, "time_ids": time_ids}, return_dict=False)[0]

    @staticmethod
    def encode_prompt(pipe, texts, device):
        embeds, _, pooled, _ = pipe.encode_prompt(list(texts), device=device, num_images_per_prompt=1,
                                                  do_classifier_free_guidance=False)
        return {"encoder_hidden_states": embeds, "text_embeds": pooled}
