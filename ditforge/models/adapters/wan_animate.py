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

Fine-tuning is refused (``unsupported``) for now: the (character image, driving clip, target clip) data and the
conditioning the batch encoder would build are not written yet."""

from __future__ import annotations

from typing import Any

from ditforge.errors import UserError
from ditforge.models.adapters.wan import WanDenoiser

MODES = ("animate", "replace")  # WanAnimatePipeline.__call__'s ``mode``; replace needs the last two videos
_REPLACE_VIDEOS = ("background_video", "mask_video")


class WanAnimateDenoiser(WanDenoiser):
    """``WanAnimatePipeline``'s transformer; its call (not ditforge's loop) samples, from ``--image`` (the character,
    any size: the pipeline resizes it to the frame size) and the driving videos as frame lists: ``pose_video``
    (resized to the frame size), ``face_video`` (resized to the transformer's ``motion_encoder_size``), and in mode
    ``replace`` ``background_video`` and ``mask_video`` (frame size). Output: ``len(pose_video)`` frames."""

    family = "wan_animate"
    pipelines = ("WanAnimatePipeline",)
    driving_videos = ("pose_video", "face_video", *_REPLACE_VIDEOS)

    @staticmethod
    def unsupported(pipe, sampling: bool = False, expert: str | None = None):
        if not sampling:
            return "fine-tuning WanAnimatePipeline is not supported yet; ditforge samples it"
        if expert is not None:
            return f"--expert {expert}: for Wan 2.2 A14B's two experts; this pipeline has one transformer"
        return None

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
