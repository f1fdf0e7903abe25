"""Multi-resolution buckets (Open-Sora's ``bucket_config``), and images and videos in one data set.

A bucket is a resolution x a frame count x an aspect ratio; each (resolution, frame count) has its own global
batch size and keep probability. ``--buckets FILE`` (YAML or JSON) maps a resolution name to ``{frame count:
[keep probability, global batch size]}``, as Open-Sora's ``bucket_config``::

    256px: {1: [1.0, 64], 16: [0.5, 8]}
    512px: {1: [0.5, 16]}

Resolution names (``resolution_area``): ``<N>px`` or ``<N>`` is the area of an N x N square; ``<N>p`` the area
of an N-line 16:9 frame, N x round(16 N / 9) (240p: 240 x 427 = 102,480 pixels). Frame count 1 is the image
bucket (an image is a 1-frame video); larger counts are video buckets.

Aspect ratios, height:width (``ASPECT_RATIOS``): 1:2, 9:16, 2:3, 3:4, 1:1, 4:3, 3:2, 16:9, 2:1. The shape of a
ratio r at an area A (``aspect_shape``) is the pair of multiples of ``multiple`` (the VAE's downsample x the
model's patch; the patch alone in pixel space) next to sqrt(A r) x sqrt(A / r) (each rounded down or up) whose
log aspect error plus log area error is smallest. Ratios whose shapes coincide (small areas, large multiples)
make one bucket.

Assignment (``Buckets.assign_bucket``, Open-Sora's rule, with a drop where Open-Sora keeps the last try):

1. Candidates, largest resolution first: every resolution the sample is big enough for, H x W >= 0.8 A
   (Open-Sora's 0.8: at most 1.25x upscaling in area), with one frame count there: for an image, 1 if the
   resolution has a 1-frame bucket; for a video, the largest count F > 1 it fills at the full stride,
   (F - 1) x frame_interval + 1 <= its frames. Videos never go to 1-frame buckets; a resolution without a
   fitting frame count is no candidate.
2. Keep draws: the first candidate whose uniform draw u < its keep probability takes the sample; a failed draw
   falls to the next smaller candidate. A sample that no draw keeps is dropped for this epoch (counted).
3. Aspect: the bucket of that resolution and frame count whose h / w is nearest to the sample's H / W in log
   (1:2 and 2:1 are equally far from 1:1; ties go to the lower ratio). So every sample lands in a bucket of its
   own nearest aspect ratio, resized there by ``center_crop_arr`` (scale to cover, centre crop) and its frames
   sampled at the data set's stride.

Batches (``BucketBatchSampler``): per epoch e, every sample draws its keep draws from a generator seeded by
``derive_seed(seed, e)``, then each bucket's samples are permuted and cut into global batches of its batch size
(the incomplete tail is dropped, as ``drop_last``), and the order of all batches is permuted, from the same
generator. Step k's global batch is so a fixed function of (seed, k), split over ranks as ``GlobalBatchSampler``
does at every world size, and resuming needs only k. Epochs differ in length (the keep draws differ).

Mixed batches (``--buckets`` with ``--pack_tokens``, ``BucketBatchSampler(..., batch_size=B)``): the same keep
draws, then all the epoch's kept samples in one permutation from the same generator, cut into global batches of
B samples whatever their buckets (the tail dropped); each sample still at its own bucket's shape. The buckets'
batch sizes are not used. Step k's batch is again a function of (seed, k) alone.
"""

from __future__ import annotations

import bisect
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image, ImageOps
from torch.utils.data import Dataset, Sampler

from ditforge.data.images import (IMAGE_EXTENSIONS, center_crop_arr, error_text, file_source, load_or_substitute,
                                  report_bad_samples)
from ditforge.data.sampler import derive_seed
from ditforge.errors import UserError

ASPECT_RATIOS = ((1, 2), (9, 16), (2, 3), (3, 4), (1, 1), (4, 3), (3, 2), (16, 9), (2, 1))  # height:width
AREA_FRACTION = 0.8  # a sample fits a resolution of area A when H x W >= AREA_FRACTION x A (Open-Sora's)
FLAG = "--buckets"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bucket:
    """One bucket: ``height`` x ``width`` pixels, ``num_frames`` frames (1: images), of ``resolution``; global
    ``batch_size`` samples per step; ``keep_prob`` of its (resolution, frame count)."""

    resolution: str
    num_frames: int
    height: int
    width: int
    batch_size: int
    keep_prob: float

    @property
    def name(self) -> str:
        """e.g. ``"256px/16f/192x336"``."""
        return f"{self.resolution}/{self.num_frames}f/{self.height}x{self.width}"


def resolution_area(name: str) -> int:
    """The area in pixels of a resolution name: ``"256px"`` or ``"256"`` -> 256 x 256; ``"240p"`` -> 240 x 427
    (an N-line 16:9 frame, N x round(16 N / 9)).

    Raises:
        UserError: any other name (naming ``--buckets``).
    """
    m = re.fullmatch(r"([1-9][0-9]*)(px|p)?", str(name).strip().lower())
    if m is None:
        raise UserError(f"{FLAG}: unknown resolution {name!r}; expected e.g. 256px (a 256x256 area) or 240p "
                        "(a 240-line 16:9 frame)")
    n = int(m.group(1))
    return n * round(16 * n / 9) if m.group(2) == "p" else n * n


def aspect_shape(area: int, ratio: tuple[int, int], multiple: int) -> tuple[int, int]:
    """(h, w), both multiples of ``multiple`` (at least ``multiple``), for the aspect ``ratio`` (height, width)
    at about ``area`` pixels: of the multiples next to sqrt(area r) and sqrt(area / r) (r = height / width; each
    rounded down and up), the pair with the least |log((h / w) / r)| + |log(h w / area)|."""
    r = ratio[0] / ratio[1]

    def around(x: float) -> set[int]:
        return {max(multiple, math.floor(x / multiple) * multiple), max(multiple, math.ceil(x / multiple) * multiple)}

    pairs = [(h, w) for h in sorted(around(math.sqrt(area * r))) for w in sorted(around(math.sqrt(area / r)))]
    return min(pairs, key=lambda p: abs(math.log(p[0] / p[1] / r)) + abs(math.log(p[0] * p[1] / area)))


def read_bucket_config(path: str | Path) -> dict[str, dict[int, tuple[float, int]]]:
    """A ``--buckets`` file (YAML, of which JSON is a subset): ``{resolution: {frame count: (keep probability,
    global batch size)}}``, frame counts as ints (JSON keys are strings).

    Raises:
        UserError: unreadable file, or an entry that is not a known resolution with positive integer frame counts,
            a keep probability in [0, 1] and a positive integer batch size (naming the file and entry).
    """
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UserError(f"{FLAG}: cannot read {path}: {' '.join(str(e).split())[:200]}") from None
    expected = "expected {resolution: {frame count: [keep probability, batch size]}}, e.g. {256px: {1: [1.0, 64]}}"
    if not isinstance(loaded, Mapping) or not loaded:
        raise UserError(f"{FLAG}: {path} holds no buckets; {expected}")
    config = {}
    for res, frames in loaded.items():
        resolution_area(res)
        if not isinstance(frames, Mapping) or not frames:
            raise UserError(f"{FLAG}: {path}: {res} holds no frame counts; {expected}")
        config[str(res)] = {}
        for t, value in frames.items():
            where = f"{FLAG}: {path}: {res} frame count {t}"
            if not re.fullmatch(r"[1-9][0-9]*", str(t).strip()):
                raise UserError(f"{where}: not a positive integer; {expected}")
            ok = isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2
            keep, batch = value if ok else (None, None)
            if not (isinstance(keep, (int, float)) and not isinstance(keep, bool) and 0 <= keep <= 1):
                raise UserError(f"{where}: expected [keep probability in [0, 1], batch size], got {value!r}")
            if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
                raise UserError(f"{where}: expected [keep probability, positive integer batch size], got {value!r}")
            config[str(res)][int(str(t))] = (float(keep), batch)
    return config


class Buckets:
    """The buckets of a ``--buckets`` config (``read_bucket_config``), shapes divisible by ``multiple``, videos
    sampled at ``frame_interval`` (see the module docstring for the rules).

    Attributes:
        buckets: every ``Bucket``, ordered by resolution (largest area first), frame count (largest first) and
            aspect ratio (lowest h / w first); a bucket's index in this list is its id.
        num_frames: the largest frame count, or None when every bucket holds images (an image run).
        image_size: the side of the largest resolution's 1:1 bucket (the model's configured input size).
    """

    def __init__(self, config: Mapping[str, Mapping[int, tuple[float, int]]], multiple: int, frame_interval: int = 1):
        self.multiple, self.frame_interval = int(multiple), int(frame_interval)
        self.resolutions = sorted(config, key=lambda r: (-resolution_area(r), r))
        self.buckets: list[Bucket] = []
        self._ids: dict[tuple[str, int], list[int]] = {}  # (resolution, frames) -> bucket ids, lowest ratio first
        for res in self.resolutions:
            area = resolution_area(res)
            shapes = sorted({aspect_shape(area, r, self.multiple) for r in ASPECT_RATIOS}, key=lambda s: s[0] / s[1])
            for t in sorted(config[res], reverse=True):
                keep, batch = config[res][t]
                self._ids[res, t] = list(range(len(self.buckets), len(self.buckets) + len(shapes)))
                self.buckets += [Bucket(res, t, h, w, batch, keep) for h, w in shapes]
        top = max(t for frames in config.values() for t in frames)
        self.num_frames = top if top > 1 else None
        self.image_size = aspect_shape(resolution_area(self.resolutions[0]), (1, 1), self.multiple)[0]
        self._cache: dict[tuple[int, int, int], tuple[int, ...]] = {}

    @classmethod
    def exact(cls, height: int, width: int, num_frames: int, frame_interval: int = 1) -> Buckets:
        """One bucket of exactly ``height`` x ``width`` pixels and ``num_frames`` frames (a distilled student's
        clips, ``train.distill_real``): every sample read there is scaled to cover it and centre-cropped
        (``read_at_bucket``), whatever its aspect ratio."""
        side = math.isqrt(height * width)  # a resolution of about the bucket's area (rule 1's size check)
        out = cls({f"{side}px": {num_frames: (1.0, 1)}}, 1, frame_interval)
        out.buckets = [Bucket(f"{side}px", num_frames, height, width, 1, 1.0)]
        out._ids = {(f"{side}px", num_frames): [0]}
        return out

    def candidates(self, height: int, width: int, num_frames: int) -> tuple[int, ...]:
        """The bucket ids a sample of ``height`` x ``width`` pixels and ``num_frames`` frames (1: an image) may
        go to, in the order its keep draws are tried (rule 1 and 3 of the module docstring); () when none."""
        key = (int(height), int(width), int(num_frames))
        if key not in self._cache:
            found = []
            for res in self.resolutions:
                if height * width < AREA_FRACTION * resolution_area(res):
                    continue
                counts = [t for r, t in self._ids if r == res and (t == 1 if num_frames == 1 else
                          1 < t and (t - 1) * self.frame_interval + 1 <= num_frames)]
                if counts:
                    ids = self._ids[res, max(counts)]
                    aspect = math.log(height / width)
                    found.append(min(ids, key=lambda b: abs(math.log(self.buckets[b].height / self.buckets[b].width)
                                                            - aspect)))
            self._cache[key] = tuple(found)
        return self._cache[key]

    def assign_bucket(self, height: int, width: int, num_frames: int, rng_key: int | Sequence[int]) -> Bucket | None:
        """The bucket of a sample of ``height`` x ``width`` pixels and ``num_frames`` frames (1: an image), or
        None (dropped: too small or short for every bucket, or no keep draw passed). Pure: the keep draws are
        uniforms from ``numpy.random.SeedSequence(rng_key)`` (e.g. ``(seed, epoch, sample id)``), one 32-bit word
        per candidate, u = word / 2**32."""
        cands = self.candidates(height, width, num_frames)
        if not cands:
            return None
        keys = [int(rng_key)] if isinstance(rng_key, (int, np.integer)) else [int(k) for k in rng_key]
        u = np.random.SeedSequence([k % 2**63 for k in keys]).generate_state(len(cands)) / 2**32
        b = self.choose(np.array([cands]), u[None])[0]
        return self.buckets[b] if b >= 0 else None

    def choose(self, cands: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Rule 2, for many samples: ``cands`` (N, M) int bucket ids (-1: no candidate), ``u`` (N, M) uniforms in
        [0, 1) -> (N,) int64 the first candidate with u < its keep probability, -1 for none."""
        keep = np.array([b.keep_prob for b in self.buckets] + [0.0])[cands]  # id -1 -> the 0.0 at the end
        kept = u < keep
        first = kept.argmax(axis=1)
        return np.where(kept.any(axis=1), cands[np.arange(len(cands)), first], -1)

    def check_batch_sizes(self, divisor: int, what: str) -> None:
        """Raise UserError (naming ``--buckets``) unless every bucket's batch size is divisible by ``divisor``
        (``what`` says what it is, e.g. "the number of processes (4)")."""
        for b in self.buckets:
            if b.batch_size % divisor:
                raise UserError(f"{FLAG}: the batch size {b.batch_size} of {b.resolution} {b.num_frames} frames is "
                                f"not divisible by {what}")


def data_buckets(sizes: np.ndarray, image_size: int, multiple: int, frame_step: int, max_frames: int | None,
                 frame_interval: int, batch_size: int, min_frames: int = 1) -> Buckets:
    """Buckets made from the data, for a run without ``--buckets``: one resolution, ``<image_size>px`` (the area
    ``image_size`` squared), at every aspect ratio (each sample goes to its nearest, the module docstring's rule 3),
    with the frame counts the samples fill: 1 for images, and for a video of n frames the largest count F of the
    frame rule F = ``frame_step`` k + 1 (the VAE's, e.g. 4k + 1) that it fills at the stride, (F - 1)
    ``frame_interval`` + 1 <= n, and that is at most ``max_frames`` (``--num_frames``; None: no cap); counts below
    ``min_frames`` are left out (an image-to-video family that gives its first latent frames learns nothing from
    clips of no more latent frames: images then fit no bucket). Keep probability 1, each bucket's global batch
    ``batch_size``. ``sizes``: (N, 3) int (height, width, frames).

    Raises:
        UserError: no sample of a usable frame count (videos shorter than ``frame_step`` + 1 frames, or than
            ``min_frames``, at the stride).
    """
    counts = set()
    for frames in np.unique(np.asarray(sizes)[:, 2]).tolist():
        fill = 1 if frames == 1 else (frames - 1) // frame_interval + 1
        fill = min(fill, max_frames) if max_frames is not None and frames > 1 else fill
        count = (fill - 1) // frame_step * frame_step + 1
        if (frames == 1 or count > 1) and count >= min_frames:  # a video goes to video buckets only (rule 1)
            counts.add(count)
    if not counts:
        cap = f" and --num_frames {max_frames}" if max_frames else ""
        raise UserError(f"--data: no video fills {max(frame_step + 1, min_frames)} frames (the frame rule "
                        f"{frame_step}k + 1) at --frame_interval {frame_interval}{cap}")
    return Buckets({f"{image_size}px": {f: (1.0, batch_size) for f in counts}}, multiple, frame_interval)


# ----------------------------------------------------------------------------------------------------------
# Images and videos in one data set


def probe_size(source: str | Path | bytes, video: bool | None = None) -> tuple[int, int, int]:
    """(height, width, frames) of an image (from its header, EXIF orientation applied; frames 1) or a video
    (PyAV's stream metadata, or a demux count when it has none), without decoding pixels. ``source``: a file
    (image or video by its extension when ``video`` is None) or a file's bytes (a shard member; ``video`` given).

    Raises:
        OSError / ValueError / SyntaxError (images), av.FFmpegError / OSError / ValueError (videos): unreadable.
    """
    if video is None:
        video = Path(source).suffix.lower() not in IMAGE_EXTENSIONS
    if not video:
        with Image.open(file_source(source)) as img:
            w, h = img.size
            if img.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # EXIF orientations that turn the image by 90 degrees
                h, w = w, h
        return h, w, 1
    from ditforge.data.video import _count_packets, probe_video

    meta = probe_video(source)
    return meta["height"], meta["width"], meta["num_frames"] or _count_packets(source)


def read_at_bucket(source: str | Path | bytes, bucket: Bucket, frame_interval: int, seed: int) -> torch.Tensor:
    """A sample at ``bucket``'s shape: (3, F, h, w) float32 in [-1, 1]. ``source``: an image (F = 1; EXIF
    orientation applied, RGB) or a video (F frames at stride ``frame_interval``, ``read_clip``, start frame uniform
    from ``seed``; a file named with ``VIDEO_EXTENSIONS`` is read so for F = 1 too), a file or its bytes; each
    frame ``center_crop_arr``-ed to (h, w).

    Raises:
        OSError / ValueError / SyntaxError / av.FFmpegError / EOFError: an unreadable file.
    """
    from ditforge.data.video import VIDEO_EXTENSIONS, read_clip

    video = isinstance(source, (str, Path)) and Path(source).suffix.lower() in VIDEO_EXTENSIONS
    if bucket.num_frames == 1 and not video:
        with Image.open(file_source(source)) as img:
            frames = [center_crop_arr(ImageOps.exif_transpose(img).convert("RGB"), (bucket.height, bucket.width))]
    else:
        clip, _ = read_clip(source, bucket.num_frames, frame_interval,
                            lambda m: int(np.random.default_rng(seed).integers(0, m + 1)))
        frames = [center_crop_arr(Image.fromarray(f), (bucket.height, bucket.width)) for f in clip]
    return torch.from_numpy(np.stack(frames)).permute(3, 0, 1, 2).float().div(127.5).sub(1.0)


class BucketDataset(Dataset):
    """Captioned images and videos together (``source``: a CSV or JSONL of ``path,text`` rows, read as captioned
    images are, see ``ditforge.data.captions``; a row's file is an image or a video by its extension; or such rows
    as dicts ``{"path", "text"}``, a folder of clips' ``ditforge.data.folders.folder_rows``), each read at the shape
    of a bucket of ``buckets``: the ``Buckets``, or a function of the probed ``sizes`` that makes them (buckets made
    from the data, ``data_buckets``).

    Sizes are probed once at start (``probe_size``, in threads): ``sizes`` (N, 3) int64 (height, width, frames).
    Rows whose file is missing, of another extension, or unreadable when probed are left out, counted in
    ``num_dropped`` and recorded in ``bad_samples_path``.

    Items: ``dataset[(index, bucket id)]`` (the keys ``BucketBatchSampler`` yields) -> dict ``x`` float32 in
    [-1, 1], (3, F, h, w) in a video run (``num_frames`` not None; images as (3, 1, h, w)) or (3, h, w) in an
    image run; ``text`` str; ``label`` int (the caption's index in ``classes``, the sorted distinct captions, as
    ``VideoDataset``); ``index`` int (the sample returned); ``references`` (R, 3, h, w) float32 in [-1, 1] where
    its row names ``reference_image`` paths (a folder's ``<stem>.ref*.png``, ``load_references``). Images: EXIF
    orientation applied, RGB, ``center_crop_arr`` to (h, w). Videos: F frames at stride ``buckets.frame_interval`` (``read_clip``; start
    frame uniform from ``derive_seed(seed, index)``), each frame ``center_crop_arr``-ed. A file that turns out
    unreadable is recorded once and replaced by the next sample (wrapping) that fits the same bucket.

    Raises:
        UserError: ``source`` missing or neither rows nor a .csv / .jsonl file, a row without path or caption, no
            usable row.
    """

    in_channels = 3
    random_flip = True
    class_captions = None

    def __init__(self, source: str | Path | list[dict], buckets: Buckets | Callable[[np.ndarray], Buckets],
                 bad_samples_path: str | Path | None = None, seed: int = 0, probe_threads: int = 8):
        from ditforge.data.captions import read_caption_csv, read_caption_jsonl
        from ditforge.data.video import VIDEO_EXTENSIONS

        if isinstance(source, list):  # rows naming files by their paths
            rows, base, source = source, Path(), "the folder of clips"
        elif Path(source).suffix.lower() in (".csv", ".jsonl"):
            source = Path(source)
            rows = read_caption_csv(source) if source.suffix.lower() == ".csv" else read_caption_jsonl(source)
            base = source.parent
        else:
            raise UserError(f"--data {source}: with {FLAG}, a .csv or .jsonl file of path,text rows naming images "
                            "or videos, or a folder of clips with <stem>.txt captions")
        self.bad_samples_path, self.seed = bad_samples_path, seed
        dropped, kept = [], []
        for row in rows:
            file = base / Path(row["path"].strip()).expanduser()
            reason = None
            if not row["path"].strip() or not file.is_file():
                reason = "file not found" if row["path"].strip() else "empty path"
            elif file.suffix.lower() not in IMAGE_EXTENSIONS | set(VIDEO_EXTENSIONS):
                reason = "neither an image nor a video extension"
            if reason:
                dropped.append({"path": str(file), "error": reason, "line": row.get("line")})
            else:
                kept.append((str(file), row["text"], row.get("line"), row.get("reference_image") or []))
        unique = list(dict.fromkeys(p for p, *_ in kept))  # a folder's repeats are probed once
        with ThreadPoolExecutor(probe_threads) as pool:  # header reads: I/O bound
            probed = dict(zip(unique, pool.map(self._probe, unique)))
        self.paths, self.texts, self.reference_paths, sizes = [], [], [], []
        for path, text, line, refs in kept:
            size = probed[path]
            if isinstance(size, str):
                dropped.append({"path": path, "error": size, "line": line})
            else:
                self.paths.append(path)
                self.texts.append(text)
                self.reference_paths.append(refs)
                sizes.append(size)
        self.num_dropped = len(dropped)
        if dropped:
            report_bad_samples(bad_samples_path, dropped, "sample")
        if not self.paths:
            raise UserError(f"--data: {source} has no usable row ({len(rows)} rows, {len(dropped)} missing, "
                            "unreadable or neither image nor video)")
        self.sizes = np.array(sizes, dtype=np.int64).reshape(-1, 3)
        self.buckets = buckets if isinstance(buckets, Buckets) else buckets(self.sizes)
        self.num_frames, self.image_size = self.buckets.num_frames, self.buckets.image_size
        self.classes = sorted(set(self.texts))
        self.num_classes = len(self.classes)
        self._label = {text: i for i, text in enumerate(self.classes)}
        self._bad: dict[int, str] = {}
        self._fits: dict[int, np.ndarray] = {}

    @staticmethod
    def _probe(path: str) -> tuple[int, int, int] | str:
        from ditforge.data.video import DECODE_ERRORS

        try:
            return probe_size(path)
        except (*DECODE_ERRORS, SyntaxError, Image.DecompressionBombError) as e:
            return error_text(e)

    def __len__(self) -> int:
        return len(self.paths)

    def fits(self, bucket_id: int) -> np.ndarray:
        """The sample ids (ascending) that can fill bucket ``bucket_id``: images for a 1-frame bucket, videos of
        at least F frames for an F-frame one (the substitutes of a bad sample there)."""
        if bucket_id not in self._fits:
            f = self.buckets.buckets[bucket_id].num_frames
            t = self.sizes[:, 2]
            self._fits[bucket_id] = np.flatnonzero(t == 1 if f == 1 else t >= f)
        return self._fits[bucket_id]

    def load(self, index: int, bucket_id: int) -> torch.Tensor:
        """Sample ``index`` at bucket ``bucket_id``'s shape (see the class docstring).

        Raises:
            OSError / ValueError / SyntaxError / av.FFmpegError / EOFError: an unreadable file.
        """
        from ditforge.data.video import BadVideo

        if index in self._bad:
            raise BadVideo(f"found bad before ({self._bad[index]})")
        x = read_at_bucket(self.paths[index], self.buckets.buckets[bucket_id], self.buckets.frame_interval,
                           derive_seed(self.seed, index))
        return x if self.num_frames is not None else x[:, 0]

    def load_references(self, index: int, bucket_id: int) -> torch.Tensor | None:
        """Sample ``index``'s reference images (a folder's ``<stem>.ref*.png``), each ``center_crop_arr``-ed to
        the bucket's (h, w): (R, 3, h, w) float32 in [-1, 1], or None where it has none.

        Raises:
            OSError / ValueError / SyntaxError: an unreadable image."""
        if not self.reference_paths[index]:
            return None
        bucket = self.buckets.buckets[bucket_id]
        refs = []
        for path in self.reference_paths[index]:
            with Image.open(path) as img:
                refs.append(center_crop_arr(img.convert("RGB"), (bucket.height, bucket.width)))
        return torch.from_numpy(np.stack(refs)).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        from ditforge.data.video import DECODE_ERRORS

        index, bucket_id = key
        fits = self.fits(bucket_id)
        start = int(np.searchsorted(fits, index))
        pos, (x, refs) = load_or_substitute(start, len(fits), lambda p: (self.load(int(fits[p]), bucket_id),
                                                                         self.load_references(int(fits[p]), bucket_id)),
                                    lambda p, e: self._report_bad(int(fits[p]), e),
                                    (*DECODE_ERRORS, SyntaxError, Image.DecompressionBombError),
                                    min(16, len(fits)), "unreadable samples")
        j = int(fits[pos])
        item = {"x": x, "text": self.texts[j], "label": self._label[self.texts[j]], "index": j}
        return item if refs is None else item | {"references": refs}

    def _report_bad(self, j: int, error: Exception) -> None:
        if j not in self._bad:  # recorded once per process; never read again
            self._bad[j] = error_text(error)
            report_bad_samples(self.bad_samples_path, [{"path": self.paths[j], "error": self._bad[j], "index": j}],
                               "unreadable sample")


# ----------------------------------------------------------------------------------------------------------
# Deterministic bucketed global batches


class BucketBatchSampler(Sampler[list[tuple[int, int]]]):
    """Yields this rank's slice of each bucketed global batch, as ``(sample id, bucket id)`` keys, forever, from
    ``start_step`` on (see the module docstring for the epoch plan).

    A bucket's batch size is its global batch, or ``batch_size`` samples of mixed buckets when given (for
    packing, see the module docstring); rank r of W takes positions ``[r * B/W, (r + 1) * B/W)`` of a global batch
    of B, so the global batches do not depend on W.

    Args:
        buckets: the ``Buckets``; sizes: (N, 3) int (height, width, frames) of every sample (``BucketDataset.sizes``).
        batch_size: None (each batch of one bucket) or the global batch of mixed buckets (``--batch_size``).

    Raises:
        UserError: a batch size not divisible by ``world_size``, or no full global batch in epoch 0.
    """

    max_empty_epochs = 1000

    def __init__(self, buckets: Buckets, sizes: np.ndarray, seed: int, rank: int = 0, world_size: int = 1,
                 start_step: int = 0, batch_size: int | None = None):
        if batch_size is None:
            buckets.check_batch_sizes(world_size, f"the number of processes ({world_size})")
        elif batch_size % world_size:
            raise UserError(f"--batch_size {batch_size} is not divisible by the number of processes ({world_size})")
        self.buckets, self.seed, self.rank, self.world_size = buckets, seed, rank, world_size
        self.start_step, self.batch_size = start_step, batch_size
        cands = [buckets.candidates(*s) for s in np.asarray(sizes).tolist()]
        width = max(1, max(map(len, cands), default=1))
        self.cands = np.full((len(cands), width), -1, dtype=np.int64)
        for i, c in enumerate(cands):
            self.cands[i, :len(c)] = c
        self._starts = [0]  # the first step of each epoch planned so far
        self._plans: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.counts: dict[int, dict[str, int]] = {}  # per epoch: samples in batches, dropped, in dropped tails
        self.steps_per_epoch = len(self.epoch_plan(0))  # epoch 0's; later epochs differ by their keep draws
        if not self.steps_per_epoch:
            raise UserError(f"{FLAG}: no bucket gathers a full global batch ({len(cands)} samples, "
                            f"{int((self.cands[:, 0] >= 0).sum())} fit some bucket); lower the batch sizes or raise "
                            "the keep probabilities")

    def epoch_plan(self, epoch: int) -> list[tuple[int | torch.Tensor, torch.Tensor]]:
        """The global batches of ``epoch`` in order: ``(bucket id, sample ids (B,) int64)``; with ``batch_size``
        (mixed buckets) ``(bucket ids (B,) int64, sample ids (B,) int64)``."""
        if epoch not in self._plans:
            g = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
            u = torch.rand(self.cands.shape, generator=g, dtype=torch.float64).numpy()
            chosen = self.buckets.choose(self.cands, u)
            batches, tails = [], 0
            if self.batch_size is None:
                for b, bucket in enumerate(self.buckets.buckets):
                    members = torch.from_numpy(np.flatnonzero(chosen == b))
                    members = members[torch.randperm(len(members), generator=g)]
                    n = len(members) // bucket.batch_size
                    tails += len(members) - n * bucket.batch_size
                    batches += [(b, members[k * bucket.batch_size : (k + 1) * bucket.batch_size]) for k in range(n)]
                order = torch.randperm(len(batches), generator=g).tolist()
                batches = [batches[i] for i in order]
            else:  # one permutation of every kept sample, cut into global batches regardless of bucket
                members = torch.from_numpy(np.flatnonzero(chosen >= 0))
                members = members[torch.randperm(len(members), generator=g)]
                n = len(members) // self.batch_size
                tails = len(members) - n * self.batch_size
                batches = [(torch.from_numpy(chosen)[ids], ids) for ids in members[:n * self.batch_size].view(n, -1)]
            self._plans = {epoch: batches}  # keeps one epoch: resume walks forward
            self.counts[epoch] = {"batched": int((chosen >= 0).sum()) - tails, "dropped": int((chosen < 0).sum()),
                                  "tails": tails}
        return self._plans[epoch]

    def locate(self, step: int) -> tuple[int, int]:
        """``(epoch, position in it)`` of global step ``step``."""
        empty = 0
        while self._starts[-1] <= step:
            n = len(self.epoch_plan(len(self._starts) - 1))
            empty = empty + 1 if n == 0 else 0
            if empty >= self.max_empty_epochs:
                raise UserError(f"{FLAG}: {empty} epochs in a row gather no full global batch; lower the batch "
                                "sizes or raise the keep probabilities")
            self._starts.append(self._starts[-1] + n)
        epoch = bisect.bisect_right(self._starts, step) - 1
        return epoch, step - self._starts[epoch]

    def global_batch(self, step: int) -> tuple[int | torch.Tensor, torch.Tensor]:
        """The whole global batch at ``step``, as ``epoch_plan`` gives it."""
        epoch, pos = self.locate(step)
        return self.epoch_plan(epoch)[pos]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step, epoch = self.start_step, None
        while True:
            b, ids = self.global_batch(step)
            if self.rank == 0 and self.locate(step)[0] != epoch:
                epoch = self.locate(step)[0]
                log.info("%s epoch %d: %d global batches; %s", FLAG, epoch, len(self.epoch_plan(epoch)),
                         ", ".join(f"{v} samples {k}" for k, v in self.counts[epoch].items()))
            local = len(ids) // self.world_size
            part = slice(self.rank * local, (self.rank + 1) * local)
            bs = b[part].tolist() if isinstance(b, torch.Tensor) else [b] * local
            yield list(zip(ids[part].tolist(), bs))
            step += 1


def collate_mixed(items: list[dict]) -> dict:
    """A batch of mixed buckets (``BucketBatchSampler(batch_size=...)``): ``x`` the list of the samples'
    tensors (their shapes differ), the other keys collated as ``default_collate`` does."""
    from torch.utils.data import default_collate

    return {"x": [item["x"] for item in items], **default_collate([{k: v for k, v in item.items() if k != "x"}
                                                                    for item in items])}
