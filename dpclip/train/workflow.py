"""``train(...)``: a run from its start to its end (the CLI, audit's LiRA shadows, the
search and the tests call it).

1. the recipe is resolved (:func:`resolve_recipe`: a resume's own, checked; across ranks,
   agreed on: :mod:`dpclip.train.ranks`);
2. the parts are assembled (:func:`dpclip.train.parts.assemble`);
3. the run directory is made with its step-0 checkpoint, or the run is resumed from its
   latest checkpoint (:class:`dpclip.train.state.Checkpointer`);
4. the loop steps the state (:func:`dpclip.train.trainer.run_loop`);
5. the last checkpoint, summary.json and the plots are written.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from dpclip.accounting import Ledger
from dpclip.distributed import World
from dpclip.errors import DpclipError, InterruptedRun
from dpclip.planning.plan import planned_private_steps
from dpclip.files import write_json_atomic
from dpclip.recipe import Recipe
from dpclip.rundir.checkpoint import latest_checkpoint
from dpclip.rundir.lock import RunLock
from dpclip.train.output import RunOutput
from dpclip.train.parts import assemble
from dpclip.train.run_parts import RunParts
from dpclip.train.plots import plot_run
from dpclip.train.ranks import agree_on_recipe, check_resume_parallel
from dpclip.train.result import TrainObserver, TrainResult
from dpclip.rundir.privacy_fields import privacy_diff, privacy_fingerprint, recipe_changes
from dpclip.rundir.run import RunDir, read_ledger, recorded_written_state, run_statement
from dpclip.rundir.searchdir import search_of_run
from dpclip.train.state import Checkpointer, RunState
from dpclip.train.tensorboard import check_logging, open_tensorboard
from dpclip.train.trainer import run_loop, run_eval

__all__ = ["train", "resolve_recipe", "TrainObserver", "TrainResult"]


def train(recipe: Recipe | None = None, *, resume: Path | None = None, dry_run: bool = False,
          observer: TrainObserver | None = None, data=None, run_dir: Path | None = None,
          file_recipe: Recipe | None = None, world: World | None = None) -> TrainResult:
    """Train ``recipe`` privately (or resume the run in ``resume``) until the planned steps,
    the ε cap or Ctrl-C; returns the result.

    Two keyword arguments serve ``dpclip audit-mia``'s shadow models (LiRA), which train
    the same recipe on a chosen subset of examples: ``data`` (a PrivateData) replaces
    what ``recipe.data`` would load, and ``run_dir`` is the exact directory of a new run
    instead of a fresh ``output_dir/name-TIMESTAMP``. Pass the same ``data`` to resume.
    ``recipe`` with ``resume``: the run's recipe with non-privacy fields changed (a new
    learning rate, more evaluation); privacy fields and the model must stay the run's.
    ``file_recipe``: the recipe before ``key=value`` overrides, whose plan's σ is reported
    beside the run's when the overrides change the steps or the batch size.
    ``world``: this process's rank in a data-parallel run (docs/distributed.md); None: one process.
    """
    world = world or World()
    resume = None if resume is None else Path(resume)
    # Across ranks: rank 0 resolves it, every rank checks it meant the same.
    recipe, resume_changes = agree_on_recipe(world, recipe, lambda: resolve_recipe(recipe, resume))
    parts = assemble(recipe, data=data, world=world, file_recipe=file_recipe, resuming=resume is not None,
                     run_dir=resume)
    check_logging(recipe)  # before the run directory exists
    info = parts.info(resume_changes)
    output = RunOutput(world.main, observer)
    if dry_run:
        return _dry_run(parts, info, output.observer)
    state = RunState(Ledger(parts.setting.plan.delta, parts.setting.plan.accountant))
    checkpointer = Checkpointer(parts, state, output)
    lock = RunLock()   # one process per run directory (rank 0 for all ranks)
    try:
        if resume is not None:
            world.on_main(lock.take, resume)
            checkpointer.resume(resume, resume_changes)
        else:
            checkpointer.start(world.on_main(output.create, recipe, parts.feed.ordinary, parts.feed.canaries, info,
                                             run_dir, parts.feed.exposure))
            world.on_main(lock.take, Path(output.run_dir))
        output.write_ledger(state)
        if world.main:
            output.tensorboard = open_tensorboard(recipe, output.run_dir, parts.learner.engine.group_names,
                                                  in_search=recipe.logging.tensorboard
                                                  and search_of_run(Path(output.run_dir)) is not None)
        output.observer.on_start({**info, **parts.info(resume_changes), "run_dir": str(output.run_dir),
                                  "start_step": state.step, "dry_run": False})  # info again: the resumed phase
        try:
            stopped = run_loop(parts, state, checkpointer, output)
            final_eval = run_eval(parts, state, output) if stopped != "interrupted" else {}
            checkpointer.save_unless_saved()
        except KeyboardInterrupt:   # a second Ctrl-C: stopped at once, maybe mid-step
            raise stopped_at_once(output.run_dir, world) from None
        return _finish(parts, state, output, stopped, final_eval, resume_changes)
    finally:
        lock.release()


def stopped_at_once(run_dir: Path, world: World) -> InterruptedRun:
    """The error of a run stopped by a second Ctrl-C: where it can go on from."""
    checkpoint = latest_checkpoint(Path(run_dir))
    where = "its last checkpoint" if checkpoint is None else f"its last checkpoint ({checkpoint.name})"
    nproc = f" --nproc {world.size}" if world.size > 1 else ""
    return InterruptedRun("interrupted twice: stopped at once, without a checkpoint of this step",
                          f"continue from {where}, the steps after it redone with the releases they made: "
                          f"dpclip train --resume {run_dir}{nproc}")


def resolve_recipe(recipe: Recipe | None, resume: Path | None) -> tuple[Recipe, dict[str, list[Any]]]:
    """(the recipe to run, the non-privacy fields a resume changes). On resume, the run's own
    recipe.yaml, refused if its privacy fields were edited; ``recipe`` may change only other
    fields (and not the model)."""
    changes: dict[str, list[Any]] = {}
    if resume is not None:
        run = RunDir(resume)
        stored = run.recipe()
        if run.meta().get("privacy_fingerprint") != privacy_fingerprint(stored):
            raise DpclipError(f"the privacy fields of {run.recipe_file} were edited after the run started",
                              "the ledger would no longer describe the run; restore recipe.yaml or start a new run")
        if recipe is None:
            return stored, changes
        changed = privacy_diff(stored, recipe)
        if changed:
            # Name the changed leaves (privacy.epsilon), not only their section (privacy).
            changed = [key for key in recipe_changes(stored, recipe)
                       if any(key == f or key.startswith(f + ".") for f in changed)] or changed
            raise DpclipError(f"cannot resume: the recipe changes privacy fields {', '.join(changed)} "
                              "of the run", "resume with the run's own recipe: dpclip train --resume RUN_DIR; "
                              "only other fields (e.g. training.optimizer.lr=0.1) may change on resume")
        changes = recipe_changes(stored, recipe)
        if any(key == "model" or key.startswith("model.") for key in changes):
            raise DpclipError("cannot resume: the recipe changes the model "
                              f"({', '.join(k for k in changes if k.startswith('model'))})",
                              "the checkpoint holds the weights of the run's own model; start a new run")
        check_resume_parallel(changes, run.path)
    if recipe is None:
        raise DpclipError("nothing to train", "pass a recipe file, or --resume RUN_DIR")
    return recipe, changes


def _finish(parts: RunParts, state: RunState, output: RunOutput, stopped: str, final_eval: dict[str, float],
            resume_changes: dict[str, list[Any]]) -> TrainResult:
    """summary.json, the plots and the diagnostics' plot (rank 0, which has the ledger's ε)."""
    recipe, plan = parts.setting.recipe, parts.setting.plan
    planned = planned_private_steps(recipe, plan.steps)
    if not parts.setting.world.main:
        return TrainResult(output.run_dir, state.step, planned, float("nan"), float("nan"), plan.delta, stopped)
    run = RunDir(output.run_dir)
    # Stopped (Ctrl-C) while redoing the steps a crash lost: the model is behind what was released,
    # but ε counts every released step, as ledger.json (never moved back) does.
    ledger = state.ledger if state.ledger.steps >= state.released_steps else read_ledger(run.ledger_file)
    accounting = ledger.result()
    statement = run_statement(recipe, ledger, world_size=parts.setting.world.size, users=parts.setting.plan.users,
                              written=recorded_written_state(output.run_dir), plan=run.public_plan())
    steps_done = state.step + ledger.steps - state.ledger.steps   # (the released steps the model is behind)
    noise = parts.setting.solved.step_metadata
    if statement.sensitivity is not None:   # BLT stopped early: the participations made, not the plan's
        noise = {**noise, "sensitivity": statement.sensitivity}
    result = TrainResult(output.run_dir, steps_done, planned, accounting.epsilon, accounting.epsilon_rdp,
                         plan.delta, stopped, final_eval, statement.lines(), noise,
                         parts.setting.sigma_change, resume_changes, step_seconds=state.step_seconds)
    write_json_atomic(run.summary_file, result.to_dict())
    if output.tensorboard is not None:
        output.tensorboard.close()
    plot_run(run.path, parts.learner.engine.group_names, policy=recipe.clipping.threshold.kind,
             epsilon_cap=recipe.privacy.epsilon, delta=plan.delta)
    parts.diagnostics.finish(run.path)
    output.observer.on_end(result)
    return result


def _dry_run(parts: RunParts, info: dict[str, Any], observer) -> TrainResult:
    observer.on_start({**info, "run_dir": None, "dry_run": True})
    parts.learner.engine.detach()
    solved, plan, recipe = parts.setting.solved, parts.setting.plan, parts.setting.recipe
    epsilon, epsilon_rdp = solved.epsilon, solved.epsilon_rdp
    statement = replace(solved.statement, world_size=parts.setting.world.size, parallel=recipe.training.parallel)
    planned = planned_private_steps(recipe, plan.steps)
    if not planned:   # only-public: the statement of a run that takes no private step (ε = 0)
        statement = run_statement(recipe, Ledger(plan.delta, plan.accountant), world_size=parts.setting.world.size,
                                  users=plan.users)
        epsilon = epsilon_rdp = 0.0
    result = TrainResult(Path("-"), 0, planned, epsilon, epsilon_rdp, plan.delta,
                         "dry-run", statement=statement.lines(),
                         noise=solved.step_metadata, sigma_change=parts.setting.sigma_change,
                         resume_changes=info["resume_changes"])
    observer.on_end(result)
    return result
