"""`dpclip train` below the CLI: one process or ``--nproc`` ranks, the recipe a run or a
resume trains, and the error an interrupted run leaves.

The command parses its arguments and renders progress; this module decides the rest:
whether this process launches ranks (:func:`spawns_ranks`, :func:`launch_ranks`), the
torch threads of a run or a resume (:func:`run_threads`), the recipe to train, checked
against ``--resume`` (:func:`training_recipes`), and how an interrupted run is resumed
(:func:`raise_if_interrupted`). See docs/training.md and docs/distributed.md.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from dpclip.distributed import World, announce_interrupted, launch, launched, rank_threads
from dpclip.distributed.world import timeout_seconds
from dpclip.errors import DpclipError, InterruptedRun, RecipeError
from dpclip.recipe import load_recipe
from dpclip.recipe.schema import Recipe
from dpclip.rundir.run import run_recipe_with
from dpclip.train.device import recorded_threads
from dpclip.train.result import TrainResult


class TrainingRecipes(NamedTuple):
    """What a `dpclip train` trains: ``recipe`` (None: the resumed run's own, unchanged) and
    ``file_recipe``, the recipe file without the overrides (its σ is shown beside the run's;
    None when there are no overrides, on a resume, or when the file alone is incomplete)."""

    recipe: Recipe | None
    file_recipe: Recipe | None


def spawns_ranks(nproc: int | None) -> bool:
    """True when this process launches ``--nproc`` ranks rather than training itself."""
    return nproc is not None and nproc != 1 and not launched()


def launch_ranks(recipe: str | None, overrides: Sequence[str], *, resume: Path | None, as_json: bool,
                 threads: str | None, dry_run: bool, nproc: int, master_port: int | None) -> None:
    """Run this same `dpclip train` command, without --nproc, as ``nproc`` ranks under
    torch.distributed's launcher, and wait for them (docs/distributed.md)."""
    timeout_seconds()   # a bad DPCLIP_DIST_TIMEOUT_S is refused once, before any rank starts
    # A dry run too: its plan and statement are the N processes', and a sharded model needs them.
    args = ["train", *([recipe] if recipe is not None else []), *overrides,
            *(["--resume", str(resume)] if resume is not None else []), *(["--json"] if as_json else []),
            *(["--threads", str(threads)] if threads is not None else []), *(["--dry-run"] if dry_run else [])]
    launch(args, nproc, master_port=master_port, debug=bool(os.environ.get("DPCLIP_DEBUG")))


def run_threads(threads: str | int | None, resume: Path | None) -> str | int | None:
    """--threads of this process: a resume's recorded count when not given (so that replayed
    steps reduce in the same order, dpclip.threads), split among the ranks on one machine."""
    if threads is None and resume is not None:
        threads = recorded_threads(resume)
    return rank_threads(threads)  # ranks on one machine share its cores


def is_override(text: str) -> bool:
    """True when a positional argument is a key=value override rather than a recipe file."""
    return "=" in text and not Path(text).exists()


def training_recipes(recipe: str | None, overrides: Sequence[str], resume: Path | None) -> TrainingRecipes:
    """The recipe file (with ``overrides``) or the resumed run's recipe (with them), after the
    checks that name what a run or a resume needs."""
    overrides = list(overrides)
    if resume is not None and recipe is not None and is_override(recipe):
        overrides, recipe = [recipe, *overrides], None  # `--resume RUN_DIR key=value ...`
    if resume is not None and not Path(resume).is_dir():
        raise DpclipError(f"run directory not found: {resume}", "pass a folder created by `dpclip train` under runs/")
    if recipe is not None:
        loaded = load_recipe(recipe, overrides)
        file_recipe = None
        if overrides and resume is None:
            try:
                file_recipe = load_recipe(recipe)  # σ of the file's own plan is shown beside the run's
            except RecipeError:
                file_recipe = None  # the file alone is incomplete: the overrides complete it
        return TrainingRecipes(loaded, file_recipe)
    if overrides:
        if resume is None:
            raise DpclipError("overrides need a recipe", "dpclip train RECIPE.yaml key=value ..., or "
                              "dpclip train --resume RUN_DIR key=value ...")
        return TrainingRecipes(run_recipe_with(resume, overrides), None)
    if resume is None:
        raise DpclipError("nothing to train", "pass a recipe file (see `dpclip recipes list`), or --resume RUN_DIR")
    return TrainingRecipes(None, None)


def raise_if_interrupted(result: TrainResult, world: World | None) -> None:
    """An interrupted run ends in :class:`InterruptedRun`, which says how to resume it; said
    once, by --nproc's launcher (rank 0 leaves it the note), else by rank 0."""
    if result.stopped != "interrupted":
        return
    resume_command = f"dpclip train --resume {result.run_dir}" + (f" --nproc {world.size}" if world else "")
    error = InterruptedRun(f"interrupted at step {result.steps_done}; a checkpoint was saved",
                           f"continue with: {resume_command}")
    told_launcher = world is not None and world.main and announce_interrupted(error.message, error.hint)
    error.quiet = world is not None and (not world.main or told_launcher)
    raise error
