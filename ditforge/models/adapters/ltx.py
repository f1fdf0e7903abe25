"""LTX-Video text- and image-to-video (0.9.x): diffusers' ``LTXVideoTransformer3DModel`` (a DiT over the tokens of a
VAE that compresses 32 x 32 x 8 pixels into one 128-channel latent, cross-attending to T5 states under their attention
mask) trained with flow matching, its shift following the video's latent size (the scheduler's dynamic shifting;
``ditforge.diffusion.objective``). Sources of the calls below: diffusers' ``pipelines/ltx/pipeline_ltx.py``
(``LTXPipeline.__call__``, ``encode_prompt``, ``_pack_latents`` / ``_unpack_latents``) and
``pipelines/ltx/pipeline_ltx_image2video.py`` (``LTXImageToVideoPipeline.__call__`` and ``prepare_latents``). Its VAE's
per-channel statistics are buffers, with the config's scaling factor on top (``pipeline_ltx.py``'s
``_normalize_latents``: (z - mean) x scaling_factor / std; ``encoders.VAE`` reads them).

The original layout (``LTX_VIDEO_TRANSFORMER``: Lightricks' ``ltx-video-2b-v0.9*.safetensors``, which ComfyUI loads
as they are) is the inverse of diffusers' ``convert_ltx_transformer_checkpoint_to_diffusers``
(``loaders/single_file_utils.py``): four renames, the rest the same names. ``LTX_VIDEO_VAE`` (the ``vae.`` tensors of
the release's checkpoint; ComfyUI's VAE files hold them without ``vae.``) is the inverse of
``convert_ltx_vae_checkpoint_to_diffusers`` for 0.9.0's structure: each coder's stages in one flat list, the mid
block at an end of it. That converter reads 0.9.1's and 0.9.5's structures too (it tells them by their keys), so
their files load into a folder of their own release; ``to_original`` writes 0.9.0's names only."""

from __future__ import annotations

import numpy as np
import torch

from ditforge.models.adapters import DiffusersDenoiser, call_default, give_first_frame
from ditforge.models.adapters.layouts import OriginalLayout, renamed
from ditforge.models.adapters.limits import call_default_limit

LTX_VIDEO_TRANSFORMER = OriginalLayout(
    name="LTX-Video transformer (Lightricks' release)",
    renames=(("proj_in.{p}", "patchify_proj.{p}"), ("time_embed.{p}", "adaln_single.{p}"),
             *renamed({"transformer_blocks.{i}.attn1.": "transformer_blocks.{i}.attn1.",
                       "transformer_blocks.{i}.attn2.": "transformer_blocks.{i}.attn2."},
                      {"norm_q.": "q_norm.", "norm_k.": "k_norm."})),
    detect=("patchify_proj.weight",))

# LTX-Video 0.9.0's VAE stages, one flat list a coder in the original: diffusers block -> its original index
_DECODER = {"mid_block.resnets.": "0.res_blocks.", "up_blocks.0.resnets.": "1.res_blocks.",
            "up_blocks.1.upsamplers.0.": "2.", "up_blocks.1.resnets.": "3.res_blocks.", "up_blocks.2.conv_in.": "4.",
            "up_blocks.2.upsamplers.0.": "5.", "up_blocks.2.resnets.": "6.res_blocks.", "up_blocks.3.conv_in.": "7.",
            "up_blocks.3.upsamplers.0.": "8.", "up_blocks.3.resnets.": "9.res_blocks."}
_ENCODER = {"down_blocks.0.resnets.": "0.res_blocks.", "down_blocks.0.downsamplers.0.": "1.",
            "down_blocks.0.conv_out.": "2.", "down_blocks.1.resnets.": "3.res_blocks.",
            "down_blocks.1.downsamplers.0.": "4.", "down_blocks.1.conv_out.": "5.",
            "down_blocks.2.resnets.": "6.res_blocks.", "down_blocks.2.downsamplers.0.": "7.",
            "down_blocks.3.resnets.": "8.res_blocks.", "mid_block.resnets.": "9.res_blocks."}

LTX_VIDEO_VAE = OriginalLayout(
    name="LTX-Video VAE (the vae. tensors of Lightricks' release, ComfyUI's VAE files)",
    renames=(
        # in each residual block, and in one that changes the width (a stage's conv_in / conv_out), the same names
        # but for its shortcut's conv and its norm3's LayerNorm
        *renamed({**{f"decoder.{ours}": f"decoder.up_blocks.{theirs}" for ours, theirs in _DECODER.items()},
                  **{f"encoder.{ours}": f"encoder.down_blocks.{theirs}" for ours, theirs in _ENCODER.items()}},
                 {"conv_shortcut.conv.": "conv_shortcut.", "norm3.": "norm3.norm.", "": ""}),
        ("latents_mean", "per_channel_statistics.mean-of-means"),
        ("latents_std", "per_channel_statistics.std-of-means"),
    ),
    detect=("decoder.up_blocks.0.res_blocks.0.conv1.conv.weight",),  # ComfyUI's mark (comfy/sd.py), every release's
    prefix="vae.")


def whole_text_plan() -> dict:
    """LTX-Video's own ``_cp_plan`` without its split of the text (``encoder_hidden_states`` and its mask): the
    packed video tokens (B, N, C), a per-token timestep (B, N) (image-to-video) and the RoPE tables (B, N, D) split,
    the output gathered at ``proj_out``. diffusers' split of the text left each process a slice of the cross-attention
    mask that its Ulysses did not gather (it failed on the mask's shape); with the text whole, the cross-attention
    needs no exchange (``split_tokens``)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    table = ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)
    return {"": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
                 "timestep": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)},
            "rope": {0: table, 1: table},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}


class LTXDenoiser(DiffusersDenoiser):
    """``transformer(hidden_states, encoder_hidden_states, timestep, encoder_attention_mask, num_frames, height,
    width, rope_interpolation_scale)``: x (B, C, T', H/32, W/32) float latents of ``AutoencoderKLLTXVideo``
    (T' = (T - 1) / 8 + 1 for T = 8k + 1 frames; normalised by the VAE's ``latents_mean`` / ``latents_std`` buffers and
    ``scaling_factor``, ``ditforge.encoders.vae``), packed into tokens by the pipeline's ``_pack_latents``; t (B,)
    float = 1000 sigma; condition ``encoder_hidden_states`` (B, L, 4096) float T5 states and
    ``encoder_attention_mask`` (B, L) of ``pipe.encode_prompt(..., max_sequence_length=L)``, L the call's default
    (128; the transformer cross-attends to any length, its config fixes none: ``text_limits``; nor a frame size, its
    rotary positions computed for each). The rotary positions are scaled as the pipeline scales them at its call's
    default ``frame_rate`` (25): (temporal compression / frame_rate, spatial compression, spatial compression). Output
    (B, C, T', h, w): the velocity noise - x0."""

    family = "ltx"
    pipelines = ("LTXPipeline",)
    component = "transformer"
    block_classes = ("LTXVideoTransformerBlock",)
    video = True
    fps = 25  # LTX-Video is trained on (and exports) 25 fps clips
    original_layouts = {"transformer": LTX_VIDEO_TRANSFORMER, "vae": LTX_VIDEO_VAE}
    vae_split_decode = ("patch",)  # AutoencoderKLLTXVideo: its convs pad their rows themselves (refused: decode noise)
    context_parallel = ("sample", "train")
    cp_plan = staticmethod(whole_text_plan)  # parallel.context: the video tokens split, the (masked) text whole
    cp_text = "cross"  # each cross-attention over the whole text on every process
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    pipeline_embeds = {"encoder_hidden_states": "prompt_embeds", "encoder_attention_mask": "prompt_attention_mask"}

    def __init__(self, model, vae_scale: int = 32):
        super().__init__(model, vae_scale)
        self.vae_temporal = 8  # LTX-Video's; attach_pipeline reads the folder's
        self.frame_rate = 25

    def attach_pipeline(self, pipe) -> None:
        self.vae_temporal = int(pipe.vae_temporal_compression_ratio)
        self.frame_rate = int(call_default(pipe, "frame_rate"))

    def denoise(self, x, t, encoder_hidden_states, encoder_attention_mask, first_frame=None):
        from diffusers import LTXPipeline

        config = self.transformer.config
        p, pt = config.patch_size, config.patch_size_t
        frames, h, w = x.shape[2:]
        if first_frame is not None:  # image-to-video: the first latent frame given, its tokens at timestep 0
            x, t = give_first_frame(x, t, first_frame, (pt, p, p))
        scale = (self.vae_temporal / self.frame_rate, self.vae_scale, self.vae_scale)
        out = self.transformer(hidden_states=LTXPipeline._pack_latents(x, p, pt),
                               encoder_hidden_states=encoder_hidden_states, timestep=t,
                               encoder_attention_mask=encoder_attention_mask, num_frames=frames, height=h, width=w,
                               rope_interpolation_scale=scale, return_dict=False)[0]
        return LTXPipeline._unpack_latents(out, frames, h, w, p, pt)

    @classmethod
    def text_limits(cls, pipe):
        return (call_default_limit(pipe),)

    @classmethod
    def encode_prompt(cls, pipe, texts, device):
        embeds, mask, _, _ = pipe.encode_prompt(list(texts), do_classifier_free_guidance=False, device=device,
                                                max_sequence_length=cls.text_length(pipe))
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}

    @staticmethod
    def timestep_kwargs(pipe, latent_shape: tuple[int, ...], steps: int) -> dict:
        """``scheduler.set_timesteps`` arguments as ``LTXPipeline.__call__`` passes them: linear sigmas from 1 and mu
        of the video's latent frames x height x width (``calculate_shift`` of the scheduler's config)."""
        from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

        frames, h, w = latent_shape[-3:]
        config = pipe.scheduler.config
        mu = calculate_shift(frames * h * w, config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        return {"sigmas": np.linspace(1.0, 1 / steps, steps), "mu": mu}


class LTXI2VDenoiser(LTXDenoiser):
    """LTX-Video image-to-video (``LTXImageToVideoPipeline``): ``LTXDenoiser``'s call with the first latent frame
    replaced by the image's latents (``first_frame``, from ``encode_image``) and a timestep per token, 0 for that
    frame's and 1000 sigma for the others' (the pipeline's ``t (1 - conditioning_mask)``). The pipeline never steps
    that frame and decodes it as given (``finish``); training leaves it out of the loss (``given_frames``). ditforge's
    loop steps every frame and puts the given one back in each pass and at the end: the same frames for a scheduler
    whose step is elementwise and deterministic (the pipeline's Euler; UniPC and DPM++ too); a stochastic one would
    draw its noise over all frames where the pipeline draws it over the others. Latent frames patched in groups
    (``patch_size_t`` > 1) are refused: the pipeline's mask takes single ones."""

    family = "ltx_i2v"
    pipelines = ("LTXImageToVideoPipeline",)
    image_to_video = True
    image_from_generator = True
    given_frames = 1

    @staticmethod
    def unsupported(pipe, sampling: bool = False, expert: str | None = None):
        config = pipe.transformer.config
        if config.patch_size_t != 1 or config.patch_size != 1:
            return (f"an LTX-Video image-to-video transformer with {config.patch_size_t} x {config.patch_size} x "
                    f"{config.patch_size} patches; the first latent frame is given alone (1 x 1 x 1 patches)")
        return DiffusersDenoiser.unsupported(pipe, sampling, expert)

    @staticmethod
    def encode_image(pipe, first: torch.Tensor, num_frames: int, images: list | None = None,
                     generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """``first_frame`` (B, C, 1, H/32, W/32) float32: the first frames ``first`` (B, 3, H, W) in [-1, 1], each alone
        through ``AutoencoderKLLTXVideo``, normalised by ``_normalize_latents`` with ``latents_mean`` / ``latents_std``
        and its default scaling factor 1, as ``LTXImageToVideoPipeline.prepare_latents`` builds the first latent frame
        (the released configs' ``scaling_factor`` is 1 too, so it equals the clip latents' normalisation). The
        posterior's mode, or with ``generator`` (sampling) a draw from it, the pipeline's ``retrieve_latents(...,
        generator)`` before the noise from the same generator. ``num_frames`` and ``images`` are unused. On the VAE's
        device."""
        vae = pipe.vae
        device = next(vae.parameters()).device
        with torch.no_grad():
            post = vae.encode(first[:, :, None].to(device, vae.dtype)).latent_dist
            latents = (post.mode() if generator is None else post.sample(generator)).float()
            latents = pipe._normalize_latents(latents, vae.latents_mean, vae.latents_std)
        return {"first_frame": latents}
