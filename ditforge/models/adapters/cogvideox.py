"""CogVideoX 1.0 (2B and 5B) and 1.5 (5B) text-to-video: diffusers' ``CogVideoXTransformer3DModel`` (an MM-DiT over
2 x 2 patches of the causal 3-D VAE's latents, 1.5's over 2 x 2 x 2 patches, ``patch_size_t`` 2, its video tokens
attending jointly with 226 T5 tokens, the transformer's ``max_text_seq_length``) trained as a
v-prediction DDPM whose scaled-linear ``alphas_cumprod`` are SNR-shifted and rescaled to zero terminal SNR
(``CogVideoXDDIMScheduler`` / ``CogVideoXDPMScheduler``; ``ditforge.diffusion.objective``: the config's
``snr_shift_scale``, 3.0 for the 2B model and 1.0 for the 5B, is ``CogVideoXDDIMScheduler.__init__``'s SNR shift,
``shift_and_rescale``). Sources of the calls below:
diffusers' ``pipelines/cogvideo/pipeline_cogvideox.py`` (``CogVideoXPipeline.__call__``, ``encode_prompt`` and
``_prepare_rotary_positional_embeddings``) and ``pipeline_cogvideox_image2video.py``
(``CogVideoXImageToVideoPipeline.prepare_latents`` and ``__call__``: 1.5's ``ofs`` input, ``additional_frames``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ditforge.models.adapters import DiffusersDenoiser
from ditforge.models.adapters.limits import TextLimit


def text_first_plan() -> dict:
    """A context-parallel plan for CogVideoX 1.0's transformer, whose blocks take the video tokens and the text apart
    and attend over [text; video]: the video tokens split at the first block's input, the rotary tables
    (``image_rotary_emb``, (cos, sin) of (N, D), the 5B model's) at the transformer's input, the output gathered at
    ``proj_out``; the text whole on every process. (The 2B model's learned positions are added before the split.)"""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    table = ContextParallelInput(split_dim=0, expected_dims=2, split_output=False)
    return {"": {"image_rotary_emb": [table, table]},
            "transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3,
                                                                           split_output=False)},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3)}


class CogVideoXDenoiser(DiffusersDenoiser):
    """``transformer(hidden_states, encoder_hidden_states, timestep, image_rotary_emb)``: x (B, C, T', H/8, W/8) float
    latents of ``AutoencoderKLCogVideoX`` (T' = (T - 1) / 4 + 1 for T = 8k + 1 frames; times the VAE's
    ``scaling_factor``, ``ditforge.encoders.vae``), handed to the transformer frames first, (B, T', C, h, w), as the
    pipeline lays its latents out; t (B,) int64 DDPM timesteps; condition ``encoder_hidden_states`` (B, L, text_dim)
    float T5 states of ``pipe.encode_prompt(..., do_classifier_free_guidance=False, max_sequence_length=L)``, L the
    transformer's ``max_text_seq_length`` (226 for the released models; its positions and joint attention are built
    for that many text tokens, ``text_limits``). The 5B model's 3-D rotary positions are the pipeline's own
    (``_prepare_rotary_positional_embeddings`` of the frame size, cached per shape and device). Output (B, C, T', h,
    w): v = sqrt(abar_t) eps - sqrt(1 - abar_t) x0.

    CogVideoX 1.5 (a transformer with ``patch_size_t``, p_t = 2: latent frames patched in pairs) takes T' latent
    frames in multiples of p_t only. Its pipelines pad the latents at the front up to one
    (``additional_frames``: the noise drawn for T' + pad frames, the first pad dropped before decoding; 81 frames:
    21 latent frames, 22 sampled), which ``ditforge sample`` does too (``padding_frames``). Latents of another T'
    (a training clip's 21) are padded here, in front, by repeating their first frame p_t - T' mod p_t times, and those
    frames' outputs dropped: THUDM/CogVideo's own 1.5 fine-tuning pads so (``finetune/models/cogvideox_t2v/
    lora_trainer.py``, ``compute_loss``: the clean first latent frame copied in front, ``ncopy``); here the copy is
    of the noisy frame (the noise is drawn by the caller) and the loss leaves it out. Its rotary tables are the pipeline's for the
    padded frames (``grid_type="slice"`` over the config's ``sample_height`` x ``sample_width`` grid, which bounds
    the frame size, ``size_refused``); it is exported at 16 fps (81 frames: 5 s)."""

    family = "cogvideox"
    pipelines = ("CogVideoXPipeline",)
    component = "transformer"
    block_classes = ("CogVideoXBlock",)
    video = True
    frames_first = True
    fps = 8  # CogVideoX 1.0 is trained on (and exports) 8 fps clips of 49 frames; 1.5 16 fps (__init__)
    # LoRA on the attention projections (finetrainers' and diffusers' train_cogvideox_lora.py default)
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    pipeline_embeds = {"encoder_hidden_states": "prompt_embeds"}
    context_parallel = ("sample", "train")
    cp_plan = staticmethod(text_first_plan)  # parallel.context: the video tokens split, the text whole
    cp_text = "joint_text_first"  # [text; video]
    attention_calls_sdpa = True  # its attention processor calls PyTorch's SDPA itself, not diffusers' dispatcher
    # its decoder doubles the latent frames twice, keeping the first apart only when their count is odd
    # (1 + 2 (T' - 1)), so only an odd T' decodes back to 4 (T' - 1) + 1 frames: clips of 8k + 1 frames
    # (49 -> 13 -> 49; 5 -> 2 -> 8); the same VAE for 1.5 (81 -> 21 -> 81)
    vae_frame_factor = 2
    vae_split_decode = ("patch",)  # AutoencoderKLCogVideoX: its convs pad their rows themselves; group norms

    def __init__(self, model, vae_scale: int = 8):
        super().__init__(model, vae_scale)
        self._rotary: dict = {}
        self.patch_t = int(model.config.patch_size_t or 1)  # latent frames a patch spans (1.5: 2)
        if self.patch_t > 1:
            self.fps = 16  # CogVideoX 1.5's clips: 16 fps (THUDM's model card; 81 frames, 5 s)

    def padding_frames(self, latent_frames: int) -> int:
        """Latent frames the pipeline puts in front of ``latent_frames`` to reach a multiple of ``patch_size_t``
        (``CogVideoXPipeline.__call__``'s ``additional_frames``): 0 for CogVideoX 1.0 (no ``patch_size_t``)."""
        return -latent_frames % self.patch_t

    @staticmethod
    def call_defaults(pipe) -> dict:
        """The pipeline's frame size and count when its call is given none (``CogVideoXPipeline.__call__``: the
        transformer's sample size times the VAE's factor, 480 x 720 x 49 for the released 1.0 models, 768 x 1360 x
        81 for 1.5)."""
        config, scale = pipe.transformer.config, pipe.vae_scale_factor_spatial
        return {"height": config.sample_height * scale, "width": config.sample_width * scale,
                "num_frames": config.sample_frames}

    @classmethod
    def text_limits(cls, pipe):
        """The transformer's ``max_text_seq_length`` T5 tokens: the joint sequence's positional table
        (``CogVideoXPatchEmbed``: text then video tokens) is built for that many, and the released models were
        trained at it (226, the pipeline call's default, which a model of another length needs in its place)."""
        length = int(pipe.transformer.config.max_text_seq_length)
        return (TextLimit("tokenizer", length, "transformer.config.max_text_seq_length"),)

    @staticmethod
    def size_refused(pipe, height, width, num_frames):
        """A transformer with learned positional embeddings (``use_learned_positional_embeddings``: the 5B I2V
        model) takes its config's ``sample_height`` x ``sample_width`` latents only (``CogVideoXPatchEmbed.forward``
        raises otherwise) and ``sample_frames`` frames (at another count it replaces the learned table by a
        sinusoidal one, a model it was not trained as); CogVideoX 1.5 (``patch_size_t``) frames of at most that
        size (its rotary tables are slices of one over that grid, ``get_3d_rotary_pos_embed(grid_type="slice")``,
        which fails beyond it); the others (sinusoidal or 1.0's rotary positions) take any."""
        config, scale = pipe.transformer.config, pipe.vae_scale_factor_spatial
        most = (config.sample_height * scale, config.sample_width * scale)
        if config.patch_size_t is not None and (height > most[0] or width > most[1]):
            return (f"frames of at most {most[0]} x {most[1]} (its rotary positions' grid: the transformer config's "
                    "sample_height x sample_width)")
        if not config.use_learned_positional_embeddings:
            return None
        want = (*most, config.sample_frames)
        if (height, width, num_frames) == want:
            return None
        return (f"{want[0]} x {want[1]} frames only, {want[2]} of them (its transformer's learned positional "
                "embeddings: the config's sample_height, sample_width, sample_frames)")

    def rotary(self, x: torch.Tensor):
        """The (cos, sin) rotary tables of latents ``x`` (B, C, T', h, w; T' a multiple of ``patch_size_t``), or
        None for a model without them (2B). ``CogVideoXPipeline._prepare_rotary_positional_embeddings`` is called
        with this model and the VAE's factor in place of the pipeline."""
        config = self.transformer.config
        if not config.use_rotary_positional_embeddings:
            return None
        frames, h, w = x.shape[2:]
        key = (frames, h, w, x.device)
        if key not in self._rotary:
            from diffusers import CogVideoXPipeline

            owner = SimpleNamespace(vae_scale_factor_spatial=self.vae_scale, transformer=self.transformer)
            self._rotary[key] = CogVideoXPipeline._prepare_rotary_positional_embeddings(
                owner, h * self.vae_scale, w * self.vae_scale, frames, x.device)
        return self._rotary[key]

    def denoise(self, x, t, encoder_hidden_states, channels: torch.Tensor | None = None, **inputs):
        """``channels``: (B, C', T' + pad, h, w) concatenated to the latents along the channels (I2V's image
        conditioning, of the padded clip); ``inputs``: more keywords of the transformer's call (I2V 1.5's ``ofs``).
        Latents whose frame count is no multiple of ``patch_size_t`` get their first frame repeated in front
        (pad frames) and those frames' outputs dropped (the class docstring says why)."""
        pad = self.padding_frames(x.shape[2])
        if pad:
            x = torch.cat([x[:, :, :1].expand(-1, -1, pad, -1, -1), x], dim=2)
        if channels is not None:
            x = torch.cat([x, channels.to(x.dtype)], dim=1)
        out = self.transformer(hidden_states=x.transpose(1, 2), encoder_hidden_states=encoder_hidden_states,
                               timestep=t, image_rotary_emb=self.rotary(x), return_dict=False, **inputs)[0]
        return out.transpose(1, 2)[:, :, pad:]

    @classmethod
    def encode_prompt(cls, pipe, texts, device):
        embeds, _ = pipe.encode_prompt(list(texts), do_classifier_free_guidance=False, device=device,
                                       max_sequence_length=cls.text_length(pipe))
        return {"encoder_hidden_states": embeds}


class CogVideoXI2VDenoiser(CogVideoXDenoiser):
    """CogVideoX 1.0 and 1.5 image-to-video (``CogVideoXImageToVideoPipeline``, the 5B I2V models): the transformer
    takes the noisy latents and ``image_condition`` concatenated along the channels (its ``in_channels`` 32 = 16 +
    16), as the pipeline's loop does frames first; x and the output as ``CogVideoXDenoiser``'s. 1.5's padding of a
    clip's T' latent frames (training, distillation) gives the padded clip's conditioning: the image latent, then
    zeros, the pipeline's for T' + pad frames (``prepare_latents``) and THUDM/CogVideo's 1.5 I2V fine-tuning's (the
    image latent at the copied first frame). 1.5's transformer also embeds an offset (``ofs_embed_dim``), given 2.0 as the pipeline's call
    gives it (``ofs_emb``; THUDM/CogVideo's 1.5 I2V fine-tuning too). Caption dropout replaces the T5 states alone;
    the image conditioning stays, as in the pipeline's unconditional pass."""

    family = "cogvideox_i2v"
    pipelines = ("CogVideoXImageToVideoPipeline",)
    image_to_video = True
    image_from_generator = True
    image_noise = (-3.0, 0.5)  # training: the first frame's pixel noise, sigma = exp(N(-3, 0.5)) (CogVideoX's recipe)

    @property
    def in_channels(self) -> int:
        """Channels of the latents x (the transformer's ``out_channels``, 16), not of its input (32)."""
        return int(self.inner.config.out_channels)

    def denoise(self, x, t, encoder_hidden_states, image_condition):
        pad = self.padding_frames(x.shape[2])
        if pad:  # the padded clip's: the image latent, then zeros (T' + pad frames), as prepare_latents builds it
            zeros = image_condition.new_zeros(*image_condition.shape[:2], pad, *image_condition.shape[3:])
            image_condition = torch.cat([image_condition[:, :, :1], zeros, image_condition[:, :, 1:]], dim=2)
        ofs = {} if self.transformer.config.ofs_embed_dim is None else {"ofs": x.new_full((1,), 2.0)}
        return super().denoise(x, t, encoder_hidden_states, channels=image_condition, **ofs)

    @classmethod
    def encode_image(cls, pipe, first: torch.Tensor, num_frames: int, images: list | None = None,
                     generator: torch.Generator | None = None, noise_seeds: list[int] | None = None
                     ) -> dict[str, torch.Tensor]:
        """``image_condition`` (B, C, T', H/8, W/8) float32 of clips of ``num_frames`` (8k + 1; sampling 1.5, 4 more a
        padding frame, ``padding_frames``) frames whose first frames are ``first`` (B, 3, H, W) float in [-1, 1], as
        ``CogVideoXImageToVideoPipeline.prepare_latents`` builds it: the first frame alone through
        ``AutoencoderKLCogVideoX``, times ``scaling_factor``, then T' - 1 latent frames of zeros. The latents are the
        posterior's mode, or with ``generator`` (sampling) a draw from it, as the pipeline's ``retrieve_latents(...,
        generator)``, which draws before the initial noise from the same generator. ``noise_seeds`` (training,
        ``--noised_image_input``; B seeds): CogVideoX's own I2V fine-tuning recipe (THUDM/CogVideo ``finetune``, as
        SAT's ``noised_image_input``): clip i's frame gets Gaussian pixel noise of sigma_i = exp(-3 + 0.5 z) before the
        VAE, and its latents are a posterior draw; from ``torch.Generator(vae device).manual_seed(noise_seeds[i])``: z
        (1 value), the noise (3, H, W), then the posterior's eps (C, 1, h, w). Without them, training conditions on the
        clean frame's mode (what stored features hold). ``images`` is unused (no image encoder). On the VAE's device."""
        vae = pipe.vae
        device = next(vae.parameters()).device
        first = first.to(device, torch.float32)
        gens = [torch.Generator(device).manual_seed(s) for s in noise_seeds] if noise_seeds is not None else None
        if gens is not None:
            mean, std = cls.image_noise
            sigma = torch.cat([(mean + std * torch.randn(1, generator=g, device=device)).exp() for g in gens])
            noise = torch.stack([torch.randn(first.shape[1:], generator=g, device=device) for g in gens])
            first = first + sigma.view(-1, 1, 1, 1) * noise
        with torch.no_grad():
            post = vae.encode(first[:, :, None].to(vae.dtype)).latent_dist
            if gens is not None:
                eps = torch.stack([torch.randn(post.mean.shape[1:], generator=g, device=device) for g in gens])
                latents = post.mean.float() + post.std.float() * eps
            else:
                latents = (post.mode() if generator is None else post.sample(generator)).float()
            scale = vae.config.scaling_factor
            latents = latents / scale if vae.config.get("invert_scale_latents") else latents * scale
            frames = (num_frames - 1) // pipe.vae_scale_factor_temporal + 1
            pad = latents.new_zeros(latents.shape[0], latents.shape[1], frames - 1, *latents.shape[-2:])
        return {"image_condition": torch.cat([latents, pad], dim=2)}
