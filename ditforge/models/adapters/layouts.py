"""The declaration of a model's original-checkpoint layout (``OriginalLayout``): how the parameter names of a
diffusers model map onto the names of the release it was converted from. An adapter declares one per component it
knows the release of (``DiffusersDenoiser.original_layouts``); ``ditforge.weights.original`` reads them (writing a
model or a LoRA in the original layout), and ``find_layout`` (recognising a single file's layout: ``single_file``).
The maps are the inverses of diffusers' single-file converters (``diffusers/loaders/single_file_utils.py``), which
the tests check them against."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ditforge.errors import UserError

# the prefixes a single file may put before the original names: a full checkpoint's (ComfyUI's and the LDM
# checkpoints' ``model.diffusion_model.``), a LoRA's (``diffusion_model.``), none (a bare diffusion model)
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")


@dataclass(frozen=True)
class OriginalLayout:
    """One original layout, as data.

    Templates are dotted parameter names with ``{field}`` placeholders (each matches one or more characters;
    ``{p}`` is by convention the rest of the name, ``weight`` or ``bias``); a template matches a name in full, and
    the fields it captures fill the other side's template.

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
    """

    name: str
    renames: tuple[tuple[str, str], ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    swapped: tuple[str, ...] = ()
    detect: tuple[str, ...] = ()
    prefix: str = ""


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
