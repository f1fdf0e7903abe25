"""The layering of DESIGN.md and the absence of import circles, checked by import-linter against the contracts in
pyproject.toml ([tool.importlinter]): a module imports only from the layers below its own, and no two modules of a
package import each other, directly or through others (function-level imports count too); and no function longer
than the house rule."""

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


MAX_FUNCTION_LINES = 120  # the house rule (issue 47): a longer function is cut at its phases


def test_no_function_is_longer_than_the_rule():
    """Every function and method of the package, decorators and docstring included, spans at most
    ``MAX_FUNCTION_LINES`` lines (its AST's first to last line)."""
    import ast

    package = Path(__file__).resolve().parents[1] / "ditforge"
    long = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - first + 1 > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name} "
                                f"({node.end_lineno - first + 1} lines)")
    assert not long, long
