"""The package's shape, checked: the layer order, no import cycles, module length.

The layers (docs/design.md), top to bottom. A module may import from its own layer and
the layers below it, never from a layer above; and no set of modules may import each
other in a circle, whether the import sits at the top of a module or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dpclip"

# Top to bottom. dpclip.recipe sits above the engine because a threshold policy's recipe
# spec lives in the policy's own file (dpclip/engine/policies/).
LAYERS = [
    ("dpclip.__main__", "dpclip.cli"),
    ("dpclip.audit", "dpclip.tuning", "dpclip.bench", "dpclip.export"),
    ("dpclip.train", "dpclip.integrations"),
    ("dpclip.recipe",),
    ("dpclip.distributed",),
    ("dpclip.data", "dpclip.models", "dpclip.engine", "dpclip.diagnose"),
    ("dpclip.accounting",),
    ("dpclip", "dpclip.errors", "dpclip.rng", "dpclip.allocator", "dpclip.threads", "dpclip.files",
     "dpclip.release"),
]

# Third-party packages a layer must never import, and why.
FORBIDDEN = {
    "dpclip.accounting": {"torch": "accounting is pure Python over dp_accounting (no torch)"},
    "dpclip.engine": {"yaml": "the engine takes dicts, never YAML", "typer": "no CLI in the engine",
                      "rich": "no console in the engine"},
    "dpclip.diagnose": {"yaml": "the diagnostics take tensors, never YAML", "typer": "no CLI below the CLI",
                        "rich": "no console below the CLI"},
    "dpclip.data": {"typer": "no CLI below the CLI", "rich": "no console below the CLI"},
    "dpclip.models": {"typer": "no CLI below the CLI", "rich": "no console below the CLI"},
    "dpclip.train": {"typer": "no CLI below the CLI"},
    "dpclip.distributed": {"typer": "no CLI below the CLI", "rich": "no console below the CLI"},
    "dpclip.tuning": {"typer": "no CLI below the CLI"},
    "dpclip.audit": {"typer": "no CLI below the CLI"},
    "dpclip.export": {"typer": "no CLI below the CLI"},
}

MAX_LINES = 400
LENGTH_REASON = "Length:"  # a module over MAX_LINES says why in its docstring, on a line starting so


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports (dpclip modules resolved to files, others by top name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in MODULES else module)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer_of(module: str) -> int | None:
    best, index = None, None
    for i, names in enumerate(LAYERS):
        for unit in names:
            if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best)):
                best, index = unit, i
    return index


def _unit(module: str) -> str:
    best = ""
    for names in LAYERS:
        for unit in names:
            if (module == unit or module.startswith(unit + ".")) and len(unit) > len(best):
                best = unit
    return best


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if _layer_of(m) is None]
    assert not missing, f"add these modules' packages to LAYERS (and docs/design.md): {missing}"


# Downward-pointing imports allowed by name, each with its reason.
LAZY_ENTRY_POINTS = {
    ("dpclip", "dpclip.integrations.private"): "dpclip.make_private, where Opacus users look for it; imported "
                                                "inside the function so that `import dpclip` imports no torch",
}


def test_no_import_points_up_the_layers():
    upward = []
    for module, imported in GRAPH.items():
        here = _layer_of(module)
        for target in imported:
            if (module, target) in LAZY_ENTRY_POINTS:
                continue
            if target.startswith("dpclip") and target in MODULES:
                there = _layer_of(target)
                if there is not None and here is not None and there < here:
                    upward.append(f"{module} -> {target}")
    assert not upward, "imports that run up the layers:\n" + "\n".join(sorted(upward))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _without_package_reexports(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Drop the edges from a package's ``__init__`` to its own submodules: an ``__init__``
    re-exporting its submodules is the package's public face, not a dependency between
    modules. A submodule importing its own package's ``__init__`` is still an edge (and
    closes a circle through the re-export, so it is reported)."""
    out = {}
    for module, targets in graph.items():
        is_package = MODULES[module].name == "__init__.py"
        out[module] = {t for t in targets if not (is_package and t.startswith(module + "."))}
    return out


def test_no_import_cycles_between_modules():
    graph = _without_package_reexports(GRAPH)
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_import_cycles_between_packages():
    units: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        here = _unit(module)
        units.setdefault(here, set())
        units[here].update(_unit(t) for t in targets if t in MODULES and _unit(t) != here)
    cycles = _cycles(units)
    assert not cycles, "packages that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("unit", sorted(FORBIDDEN))
def test_layer_does_not_import_what_it_must_not(unit):
    bad = []
    for module, imported in GRAPH.items():
        if module == unit or module.startswith(unit + "."):
            for target in imported:
                top = target.split(".")[0]
                if top in FORBIDDEN[unit]:
                    bad.append(f"{module} imports {target}: {FORBIDDEN[unit][top]}")
    assert not bad, "\n".join(bad)


def test_long_modules_say_why():
    unexplained = []
    for module, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n") + 1
        if lines > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if not any(line.strip().startswith(LENGTH_REASON) for line in doc.splitlines()):
                unexplained.append(f"{module} ({lines} lines)")
    assert not unexplained, (f"modules over {MAX_LINES} lines without a '{LENGTH_REASON} ...' line in their "
                             "docstring saying why: " + ", ".join(unexplained))


# --- the checker itself must be able to fail -------------------------------------------------

def test_cycle_finder_reports_a_circle_and_nothing_else():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_layer_of_prefers_the_most_specific_unit():
    assert _layer_of("dpclip.cli.train") == 0
    assert _layer_of("dpclip.errors") == len(LAYERS) - 1
    assert _layer_of("dpclip.engine.engine") == _layer_of("dpclip.data.sampler")
    assert _layer_of("dpclip.accounting.ledger") > _layer_of("dpclip.engine.engine")
