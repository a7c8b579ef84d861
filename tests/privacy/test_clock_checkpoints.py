"""An attacker lists a run's released checkpoint folders. ``checkpoint.every_minutes`` (on by
default) saves at the first step boundary M minutes after the last checkpoint, so the
step a clock checkpoint is named by (``checkpoints/step_000k``, ``LATEST``, an export's
``checkpoint_step``) says how long the steps before it took: their wall time follows the
realised Poisson batch sizes, an exact function of private data. Before the fix the
statement named no such thing, and with ``privacy.exact_diagnostics: false`` it named no
timing at all, while the folder names still carried it.

Now the statement lists the clock's checkpoint steps as not covered by ε whenever the
recipe's clock is on, with or without exact diagnostics, and never when it is off; and after
a resume that turned it off, since the folders it named before stay."""

from __future__ import annotations

import pytest

import dpclip.train.state as train_state
from dpclip.accounting.statement import dataset_size_line
from dpclip.planning.plan import HELD_OUT_CUT, PRIVATE_HESSIAN_DIAGNOSTICS, not_covered, not_covered_of_run
from dpclip.files import write_json_atomic
from dpclip.recipe import recipe_to_yaml
from dpclip.rundir.privacy_fields import privacy_fingerprint, recipe_changes
from dpclip.rundir.run import RunDir, record_resume_changes, spent
from dpclip.train.workflow import train
from tests.privacy.test_crash_and_resume import _crashed_copy


class _SlowClock:
    """time.monotonic as seen by the checkpointer: every reading 11 minutes after the last."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 11 * 60.0
        return self.now


def _uncovered(run_dir) -> list[str]:
    _, statement = spent(run_dir)
    return [line for line in statement.lines() if line.startswith("not covered by ε")]


@pytest.mark.parametrize("exact", ["true", "false"])
def test_checkpoints_made_by_the_clock_are_listed_not_covered(tiny_recipe, monkeypatch, exact):
    monkeypatch.setattr(train_state, "time", _SlowClock())
    result = train(tiny_recipe(f"privacy.exact_diagnostics={exact}", "checkpoint.every_steps=null",
                               "checkpoint.every_minutes=10", "checkpoint.keep=10"))
    folders = sorted(p.name for p in (result.run_dir / "checkpoints").glob("step_*"))
    assert "step_000001" in folders   # saved by the clock, not by a step count: its name is a timing
    uncovered = _uncovered(result.run_dir)
    assert any("checkpoint.every_minutes" in line for line in uncovered), uncovered
    assert any("checkpoint.every_minutes" in line for line in result.statement), result.statement


def test_a_run_without_the_clock_lists_no_clock_checkpoints(tiny_recipe):
    result = train(tiny_recipe("privacy.exact_diagnostics=false", "checkpoint.every_minutes=null"))
    assert _uncovered(result.run_dir) == [f"not covered by ε: {line}" for line in
                                          (dataset_size_line('example'), HELD_OUT_CUT)]


def test_a_resume_that_turns_the_clock_off_still_lists_the_clock_checkpoints_made_before(
        tiny_recipe, monkeypatch, tmp_path):
    """The folders the clock named before the resume stay in the run directory, so the line stays
    with every later statement of the run (account, report, export, the summary)."""
    monkeypatch.setattr(train_state, "time", _SlowClock())
    recipe = tiny_recipe("checkpoint.every_steps=null", "checkpoint.every_minutes=10", "checkpoint.keep=10")
    full = train(recipe).run_dir
    crashed = _crashed_copy(full, tmp_path / "crashed", checkpoint_step=2, crash_step=2)
    assert (crashed / "checkpoints" / "step_000001").is_dir()   # a folder the clock named
    result = train(recipe.model_copy(update={"checkpoint": recipe.checkpoint.model_copy(
        update={"every_minutes": None})}), resume=crashed)
    assert any("checkpoint.every_minutes" in line for line in _uncovered(crashed))
    assert any("checkpoint.every_minutes" in line for line in result.statement), result.statement


def test_each_earlier_recipe_of_a_resumed_run_keeps_its_not_covered_lines(tiny_recipe, tmp_path):
    """Hessian diagnostics on private data turned off by a resume at step 4: diagnostics.jsonl still
    holds their records, so the run's statement keeps the line (the fields a resume may change are
    the non-privacy ones: checkpointing, diagnostics). plan.json (released) keeps the line."""
    now = tiny_recipe()
    before = tiny_recipe("diagnostics.every_steps=2", "diagnostics.data=private",
                         "diagnostics.private_not_covered=true")
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.recipe_file.write_text(recipe_to_yaml(before))
    write_json_atomic(run.meta_file, {"privacy_fingerprint": privacy_fingerprint(before)})
    write_json_atomic(run.plan_file, {"privacy_fingerprint": privacy_fingerprint(before)})
    record_resume_changes(run, now, 4, recipe_changes(before, now))
    assert PRIVATE_HESSIAN_DIAGNOSTICS not in not_covered(now)
    assert PRIVATE_HESSIAN_DIAGNOSTICS in not_covered_of_run(now, run.public_plan())
    assert not_covered_of_run(now, {}) == not_covered(now)
