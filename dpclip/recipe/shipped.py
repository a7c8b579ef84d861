"""The recipes shipped with dpclip (``recipes/`` in the repo, ``dpclip.recipes`` in a wheel)."""

from __future__ import annotations

import re
import shutil
from importlib import resources
from pathlib import Path

from dpclip.errors import RecipeError


def _recipe_dir():
    return resources.files("dpclip.recipes")


def shipped_names() -> list[str]:
    try:
        entries = list(_recipe_dir().iterdir())
    except (ModuleNotFoundError, FileNotFoundError):
        return []
    return sorted(entry.name[: -len(".yaml")] for entry in entries if entry.name.endswith(".yaml"))


def shipped_text(name: str) -> str:
    name = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if name not in shipped_names():
        close = ", ".join(shipped_names())
        raise RecipeError(f"no shipped recipe named {name!r}", f"shipped recipes: {close}")
    return (_recipe_dir() / f"{name}.yaml").read_text(encoding="utf-8")


# A sentence ends at a full stop before a space or the end, except after "et al" (Bu et al. 2023).
_SENTENCE_END = re.compile(r"(?<!\bal)\.(?=\s|$)")


def shipped_summary(name: str) -> str:
    """The first sentence of a shipped recipe's opening comment: what it shows (a sentence
    may run over several comment lines; the "reaches ..." results line ends the comment)."""
    lines = []
    for line in shipped_text(name).splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith("reaches "):
            break
        lines.append(text)
    comment = " ".join(lines)
    end = _SENTENCE_END.search(comment)
    return comment[:end.end()] if end else comment


def copy_shipped(name: str, destination: str | Path, overwrite: bool = False) -> Path:
    destination = Path(destination)
    if destination.is_dir():
        destination = destination / f"{name.removesuffix('.yaml')}.yaml"
    if destination.exists() and not overwrite:
        raise RecipeError(f"{destination} already exists", "pass --force to overwrite it, or choose another path")
    text = shipped_text(name)
    if not destination.parent.exists():
        raise RecipeError(f"folder {destination.parent} does not exist", "create it first")
    tmp = destination.with_name(destination.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    shutil.move(tmp, destination)
    return destination
