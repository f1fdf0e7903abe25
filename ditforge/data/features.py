"""Pre-computed features: the latent posterior and the caption states of every sample, stored in shards, so
training reads features instead of decoding and encoding pixels every step (as fast-DiT's
``extract_features.py`` does, except that the posterior's moments are stored, not one draw from it: training
still draws fresh latents ``mean + std * eps`` every step, exactly as it does when encoding on the fly).

``ditforge.data.store.extract_features`` writes a folder; ``ditforge.data.build_dataset`` reads a folder
holding ``features.json`` as a ``FeatureDataset``, whose items ``ditforge.encoders.batch.BatchEncoder`` turns into
the same denoiser inputs (and the same training loss, for the same seed) as the pixels and captions they were
computed from.

A features folder::

    features.json               the manifest (written last: a folder without it is not a features folder)
    shard-00000.safetensors     up to --shard_size samples each
    shard-00001.safetensors
    bad_samples.jsonl           source samples that could not be read and were left out (when there were any)

A shard (safetensors, N its samples, each tensor row-aligned):

    mean           (N, C, [T,] h, w) float32   posterior mean of the scaled latents (the pixels in pixel space)
    std            (N, C, [T,] h, w) float32   posterior std (only with a real VAE: ``manifest["stochastic"]``)
    label          (N,) int64                  class label of the source sample
    source_index   (N,) int64                  the sample's index in the source data set
    text_lengths   (N,) int64                  text condition only: real tokens of each caption (special ones
                                                included), L_i <= text_max_length
    text_states    (sum L_i, D_text) float32   text condition only: each caption's states, trimmed to its real
                                                tokens and concatenated in sample order
    cond.<key>     (N, ...)                    a pretrained pipeline's (``--init_from``) conditioning tensors,
                                                one per key of its prompt encoding (e.g. ``encoder_hidden_states``
                                                (N, 77, 768) for SD 1.x; the T5 states and mask for a T5 family), as
                                                computed, float32

Features in buckets (a video pipeline's folder of clips, or ``--buckets``): each shard holds one bucket's samples, at
its latent shape (the shard's ``bucket`` id and ``shape`` in the manifest), and the manifest holds the buckets
(``buckets``: their config, multiple and frame interval; ``from_data``: made from the data, their batch sizes the
training run's ``--batch_size``) and every source sample's (height, width, frames) (``sizes``), so that the bucket
sampler draws from the features the global batches it draws from the files.
"""

from __future__ import annotations

import json
import os
from bisect import bisect_right
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ditforge.errors import UserError

FEATURES_MANIFEST = "features.json"
FEATURES_FORMAT = "ditforge-features"
FEATURES_VERSION = 1
SHARD_PATTERN = "shard-{:05d}.safetensors"
MANIFEST_KEYS = ("format", "version", "condition", "vae", "text_encoder", "text_max_length", "text_dim", "in_channels",
                 "input_size", "num_frames", "image_size", "frame_interval", "num_classes", "class_captions",
                 "random_flip", "stochastic", "data", "num_samples", "shards", "texts")


def read_manifest(folder: str | Path) -> dict:
    """The checked ``features.json`` of a features folder (see ``store.extract_features`` for its keys).

    Raises:
        UserError naming ``--data`` and the file: missing or unreadable, not JSON, another format or version,
            a key missing, or shard counts that do not add up to ``num_samples``.
    """
    path = Path(folder) / FEATURES_MANIFEST
    where = f"--data {folder}: {path}"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{where} is not a readable features manifest ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FEATURES_FORMAT:
        raise UserError(f"{where} is not a manifest written by `ditforge extract-features`")
    if manifest.get("version") != FEATURES_VERSION:
        raise UserError(f"{where} has features format version {manifest.get('version')!r}; this ditforge reads "
                        f"version {FEATURES_VERSION}: extract the features again")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise UserError(f"{where} lacks {', '.join(missing)}; extract the features again")
    shards = manifest["shards"]
    if (not isinstance(shards, list) or not all(isinstance(s, dict) and {"file", "num_samples"} <= s.keys()
                                                for s in shards)
            or sum(s["num_samples"] for s in shards) != manifest["num_samples"]):
        raise UserError(f"{where}: its shard list does not add up to num_samples {manifest['num_samples']}")
    if manifest["texts"] is not None and len(manifest["texts"]) != manifest["num_samples"]:
        raise UserError(f"{where}: {len(manifest['texts'])} captions for {manifest['num_samples']} samples")
    return manifest


class FeatureDataset(Dataset):
    """The samples of a folder written by ``extract_features``.

    Items are dicts (the keys that apply), all padded to static shapes so the default collate stacks them:

    - ``mean``: (C, [T,] h, w) float32, the scaled latents' posterior mean (the pixels in pixel space);
    - ``std``: (C, [T,] h, w) float32, the posterior std (features of a real VAE only);
    - ``label``: int, the class label;
    - text condition: ``text_states`` (text_max_length, D_text) float32, zero after the caption's tokens;
      ``text_mask`` (text_max_length,) bool, True on its tokens; ``text`` str, the caption;
    - a pretrained pipeline's features (``cond_keys``): ``cond``, the dict of its conditioning tensors, and ``text``.

    Shards are opened lazily (memory-mapped by safetensors, one handle per shard and process, reopened in
    data-loader workers) and each item reads only its own rows, so a data set larger than memory works; the
    labels and caption lengths (8 bytes a sample each) are read into memory when the data set is built.

    Attributes (those the trainer reads): ``manifest`` (the dict of ``features.json``), ``image_size`` (pixels),
    ``num_frames`` (None for images), ``in_channels`` (channels of the stored arrays: latent channels, or the
    pixels' in pixel space), ``num_classes``, ``random_flip`` (the source's default), ``texts`` (the caption of
    each sample, text condition; else None), ``class_captions`` (or None), ``stochastic``; features in buckets:
    ``buckets`` (``data.buckets.Buckets``, each bucket's global batch ``batch_size`` where they were made from the
    data) and ``sizes`` ((N_source, 3) int64), else None, and items keyed ``(source index, bucket id)`` as a
    ``BucketDataset``'s.

    Raises:
        UserError naming ``--data`` and the file: see ``read_manifest``; a shard missing, unreadable, or whose
            tensors do not match the manifest.
    """

    def __init__(self, folder: str | Path, batch_size: int | None = None):
        from safetensors import SafetensorError, safe_open

        self.folder = Path(folder)
        self.manifest = m = read_manifest(self.folder)
        self.condition = m["condition"]
        self.image_size, self.num_frames, self.in_channels = m["image_size"], m["num_frames"], m["in_channels"]
        self.num_classes, self.random_flip, self.stochastic = m["num_classes"], m["random_flip"], m["stochastic"]
        self.texts, self.class_captions = m["texts"], m["class_captions"]
        self.text_max_length, self.text_dim = m["text_max_length"], m["text_dim"]
        self.init_from, self.cond_keys = m.get("init_from"), m.get("cond_keys") or []
        text = self.condition == "text" and not self.cond_keys
        sample_shape = [m["in_channels"], *([m["num_frames"]] if m["num_frames"] is not None else []),
                        m["input_size"], m["input_size"]]
        self._files = [self.folder / s["file"] for s in m["shards"]]
        # in buckets: source index -> row, and each bucket's stored source indices (sorted)
        self.buckets, self.sizes, self._row, self._members = None, None, {}, {}
        if m.get("buckets") is not None:
            from ditforge.data.buckets import Buckets

            stored = m["buckets"]
            batch = batch_size if stored["from_data"] and batch_size else None
            config = {res: {int(f): (keep, batch or b) for f, (keep, b) in frames.items()}
                      for res, frames in stored["config"].items()}
            self.buckets = Buckets(config, stored["multiple"], stored["frame_interval"])
            self.sizes = np.array(m["sizes"], dtype=np.int64).reshape(-1, 3)
        self._labels, self._lengths, self._offsets, self._starts = [], [], [], []
        total = 0
        for spec, file in zip(m["shards"], self._files):
            where = f"--data {self.folder}: shard {file}"
            if not file.is_file():
                raise UserError(f"{where} (listed in {FEATURES_MANIFEST}) is missing; extract the features again")
            n = spec["num_samples"]
            try:
                with safe_open(str(file), framework="pt") as f:
                    shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
                    row_shape = spec.get("shape", sample_shape)  # in buckets: the shard's bucket's
                    expected = {"mean": [n, *row_shape], "label": [n], "source_index": [n]}
                    if self.stochastic:
                        expected["std"] = [n, *row_shape]
                    if text:
                        expected["text_lengths"] = [n]
                    wrong = [k for k, shape in expected.items() if shapes.get(k) != shape]
                    if text and (len(shapes.get("text_states", [])) != 2 or shapes["text_states"][1] != m["text_dim"]):
                        wrong.append("text_states")
                    if wrong:
                        raise UserError(f"{where}: tensors {', '.join(wrong)} do not match {FEATURES_MANIFEST}; "
                                        "extract the features again")
                    self._labels.append(f.get_tensor("label"))
                    if self.buckets is not None:
                        indices = f.get_tensor("source_index").tolist()
                        self._row |= {i: total + r for r, i in enumerate(indices)}
                        self._members.setdefault(spec["bucket"], []).extend(indices)
                    if text:
                        lengths = f.get_tensor("text_lengths")
                        if (int(lengths.sum()) != shapes["text_states"][0]
                                or (n and not 1 <= int(lengths.min()) <= int(lengths.max()) <= m["text_max_length"])):
                            raise UserError(f"{where}: caption lengths do not match its text_states; extract the "
                                            "features again")
                        self._lengths.append(lengths)
                        self._offsets.append(torch.cumsum(lengths, 0) - lengths)
            except (OSError, SafetensorError) as e:
                raise UserError(f"{where} is unreadable ({type(e).__name__}: {e}); extract the features again") from None
            self._starts.append(total)
            total += n
        self._len = total
        self._members = {b: np.sort(np.array(ids, dtype=np.int64)) for b, ids in self._members.items()}
        self._handles: dict[int, object] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict:  # data-loader workers (spawn) open their own handles
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state

    def _handle(self, shard: int):
        from safetensors import safe_open

        if self._pid != os.getpid():  # a forked worker: handles are per process
            self._handles, self._pid = {}, os.getpid()
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self._files[shard]), framework="pt")
        return self._handles[shard]

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, row) of sample ``index``. Raises IndexError outside ``[-len, len)``."""
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"sample {index} of {self._len}")
        shard = bisect_right(self._starts, index) - 1
        return shard, index - self._starts[shard]

    def __getitem__(self, index: int | tuple[int, int]) -> dict:
        if isinstance(index, tuple):  # in buckets: (source index, bucket id), the bucket sampler's key
            source, members = int(index[0]), self._members[int(index[1])]
            # not stored at that bucket (left out at extraction, unreadable): the bucket's next, as BucketDataset
            index = self._row[int(members[np.searchsorted(members, source) % len(members)])]
        shard, row = self.locate(int(index))
        f = self._handle(shard)
        item: dict = {"mean": f.get_slice("mean")[row]}
        if self.stochastic:
            item["std"] = f.get_slice("std")[row]
        item["label"] = int(self._labels[shard][row])
        if self.cond_keys:  # a pretrained pipeline's conditioning, as its prompt encoder gave it
            item["cond"] = {k: f.get_slice(f"cond.{k}")[row] for k in self.cond_keys}
            item["text"] = self.texts[self._starts[shard] + row]
        elif self.condition == "text":
            n, off = int(self._lengths[shard][row]), int(self._offsets[shard][row])
            states = torch.zeros(self.text_max_length, self.text_dim, dtype=torch.float32)
            states[:n] = f.get_slice("text_states")[off:off + n]
            mask = torch.zeros(self.text_max_length, dtype=torch.bool)
            mask[:n] = True
            item |= {"text_states": states, "text_mask": mask, "text": self.texts[self._starts[shard] + row]}
        return item

    def source_index(self, index: int) -> int:
        """The index in the source data set of sample ``index``."""
        shard, row = self.locate(int(index))
        return int(self._handle(shard).get_slice("source_index")[row])

