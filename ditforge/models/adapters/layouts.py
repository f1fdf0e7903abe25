"""The declaration of a model's original-checkpoint layout (``OriginalLayout``): how the parameter names of a
diffusers model map onto the names of the release it was converted from. An adapter declares one per component it
knows the release of (``DiffusersDenoiser.original_layouts``, one layout or several for a component: ``declared``);
``ditforge.weights.original`` reads them (writing a model or a LoRA in the original layout, reading a layout that
diffusers has no converter of), and ``find_layout`` (recognising a single file's layout: ``single_file``). The maps
are the inverses of diffusers' single-file converters (``diffusers/loaders/single_file_utils.py``), which the tests
check them against; a layout diffusers has no converter of (``diffusers_converts`` False) is read by inverting its
renames (``weights.original.from_original``)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from ditforge.errors import UserError

# the prefixes a single file may put before the original names: a full checkpoint's (ComfyUI's and the LDM
# checkpoints' ``model.diffusion_model.``), a LoRA's (``diffusion_model.``), none (a bare diffusion model)
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")


@dataclass(frozen=True)
class OriginalLayout:
    """One original layout, as data.

    Templates are dotted parameter names with ``{field}`` placeholders (each matches one or more characters;
    ``{p}`` is by convention the rest of the name, ``weight`` or ``bias``); a template matches a name in full, and
    the fields it captures fill the other side's template. An original template may hold a field its diffusers
    template has not (an index diffusers drops: Wan 2.2's VAE resamplers); such a name is read, never written.

    Attributes:
        name: what a user calls the layout (messages: the layouts ``find_layout`` knows).
        renames: ``(diffusers template, original template)`` pairs, tried in order; the first that matches a
            diffusers name gives its original name; a name that none matches is the same in both layouts.
        fused: ``(original template, (diffusers template, ...))``: that original tensor is the concatenation along
            dim 0 (rows) of the listed diffusers tensors, in that order (a fused q, k, v projection).
        swapped: original templates whose tensor holds the diffusers tensor's two halves along dim 0 in the other
            order (a final norm's (shift, scale) stored as (scale, shift) by diffusers).
        detect: original names of which any, present in a file (after a known prefix), identifies the layout
            (diffusers' ``CHECKPOINT_KEY_NAMES``); the first distinguishes it from the others of the same family.
        prefix: what every original name carries in the release's own file, and diffusers' converter expects
            (LTX-Video's VAE lies in its release's checkpoint under ``vae.``); ``to_original`` writes it, and a file
            whose names lack it (ComfyUI's VAE files) is read too (``find_layout``).
        diffusers_converts: diffusers' single-file converter of the class reads the layout (the one
            ``from_single_file`` calls, ``single_file.load_component`` uses it); False: ditforge reads it itself,
            by its ``renames`` inverted (``weights.original.from_original``; no ``fused`` tensors then), for a
            layout diffusers has no converter of (Wan 2.2's VAE, Wan's own UMT5 text encoder file).
    """

    name: str
    renames: tuple[tuple[str, str], ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    swapped: tuple[str, ...] = ()
    detect: tuple[str, ...] = ()
    prefix: str = ""
    diffusers_converts: bool = True


def declared(original_layouts: Mapping[str, OriginalLayout | tuple[OriginalLayout, ...]], component: str
             ) -> tuple[OriginalLayout, ...]:
    """The layouts an adapter's ``original_layouts`` declares for ``component`` (``transformer``, ``vae``,
    ``text_encoder``), in the order ``find_layout`` tries them: the value itself when it is a tuple (a component
    released in several layouts, the one whose ``detect`` names are also in the others' files first), else the one
    layout; () for none."""
    layouts = original_layouts.get(component, ())
    return layouts if isinstance(layouts, tuple) else (layouts,)


@functools.lru_cache(maxsize=4096)
def _pattern(template: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", template)  # literal, field, literal, field, ...
    return re.compile("".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>.+?)" for i, p in enumerate(parts)))


def match(template: str, name: str) -> dict[str, str] | None:
    """The fields of ``template`` (``OriginalLayout``'s templates) in ``name``, or None where it does not match it in
    full."""
    found = _pattern(template).fullmatch(name)
    return None if found is None else found.groupdict()


def swapped(original: str, layout: OriginalLayout) -> bool:
    """Whether original name ``original`` is one of ``layout``'s ``swapped`` tensors."""
    return any(match(t, original) is not None for t in layout.swapped)


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s two halves along dim 0 in the other order (a new tensor)."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def diffusers_name(original: str, layout: OriginalLayout) -> str:
    """The diffusers parameter name of ``original`` (a name of ``layout``, without its ``prefix``): the first of the
    ``renames`` whose original template matches it, its diffusers template filled with the captured fields (a field
    only the original template has, such as an index diffusers drops, is left out); a name that none matches is
    the same in both layouts. The inverse of ``weights.original.original_name`` for a layout without ``fused`` tensors."""
    for ours, theirs in layout.renames:
        fields = match(theirs, original)
        if fields is not None:
            return ours.format(**fields)
    return original


def from_original(state: Mapping[str, torch.Tensor], layout: OriginalLayout) -> dict[str, torch.Tensor]:
    """A checkpoint in ``layout`` (original name without the layout's ``prefix`` -> tensor, any dtype and shape) in
    diffusers' (or transformers') names: renamed by ``diffusers_name``, the swapped halves swapped back; the tensors
    are ``state``'s own (no copy). For the layouts diffusers has no converter of (``diffusers_converts`` False).

    Raises:
        TypeError: the layout declares ``fused`` tensors (their parts' sizes are not in the names), or two original
            names map to one diffusers name (the layout's declaration is wrong).
    """
    if layout.fused:
        raise TypeError(f"{layout.name}: a layout of fused tensors is read by diffusers' converter only")
    out: dict[str, torch.Tensor] = {}
    for original, tensor in state.items():
        name = diffusers_name(original, layout)
        if name in out:
            raise TypeError(f"{layout.name}: {original} and another tensor both map to {name}")
        out[name] = swap_halves(tensor) if swapped(original, layout) else tensor
    return out


def renamed(prefixes: dict[str, str], names: dict[str, str], suffix: str = "{p}") -> tuple[tuple[str, str], ...]:
    """The ``renames`` of every ``prefix + name + suffix``: each diffusers prefix (a template) with each diffusers
    name, to the original prefix and name, e.g. ``renamed({"blocks.{i}.attn1.": "blocks.{i}.self_attn."},
    {"to_q.": "q."})`` -> ``(("blocks.{i}.attn1.to_q.{p}", "blocks.{i}.self_attn.q.{p}"),)``."""
    return tuple((ours + name + suffix, theirs + original + suffix)
                 for ours, theirs in prefixes.items() for name, original in names.items())


def find_layout(keys: Iterable[str], layouts: Mapping[str, OriginalLayout], what: str
                ) -> tuple[str, OriginalLayout, str]:
    """The layout of a single file whose tensors are named ``keys``: ``(its key in layouts, the layout, the
    prefix its names carry, the layout's own ``prefix`` or one of PREFIXES)``, the first of ``layouts`` (in order) one of whose ``detect`` names
    is in ``keys`` after a prefix.

    Raises:
        UserError: no layout matches; the message names ``what`` (the flag and file) and the known layouts.
    """
    keys = set(keys)
    for key, layout in layouts.items():
        for prefix in (layout.prefix, *PREFIXES) if layout.prefix else PREFIXES:
            if any(prefix + name in keys for name in layout.detect):
                return key, layout, prefix
    known = "; ".join(layout.name for layout in layouts.values())
    raise UserError(f"{what}: the file's tensor names match no known layout (known: {known or 'none'})")
