"""The files ``ditforge sample`` writes besides PNG grids (``data.images.save_grid``): an MP4 and a GIF per video
sample, and .npz files, each written atomically."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ditforge.atomic import atomic_path

log = logging.getLogger(__name__)


def write_video_files(frames: np.ndarray, stem: Path, fps: int) -> None:
    """Write (T, H, W, C) uint8 frames as ``stem.mp4`` and ``stem.gif`` (grey is repeated to RGB); the GIF is
    written last, so an existing GIF marks a complete pair."""
    from ditforge.data.video import display_scale, write_gif, write_video

    if frames.shape[-1] == 1:
        frames = frames.repeat(3, axis=-1)
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_video(frames, stem.with_suffix(".mp4"), fps)
    write_gif(frames, stem.with_suffix(".gif"), fps)
    k = display_scale(*frames.shape[1:3])
    log.info("wrote %s.mp4 and .gif: %d frames of %dx%d (shown %dx enlarged) at %d fps", stem, len(frames),
             frames.shape[2], frames.shape[1], k, fps)


def write_videos(videos: np.ndarray, folder: Path, names: list[str], fps: int) -> None:
    """Write (N, T, H, W, C) uint8 videos as ``folder/NNN-name.mp4`` plus ``.gif`` (grey is repeated to RGB)."""
    width = max(3, len(str(len(videos) - 1)))
    for i, (frames, name) in enumerate(zip(videos, names)):
        write_video_files(frames, folder / f"{i:0{width}d}-{name}", fps)
    log.info("wrote %d videos to %s", len(videos), folder)


VIDEO_FILE_SUFFIXES = (".mp4", ".gif", ".avi", ".mov", ".mkv", ".webm")
IMAGE_FILE_SUFFIXES = (".png", ".jpg", ".jpeg", ".npz")


def video_file_out(out: str | None, count: int) -> Path | None:
    """Where ``--out`` of a video model names one file (a suffix of ``VIDEO_FILE_SUFFIXES``): that path, for
    ``count`` == 1 video; None where it names a folder (or is None).

    Raises:
        UserError: a video file name for ``count`` > 1 videos, or an image / .npz file name (one line each).
    """
    from ditforge.errors import UserError

    if out is None:
        return None
    path = Path(out)
    suffix = path.suffix.lower()
    if suffix in VIDEO_FILE_SUFFIXES:
        if count != 1:
            raise UserError(f"--out {out}: a file holds one video and there are {count} prompts; give a folder "
                            "name (one NNN-<prompt>.mp4 + .gif each)")
        return path
    if suffix in IMAGE_FILE_SUFFIXES:
        raise UserError(f"--out {out}: a video model writes a video file (.mp4, one prompt) or a folder of .mp4 "
                        "and .gif files")
    return None


def write_video_file(frames: np.ndarray, path: Path, fps: int) -> None:
    """Write (T, H, W, C) uint8 frames to the one file ``path``: a GIF for ``.gif``, else a video in the
    container of its suffix (``data.video.write_video``); grey is repeated to RGB."""
    from ditforge.data.video import write_gif, write_video

    if frames.shape[-1] == 1:
        frames = frames.repeat(3, axis=-1)
    path.parent.mkdir(parents=True, exist_ok=True)
    (write_gif if path.suffix.lower() == ".gif" else write_video)(frames, path, fps)
    log.info("wrote %s: %d frames of %dx%d at %d fps", path, len(frames), frames.shape[2], frames.shape[1], fps)


def save_npz(path: str, **arrays: np.ndarray) -> None:
    """Write ``arrays`` to the .npz file ``path`` (``np.savez``), atomically."""
    with atomic_path(path, suffix=".npz") as tmp:  # np.savez appends .npz to other names
        np.savez(tmp, **arrays)
