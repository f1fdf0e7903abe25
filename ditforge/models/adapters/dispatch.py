"""The attention seam of diffusers' transformers: their processors call diffusers' ``dispatch_attention_fn``
(``diffusers.models.attention_dispatch``) with the processor's ``_attention_backend``; ``route_self_attention``
sends the self-attention calls of one transformer to a ditforge kernel instead, leaving diffusers' code as it is.

How: the module of each processor class gets a router in place of its ``dispatch_attention_fn`` (installed once a
module; every other call goes on to diffusers' function unchanged), and the routed processors get a marker as
their backend. A call is routed when it carries the marker and is a plain self-attention: no mask, no dropout, not
causal, keys as many as queries, no context-parallel config, and a head width the kernel takes. Anything else
(cross-attention, a masked joint attention, a split sequence) runs the processor's own backend, as it would have.

``intercept_attention`` hands every call of a transformer's processors to a function of ditforge's (context
parallelism of a joint text-video attention, ``parallel.context``), with the processor's own backend to call for the
attention itself. ``intercept_sdpa`` does the same for processors that call PyTorch's SDPA themselves, past the
dispatcher (CogVideoX's): a ``TorchFunctionMode`` around each such attention module's forward catches the call.

``unmask_full_attention`` uses the same router for another purpose: a family whose attention always carries a mask
(HunyuanVideo's joint text-video attention masks the text padding) computes the same without it once the padding
is cropped away, and a mask keeps PyTorch's SDPA off its Flash and cuDNN kernels. While the caller says the masks
are full (``Unmask.full``), the marked processors' calls drop them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

__all__ = ["Intercept", "Unmask", "intercept_attention", "intercept_sdpa", "route_exact_attention",
           "route_self_attention", "unmask_full_attention"]
EXACT_HEAD_DIMS = tuple(range(8, 257, 8))  # what route_exact_attention routes; ops.flash4 names what FA4 takes


class _Route:
    """The marker put in a processor's ``_attention_backend``: the kernel, the head widths it takes, and the backend
    the processor had (what the calls the kernel does not take go to)."""

    def __init__(self, fn: Callable[..., torch.Tensor], head_dims: tuple[int, ...], previous=None):
        self.fn, self.head_dims, self.previous = fn, head_dims, previous


class Unmask:
    """The marker of ``unmask_full_attention``: while ``full`` (a host-side flag the caller sets) every mask the
    processor passes is all True, and its calls go to ``previous`` (the processor's own backend) without it."""

    def __init__(self, previous=None):
        self.previous, self.full = previous, False


class Intercept:
    """The marker of ``intercept_attention``: every call goes to ``fn(query, key, value, attn_mask, attend)``, where
    ``attend(q, k, v, mask)`` is the processor's own backend (``previous``) without a context-parallel config."""

    def __init__(self, fn: Callable[..., torch.Tensor], previous=None):
        self.fn, self.previous = fn, previous


def _router(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A ``dispatch_attention_fn`` that sends marked plain self-attention calls to the marker's kernel, and drops the
    masks of processors marked ``Unmask`` while they are full."""

    def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        if isinstance(backend, Unmask):
            attn_mask = None if backend.full else attn_mask
            backend = backend.previous
        if isinstance(backend, Intercept):
            previous = backend.previous

            def attend(q, k, v, mask):
                return original(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                enable_gqa=enable_gqa, attention_kwargs=attention_kwargs, backend=previous)

            return backend.fn(query, key, value, attn_mask, attend)
        if isinstance(backend, _Route):
            if (attn_mask is None and dropout_p == 0.0 and not is_causal and parallel_config is None
                    and not attention_kwargs and query.shape == key.shape == value.shape
                    and query.shape[-1] in backend.head_dims):
                return backend.fn(query, key, value, scale=scale).to(query.dtype)
            backend = backend.previous  # the processor's own, as before the routing
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa, attention_kwargs=attention_kwargs, backend=backend,
                        parallel_config=parallel_config)

    dispatch_attention_fn.routes_ditforge = True
    return dispatch_attention_fn


def _install(processor) -> None:
    """The router in place of the ``dispatch_attention_fn`` of ``processor``'s module (once a module)."""
    home = sys.modules[type(processor).__module__]
    original = getattr(home, "dispatch_attention_fn")
    if not getattr(original, "routes_ditforge", False):
        home.dispatch_attention_fn = _router(original)


def _dispatching(transformer: torch.nn.Module):
    """(name, module, processor) of ``transformer``'s attention modules whose processor calls diffusers' dispatcher."""
    for name, module in transformer.named_modules():
        processor = getattr(module, "processor", None)
        if (processor is not None and hasattr(processor, "_attention_backend")
                and getattr(sys.modules[type(processor).__module__], "dispatch_attention_fn", None) is not None):
            yield name, module, processor


def route_exact_attention(transformer: torch.nn.Module, device: torch.device) -> int:
    """``--enable_flashattn`` on a diffusers transformer: its plain self-attention calls (``route_self_attention``'s)
    to ``ops.attention.fastest_exact`` (FlashAttention-4 where faster at the shape), when FlashAttention-4 is installed
    (else diffusers' own SDPA call is the fastest exact kernel there is, and nothing is routed). Returns how many
    modules were routed, and logs it."""
    from ditforge.ops.attention import fastest_exact
    from ditforge.ops.flash4 import fa4_installed, ops

    if device.type != "cuda" or not fa4_installed():
        return 0
    ops()  # registered before the blocks compile
    routed = route_self_attention(transformer, fastest_exact(device), EXACT_HEAD_DIMS)
    log.info("exact attention: %d self-attention modules take FlashAttention-4 where it is faster", routed)
    return routed


def unmask_full_attention(transformer: torch.nn.Module) -> list[Unmask]:
    """Mark every attention module of ``transformer`` whose processor calls diffusers' dispatcher with an ``Unmask``
    (returned, one a processor; none for processors that call PyTorch directly): set their ``full`` while the masks
    the transformer builds are all True."""
    markers = []
    for _, _, processor in _dispatching(transformer):
        _install(processor)
        if not isinstance(processor._attention_backend, Unmask):
            processor._attention_backend = Unmask(processor._attention_backend)
        markers.append(processor._attention_backend)
    return markers


def _is_cross(name: str, module: torch.nn.Module) -> bool:
    """Cross-attention: as the module says (Wan's), else by diffusers' block naming (LTX-Video's attn2, whose key
    width can equal the query's)."""
    cross = getattr(module, "is_cross_attention", None)
    return name.rsplit(".", 1)[-1] == "attn2" if cross is None else bool(cross)


def intercept_attention(transformer: torch.nn.Module, fn: Callable[..., torch.Tensor], cross_only: bool = False
                        ) -> int:
    """Hand every attention call of ``transformer``'s processors that call diffusers' dispatcher (with
    ``cross_only``, of its cross-attention modules alone) to ``fn`` (see ``Intercept``; q, k, v (B, S, H, D) as the
    processor passes them, the output the same). Returns how many processors were marked. Call it after
    ``enable_parallelism`` (which reads the backends) and before ``unmask_full_attention`` (whose mask drop then
    comes first)."""
    marked = 0
    for name, module, processor in _dispatching(transformer):
        if cross_only and not _is_cross(name, module):
            continue
        _install(processor)
        processor._attention_backend = Intercept(fn, processor._attention_backend)
        marked += 1
    return marked


class _CatchSDPA(TorchFunctionMode):
    """Every ``F.scaled_dot_product_attention(q, k, v, ...)`` ((B, H, S, D) each) made while active goes to ``fn(q, k,
    v, attn_mask, attend)`` in the dispatcher's layout, (B, S, H, D) (``Intercept``); ``attend`` is PyTorch's SDPA
    with the call's other options. Everything else runs as called (a mode is off inside its own handler)."""

    def __init__(self, fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.fn = fn

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        # SDPA's parameters in order: whatever the processor passed by position is named, the rest passed on as given
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        kwargs.update(zip(names, args))
        q, k, v, mask = (kwargs.pop(name, None) for name in names[:4])

        def attend(q, k, v, mask):
            return func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                        **kwargs).transpose(1, 2)

        return self.fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, attend).transpose(1, 2)


def intercept_sdpa(transformer: torch.nn.Module, fn: Callable[..., torch.Tensor]) -> int:
    """Hand the SDPA calls of ``transformer``'s attention modules whose processor calls PyTorch itself (not diffusers'
    dispatcher) to ``fn`` (``Intercept``'s signature and layout). Each such module's forward runs under a
    ``_CatchSDPA`` mode, eager (``torch.compiler.disable``: a compiled block breaks its graph there). Returns how
    many modules were wrapped."""
    wrapped = 0
    for _, module in transformer.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None or hasattr(processor, "_attention_backend"):
            continue

        @torch.compiler.disable
        def forward(*args, _forward=module.forward, **kwargs):
            with _CatchSDPA(fn):
                return _forward(*args, **kwargs)

        module.forward = forward
        wrapped += 1
    return wrapped


def route_self_attention(transformer: torch.nn.Module, fn: Callable[..., torch.Tensor],
                         head_dims: tuple[int, ...]) -> int:
    """Send the self-attention of ``transformer``'s attention modules (those whose processor calls diffusers'
    dispatcher and that are not cross-attention: ``is_cross_attention``, else not named ``attn2``) to ``fn(q, k, v,
    scale=) -> (B, S, H, D)`` for q, k, v (B, S, H, D) of a head width in ``head_dims``. Returns how many modules were
    routed (0: the transformer's processors do not call the dispatcher, e.g. an older diffusers)."""
    routed = 0
    for name, module, processor in _dispatching(transformer):
        if _is_cross(name, module):
            continue
        _install(processor)
        outer = processor._attention_backend if isinstance(processor._attention_backend, Unmask) else None
        previous = outer.previous if outer is not None else processor._attention_backend
        route = _Route(fn, head_dims, previous.previous if isinstance(previous, _Route) else previous)
        if outer is not None:  # the mask drop stays first: a call it unmasks is a plain one the kernel takes
            outer.previous = route
        else:
            processor._attention_backend = route
        routed += 1
    return routed
