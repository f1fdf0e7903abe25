"""Third-party lines that importing torchao or bitsandbytes prints (directly, or through diffusers and peft, which
import both when installed), silenced at the loggers that emit them. None of them concerns ditforge:

- torchao logs "Failed to load <path>.so: ..." for each optional compiled extension it cannot load here (logger
  ``torchao``, ``torchao/__init__.py``);
- importing torchao registers its Enums as pytree constants, which torch logs as deprecated (logger
  ``torch.utils._pytree``: "<enum ...> is an Enum subclass ... Calling register_constant() on Enum subclasses is
  deprecated");
- diffusers' torchao quantizer logs "Unable to import `torchao` Tensor objects" when torchao's tensor classes have
  moved (logger ``diffusers.quantizers.torchao.torchao_quantizer``; ditforge loads no checkpoint serialized with
  torchao);
- bitsandbytes logs "Failed to load CPU gemm_4bit_forward from kernels-community" on CPUs with AVX-512 bf16
  where the optional ``kernels`` package is missing (logger ``bitsandbytes.backends.cpu.ops``; ditforge runs no
  4-bit GEMM).

They are log records, not ``warnings``: each is dropped by a filter on the logger that emits it, matched on its
message (and, for torch's, on the Enum coming from torchao), so that every other record of those loggers, and
every warning of ours, still shows. The filters are attached when ``ditforge`` is imported, before any of these
libraries can be.
"""

from __future__ import annotations

import logging
from collections.abc import Callable


def _torchao_extension(record: logging.LogRecord) -> bool:
    return str(record.msg).startswith("Failed to load ") and ".so" in str(record.msg)


def _torchao_enum_constant(record: logging.LogRecord) -> bool:
    args = record.args if isinstance(record.args, tuple) else ()
    return "register_constant() on Enum subclasses is deprecated" in str(record.msg) and len(args) == 1 \
        and getattr(args[0], "__module__", "").startswith("torchao")


def _torchao_tensor_objects(record: logging.LogRecord) -> bool:
    return str(record.msg).startswith("Unable to import `torchao` Tensor objects")


def _bitsandbytes_cpu_gemm(record: logging.LogRecord) -> bool:
    return str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


NOISE: dict[str, Callable[[logging.LogRecord], bool]] = {
    "torchao": _torchao_extension,
    "torch.utils._pytree": _torchao_enum_constant,
    "diffusers.quantizers.torchao.torchao_quantizer": _torchao_tensor_objects,
    "bitsandbytes.backends.cpu.ops": _bitsandbytes_cpu_gemm,
}


class _Drop(logging.Filter):
    """Drops the records ``noise(record)`` is true of."""

    def __init__(self, noise: Callable[[logging.LogRecord], bool]):
        super().__init__()
        self.noise = noise

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.noise(record)


_FILTERS = {name: _Drop(noise) for name, noise in NOISE.items()}


def silence_import_noise() -> None:
    """Attach the filters to the loggers of ``NOISE`` (again: no effect). Loggers are created on first use, so
    this may run before the libraries are imported."""
    for name, drop in _FILTERS.items():
        logging.getLogger(name).addFilter(drop)
