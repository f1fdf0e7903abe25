"""The attention seam: every attention call in every model goes through `attention`.

Backends, sequence parallelism and packed sequences plug in here (set from outside, by ``parallelize``), so
model code never branches on them.

Packed sequences (``Packed``, built by ``ditforge.data.packing.pack``): the tokens of several samples lie end to
end in (R, L, D) rows, and self-attention is block-diagonal, each token attending to its own sample's tokens
only (``packed_attention``). The kernel is chosen here (``set_packed_attention_backend``): PyTorch's
FlexAttention with a document mask (compiled; CUDA), the flash variable-length kernel
(``torch.nn.attention.varlen.varlen_attn``, cumulative lengths; CUDA), or the dense reference (SDPA with a
boolean block-diagonal mask; any device, the CPU's and the tests' oracle).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

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
_exact: Callable[..., torch.Tensor] | None = None  # under fast on a GPU with FlashAttention-4: fastest_exact's
# project(x, heads) -> (q, k, v): the query, key and value projection of tokens x (B, N, D) for the heads in
# the slice ``heads`` (None: all), each (B, h, N, Dh); see ``self_attention``.
Projection = Callable[[torch.Tensor, "slice | None"], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# Self-attention over a token sequence that is split across processes (sequence parallelism), installed by
# ``ditforge.parallel.sequence.shard``; None: the sequence is whole and ``self_attention`` is ``attention``.
_split_sequence_attention: Callable[[torch.Tensor, Projection], torch.Tensor] | None = None
PACKED_ATTENTION_BACKENDS = ("auto", "flex", "varlen", "dense")
_packed_backend = "auto"
_HAS_VARLEN = importlib.util.find_spec("torch.nn.attention.varlen") is not None
_compiled_flex: Callable | None = None


@dataclass(eq=False)
class Packed:
    """Where the tokens of S samples lie in R packed rows of L tokens, and what a model needs to run them.

    Samples never cross rows; each row's unused tail is padding (its own document, so no attention row is
    empty). Tokens of a sample are in row-major order over its own grid. "Real tokens" are the M = sum of the
    samples' token counts, numbered sample by sample (the order of ``data.packing.patchify``'s rows).

    Attributes:
        rows, length: R and L.
        document_ids: (R, L) int32, the document of each position: samples and padding runs, numbered along
            the flattened R * L stream (so equal ids are one contiguous run).
        cu_seqlens: (documents + 1,) int32 cumulative lengths of the documents along that stream.
        max_len: the longest document, in tokens.
        sample: (R, L) int64, the sample of each position (padding: 0, whose values it then carries; padding
            never reaches a sample's tokens through attention, and its outputs are dropped).
        valid: (R, L) bool, False on padding.
        index: (M,) int64, position in the flattened stream of each real token.
        token_sample: (M,) int64, the sample of each real token.
        first: (S,) int64, the first real token of each sample.
        grids: each sample's token grid ((H', W') or (T', H', W')).
        repeated: (M,) bool, tokens of 1-frame samples in a video model with temporal patch t > 1 (the frame
            repeated t times; the model returns the mean of the t copies), else all False.
        block_mask: FlexAttention's block mask, built on first use and reused by every layer.
    """

    rows: int
    length: int
    document_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    sample: torch.Tensor
    valid: torch.Tensor
    index: torch.Tensor
    token_sample: torch.Tensor
    first: torch.Tensor
    grids: tuple[tuple[int, ...], ...]
    repeated: torch.Tensor
    block_mask: object = field(default=None, repr=False)


def set_packed_attention_backend(backend: str = "auto") -> str:
    """Choose the kernel of ``packed_attention``: ``flex`` (FlexAttention, document mask; compiled on CUDA,
    eager and forward-only on the CPU), ``varlen`` (flash variable-length attention, CUDA only), ``dense``
    (SDPA with a boolean (L, L) block-diagonal mask per row: exact everywhere, O(L^2) memory), ``auto`` (on
    CUDA varlen for fp16 / bf16 where this torch has it, else flex; dense elsewhere). Returns a description for
    the log.

    Raises:
        ValueError: an unknown name.
    """
    global _packed_backend
    if backend not in PACKED_ATTENTION_BACKENDS:
        raise ValueError(f"packed attention backend {backend!r}: expected one of {PACKED_ATTENTION_BACKENDS}")
    _packed_backend = backend
    return f"packed attention: {backend}"


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _compiled_flex
    if packed.block_mask is None:
        ids = packed.document_ids

        def same_document(b, h, q_idx, kv_idx):
            return ids[b, q_idx] == ids[b, kv_idx]

        packed.block_mask = create_block_mask(same_document, packed.rows, None, packed.length, packed.length,
                                              device=q.device)
    if q.device.type != "cuda":  # the CPU runs FlexAttention's eager reference (forward only)
        return flex_attention(q, k, v, block_mask=packed.block_mask)
    if _compiled_flex is None:  # uncompiled, FlexAttention materialises the scores; compiled it is one kernel
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=packed.block_mask)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    rows, heads, length, dh = q.shape
    q, k, v = (a.transpose(1, 2).reshape(rows * length, heads, dh) for a in (q, k, v))  # (R L, H, Dh) stream
    out = varlen_attn(q, k, v, packed.cu_seqlens, packed.cu_seqlens, packed.max_len, packed.max_len)
    return out.reshape(rows, length, heads, dh).transpose(1, 2)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed) -> torch.Tensor:
    ids = packed.document_ids
    return attention(q, k, v, ids[:, :, None] == ids[:, None, :])


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Block-diagonal softmax attention of packed rows: each query attends to the keys of its own document
    (sample, or padding run) only; exactly ``attention`` of each sample alone (Vaswani et al. 2017, eq. 1),
    up to float rounding. Kernel: ``set_packed_attention_backend``.

    Args:
        q, k, v: (R, H, L, Dh), same float dtype (varlen: fp16 / bf16 on CUDA).
        packed: where the documents lie.

    Returns:
        (R, H, L, Dh) in the dtype of ``q``.
    """
    backend = _packed_backend
    if backend == "auto":  # varlen measured fastest on an H100 (benchmarks/results/packing_h100.json)
        half = q.dtype in (torch.float16, torch.bfloat16)
        backend = ("varlen" if half and _HAS_VARLEN else "flex") if q.device.type == "cuda" else "dense"
    return {"flex": _flex, "varlen": _varlen, "dense": _dense}[backend](q, k, v, packed)


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


def self_attention(x: torch.Tensor, project: Projection, packed: Packed | None = None) -> torch.Tensor:
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
        packed: packed rows (x is (R, L, D)): ``packed_attention``, each sample attending within itself.

    Returns:
        (B, H, N, Dh) in the dtype of the projection.

    Raises:
        ValueError: packed rows under sequence parallelism (not supported; the config refuses the pair first).
    """
    if packed is not None:
        if _split_sequence_attention is not None:
            raise ValueError("packed sequences under sequence parallelism are not supported")
        return packed_attention(*project(x, None), packed)
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


def fastest_exact(device: torch.device) -> Callable[..., torch.Tensor]:
    """``fn(q, k, v, scale=None)`` on (B, S, H, D) inputs (the diffusers dispatcher's layout, ``route_self_attention``'s
    kernel signature): exact attention by the faster of FlashAttention-4 and SDPA in ``fast_backends`` order at each
    shape (``ops.flash4.exact_attention``)."""
    from functools import partial

    from ditforge.ops.flash4 import exact_attention

    return partial(exact_attention, backends=tuple(b.name for b in fast_backends(device)))


def set_attention_backend(backend: str = "auto", device: torch.device | None = None) -> str:
    """Choose the SDPA kernels behind ``attention``: ``fast`` (``--enable_flashattn``) the fastest exact kernel
    on ``device`` (default: the current CUDA device, else the CPU): FlashAttention-4 where installed and faster at a
    shape (``fastest_exact``), else PyTorch's in ``fast_backends`` order;
    ``math`` the unfused reference computation (materialises the N x N scores, as the original DiT code did;
    the baseline row of ``ditforge bench``); ``auto`` PyTorch's default order. Returns a description for the log.

    Raises:
        ValueError: an unknown backend name.
    """
    global _preferred, _exact
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected one of {ATTENTION_BACKENDS}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    _preferred = {"auto": None, "fast": fast_backends(device), "math": [SDPBackend.MATH]}[backend]
    _exact = None
    if backend == "fast" and device.type == "cuda":
        from ditforge.ops.flash4 import fa4_installed, ops

        if fa4_installed():
            ops()  # registered before any block compiles
            _exact = fastest_exact(device)  # made here, not in the (traced) attention call
    if _preferred is None:
        return "PyTorch's default SDPA order"
    return "SDPA, in order: " + ", ".join(b.name.lower() for b in _preferred)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exact softmax attention, softmax(q k^T / sqrt(d)) v (Vaswani et al. 2017, eq. 1).

    Args:
        q: (B, H, Nq, Dh) queries, any float dtype.
        k, v: (B, H, Nk, Dh) keys and values, same dtype as ``q``.
        mask: optional (B, Nk) bool, True for keys to attend to (padding of text tokens is False), or (B, Nq, Nk)
            per query (packed rows: each sample's queries to its own caption); every row needs at least one True.

    Returns:
        (B, H, Nq, Dh) in the dtype of ``q``. Runs PyTorch's ``scaled_dot_product_attention``, with the
        backend order set by ``set_attention_backend`` (every backend is exact; they differ in speed); under
        ``fast``, an unmasked CUDA call goes to ``fastest_exact`` (FlashAttention-4 where it is faster at the shape).
    """
    attn_mask = None if mask is None else mask[:, None] if mask.dim() == 3 else mask[:, None, None, :]
    if _preferred is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    if mask is None and _exact is not None:  # FlashAttention-4 where faster
        return _exact(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    with sdpa_kernel(_preferred, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
