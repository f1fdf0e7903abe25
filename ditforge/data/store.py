"""Store a ``--data`` source in the forms that training reads fastest: raw WebDataset shards (``ditforge shard``,
read by ``ditforge.data.shards``) and pre-computed features (``ditforge extract-features``, read by
``ditforge.data.features``). Both commands read any source through the registry (``ditforge.data.sources``), which
imports the readers, so they live here, above it, not beside the readers.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ditforge.atomic import atomic_path
from ditforge.config.sections import assign
from ditforge.config.values import resolve_device
from ditforge.data.features import FEATURES_FORMAT, FEATURES_MANIFEST, FEATURES_VERSION, SHARD_PATTERN
from ditforge.data.prefetch import default_num_workers
from ditforge.data.shards.write import NUM_TEXTS, ShardWriter
from ditforge.data.sources import (BUILTIN_DATASETS, CLIP_FOLDER, FEATURES, build_bucket_dataset, build_dataset,
                                   source_of)
from ditforge.errors import UserError

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------
# Raw shards (``ditforge shard``)


def write_raw_shards(data: str, out: str | Path, shard_size: int = 1000) -> dict:
    """``ditforge shard``: store the samples of ``--data`` (an image folder, captioned images, a video CSV) as raw
    shards in ``out``: each file's bytes as read (member ``<ext>``, e.g. ``jpg``, ``png``, ``mp4``), ``cls`` (the
    label, where the data has classes) and ``txt`` (the caption, where it has one). Returns the manifest.

    Raises:
        UserError: a built-in data set (it has no files), a shard set already, and ``ShardWriter``'s and the
            data set's own errors.
    """
    if not source_of(data).files:
        raise UserError(f"--data {data}: `ditforge shard` stores image or video files; give an image folder, "
                        "captioned images or a video CSV")
    # The size is only a reader setting: the bytes are stored as read, never decoded here.
    dataset = build_dataset(data, 1 if data.lower().endswith(".csv") else 8, None)
    files = getattr(dataset, "samples", None)  # ImageFolderDataset: (path, label)
    if files is None:
        index = {c: i for i, c in enumerate(getattr(dataset, "classes", ()))}  # a dict: millions of captions
        labels = ([index[t] for t in dataset.texts] if hasattr(dataset, "classes")
                  else [None] * len(dataset.paths))
        files = list(zip(dataset.paths, labels))
    texts = getattr(dataset, "texts", None)
    writer = ShardWriter(out, shard_size)
    for i, (path, label) in enumerate(files):
        sample = {"__key__": f"{i:09d}", Path(path).suffix.lower().lstrip("."): Path(path).read_bytes()}
        if label is not None:
            sample["cls"] = int(label)
        if texts is not None:
            sample["txt"] = texts[i]
        writer.write(sample)
    video = getattr(dataset, "num_frames", None) is not None
    return writer.close({
        "kind": "raw", "media": "video" if video else "image", "data": data,
        "num_classes": getattr(dataset, "num_classes", 0) or 0,
        "class_captions": list(c) if (c := getattr(dataset, "class_captions", None)) is not None else None,
        "texts": list(dict.fromkeys(texts))[:NUM_TEXTS] if texts is not None else None})


# ----------------------------------------------------------------------------------------------------------
# Features (``ditforge extract-features``)


def extract_features(cfg, out: str | Path, batch_size: int = 32, shard_size: int = 1024,
                     device: str | torch.device = "auto", fmt: str = "safetensors") -> Path:
    """Encode every sample of ``--data`` once and store the results in ``out`` (see ``ditforge.data.features``).

    The data set is built exactly as the trainer builds it (``build_dataset`` with ``cfg.data`` and
    ``cfg.train.seed``: a video's clip is the one training on the fly reads for that seed), the encoders exactly
    as it loads them (``build_batch_encoder``, which resolves ``--condition auto``; what it finds is written into
    ``cfg.model`` and ``cfg.data``), and
    what is stored is what ``BatchEncoder`` computes from a loader batch: ``moments`` (posterior mean, and std
    with a real VAE; the pixels themselves in pixel space) and, for the text condition, ``conditioning`` (the
    caption states, float32; the text encoder runs in float32 here, so on a GPU the stored states are more
    precise than a bf16 run's on-the-fly ones). Samples are read in index order (no shuffling) in batches of
    ``batch_size``, with ``cfg.data.num_workers`` loader workers (when unset, as the trainer: 0 for the built-in
    data sets, ``default_num_workers()`` otherwise).

    A video that cannot be decoded is replaced by the data set with another sample (whose ``index`` differs):
    such substitutes are left out, so every stored sample is a real one (the data set records the bad file in
    ``out/bad_samples.jsonl``); ``num_samples`` then is the number of good ones. Image folders do not tell which
    items are substitutes: an unreadable image is recorded in ``bad_samples.jsonl`` and its substitute stored.

    Storage per sample (float32, 4 bytes a number): the mean and the std hold C * [T *] h * w numbers each
    (SD's VAE at 256 px: 4 x 32 x 32 = 16 KiB each; a 16-frame 256 px clip 256 KiB each; digits in pixel space
    256 bytes, no std); caption states L_real * D_text numbers (MiniLM, D = 384: 1.5 KiB a token, ~30 KiB for
    a 20-token caption; T5-XXL, D = 4096: 16 KiB a token, up to 1.9 MiB at 120 tokens).

    Args:
        cfg: a ``RunConfig``; what is read: ``--data``, ``--image_size``, ``--num_frames``, ``--frame_interval``,
            ``--num_workers``, ``--condition``, ``--vae``, ``--text_encoder``, ``--text_max_length``, ``--seed``.
            ``cfg.model`` and ``cfg.data`` are resolved in place.
        out: the folder to write (created); must not hold features already.
        batch_size: samples per encoder call (memory, not results: up to float rounding, see the tests).
        shard_size: samples per shard file.
        device: where the encoders run: cuda | cpu | auto.
        fmt: ``safetensors`` (``ditforge.data.features``' folder) or ``wds``: WebDataset tar shards that ``--data``
            streams (``ditforge.data.shards``: per sample ``latent.npy`` = the mean, ``std.npy``, ``cls``, and
            ``text.npy`` (L_i, D_text) + ``txt`` for the text condition; ``shards.json`` holds this manifest's
            keys, its ``texts`` only the first ``NUM_TEXTS`` distinct captions, for the sample grids).

    Returns:
        ``out`` as a Path. Its ``features.json`` is written last and atomically, as is every shard, so an
        interrupted extraction never leaves a folder that looks complete.

    Raises:
        UserError: ``out`` already holds features or is a file; ``--data`` is a features folder already;
            ``batch_size`` or ``shard_size`` < 1; no usable sample; ``wds`` with ``--init_from``; and the data set's
            and encoders' own (``build_dataset``, ``build_batch_encoder``).
    """
    out = Path(out)
    _check_extraction(cfg, out, batch_size, shard_size, fmt)
    data = cfg.data
    if data.frame_interval is None:  # the source's default, as a training run's (train/build.py::build_data)
        assign(cfg, {"data.frame_interval": source_of(data.data).frame_interval})
    dev = resolve_device(device)
    keys = None  # in buckets: the (sample, bucket) keys of each batch
    if cfg.model.init_from is not None and (data.buckets is not None or source_of(data.data) is CLIP_FOLDER):
        pre = _extraction_pipeline(cfg, dev)
        dataset = build_bucket_dataset(cfg, out / "bad_samples.jsonl", pre=pre)
        inputs, pre = _extraction_encoders(cfg, dataset, dev, pre)
        keys = _bucket_keys(dataset, batch_size, data.buckets)
    else:
        dataset = build_dataset(data.data, data.image_size, out / "bad_samples.jsonl", data.num_frames,
                                data.frame_interval, cfg.train.seed, resize_mode=data.resize_mode)
        inputs, pre = _extraction_encoders(cfg, dataset, dev)
    rows = _FeatureRows(out, shard_size, cfg.model.condition == "text" and pre is None,
                        ShardWriter(out, shard_size) if fmt == "wds" else None)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("shard-*.safetensors"):  # from an extraction that was interrupted: no manifest
        stale.unlink()
    if data.num_workers is None:  # as the trainer: the built-in sets live in memory, files are decoded in workers
        data.num_workers = 0 if data.data in BUILTIN_DATASETS else default_num_workers()
    loader = (DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=data.num_workers) if keys is None
              else DataLoader(dataset, batch_sampler=keys, num_workers=data.num_workers))
    _encode_all(loader, len(dataset), inputs, pre, dev, rows, keys)
    rows.flush(final=True)
    num_samples = rows.sink.total if rows.sink is not None else sum(s["num_samples"] for s in rows.shards)
    if num_samples == 0:
        raise UserError(f"--data {data.data}: no usable sample to extract (see {out / 'bad_samples.jsonl'})")
    _write_manifest(cfg, out, dataset, inputs.stochastic, pre, rows, num_samples)
    return out


def _check_extraction(cfg, out: Path, batch_size: int, shard_size: int, fmt: str) -> None:
    """``extract_features``' arguments, checked before anything is read or written."""
    manifest_path = out / FEATURES_MANIFEST
    if fmt not in ("safetensors", "wds"):
        raise UserError(f"--format: expected safetensors or wds, got {fmt!r}")
    if fmt == "wds" and cfg.model.init_from is not None:
        raise UserError("--format wds: features of a pretrained pipeline (--init_from) are stored as safetensors "
                        "only; leave --format out")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; expected a folder for the features")
    if manifest_path.exists():
        raise UserError(f"--out {out} already holds features ({manifest_path.name}); choose another folder or "
                        "delete it first")
    for flag, value in (("--batch_size", batch_size), ("--shard_size", shard_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{flag}: expected a positive integer, got {value!r}")
    if source_of(cfg.data.data) is FEATURES:
        raise UserError(f"--data {cfg.data.data} holds features already; extract from the images or videos")


def _extraction_encoders(cfg, dataset, dev: torch.device, pre=None) -> tuple:
    """``(BatchEncoder, pretrained pipeline or None)``: a pretrained pipeline's own VAE and prompt encoding
    (``--init_from``; ``pre`` when loaded already), else the encoders the trainer loads; the settings they find are
    written into ``cfg``."""
    from ditforge.encoders.batch import build_batch_encoder, pipeline_batch_encoder

    if cfg.model.init_from is None:
        inputs, found = build_batch_encoder(cfg, dataset, dev, torch.float32)
    else:
        pre = pre or _extraction_pipeline(cfg, dev)
        inputs, found = pipeline_batch_encoder(cfg, pre, dataset)
    assign(cfg, found)
    return inputs, pre


def _extraction_pipeline(cfg, dev: torch.device):
    """The pretrained pipeline of ``--init_from``, its encoders on ``dev``.

    Raises:
        UserError: a folder of no family ditforge adapts; a reference-image or driven family (``takes_references``,
            ``trained_videos``)."""
    from ditforge.models.adapters.pipeline import is_adapted_pipeline, load_pretrained
    from ditforge.models.adapters.single_file import component_files

    m = cfg.model
    if not is_adapted_pipeline(m.init_from, tuple(component_files(m))):
        raise UserError(f"--init_from {m.init_from}: features are extracted with a diffusers pipeline folder "
                        "of a family ditforge adapts; DiT runs take --vae and --text_encoder")
    # the denoiser encodes nothing: it stays on the host in bf16 (a 14B transformer would take 57 GB in float32 on
    # the GPU for no use); a pipeline's two experts share the VAE and encoders
    pre = load_pretrained(m.init_from, dev, expert=m.expert, denoiser_device=torch.device("cpu"),
                          denoiser_dtype=torch.bfloat16, files=component_files(m))
    if pre.denoiser.takes_references or pre.denoiser.trained_videos:  # per clip: references, driving videos
        raise UserError(f"--init_from {m.init_from}: a {pre.pipeline_class} trains on its clips' "
                        + ("reference images" if pre.denoiser.takes_references else "driving videos")
                        + ", which stored features do not carry; train from the clips (ditforge train --data)")
    return pre


def _bucket_keys(dataset, batch_size: int, bucket_file: str | None) -> list[list[tuple[int, int]]]:
    """The batches of a bucketed extraction: each sample at its bucket (its first candidate, the one every epoch's
    draws give at keep probability 1), ``batch_size`` samples of one bucket a batch, buckets in id order and the
    samples of each in index order.

    Raises:
        UserError: a ``--buckets`` keep probability below 1 (its draws move a sample between buckets by epoch)."""
    if any(b.keep_prob < 1 for b in dataset.buckets.buckets):
        raise UserError(f"--buckets {bucket_file}: features store each sample at one bucket; keep probabilities "
                        "below 1 move samples between buckets by epoch: use 1")
    groups: dict[int, list[int]] = {}
    for i, size in enumerate(dataset.sizes.tolist()):
        cands = dataset.buckets.candidates(*size)
        if cands:
            groups.setdefault(cands[0], []).append(i)
    return [[(i, b) for i in ids[k:k + batch_size]] for b, ids in sorted(groups.items())
            for k in range(0, len(ids), batch_size)]


class _FeatureRows:
    """The rows ``extract_features`` collects, batch by batch (``add``; ``end_batch``), and writes: into
    safetensors shards of ``shard_size`` rows (``flush``), or, with a ``sink`` (``ShardWriter``, ``--format
    wds``), each batch's rows as WebDataset samples. ``text``: caption states are stored (the text condition of
    a DiT run); ``texts``: the captions of the rows, in order; ``cond_keys``: a pretrained pipeline's
    conditioning keys."""

    def __init__(self, out: Path, shard_size: int, text: bool, sink):
        self.out, self.shard_size, self.text, self.sink = out, shard_size, text, sink
        self.bucket: int | None = None  # in buckets: the bucket of the pending rows (each shard holds one's)
        self.shards: list[dict] = []
        self.texts: list[str] = []
        self.cond_keys: list[str] = []
        self.pending: dict[str, list[torch.Tensor]] = {}
        self.pending_count = 0

    def add(self, key: str, value: torch.Tensor) -> None:
        self.pending.setdefault(key, []).append(value.detach().to("cpu").contiguous())

    def end_batch(self, n: int) -> None:
        """The ``n`` rows of a batch are all added: written as samples (``sink``) or flushed when a shard is full."""
        if self.sink is not None:
            _write_samples(self.sink, self.pending, n, self.texts[-n:] if self.text else None)
            self.pending = {}
            return
        self.pending_count += n
        self.flush(final=False)

    def flush(self, final: bool) -> None:
        """Write every full shard of the pending rows (``final``: the rest too)."""
        while self.pending_count >= self.shard_size or (final and self.pending_count):
            n = min(self.shard_size, self.pending_count)
            cat = {k: torch.cat(v) for k, v in self.pending.items()}
            keys = ("mean", "std", "label", "source_index", *(f"cond.{k}" for k in self.cond_keys))
            tensors = {k: cat[k][:n] for k in keys if k in cat}
            rest = {k: [cat[k][n:]] for k in keys if k in cat}
            if self.text:
                lengths = cat["text_lengths"]
                used = int(lengths[:n].sum())
                tensors |= {"text_lengths": lengths[:n], "text_states": cat["text_states"][:used]}
                rest |= {"text_lengths": [lengths[n:]], "text_states": [cat["text_states"][used:]]}
            name = SHARD_PATTERN.format(len(self.shards))
            _write_shard(self.out / name, tensors)
            bucket = {} if self.bucket is None else {"bucket": self.bucket, "shape": list(tensors["mean"].shape[1:])}
            self.shards.append({"file": name, "num_samples": n, **bucket})
            self.pending, self.pending_count = rest, self.pending_count - n
        if not self.pending_count:  # no empty leftovers of this bucket's shape before the next bucket's rows
            self.pending = {}


def _encode_all(loader: DataLoader, total: int, inputs, pre, dev: torch.device, rows: _FeatureRows,
                keys: list[list[tuple[int, int]]] | None = None) -> None:
    """Encode every batch of ``loader`` (``total`` samples, in index order; in buckets the batches of ``keys``, a
    shard holding one bucket's) into ``rows``, leaving out the substitutes a video data set returns for bad
    samples."""
    from ditforge.encoders.batch import as_batch

    start = 0
    with tqdm(total=total, desc="extract features", dynamic_ncols=True, disable=None) as bar:
        for n, raw in enumerate(loader):
            batch = as_batch(raw)
            n_batch = len(batch["label"]) if "label" in batch else len(batch["x"])
            requested = torch.arange(start, start + n_batch)
            start += n_batch
            if keys is not None:
                requested = torch.tensor([i for i, _ in keys[n]])
                if rows.bucket != keys[n][0][1]:  # a bucket's rows end: written, its last shard maybe short
                    rows.flush(final=True)
                    rows.bucket = keys[n][0][1]
            bar.update(n_batch)
            if "index" in batch:  # video: a substitute for a bad sample carries the substitute's index
                keep = torch.as_tensor(batch["index"]) == requested
                if not keep.all():
                    batch, requested = _select(batch, keep), requested[keep]
                if not len(requested):
                    continue
            _encode_batch(batch, requested, inputs, pre, dev, rows)
            rows.end_batch(len(requested))


def _encode_batch(batch: dict, requested: torch.Tensor, inputs, pre, dev: torch.device, rows: _FeatureRows) -> None:
    """Add the rows of one batch (source indices ``requested``): moments, labels and the condition."""
    mean, std = inputs.moments(batch, dev)
    rows.add("mean", mean.float())
    if inputs.stochastic:
        rows.add("std", std.float())
    rows.add("label", torch.as_tensor(batch.get("label", [0] * len(requested)), dtype=torch.int64))
    rows.add("source_index", requested)
    if pre is not None:
        cond = inputs.conditioning(batch, dev)
        rows.cond_keys = list(cond)
        for key, value in cond.items():
            rows.add(f"cond.{key}", value.float() if value.is_floating_point() else value)
        rows.texts.extend(batch["text"])
    if rows.text:
        captions = batch.get("text")
        if captions is None:  # labelled images captioned by their class (``class_captions``)
            captions = [inputs.class_captions[int(i)] for i in batch["label"]]
        cond = inputs.conditioning({"text": list(captions)}, dev)
        states, mask = cond["y"].float().cpu(), cond["y_mask"].cpu()
        lengths = mask.sum(1)
        if not all(bool(mask[i, :int(k)].all()) for i, k in enumerate(lengths)):
            raise RuntimeError("caption masks are not right-padded")  # a bug, not a user error
        rows.add("text_lengths", lengths.to(torch.int64))
        rows.add("text_states", torch.cat([states[i, :int(k)] for i, k in enumerate(lengths)]))
        rows.texts.extend(captions)


def _write_manifest(cfg, out: Path, dataset, stochastic: bool, pre, rows: _FeatureRows, num_samples: int) -> None:
    """``features.json`` (written last, atomically), or with ``--format wds`` the same keys in ``shards.json``."""
    m, data, texts = cfg.model, cfg.data, rows.texts
    manifest = {
        "format": FEATURES_FORMAT, "version": FEATURES_VERSION,
        "condition": m.condition, "vae": _local_path(m.vae), "text_encoder": _local_path(m.text_encoder),
        "text_max_length": m.text_max_length, "text_dim": m.text_dim,
        "in_channels": m.in_channels, "input_size": m.input_size, "num_frames": m.num_frames,
        "pixel_channels": dataset.in_channels, "image_size": data.image_size,
        "frame_interval": data.frame_interval if m.num_frames is not None else None,
        "seed": cfg.train.seed, "num_classes": dataset.num_classes,
        "class_captions": list(c) if (c := getattr(dataset, "class_captions", None)) is not None else None,
        "random_flip": bool(getattr(dataset, "random_flip", True)), "stochastic": stochastic,
        "data": data.data, "num_samples": num_samples, "shards": rows.shards,
        "texts": texts if m.condition == "text" else None,
        "init_from": _local_path(m.init_from) if pre is not None else None, "cond_keys": rows.cond_keys or None,
    }
    if rows.bucket is not None:  # the buckets, and every sample's size, which the bucket sampler reads
        buckets, config = dataset.buckets, {}
        for b in buckets.buckets:
            config.setdefault(b.resolution, {})[b.num_frames] = [b.keep_prob, b.batch_size]
        manifest |= {"buckets": {"config": config, "multiple": buckets.multiple,
                                 "frame_interval": buckets.frame_interval, "from_data": data.buckets is None},
                     "sizes": dataset.sizes.tolist()}
    if rows.sink is not None:
        shared = {k: v for k, v in manifest.items() if k not in ("format", "version", "shards", "num_samples")}
        grid_texts = list(dict.fromkeys(texts))[:NUM_TEXTS] if texts else None  # the sample grids' captions
        rows.sink.close({**shared, "kind": "latent", "texts": grid_texts})
        return
    with atomic_path(out / FEATURES_MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    log.info("wrote %d samples in %d shards to %s", num_samples, len(rows.shards), out)


def _local_path(value: str | None) -> str | None:
    """An existing local folder as an absolute path (so the features can be used from anywhere); else as given."""
    if value is None or str(value).lower() == "none":
        return value
    p = Path(value).expanduser()
    return str(p.resolve()) if p.exists() else value


def _select(batch: dict, keep: torch.Tensor) -> dict:
    """The rows ``keep`` (B,) bool of a collated batch (tensors indexed, lists filtered)."""
    rows = keep.nonzero().flatten().tolist()
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            out[k] = v[keep]
        elif isinstance(v, (list, tuple)):
            out[k] = [v[i] for i in rows]
        else:
            out[k] = v
    return out


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    with atomic_path(path, suffix=".safetensors") as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"format": FEATURES_FORMAT, "version": str(FEATURES_VERSION)})
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates its files 0600; shards are shared like the manifest


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_samples(sink, pending: dict[str, list[torch.Tensor]], n: int, captions: list[str] | None) -> None:
    """One encoder batch's rows (``pending``: the tensors ``extract_features`` collects) as WebDataset samples,
    keyed by their source index."""
    rows = {k: torch.cat(v) for k, v in pending.items()}
    offsets = torch.cumsum(rows["text_lengths"], 0) - rows["text_lengths"] if captions is not None else None
    for i in range(n):
        sample = {"__key__": f"{int(rows['source_index'][i]):09d}", "latent.npy": rows["mean"][i].numpy(),
                  "cls": int(rows["label"][i])}
        if "std" in rows:
            sample["std.npy"] = rows["std"][i].numpy()
        if captions is not None:
            off, k = int(offsets[i]), int(rows["text_lengths"][i])
            sample |= {"text.npy": rows["text_states"][off:off + k].numpy(), "txt": captions[i]}
        sink.write(sample)
