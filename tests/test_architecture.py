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


# A foreign family's name, as a word (case-sensitive): its model, pipeline and VAE class names, its short names, and
# the config keys only one family has. "Wan" stands alone or before a capital or digit (WanPipeline, Wan2.1), not Wang.
FAMILY_NAMES = (r"\bWan\b|\bWan[A-Z0-9]\w*|\bwan_\w*|\bCogVideoX\w*|\bcogvideox\w*|\bHunyuan\w*|\bhunyuan\w*|\bLTX\w*"
                r"|\bltx\w*|\bPixArt\w*|\bpixart\w*|\bSD3\w*|\bsd3\w*|\bSDXL\w*|\bsdxl\w*|\bAutoencoderKL[A-Z]\w*"
                r"|\bVACE\w*|\bvace\b|\bimage_condition_type\b|\bboundary_ratio\b")


def test_no_foreign_family_is_named_outside_its_adapter():
    """Shared code reads the adapters' declarations (``models.adapters.DiffusersDenoiser``'s class attributes):
    no file of ``ditforge/`` outside ``models/adapters/`` names a foreign family (``FAMILY_NAMES``), in code,
    docstrings, comments or help alike; the sources of its formulas cite the paper or say "the family's pipeline",
    and a sentence that must name a family's diffusers file lives in that family's adapter."""
    import re

    package = Path(__file__).resolve().parents[1] / "ditforge"
    pattern = re.compile(FAMILY_NAMES)
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.is_relative_to(package / "models" / "adapters"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if (match := pattern.search(line)) is not None:
                found.append(f"{path.relative_to(package.parent)}:{number}: {match.group(0)}")
    assert not found, f"{len(found)} lines name a foreign family:\n" + "\n".join(found)
