"""A run's state, and the one checkpointer that saves and restores all of it.

:class:`RunState` is what changes from step to step besides the weights: the step count,
the ledger (and how many of its steps ledger.json already holds), the steps' wall time. The
rest of a run's state lives in its parts while it trains (:mod:`dpclip.train.parts`): the
optimizer's state, the sampler's and the engine's generators, the threshold policy, torch's
global RNG (dropout), the continual schedule. :func:`checkpoint_tree` gathers all of it,
:func:`restore` puts it back, and :class:`Checkpointer` is the only writer and reader of
checkpoints (the file format: :mod:`dpclip.rundir.checkpoint`).

Across ranks (docs/distributed.md): rank 0 writes the checkpoint with every rank's own part
(sampler, RNG; a pipeline stage's optimizer and engine; a sharded rank's noise generators)
gathered to it, and on resume hands each rank its part. A sharded model's weights and
optimizer state are gathered whole to rank 0 for the checkpoint (the same files as one
process writes), and each rank takes its shards back on resume.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpclip.accounting import Ledger
from dpclip.distributed.pipeline import sync_stages
from dpclip.errors import DpclipError
from dpclip import layout
from dpclip.files import remove_stale_temporaries
from dpclip.layout import STATE
from dpclip.rng import fork_private_streams
from dpclip.rundir.checkpoint import (finish_interrupted_save, latest_checkpoint, load_checkpoint,
                                      missing_checkpoint_hint, newer_checkpoints, save_checkpoint)
from dpclip.train.output import RunOutput
from dpclip.train.run_parts import RunParts
from dpclip.train.ranks import check_parallel, check_world_size, rank_states, share_run_dir
from dpclip.rundir.metrics import released_records
from dpclip.rundir.fingerprints import check_data
from dpclip.rundir.run import RunDir, check_canaries, check_ledger, read_ledger, record_resume_changes

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """The step count and the ledger of a run (module doc). ``released_steps``: the steps
    ledger.json holds, which may be ahead of a resumed checkpoint after a crash and never
    move back. ``step_seconds``: this process's private steps' wall time (never written:
    see :class:`~dpclip.train.result.TrainResult`)."""

    ledger: Ledger
    step: int = 0
    released_steps: int = 0
    step_seconds: float = 0.0


def rank_local_state(parts: RunParts) -> dict[str, Any]:
    """What each rank holds of its own: its sampler and RNG (a pipeline stage: also its
    optimizer and engine, its noise generator and thresholds; a sharded rank: its engine,
    whose noise stream is its own)."""
    state = {"sampler": parts.feed.sampler.state_dict(), "torch_rng": torch.get_rng_state()}
    if parts.pipeline:
        state.update(optimizer=parts.learner.optimizer.state_dict(), engine=parts.learner.engine.state_dict())
    elif parts.learner.shards is not None:
        state.update(engine=parts.learner.engine.state_dict())
    return state


def checkpoint_tree(parts: RunParts, state: RunState, ranks: list[dict[str, Any]] | None,
                    optimizer_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a checkpoint holds besides the weights (``optimizer_state``: a sharded
    model's, gathered whole)."""
    optimizer_state = parts.learner.optimizer.state_dict() if optimizer_state is None else optimizer_state
    tree = {"step": state.step, "optimizer": optimizer_state, "sampler": parts.feed.sampler.state_dict(),
            "engine": parts.learner.engine.state_dict(), "torch_rng": torch.get_rng_state(),
            "ledger": state.ledger.to_dict(),
            "parallel": parts.setting.recipe.training.parallel}
    if parts.feed.continual is not None:
        tree["continual"] = parts.feed.continual.state_dict()
    if parts.setting.device.type == "cuda":  # dropout on a GPU draws from its generator, not the CPU's
        tree["cuda_rng"] = torch.cuda.get_rng_state(parts.setting.device)
    if ranks is not None:
        tree["ranks"] = ranks
    return tree


def restore(parts: RunParts, state: RunState, tree: dict[str, Any], local: dict[str, Any] | None = None) -> None:
    """Put a checkpoint's ``tree`` back into ``parts`` and ``state``; ``local``: this rank's
    own part of it (another rank than 0's), else the tree's."""
    local = tree if local is None else local
    state.step = int(tree["step"])
    state.ledger = Ledger.from_dict(tree["ledger"])
    # A sharded model's ranks take theirs together (Checkpointer.resume); a sharded run's state,
    # keyed by parameter name, is not loaded into an unsharded optimizer (dpclip diagnose measures
    # such a run's weights in one process and takes no step).
    if parts.learner.shards is None and tree.get("parallel") != "fsdp":
        parts.learner.optimizer.load_state_dict((local if parts.pipeline else tree)["optimizer"])
    parts.feed.sampler.load_state_dict(local["sampler"])
    own_engine_state = parts.pipeline or parts.learner.shards is not None  # each rank's own, in ``local``
    engine_state = (local if own_engine_state else tree)["engine"]
    if "noise" not in engine_state:  # rank 0's public part (:func:`shared_tree`): this rank keeps its own streams
        engine_state = {**parts.learner.engine.state_dict(), **engine_state}
    parts.learner.engine.load_state_dict(engine_state)
    torch.set_rng_state(local["torch_rng"])
    # a resume keeps the run's device (dpclip.train.device)
    if "cuda_rng" in tree and parts.setting.device.type == "cuda":
        torch.cuda.set_rng_state(tree["cuda_rng"], parts.setting.device)


#: the engine state a data-parallel rank takes from rank 0's (its noise streams and correlated-noise
#: history stay rank 0's: the other ranks draw no noise)
PUBLIC_ENGINE_STATE = ("policy", "steps", "forward_written_state")


def shared_tree(tree: dict[str, Any], own_engine_state: bool) -> dict[str, Any]:
    """What rank 0 broadcasts of a checkpoint it resumed: not the ranks' own parts (each is sent to
    its rank alone), nor its own sampler's or noise's generator states and correlated-noise history,
    from which another rank could regenerate rank 0's draws and noise for the redone steps
    (docs/distributed.md, "The privacy argument": the noise is known to the rank that drew it)."""
    shared = {key: value for key, value in tree.items() if key not in ("ranks", "sampler", "engine")}
    if not own_engine_state:
        shared["engine"] = {key: tree["engine"][key] for key in PUBLIC_ENGINE_STATE if key in tree["engine"]}
    return shared


class Checkpointer:
    """Saves ``state`` with ``parts`` into ``output``'s run directory, tells when a checkpoint
    is due, and resumes a run from its latest checkpoint."""

    def __init__(self, parts: RunParts, state: RunState, output: RunOutput):
        self.parts, self.state, self.output = parts, state, output
        self.checkpoint = parts.setting.recipe.checkpoint  # when to save, how many to keep
        self.last_save = time.monotonic()  # checkpoint.every_minutes counts from it
        self._optimizer_state: dict[str, Any] | None = None  # a sharded resume's, on rank 0
        self._on_disk: tuple | None = None   # the progress the newest checkpoint holds
        self._fork_pending = False   # a resumed run whose private streams are still the checkpoint's

    def due(self, count: int) -> bool:
        """checkpoint.every_steps (of ``count`` steps), or checkpoint.every_minutes since the
        last checkpoint (a step boundary either way; docs/training.md, "Checkpoints and
        resuming"). Every rank saves together: any rank's clock."""
        every_steps, every_minutes = self.checkpoint.every_steps, self.checkpoint.every_minutes
        due = bool(every_steps and count % every_steps == 0) or (
            every_minutes is not None and time.monotonic() - self.last_save >= 60.0 * every_minutes)
        return self.parts.setting.world.any(due)

    def _progress(self) -> tuple:
        """(private steps, public steps, phase): what a checkpoint of now holds that the last may not."""
        continual = self.parts.feed.continual
        return (self.state.step,) + (() if continual is None else (continual.public_step, continual.phase))

    def save_unless_saved(self) -> None:
        """The closing checkpoint, unless the newest one holds this very progress: rewriting a
        step's folder leaves a moment when LATEST names none (dpclip.files.replace_dir_atomic)."""
        if self._on_disk != self._progress():
            self.save()

    def save(self) -> None:
        self._on_disk = self._progress()
        parts, world = self.parts, self.parts.setting.world
        if parts.pipeline:  # rank 0 saves the whole model: each stage's weights from its rank
            sync_stages(parts.learner.model, parts.learner.engine.bounds, world)
        ranks = rank_states(world, rank_local_state(parts))  # every rank's own part, on rank 0
        if parts.learner.shards is not None:  # every rank sends its shards; rank 0 writes the whole
            optimizer_state = parts.learner.shards.optimizer_state(parts.learner.optimizer)
            with parts.learner.shards.whole() as whole:
                if world.main:
                    self._write(whole, checkpoint_tree(parts, self.state, ranks, optimizer_state))
            return
        if world.main:
            self._write(parts.learner.model, checkpoint_tree(parts, self.state, ranks))

    def _write(self, model, tree: dict[str, Any]) -> None:
        # The ledger goes to disk before the checkpoint that depends on it is made current.
        self.output.write_ledger(self.state)
        save_checkpoint(self.output.run_dir, self.state.step, model, tree, keep=self.checkpoint.keep)
        self.last_save = time.monotonic()

    def start(self, run_dir: Path) -> None:
        """A new run's step-0 checkpoint (with the generators' states), so that a crash
        before the first regular checkpoint resumes into the same noise and batches."""
        # a sharded model's ranks started from rank 0's weights already (dpclip.train.parts.assemble)
        self.output.run_dir = share_run_dir(self.parts.setting.world, run_dir,
                                            self.parts.learner.model if self.parts.learner.shards is None else None)
        self.save()

    def resume(self, run_dir: Path, resume_changes: dict[str, list[Any]]) -> None:
        """Rank 0 reads the run's latest checkpoint and checks it; every rank takes its part."""
        parts, world = self.parts, self.parts.setting.world
        own_engine_state = parts.pipeline or parts.learner.shards is not None
        ranks: list[dict[str, Any]] = []   # every rank's own part, on rank 0: each is sent to its rank alone

        def load(model) -> dict[str, Any]:
            tree = self._load(RunDir(run_dir), resume_changes, model)
            ranks.extend(tree.get("ranks") or ())
            return shared_tree(tree, own_engine_state)

        if parts.learner.shards is not None:  # rank 0 reads the whole weights; every rank takes its shards
            with parts.learner.shards.loading() as whole:
                tree = world.on_main(load, whole)
            parts.learner.shards.load_optimizer_state(parts.learner.optimizer, self._optimizer_state)
            self._optimizer_state = None
            self.output.run_dir = share_run_dir(world, Path(run_dir), None)
        else:
            tree = world.on_main(load, parts.learner.model)
            self.output.run_dir = share_run_dir(world, Path(run_dir), parts.learner.model)
        local = world.scatter(ranks if world.main else None) if world.size > 1 else None
        if not world.main:
            restore(parts, self.state, tree, local)
            self.state.released_steps = int(tree["released_steps"])
        self._on_disk = self._progress()
        self._fork_pending = True
        self.fork_when_redone()

    def fork_when_redone(self) -> None:
        """Once a resumed run has redone the steps it had released (at once if none), every
        private stream gets a fresh state from OS entropy (:func:`dpclip.rng.fork_private_streams`):
        its new steps are new releases, and a copy of the run directory resumed beside it must not
        draw their noise too. Every rank at the same step (each knows ``released_steps``)."""
        if self._fork_pending and self.state.step >= self.state.released_steps:
            fork_private_streams(self.parts.learner.engine.noise, self.parts.feed.sampler)
            self._fork_pending = False

    def _load(self, run: RunDir, resume_changes: dict[str, list[Any]], model) -> dict[str, Any]:
        parts, state = self.parts, self.state
        solved, steps = parts.setting.solved, parts.setting.plan.steps
        for folder in (run.path, layout.checkpoints_dir(run.path)):   # (the run is locked: no write is under way)
            if stale := remove_stale_temporaries(folder):
                log.info("removed what writes the crash cut short left in %s: %s", folder, ", ".join(stale))
        if (finished := finish_interrupted_save(run.path)) is not None:
            log.warning("%s was complete but LATEST did not name it yet (the run was killed between the two): "
                        "resuming from it", finished.name)
        checkpoint = latest_checkpoint(run.path)
        if checkpoint is None:
            raise DpclipError(f"{run.path} has no checkpoint to resume from", missing_checkpoint_hint(run.path))
        if newer := newer_checkpoints(checkpoint):
            # Resuming before them would redo their steps with the noise they were released with.
            raise DpclipError(f"{checkpoint.parent / layout.LATEST} names {checkpoint.name}, but {newer[-1].name} is "
                              "complete and newer: its steps would be redone with the same noise and batches, and "
                              "any difference between the two (another lr, other code) released without noise",
                              f"resume from the newest: write {newer[-1].name} into {checkpoint.parent / layout.LATEST}")
        # The data first: rows or people added or removed move N, so q and the plan's event, and the
        # ledger's check below would blame the run directory for an edit to the data.
        check_data(run, parts.feed.ordinary)

        def check(tree: dict[str, Any]) -> None:  # before any weight is loaded
            check_world_size(tree, parts.setting.world.size, run.path)
            check_parallel(tree, parts.setting.recipe.training.parallel, run.path)

        tree = load_checkpoint(checkpoint, model, check)
        try:
            restore(parts, state, tree)
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, RuntimeError) as exc:
            # state.json read as JSON, but what it holds is not what the run saved (edited, or another version's)
            raise DpclipError(f"checkpoint {checkpoint} does not hold a state this run can take back "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})",
                              "the run directory was modified: restore it from a backup, or start a new run") from None
        check_ledger(state.ledger, solved, state.step, where=checkpoint / STATE)
        released = read_ledger(run.ledger_file) if run.ledger_file.exists() else state.ledger
        check_ledger(released, solved, range(state.step, steps + 1), where=run.ledger_file)
        state.released_steps = tree["released_steps"] = released.steps   # every rank forks after them
        if parts.feed.continual is not None:
            parts.feed.continual.load_state_dict(tree.get("continual"), run.metrics_file)
        # Steps after the checkpoint that already left the process are redone with the
        # checkpoint's generator states, so they must release exactly what they did.
        self.output.replay = released_records(run.metrics_file, state.step)
        unrecorded = [s for s in range(state.step + 1, released.steps) if ("step", s) not in self.output.replay]
        if unrecorded:   # (the ledger is written first: the last released step may lack its line)
            log.warning("metrics.jsonl holds no record of step%s %s, which the ledger says were released: their "
                        "redone releases cannot be compared with what was released (was the file cut or "
                        "edited?)", "s" if len(unrecorded) > 1 else "",
                        f"{unrecorded[0]}-{unrecorded[-1]}" if len(unrecorded) > 1 else unrecorded[0])
        if parts.feed.canaries is not None:
            check_canaries(run.path, parts.feed.canaries)
        if resume_changes:
            # The run directory says what its later steps were trained with (the privacy
            # fields, and so the fingerprint, are unchanged: checked when the recipe was resolved).
            record_resume_changes(run, parts.setting.recipe, state.step, resume_changes)
        if parts.learner.shards is not None:  # kept on rank 0, not broadcast with the rest: every rank loads its shards
            self._optimizer_state = tree.pop("optimizer")
        return tree
