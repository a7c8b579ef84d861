"""The exporting machine's folders, cut out of everything an export writes (docs/export.md, "The
exported recipe.yaml"): an absolute path keeps its last part only, as ``(local path)/NAME``. Its
folders would tell whoever holds the export the exporter's user name and layout, and mean nothing
on another machine. Used for the exported recipe, a LoRA run's README.md and adapter_config.json
(the pretrained base's folder), a custom model's model_card.json (its ``module_dir``), the
privacy.json of a run a search selected (the search's folder) and the statement's lines in the
card (the public data's files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpclip.recipe.load import PATH_FIELDS

#: what replaces the folders of a path on the exporting machine (its last part is kept)
LOCAL_PATH = "(local path)/"


def local_name(value: Any) -> Any:
    """``value`` with an absolute path (or each of a list of them) cut to ``(local path)/NAME``;
    anything else as it is (a relative path, a hub name, None)."""
    if isinstance(value, list):
        return [local_name(v) for v in value]
    if isinstance(value, str) and value and Path(value).is_absolute():
        return LOCAL_PATH + Path(value).name
    return value


def _places(released: dict[str, Any]) -> list[tuple[Any, str]]:
    """(mapping, key) of each recipe field that may hold a path of the exporting machine."""
    return [(released, "output_dir")] + [(released.get(section), name) for section, name, _ in PATH_FIELDS] + \
        [(released.get(section), "name") for section in ("data", "public")
         if isinstance(released.get(section), dict) and released[section].get("source") == "hf"]


def without_local_paths(released: dict[str, Any]) -> dict[str, Any]:
    """``released`` (a recipe as a mapping, changed in place and returned) with each absolute path
    of the exporting machine (``output_dir``, data files, a local tokenizer or pretrained folder, a
    custom model's ``module_dir``) cut by :func:`local_name`."""
    for node, name in _places(released):
        if isinstance(node, dict) and name in node:
            node[name] = local_name(node[name])
    return released


def local_paths(recipe: dict[str, Any]) -> list[str]:
    """The absolute paths a recipe (as a mapping) holds at those places, longest first."""
    found: set[str] = set()
    for node, name in _places(recipe):
        value = node.get(name) if isinstance(node, dict) else None
        for one in value if isinstance(value, list) else [value]:
            if isinstance(one, str) and one and Path(one).is_absolute():
                found.add(one)
    return sorted(found, key=len, reverse=True)


def cut_in_text(value: Any, paths: list[str]) -> Any:
    """``value`` (strings, lists and mappings of them) with each of ``paths`` written inside a
    string cut by :func:`local_name`: the statement's lines name the public data's files."""
    if isinstance(value, dict):
        return {key: cut_in_text(item, paths) for key, item in value.items()}
    if isinstance(value, list):
        return [cut_in_text(item, paths) for item in value]
    if isinstance(value, str):
        for path in paths:
            value = value.replace(path, local_name(path))
    return value


def model_without_local_paths(model: dict[str, Any]) -> dict[str, Any]:
    """A recipe's model section (a mapping) as an export releases it: its ``pretrained`` folder or
    ``module_dir`` cut by :func:`local_name`."""
    return without_local_paths({"model": dict(model)})["model"]
