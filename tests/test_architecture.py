"""The layering of DESIGN.md and the absence of import circles, checked by import-linter against the contracts in
pyproject.toml ([tool.importlinter]): a module imports only from the layers below its own, and no two modules of a
package import each other, directly or through others (function-level imports count too)."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_import_contracts_are_kept(capsys, monkeypatch):
    cli = pytest.importorskip("importlinter.cli")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    status = cli.lint_imports(config_filenames=("pyproject.toml",), no_cache=True, no_logo=True)
    assert status == 0, capsys.readouterr().out
