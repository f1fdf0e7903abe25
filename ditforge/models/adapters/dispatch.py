"""The attention seam of diffusers' transformers: their processors call diffusers' ``dispatch_attention_fn``
(``diffusers.models.attention_dispatch``) with the processor's ``_attention_backend``; ``route_self_attention``
sends the self-attention calls of one transformer to a ditforge kernel instead, leaving diffusers' code as it is.

How: the module of each processor class gets a router in place of its ``dispatch_attention_fn`` (installed once a
module; every other call goes on to diffusers' function unchanged), and the routed processors get a marker as
their backend. A call is routed when it carries the marker and is a plain self-attention: no mask, no dropout, not
causal, keys as many as queries, no context-parallel config, and a head width the kernel takes. Anything else
(cross-attention, a masked joint attention, a split sequence) runs the processor's own backend, as it would have.

Processors that call PyTorch's SDPA themselves, past the dispatcher (CogVideoX's), are routed too: each gets a
class of its own, a subclass of its class whose ``__call__`` is the same code reading the name ``F`` from a copy of
its module's globals, where ``F`` is a copy of ``torch.nn.functional`` whose ``scaled_dot_product_attention``
routes plain self-attention calls (``_sdpa_router``). diffusers' code runs as written and dynamo traces it whole;
only the function the name resolves to differs.

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

import itertools
import logging
import sys
import types
from collections.abc import Callable

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)
_ROUTED = itertools.count()  # names of _sdpa_routed_class's namespaces

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
            if (parallel_config is None and not attention_kwargs
                    and _plain(query, key, value, attn_mask, dropout_p, is_causal, backend.head_dims)):
                return backend.fn(query, key, value, scale=scale).to(query.dtype)
            backend = backend.previous  # the processor's own, as before the routing
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa, attention_kwargs=attention_kwargs, backend=backend,
                        parallel_config=parallel_config)

    dispatch_attention_fn.routes_ditforge = True
    return dispatch_attention_fn


def _plain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask, dropout_p: float,
           is_causal: bool, head_dims: tuple[int, ...]) -> bool:
    """A call a route's kernel takes: no mask, no dropout, not causal, keys as many as queries (q, k, v of one
    shape) and a head width (the last dimension) in ``head_dims``."""
    return (attn_mask is None and dropout_p == 0.0 and not is_causal and query.shape == key.shape == value.shape
            and query.shape[-1] in head_dims)


def _sdpa_router(route: _Route) -> Callable[..., torch.Tensor]:
    """PyTorch's ``scaled_dot_product_attention`` as a routed processor that calls it itself sees it: a plain call
    (``_plain``; q, k, v (B, H, S, D)) goes to ``route.fn`` in the dispatcher's layout (B, S, H, D), any other to
    PyTorch's as called."""

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        if not enable_gqa and _plain(query, key, value, attn_mask, dropout_p, is_causal, route.head_dims):
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))
            return route.fn(q, k, v, scale=scale).to(query.dtype).transpose(1, 2)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    return scaled_dot_product_attention


def _sdpa_routed_class(cls: type, route: _Route) -> type | None:
    """``cls`` (a processor class whose ``__call__`` calls ``F.scaled_dot_product_attention``) with that name
    resolving to ``_sdpa_router(route)`` (module docstring); None where its ``__call__`` names no ``F`` SDPA call
    (it reaches SDPA some other way: nothing to route). One class per route and processor class: the blocks of one
    class then stay one compiled graph (dynamo guards on the processor's type)."""
    call = cls.__call__
    code = call.__code__
    if "F" not in code.co_names or "scaled_dot_product_attention" not in code.co_names:
        return None
    # both namespaces are modules in sys.modules under names of their own: dynamo finds an inlined function's
    # globals, and guards on them, through its module's name
    name = f"{__name__}._routed{next(_ROUTED)}"
    functional = sys.modules[f"{name}.F"] = types.ModuleType(f"{name}.F")
    functional.__dict__.update({k: v for k, v in vars(F).items() if not k.startswith("__")})
    functional.scaled_dot_product_attention = _sdpa_router(route)
    home = sys.modules[name] = types.ModuleType(name)
    home.__dict__.update({k: v for k, v in call.__globals__.items() if k != "__name__"}, F=functional)
    routed = types.FunctionType(code, home.__dict__, call.__name__, call.__defaults__, call.__closure__)
    routed.__kwdefaults__, routed.__qualname__ = call.__kwdefaults__, call.__qualname__
    return type(cls.__name__, (cls,), {"__call__": routed, "_ditforge_unrouted": cls, "__module__": cls.__module__})


def _unroute_sdpa(processor) -> None:
    """Give a processor routed by ``_sdpa_routed_class`` its own class back (no-op for any other)."""
    processor.__class__ = getattr(type(processor), "_ditforge_unrouted", type(processor))


def _calling_sdpa(transformer: torch.nn.Module):
    """(name, module, processor) of ``transformer``'s attention modules whose processor calls PyTorch itself."""
    for name, module in transformer.named_modules():
        processor = getattr(module, "processor", None)
        if processor is not None and not hasattr(processor, "_attention_backend"):
            yield name, module, processor


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
    from ditforge.ops.flash4 import ops

    if not _fa4_runs(device):
        return 0
    ops()  # registered before the blocks compile
    routed = route_self_attention(transformer, fastest_exact(device), EXACT_HEAD_DIMS)
    log.info("exact attention: %d self-attention modules take FlashAttention-4 where it is faster", routed)
    return routed


def _fa4_runs(device: torch.device) -> bool:
    """FlashAttention-4 can take ``device``'s calls: a CUDA device, the wheel installed. Apart so that a CPU test can
    route anyway, the kernel then falling back to SDPA (``ops.flash4.exact_attention``)."""
    from ditforge.ops.flash4 import fa4_installed

    return device.type == "cuda" and fa4_installed()


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
    many modules were wrapped. A processor ``route_self_attention`` routed is unrouted first: a split sequence
    attends through ``fn``."""
    wrapped = 0
    for _, module, processor in _calling_sdpa(transformer):
        _unroute_sdpa(processor)

        @torch.compiler.disable
        def forward(*args, _forward=module.forward, **kwargs):
            with _CatchSDPA(fn):
                return _forward(*args, **kwargs)

        module.forward = forward
        wrapped += 1
    return wrapped


def route_self_attention(transformer: torch.nn.Module, fn: Callable[..., torch.Tensor],
                         head_dims: tuple[int, ...]) -> int:
    """Send the self-attention of ``transformer``'s attention modules (not cross-attention: ``is_cross_attention``,
    else not named ``attn2``) to ``fn(q, k, v, scale=) -> (B, S, H, D)`` for q, k, v (B, S, H, D) of a head width in
    ``head_dims``: where the processor calls diffusers' dispatcher, through it (``_router``), where it calls PyTorch's
    SDPA itself, through the name it calls it by (``_sdpa_routed_class``). A joint text-video attention without a
    mask is a self-attention here. Returns how many modules were routed (0: none whose calls can be reached)."""
    routed = 0
    classes: dict[type, type | None] = {}
    route = _Route(fn, head_dims)
    for name, module, processor in _calling_sdpa(transformer):
        own = getattr(type(processor), "_ditforge_unrouted", type(processor))
        if own not in classes:
            classes[own] = _sdpa_routed_class(own, route)
        if _is_cross(name, module) or classes[own] is None:
            continue
        processor.__class__ = classes[own]
        routed += 1
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
