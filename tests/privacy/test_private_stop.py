"""An attacker reads where a stopped run's ledger, metrics and checkpoints end. A step that raises
on its private batch (the model's own error on some input, the certificate refusing a batch size
it mixes at) stops the run at a step that follows the private draws, and before the fix no
statement of the run said so. Now plan.json keeps that it happened (not where), and every statement
of the run names it, after a resume too (docs/accounting.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

import dpclip.train.output as output
from dpclip.errors import EngineError
from dpclip.planning.plan import PRIVATE_STOP
from dpclip.rundir.run import RunDir, spent
from dpclip.train.step import PrivateStep
from dpclip.train.workflow import train


def _stopped_at(monkeypatch, step: int):
    """The private step as if the engine refused the batch drawn at ``step`` (0-based)."""
    real, calls = PrivateStep.__call__, []

    def refusing(self, indices, **kwargs):
        calls.append(1)
        if len(calls) == step + 1:
            raise EngineError("module 0 mixes samples [computed from the private batch: not covered by ε]", "-")
        return real(self, indices, **kwargs)
    monkeypatch.setattr(PrivateStep, "__call__", refusing)


def _failing_at(monkeypatch, target, name: str, call: int):
    """``target.name`` raising a disk error at its ``call``-th call (1-based)."""
    real, calls = getattr(target, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)
    monkeypatch.setattr(target, name, failing)


def _only_run(recipe) -> Path:
    (run_dir,) = [p for p in Path(recipe.output_dir).iterdir() if p.is_dir()]
    return run_dir


@pytest.mark.slow  # an end-to-end resume: the slow set (README)
def test_a_run_stopped_by_a_refusal_states_its_stop_not_covered_and_keeps_it_after_a_resume(
        tiny_recipe, monkeypatch):
    _stopped_at(monkeypatch, 3)
    recipe = tiny_recipe("training.steps=6", "checkpoint.every_steps=2")
    with pytest.raises(EngineError, match="mixes samples"):
        train(recipe)
    (run_dir,) = [p for p in Path(recipe.output_dir).iterdir() if p.is_dir()]
    ledger, statement = spent(run_dir)
    assert ledger.steps == 3
    assert PRIVATE_STOP in statement.not_covered
    assert RunDir(run_dir).public_plan()["stopped_on_private_batch"] is True   # the fact, not the step
    monkeypatch.undo()
    result = train(resume=run_dir)
    assert result.steps_done == 6
    assert any(PRIVATE_STOP in line for line in result.statement)
    assert PRIVATE_STOP in spent(run_dir)[1].not_covered


def test_a_run_that_no_error_stopped_states_no_stop(tiny_recipe):
    result = train(tiny_recipe())
    assert PRIVATE_STOP not in spent(result.run_dir)[1].not_covered
    assert not any(PRIVATE_STOP in line for line in result.statement)


def test_a_run_its_model_stopped_on_a_batch_states_the_stop(tiny_recipe, monkeypatch):
    _stopped_at(monkeypatch, 1)
    recipe = tiny_recipe()
    with pytest.raises(EngineError, match="mixes samples"):
        train(recipe)
    assert PRIVATE_STOP in spent(_only_run(recipe))[1].not_covered


def test_a_run_a_disk_error_stopped_after_its_step_was_charged_states_no_private_stop(tiny_recipe, monkeypatch):
    _failing_at(monkeypatch, output, "append_record", 2)   # the second step's metrics.jsonl record
    recipe = tiny_recipe()
    with pytest.raises(OSError, match="No space left"):
        train(recipe)
    run_dir = _only_run(recipe)
    ledger, statement = spent(run_dir)
    assert ledger.steps == 2   # charged, then its record's write failed: where it stopped follows no batch
    assert "stopped_on_private_batch" not in RunDir(run_dir).public_plan()
    assert PRIVATE_STOP not in statement.not_covered
