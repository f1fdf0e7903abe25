"""Wan2.1-VACE (all-in-one video creation and editing; Jiang et al. 2025, arXiv 2503.07598): Wan 2.1's text-to-video
transformer plus a control branch, diffusers' ``WanVACETransformer3DModel``, whose ``vace_blocks`` read
``control_hidden_states`` and add their hints to the main blocks at ``vace_layers``. The control is built from
reference images, a control video and its mask as diffusers' ``pipelines/wan/pipeline_wan_vace.py`` builds it
(``WanVACEPipeline.__call__``, ``preprocess_conditions``, ``prepare_video_latents``, ``prepare_masks``); this
adapter calls those methods of the loaded pipeline, so the tensors are the pipeline's own.

Fine-tuning (LoRA or full) builds the same control from each clip's reference images alone
(``Pretrained.encode_references``) and puts the references' latent frames before the clip's in x0
(``encoders.batch.PREFIX``), as DiffSynth-Studio's Wan VACE training does (``WanVideoUnit_InputVideoEmbedder``).

Everything else (the UMT5 prompt, the VAE, the flow objective, the LoRA targets) is ``WanDenoiser``'s."""

from __future__ import annotations

from typing import Any

import torch

from ditforge.models.adapters.wan import WAN_UMT5, WAN_VAE, WanDenoiser


class WanVACEDenoiser(WanDenoiser):
    """``transformer(x, timestep, encoder_hidden_states, control_hidden_states)``: x (B, 16, R + T', h, w) float, the
    latents of ``WanDenoiser`` with R leading latent frames for the R reference images (the pipeline draws its noise
    for ``num_frames + 4 R`` frames and drops the first R latent frames before decoding, ``prepended_frames``);
    ``control_hidden_states`` (B, 96, R + T', h, w) from ``encode_control``; the hints' scale is the transformer's
    default, 1 at every VACE layer (the pipeline's ``conditioning_scale`` default 1.0). Output: the velocity of all
    R + T' frames.

    Not available: context parallelism (diffusers 0.42.1's ``WanVACETransformer3DModel`` has no ``_cp_plan``, and
    its control tokens would need the same split), and the transformer in the original release's layout (diffusers'
    ``convert_wan_transformer_to_diffusers`` renames the VACE blocks, ``WAN_TRANSFORMER`` does not): the VAE's
    and the text encoder's layouts only."""

    family = "vace"
    pipelines = ("WanVACEPipeline",)
    block_classes = ("WanTransformerBlock", "WanVACETransformerBlock")
    takes_references = True
    adds_between_blocks = True  # the hints, after the blocks at vace_layers
    context_parallel = ()
    original_layouts = {"vae": WAN_VAE, "text_encoder": WAN_UMT5}

    @staticmethod
    def unsupported(pipe, sampling: bool = False, expert: str | None = None):
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("boundary_ratio") is not None:
            return "a Wan 2.2 VACE pipeline of two experts (ditforge takes Wan2.1-VACE's one transformer)"
        return WanDenoiser.unsupported(pipe, sampling, expert)

    def denoise(self, x, t, encoder_hidden_states, control_hidden_states):
        return self.inner(hidden_states=x, timestep=t, encoder_hidden_states=encoder_hidden_states,
                          control_hidden_states=control_hidden_states.to(x.dtype), return_dict=False)[0]

    @staticmethod
    def encode_control(pipe: Any, references: list, video: list | None, mask: list | None, height: int, width: int,
                       num_frames: int, device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
        """(the control conditioning, R = the latent frames prepended for the references) of one video, as
        ``WanVACEPipeline.__call__`` builds it from ``reference_images=references`` (R PIL images; none: text-to-video with the control alone),
        ``video`` (``num_frames`` PIL frames, or None: zeros, the pipeline's default) and ``mask`` (PIL frames of the
        video's size, white = generate; None: all ones, the pipeline's default, generate everything):
        ``preprocess_conditions`` (each reference scaled to fit the frame and centred on a white canvas),
        ``prepare_video_latents`` (the posterior modes of the video's inactive ``video (1 - m)`` and reactive
        ``video m`` parts, m the mask > 0.5, 16 + 16 channels, normalised by ``latents_mean`` / ``latents_std``;
        each reference's latent frame, with 16 zero channels, prepended) and ``prepare_masks`` (the mask folded
        8 x 8 pixels into 64 channels at the latent frames, nearest-exact; zeros at the reference frames).

        Returns ``{"control_hidden_states": (1, 96, R + T', h, w) float32}`` on ``device``, and R. Raises nothing
        of its own (diffusers' errors pass through)."""
        with torch.no_grad():
            # no references: None, the pipeline's default (its list-of-lists branch cannot take an empty list)
            video, mask, refs = pipe.preprocess_conditions(video, mask, [list(references)] if references else None,
                                                           1, height, width, num_frames, torch.float32, device)
            latents = pipe.prepare_video_latents(video, mask, refs, None, device)
            control = torch.cat([latents, pipe.prepare_masks(mask, refs, None)], dim=1)
        return {"control_hidden_states": control.float()}, len(refs[0])
