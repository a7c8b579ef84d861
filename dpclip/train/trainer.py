"""The training loop: it steps a :class:`~dpclip.train.state.RunState` with the run's parts.

The parts come from :func:`dpclip.train.parts.assemble`, the state and its checkpoints from
:mod:`dpclip.train.state`, the run directory's writer from :mod:`dpclip.train.output`; the
run's start and end (recipe, run directory, summary, plots) are :mod:`dpclip.train.workflow`.

Each private step (:class:`~dpclip.train.step.PrivateStep`) is charged in the ledger, and
the ledger written, before anything of it leaves the process. Nothing else touches the
private data, except the diagnostics in metrics.jsonl (training loss, clip fractions, norm
quantiles), which are computed without noise, are not covered by ε, and are labelled so.
"""

from __future__ import annotations

from typing import Any

import torch

from dpclip.accounting import check_same_release
from dpclip.models import evaluate
from dpclip.interrupt import DeferredInterrupt
from dpclip.train.run_parts import RunParts
from dpclip.train.ranks import global_outcome, written_state_of_ranks
from dpclip.rundir.metrics import step_record
from dpclip.train.state import Checkpointer, RunState
from dpclip.distributed.pipeline import sync_stages


def run_loop(parts: RunParts, state: RunState, checkpointer: Checkpointer, output) -> str:
    """Steps until done; returns why it stopped ("completed", "budget" or "interrupted")."""
    solved, cap = parts.setting.solved, parts.setting.recipe.privacy.epsilon
    phases = parts.feed.continual
    parts.learner.model.train()
    with DeferredInterrupt() as interrupt:
        try:
            batches = iter(parts.feed.sampler)
            if phases is not None and phases.run_public_phase(interrupt, state.step, checkpointer,
                                                              output.public_record) == "interrupted":
                return "interrupted"
            while state.step < (parts.setting.plan.steps if phases is None else phases.private_steps()):
                if parts.setting.world.any(interrupt.requested):  # between steps only, never inside one; any rank's
                    return "interrupted"
                # The cap is checked before the batch is touched, with the plan's event, which
                # is asserted in each step to be the event the engine actually releases.
                if cap is not None and not state.ledger.allows(solved.event_at(state.step), cap):
                    return "budget"
                with output.on_private_batch():   # the draw (the sampler's own error follows it too)
                    indices = next(batches)
                train_step(parts, state, indices, output)   # (it records a stop on its batch: on_private_batch)
                checkpointer.fork_when_redone()
                if checkpointer.due(state.step):
                    checkpointer.save()
        finally:
            parts.learner.engine.detach()
    return "completed"


def train_step(parts: RunParts, state: RunState, indices: torch.Tensor, output) -> None:
    """One private step, charged in the ledger on disk before its record is written."""
    recipe, plan, step_event = parts.setting.recipe, parts.setting.plan, parts.setting.solved.step_event
    lr = parts.learner.schedule.apply(state.step)

    def checked(report):
        check_same_release(report.participation_event, step_event)

    with output.on_private_batch():   # an error here follows the batch: the statement names the stop
        if parts.feed.continual is None:
            outcome = parts.learner.private_step(indices, before_update=checked)
        else:
            outcome = parts.feed.continual.step_fn(state.step, indices, before_update=checked)
        written = parts.learner.engine.forward_written_state   # (each stage its own: docs/distributed.md)
        outcome, written_count = global_outcome(parts.setting.world, outcome, len(written))  # all ranks' parts
    # Banded MF charges the first step of each cycle of b and records the others as no-ops.
    state.ledger.record(parts.setting.solved.event_at(state.step), metadata=parts.setting.solved.step_metadata)
    state.step += 1
    state.step_seconds += outcome.seconds
    # Charged before anything of this step leaves the process (a crash between
    # the two leaves the ledger ahead, never behind).
    output.write_ledger(state, every_step=True)
    if written_count != output.written_count:   # a rank's forwards wrote a buffer new to it: rank 0 gathers the names
        output.written_count = written_count
        output.record_written_state(written_state_of_ranks(parts.setting.world, written))   # the statement names them
    epsilon_every = max(1, plan.steps // 50)  # ε with the ledger's accountant costs ~0.1 s: not every step
    live = parts.setting.world.main and (state.step == plan.steps or state.step % epsilon_every == 0)
    epsilon = state.ledger.epsilon() if live else None
    with output.on_private_batch():   # computed from the step's outcome
        record = step_record(state.step, outcome.report, epsilon, outcome.loss_sum, outcome.batch_size,
                             recipe.training.batch_size, lr, outcome.seconds, recipe.clipping.fn,
                             recipe.privacy.exact_diagnostics)
        if parts.feed.continual is not None:
            record = {**record, **parts.feed.continual.record_fields(state.step)}
    output.emit(record, "step")
    parts.diagnostics.maybe_record(state.step, output.run_dir, output.on_private_batch)
    if recipe.eval.every_steps and state.step % recipe.eval.every_steps == 0 and state.step < plan.steps:
        run_eval(parts, state, output)


def run_eval(parts: RunParts, state: RunState, output) -> dict[str, Any]:
    """Held-out metrics (exact: not covered by ε), only with privacy.exact_diagnostics, on rank 0
    (a sharded model's ranks all run its forwards, which are collectives; rank 0 writes)."""
    exact = parts.setting.recipe.privacy.exact_diagnostics
    if parts.pipeline and exact:  # rank 0 evaluates the whole model
        sync_stages(parts.learner.model, parts.learner.engine.bounds, parts.setting.world)
    if not exact or not (parts.setting.world.main or parts.learner.shards is not None):
        return {}
    with output.on_private_batch():   # the model on the held-out split of the private data
        metrics = evaluate(parts.learner.model, parts.learner.loss_fn, parts.feed.data.test, parts.feed.data.task,
                           batch_size=parts.setting.recipe.eval.batch_size)
    if parts.learner.shards is not None:
        parts.learner.shards.reshard()
    if not parts.setting.world.main:
        return {}
    output.emit({"step": state.step, "eval": metrics, "not_covered_by_epsilon": ["eval"]}, "eval")
    return metrics
