"""Files in a run directory are input, not truth: an edited ledger or LATEST pointer must
be refused, not believed (an edited ledger would understate ε)."""

from __future__ import annotations

import json

import pytest

from dpclip.accounting import Ledger
from dpclip.errors import DpclipError
from dpclip.rundir.run import spent
from dpclip.train.workflow import train


@pytest.fixture
def run_dir(tiny_recipe):
    return train(tiny_recipe()).run_dir


def _edit_json(path, change):
    payload = json.loads(path.read_text())
    change(payload)
    path.write_text(json.dumps(payload))


def test_latest_pointing_outside_the_run_is_refused(run_dir, tmp_path):
    outside = tmp_path / "elsewhere" / "step_000004"
    outside.mkdir(parents=True)
    for name in ("state.json", "state.safetensors", "model.safetensors"):
        (outside / name).write_bytes((run_dir / "checkpoints" / "step_000004" / name).read_bytes())
    (run_dir / "checkpoints" / "LATEST").write_text("../../elsewhere/step_000004\n")
    with pytest.raises(DpclipError) as info:
        train(resume=run_dir)
    assert "not a checkpoint of this run" in info.value.message


def test_checkpoint_whose_state_is_another_step_is_refused(run_dir):
    _edit_json(run_dir / "checkpoints" / "step_000004" / "state.json", lambda s: s.update(step=2))
    with pytest.raises(DpclipError) as info:
        train(resume=run_dir)
    assert "does not hold step 4" in info.value.message


def _fewer_steps(state):
    state["ledger"]["entries"][0]["count"] = 1
    state["ledger"]["steps"] = 1


def test_checkpoint_ledger_with_fewer_steps_than_its_step_is_refused_on_resume(run_dir):
    _edit_json(run_dir / "checkpoints" / "step_000004" / "state.json", _fewer_steps)
    with pytest.raises(DpclipError) as info:
        train(resume=run_dir)
    assert "records 1 steps" in info.value.message


def _more_noise(ledger):
    ledger["entries"][0]["event"]["event"]["noise_multiplier"] *= 2


def test_ledger_with_a_larger_noise_multiplier_is_refused_by_account(run_dir):
    ledger, _ = spent(run_dir)
    assert ledger.steps == 4
    _edit_json(run_dir / "ledger.json", _more_noise)
    with pytest.raises(DpclipError) as info:
        spent(run_dir)
    assert "not this run's step event" in info.value.message


def test_ledger_with_more_steps_than_planned_is_refused_by_account(run_dir):
    ledger = Ledger.from_dict(json.loads((run_dir / "ledger.json").read_text()))
    ledger.record(ledger.entries[0].event, count=10, metadata=ledger.entries[0].metadata)
    (run_dir / "ledger.json").write_text(json.dumps(ledger.to_dict()))
    with pytest.raises(DpclipError):
        spent(run_dir)


def test_audit_refuses_a_checkpoint_whose_ledger_was_edited(run_dir):
    from dpclip.audit.report import audit

    _edit_json(run_dir / "checkpoints" / "step_000004" / "state.json", _fewer_steps)
    with pytest.raises(DpclipError) as info:
        audit(run_dir, ["loss"], bootstrap=0, write=False)
    assert "records 1 steps" in info.value.message


def test_account_cli_refuses_an_edited_ledger_with_error_and_hint(run_dir, cli):
    _edit_json(run_dir / "ledger.json", _more_noise)
    result = cli("account", str(run_dir))
    assert result.code != 0
    assert "error:" in result.err and "hint:" in result.err and "Traceback" not in result.err


def _cut_to(steps: int):
    """An edit of ledger.json: its first entry alone, cut back to ``steps`` steps."""
    def cut(ledger):
        ledger["entries"] = ledger["entries"][:1]
        ledger["entries"][0]["count"] = steps
        ledger["steps"] = steps
    return cut


def _refused_where_stated(cli, run_dir, tmp_path, command: str, message: str) -> None:
    """``command`` (account, report, export) on the run exits 2 with ``message`` and a hint, exporting nothing."""
    extra = [str(tmp_path / "exported")] if command == "export" else []
    result = cli(command, str(run_dir), *extra)
    assert result.code == 2 and message in result.err and "hint:" in result.err
    assert not (tmp_path / "exported").exists()


@pytest.mark.parametrize("command", ["account", "report", "export"])
def test_a_ledger_behind_the_run_s_checkpoint_is_refused_where_epsilon_is_stated(run_dir, cli, tmp_path, command):
    """ledger.json cut back to 1 step while step_000004 holds the weights after 4: account, report
    and export stated the ε of 1 step for weights that cost 4."""
    _edit_json(run_dir / "ledger.json", _cut_to(1))
    with pytest.raises(DpclipError, match="records 1 steps, but checkpoint step_000004"):
        spent(run_dir)
    _refused_where_stated(cli, run_dir, tmp_path, command, "records 1 steps, but checkpoint step_000004")


@pytest.mark.slow  # a run per command: the slow set (README)
@pytest.mark.parametrize("command", ["account", "report", "export"])
def test_a_ledger_cut_back_with_the_later_checkpoints_is_refused_by_its_metrics(run_dir, cli, tmp_path, command):
    """ledger.json cut back to 2 steps, step_000004 deleted and LATEST pointed at step_000002: no
    checkpoint is ahead of the ledger, but metrics.jsonl (written after the ledger, each step)
    still records step 4; account, report and export stated the ε of 2 steps for a run that
    released 4."""
    import shutil

    _edit_json(run_dir / "ledger.json", _cut_to(2))
    shutil.rmtree(run_dir / "checkpoints" / "step_000004")
    (run_dir / "checkpoints" / "LATEST").write_text("step_000002\n")
    with pytest.raises(DpclipError, match="records 2 steps, but metrics.jsonl records step 4"):
        spent(run_dir)
    _refused_where_stated(cli, run_dir, tmp_path, command, "metrics.jsonl records step 4")
