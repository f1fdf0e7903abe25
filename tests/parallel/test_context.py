"""The adapters' context-parallel declarations, as ``parallel.context.split_tokens`` reads them: every registered
family's ``cp_plan`` and ``cp_text`` agree, and a pair that does not is a TypeError naming the adapter."""

from __future__ import annotations

import pytest

from ditforge.models.adapters import DiffusersDenoiser, families
from ditforge.parallel.context import _text_kind


@pytest.mark.parametrize("family", sorted(families()))
def test_every_family_declares_a_plan_split_tokens_knows(family):
    cls = families()[family]
    kind = _text_kind(cls)
    assert (kind is None) == (cls.cp_plan is None)
    if cls.cp_plan is not None:  # ditforge's plan: a dict of diffusers' ContextParallelInput / Output
        assert isinstance(cls.cp_plan(), dict) and "proj_out" in cls.cp_plan()


def test_a_plan_without_its_text_kind_is_refused():
    class Planned(DiffusersDenoiser):
        cp_plan = staticmethod(dict)

    class Unknown(DiffusersDenoiser):
        cp_plan = staticmethod(dict)
        cp_text = "sideways"

    for cls in (Planned, Unknown):
        with pytest.raises(TypeError, match=cls.__name__):
            _text_kind(cls)
