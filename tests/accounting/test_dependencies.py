"""README.md, Layout: accounting never imports torch (nor anything outside its small world)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import dpclip.accounting

PACKAGE_DIR = Path(dpclip.accounting.__file__).parent
ALLOWED_ROOTS = {"dp_accounting", "attr", "numpy", "scipy", "dpclip"}
ALLOWED_DPCLIP = ("dpclip.errors", "dpclip.accounting")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_accounting_modules_import_only_stdlib_dp_accounting_and_dpclip_errors():
    modules = sorted(PACKAGE_DIR.glob("*.py"))
    assert len(modules) >= 8
    for module in modules:
        for name in _imports(module):
            root = name.split(".")[0]
            assert root in ALLOWED_ROOTS or root in sys.stdlib_module_names, (module.name, name)
            assert "torch" not in name
            if root == "dpclip":
                assert name.startswith(ALLOWED_DPCLIP), (module.name, name)
