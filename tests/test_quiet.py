"""Third-party import noise (ditforge.quiet): importing torchao and bitsandbytes, directly as ``ditforge.optim`` and
``parallel.parallelize`` do or through diffusers, prints nothing once ditforge is imported; the filters drop only
those records, and every other record of the same loggers still shows."""

from __future__ import annotations

import enum
import logging
import subprocess
import sys

import pytest

import ditforge  # noqa: F401  (attaches the filters)
from ditforge.quiet import NOISE


def test_importing_torchao_and_bitsandbytes_prints_nothing():
    pytest.importorskip("torchao")
    pytest.importorskip("bitsandbytes")
    # a fresh process: in this one the libraries may be imported already, and import-time lines come once
    code = ("import ditforge, torchao.float8, torchao.optim, bitsandbytes.functional, "
            "diffusers.quantizers.torchao.torchao_quantizer")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr == "" and p.stdout == ""


def _record(name: str, msg: str, args=()) -> logging.LogRecord:
    return logging.getLogger(name).makeRecord(name, logging.WARNING, __file__, 0, msg, args, None)


def test_filters_drop_only_the_noise():
    TorchaoEnum = enum.Enum("TorchaoEnum", "A", module="torchao.quantization")
    OurEnum = enum.Enum("OurEnum", "A", module="ditforge.config")
    enum_msg = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
                "Calling register_constant() on Enum subclasses is deprecated and will be an error in a future "
                "release.")
    noise = [("torchao", "Failed to load /site-packages/torchao/_C_mxfp8.so: Could not load this library", ()),
             ("torch.utils._pytree", enum_msg, (TorchaoEnum,)),
             ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects. This "
              "may affect loading checkpoints serialized with `torchao`", ()),
             ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community: %s. "
              "Please make sure you already `pip install kernels`", ("No module named 'kernels'",))]
    assert sorted(name for name, _, _ in noise) == sorted(NOISE)
    for name, msg, args in noise:
        assert not logging.getLogger(name).filter(_record(name, msg, args)), name
        assert logging.getLogger(name).filter(_record(name, "something else", ())), name
    assert logging.getLogger("torch.utils._pytree").filter(_record("torch.utils._pytree", enum_msg, (OurEnum,)))
    assert logging.getLogger("torchao.float8").filter(_record("torchao.float8", noise[0][1]))  # another logger
