"""Whether a path a command is about to write lies inside a run directory (whose files it must not replace)."""

from __future__ import annotations

from pathlib import Path

from dpclip import layout


def enclosing_run(path: str | Path) -> Path | None:
    """The run directory ``path`` is (or lies inside), resolved; None when it is in none. A run
    directory is a folder holding a run's recipe.yaml and meta.json."""
    resolved = Path(path).expanduser().resolve()
    return next((folder for folder in (resolved, *resolved.parents)
                 if (folder / layout.RECIPE).is_file() and (folder / layout.META).is_file()), None)
