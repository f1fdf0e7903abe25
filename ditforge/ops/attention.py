"""The attention seam: every attention call in every model goes through `attention`.

Backends and sequence parallelism plug in here (set from outside, by ``parallelize``), so model code never
branches on them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# GPUs on which cuDNN's attention may go first, and the cuDNN it needs (exclusive): PyTorch's own rule for
# preferring it (``check_prefer_cudnn_attention`` in aten's sdp_utils.cpp, pytorch/pytorch#174200): cuDNN up to
# 9.15.0 can access memory out of bounds when the query length is not a multiple of 128 (pytorch/pytorch#169849).
CUDNN_ATTENTION_CAPABILITIES = ((9, 0), (9, 3), (10, 0), (10, 3))
CUDNN_ATTENTION_MIN_VERSION = 91500
ATTENTION_BACKENDS = ("auto", "fast", "math")
_preferred: list[SDPBackend] | None = None
# project(x, heads) -> (q, k, v): the query, key and value projection of tokens x (B, N, D) for the heads in
# the slice ``heads`` (None: all), each (B, h, N, Dh); see ``self_attention``.
Projection = Callable[[torch.Tensor, "slice | None"], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# Self-attention over a token sequence that is split across processes (sequence parallelism), installed by
# ``ditforge.parallel.sequence.shard``; None: the sequence is whole and ``self_attention`` is ``attention``.
_split_sequence_attention: Callable[[torch.Tensor, Projection], torch.Tensor] | None = None


def set_sequence_attention(fn: Callable[[torch.Tensor, Projection], torch.Tensor] | None) -> None:
    """Install (or with None remove) the attention of a split sequence used by ``self_attention``."""
    global _split_sequence_attention
    _split_sequence_attention = fn


# Under sequence parallelism of a model that attends within and across frames (STDiT), each process holds
# whole frames; these exchange them for whole token columns (all frames of a slice of the positions) around
# the attention across frames, and back. Installed by ``ditforge.parallel.sequence.shard``; None: identity.
_frame_exchange: tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None = None


def set_frame_exchange(fns: tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]
                       | None) -> None:
    """Install (or with None remove) the (frames_to_positions, positions_to_frames) pair."""
    global _frame_exchange
    _frame_exchange = fns


def frames_to_positions(x: torch.Tensor) -> torch.Tensor:
    """(B, T_local, S, D), this process's frames -> (B, T, S_local, D), all frames of its positions; the
    identity when the sequence is whole."""
    return x if _frame_exchange is None else _frame_exchange[0](x)


def positions_to_frames(x: torch.Tensor) -> torch.Tensor:
    """Inverse of ``frames_to_positions``: (B, T, S_local, D) -> (B, T_local, S, D)."""
    return x if _frame_exchange is None else _frame_exchange[1](x)


@contextlib.contextmanager
def whole_sequences():
    """Within the block, ``self_attention`` is plain attention whatever is installed: for a model that one
    process runs alone (e.g. rank 0 drawing sample grids during a sequence-parallel run)."""
    global _split_sequence_attention, _frame_exchange
    saved = _split_sequence_attention, _frame_exchange
    _split_sequence_attention = _frame_exchange = None
    try:
        yield
    finally:
        _split_sequence_attention, _frame_exchange = saved


def self_attention(x: torch.Tensor, project: Projection) -> torch.Tensor:
    """Multi-head attention of the model's token sequence over itself, before the output projection:
    ``attention(*project(x, None))``, or, under sequence parallelism, this process's tokens attending to the
    whole sequence (x is this process's shard; the installed function communicates). The seam takes the
    tokens and their projection rather than q, k, v because FastSeq, as OpenDiT builds it, all-gathers x and
    projects one head group of the whole sequence. Cross-attention to caption tokens, which every process
    holds whole, calls ``attention`` directly.

    Args:
        x: (B, N, D) tokens, any float dtype.
        project: ``project(x, heads)`` -> q, k, v, each (B, h, N', Dh), of tokens (B, N', D) for the heads in
            the slice ``heads`` (None: all H heads).

    Returns:
        (B, H, N, Dh) in the dtype of the projection.
    """
    if _split_sequence_attention is None:
        return attention(*project(x, None))
    return _split_sequence_attention(x, project)


def cudnn_attention_preferred(device: torch.device) -> bool:
    """Whether cuDNN's attention kernels go first on ``device``: a CUDA GPU in ``CUDNN_ATTENTION_CAPABILITIES``
    (Hopper, Blackwell datacenter parts) with cuDNN newer than 9.15.0 and cuDNN SDPA not switched off
    (``torch.backends.cuda.enable_cudnn_sdp(False)``)."""
    return (device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cudnn.is_available()
            and torch.backends.cudnn.version() > CUDNN_ATTENTION_MIN_VERSION
            and torch.cuda.get_device_capability(device) in CUDNN_ATTENTION_CAPABILITIES)


def fast_backends(device: torch.device) -> list[SDPBackend]:
    """The SDPA backends in ``--enable_flashattn`` order on ``device``: cuDNN first where
    ``cudnn_attention_preferred`` (fastest on Hopper at DiT shapes: REFERENCES.md, H100, B64 x 16 heads x 256
    tokens x 72, bf16 forward: cuDNN 165, Flash 124, memory-efficient 50, math 11 TFLOP/s), else after Flash and
    memory-efficient; math last so any input still runs."""
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if cudnn_attention_preferred(device):
        return [SDPBackend.CUDNN_ATTENTION, *fused, SDPBackend.MATH]
    return [*fused, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def set_attention_backend(backend: str = "auto", device: torch.device | None = None) -> str:
    """Choose the SDPA kernels behind ``attention``: ``fast`` (``--enable_flashattn``) the fastest exact kernel
    PyTorch has on ``device`` (default: the current CUDA device, else the CPU), in ``fast_backends`` order;
    ``math`` the unfused reference computation (materialises the N x N scores, as the original DiT code did;
    the baseline row of ``ditforge bench``); ``auto`` PyTorch's default order. Returns a description for the log.

    Raises:
        ValueError: an unknown backend name.
    """
    global _preferred
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected one of {ATTENTION_BACKENDS}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    _preferred = {"auto": None, "fast": fast_backends(device), "math": [SDPBackend.MATH]}[backend]
    if _preferred is None:
        return "PyTorch's default SDPA order"
    return "SDPA, in order: " + ", ".join(b.name.lower() for b in _preferred)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exact softmax attention, softmax(q k^T / sqrt(d)) v (Vaswani et al. 2017, eq. 1).

    Args:
        q: (B, H, Nq, Dh) queries, any float dtype.
        k, v: (B, H, Nk, Dh) keys and values, same dtype as ``q``.
        mask: optional (B, Nk) bool, True for keys to attend to (padding of text tokens is False); every row
            needs at least one True.

    Returns:
        (B, H, Nq, Dh) in the dtype of ``q``. Runs PyTorch's ``scaled_dot_product_attention``, with the
        backend order set by ``set_attention_backend`` (every backend is exact; they differ in speed).
    """
    attn_mask = None if mask is None else mask[:, None, None, :]
    if _preferred is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    with sdpa_kernel(_preferred, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
