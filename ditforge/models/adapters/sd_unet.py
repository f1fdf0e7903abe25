"""Stable Diffusion 1.x / 2.x: diffusers' ``UNet2DConditionModel`` conditioned on CLIP text states."""

from __future__ import annotations


from ditforge.models.adapters import DiffusersDenoiser


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

    def denoise(self, x, t, encoder_hidden_states):
        return self.unet(x, t, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]

    @staticmethod
    def encode_prompt(pipe, texts, device):
        embeds, _ = pipe.encode_prompt(list(texts), device, 1, False)
        return {"encoder_hidden_states": embeds}
