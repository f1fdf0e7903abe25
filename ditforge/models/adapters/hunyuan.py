"""HunyuanVideo text-to-video: diffusers' ``HunyuanVideoTransformer3DModel`` (double-stream then single-stream
blocks, as FLUX, over 1 x 2 x 2 patches of the causal 3-D VAE's latents; a Llama encoder's states through a token
refiner, a CLIP pooled vector, and a distilled guidance scale embedded like the timestep) trained with flow matching,
shift 7 (its ``FlowMatchEulerDiscreteScheduler``; ``ditforge.diffusion.objective``). Sources of the calls below:
diffusers' ``pipelines/hunyuan_video/pipeline_hunyuan_video.py`` (``HunyuanVideoPipeline.__call__`` and
``encode_prompt``)."""

from __future__ import annotations

import numpy as np

from ditforge.models.adapters import DiffusersDenoiser, call_default

TRAIN_GUIDANCE = 1.0  # the embedded guidance scale fine-tuning runs at (finetrainers, musubi-tuner, diffusion-pipe)


class HunyuanVideoDenoiser(DiffusersDenoiser):
    """``transformer(hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, pooled_projections,
    guidance)``: x (B, 16, T', H/8, W/8) float latents of ``AutoencoderKLHunyuanVideo`` (T' = (T - 1) / 4 + 1 for
    T = 4k + 1 frames; times its ``scaling_factor`` 0.476986), t (B,) float = 1000 sigma; condition
    ``encoder_hidden_states`` (B, L, 4096) float Llama states (the third-to-last layer, the prompt template's
    system part cropped off) with ``encoder_attention_mask`` (B, L) and ``pooled_projections`` (B, 768) CLIP pooled
    states, all of ``pipe.encode_prompt(..., max_sequence_length=L)``, L the call's default (256). ``guidance`` (B,)
    float: 1000 x the embedded guidance scale of the guidance-distilled model; the pipeline samples at its
    ``guidance_scale`` (6.0), fine-tuning trains at ``TRAIN_GUIDANCE`` (1.0), as finetrainers and musubi-tuner do.
    Output (B, 16, T', h, w): the velocity noise - x0."""

    family = "hunyuan_video"
    pipelines = ("HunyuanVideoPipeline",)
    component = "transformer"
    block_classes = ("HunyuanVideoTransformerBlock", "HunyuanVideoSingleTransformerBlock")
    video = True
    embedded_guidance = True
    # the transformer attends over the video and text tokens jointly under the text's padding mask, in every block
    masked_self_attention = True
    fps = 24  # HunyuanVideo is trained on (and exports) 24 fps clips
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    pipeline_embeds = {"encoder_hidden_states": "prompt_embeds", "encoder_attention_mask": "prompt_attention_mask",
                       "pooled_projections": "pooled_prompt_embeds"}

    def denoise(self, x, t, encoder_hidden_states, encoder_attention_mask, pooled_projections, guidance=None):
        if guidance is None:
            guidance = x.new_full((x.shape[0],), TRAIN_GUIDANCE * 1000.0)
        return self.transformer(hidden_states=x, timestep=t, encoder_hidden_states=encoder_hidden_states,
                                encoder_attention_mask=encoder_attention_mask, pooled_projections=pooled_projections,
                                guidance=guidance, return_dict=False)[0]

    @staticmethod
    def encode_prompt(pipe, texts, device):
        length = call_default(pipe, "max_sequence_length")
        embeds, pooled, mask = pipe.encode_prompt(list(texts), device=device, max_sequence_length=length)
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask, "pooled_projections": pooled}

    @staticmethod
    def timestep_kwargs(pipe, latent_shape: tuple[int, ...], steps: int) -> dict:
        """The sigmas ``HunyuanVideoPipeline.__call__`` passes: linear from 1 down, ``steps`` of them (then shifted
        by the scheduler's shift)."""
        return {"sigmas": np.linspace(1.0, 0.0, steps + 1)[:-1]}
