"""Stable Diffusion 3 / 3.5: diffusers' ``SD3Transformer2DModel`` (MM-DiT) on CLIP-L + CLIP-G + T5 states, trained
with rectified flow (its scheduler is ``FlowMatchEulerDiscreteScheduler``)."""

from __future__ import annotations


from ditforge.models.adapters import DiffusersDenoiser, call_default


class SD3Denoiser(DiffusersDenoiser):
    """``transformer(x, encoder_hidden_states, pooled_projections, timestep)``: x (B, 16, H/8, W/8), t (B,) float
    = 1000 sigma, conditions ``encoder_hidden_states`` (B, 77 + L_T5, 4096) (the CLIP pair's states padded to the
    T5 width, then T5's; L_T5 = the pipeline's ``max_sequence_length``, 256) and ``pooled_projections``
    (B, 2048) (both CLIPs' pooled outputs)."""

    family = "sd3"
    pipelines = ("StableDiffusion3Pipeline",)
    component = "transformer"
    block_classes = ("JointTransformerBlock",)
    pipeline_embeds = {"encoder_hidden_states": "prompt_embeds", "pooled_projections": "pooled_prompt_embeds"}

    def denoise(self, x, t, encoder_hidden_states, pooled_projections):
        return self.transformer(x, encoder_hidden_states=encoder_hidden_states,
                                pooled_projections=pooled_projections, timestep=t, return_dict=False)[0]

    @staticmethod
    def encode_prompt(pipe, texts, device):
        length = call_default(pipe, "max_sequence_length")
        embeds, _, pooled, _ = pipe.encode_prompt(list(texts), None, None, device=device,
                                                  do_classifier_free_guidance=False, max_sequence_length=length)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}
