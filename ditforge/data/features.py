"""Pre-computed features: the latent posterior and the caption states of every sample, stored in shards, so
training reads features instead of decoding and encoding pixels every step (as fast-DiT's
``extract_features.py`` does, except that the posterior's moments are stored, not one draw from it: training
still draws fresh latents ``mean + std * eps`` every step, exactly as it does when encoding on the fly).

``extract_features`` writes a folder; ``ditforge.data.build_dataset`` reads a folder holding ``features.json``
as a ``FeatureDataset``, whose items ``ditforge.encoders.batch.BatchEncoder`` turns into the same denoiser inputs
(and the same training loss, for the same seed) as the pixels and captions they were computed from.

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
                                                (N, 77, 768) for SD 1.x; the T5 states and mask for PixArt), as
                                                computed, float32
"""

from __future__ import annotations

import json
import logging
import os
from bisect import bisect_right
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from ditforge.atomic import atomic_path
from ditforge.config import resolve_device
from ditforge.data.prefetch import default_num_workers
from ditforge.errors import UserError

log = logging.getLogger(__name__)

FEATURES_FORMAT = "ditforge-features"
FEATURES_VERSION = 1
SHARD_PATTERN = "shard-{:05d}.safetensors"
MANIFEST_KEYS = ("format", "version", "condition", "vae", "text_encoder", "text_max_length", "text_dim", "in_channels",
                 "input_size", "num_frames", "image_size", "frame_interval", "num_classes", "class_captions",
                 "random_flip", "stochastic", "data", "num_samples", "shards", "texts")


def _manifest_name() -> str:
    from ditforge.data import FEATURES_MANIFEST

    return FEATURES_MANIFEST


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


def extract_features(cfg, out: str | Path, batch_size: int = 32, shard_size: int = 1024,
                     device: str | torch.device = "auto", fmt: str = "safetensors") -> Path:
    """Encode every sample of ``--data`` once and store the results in ``out`` (see the module docstring).

    The data set is built exactly as the trainer builds it (``build_dataset`` with ``cfg.data`` and
    ``cfg.train.seed``: a video's clip is the one training on the fly reads for that seed), the encoders exactly
    as it loads them (``build_batch_encoder``, which resolves ``--condition auto`` and fills ``cfg.model``), and
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
        fmt: ``safetensors`` (this module's folder) or ``wds``: WebDataset tar shards that ``--data`` streams
            (``ditforge.data.shards``: per sample ``latent.npy`` = the mean, ``std.npy``, ``cls``, and ``text.npy``
            (L_i, D_text) + ``txt`` for the text condition; ``shards.json`` holds this manifest's keys, its
            ``texts`` only the first ``NUM_TEXTS`` distinct captions, for the sample grids).

    Returns:
        ``out`` as a Path. Its ``features.json`` is written last and atomically, as is every shard, so an
        interrupted extraction never leaves a folder that looks complete.

    Raises:
        UserError: ``out`` already holds features or is a file; ``--data`` is a features folder already;
            ``batch_size`` or ``shard_size`` < 1; no usable sample; ``wds`` with ``--init_from``; and the data set's and encoders' own
            (``build_dataset``, ``build_batch_encoder``).
    """
    from ditforge.data import BUILTIN_DATASETS, build_dataset, is_features
    from ditforge.encoders.batch import as_batch, build_batch_encoder

    from ditforge.data.shards import NUM_TEXTS, ShardWriter

    out = Path(out)
    manifest_path = out / _manifest_name()
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
    data = cfg.data
    if is_features(data.data):
        raise UserError(f"--data {data.data} holds features already; extract from the images or videos")
    dev = resolve_device(device)
    dataset = build_dataset(data.data, data.image_size, out / "bad_samples.jsonl", data.num_frames,
                            data.frame_interval, cfg.train.seed, resize_mode=data.resize_mode)
    m = cfg.model
    pre = None
    if m.init_from is not None:  # a pretrained pipeline's own VAE and prompt encoding
        from ditforge.encoders.batch import pipeline_batch_encoder
        from ditforge.models.adapters.pipeline import is_adapted_pipeline, load_pretrained

        if not is_adapted_pipeline(m.init_from):
            raise UserError(f"--init_from {m.init_from}: features are extracted with a diffusers pipeline folder "
                            "(Stable Diffusion, PixArt, SD3); DiT runs take --vae and --text_encoder")
        pre = load_pretrained(m.init_from, dev)
        inputs = pipeline_batch_encoder(cfg, pre, dataset)
    else:
        inputs = build_batch_encoder(cfg, dataset, dev, torch.float32)
    text = m.condition == "text" and pre is None
    cond_keys: list[str] = []
    stochastic = inputs.stochastic
    sink = ShardWriter(out, shard_size) if fmt == "wds" else None
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("shard-*.safetensors"):  # from an extraction that was interrupted: no manifest
        stale.unlink()
    if data.num_workers is None:  # as the trainer: the built-in sets live in memory, files are decoded in workers
        data.num_workers = 0 if data.data in BUILTIN_DATASETS else default_num_workers()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=data.num_workers)

    shards: list[dict] = []
    texts: list[str] = []
    pending: dict[str, list[torch.Tensor]] = {}
    pending_count = 0

    def flush(final: bool) -> None:
        nonlocal pending, pending_count
        while pending_count >= shard_size or (final and pending_count):
            n = min(shard_size, pending_count)
            cat = {k: torch.cat(v) for k, v in pending.items()}
            rows = ("mean", "std", "label", "source_index", *(f"cond.{k}" for k in cond_keys))
            tensors = {k: cat[k][:n] for k in rows if k in cat}
            rest = {k: [cat[k][n:]] for k in rows if k in cat}
            if text:
                lengths = cat["text_lengths"]
                used = int(lengths[:n].sum())
                tensors |= {"text_lengths": lengths[:n], "text_states": cat["text_states"][:used]}
                rest |= {"text_lengths": [lengths[n:]], "text_states": [cat["text_states"][used:]]}
            name = SHARD_PATTERN.format(len(shards))
            _write_shard(out / name, tensors)
            shards.append({"file": name, "num_samples": n})
            pending, pending_count = rest, pending_count - n

    def add(key: str, value: torch.Tensor) -> None:
        pending.setdefault(key, []).append(value.detach().to("cpu").contiguous())

    start = 0
    with tqdm(total=len(dataset), desc="extract features", dynamic_ncols=True, disable=None) as bar:
        for raw in loader:
            batch = as_batch(raw)
            n_batch = len(batch["label"]) if "label" in batch else len(batch["x"])
            requested = torch.arange(start, start + n_batch)
            start += n_batch
            bar.update(n_batch)
            if "index" in batch:  # video: a substitute for a bad sample carries the substitute's index
                keep = torch.as_tensor(batch["index"]) == requested
                if not keep.all():
                    batch, requested = _select(batch, keep), requested[keep]
                if not len(requested):
                    continue
            mean, std = inputs.moments(batch, dev)
            add("mean", mean.float())
            if stochastic:
                add("std", std.float())
            add("label", torch.as_tensor(batch.get("label", [0] * len(requested)), dtype=torch.int64))
            add("source_index", requested)
            if pre is not None:
                cond = inputs.conditioning(batch, dev)
                cond_keys = list(cond)
                for key, value in cond.items():
                    add(f"cond.{key}", value.float() if value.is_floating_point() else value)
                texts.extend(batch["text"])
            if text:
                captions = batch.get("text")
                if captions is None:  # labelled images captioned by their class (``class_captions``)
                    captions = [inputs.class_captions[int(i)] for i in batch["label"]]
                cond = inputs.conditioning({"text": list(captions)}, dev)
                states, mask = cond["y"].float().cpu(), cond["y_mask"].cpu()
                lengths = mask.sum(1)
                if not all(bool(mask[i, :int(k)].all()) for i, k in enumerate(lengths)):
                    raise RuntimeError("caption masks are not right-padded")  # a bug, not a user error
                add("text_lengths", lengths.to(torch.int64))
                add("text_states", torch.cat([states[i, :int(k)] for i, k in enumerate(lengths)]))
                texts.extend(captions)
            if sink is not None:
                _write_samples(sink, pending, len(requested), texts[-len(requested):] if text else None)
                pending = {}
                continue
            pending_count += len(requested)
            flush(final=False)
    flush(final=True)

    num_samples = sink.total if sink is not None else sum(s["num_samples"] for s in shards)
    if num_samples == 0:
        raise UserError(f"--data {data.data}: no usable sample to extract (see {out / 'bad_samples.jsonl'})")
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
        "data": data.data, "num_samples": num_samples, "shards": shards,
        "texts": texts if m.condition == "text" else None,
        "init_from": _local_path(m.init_from) if pre is not None else None, "cond_keys": cond_keys or None,
    }
    if sink is not None:
        sink.close({**{k: v for k, v in manifest.items() if k not in ("format", "version", "shards", "num_samples")},
                    "kind": "latent", "texts": list(dict.fromkeys(texts))[:NUM_TEXTS] if texts else None})
        return out
    with atomic_path(manifest_path) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    log.info("wrote %d samples in %d shards to %s", num_samples, len(shards), out)
    return out


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


def read_manifest(folder: str | Path) -> dict:
    """The checked ``features.json`` of a features folder (see ``extract_features`` for its keys).

    Raises:
        UserError naming ``--data`` and the file: missing or unreadable, not JSON, another format or version,
            a key missing, or shard counts that do not add up to ``num_samples``.
    """
    path = Path(folder) / _manifest_name()
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
    each sample, text condition; else None), ``class_captions`` (or None), ``stochastic``.

    Raises:
        UserError naming ``--data`` and the file: see ``read_manifest``; a shard missing, unreadable, or whose
            tensors do not match the manifest.
    """

    def __init__(self, folder: str | Path):
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
        self._labels, self._lengths, self._offsets, self._starts = [], [], [], []
        total = 0
        for spec, file in zip(m["shards"], self._files):
            where = f"--data {self.folder}: shard {file}"
            if not file.is_file():
                raise UserError(f"{where} (listed in {_manifest_name()}) is missing; extract the features again")
            n = spec["num_samples"]
            try:
                with safe_open(str(file), framework="pt") as f:
                    shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
                    expected = {"mean": [n, *sample_shape], "label": [n], "source_index": [n]}
                    if self.stochastic:
                        expected["std"] = [n, *sample_shape]
                    if text:
                        expected["text_lengths"] = [n]
                    wrong = [k for k, shape in expected.items() if shapes.get(k) != shape]
                    if text and (len(shapes.get("text_states", [])) != 2 or shapes["text_states"][1] != m["text_dim"]):
                        wrong.append("text_states")
                    if wrong:
                        raise UserError(f"{where}: tensors {', '.join(wrong)} do not match {_manifest_name()}; "
                                        "extract the features again")
                    self._labels.append(f.get_tensor("label"))
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

    def __getitem__(self, index: int) -> dict:
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

