"""The declaration of a model's original-checkpoint layout (``OriginalLayout``): how the parameter names of a
diffusers model map onto the names of the release it was converted from. An adapter declares one per component it
knows the release of (``DiffusersDenoiser.original_layouts``); ``ditforge.weights.original`` reads them (writing a
model or a LoRA in the original layout, recognising a single file's layout). The maps are the inverses of diffusers'
single-file converters (``diffusers/loaders/single_file_utils.py``), which the tests check them against."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OriginalLayout:
    """One original layout, as data.

    Templates are dotted parameter names with ``{field}`` placeholders (each matches one or more characters;
    ``{p}`` is by convention the rest of the name, ``weight`` or ``bias``); a template matches a name in full, and
    the fields it captures fill the other side's template.

    Attributes:
        name: what a user calls the layout (messages: the layouts ``weights.original.find_layout`` knows).
        renames: ``(diffusers template, original template)`` pairs, tried in order; the first that matches a
            diffusers name gives its original name; a name that none matches is the same in both layouts.
        fused: ``(original template, (diffusers template, ...))``: that original tensor is the concatenation along
            dim 0 (rows) of the listed diffusers tensors, in that order (a fused q, k, v projection).
        swapped: original templates whose tensor holds the diffusers tensor's two halves along dim 0 in the other
            order (a final norm's (shift, scale) stored as (scale, shift) by diffusers).
        detect: original names of which any, present in a file (after a known prefix), identifies the layout
            (diffusers' ``CHECKPOINT_KEY_NAMES``); the first distinguishes it from the others of the same family.
    """

    name: str
    renames: tuple[tuple[str, str], ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    swapped: tuple[str, ...] = ()
    detect: tuple[str, ...] = ()


def renamed(prefixes: dict[str, str], names: dict[str, str], suffix: str = "{p}") -> tuple[tuple[str, str], ...]:
    """The ``renames`` of every ``prefix + name + suffix``: each diffusers prefix (a template) with each diffusers
    name, to the original prefix and name, e.g. ``renamed({"blocks.{i}.attn1.": "blocks.{i}.self_attn."},
    {"to_q.": "q."})`` -> ``(("blocks.{i}.attn1.to_q.{p}", "blocks.{i}.self_attn.q.{p}"),)``."""
    return tuple((ours + name + suffix, theirs + original + suffix)
                 for ours, theirs in prefixes.items() for name, original in names.items())
