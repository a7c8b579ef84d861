"""A run across ranks (docs/distributed.md, "What each rank does").

Every rank builds the same run (recipe, data, model, engine), draws its own part of each
Poisson batch (:class:`~dpclip.distributed.sampler.ShardedPoissonSampler`), clips its own
examples, and takes the same optimizer step from the same noised gradient, summed over the
ranks by the engine's reducer with the noise drawn once, by rank 0. Rank 0 alone writes the
run directory. What this module adds to a run (each function takes the world and the data
it needs, never the loop):

- agreement before anything is trained: rank 0 resolves the recipe (a resume reads the
  run's own), and every rank checks that it would train the same recipe on the same data;
- what does not work across ranks yet is refused with a hint;
- checkpoints hold every rank's sampler and RNG state (gathered to rank 0) and so the world
  size; a resume refuses another world size or another training.parallel, and rank 0 hands
  the resumed state to the others (weights, optimizer, policy, ledger, each rank its own
  sampler state).

One process (``world.size == 1``): every function here is a no-op or the one-process path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from dpclip.distributed import World, announce_run_dir
from dpclip.distributed.code import check_same_code
from dpclip.errors import DpclipError
from dpclip.recipe import Recipe, recipe_to_yaml
from dpclip.rundir.fingerprints import fingerprints
from dpclip.rundir.run import MAX_WORLD_SIZE

SAME_RECIPE_HINT = ("start every rank with the same recipe file and key=value overrides (torchrun passes the "
                    "same arguments to all the ranks of one node; check the other nodes' command lines)")


def agree_on_recipe(world: World, recipe: Recipe | None, resolve: Callable[[], tuple[Recipe, dict]]):
    """(recipe, resume changes): ``resolve()`` on rank 0 (a resume reads the run's recipe),
    then every rank takes its result and checks that its own command line meant the same one."""
    if world.size == 1:
        return resolve()
    check_same_code(world)   # first: another dpclip may read the recipe otherwise, or sample and clip otherwise
    mine = None if recipe is None else recipe_to_yaml(recipe)
    recipe, changes = world.on_main(resolve)
    world.check_same("the recipe", mine if mine is not None else recipe_to_yaml(recipe), SAME_RECIPE_HINT)
    return recipe, changes


def check_ranks(recipe: Recipe, world: World, data) -> None:
    """Refuse what is not data-parallel yet; check that every rank loaded the same data
    (the sampler's owner of example i is i mod W: the ranks must agree on what i is)."""
    if recipe.training.parallel == "pipeline" and world.size == 1:
        raise DpclipError("training.parallel: pipeline runs one stage per process, and this is one process",
                          "start one process per stage of clipping.grouping.stages: dpclip train RECIPE --nproc K")
    if recipe.training.parallel == "fsdp":
        check_shardable(recipe, world)
    if recipe.privacy.unit == "user":
        check_user_level(data)
    if world.size == 1:
        return
    if world.size > MAX_WORLD_SIZE:   # plan.json records it, and its readers refuse more
        raise DpclipError(f"{world.size:,} processes are more than a run can record ({MAX_WORLD_SIZE:,} at most)",
                          "train with fewer processes")
    refused = []
    if recipe.continual is not None:
        refused.append(("continual: (public phases)", "train the public phase in one process"))
    if recipe.diagnostics.every_steps:
        refused.append(("diagnostics: (Hessian diagnostics)", "set diagnostics.every_steps: null, or run one process"))
    if refused:
        what, hint = refused[0]
        raise DpclipError(f"{what} does not run across {world.size} ranks yet (docs/distributed.md)", hint)
    world.check_same("the training data (content and people fingerprints)", fingerprints(data),
                     "every rank must load the same data in the same order: the same files on every node")


def check_shardable(recipe: Recipe, world: World) -> None:
    """What training.parallel: fsdp cannot run (docs/distributed.md, "Sharded training")."""
    if world.size == 1:
        raise DpclipError("training.parallel: fsdp shards the model over processes, and this is one process",
                          "start several: dpclip train RECIPE --nproc N (or use training.parallel: data)")


def rank_states(world: World, local: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's ``local`` state (its sampler, RNG, and a pipeline stage's optimizer and
    engine), on rank 0 for its checkpoint; None in one process."""
    if world.size == 1:
        return None
    return world.gather(local)


def check_world_size(state: dict[str, Any], world_size: int, where: Path) -> None:
    """A checkpoint resumes with the world size it was made with (each rank's sampler state is its own)."""
    saved = len(state["ranks"]) if "ranks" in state else 1
    if saved != world_size:
        command = "dpclip train --resume RUN_DIR" + (f" --nproc {saved}" if saved > 1 else "")
        raise DpclipError(f"{where} was trained by {saved} rank{'s' if saved > 1 else ''}, and this resume has "
                          f"{world_size}", f"resume with the same number of ranks: {command} (or torchrun "
                          f"with {saved} processes in all); each rank's sampler state is its own")


def saved_parallel(state: dict[str, Any]) -> str:
    """The training.parallel a checkpoint was made with. Checkpoints from before it was
    written: a pipeline stage's held its own optimizer (in its rank's state), others were data."""
    ranks = state.get("ranks") or [{}]
    return state.get("parallel") or ("pipeline" if "optimizer" in ranks[0] else "data")


def parallel_switch(where: Path, saved: str, asked: str) -> DpclipError:
    """The refusal of a resume that asks for another training.parallel than the run's."""
    return DpclipError(f"{where} was trained with training.parallel: {saved}, and this resume asks for {asked}",
                       f"a resume keeps the run's parallel mode (each mode stores the optimizer and sampler "
                       f"state its own way): resume with training.parallel: {saved}, or start a new run with {asked}")


def check_parallel(state: dict[str, Any], parallel: str, where: Path) -> None:
    """A resume keeps the training.parallel of the checkpoint (data, pipeline or fsdp)."""
    saved = saved_parallel(state)
    if saved != parallel:
        raise parallel_switch(where, saved, parallel)


def check_resume_parallel(changes: dict[str, list[Any]], where: Path) -> None:
    """A resume's recipe changes (``{field: [old, new]}``) keep training.parallel."""
    if "training.parallel" in changes:
        saved, asked = changes["training.parallel"]
        raise parallel_switch(where, saved, asked)


def share_run_dir(world: World, run_dir: Path, model) -> Path:
    """After rank 0 made or resumed the run directory: every rank takes its path and rank
    0's weights (a resume's further state: :meth:`dpclip.train.state.Checkpointer.resume`)."""
    if world.main:
        announce_run_dir(run_dir)
    if world.size == 1:
        return run_dir
    run_dir = Path(world.broadcast(str(run_dir)))
    if model is not None:  # None: a sharded model, whose ranks took their shards of rank 0's weights
        world.broadcast_(list(model.state_dict().values()))
    return run_dir


def global_outcome(world: World, outcome, written: int = 0):
    """The step's loss sum and realised batch size over all ranks (diagnostics, not covered by ε),
    and ``written`` summed over the ranks (each rank's count of the buffer names its engine saw a
    training forward write: it grows exactly when some rank's set does)."""
    if world.size == 1:
        return outcome, written
    totals = world.reducer.sum(torch.tensor([outcome.loss_sum, float(outcome.batch_size), float(written)],
                                            dtype=torch.float64))
    outcome.loss_sum, outcome.batch_size = float(totals[0]), int(round(float(totals[1])))
    return outcome, int(round(float(totals[2])))


def written_state_of_ranks(world: World, names: set[str]) -> set[str]:
    """The union of every rank's forward-written buffer names on rank 0, which writes the statement
    (empty elsewhere): a pipeline stage's buffers are on its own rank only. A collective: every rank calls it."""
    if world.size == 1:
        return set(names)
    parts = world.gather(sorted(names))
    return set().union(*parts) if world.main else set()


def check_user_level(data) -> None:
    """Data that must name a person for every record (what user-level privacy does not run with
    yet is refused by the recipe's validation: :func:`dpclip.recipe.users.check_users`)."""
    if data.train_users is None:
        raise DpclipError("privacy.unit 'user' but the data carry no users",
                          "name the person's column in data.user_field (or use builtin synthetic-users)")
