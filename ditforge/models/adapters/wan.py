"""Wan 2.1 text-to-video: diffusers' ``WanTransformer3DModel`` (a DiT over 3-D patches of the causal video VAE's
latents, cross-attending to UMT5 states) trained with flow matching (its ``UniPCMultistepScheduler`` runs on flow
sigmas with ``flow_shift``; ``ditforge.diffusion.objective``). Source of the calls below: diffusers'
``pipelines/wan/pipeline_wan.py`` (``WanPipeline.__call__`` and ``encode_prompt``)."""

from __future__ import annotations

import inspect

from ditforge.models.adapters import DiffusersDenoiser


class WanDenoiser(DiffusersDenoiser):
    """``transformer(hidden_states, timestep, encoder_hidden_states)``: x (B, 16, T', H/8, W/8) float latents of
    ``AutoencoderKLWan`` (T' = (T - 1) / 4 + 1 for T = 4k + 1 frames; normalised per channel by the VAE's
    ``latents_mean`` / ``latents_std``, ``ditforge.encoders.vae``), t (B,) float = 1000 sigma (the pipeline feeds
    the scheduler's timesteps, expanded to the batch), condition ``encoder_hidden_states`` (B, L, text_dim) float
    UMT5 states of ``pipe.encode_prompt(..., do_classifier_free_guidance=False, max_sequence_length=L)``, L the
    pipeline call's default (512), zero past each prompt's tokens. Output (B, 16, T', H/8, W/8): the velocity
    noise - x0."""

    family = "wan"
    pipelines = ("WanPipeline",)
    component = "transformer"
    block_classes = ("WanTransformerBlock",)
    video = True
    # LoRA on the self- and cross-attention projections (finetrainers' default for Wan)
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    pipeline_embeds = {"encoder_hidden_states": "prompt_embeds"}

    @staticmethod
    def unsupported(pipe):
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("boundary_ratio") is not None:
            return ("a Wan 2.2 pipeline with two transformers (transformer_2, boundary_ratio); ditforge fine-tunes "
                    "Wan 2.1's one")
        if pipe.config.get("expand_timesteps"):
            return "a Wan 2.2 TI2V pipeline (expand_timesteps: a timestep per token); ditforge fine-tunes Wan 2.1"
        return None

    def denoise(self, x, t, encoder_hidden_states):
        return self.transformer(hidden_states=x, timestep=t, encoder_hidden_states=encoder_hidden_states,
                                return_dict=False)[0]

    @staticmethod
    def encode_prompt(pipe, texts, device):
        length = inspect.signature(pipe.__call__).parameters["max_sequence_length"].default
        embeds, _ = pipe.encode_prompt(list(texts), do_classifier_free_guidance=False, device=device,
                                       max_sequence_length=length)
        return {"encoder_hidden_states": embeds}
