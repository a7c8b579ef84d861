"""``train(...)``: the training workflow's entry point (the CLI, audit's LiRA shadows, the
search and the tests call it); the workflow itself is :class:`dpclip.train.trainer.Trainer`."""

from __future__ import annotations

from pathlib import Path

from dpclip.recipe import Recipe
from dpclip.train.result import TrainObserver, TrainResult
from dpclip.train.trainer import Trainer

__all__ = ["train", "Trainer", "TrainObserver", "TrainResult"]


def train(recipe: Recipe | None = None, *, resume: Path | None = None, dry_run: bool = False,
          observer: TrainObserver | None = None, data=None, run_dir: Path | None = None,
          file_recipe: Recipe | None = None, world=None) -> TrainResult:
    """Train ``recipe`` privately (or resume the run in ``resume``); see :class:`Trainer`.

    Two keyword arguments serve ``dpclip audit-mia``'s shadow models (LiRA), which train
    the same recipe on a chosen subset of examples: ``data`` (a PrivateData) replaces
    what ``recipe.data`` would load, and ``run_dir`` is the exact directory of a new run
    instead of a fresh ``output_dir/name-TIMESTAMP``. Pass the same ``data`` to resume.
    ``file_recipe``: the recipe before ``key=value`` overrides (σ is compared with its plan).
    ``world``: this process's rank in a data-parallel run (docs/distributed.md); None: one process.
    """
    return Trainer(recipe, resume=resume, dry_run=dry_run, observer=observer, data=data, run_dir=run_dir,
                   file_recipe=file_recipe, world=world).train()
