"""Decoding a shard's samples: ``.npy`` members, latent samples and raw images or videos, collated into batches."""

from __future__ import annotations

import io
import math
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ditforge.data.images import IMAGE_EXTENSIONS, error_text
from ditforge.data.sampler import derive_seed
from ditforge.data.shards.tar import ShardFile

if TYPE_CHECKING:
    from ditforge.data.buckets import Buckets

IMAGE_FIELDS = tuple(e.lstrip(".") for e in sorted(IMAGE_EXTENSIONS))
VIDEO_FIELDS = ("mp4", "avi", "mov", "mkv", "webm")  # video.VIDEO_EXTENSIONS; that module needs PyAV


_NPY_HEADERS: dict[bytes, tuple[np.dtype, tuple[int, ...], int]] = {}


def decode_npy(buf: memoryview) -> np.ndarray:
    """An ``.npy`` member as an array viewing ``buf`` (the header parsed by ``numpy.lib.format`` once per distinct
    header, then cached: a batch of same-shaped members costs one slice each).

    Raises:
        ValueError: not an npy file, a Fortran-order or object array, or a size that does not match the header.
    """
    if bytes(buf[:6]) != b"\x93NUMPY":
        raise ValueError("not an npy member")
    major = buf[6]
    start = 10 if major == 1 else 12
    if len(buf) < start:
        raise ValueError("truncated npy header")
    hlen = int.from_bytes(buf[8:start], "little")
    header = bytes(buf[:start + hlen])
    known = _NPY_HEADERS.get(header)
    if known is None:
        f = io.BytesIO(header)
        fmt = np.lib.format
        read = fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read(f)
        if fortran or dtype.hasobject:
            raise ValueError("npy member is Fortran-ordered or holds objects")
        known = _NPY_HEADERS[header] = (dtype, shape, start + hlen)
    dtype, shape, offset = known
    count = math.prod(shape)
    if len(buf) - offset != count * dtype.itemsize:
        raise ValueError(f"npy member holds {len(buf) - offset} bytes, its header says {count * dtype.itemsize}")
    return np.frombuffer(buf, dtype, count, offset).reshape(shape)


class LatentDecoder:
    """Latent samples -> ``FeatureDataset``'s item layout, collated: ``mean`` (B, C, [T,] h, w) in the stored
    dtype (``BatchEncoder.moments`` casts to float32), ``std`` (stochastic features), ``label`` (B,) int64, and
    for the text condition ``text_states`` (B, text_max_length, D) float32 zero-padded, ``text_mask`` (B, L) bool,
    ``text`` (list of str)."""

    def __init__(self, manifest: dict):
        self.stochastic = bool(manifest.get("stochastic"))
        self.text = manifest.get("condition") == "text"
        self.length, self.dim = manifest.get("text_max_length"), manifest.get("text_dim")

    def __call__(self, shard: ShardFile, i: int) -> tuple:
        mean = decode_npy(shard.member(i, "latent.npy"))
        std = decode_npy(shard.member(i, "std.npy")) if self.stochastic else None
        label = int(bytes(shard.member(i, "cls"))) if "cls" in shard.members[i] else 0
        if not self.text:
            return mean, std, label, None, None
        states = decode_npy(shard.member(i, "text.npy"))
        if states.ndim != 2 or states.shape[1] != self.dim or not 1 <= len(states) <= self.length:
            raise ValueError(f"text.npy of shape {states.shape}, expected (1..{self.length}, {self.dim})")
        return mean, std, label, states, str(shard.member(i, "txt"), "utf-8")

    def collate(self, items: list[tuple]) -> dict:
        batch: dict[str, Any] = {"mean": torch.from_numpy(np.stack([it[0] for it in items])),
                                 "label": torch.tensor([it[2] for it in items], dtype=torch.int64)}
        if self.stochastic:
            batch["std"] = torch.from_numpy(np.stack([it[1] for it in items]))
        if self.text:
            states = torch.zeros(len(items), self.length, self.dim)
            mask = torch.zeros(len(items), self.length, dtype=torch.bool)
            for k, it in enumerate(items):
                states[k, :len(it[3])] = torch.from_numpy(it[3].astype(np.float32))
                mask[k, :len(it[3])] = True
            batch |= {"text_states": states, "text_mask": mask, "text": [it[4] for it in items]}
        return batch


class DroppedByBucket(ValueError):
    """A sample that no keep draw of ``--buckets`` keeps: skipped, as Open-Sora drops it, but not reported."""


class RawDecoder:
    """Raw samples -> the image and video data sets' layout, collated: ``x`` (B, 3, S, S) for images
    (``captions.load_image``: EXIF orientation, ``resize_mode``) or (B, 3, T, S, S) for videos (``num_frames``
    given: ``video.read_clip`` from the member's bytes, frames ``frame_interval`` apart from a start drawn from
    ``derive_seed(seed, crc32(key))``, each frame centre-cropped as ``VideoDataset`` does), float32 in [-1, 1];
    ``label`` (B,) int64 where samples have ``cls``, ``text`` (list of str) where they have ``txt``."""

    def __init__(self, image_size: int, resize_mode: str, labels: bool, captions: bool, num_frames: int | None = None,
                 frame_interval: int = 3, seed: int = 0, buckets: Buckets | None = None):
        self.image_size, self.resize_mode, self.labels, self.captions = image_size, resize_mode, labels, captions
        self.num_frames, self.frame_interval, self.seed, self.buckets = num_frames, frame_interval, seed, buckets
        self.fields = (IMAGE_FIELDS + VIDEO_FIELDS if buckets is not None else
                       IMAGE_FIELDS if num_frames is None else VIDEO_FIELDS)

    def __call__(self, shard: ShardFile, i: int) -> tuple:
        members = shard.members[i]
        field = next((f for f in members if f.lower() in self.fields), None)
        if field is None:
            raise ValueError(f"no {'image' if self.num_frames is None else 'video'} member (one of "
                             f"{', '.join(self.fields)}) in {', '.join(members)}")
        data, key = bytes(shard.member(i, field)), shard.keys[i]
        video = field.lower() in VIDEO_FIELDS
        if self.buckets is None and not video:
            from ditforge.data.captions import load_image

            x = load_image(io.BytesIO(data), self.image_size, self.resize_mode)
        else:
            x = self._clip(data, video, key)
        label = int(bytes(shard.member(i, "cls"))) if self.labels else 0
        text = str(shard.member(i, "txt"), "utf-8") if self.captions else None
        return x, label, text

    def _clip(self, data: bytes, video: bool, key: str) -> torch.Tensor:
        """``read_at_bucket`` of a video at (``num_frames``, ``image_size``, ``image_size``), or with --buckets of
        any sample at the bucket ``Buckets.assign_bucket`` gives it from its size and a draw seeded by (seed, key):
        the same in every epoch and at every world size (``DroppedByBucket`` when no keep draw keeps it)."""
        from ditforge.data.buckets import Bucket, probe_size, read_at_bucket
        from ditforge.data.video import DECODE_ERRORS as VIDEO_ERRORS

        seed = derive_seed(self.seed, zlib.crc32(key.encode()))
        try:
            if self.buckets is None:
                bucket = Bucket(resolution=str(self.image_size), num_frames=self.num_frames, height=self.image_size,
                                width=self.image_size, batch_size=0, keep_prob=1.0)
            else:
                bucket = self.buckets.assign_bucket(*probe_size(data, video), seed)
            x = None if bucket is None else read_at_bucket(data, bucket, self.frame_interval, seed)
        except VIDEO_ERRORS as e:  # FFmpeg's errors are not all OSErrors: one kind for the reader to skip
            raise ValueError(error_text(e)) from e
        if x is None:
            raise DroppedByBucket(key)
        return x if self.num_frames is not None else x[:, 0]

    def collate(self, items: list[tuple]) -> dict:
        xs = [it[0] for it in items]  # --buckets: shapes differ, the trainer packs them (train.mixed)
        batch: dict[str, Any] = {"x": xs if self.buckets is not None else torch.stack(xs)}
        if self.labels:
            batch["label"] = torch.tensor([it[1] for it in items], dtype=torch.int64)
        if self.captions:
            batch["text"] = [it[2] for it in items]
        return batch
