"""The exporting machine's folders, cut out of everything an export writes (docs/export.md, "The
exported recipe.yaml"): an absolute path keeps its last part only, as ``(local path)/NAME``. Its
folders would tell whoever holds the export the exporter's user name and layout, and mean nothing
on another machine. Used for the exported recipe, a LoRA run's README.md and adapter_config.json
(the pretrained base's folder), a custom model's model_card.json (its ``module_dir``) and the
privacy.json of a run a search selected (the search's folder)."""

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


def without_local_paths(released: dict[str, Any]) -> dict[str, Any]:
    """``released`` (a recipe as a mapping, changed in place and returned) with each absolute path
    of the exporting machine (``output_dir``, data files, a local tokenizer or pretrained folder, a
    custom model's ``module_dir``) cut by :func:`local_name`."""
    places = [(released, "output_dir")] + [(released.get(section), name) for section, name, _ in PATH_FIELDS] + \
        [(released.get(section), "name") for section in ("data", "public")
         if isinstance(released.get(section), dict) and released[section].get("source") == "hf"]
    for node, name in places:
        if isinstance(node, dict) and name in node:
            node[name] = local_name(node[name])
    return released


def model_without_local_paths(model: dict[str, Any]) -> dict[str, Any]:
    """A recipe's model section (a mapping) as an export releases it: its ``pretrained`` folder or
    ``module_dir`` cut by :func:`local_name`."""
    return without_local_paths({"model": dict(model)})["model"]
