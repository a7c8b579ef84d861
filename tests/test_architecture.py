"""The package's shape, checked: the layer order, no import cycles, module length; no
function that takes the whole trainer, no private name imported across modules, no run
directory file name spelled outside dpclip/layout.py, torch's private API only in
dpclip/torch_compat.py, and the run's parts typed and built by keyword.

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
    ("dpclip.rundir",),
    ("dpclip.planning",),
    ("dpclip.recipe",),
    ("dpclip.distributed",),
    ("dpclip.data", "dpclip.models", "dpclip.engine", "dpclip.diagnose"),
    ("dpclip.accounting",),
    ("dpclip", "dpclip.errors", "dpclip.rng", "dpclip.allocator", "dpclip.threads", "dpclip.files",
     "dpclip.release", "dpclip.layout", "dpclip.interrupt", "dpclip.torch_compat"),
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
    "dpclip.rundir": {"typer": "no CLI below the CLI", "rich": "no console below the CLI"},
    "dpclip.planning": {"typer": "no CLI below the CLI", "rich": "no console below the CLI"},
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
                                                "on first use (the package's __getattr__) so that `import dpclip` "
                                                "imports no torch",
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


# --- the run as explicit data (issue 27) -----------------------------------------------------

# The only modules that may spell a run directory's file names: the layout, and the release
# manifest's glob patterns and field tables (the dpclip.release package).
LAYOUT_MODULES = {"dpclip.layout", "dpclip.release"}
RUN_DIR_FILES = ("ledger.json", "metrics.jsonl", "meta.json", "summary.json", "plan.json", "state.json",
                 "state.safetensors", "model.safetensors", "model.json", "recipe.yaml", "search.json", "report.html",
                 "diagnostics.jsonl", "canaries.json", "LATEST", "training.png", "thresholds.png",
                 "hessian_over_training.png", "improvement_vs_batch.png", "roc.png", "report.json")


def trainer_parameters(tree: ast.AST) -> list[str]:
    """Functions with a parameter named ``trainer`` or annotated ``Trainer``: the loop's
    collaborators take the data they need (docs/design.md, "train/"), never the whole run."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args
            for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                        *filter(None, [arguments.vararg, arguments.kwarg])]:
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg.lower() == "trainer" or "Trainer" in annotation:
                    found.append(f"{getattr(node, 'name', 'lambda')}({arg.arg}) line {node.lineno}")
    return found


def underscore_imports(tree: ast.AST) -> list[str]:
    """``from dpclip.x import _y``: a private name taken from another module (a relative
    import counts too; ``import m as _m`` does not, the name imported is public)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "dpclip"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{alias.name} from {'.' * node.level}{node.module or ''} line {node.lineno}")
    return found


def run_dir_literals(tree: ast.AST) -> list[str]:
    """String literals that are a run directory file name, or a path ending in one (prose
    that mentions a file, with spaces, is not a literal name)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and not any(c.isspace() for c in node.value):
            if any(node.value == name or node.value.endswith("/" + name) for name in RUN_DIR_FILES):
                found.append(f"{node.value!r} line {node.lineno}")
    return found


def _violations(rule, skip=()) -> list[str]:
    """``rule``'s hits in every module but those in ``skip`` (a package there skips its modules)."""
    out = []
    for module, path in MODULES.items():
        if not any(module == unit or module.startswith(unit + ".") for unit in skip):
            out += [f"{module}: {hit}" for hit in rule(ast.parse(path.read_text(encoding="utf-8")))]
    return out


def test_no_function_takes_the_whole_trainer():
    bad = _violations(trainer_parameters)
    assert not bad, "pass the parts, the state or a small strategy object instead:\n" + "\n".join(bad)


def test_no_private_name_is_imported_from_another_module():
    bad = _violations(underscore_imports)
    assert not bad, "make the name public (and its module's API), or keep its use inside its module:\n" + \
        "\n".join(bad)


def test_run_directory_file_names_are_spelled_only_in_the_layout():
    bad = _violations(run_dir_literals, skip=LAYOUT_MODULES)
    assert not bad, "use dpclip.layout's constant for these names:\n" + "\n".join(bad)


def test_the_layout_module_spells_every_name_the_rule_refuses():
    import dpclip.layout as layout

    spelled = {value for value in vars(layout).values() if isinstance(value, str)}
    assert set(RUN_DIR_FILES) <= spelled, set(RUN_DIR_FILES) - spelled


@pytest.mark.parametrize("rule, bad, good", [
    (trainer_parameters, "def f(trainer):\n    return trainer.step\n", "def f(parts, state):\n    pass\n"),
    (trainer_parameters, "def f(run: 'Trainer'):\n    pass\n", "def f(run: 'RunParts'):\n    pass\n"),
    (trainer_parameters, "class C:\n    def m(self, *, trainer=None):\n        pass\n", "def f(train):\n    pass\n"),
    (underscore_imports, "from dpclip.rundir.run import _meta\n", "from dpclip.rundir.run import meta_record\n"),
    (underscore_imports, "from .plots import _pyplot\n", "from dpclip.engine.layers import linear as _linear\n"),
    (run_dir_literals, "path = run / 'ledger.json'\n", "LEDGER = layout.LEDGER\n"),
    (run_dir_literals, "p = 'checkpoints/LATEST'\n", "raise E('no ledger.json in the run')\n"),
])
def test_each_new_rule_reports_a_bad_snippet_and_passes_a_good_one(rule, bad, good):
    assert rule(ast.parse(bad)), f"{rule.__name__} missed: {bad!r}"
    assert not rule(ast.parse(good)), f"{rule.__name__} reported: {good!r}"


# --- the checker itself must be able to fail -------------------------------------------------

def test_cycle_finder_reports_a_circle_and_nothing_else():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_layer_of_prefers_the_most_specific_unit():
    assert _layer_of("dpclip.cli.train") == 0
    assert _layer_of("dpclip.errors") == len(LAYERS) - 1
    assert _layer_of("dpclip.engine.engine") == _layer_of("dpclip.data.sampler")
    assert _layer_of("dpclip.accounting.ledger") > _layer_of("dpclip.engine.engine")


# --- torch's private API in one module (issue 53) --------------------------------------------

# The one module that may use torch's private names (each wrapped and documented there).
TORCH_COMPAT = "dpclip.torch_compat"
# torch's private attributes of objects that are not reached through a torch module name: a
# Module's own dicts, a tensor's view and version bookkeeping, the layer attributes dpclip reads.
TORCH_PRIVATE_ATTRIBUTES = ("_parameters", "_buffers", "_modules", "_is_view", "_version", "_qkv_same_embed_dim",
                            "_reversed_padding_repeated_twice")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def private_torch_uses(tree: ast.AST) -> list[str]:
    """torch's private API: an import path under torch with a component starting with "_"
    (``import torch._dynamo``, ``from torch.utils._pytree import ...``, ``from torch.x import
    _name``), an attribute path through such a component from torch or a name imported from it
    (``torch._C``, ``nn.modules.batchnorm._BatchNorm``, ``F._canonical_mask``), or one of
    :data:`TORCH_PRIVATE_ATTRIBUTES` on any object (``module._parameters``, ``t._version``).
    Dunder names (``torch.__version__``) are public; a class without bases may keep an attribute
    of such a name on ``self`` (its own, not a Module's)."""
    roots = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.asname for a in node.names if a.asname and a.name.split(".")[0] == "torch")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            roots.update(a.asname or a.name for a in node.names)
    found: list[str] = []

    def path(node: ast.AST) -> list[str] | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None

    def visit(node: ast.AST, own_class: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(f"import {a.name} line {node.lineno}" for a in node.names
                         if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split("."))))
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            found.extend(f"from {node.module} import {a.name} line {node.lineno}" for a in node.names
                         if any(map(_private, [*node.module.split("."), a.name])))
        elif isinstance(node, ast.Attribute):
            parts = path(node)
            if parts is not None and parts[0] in roots:
                if any(map(_private, parts[1:])):
                    found.append(f"{'.'.join(parts)} line {node.lineno}")
                return   # the outermost attribute of the path has judged it whole
            if node.attr in TORCH_PRIVATE_ATTRIBUTES and not (
                    own_class and isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(f"{ast.unparse(node)} line {node.lineno}")
        elif isinstance(node, ast.ClassDef):
            own_class = all(isinstance(b, ast.Name) and b.id == "object" for b in node.bases)
        for child in ast.iter_child_nodes(node):
            visit(child, own_class)

    visit(tree, False)
    return found


def test_torch_private_api_is_used_only_through_the_compat_module():
    bad = _violations(private_torch_uses, skip={TORCH_COMPAT})
    assert not bad, ("wrap it in dpclip/torch_compat.py (what it is, why the public API does not do, the torch "
                     "version checked) and use that:\n" + "\n".join(bad))


def test_the_compat_module_is_where_the_private_api_is():
    assert private_torch_uses(ast.parse(MODULES[TORCH_COMPAT].read_text(encoding="utf-8")))


@pytest.mark.parametrize("bad, good", [
    ("from torch.utils._pytree import tree_flatten\n", "from dpclip.torch_compat import tree_flatten\n"),
    ("import torch._dynamo\n", "import torch.distributed\n"),
    ("from torch.distributed.tensor import _redistribute\n", "from torch.distributed.tensor import DTensor\n"),
    ("import torch\nwith torch._C.DisableTorchFunctionSubclass():\n    pass\n",
     "import torch\nwith torch.DisableTorchFunctionSubclass():\n    pass\n"),
    ("from torch import nn\nok = isinstance(m, nn.modules.batchnorm._BatchNorm)\n",
     "from torch import nn\nok = isinstance(m, nn.BatchNorm2d)\n"),
    ("import torch.nn.functional as F\nF._canonical_mask(mask=m)\n", "import torch\nv = torch.__version__\n"),
    ("p = module._parameters\n", "p = own_parameters(module)\n"),
    ("def f(t):\n    return t._version\n", "class Noise:\n    def f(self):\n        return self._buffers\n"),
    ("class M(nn.Module):\n    def f(self):\n        return self._buffers\n", "x = obj._private_of_ours\n"),
])
def test_the_private_torch_rule_reports_a_bad_snippet_and_passes_a_good_one(bad, good):
    assert private_torch_uses(ast.parse(bad)), f"missed: {bad!r}"
    assert not private_torch_uses(ast.parse(good)), f"reported: {good!r}"


def test_the_run_parts_are_typed_and_built_by_keyword():
    """issue 53: no ``Any`` in the run's parts, and no part built positionally (the order of
    21 positional fields was what a seeded run depended on)."""
    import dataclasses
    import typing

    from dpclip.train import run_parts

    source = (PACKAGE / "train" / "run_parts.py").read_text(encoding="utf-8")
    assert not any(isinstance(node, ast.Name) and node.id == "Any" for node in ast.walk(ast.parse(source)))
    for part in (run_parts.RunSetting, run_parts.Learner, run_parts.Feed, run_parts.RunParts):
        hints = typing.get_type_hints(part)
        assert all(field.kw_only for field in dataclasses.fields(part)), part.__name__
        assert set(hints) >= {field.name for field in dataclasses.fields(part)}


MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80


def _oversized(kinds: tuple[type, ...], limit: int) -> list[str]:
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, kinds) and node.end_lineno - node.lineno + 1 > limit:
                found.append(f"{module}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    return found


def test_no_class_is_over_300_lines_and_no_function_over_80():
    """issue 53: a class a newcomer can read whole; a longer one is split along a seam
    (composition), a longer function into named steps."""
    classes = _oversized((ast.ClassDef,), MAX_CLASS_LINES)
    functions = _oversized((ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES)
    assert not classes and not functions, f"too long: {classes + functions}"
