"""The layering of DESIGN.md and the absence of import circles, checked by import-linter against the contracts in
pyproject.toml ([tool.importlinter]): a module imports only from the layers below its own, and no two modules of a
package import each other, directly or through others (function-level imports count too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filenames=('pyproject.toml',), no_cache=True, no_logo=True))")


def test_import_contracts_are_kept():
    pytest.importorskip("importlinter")
    # a process of its own: import-linter reconfigures logging, which would silence the loggers of later tests
    run = subprocess.run([sys.executable, "-c", LINT], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
