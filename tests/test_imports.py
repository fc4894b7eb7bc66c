"""One-way imports, read from the source (ast), so that a lazy import inside a function counts too.

- A reference (``specdec_kernels/reference/``) imports torch, einops, the standard library and the
  modules the fast paths share with it (types, noise, input checks), never a fast path: the
  oracle cannot share a bug with what it judges.
- Those shared modules import nothing else of the package either (so the rule holds transitively).
- The kernels (repo folder ``kernels/``, installed as ``specdec_kernels.kernels``) import no public
  op module: only private helpers (``specdec_kernels._*``) and each other.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: Modules of the package that a reference may import (each imports torch and these only).
SHARED = {"specdec_kernels._types", "specdec_kernels._checks", "specdec_kernels._noise",
          "specdec_kernels._sampling_checks"}


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in the file, relative ones resolved
    against ``package``; ``from X import name`` counts as importing ``X`` and ``X.name``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def third_party_or_stdlib(name: str, allowed: set[str]) -> bool:
    top = name.split(".")[0]
    return top == "__future__" or top in sys.stdlib_module_names or top in allowed


def violations(folder: str, package: str, allowed: Callable[[str], bool]) -> list[str]:
    """``file:line imports name`` for every import of the folder's files (modules of ``package``)
    that ``allowed`` refuses."""
    bad = []
    for path in sorted((REPO / folder).glob("*.py")):
        for line, name in imported_modules(path, package):
            if not allowed(name):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    return bad


def shared(name: str) -> bool:
    """A shared module, or a name imported from one (``specdec_kernels._types.RejectionNoise``)."""
    return name in SHARED or name.rsplit(".", 1)[0] in SHARED


def reference_may_import(name: str) -> bool:
    return (third_party_or_stdlib(name, {"torch", "einops"}) or name.startswith("specdec_kernels.reference")
            or shared(name))


def kernels_may_import(name: str) -> bool:
    if third_party_or_stdlib(name, {"torch", "triton"}):
        return True
    if name.startswith("specdec_kernels.kernels"):
        return True
    parts = name.split(".")
    return parts[0] == "specdec_kernels" and len(parts) > 1 and parts[1].startswith("_")


def test_references_import_no_fast_path():
    assert violations("specdec_kernels/reference", "specdec_kernels.reference", reference_may_import) == []


def test_shared_modules_import_only_torch_and_each_other():
    bad = []
    for module in sorted(SHARED):
        path = REPO / Path(*module.split(".")).with_suffix(".py")
        for line, name in imported_modules(path, "specdec_kernels"):
            if not (third_party_or_stdlib(name, {"torch"}) or shared(name)):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert bad == []


def test_kernels_import_no_public_op_module():
    assert violations("kernels", "specdec_kernels.kernels", kernels_may_import) == []


@pytest.mark.parametrize("source,folder,rule", [
    ("from ..sampling import RejectionNoise\n", "specdec_kernels/reference", reference_may_import),
    ("def f():\n    from specdec_kernels.attention import check\n", "specdec_kernels/reference", reference_may_import),
    ("import specdec_kernels._sampling_torch\n", "specdec_kernels/reference", reference_may_import),
    ("from specdec_kernels.sampling import RejectionOutput\n", "kernels", kernels_may_import),
    ("from specdec_kernels import sampling\n", "kernels", kernels_may_import),
], ids=["reference-relative", "reference-lazy", "reference-torch-path", "kernels-public-op", "kernels-package"])
def test_the_rules_catch_forbidden_imports(tmp_path, monkeypatch, source, folder, rule):
    """Each rule refuses what it is meant to (the imports these modules had before the split)."""
    package = "specdec_kernels.reference" if folder.startswith("specdec_kernels") else "specdec_kernels.kernels"
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert [name for _, name in imported_modules(path, package) if not rule(name)]
