"""Stable Diffusion 3 / 3.5: diffusers' ``SD3Transformer2DModel`` (MM-DiT) on CLIP-L + CLIP-G + T5 states, trained
with rectified flow (its scheduler is ``FlowMatchEulerDiscreteScheduler``)."""

from __future__ import annotations


from ditforge.models.adapters import DiffusersDenoiser
from ditforge.models.adapters.limits import call_default_limit, tokenizer_limit


class SD3Denoiser(DiffusersDenoiser):
    """``transformer(x, encoder_hidden_states, pooled_projections, timestep)``: x (B, 16, H/8, W/8), t (B,) float =
    1000 sigma, conditions ``encoder_hidden_states`` (B, 77 + L_T5, 4096) (the CLIP pair's states padded to the T5
    width, then T5's; L_T5 = the pipeline call's ``max_sequence_length`` default, 256: ``text_limits``) and
    ``pooled_projections`` (B, 2048) (both CLIPs' pooled outputs)."""

    family = "sd3"
    pipelines = ("StableDiffusion3Pipeline",)
    component = "transformer"
    block_classes = ("JointTransformerBlock",)
    pipeline_embeds = {"encoder_hidden_states": "prompt_embeds", "pooled_projections": "pooled_prompt_embeds"}

    def denoise(self, x, t, encoder_hidden_states, pooled_projections):
        return self.transformer(x, encoder_hidden_states=encoder_hidden_states,
                                pooled_projections=pooled_projections, timestep=t, return_dict=False)[0]

    @classmethod
    def text_limits(cls, pipe):
        """T5's: the call's ``max_sequence_length`` default (the joint attention takes any length); the CLIP pair's:
        their tokenizer's ``model_max_length`` (77)."""
        return (call_default_limit(pipe, "tokenizer_3"), tokenizer_limit(pipe, "tokenizer"))

    @staticmethod
    def size_refused(pipe, height, width, num_frames):
        """The transformer's positional table (``PatchEmbed.cropped_pos_embed``) holds ``pos_embed_max_size`` patches
        a side (192 for SD3.5 Large: 3072 px), cropped to the image's."""
        config = pipe.transformer.config
        most = config.get("pos_embed_max_size")
        side = most * config.patch_size * int(pipe.vae_scale_factor) if most else None
        if side is None or max(height, width) <= side:
            return None
        return f"sides up to {side} px ({most} patches: the transformer config's pos_embed_max_size)"

    @classmethod
    def encode_prompt(cls, pipe, texts, device):
        embeds, _, pooled, _ = pipe.encode_prompt(list(texts), None, None, device=device,
                                                  do_classifier_free_guidance=False,
                                                  max_sequence_length=cls.text_length(pipe))
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}
