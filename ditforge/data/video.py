"""Video data: a CSV of ``path,text`` rows (the OpenDiT / Open-Sora convention), decoded with PyAV.

A CSV has a header row and the columns ``path`` (a video file; relative paths resolve against the CSV's
folder) and ``text`` (its caption); an optional ``image`` column names each clip's conditioning image for
image-to-video training (resolved the same way; an empty cell: the clip's first frame); an optional
``reference_image`` column its reference images for reference-image training (``takes_references`` families:
``;``-separated paths resolved the same way; an empty cell: ``default_reference``); optional ``pose_video`` and ``face_video``
columns (``DRIVING_COLUMNS``, named as a driven pipeline's arguments) the clip's driving videos,
frame-aligned with it (resolved the same way); the optional columns
``num_frames, fps, height, width`` (written by ``ditforge preprocess``) are accepted and ignored: the container is
opened to decode it anyway, and its own metadata is what counts. The built-in ``clips`` data set
(``ditforge.data.clips``) is a list of the same rows.
"""

from __future__ import annotations

import csv
import logging
import numbers
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
from av.video.reformatter import VideoReformatter
from PIL import Image
from torch.utils.data import Dataset

from ditforge.atomic import atomic_path
from ditforge.data.images import (CSV_EXPECTED, center_crop_arr, error_text, file_source, load_or_substitute,
                                  read_csv_rows, report_bad_samples)
from ditforge.data.sampler import derive_seed
from ditforge.errors import UserError

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mov", ".mkv", ".webm")
REQUIRED_COLUMNS = ("path", "text")
REFERENCE_SEPARATOR = ";"  # between the paths of a ``reference_image`` cell
REFERENCE_STREAM = 6007  # the key that sets the default references' draws apart from every other's
META_COLUMNS = ("num_frames", "fps", "height", "width")
DRIVING_COLUMNS = ("pose_video", "face_video")  # a driven pipeline's videos beside the clip (its call's arguments)
log = logging.getLogger(__name__)


class BadVideo(ValueError):
    """A video that cannot be used: no video stream, no frames, or fewer frames than a clip needs."""


# Errors that mean "this file is bad", not "ditforge has a bug": PyAV's (av.FFmpegError, whose
# InvalidDataError is also a ValueError), missing or unreadable files (OSError), BadVideo (a ValueError).
DECODE_ERRORS = (av.FFmpegError, OSError, ValueError, EOFError)


def _open(source: str | Path | bytes) -> av.container.InputContainer:
    """A video file by its path, or the bytes of one (a shard member: PyAV reads from a file object)."""
    return av.open(file_source(source))


# ----------------------------------------------------------------------------------------------------------
# Frame selection and decoding


def frame_plan(num_available: int, num_frames: int, frame_interval: int) -> tuple[int, int]:
    """The stride and the last valid start frame of a clip of ``num_frames`` frames from a video of
    ``num_available`` frames.

    A clip with stride s spans ``(num_frames - 1) * s + 1`` frames. The stride is ``frame_interval`` when the
    video is long enough for it, else the largest smaller stride that fits (down to 1): ``min(frame_interval,
    (num_available - 1) // (num_frames - 1))``. The start may be any frame in ``[0, max_start]``.

    Returns:
        ``(stride, max_start)``, both int.
    Raises:
        BadVideo: ``num_available < num_frames`` (too short even at stride 1).
    """
    if num_available < num_frames:
        raise BadVideo(f"too short: {num_available} frames, a clip needs {num_frames}")
    stride = frame_interval if num_frames == 1 else min(frame_interval, (num_available - 1) // (num_frames - 1))
    return stride, num_available - ((num_frames - 1) * stride + 1)


def _video_stream(container: av.container.InputContainer) -> av.VideoStream:
    if not container.streams.video:
        raise BadVideo("no video stream")
    return container.streams.video[0]


def _rate(stream: av.VideoStream) -> Fraction | None:
    rate = stream.average_rate or stream.guessed_rate
    return Fraction(rate) if rate else None


def _metadata_frame_count(container: av.container.InputContainer, stream: av.VideoStream) -> int:
    """Frames in the stream by its metadata: the container's count (AVI, MP4, MOV) or duration x frame rate
    (MKV, WebM); 0 when unknown. Cheap (no decoding); may be off by a frame or two."""
    if stream.frames:
        return int(stream.frames)
    rate = _rate(stream)
    if rate is None:
        return 0
    if stream.duration and stream.time_base:
        return round(stream.duration * stream.time_base * rate)
    if container.duration:
        return round(Fraction(container.duration, av.time_base) * rate)
    return 0


def probe_video(path: str | Path) -> dict[str, int | float]:
    """Stream metadata of a video file without decoding it: ``{"num_frames": int (0: unknown), "fps": float
    (0.0: unknown), "height": int, "width": int}`` (pixels, frames per second).

    Raises:
        av.FFmpegError / OSError: not a readable media file. BadVideo: no video stream or no frame size.
    """
    with _open(path) as container:
        stream = _video_stream(container)
        if not (stream.width and stream.height):
            raise BadVideo("video stream without a frame size")
        rate = _rate(stream)
        return {"num_frames": _metadata_frame_count(container, stream), "fps": round(float(rate), 3) if rate else 0.0,
                "height": int(stream.height), "width": int(stream.width)}


def _count_packets(path: str | Path | bytes) -> int:
    """Frames of a stream whose metadata does not say, by demuxing (no decoding)."""
    with _open(path) as container:
        stream = _video_stream(container)
        return sum(1 for p in container.demux(stream) if p.size)


def _decode(path: str | Path | bytes, wanted: list[int], seek: bool) -> tuple[list[np.ndarray] | None, int]:
    """The frames at the ascending indices ``wanted``, each (H, W, 3) uint8 RGB, decoding no further than the
    last; with ``seek``, first jump to the key frame before ``wanted[0]`` and place frames by timestamp.

    Returns ``(frames, n)``; ``frames`` is None when the video ended first (then ``n`` is its true frame count
    when not seeking) or, with ``seek``, when the timestamps do not place the frames (then decode without).
    """
    first, last, want = wanted[0], wanted[-1], set(wanted)
    out: dict[int, np.ndarray] = {}
    idx = -1
    # A converter of this call's own, not the one per thread that PyAV 18 keeps for frame.to_ndarray: that one's
    # swscale slice threads (FFmpeg 8), started in the parent, do not exist in a forked DataLoader worker, whose
    # first conversion then waits on them forever
    rgb = VideoReformatter()
    with _open(path) as container:
        stream = _video_stream(container)
        rate, tb, t0 = _rate(stream), stream.time_base, stream.start_time or 0
        if seek:
            if rate is None or not tb:
                return None, -1
            container.seek(t0 + int(Fraction(first) / rate / tb), stream=stream, backward=True, any_frame=False)
        for k, frame in enumerate(container.decode(stream)):
            if seek:
                if frame.pts is None:
                    return None, -1
                idx = round((frame.pts - t0) * tb * rate)
                if k == 0 and idx > first:  # landed past the start: cannot trust the seek
                    return None, -1
            else:
                idx = k
            if idx in want:
                out[idx] = rgb.reformat(frame, format="rgb24").to_ndarray()
            if idx >= last:
                break
    if len(out) == len(wanted):
        return [out[i] for i in wanted], idx + 1
    return None, idx + 1


def read_clip(path: str | Path | bytes, num_frames: int, frame_interval: int,
              choose_start: Callable[[int], int]) -> tuple[np.ndarray, list[int]]:
    """Decode one clip: ``num_frames`` frames ``start + k * stride`` of ``path`` (a file, or a video's bytes; see
    ``frame_plan`` for the stride), ``start = choose_start(max_start)`` in ``[0, max_start]``.

    Decodes only what the clip needs: it seeks to the key frame before the start (placing frames by their
    timestamps, constant frame rate assumed; if the timestamps disagree it decodes from the first frame,
    counting frames) and stops after the last frame. When the metadata's frame count was too high, the clip
    is planned again from the true count. Containers are closed.

    Returns:
        ``(frames (T, H, W, 3) uint8 RGB, the frame indices (T,))``.
    Raises:
        BadVideo: no video stream, or too short. av.FFmpegError / OSError / ValueError: unreadable file.
    """
    with _open(path) as container:
        n = _metadata_frame_count(container, _video_stream(container))
    if n <= 0:
        n = _count_packets(path)
    for _ in range(2):
        stride, max_start = frame_plan(n, num_frames, frame_interval)
        start = choose_start(max_start)
        if not 0 <= start <= max_start:  # a bug, not a bad file: not one of DECODE_ERRORS
            raise RuntimeError(f"choose_start gave {start}, outside [0, {max_start}]")
        wanted = [start + k * stride for k in range(num_frames)]
        frames = _decode(path, wanted, seek=True)[0] if start > 0 else None
        if frames is None:
            frames, n = _decode(path, wanted, seek=False)
        if frames is not None:
            return np.stack(frames), wanted
    raise BadVideo(f"decoding ended early, at frame {n}")


# ----------------------------------------------------------------------------------------------------------
# CSV files


def read_video_csv(path: str | Path) -> list[dict[str, str]]:
    """The rows of a video CSV as dicts (column names stripped and lower-cased; UTF-8, a BOM allowed). Each
    row also gets ``"_line"``: its line number in the file, for messages.

    Raises:
        UserError: the file does not exist, is empty, or its header lacks ``path`` or ``text``.
    """
    header, rows = read_csv_rows(path)
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise UserError(f"--data: {path} has no column {' or '.join(missing)} in its header row "
                        f"({','.join(header)[:80]}); {CSV_EXPECTED}")
    return [{**row, "_line": str(line)} for line, row in rows]


def resolve_cell(base: Path, cell: str) -> Path:
    """A CSV cell's file: relative paths against the CSV's folder ``base``, ``~`` expanded."""
    return base / Path(cell.strip()).expanduser()


def write_video_csv(rows: Sequence[Mapping[str, object]], path: str | Path,
                    columns: Sequence[str] = REQUIRED_COLUMNS) -> Path:
    """Write ``rows`` (dicts with at least ``columns``) as a CSV with a header row, quoted by the csv module;
    atomically (temporary name, then rename). Returns ``path``."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
    return path


# ----------------------------------------------------------------------------------------------------------
# The data set


class VideoDataset(Dataset):
    """Captioned video clips: ``num_frames`` frames each, resized and centre-cropped to ``image_size``.

    ``source`` is a CSV file (see the module docstring) or its rows as a list of dicts with ``path`` and
    ``text`` (relative paths then resolve against the current folder), as the built-in ``clips`` passes.

    Frame selection: a clip of T = ``num_frames`` frames at stride s spans (T - 1) * s + 1 frames. The stride
    is ``frame_interval`` when the video is long enough, else the largest smaller stride that fits, down to 1;
    a video with fewer than T frames is too short (a bad sample). The start frame is uniform in the valid
    range from a generator seeded by ``derive_seed(seed, index)`` (the same clip of sample ``index`` every time
    it is read, on any process), or the middle of the range (``(max_start) // 2``) with ``random_start=False``.
    So ``cache=True`` (keep decoded clips in memory; the built-in ``clips`` does) changes nothing but speed.

    Each frame is resized with Pillow as DiT's ``center_crop_arr`` does for images (box-filter halving while
    the short side is at least twice ``image_size``, then bicubic, which antialiases) and centre-cropped.

    Items are dicts: ``video`` (3, T, S, S) float32 in [-1, 1] (``uint8 / 127.5 - 1``), ``text`` str, ``label``
    int (the caption's index in ``classes``, the sorted distinct captions: class-conditional training on e.g.
    UCF101, whose captions are the action classes), ``index`` int (the sample actually returned, which is a
    substitute when ``index`` was bad); where the rows have an ``image`` column, also ``image`` (3, S, S) float32
    in [-1, 1]: that file, resized and cropped as the frames, or the clip's first frame where the cell is empty
    (an image-to-video pipeline's first frame; ``image_paths`` holds the files, None without the column); where a
    row's ``reference_image`` cell names files, also ``references`` (R, 3, S, S) float32 in [-1, 1], each resized
    and cropped as the frames (``reference_paths`` holds the lists); where a row names ``DRIVING_COLUMNS``
    videos, also each by its column's name, (3, T, S, S) float32 in [-1, 1]: the same frame indices as the clip
    (the same start and stride: the videos are expected frame-aligned with it, of its length), resized and
    cropped as its frames (``driving_paths``). A row naming a missing image, reference or driving file is dropped
    as one with a missing video; an unreadable one makes a bad sample.

    Bad input never stops a run. Rows whose file is missing (or whose ``path`` is empty or row is cut short)
    are dropped at start, counted in ``num_dropped`` and recorded in ``bad_samples_path`` (JSON lines with the
    row and the reason). A video that turns out unreadable, corrupt, empty or too short when read is recorded
    once and replaced by the next good sample (``index + 1, index + 2, ...`` wrapping around), so the
    substitute is the same on every process.

    Raises:
        UserError: bad settings (naming the flag); for a CSV, see ``read_video_csv``; no valid row at all.
    """

    in_channels = 3

    def __init__(self, source: str | Path | Sequence[Mapping[str, str]], num_frames: int, frame_interval: int,
                 image_size: int, bad_samples_path: str | Path | None = None, seed: int = 0,
                 random_start: bool = True, name: str | None = None, cache: bool = False):
        for flag, value in (("--num_frames", num_frames), ("--frame_interval", frame_interval),
                            ("--image_size", image_size)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise UserError(f"{flag} must be a positive integer for video data, got {value!r}")
        if isinstance(source, (str, Path)):
            rows, base, self.name = read_video_csv(source), Path(source).parent, name or str(source)
        else:
            rows, base, self.name = [dict(r) for r in source], Path(), name or "video rows"
        self.num_frames, self.frame_interval, self.image_size = int(num_frames), int(frame_interval), int(image_size)
        self.bad_samples_path, self.seed, self.random_start = bad_samples_path, seed, random_start
        self.paths: list[str] = []
        self.texts: list[str] = []
        images: list[str | None] = []
        self.reference_paths: list[list[str]] = []
        self.driving_paths: list[dict[str, str]] = []
        with_images = any("image" in row for row in rows)
        dropped = []
        for row in rows:
            raw = (row.get("path") or "").strip()
            text = row.get("text")
            reason = None
            if not raw:
                reason = "empty path"
            elif text is None:
                reason = "row has fewer fields than the header (no text)"
            else:
                file = base / Path(raw).expanduser()
                image = (row.get("image") or "").strip()
                refs = [str(base / Path(r.strip()).expanduser())
                        for r in (row.get("reference_image") or "").split(REFERENCE_SEPARATOR) if r.strip()]
                if not file.is_file():
                    reason = "file not found"
                elif image and not (base / Path(image).expanduser()).is_file():
                    reason = "image file not found"
                elif not all(Path(r).is_file() for r in refs):
                    reason = "reference image file not found"
                driving = {c: str(resolve_cell(base, row[c])) for c in DRIVING_COLUMNS if (row.get(c) or "").strip()}
                missing = [c for c, f in driving.items() if not Path(f).is_file()]
                if reason is None and missing:
                    reason = f"{missing[0]} file not found"
            if reason is not None:
                record = {"path": str(base / raw) if raw else "", "error": reason,
                          "row": {k: v for k, v in row.items() if k != "_line"}}
                if "_line" in row:
                    record["line"] = int(row["_line"])
                dropped.append(record)
                continue
            self.paths.append(str(file))
            self.texts.append(text)
            images.append(str(base / Path(image).expanduser()) if image else None)
            self.reference_paths.append(refs)
            self.driving_paths.append(driving)
        self.num_dropped = len(dropped)
        if dropped:
            report_bad_samples(bad_samples_path, dropped, "video row")
            log.warning("%s: %d of %d rows dropped (missing file, no path or no text)%s", self.name, len(dropped),
                        len(rows), f"; recorded in {bad_samples_path}" if bad_samples_path is not None else "")
        if not self.paths:
            raise UserError(f"--data: {self.name} has no valid rows ({len(rows)} rows, {len(dropped)} with a "
                            "missing file or no path/text; expected rows path,text naming existing video files)")
        self.classes = sorted(set(self.texts))  # distinct captions as class labels (UCF101: the action classes)
        self.num_classes = len(self.classes)
        self._label = {text: i for i, text in enumerate(self.classes)}
        self.max_substitutions = len(self.paths)  # every sample may be tried before giving up
        self._bad: dict[int, str] = {}  # known bad samples of this process (index -> error): not decoded again
        self._cache: dict[int, torch.Tensor] | None = {} if cache else None
        self.image_paths: list[str | None] | None = images if with_images else None

    def __len__(self) -> int:
        return len(self.paths)

    def start_frame(self, index: int, max_start: int) -> int:
        """Start frame of sample ``index`` given the last valid one (see the class docstring)."""
        if not self.random_start:
            return max_start // 2
        return int(np.random.default_rng(derive_seed(self.seed, index)).integers(0, max_start + 1))

    def load(self, index: int) -> torch.Tensor:
        """Decode, crop and scale sample ``index``: (3, T, S, S) float32 in [-1, 1].

        Raises:
            BadVideo, av.FFmpegError, OSError, ValueError: a bad file (see ``read_clip``).
        """
        if index in self._bad:
            raise BadVideo(f"found bad before ({self._bad[index]})")
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        clip = self._frames(self.paths[index], index)
        if self._cache is not None:
            self._cache[index] = clip
        return clip

    def _frames(self, path: str, index: int) -> torch.Tensor:
        frames, _ = read_clip(path, self.num_frames, self.frame_interval, lambda m: self.start_frame(index, m))
        arr = np.stack([center_crop_arr(Image.fromarray(f), self.image_size) for f in frames])  # (T, S, S, 3)
        return torch.from_numpy(arr).permute(3, 0, 1, 2).float().div(127.5).sub(1.0)

    def _image(self, path: str) -> torch.Tensor:
        with Image.open(path) as img:
            arr = center_crop_arr(img.convert("RGB"), self.image_size)
        return torch.from_numpy(arr).permute(2, 0, 1).float().div(127.5).sub(1.0)

    def load_with_image(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, dict]:
        """``load(index)``, the sample's conditioning image (3, S, S) float32 in [-1, 1] (its ``image`` file,
        else the clip's first frame; None without an ``image`` column), its references (R, 3, S, S) float32 in
        [-1, 1] (None where its ``reference_image`` cell names none) and its driving videos (column -> (3, T, S, S)
        float32 in [-1, 1], the clip's frame indices; {} where it names none).

        Raises:
            as ``load``; OSError, ValueError: an unreadable image file.
        """
        clip = self.load(index)
        refs = self.reference_paths[index]
        references = torch.stack([self._image(r) for r in refs]) if refs else None
        driving = {c: self._frames(f, index) for c, f in self.driving_paths[index].items()}
        if self.image_paths is None:
            return clip, None, references, driving
        path = self.image_paths[index]
        return clip, (clip[:, 0] if path is None else self._image(path)), references, driving

    def __getitem__(self, index: int) -> dict:
        j, (video, image, refs, driving) = load_or_substitute(index, len(self.paths), self.load_with_image,
                                                              self._report_bad, DECODE_ERRORS,
                                                              self.max_substitutions, "unusable videos")
        item = {"video": video, "text": self.texts[j], "label": self._label[self.texts[j]], "index": j, **driving}
        if image is not None:
            item["image"] = image
        if refs is not None:
            item["references"] = refs
        return item

    def _report_bad(self, j: int, error: Exception) -> None:
        if j in self._bad:
            return
        self._bad[j] = error_text(error)
        report_bad_samples(self.bad_samples_path,
                           [{"path": self.paths[j], "error": error_text(error), "text": self.texts[j], "index": j}],
                           "video")


# ----------------------------------------------------------------------------------------------------------
# Writing videos (``ditforge sample``)

MIN_DISPLAY_SIDE = 64  # written videos and GIFs are enlarged until their shorter side has at least this many pixels


def default_reference(clip: torch.Tensor, seed: int, index: int) -> torch.Tensor:
    """The reference image of a clip that names none (reference-image training, ``takes_references``): the centre
    square crop, of half the clip's shorter side, of frame k of the clip, resized (bicubic, clamped) to the clip's
    height x width; k is drawn uniformly from the T frames by ``derive_seed(seed, REFERENCE_STREAM, index)``, so a
    sample (data index ``index``) gets the same reference on every process, epoch and resumed run.

    Args:
        clip: (3, T, H, W) float in [-1, 1].
    Returns:
        (3, H, W) float32 in [-1, 1].
    """
    _, T, H, W = clip.shape
    k = int(np.random.default_rng(derive_seed(seed, REFERENCE_STREAM, index)).integers(0, T))
    side = max(1, min(H, W) // 2)
    top, left = (H - side) // 2, (W - side) // 2
    crop = clip[:, k, top:top + side, left:left + side].float()[None]
    return torch.nn.functional.interpolate(crop, size=(H, W), mode="bicubic", align_corners=False)[0].clamp(-1, 1)


def default_references(clips: torch.Tensor, indices, seed: int) -> torch.Tensor:
    """The batch's references where its rows name none: each clip's ``default_reference`` (its data index from
    ``indices``, B ints), (B, 1, 3, H, W) float32 in [-1, 1] for clips (B, 3, T, H, W)."""
    return torch.stack([default_reference(clip, seed, int(i))[None] for clip, i in zip(clips, indices)])


def display_scale(height: int, width: int) -> int:
    """The integer factor k by which ``write_video`` and ``write_gif`` enlarge frames of ``height`` x ``width``:
    the smallest k >= 1 with ``k * min(height, width) >= 64`` (8 px -> 8, 12 px -> 6, 64 px and up -> 1)."""
    return max(1, -(-MIN_DISPLAY_SIDE // min(height, width)))


def _check_frames(frames: np.ndarray) -> None:
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 frames (T, H, W, 3), got {getattr(frames, 'dtype', type(frames))} "
                         f"{getattr(frames, 'shape', '')}")
    if frames.shape[0] < 1 or frames.shape[1] < 1 or frames.shape[2] < 1:
        raise ValueError(f"expected at least one frame of at least 1x1 pixels, got shape {frames.shape}")


def _enlarge(frames: np.ndarray) -> np.ndarray:
    """(T, H, W, 3) -> (T, kH, kW, 3), nearest neighbour (each pixel becomes a k x k block), k = display_scale."""
    k = display_scale(frames.shape[1], frames.shape[2])
    return frames if k == 1 else frames.repeat(k, axis=1).repeat(k, axis=2)


_ENCODER: str | None = None


def video_encoder() -> str:
    """The encoder ``write_video`` uses: ``libx264`` (H.264) when this PyAV/FFmpeg build has it, else ``mpeg4``
    (MPEG-4 part 2, in every FFmpeg build)."""
    global _ENCODER
    if _ENCODER is None:
        try:
            av.codec.Codec("libx264", "w")
            _ENCODER = "libx264"
        except (av.FFmpegError, ValueError):  # UnknownCodecError is a ValueError
            _ENCODER = "mpeg4"
    return _ENCODER


def write_video(frames: np.ndarray, path: str | Path, fps: int = 8) -> Path:
    """Write frames as a video file (MP4 for ``.mp4``; the container follows the suffix), atomically.

    Encoding: ``video_encoder()`` (H.264 via libx264, CRF 18, else MPEG-4 part 2 at a high bit rate), pixel format
    yuv420p (what players expect), constant ``fps`` frames per second, one frame per input frame.

    Size rule (yuv420p needs even sides; players show tiny videos as specks): frames are first enlarged by the
    integer factor k = ``display_scale(H, W)`` (the smallest k with k * min(H, W) >= 64; nearest neighbour, so
    each pixel becomes a k x k block), then an odd side is padded by one row / column at the bottom / right that
    repeats the last one. The video is ``(kH + (kH % 2)) x (kW + (kW % 2))``: 8x8 frames -> 64x64, 12x12 -> 72x72,
    65x65 -> 66x66, 128x96 -> 128x96.

    Args:
        frames: (T, H, W, 3) uint8 RGB.
        path: the file to write (its folder is created); written under a temporary name, then renamed.
        fps: frames per second, >= 1.

    Returns:
        ``path`` as a Path.

    Raises:
        ValueError: frames not uint8 (T, H, W, 3) with T, H, W >= 1, or fps < 1. av.FFmpegError: encoding failed.
    """
    _check_frames(frames)
    if int(fps) != fps or fps < 1:
        raise ValueError(f"fps must be a positive integer, got {fps}")
    big = _enlarge(frames)
    pad_h, pad_w = big.shape[1] % 2, big.shape[2] % 2
    if pad_h or pad_w:
        big = np.pad(big, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    height, width = big.shape[1:3]
    path = Path(path)
    codec = video_encoder()
    with atomic_path(path, suffix=path.suffix) as tmp:  # the suffix tells FFmpeg the container
        with av.open(str(tmp), mode="w") as container:
            stream = container.add_stream(codec, rate=int(fps))
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            if codec == "libx264":
                stream.options = {"crf": "18"}
            else:
                stream.bit_rate = max(1_000_000, 8 * width * height * int(fps))
            for array in big:
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())  # flush the delayed frames
    return path


def write_gif(frames: np.ndarray, path: str | Path, fps: int = 8) -> Path:
    """Write frames as a looping animated GIF (Pillow), atomically: a preview that shows inline almost anywhere.

    Frames are enlarged by the same integer factor k as ``write_video`` (``display_scale``; nearest neighbour; no
    padding: GIF takes any size), so the GIF is kH x kW. Each frame shows ``1000 / fps`` ms (Pillow rounds to whole
    ms; GIF itself stores hundredths of a second), ``loop=0`` repeats forever. Colours are reduced to a 256-colour
    palette per frame by Pillow. Pillow merges consecutive identical frames into one longer frame.

    Args:
        frames: (T, H, W, 3) uint8 RGB.
        path: the file to write (its folder is created); written under a temporary name, then renamed.
        fps: frames per second, > 0.

    Returns:
        ``path`` as a Path.

    Raises:
        ValueError: frames not uint8 (T, H, W, 3), or fps <= 0.
    """
    _check_frames(frames)
    if not fps > 0:
        raise ValueError(f"fps must be positive, got {fps}")
    images = [Image.fromarray(np.ascontiguousarray(f)) for f in _enlarge(frames)]
    path = Path(path)
    with atomic_path(path) as tmp:
        images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:], loop=0, duration=1000 / fps)
    return path
