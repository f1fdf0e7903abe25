"""Wan2.2-Animate: diffusers' ``WanAnimateTransformer3DModel`` (``models/transformers/transformer_wan_animate.py``:
Wan's DiT over 36 input channels, with a motion encoder of the face frames and a face adapter injected every
``inject_face_latents_blocks`` blocks) in ``WanAnimatePipeline`` (``pipelines/wan/pipeline_wan_animate.py``), which
animates a character image with a pose video and a face video (mode ``animate``) or replaces the person of a
background video inside a mask video with the character (mode ``replace``).

Sampling is the pipeline's own call (``pipeline.generate_with_pipeline``), not ``sample/video.py``'s loop: the
pipeline draws the clip in segments of ``segment_frame_length`` frames, each one decoded by the VAE and its last
``prev_segment_conditioning_frames`` frames encoded again as the next segment's condition, a fresh noise draw and
scheduler run per segment; ditforge's loop, one latent clip denoised and decoded once, would have to copy that
segment loop line by line. So the sampling speed-ups of ``sample/video.py`` (fp8, caching, ...) do not apply.

LoRA fine-tuning (mode ``animate``) trains on (character image, pose video, face video, target clip) rows of a video
CSV (columns ``image``, ``pose_video``, ``face_video``, ``data.video.DRIVING_COLUMNS``): ``encode_driving`` builds the
conditioning of the pipeline's first segment with the pipeline's own methods, and the character's latent frame
leads the clip's latents x0 (``encoders.batch.PREFIX``), where the pipeline's noise has its extra first latent frame
(``prepare_latents``: ``num_latent_frames + 1``, dropped before decoding)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ditforge.errors import UserError
from ditforge.models.adapters.wan import WanDenoiser

MODES = ("animate", "replace")  # WanAnimatePipeline.__call__'s ``mode``; replace needs the last two videos
_REPLACE_VIDEOS = ("background_video", "mask_video")


class WanAnimateDenoiser(WanDenoiser):
    """``WanAnimatePipeline``'s transformer; its call (not ditforge's loop) samples, from ``--image`` (the character,
    any size: the pipeline resizes it to the frame size) and the driving videos as frame lists: ``pose_video``
    (resized to the frame size), ``face_video`` (resized to the transformer's ``motion_encoder_size``), and in mode
    ``replace`` ``background_video`` and ``mask_video`` (frame size). Output: ``len(pose_video)`` frames.

    In training, ``transformer(cat([x, reference_latents], 1), timestep, encoder_hidden_states,
    encoder_hidden_states_image, pose_hidden_states, face_pixel_values)`` as the pipeline's denoising loop calls it:
    x (B, 16, 1 + T', h, w), the character's latent frame then the clip's (16 = the transformer's ``out_channels``,
    its input having 36); the conditioning of ``encode_driving``. Caption dropout replaces the UMT5 states by the
    empty prompt's and the face frames by -1, the pipeline's unconditional pass (``face_video_segment * 0 - 1``)."""

    family = "wan_animate"
    pipelines = ("WanAnimatePipeline",)
    # the face adapters run between the blocks over every video token: units of checkpointing and activation offload
    # as the blocks are (left out, each keeps ~2 GiB of saved tensors through the forward at 33,600 tokens, 8 of them
    # in the 14B); --blocks_to_swap counts the blocks alone, which run in module order
    block_classes = ("WanTransformerBlock", "WanAnimateFaceBlockCrossAttention")
    swap_classes = ("WanTransformerBlock",)
    driving_videos = ("pose_video", "face_video", *_REPLACE_VIDEOS)
    trained_videos = ("pose_video", "face_video")  # mode animate's: the columns of a training CSV

    @staticmethod
    def unsupported(pipe, sampling: bool = False, expert: str | None = None):
        if expert is not None:
            return f"--expert {expert}: for Wan 2.2 A14B's two experts; this pipeline has one transformer"
        return None

    @staticmethod
    def call_defaults(pipe) -> dict[str, int]:
        """``num_frames``: the call's default ``segment_frame_length`` (77), the clip of one segment (what
        ``ditforge distill`` trains a student on: the first segment's conditioning, ``encode_driving``)."""
        return {"num_frames": inspect.signature(pipe.__call__).parameters["segment_frame_length"].default}

    def padding_frames(self, latent_frames: int) -> int:
        """1: the pipeline's noise has a latent frame before the segment's (``prepare_latents``: ``num_latent_frames
        + 1``, the character's place), dropped before decoding (``latents[:, :, 1:]``)."""
        return 1

    @property
    def in_channels(self) -> int:
        """Channels of the latents x (the transformer's ``out_channels``, 16), not of its input (36)."""
        return int(self.inner.config.out_channels)

    def denoise(self, x, t, encoder_hidden_states, encoder_hidden_states_image, reference_latents,
                pose_hidden_states, face_pixel_values):
        hidden = torch.cat([x, reference_latents.to(x.dtype)], dim=1)
        return self.inner(hidden_states=hidden, timestep=t, encoder_hidden_states=encoder_hidden_states,
                          encoder_hidden_states_image=encoder_hidden_states_image.to(x.dtype),
                          pose_hidden_states=pose_hidden_states.to(x.dtype),
                          face_pixel_values=face_pixel_values.to(x.dtype), return_dict=False)[0]

    def drop(self, cond: dict[str, torch.Tensor], force_drop_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The empty prompt's states and face frames of -1 on the rows where ``force_drop_ids`` (B,) bool is True
        (``WanAnimatePipeline.__call__``'s unconditional pass: ``negative_prompt_embeds``,
        ``face_video_segment * 0 - 1``)."""
        out = super().drop(cond, force_drop_ids)
        if force_drop_ids is not None and "face_pixel_values" in out:
            face = out["face_pixel_values"]
            out["face_pixel_values"] = torch.where(force_drop_ids.view(-1, 1, 1, 1, 1), -torch.ones_like(face), face)
        return out

    @staticmethod
    def encode_driving(pipe, image, videos: dict[str, list], height: int, width: int, device: torch.device
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """One training row's conditioning as ``WanAnimatePipeline.__call__`` builds its first segment (mode
        ``animate``, ``start`` 0) from ``image`` (the character, a PIL RGB image) and ``videos`` (``pose_video``,
        ``face_video``: T PIL frames each, T = 4k + 1 the clip's frames), with the pipeline's own methods:

        * ``encoder_hidden_states_image`` (1, L_img, D_img): ``encode_image(image)``, the CLIP vision model's
          second-to-last hidden states;
        * ``reference_latents`` (1, 20, 1 + T', h, w): ``prepare_reference_image_latents`` of the image
          (``vae_image_processor.preprocess(resize_mode="fill")`` to height x width; 4 mask channels of 1, then its
          normalised VAE mode) before ``prepare_prev_segment_cond_latents`` of no previous segment (zero frames,
          mask 0: the first segment's);
        * ``pose_hidden_states`` (1, 16, T', h, w): ``prepare_pose_latents`` of the pose frames resized to height x
          width (``video_processor.preprocess_video``);
        * ``face_pixel_values`` (1, 3, T, S_m, S_m) in [-1, 1]: the face frames resized to the transformer's
          ``motion_encoder_size`` S_m.

        Returns (those, float32 on ``device``; the character's latent frame (1, 16, 1, h, w) float32, the
        normalised mode above, which leads x0). Raises nothing of its own (diffusers' errors pass through)."""
        with torch.no_grad():
            pixels = pipe.vae_image_processor.preprocess(image, height=height, width=width, resize_mode="fill")
            ref = pipe.prepare_reference_image_latents(pixels.to(device, torch.float32), 1, device=device)
            prev = pipe.prepare_prev_segment_cond_latents(None, batch_size=1, segment_frame_length=len(
                videos["pose_video"]), start_frame=0, height=height, width=width, task="animate", device=device)
            pose = pipe.video_processor.preprocess_video(videos["pose_video"], height=height, width=width)
            side = pipe.transformer.config.motion_encoder_size
            face = pipe.video_processor.preprocess_video(videos["face_video"], height=side, width=side)
            cond = {"encoder_hidden_states_image": pipe.encode_image(image, device),
                    "reference_latents": torch.cat([ref, prev], dim=2),
                    "pose_hidden_states": pipe.prepare_pose_latents(pose.to(device, torch.float32), 1, device=device),
                    "face_pixel_values": face}
        lead = ref[:, -pipe.vae.config.z_dim:]
        return {k: v.float().to(device) for k, v in cond.items()}, lead.float().to(device)

    @staticmethod
    def driving_inputs(pipe, videos: dict[str, list], mode: str | None) -> dict[str, Any]:
        """``WanAnimatePipeline``'s ``pose_video``, ``face_video`` (both required, of one frame count), ``mode``
        (default ``animate``) and, for ``replace`` only, ``background_video`` and ``mask_video`` (required, each
        as many frames as the pose video); the pipeline pads the videos to whole segments itself.

        Raises:
            UserError: a missing video, videos of different frame counts, an unknown mode, a replace video without
                mode replace (one line, naming the flag).
        """
        mode = mode or MODES[0]
        if mode not in MODES:
            raise UserError(f"--mode {mode}: WanAnimatePipeline takes {' or '.join(MODES)}")
        needed = ("pose_video", "face_video", *(_REPLACE_VIDEOS if mode == "replace" else ()))
        for name in needed:
            if name not in videos:
                raise UserError(f"--{name}: WanAnimatePipeline in mode {mode} needs it; give --{name} FILE.mp4")
        for name in videos:
            if name not in needed:
                raise UserError(f"--{name}: only for --mode replace; leave it out or give --mode replace")
        frames = len(videos["pose_video"])
        for name in needed[1:]:
            if len(videos[name]) != frames:
                raise UserError(f"--{name}: {len(videos[name])} frames, the --pose_video has {frames}; give videos "
                                "of one frame count")
        return {**videos, "mode": mode}
