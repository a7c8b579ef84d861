"""The trainer's part in a data-parallel run (docs/distributed.md, "What each rank does").

Every rank builds the same run (recipe, data, model, engine), draws its own part of each
Poisson batch (:class:`~dpclip.distributed.sampler.ShardedPoissonSampler`), clips its own
examples, and takes the same optimizer step from the same noised gradient, summed over the
ranks by the engine's reducer with the noise drawn once, by rank 0. Rank 0 alone writes the
run directory. What this module adds to :class:`~dpclip.train.trainer.Trainer`:

- agreement before anything is trained: rank 0 resolves the recipe (a resume reads the
  run's own), and every rank checks that it would train the same recipe on the same data;
- what does not work across ranks yet is refused with a hint;
- checkpoints hold every rank's sampler and RNG state (gathered to rank 0) and so the world
  size; a resume refuses another world size, and rank 0 hands the resumed state to the
  others (weights, optimizer, policy, ledger, each rank its own sampler state).

One process (``world.size == 1``): every function here is a no-op or the one-process path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dpclip.accounting import Ledger
from dpclip.distributed import World, announce_run_dir
from dpclip.errors import DpclipError
from dpclip.recipe import recipe_to_yaml
from dpclip.train.rundir import data_fingerprint

SAME_RECIPE_HINT = ("start every rank with the same recipe file and key=value overrides (torchrun passes the "
                    "same arguments to all the ranks of one node; check the other nodes' command lines)")


def setup_recipe(trainer) -> None:
    """Rank 0's ``_setup_recipe`` (a resume reads the run's recipe), then every rank takes its
    recipe and checks that its own command line meant the same one."""
    world: World = trainer.world
    if world.size == 1:
        trainer._setup_recipe()
        return
    mine = None if trainer.recipe is None else recipe_to_yaml(trainer.recipe)

    def resolve():
        trainer._setup_recipe()
        return trainer.recipe, trainer.resume_changes

    trainer.recipe, trainer.resume_changes = world.on_main(resolve)
    world.check_same("the recipe", mine if mine is not None else recipe_to_yaml(trainer.recipe), SAME_RECIPE_HINT)


def check_ranks(trainer) -> None:
    """Refuse what is not data-parallel yet; check that every rank loaded the same data
    (the sampler's owner of example i is i mod W: the ranks must agree on what i is)."""
    world: World = trainer.world
    recipe = trainer.recipe
    if recipe.training.parallel == "pipeline" and world.size == 1:
        raise DpclipError("training.parallel: pipeline runs one stage per process, and this is one process",
                          "start one process per stage of clipping.grouping.stages: dpclip train RECIPE --nproc K")
    if recipe.training.parallel == "pipeline" and recipe.training.precision != "fp32":
        raise DpclipError(f"training.precision: {recipe.training.precision} does not run on pipeline stages yet",
                          "use training.precision: fp32 with training.parallel: pipeline")
    if world.size == 1:
        return
    refused = []
    if recipe.continual is not None:
        refused.append(("continual: (public phases)", "train the public phase in one process"))
    if recipe.diagnostics.every_steps:
        refused.append(("diagnostics: (Hessian diagnostics)", "set diagnostics.every_steps: null, or run one process"))
    if refused:
        what, hint = refused[0]
        raise DpclipError(f"{what} does not run across {world.size} ranks yet (docs/distributed.md)", hint)
    world.check_same("the training data (content fingerprint)", data_fingerprint(trainer.data),
                     "every rank must load the same data in the same order: the same files on every node")


def rank_states(trainer) -> list[dict[str, Any]] | None:
    """Every rank's sampler and torch RNG states, on rank 0 (for its checkpoint); None in one process."""
    world: World = trainer.world
    if world.size == 1:
        return None
    state = {"sampler": trainer.sampler.state_dict(), "torch_rng": torch.get_rng_state()}
    if trainer.pipeline:  # a stage's optimizer and engine (noise generator, thresholds) are its own
        state.update(optimizer=trainer.optimizer.state_dict(), engine=trainer.engine.state_dict())
    return world.gather(state)


def check_world_size(state: dict[str, Any], world_size: int, where: Path) -> None:
    """A checkpoint resumes with the world size it was made with (each rank's sampler state is its own)."""
    saved = len(state["ranks"]) if "ranks" in state else 1
    if saved != world_size:
        command = "dpclip train --resume RUN_DIR" + (f" --nproc {saved}" if saved > 1 else "")
        raise DpclipError(f"{where} was trained by {saved} rank{'s' if saved > 1 else ''}, and this resume has "
                          f"{world_size}", f"resume with the same number of ranks: {command} (or torchrun "
                          f"with {saved} processes in all); each rank's sampler state is its own")


def share_run_state(trainer, state: dict[str, Any] | None) -> None:
    """After rank 0 made or resumed the run directory: every rank takes rank 0's weights and,
    on a resume, the checkpoint's state (``state``: what rank 0 loaded, sent to all)."""
    world: World = trainer.world
    if world.main:
        announce_run_dir(trainer.run_dir)
    if world.size == 1:
        return
    trainer.run_dir = Path(world.broadcast(str(trainer.run_dir)))
    world.broadcast_(list(trainer.model.state_dict().values()))
    if state is None or world.main:
        return
    local = state["ranks"][world.rank]
    trainer.step = int(state["step"])
    trainer.ledger = Ledger.from_dict(state["ledger"])
    trainer.optimizer.load_state_dict(local["optimizer"] if trainer.pipeline else state["optimizer"])
    trainer.engine.load_state_dict(local["engine"] if trainer.pipeline else state["engine"])
    trainer.sampler.load_state_dict(local["sampler"])
    torch.set_rng_state(local["torch_rng"])


def global_outcome(world: World, outcome):
    """The step's loss sum and realised batch size over all ranks (diagnostics, not covered by ε)."""
    if world.size == 1:
        return outcome
    totals = world.reducer.sum(torch.tensor([outcome.loss_sum, float(outcome.batch_size)], dtype=torch.float64))
    outcome.loss_sum, outcome.batch_size = float(totals[0]), int(round(float(totals[1])))
    return outcome

