"""The multi-process tests' launcher (``dist_helpers.spawn``): its processes start with ``PRELOAD`` imported. Python
3.11's forkserver skips a preload module it cannot import without a word, and every launch would then import torch,
ditforge and diffusers again (about 15 s of CPU a process on the 2-core CI machine)."""

from __future__ import annotations

import sys

from dist_helpers import PRELOAD, spawn


def _check(rank: int) -> None:
    missing = [name for name in PRELOAD if name not in sys.modules]
    assert not missing, f"process {rank} started without {missing}"


def test_preload_reaches_the_processes():
    spawn(_check, nprocs=2)
