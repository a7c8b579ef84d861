"""The run as explicit data: frozen parts (dpclip.train.parts) and the one checkpointer
that saves and restores a run's whole state (dpclip.train.state)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dpclip.accounting import Ledger
from dpclip.rundir.checkpoint import flatten_state, latest_checkpoint, load_checkpoint
from dpclip.train.output import RunOutput
from dpclip.train.parts import assemble
from dpclip.train.state import Checkpointer, RunState, checkpoint_tree, restore

TINY = ("privacy.unsafe_seeded_randomness=true", "model.hidden=[8]", "training.steps=3", "eval.every_steps=null",
        "clipping.threshold={kind: quantile, initial: 1.0, sigma: 2.0}")


def test_the_parts_of_a_run_cannot_be_replaced(small_recipe):
    parts = assemble(small_recipe(*TINY))
    try:
        with pytest.raises(dataclasses.FrozenInstanceError):
            parts.learner.engine = None
    finally:
        parts.learner.engine.detach()


def test_the_checkpointer_restores_everything_it_saved(small_recipe, tmp_path):
    recipe = small_recipe(*TINY, "training.optimizer={kind: adam, lr: 0.003}")
    parts = assemble(recipe)
    state = RunState(Ledger(parts.setting.plan.delta, parts.setting.plan.accountant))
    output = RunOutput(True, None)
    checkpointer = Checkpointer(parts, state, output)
    checkpointer.start(output.create(recipe, parts.feed.ordinary, parts.feed.canaries, parts.info({}), tmp_path / "run"))
    batches = iter(parts.feed.sampler)
    for _ in range(2):  # two private steps move the optimizer, the generators and the thresholds
        parts.learner.private_step(next(batches))
        state.ledger.record(parts.setting.solved.step_event)
        state.step += 1
    checkpointer.save()
    saved = checkpoint_tree(parts, state, None)
    parts.learner.engine.detach()

    fresh = assemble(recipe)
    resumed = RunState(Ledger(fresh.setting.plan.delta, fresh.setting.plan.accountant))
    restore(fresh, resumed, load_checkpoint(latest_checkpoint(tmp_path / "run"), fresh.learner.model))
    fresh.learner.engine.detach()
    assert resumed.step == 2 and resumed.ledger.steps == 2
    saved_json, saved_tensors = flatten_state(saved)
    again_json, again_tensors = flatten_state(checkpoint_tree(fresh, resumed, None))
    assert again_json == saved_json and set(again_tensors) == set(saved_tensors)
    assert all(torch.equal(saved_tensors[key], again_tensors[key]) for key in saved_tensors)
    for p, q in zip(parts.learner.model.parameters(), fresh.learner.model.parameters()):
        assert torch.equal(p, q)
