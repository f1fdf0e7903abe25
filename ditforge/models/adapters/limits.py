"""What a family's model takes, declared by its adapter (``DiffusersDenoiser.text_limits`` / ``size_refused``) and
read from the model's own config where the model fixes it (CogVideoX's ``max_text_seq_length``, Wan's
``rope_max_seq_len``, SD3's ``pos_embed_max_size``), else from the pipeline (its tokenizer's ``model_max_length``,
its call's ``max_sequence_length`` default): the caption length every encoding uses (training, feature
extraction, sampling: ``Pretrained.encode_prompt``), and the frame sizes it refuses.

A caption longer than a text encoder takes is truncated to that length, as the pipelines' ``encode_prompt`` does,
with one warning line per process naming both lengths (``CaptionCheck``); the pipelines' own truncation warnings
(diffusers logs one per call, every training step) are dropped meanwhile (``quiet_truncation``)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextLimit:
    """One text encoder's caption length.

    Attributes:
        tokenizer: the pipeline component that tokenizes for it (``tokenizer``, ``tokenizer_2``, ``tokenizer_3``).
        length: the tokens it takes (special tokens included), what the pipeline's ``encode_prompt`` truncates to.
        source: where ``length`` comes from, for messages (``transformer.config.max_text_seq_length``, ...).
    """

    tokenizer: str
    length: int
    source: str


def call_default_limit(pipe: Any, tokenizer: str = "tokenizer") -> TextLimit:
    """The limit of a model that fixes no caption length (cross-attention, or a joint attention without positions
    for the text): the pipeline call's ``max_sequence_length`` default, the length it was trained and is sampled
    at (``inspect.signature(pipe.__call__)``)."""
    from ditforge.models.adapters import call_default

    return TextLimit(tokenizer, int(call_default(pipe, "max_sequence_length")),
                     f"{type(pipe).__name__}.__call__'s max_sequence_length default")


def tokenizer_limit(pipe: Any, tokenizer: str = "tokenizer") -> TextLimit:
    """A CLIP tokenizer's limit, ``model_max_length`` (77: the text model's ``max_position_embeddings``), to which the
    pipelines tokenize."""
    return TextLimit(tokenizer, int(getattr(pipe, tokenizer).model_max_length), f"{tokenizer}.model_max_length")


class _DropTruncation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return "truncated" not in message and not message.startswith("Token indices sequence length is longer")


_DROP = _DropTruncation()


@contextlib.contextmanager
def quiet_truncation(pipe: Any):
    """Drops the "... was truncated because ..." records of the loggers of the modules defining ``pipe``'s class
    and its bases (where their ``encode_prompt`` lives), and transformers' "Token indices sequence length is longer
    than ..." (the pipelines tokenize untruncated to compare), while the block runs: ``CaptionCheck`` says it
    once."""
    loggers = {logging.getLogger(c.__module__) for c in type(pipe).__mro__ if c.__module__.startswith("diffusers.")}
    loggers.add(logging.getLogger("transformers.tokenization_utils_base"))
    for logger in loggers:
        logger.addFilter(_DROP)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_DROP)


class CaptionCheck:
    """Warns, once per process, of a caption longer than the family's text encoders take (``text_limits``): one
    line, naming the caption's tokens and each limit it passes, with its source; later long captions are truncated
    without a word (a run meets the same captions every epoch)."""

    def __init__(self, denoiser: Any, pipe: Any):
        self.denoiser, self.pipe, self.warned = denoiser, pipe, False

    def __call__(self, texts: list[str]) -> None:
        """Counts the tokens of ``texts`` against each limit (the adapter's ``prompt_tokens``) until one passes."""
        if self.warned:
            return
        limits = self.denoiser.text_limits(self.pipe)
        for text in texts:
            over = [(self.denoiser.prompt_tokens(self.pipe, text, limit), limit) for limit in limits]
            over = [(n, limit) for n, limit in over if n > limit.length]
            if over:
                self.warned = True
                parts = ", ".join(f"{n} tokens to {limit.length} ({limit.source})" for n, limit in over)
                log.warning("a caption is longer than %s takes: truncated, as the pipeline does, %s; \"%s\" (later "
                            "captions are truncated alike, without this warning)", type(self.pipe).__name__, parts,
                            " ".join(text.split())[:60])
                return
