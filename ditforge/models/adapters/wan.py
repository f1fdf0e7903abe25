"""Wan 2.1 text-to-video and image-to-video: diffusers' ``WanTransformer3DModel`` (a DiT over 3-D patches of the
causal video VAE's latents, cross-attending to UMT5 states, and for image-to-video to CLIP image states too)
trained with flow matching (its ``UniPCMultistepScheduler`` runs on flow sigmas with ``flow_shift``;
``ditforge.diffusion.objective``). Sources of the calls below: diffusers' ``pipelines/wan/pipeline_wan.py``
(``WanPipeline.__call__`` and ``encode_prompt``) and ``pipelines/wan/pipeline_wan_i2v.py``
(``WanImageToVideoPipeline.__call__``, ``prepare_latents`` and ``encode_image``).

The VAE, ``AutoencoderKLWan`` (``encoders.VAE``), takes clips of 4k + 1 frames (``pipeline_wan.py``'s rule,
``num_frames % 4 == 1``) and normalises each latent channel by its config's ``latents_mean`` / ``latents_std``: the
tensors ``pipeline_wan.py`` builds to un-normalise, ``latents / (1 / latents_std) + latents_mean``. Under
torchrun its decode splits in bands of rows (``parallel.vae_decode``: ``WanCausalConv3d`` pads its rows itself, the
mid block's attention sees the whole frame), or its ``tiled_decode`` in column strips (Wan 2.1's, without
``patch_size``).

The original layouts (``WAN_TRANSFORMER``, ``WAN_VAE``) are the inverses of diffusers'
``loaders/single_file_utils.py``: ``convert_wan_transformer_to_diffusers`` (Wan-AI's ``diffusion_pytorch_model*``
and ComfyUI's repackaged ``wan2.1_*.safetensors`` / ``wan2.2_*.safetensors``: Wan 2.1 T2V / I2V with its image
embedder, 2.2 TI2V-5B and both A14B experts, one layout) and ``convert_wan_vae_to_diffusers`` (``Wan2.1_VAE.pth``,
ComfyUI's ``wan_2.1_vae.safetensors``: 4 stages of 2 residual blocks, the decoder's 3 a stage and an upsampler in one
flat list of 15). Two more, which diffusers has no single-file converter of, are read by their renames inverted
(``diffusers_converts`` False): Wan 2.2's VAE (``WAN22_VAE``: TI2V-5B's 48 channels, residual down and up blocks;
``Wan2.2_VAE.pth``, ComfyUI's ``wan2.2_vae.safetensors``) and Wan's own UMT5 text encoder file (``WAN_UMT5``,
``models_t5_umt5-xxl-enc-bf16.pth``)."""

from __future__ import annotations

import torch

from ditforge.models.adapters import DiffusersDenoiser, as_images, give_first_frame
from ditforge.models.adapters.layouts import OriginalLayout, renamed
from ditforge.models.adapters.limits import call_default_limit

_ATTENTION = {"to_q.": "q.", "to_k.": "k.", "to_v.": "v.", "to_out.0.": "o.", "add_k_proj.": "k_img.",
              "add_v_proj.": "v_img.", "norm_added_k.": "norm_k_img."}  # norm_q, norm_k keep their names

WAN_TRANSFORMER = OriginalLayout(
    name="Wan 2.1 / 2.2 transformer (Wan-AI's release, ComfyUI's repackaging)",
    renames=(
        *renamed({"blocks.{i}.attn1.": "blocks.{i}.self_attn.", "blocks.{i}.attn2.": "blocks.{i}.cross_attn."},
                 {**_ATTENTION, "norm_q.": "norm_q.", "norm_k.": "norm_k."}),
        ("blocks.{i}.scale_shift_table", "blocks.{i}.modulation"),
        # diffusers' norm2 is the cross-attention's (affine) norm, the original's norm3, and the other way round
        ("blocks.{i}.norm2.{p}", "blocks.{i}.norm3.{p}"),
        ("blocks.{i}.norm3.{p}", "blocks.{i}.norm2.{p}"),
        *renamed({"blocks.{i}.ffn.": "blocks.{i}.ffn."}, {"net.0.proj.": "0.", "net.2.": "2."}),
        ("scale_shift_table", "head.modulation"),
        ("proj_out.{p}", "head.head.{p}"),
        *renamed({"condition_embedder.": ""},
                 {"time_embedder.linear_1.": "time_embedding.0.", "time_embedder.linear_2.": "time_embedding.2.",
                  "text_embedder.linear_1.": "text_embedding.0.", "text_embedder.linear_2.": "text_embedding.2.",
                  "time_proj.": "time_projection.1.", "image_embedder.norm1.": "img_emb.proj.0.",
                  "image_embedder.ff.net.0.proj.": "img_emb.proj.1.", "image_embedder.ff.net.2.": "img_emb.proj.3.",
                  "image_embedder.norm2.": "img_emb.proj.4."}),
    ),
    detect=("head.modulation",))

_RESIDUAL = {"norm1.": "residual.0.", "conv1.": "residual.2.", "norm2.": "residual.3.", "conv2.": "residual.6.",
             "conv_shortcut.": "shortcut."}

# what Wan 2.1's and 2.2's VAEs share: the middle blocks, the heads, the first convolutions and the quant convs
_VAE_ENDS = tuple(rule for coder in ("encoder", "decoder") for rule in (
    *renamed({f"{coder}.mid_block.resnets.0.": f"{coder}.middle.0.",
              f"{coder}.mid_block.resnets.1.": f"{coder}.middle.2."}, _RESIDUAL),
    (f"{coder}.mid_block.attentions.0.{{p}}", f"{coder}.middle.1.{{p}}"),
    (f"{coder}.conv_in.{{p}}", f"{coder}.conv1.{{p}}"),
    (f"{coder}.norm_out.{{p}}", f"{coder}.head.0.{{p}}"),
    (f"{coder}.conv_out.{{p}}", f"{coder}.head.2.{{p}}"))) + (
    ("quant_conv.{p}", "conv1.{p}"),
    ("post_quant_conv.{p}", "conv2.{p}"))

WAN_VAE = OriginalLayout(
    name="Wan 2.1 VAE (Wan2.1_VAE.pth, ComfyUI's wan_2.1_vae)",
    renames=(
        *renamed({"encoder.down_blocks.{i}.": "encoder.downsamples.{i}."}, _RESIDUAL),
        ("encoder.down_blocks.{i}.{p}", "encoder.downsamples.{i}.{p}"),  # the resamples
        # the decoder's stages of 3 residual blocks and an upsampler, one flat list in the original
        *(rule for stage in range(4) for block in range(3) for rule in renamed(
            {f"decoder.up_blocks.{stage}.resnets.{block}.": f"decoder.upsamples.{4 * stage + block}."}, _RESIDUAL)),
        *((f"decoder.up_blocks.{stage}.upsamplers.0.{{p}}", f"decoder.upsamples.{4 * stage + 3}.{{p}}")
          for stage in range(3)),
        *_VAE_ENDS,
    ),
    detect=("decoder.middle.0.residual.0.gamma",))

# Wan 2.2's VAE (``wan/modules/vae2_2.py``: ``Down_ResidualBlock`` / ``Up_ResidualBlock`` stages, each a
# ``downsamples`` / ``upsamples`` list of residual blocks and then its ``Resample``, at index n = num_res_blocks in
# the encoder and num_res_blocks + 1 in the decoder; its ``avg_shortcut`` has no parameters). diffusers keeps the
# residual blocks as ``resnets`` and the resample as ``downsampler`` / ``upsampler`` without the index (the map of
# diffusers' ``scripts/convert_wan_to_diffusers.py``, ``convert_vae_22``), which its single-file converter lacks.
# Detected by the nested up block's tensor ComfyUI tells the two VAEs apart by (``comfy/sd.py``).
WAN22_VAE = OriginalLayout(
    name="Wan 2.2 VAE (Wan2.2_VAE.pth, ComfyUI's wan2.2_vae)",
    renames=(
        *renamed({"encoder.down_blocks.{i}.resnets.{j}.": "encoder.downsamples.{i}.downsamples.{j}.",
                  "decoder.up_blocks.{i}.resnets.{j}.": "decoder.upsamples.{i}.upsamples.{j}."}, _RESIDUAL),
        *renamed({"encoder.down_blocks.{i}.downsampler.": "encoder.downsamples.{i}.downsamples.{n}.",
                  "decoder.up_blocks.{i}.upsampler.": "decoder.upsamples.{i}.upsamples.{n}."},
                 {"resample.": "resample.", "time_conv.": "time_conv."}),
        *_VAE_ENDS,
    ),
    detect=("decoder.upsamples.0.upsamples.0.residual.2.weight",),
    diffusers_converts=False)

# Wan's own UMT5-XXL encoder (``wan/modules/t5.py``: ``T5Encoder`` with a relative position embedding in every block,
# ``shared_pos`` False; the file ``models_t5_umt5-xxl-enc-bf16.pth``) in transformers' ``UMT5EncoderModel`` names. Its
# gated feed-forward is ``fc1(x) * gelu(gate(x))``, transformers' ``wo(act(wi_0(x)) * wi_1(x))``: gate is wi_0.
# transformers' tied ``encoder.embed_tokens`` is filled from ``shared`` (``single_file.load_component``).
WAN_UMT5 = OriginalLayout(
    name="Wan's UMT5 encoder (models_t5_umt5-xxl-enc-bf16.pth)",
    renames=(
        ("shared.{p}", "token_embedding.{p}"),
        *renamed({"encoder.block.{i}.layer.0.": "blocks.{i}."},
                 {"SelfAttention.q.": "attn.q.", "SelfAttention.k.": "attn.k.", "SelfAttention.v.": "attn.v.",
                  "SelfAttention.o.": "attn.o.", "SelfAttention.relative_attention_bias.": "pos_embedding.embedding.",
                  "layer_norm.": "norm1."}),
        *renamed({"encoder.block.{i}.layer.1.": "blocks.{i}."},
                 {"DenseReluDense.wi_0.": "ffn.gate.0.", "DenseReluDense.wi_1.": "ffn.fc1.",
                  "DenseReluDense.wo.": "ffn.fc2.", "layer_norm.": "norm2."}),
        ("encoder.final_layer_norm.{p}", "norm.{p}"),
    ),
    detect=("blocks.0.ffn.gate.0.weight",),
    diffusers_converts=False)

class WanDenoiser(DiffusersDenoiser):
    """``transformer(hidden_states, timestep, encoder_hidden_states)``: x (B, 16, T', H/8, W/8) float latents of
    ``AutoencoderKLWan`` (T' = (T - 1) / 4 + 1 for T = 4k + 1 frames; normalised per channel by the VAE's
    ``latents_mean`` / ``latents_std``, ``ditforge.encoders.vae``), t (B,) float = 1000 sigma (the pipeline feeds
    the scheduler's timesteps, expanded to the batch), condition ``encoder_hidden_states`` (B, L, text_dim) float
    UMT5 states of ``pipe.encode_prompt(..., do_classifier_free_guidance=False, max_sequence_length=L)``, L the
    pipeline call's default (512), zero past each prompt's tokens. Output (B, 16, T', H/8, W/8): the velocity
    noise - x0. Wan 2.2 TI2V-5B's ``WanPipeline`` (``expand_timesteps``) the same with 48 channels at H/16 x W/16
    (its VAE patchifies 2 x 2 pixels). Its pipeline gives the transformer a timestep per token, t for every token of
    a text-to-video call; the transformer computes the same from t (B,) (tested to 1e-5), without the per-token
    timestep embedding (an L x D x 6D product and a (B, L, 6, D) modulation table more: for the 5B at 704 x 1280 x
    121, L = 27,280 and D = 3,072, about 3.6 TFLOP and 1 GB in bf16 a pass). Its image-to-video is
    ``WanI2VDenoiser``'s."""

    family = "wan"
    pipelines = ("WanPipeline",)
    component = "transformer"
    block_classes = ("WanTransformerBlock",)
    video = True
    context_parallel = ("sample", "train")
    fps = 16  # Wan 2.1 / 2.2 A14B are trained on (and export) 16 fps clips
    # LoRA on the self- and cross-attention projections (finetrainers' default for Wan)
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    pipeline_embeds = {"encoder_hidden_states": "prompt_embeds"}

    # AutoencoderKLWan: WanCausalConv3d pads (zeros) in its forward, its conv has none; the mid block's attention is
    # over each whole frame; the strips replay its tiled_decode, when its VAE has no patch_size (Wan 2.1's)
    vae_split_decode = ("patch", "strips")
    vae_halo_modules = ("WanCausalConv3d",)
    vae_whole_modules = ("WanAttentionBlock",)
    vae_folds_pixels = True  # Wan 2.2's VAE states in_channels after folding its patch_size^2 pixels (12 = 3 x 2 x 2)
    # Wan 2.2's VAE first: a Wan 2.2 file holds the 2.1 layout's detect name too
    original_layouts = {"transformer": WAN_TRANSFORMER, "vae": (WAN22_VAE, WAN_VAE), "text_encoder": WAN_UMT5}

    @staticmethod
    def expert_boundary(pipe):
        return getattr(pipe.config, "boundary_ratio", None)

    @staticmethod
    def unsupported(pipe, sampling: bool = False, expert: str | None = None):
        transformer = getattr(pipe, "transformer", None)
        if (pipe.config.get("expand_timesteps") and type(pipe).__name__ != "WanPipeline" and transformer is not None
                and transformer.config.patch_size[0] != 1):
            return (f"a Wan 2.2 TI2V image-to-video transformer with {transformer.config.patch_size[0]} latent frames "
                    "a patch; its first latent frame is given alone (ditforge takes 1)")
        if transformer is None:
            return "a Wan pipeline without its first transformer (the high-noise expert); ditforge needs both"
        two = getattr(pipe, "transformer_2", None) is not None or pipe.config.get("boundary_ratio") is not None
        if two and (getattr(pipe, "transformer_2", None) is None or pipe.config.get("boundary_ratio") is None):
            return "a Wan 2.2 pipeline needs both transformer_2 and boundary_ratio"
        if expert is not None and not two:
            return f"--expert {expert}: for Wan 2.2 A14B's two experts; this pipeline has one transformer"
        return None

    def denoise(self, x, t, encoder_hidden_states):
        return self.inner(hidden_states=x, timestep=t, encoder_hidden_states=encoder_hidden_states,
                                return_dict=False)[0]

    @classmethod
    def text_limits(cls, pipe):
        """The pipeline call's ``max_sequence_length`` default (512, Wan's ``text_len``) UMT5 tokens: the
        transformer cross-attends to any length, so its config fixes none."""
        return (call_default_limit(pipe),)

    @staticmethod
    def size_refused(pipe, height, width, num_frames):
        """The transformer's rotary table (``WanRotaryPosEmbed``) holds ``rope_max_seq_len`` positions an axis (1024):
        the patches along the latent frames, rows and columns must each fit in it."""
        config = pipe.transformer.config
        p_t, p_h, p_w = config.patch_size
        space, time = int(pipe.vae_scale_factor_spatial), int(pipe.vae_scale_factor_temporal)
        most = config.get("rope_max_seq_len")
        if most is None:
            return None
        axes = {"latent frames": (num_frames - 1) // time + 1, "rows": height // space, "columns": width // space}
        for (axis, n), p in zip(axes.items(), (p_t, p_h, p_w)):
            if n // p > most:
                return (f"at most {most} patches an axis (the transformer config's rope_max_seq_len, its rotary "
                        f"table), not {n // p} patches of {axis}")
        return None

    @classmethod
    def encode_prompt(cls, pipe, texts, device):
        embeds, _ = pipe.encode_prompt(list(texts), do_classifier_free_guidance=False, device=device,
                                       max_sequence_length=cls.text_length(pipe))
        return {"encoder_hidden_states": embeds}


class WanI2VDenoiser(WanDenoiser):
    """Wan 2.1 image-to-video (``WanImageToVideoPipeline``): ``transformer(cat([x, image_condition], 1), timestep,
    encoder_hidden_states, encoder_hidden_states_image)``, x (B, 16, T', h, w) as ``WanDenoiser``'s (16 = the
    transformer's ``out_channels``, its ``in_channels`` being 36), and two more conditioning tensors built from the
    clip's first frame by ``encode_image`` as ``pipeline_wan_i2v.py`` builds them. Caption dropout replaces the
    UMT5 states alone (the empty prompt's); the image conditioning is never dropped, because the pipeline's
    unconditional pass keeps it (``negative_prompt_embeds`` with the same ``latent_model_input`` and
    ``image_embeds``), so guidance contrasts captions, not images. Wan 2.2 TI2V-5B's image-to-video:
    ``transformer(x with its first latent frame replaced by first_frame, a timestep per token, 0 on that
    frame)``, x (B, 48, T', h, w) (``give_first_frame``, ``finish``); training leaves that frame out of the
    loss (``given_frames``, the objective's)."""

    family = "wan_i2v"
    pipelines = ("WanImageToVideoPipeline",)
    image_to_video = True
    pipeline_embeds = {"encoder_hidden_states": "prompt_embeds"}

    def attach_pipeline(self, pipe) -> None:
        super().attach_pipeline(pipe)
        # Wan 2.2 TI2V: the first latent frame is the image's, given at timestep 0, not learned
        self.given_frames = 1 if pipe.config.get("expand_timesteps") else 0

    @property
    def in_channels(self) -> int:
        """Channels of the latents x (the transformer's ``out_channels``, 16), not of its input (36)."""
        return int(self.inner.config.out_channels)

    def denoise(self, x, t, encoder_hidden_states, image_condition=None, encoder_hidden_states_image=None,
                first_frame=None):
        if first_frame is not None:  # Wan 2.2 TI2V: the first latent frame given, its tokens at timestep 0
            x, timestep = give_first_frame(x, t, first_frame, self.inner.config.patch_size)
            return self.inner(hidden_states=x, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                                    return_dict=False)[0]
        hidden = torch.cat([x, image_condition.to(x.dtype)], dim=1)
        return self.inner(hidden_states=hidden, timestep=t, encoder_hidden_states=encoder_hidden_states,
                                encoder_hidden_states_image=encoder_hidden_states_image, return_dict=False)[0]

    @staticmethod
    def encode_image(pipe, first: torch.Tensor, num_frames: int, images: list | None = None
                     ) -> dict[str, torch.Tensor]:
        """The image conditioning of clips of ``num_frames`` (4k + 1) frames whose first frames are ``first``
        (B, 3, H, W) float in [-1, 1], as ``WanImageToVideoPipeline`` builds it for ``image``:

        * ``image_condition`` (B, 20, T', H/8, W/8) float32: the 4 mask channels (``prepare_latents``: the first
          pixel frame's mask, 1, repeated 4 times, then the 4k others, 0, folded 4 to a latent frame, so the first
          latent frame's 4 channels are 1 and the others' 0), then the mode of ``AutoencoderKLWan``'s posterior of
          the clip [first frame, 4k zero frames], normalised by ``latents_mean`` / ``latents_std`` as
          ``prepare_latents`` does;
        * ``encoder_hidden_states_image`` (B, L_img, D_img) float32: ``pipe.encode_image`` of the frames as uint8
          images (``as_images``), or of ``images`` (B PIL
          images; the pipeline encodes the image it was given, before resizing it to the frame size), the CLIP
          vision model's second-to-last hidden states (``image_processor`` resizes and normalises).

        Wan 2.2 TI2V (``expand_timesteps``): ``first_frame`` (B, 48, 1, H/16, W/16) float32 alone, the posterior mode
        of the first frame by itself, normalised the same way (``prepare_latents``); ``denoise`` puts it in place of
        the first latent frame, whose tokens get timestep 0, and ``finish`` puts it back in the sampled latents.

        Both on the VAE's device. Raises nothing of its own (diffusers' errors pass through).
        """
        vae = pipe.vae
        device = next(vae.parameters()).device
        b, _, h, w = first.shape
        ti2v = bool(pipe.config.get("expand_timesteps"))  # Wan 2.2 TI2V: the first frame alone
        clip = first[:, :, None]
        if not ti2v:  # Wan 2.1 / 2.2 A14B: [the first frame, zero frames]
            clip = torch.cat([clip, first.new_zeros(b, 3, num_frames - 1, h, w)], dim=2)
        with torch.no_grad():
            latents = vae.encode(clip.to(device, vae.dtype)).latent_dist.mode().float()
            z = vae.config.z_dim
            mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(device)
            inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(device)
            latents = (latents - mean) * inv_std
            if ti2v:
                return {"first_frame": latents}
            k = pipe.vae_scale_factor_temporal
            mask = torch.zeros(b, 1, num_frames, *latents.shape[-2:], device=device)
            mask[:, :, 0] = 1
            mask = torch.cat([mask[:, :, :1].repeat_interleave(k, dim=2), mask[:, :, 1:]], dim=2)
            mask = mask.view(b, -1, k, *latents.shape[-2:]).transpose(1, 2)  # (B, 4, T', h, w)
            condition = {"image_condition": torch.cat([mask, latents], dim=1)}
            if pipe.transformer.config.image_dim is None:  # Wan 2.2 A14B: no CLIP states
                return condition
            states = pipe.encode_image(as_images(first if images is None else images), device).float()
        return {**condition, "encoder_hidden_states_image": states}

