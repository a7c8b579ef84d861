"""A crash must never leave a release uncharged, and a resume must never release twice.

The attacker here is the crash itself: a process killed between two writes, or between
a step's release and the next checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dpclip.accounting import Ledger
from dpclip.errors import DpclipError
from dpclip.rundir import checkpoint as checkpoint_module
from dpclip.train import output
from dpclip.train import state as state_module
from dpclip.train import trainer
from dpclip.train.workflow import train


def _disk_ledger_steps(run_dir) -> int:
    path = run_dir / "ledger.json"
    return json.loads(path.read_text())["steps"] if path.exists() else 0


def test_ledger_on_disk_is_never_behind_what_left_the_process(tiny_recipe, monkeypatch):
    """Every metrics record and every checkpoint made current is already charged on disk."""
    seen = []
    append, save = output.append_record, state_module.save_checkpoint

    def checked_append(path, record):
        seen.append(("metrics", record["step"], _disk_ledger_steps(path.parent)))
        append(path, record)

    def checked_save(run_dir, step, model, state, keep):
        seen.append(("checkpoint", step, _disk_ledger_steps(run_dir)))
        return save(run_dir, step, model, state, keep)

    monkeypatch.setattr(output, "append_record", checked_append)
    monkeypatch.setattr(state_module, "save_checkpoint", checked_save)
    train(tiny_recipe("clipping.threshold={kind: quantile, budget_fraction: 0.1}", "eval.every_steps=2"))
    assert seen and all(charged >= step for _, step, charged in seen), seen


def _crashed_copy(run_dir, dest, checkpoint_step: int, crash_step: int):
    """``run_dir`` as a process killed right after step ``crash_step`` would have left it."""
    shutil.copytree(run_dir, dest)
    for folder in (dest / "checkpoints").iterdir():
        if folder.is_dir() and int(folder.name.split("_")[1]) > checkpoint_step:
            shutil.rmtree(folder)
    (dest / "checkpoints" / "LATEST").write_text(f"step_{checkpoint_step:06d}\n")
    ledger = Ledger.from_dict(json.loads((dest / "ledger.json").read_text()))
    cut = Ledger(ledger.delta, ledger.accountant)
    entry = ledger.entries[0]
    cut.record(entry.event, count=crash_step, metadata=entry.metadata)
    (dest / "ledger.json").write_text(json.dumps(cut.to_dict()))
    lines = (dest / "metrics.jsonl").read_text().splitlines()
    (dest / "metrics.jsonl").write_text("".join(l + "\n" for l in lines if json.loads(l)["step"] <= crash_step))
    return dest


def _records(path):
    """The records, without what legitimately differs after a resume: wall time, and the
    certificate's record (a resumed process checks again each batch shape it has not seen
    itself, docs/certificate.md; a not-covered diagnostic of the check alone)."""
    out = [json.loads(line) for line in path.read_text().splitlines()]
    for record in out:
        record.pop("seconds", None)
        (record.get("diagnostics") or {}).pop("certificate", None)
    return out


def _up_to(path, step: int):
    return [r for r in _records(path) if r["step"] <= step]


def test_redone_steps_replay_the_released_thresholds_exactly(tiny_recipe, tmp_path):
    """Adaptive thresholds are released every step (noisy quantile counts). The steps redone
    after a crash use the checkpoint's generator states: same batches, same noise, so the
    same thresholds; nothing is released twice and the ledger ends where it would have. (The
    steps after them draw fresh streams: test_forked_resumes.py.)"""
    recipe = tiny_recipe("training.steps=8", "checkpoint.every_steps=4", "checkpoint.keep=5",
                         "clipping.threshold={kind: quantile, budget_fraction: 0.1}")
    full = train(recipe).run_dir
    crashed = _crashed_copy(full, tmp_path / "crashed", checkpoint_step=4, crash_step=6)
    train(resume=crashed)
    assert _up_to(crashed / "metrics.jsonl", 6) == _up_to(full / "metrics.jsonl", 6)
    steps = [[r["step"] for r in _records(run / "metrics.jsonl")] for run in (crashed, full)]
    assert steps[0] == steps[1]
    assert json.loads((crashed / "ledger.json").read_text()) == json.loads((full / "ledger.json").read_text())


def test_crash_before_the_first_regular_checkpoint_replays_from_step_zero(tiny_recipe, tmp_path):
    recipe = tiny_recipe("training.steps=6", "checkpoint.every_steps=null", "checkpoint.keep=5",
                         "clipping.threshold={kind: quantile, budget_fraction: 0.1}")
    full = train(recipe).run_dir
    assert (full / "checkpoints" / "step_000000").is_dir(), "step 0 is checkpointed with the generators"
    crashed = _crashed_copy(full, tmp_path / "crashed", checkpoint_step=0, crash_step=3)
    train(resume=crashed)
    assert _up_to(crashed / "metrics.jsonl", 3) == _up_to(full / "metrics.jsonl", 3)


def test_a_replay_that_would_release_something_new_stops_the_resume(tiny_recipe, tmp_path):
    recipe = tiny_recipe("training.steps=8", "checkpoint.every_steps=4", "checkpoint.keep=5",
                         "clipping.threshold={kind: quantile, budget_fraction: 0.1}")
    full = train(recipe).run_dir
    crashed = _crashed_copy(full, tmp_path / "crashed", checkpoint_step=4, crash_step=6)
    # As if the first run had released other thresholds at step 6 (another device, another torch).
    records = [json.loads(l) for l in (crashed / "metrics.jsonl").read_text().splitlines()]
    records[5]["thresholds"] = [t * 1.0001 for t in records[5]["thresholds"]]
    (crashed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(DpclipError) as info:
        train(resume=crashed)
    assert "step 6" in info.value.message and "twice" in info.value.message
    assert json.loads((crashed / "ledger.json").read_text())["steps"] == 6  # not rolled back


def test_checkpoint_holds_the_private_generator_states(tiny_recipe):
    """Without them a resumed run would draw fresh noise for the redone steps: a second release."""
    from dpclip.rundir.checkpoint import load_checkpoint
    from dpclip.data import load_data
    from dpclip.models import build_model

    recipe = tiny_recipe()
    run = train(recipe).run_dir
    model, _ = build_model(recipe.model, load_data(recipe.data, seed=recipe.seed), seed=recipe.seed)
    state = load_checkpoint(run / "checkpoints" / "step_000002", model)
    assert state["engine"]["noise"]["states"]["cpu"].numel() == 5056
    assert state["sampler"]["generator"].numel() == 5056


def test_a_replay_whose_exact_diagnostics_differ_resumes_without_writing_them_again(tiny_recipe, tmp_path):
    """Diagnostics are not charged releases, and a replay never re-emits them: float noise
    there (another thread count) must not make a run impossible to resume."""
    recipe = tiny_recipe("training.steps=8", "checkpoint.every_steps=4", "checkpoint.keep=5")
    full = train(recipe).run_dir
    crashed = _crashed_copy(full, tmp_path / "crashed", checkpoint_step=4, crash_step=6)
    records = [json.loads(l) for l in (crashed / "metrics.jsonl").read_text().splitlines()]
    records[5]["diagnostics"]["train_loss"] += 1e-6
    (crashed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    train(resume=crashed)
    after = [json.loads(l) for l in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert after[5] == records[5]
    assert [r["step"] for r in after if "eval" not in r] == list(range(1, 9))


def test_resuming_before_a_newer_complete_checkpoint_is_refused(tiny_recipe):
    """LATEST set back by hand, two checkpoints (one newer is what a kill between the folder and
    LATEST leaves: resumed from, test below): the steps
    after it would be redone with the noise a newer, kept checkpoint's weights already hold; with
    another lr the two weights' difference is a difference of gradients without noise."""
    run = train(tiny_recipe("training.steps=6", "checkpoint.keep=5")).run_dir
    (run / "checkpoints" / "LATEST").write_text("step_000002\n")
    with pytest.raises(DpclipError) as info:
        train(resume=run)
    assert "step_000006 is complete and newer" in info.value.message
    assert "step_000006" in info.value.hint
    (run / "checkpoints" / "LATEST").write_text("step_000006\n")
    assert train(resume=run).steps_done == 6     # as the hint says


def test_the_closing_checkpoint_is_not_rewritten_over_the_one_of_its_step(tiny_recipe, saved_checkpoint_steps):
    """Rewriting step_N's folder renames it away for a moment in which LATEST names nothing: a
    crash then left a run that neither resumed nor exported."""
    saved = saved_checkpoint_steps
    run = train(tiny_recipe("training.steps=4", "checkpoint.every_steps=2")).run_dir
    assert saved == [0, 2, 4]
    train(resume=run)                      # a finished run resumed: nothing to redo, nothing to write
    assert saved == [0, 2, 4]


@pytest.mark.slow
def test_a_run_killed_after_its_final_evaluation_resumes_without_writing_it_twice(tiny_recipe):
    """The final evaluation follows the closing checkpoint; killed before summary.json, the run
    resumes from that checkpoint and evaluates again: metrics.jsonl must keep one line of it."""
    run = train(tiny_recipe("eval.every_steps=2")).run_dir
    (run / "summary.json").unlink()          # as a kill -9 after the last metrics line leaves it
    before = (run / "metrics.jsonl").read_text()
    assert train(resume=run).steps_done == 4
    assert (run / "metrics.jsonl").read_text() == before
    assert [r["step"] for r in _records(run / "metrics.jsonl") if "eval" in r] == [2, 4]


class _Killed(BaseException):
    """The process killed (kill -9, a power cut) at this point."""


@pytest.mark.slow
@pytest.mark.parametrize("killed_at", [0, 2])
def test_a_run_killed_between_a_checkpoints_folder_and_latest_resumes_from_that_checkpoint(
        tiny_recipe, monkeypatch, killed_at):
    """The folder is renamed into place, then LATEST is replaced: a kill between the two left a
    run whose --resume was refused (a complete checkpoint newer than LATEST; at step 0, none named)."""
    real = checkpoint_module.write_text_atomic

    def killed(path, text, *args):
        if path.name == "LATEST" and text.strip() == f"step_{killed_at:06d}":
            raise _Killed
        return real(path, text, *args)

    monkeypatch.setattr(checkpoint_module, "write_text_atomic", killed)
    recipe = tiny_recipe("checkpoint.keep=5")
    with pytest.raises(_Killed):
        train(recipe)
    monkeypatch.setattr(checkpoint_module, "write_text_atomic", real)
    run = next(Path(recipe.output_dir).iterdir())
    assert train(resume=run).steps_done == 4
    assert (run / "checkpoints" / "LATEST").read_text() == "step_000004\n"
    assert [r["step"] for r in _records(run / "metrics.jsonl") if "eval" not in r] == [1, 2, 3, 4]


def test_a_resume_interrupted_while_redoing_released_steps_reports_every_released_step(
        tiny_recipe, tmp_path, monkeypatch):
    """Ctrl-C while a resume redoes the steps a crash lost: the model stops behind what was
    released (steps 5-6 of 8 redone), yet summary.json and the returned ε must still count the
    8 released steps, as ledger.json, dpclip report and dpclip account do."""
    recipe = tiny_recipe("training.steps=8", "checkpoint.every_steps=4", "checkpoint.keep=5",
                         "clipping.threshold={kind: quantile, budget_fraction: 0.1}")
    full = train(recipe).run_dir
    crashed = _crashed_copy(full, tmp_path / "crashed", checkpoint_step=4, crash_step=8)

    class CtrlCAfterTwoSteps(trainer.DeferredInterrupt):
        checks = 0

        @property
        def requested(self):   # read before each step: the third read stops the run after step 6
            CtrlCAfterTwoSteps.checks += 1
            return CtrlCAfterTwoSteps.checks > 2

        @requested.setter
        def requested(self, value):
            pass

    monkeypatch.setattr(trainer, "DeferredInterrupt", CtrlCAfterTwoSteps)
    result = train(resume=crashed)
    assert result.stopped == "interrupted"
    released = json.loads((crashed / "ledger.json").read_text())
    assert released["steps"] == 8, "ledger.json never moves back"
    summary = json.loads((crashed / "summary.json").read_text())
    assert summary["epsilon"] == pytest.approx(released["epsilon"]) == pytest.approx(result.epsilon)
    assert summary["steps_done"] == 8
    assert any("steps: 8" in line for line in summary["statement"])
