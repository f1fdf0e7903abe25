"""HunyuanVideo text- and image-to-video: diffusers' ``HunyuanVideoTransformer3DModel`` (double-stream then
single-stream blocks, as FLUX, over 1 x 2 x 2 patches of the causal 3-D VAE's latents; a Llama encoder's states
through a token refiner, a CLIP pooled vector, and a distilled guidance scale embedded like the timestep) trained
with flow matching, shift 7 (its ``FlowMatchEulerDiscreteScheduler``; ``ditforge.diffusion.objective``). Sources of
the calls below: diffusers' ``pipelines/hunyuan_video/pipeline_hunyuan_video.py`` (``HunyuanVideoPipeline.__call__``
and ``encode_prompt``) and ``pipeline_hunyuan_video_image2video.py`` (``HunyuanVideoImageToVideoPipeline.__call__``,
``prepare_latents`` and ``encode_prompt``).

The original layout (``HUNYUAN_VIDEO_TRANSFORMER``: Tencent's ``mp_rank_00_model_states.pt``, ComfyUI's
``hunyuan_video_*_bf16.safetensors``) is the inverse of diffusers' ``convert_hunyuan_video_transformer_to_diffusers``
(``loaders/single_file_utils.py``): the q, k, v projections fused (``img_attn_qkv``, ``txt_attn_qkv``, the token
refiner's ``self_attn_qkv``), the single-stream blocks' q, k, v and MLP input as one ``linear1``, and the final norm's
modulation stored (shift, scale) where diffusers' ``AdaLayerNormContinuous`` holds (scale, shift). That converter
splits ``linear1`` at a hidden size of 3072 (HunyuanVideo's) whatever the file's, and reads bare names only (it
strips no ``model.diffusion_model.`` prefix), which is why ``export --format comfyui`` writes bare names. ComfyUI reads
a LoRA in these names (``comfy/lora.py``, ``model_lora_keys_unet``'s branch for diffusion-pipe's HunyuanVideo LoRAs
maps ``_attn_qkv``, ``_attn_proj``, ``_mod.linear``, ``modulation.linear``, ``mlp.fc1`` / ``mlp.fc2`` onto its own
names); a LoRA on other modules (the time and guidance embedders) was not checked against it."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ditforge.models.adapters import DiffusersDenoiser, as_images, with_first_frame
from ditforge.models.adapters.layouts import OriginalLayout, renamed
from ditforge.models.adapters.limits import call_default_limit, tokenizer_limit

_QKV = ("attn.to_q.{p}", "attn.to_k.{p}", "attn.to_v.{p}")
_REFINER = "context_embedder.token_refiner.refiner_blocks.{i}."

HUNYUAN_VIDEO_TRANSFORMER = OriginalLayout(
    name="HunyuanVideo transformer (Tencent's release, ComfyUI's repackaging)",
    renames=(
        ("x_embedder.{p}", "img_in.{p}"),
        *renamed({"context_embedder.": "txt_in."},
                 {"time_text_embed.timestep_embedder.linear_1.": "t_embedder.mlp.0.",
                  "time_text_embed.timestep_embedder.linear_2.": "t_embedder.mlp.2.",
                  "time_text_embed.text_embedder.": "c_embedder.", "proj_in.": "input_embedder."}),
        *renamed({_REFINER: "txt_in.individual_token_refiner.blocks.{i}."},
                 {"attn.to_out.0.": "self_attn_proj.", "ff.net.0.proj.": "mlp.fc1.", "ff.net.2.": "mlp.fc2.",
                  "norm_out.linear.": "adaLN_modulation.1."}),
        ("context_embedder.token_refiner.refiner_blocks.{i}.{p}", "txt_in.individual_token_refiner.blocks.{i}.{p}"),
        *renamed({"time_text_embed.": ""},
                 {"timestep_embedder.linear_1.": "time_in.mlp.0.", "timestep_embedder.linear_2.": "time_in.mlp.2.",
                  "guidance_embedder.linear_1.": "guidance_in.mlp.0.",
                  "guidance_embedder.linear_2.": "guidance_in.mlp.2.",
                  "text_embedder.linear_1.": "vector_in.in_layer.", "text_embedder.linear_2.": "vector_in.out_layer."}),
        *renamed({"transformer_blocks.{i}.": "double_blocks.{i}."},
                 {"norm1.linear.": "img_mod.linear.", "norm1_context.linear.": "txt_mod.linear.",
                  "attn.norm_q.": "img_attn_q_norm.", "attn.norm_k.": "img_attn_k_norm.",
                  "attn.to_out.0.": "img_attn_proj.", "attn.norm_added_q.": "txt_attn_q_norm.",
                  "attn.norm_added_k.": "txt_attn_k_norm.", "attn.to_add_out.": "txt_attn_proj.",
                  "ff.net.0.proj.": "img_mlp.fc1.", "ff.net.2.": "img_mlp.fc2.",
                  "ff_context.net.0.proj.": "txt_mlp.fc1.", "ff_context.net.2.": "txt_mlp.fc2."}),
        *renamed({"single_transformer_blocks.{i}.": "single_blocks.{i}."},
                 {"attn.norm_q.": "q_norm.", "attn.norm_k.": "k_norm.", "norm.linear.": "modulation.linear.",
                  "proj_out.": "linear2."}),
        ("norm_out.linear.{p}", "final_layer.adaLN_modulation.1.{p}"),
        ("proj_out.{p}", "final_layer.linear.{p}"),
    ),
    fused=(
        ("txt_in.individual_token_refiner.blocks.{i}.self_attn_qkv.{p}", tuple(_REFINER + q for q in _QKV)),
        ("double_blocks.{i}.img_attn_qkv.{p}", tuple("transformer_blocks.{i}." + q for q in _QKV)),
        ("double_blocks.{i}.txt_attn_qkv.{p}", tuple("transformer_blocks.{i}.attn." + q for q in (
            "add_q_proj.{p}", "add_k_proj.{p}", "add_v_proj.{p}"))),
        ("single_blocks.{i}.linear1.{p}",
         tuple("single_transformer_blocks.{i}." + q for q in (*_QKV, "proj_mlp.{p}"))),
    ),
    swapped=("final_layer.adaLN_modulation.1.{p}",),
    detect=("txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.bias",))

TRAIN_GUIDANCE = 1.0  # the embedded guidance scale fine-tuning runs at (finetrainers, musubi-tuner, diffusion-pipe)


def joint_text_plan() -> dict:
    """A context-parallel plan (diffusers' ``ContextParallelInput`` / ``Output``) for HunyuanVideo's transformer:
    the video tokens split at the first double-stream block's input and the RoPE tables (cos, sin; (N, D)) with
    them, gathered at ``proj_out``; the text stays whole on every process (its token refiner, and the text stream of
    every block)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    table = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)
    return {"rope": {0: table, 1: table},
            "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3,
                                                                           split_output=False)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}


def first_frame_tokens(transformer: nn.Module, group) -> None:
    """HunyuanVideo-I2V's token_replace blocks modulate the first ``num_tokens`` video tokens (the first latent
    frame's) at timestep 0, the rest at t (their 7th argument, which the transformer passes by position). With the
    video tokens split in order, this process's slice [r S, (r + 1) S) holds min(max(num_tokens - r S, 0), S) of
    them, first: a forward pre-hook on every block passes that count instead."""
    rank = dist.get_rank(group)

    def local(module, args):
        held = args[0].shape[1]
        return (*args[:6], min(max(args[6] - rank * held, 0), held), *args[7:])

    for block in (*transformer.transformer_blocks, *transformer.single_transformer_blocks):
        block.register_forward_pre_hook(local)


class HunyuanVideoDenoiser(DiffusersDenoiser):
    """``transformer(hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, pooled_projections,
    guidance)``: x (B, 16, T', H/8, W/8) float latents of ``AutoencoderKLHunyuanVideo`` (T' = (T - 1) / 4 + 1 for
    T = 4k + 1 frames; times its ``scaling_factor`` 0.476986), t (B,) float = 1000 sigma; condition
    ``encoder_hidden_states`` (B, L, 4096) float Llama states (the third-to-last layer, the prompt template's
    system part cropped off) with ``encoder_attention_mask`` (B, L) and ``pooled_projections`` (B, 768) CLIP pooled
    states, all of ``pipe.encode_prompt(..., max_sequence_length=L)``, L the call's default (256; the token refiner
    and the joint attention take any length, so the transformer's config fixes none, nor a frame size: its rotary
    positions are computed for each; ``text_limits``). ``guidance`` (B,)
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
    context_parallel = ("sample", "train")
    cp_plan = staticmethod(joint_text_plan)  # parallel.context: the video tokens split, the text whole
    cp_text = "joint"  # [video; text], at diffusers' dispatcher
    fps = 24  # HunyuanVideo is trained on (and exports) 24 fps clips
    original_layouts = {"transformer": HUNYUAN_VIDEO_TRANSFORMER}
    # AutoencoderKLHunyuanVideo: HunyuanVideoCausalConv3d pads (replicate) before its unpadded conv; the mid block's
    # attention is over all the frames' pixels, so the mid block runs whole
    vae_split_decode = ("patch",)
    vae_halo_modules = ("HunyuanVideoCausalConv3d",)
    vae_whole_modules = ("HunyuanVideoMidBlock3D",)

    @staticmethod
    def split_hooks(transformer, group):
        if getattr(transformer.config, "image_condition_type", None) == "token_replace":
            first_frame_tokens(transformer, group)
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    pipeline_embeds = {"encoder_hidden_states": "prompt_embeds", "encoder_attention_mask": "prompt_attention_mask",
                       "pooled_projections": "pooled_prompt_embeds"}

    def denoise(self, x, t, encoder_hidden_states, encoder_attention_mask, pooled_projections, guidance=None):
        if guidance is None:
            guidance = x.new_full((x.shape[0],), TRAIN_GUIDANCE * 1000.0)
        return self.transformer(hidden_states=x, timestep=t, encoder_hidden_states=encoder_hidden_states,
                                encoder_attention_mask=encoder_attention_mask, pooled_projections=pooled_projections,
                                guidance=guidance, return_dict=False)[0]

    @classmethod
    def text_limits(cls, pipe):
        """The Llama prompt's: the call's ``max_sequence_length`` default (256); CLIP's: ``tokenizer_2``'s
        ``model_max_length`` (77, what the pipeline passes to its CLIP encoding)."""
        return (call_default_limit(pipe), tokenizer_limit(pipe, "tokenizer_2"))

    @staticmethod
    def prompt_tokens(pipe, text, limit):
        """The Llama tokens of ``text`` inside the pipeline's prompt template (its module's
        ``DEFAULT_PROMPT_TEMPLATE``) past the template's ``crop_start``, which ``_get_llama_prompt_embeds`` adds to
        ``max_sequence_length`` before truncating; a CLIP limit's, plain."""
        import sys

        template = getattr(sys.modules[type(pipe).__module__], "DEFAULT_PROMPT_TEMPLATE", None)
        if limit.tokenizer != "tokenizer" or template is None:
            return DiffusersDenoiser.prompt_tokens(pipe, text, limit)
        ids = pipe.tokenizer(template["template"].format(text), verbose=False).input_ids
        return len(ids) - int(template["crop_start"])

    @classmethod
    def encode_prompt(cls, pipe, texts, device):
        embeds, pooled, mask = pipe.encode_prompt(list(texts), device=device,
                                                  max_sequence_length=cls.text_length(pipe))
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask, "pooled_projections": pooled}

    @staticmethod
    def trim_padding(cond):
        """The text tokens past the last one any row's ``encoder_attention_mask`` keeps, cropped: the transformer
        masks them out as keys in every attention (its token refiner's and the joint text-video one) and drops them
        from its output, so no kept token changes. Full when every row keeps all the rest (batch 1 always): the
        joint attention then runs unmasked (``dispatch.unmask_full_attention``), on SDPA's Flash / cuDNN kernels
        instead of the memory-efficient one a mask forces. One host sync."""
        mask = cond["encoder_attention_mask"].bool()
        positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
        keep = int((mask * positions).max())
        out = {**cond, "encoder_hidden_states": cond["encoder_hidden_states"][:, :keep],
               "encoder_attention_mask": cond["encoder_attention_mask"][:, :keep]}
        return out, bool(mask[:, :keep].all())

    @staticmethod
    def timestep_kwargs(pipe, latent_shape: tuple[int, ...], steps: int) -> dict:
        """The sigmas ``HunyuanVideoPipeline.__call__`` passes: linear from 1 down, ``steps`` of them (then shifted
        by the scheduler's shift)."""
        return {"sigmas": np.linspace(1.0, 0.0, steps + 1)[:-1]}


def _replaces_tokens(transformer) -> bool:
    """Whether an image-to-video transformer gives the image as its first latent frame (``token_replace``,
    HunyuanVideo-I2V), not concatenated to the channels (``latent_concat``, HunyuanVideo-I2V-33ch)."""
    return transformer.config.image_condition_type == "token_replace"


class HunyuanVideoI2VDenoiser(HunyuanVideoDenoiser):
    """HunyuanVideo image-to-video (``HunyuanVideoImageToVideoPipeline``), both released transformers, told apart by
    their config's ``image_condition_type``:

    * ``token_replace`` (HunyuanVideo-I2V; guidance-distilled, ``guidance_embeds``): x (B, 16, T', h, w) with its
      first latent frame replaced by the image's (``first_frame`` (B, 16, 1, h, w)); the transformer modulates that
      frame's tokens at timestep 0 itself. Training leaves the frame out of the loss (``given_frames`` 1),
      sampling puts it back (``finish``).
    * ``latent_concat`` (HunyuanVideo-I2V-33ch; no guidance embedding): ``cat([x, image_condition], 1)``, 16 + 17 =
      33 channels: the image's latents on the first latent frame and zeros on the others, then one mask channel, 1 on
      the first frame. Every frame is learned; its pipeline drops the first latent frame's pixels after decoding
      (``decoded_frames``: a call for T frames returns T - 4).

    Either way the prompt is encoded with the image (``prompt_sees_image``): the pipeline's Llava text encoder reads
    the image's 576 CLIP patch states in the prompt template, and the conditioning's ``encoder_hidden_states`` (B,
    576 / k + L - 4, 4096) are its image states (every k-th, k = 4 for token_replace, 2 for latent_concat: the call's
    ``image_embed_interleave``) then the prompt's; ``encoder_attention_mask`` likewise. Caption dropout and the
    negative prompt use the empty prompt with a black image, as the pipeline's unconditional pass does; the image
    latents stay. ``guidance``: as ``HunyuanVideoDenoiser``'s (training at ``TRAIN_GUIDANCE``); the 33-channel
    model ignores it and samples with true classifier-free guidance (``--cfg_scale``, its ``true_cfg_scale``; off
    at the pipeline's default 1)."""

    family = "hunyuan_video_i2v"
    pipelines = ("HunyuanVideoImageToVideoPipeline",)
    block_classes = HunyuanVideoDenoiser.block_classes + ("HunyuanVideoTokenReplaceTransformerBlock",
                                                          "HunyuanVideoTokenReplaceSingleTransformerBlock")
    image_to_video = True
    prompt_sees_image = True

    @property
    def embedded_guidance(self) -> bool:
        return bool(self.inner.config.guidance_embeds)

    @property
    def given_frames(self) -> int:
        return int(_replaces_tokens(self.inner))

    @property
    def in_channels(self) -> int:
        """Channels of the latents x (the transformer's ``out_channels``, 16), not of its input (33 when the image is
        concatenated)."""
        return int(self.inner.config.out_channels)

    def denoise(self, x, t, encoder_hidden_states, encoder_attention_mask, pooled_projections, guidance=None,
                image_condition=None, first_frame=None):
        if first_frame is not None:
            x = with_first_frame(x, first_frame)
        else:
            x = torch.cat([x, image_condition.to(x.dtype)], dim=1)
        return super().denoise(x, t, encoder_hidden_states, encoder_attention_mask, pooled_projections, guidance)

    @classmethod
    def encode_prompt(cls, pipe, texts, device, images=None):
        """``pipe.encode_prompt(image=, prompt=, max_sequence_length=L, image_embed_interleave=k)`` with the call's
        defaults (L = 256; k by ``image_condition_type``, as ``__call__`` picks it), one prompt a call (diffusers'
        crop of a prompt longer than L is right for a batch of one only, as the pipeline calls it). ``images``: B
        first frames (B, 3, H, W) float in [-1, 1] or B PIL images; None: black ones, what the pipeline encodes its
        negative prompt with (any size: the image processor's resize and crop keep a black image black)."""
        from PIL import Image

        texts = list(texts)
        images = [Image.new("RGB", (64, 64), 0)] * len(texts) if images is None else as_images(images)
        interleave = 4 if _replaces_tokens(pipe.transformer) else 2
        rows = [pipe.encode_prompt(image=[image], prompt=[text], device=device,
                                   max_sequence_length=cls.text_length(pipe),
                                   image_embed_interleave=interleave)
                for text, image in zip(texts, images)]  # one a call: a truncated prompt's crop holds for batch 1 only
        embeds, pooled, mask = (torch.cat(parts) for parts in zip(*rows))
        return {"encoder_hidden_states": embeds, "encoder_attention_mask": mask, "pooled_projections": pooled}

    @staticmethod
    def encode_image(pipe, first: torch.Tensor, num_frames: int, images: list | None = None
                     ) -> dict[str, torch.Tensor]:
        """The image latents of clips of ``num_frames`` (4k + 1) frames whose first frames are ``first`` (B, 3, H, W)
        float in [-1, 1], as ``prepare_latents`` builds them: the frame alone through ``AutoencoderKLHunyuanVideo``,
        its posterior's mode times ``scaling_factor``. token_replace: ``first_frame`` (B, 16, 1, H/8, W/8) float32;
        latent_concat: ``image_condition`` (B, 17, T', H/8, W/8) float32, those latents on latent frame 0, zeros on
        the T' - 1 others, then the mask channel (1 on frame 0, else 0). ``images`` is unused (the prompt encoder
        reads the image). On the VAE's device."""
        vae = pipe.vae
        device = next(vae.parameters()).device
        with torch.no_grad():
            latents = vae.encode(first[:, :, None].to(device, vae.dtype)).latent_dist.mode().float()
        latents = latents * vae.config.scaling_factor
        if _replaces_tokens(pipe.transformer):
            return {"first_frame": latents}
        frames = (num_frames - 1) // pipe.vae_scale_factor_temporal + 1
        b, c, _, h, w = latents.shape
        image = torch.cat([latents, latents.new_zeros(b, c, frames - 1, h, w)], dim=2)
        mask = torch.zeros(b, 1, frames, h, w, device=device)
        mask[:, :, 0] = 1
        return {"image_condition": torch.cat([image, mask], dim=1)}

    @staticmethod
    def start(latents, image_cond):
        """``prepare_latents``: 0.999 noise + 0.001 image latents, the first frame's on every latent frame."""
        image = image_cond["first_frame"] if "first_frame" in image_cond else (
            image_cond["image_condition"][:, :latents.shape[1], :1])
        keep = torch.tensor(0.999, dtype=latents.dtype)  # float32 arithmetic, as the pipeline's
        return latents * keep + image.to(latents.dtype) * (1 - keep)

    @staticmethod
    def decoded_frames(pipe, frames):
        return frames if _replaces_tokens(pipe.transformer) else frames[:, :, pipe.vae_scale_factor_temporal:]
