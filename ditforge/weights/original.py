"""A diffusers model's weights, and its LoRA, in the layout of the original release it was converted from (the names
and fused tensors of the family's own code, which ComfyUI reads too), read off the adapter's declarations
(``DiffusersDenoiser.original_layouts``, ``models.adapters.layouts.OriginalLayout``; a single file's layout is
recognised by ``layouts.find_layout``). diffusers converts the other way (``loaders/single_file_utils.py``), and
reads what ``to_original`` writes (``from_single_file``), which the tests check; a layout diffusers has no converter
of is read by ``layouts.from_original``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ditforge.models.adapters import families
from ditforge.models.adapters.layouts import OriginalLayout, declared, match, swap_halves, swapped


def original_name(name: str, layout: OriginalLayout) -> tuple[str, int, tuple[str, ...]]:
    """Where diffusers parameter ``name`` goes in ``layout``: ``(original name, its index among the parts of a
    fused tensor, the diffusers names of all the parts)``; a tensor of its own is part 0 of ``(name,)``."""
    for original, parts in layout.fused:
        for index, part in enumerate(parts):
            fields = match(part, name)
            if fields is not None:
                return original.format(**fields), index, tuple(p.format(**fields) for p in parts)
    for ours, theirs in layout.renames:
        fields = match(ours, name)
        if fields is not None:
            try:
                return theirs.format(**fields), 0, (name,)
            except KeyError as e:  # an original index the diffusers name drops: the layout is read only
                raise TypeError(f"{layout.name}: {theirs} needs {e}, which {name} does not give (a layout ditforge "
                                "reads, never writes)") from None
    return name, 0, (name,)


def to_original(state: Mapping[str, torch.Tensor], layout: OriginalLayout) -> dict[str, torch.Tensor]:
    """A diffusers model's ``state`` (name -> tensor, any dtype and shape) in ``layout``: renamed, the fused
    tensors concatenated along dim 0 in the layout's order, the swapped halves swapped, each name under the
    layout's ``prefix``. Tensors are shared with ``state`` where only the name changes.

    Raises:
        TypeError: a fused tensor whose parts are not all in ``state``, or two names that map to one original
            name (the layout's declaration is wrong, or ``state`` is no model of its class); a layout ditforge only
            reads (an original name needs an index the diffusers name drops, ``original_name``).
    """
    out: dict[str, torch.Tensor] = {}
    for name in state:
        original, index, parts = original_name(name, layout)
        if index:
            continue  # written with its part 0
        if original in out:
            raise TypeError(f"{layout.name}: {name} and another parameter both map to {original}")
        missing = [p for p in parts if p not in state]
        if missing:
            raise TypeError(f"{layout.name}: {original} fuses {', '.join(parts)}; {', '.join(missing)} missing")
        tensor = state[name] if len(parts) == 1 else torch.cat([state[p] for p in parts], dim=0)
        out[original] = swap_halves(tensor) if swapped(original, layout) else tensor
    return {layout.prefix + k: v for k, v in out.items()} if layout.prefix else out


def lora_to_original(lora: Mapping[str, torch.Tensor], layout: OriginalLayout, alpha: float,
                     rows: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """A peft LoRA (``lora``: ``<diffusers module>.lora_A.weight`` (r, in) and ``.lora_B.weight`` (out, r), any
    float dtype, scale ``alpha / r``) in ``layout``'s names, as ComfyUI's and diffusers' non-diffusers LoRA loaders
    read it: ``<original module>.lora_A.weight``, ``.lora_B.weight`` and ``.alpha`` (a 0-d float32 tensor).

    A module of its own keeps its A and B (B's halves swapped where the layout swaps the weight's), and alpha. A
    fused original weight W = cat(W_1, ..., W_n) gets the exact block form of its parts' updates: A = cat(A_i) over
    its k adapted parts (k r x in), B (out x k r) block-diagonal, B_i in the rows of part i and the columns of A_i,
    zero rows for a part without an adapter; so B A = cat(B_i A_i), zero for the others. Its alpha is k alpha,
    which keeps ComfyUI's scale alpha / rank (rank k r) equal to peft's alpha / r.

    Args:
        rows: the diffusers parameter name (``<module>.weight``) -> its rows (out features), read for the parts of
            a fused weight that have no adapter.

    Raises:
        TypeError: A and B of one module not both in ``lora``, or parts of one fused weight with different input
            widths or ranks.
    """
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in lora if ".lora_" in k})
    # original module -> (the diffusers weights it fuses, the adapted module of each or None)
    groups: dict[str, tuple[tuple[str, ...], list[str | None]]] = {}
    for module in modules:
        if f"{module}.lora_A.weight" not in lora or f"{module}.lora_B.weight" not in lora:
            raise TypeError(f"LoRA of {module}: lora_A.weight and lora_B.weight expected")
        original, index, parts = original_name(f"{module}.weight", layout)
        groups.setdefault(original.removesuffix(".weight"), (parts, [None] * len(parts)))[1][index] = module
    out: dict[str, torch.Tensor] = {}
    for original, (parts, adapted) in groups.items():
        a = [lora[f"{m}.lora_A.weight"] for m in adapted if m]
        if len({t.shape for t in a}) > 1:
            raise TypeError(f"LoRA of {original}: its parts' lora_A differ in shape ({[tuple(t.shape) for t in a]})")
        rank = a[0].shape[0]
        b = torch.zeros(sum(rows[p] if m is None else lora[f"{m}.lora_B.weight"].shape[0]
                            for p, m in zip(parts, adapted)), rank * len(a), dtype=a[0].dtype)
        row = col = 0
        for part, module in zip(parts, adapted):
            if module is None:
                row += rows[part]
                continue
            block = lora[f"{module}.lora_B.weight"]
            b[row:row + block.shape[0], col:col + rank] = block
            row, col = row + block.shape[0], col + rank
        if swapped(f"{original}.weight", layout):
            b = swap_halves(b)
        out[f"{original}.lora_A.weight"] = torch.cat(a, dim=0)
        out[f"{original}.lora_B.weight"] = b
        out[f"{original}.alpha"] = torch.tensor(float(alpha) * len(a), dtype=torch.float32)
    return out


def known_layouts(component: str) -> dict[str, OriginalLayout]:
    """The original layouts the adapters declare for ``component`` (``transformer``, ``vae``, ``text_encoder``),
    each once, in the registry's order of the families and each family's own order (``layouts.declared``): the
    layout's name -> the layout."""
    out: dict[str, OriginalLayout] = {}
    for cls in families().values():
        for layout in declared(cls.original_layouts, component):
            out.setdefault(layout.name, layout)
    return out
