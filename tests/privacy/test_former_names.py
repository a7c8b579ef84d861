"""A run directory written before the σ names were unified (issue 27: ``sigma_total`` /
``sigma_gradient`` in ledger.json's metadata, meta.json's plan and the checkpoints' ledgers)
reads and resumes to the same statement and ε as one written now: the rename moves no ε."""

from __future__ import annotations

import json
import shutil

import pytest

from dpclip.accounting.split import FORMER_NAMES
from dpclip.rundir.run import spent
from dpclip.train.workflow import train

QUANTILE = "clipping.threshold={kind: quantile, budget_fraction: 0.1}"  # σ_g differs from the total


def _to_former_names(record: dict) -> None:
    for former, current in FORMER_NAMES.items():
        if current in record:
            record[former] = record.pop(current)


def _edit_json(path, change) -> None:
    payload = json.loads(path.read_text())
    change(payload)
    path.write_text(json.dumps(payload))


def _ledger_to_former_names(ledger: dict) -> None:
    for entry in ledger["entries"]:
        _to_former_names(entry["metadata"])


def _age(run_dir) -> None:
    """Rewrite ``run_dir`` as a run written before the rename."""
    _edit_json(run_dir / "ledger.json", _ledger_to_former_names)
    _edit_json(run_dir / "meta.json", lambda meta: _to_former_names(meta["plan"]))
    for state in (run_dir / "checkpoints").glob("step_*/state.json"):
        _edit_json(state, lambda s: _ledger_to_former_names(s["ledger"]))
    text = (run_dir / "ledger.json").read_text()
    assert "sigma_gradient" in text and "gradient_noise_multiplier" not in text, "nothing was aged"


@pytest.fixture
def run_dir(tiny_recipe):
    return train(tiny_recipe(QUANTILE, "privacy.unsafe_seeded_randomness=true")).run_dir


def _account(cli, run_dir) -> dict:
    result = cli("account", run_dir, "--json")
    assert result.code == 0, result.err
    return json.loads(result.out)


def test_account_report_and_export_read_a_run_written_with_the_former_names(cli, run_dir, tmp_path):
    before = _account(cli, run_dir)
    statement = before["statement"]
    assert statement["gradient_noise_multiplier"] > statement["noise_multiplier"]  # the split is visible
    _age(run_dir)
    after = _account(cli, run_dir)
    assert after["statement"] == statement

    report = cli("report", run_dir)
    assert report.code == 0, report.err
    export = cli("export", run_dir, tmp_path / "export")
    assert export.code == 0, export.err
    card = json.loads((tmp_path / "export" / "privacy.json").read_text())
    assert card["noise_multiplier"] == statement["noise_multiplier"]
    assert card["gradient_noise_multiplier"] == statement["gradient_noise_multiplier"]


@pytest.mark.slow  # an end-to-end run: the slow set (README)
def test_resuming_a_checkpoint_written_with_the_former_names_ends_as_an_untouched_resume(run_dir, tmp_path):
    """A crash after step 2: the newest checkpoint is step 2's, ledger.json has moved on."""
    twin = tmp_path / "twin"
    shutil.copytree(run_dir, twin)
    for folder in (run_dir, twin):
        shutil.rmtree(folder / "checkpoints" / "step_000004")
        (folder / "checkpoints" / "LATEST").write_text("step_000002\n")
        (folder / "summary.json").unlink()
    _age(run_dir)

    train(resume=run_dir)
    train(resume=twin)
    metadata = [entry["metadata"] for entry in json.loads((run_dir / "ledger.json").read_text())["entries"]]
    assert any("sigma_gradient" in m for m in metadata) and any("gradient_noise_multiplier" in m for m in metadata)
    (aged_ledger, aged), (ledger, untouched) = spent(run_dir), spent(twin)
    assert aged.to_dict() == untouched.to_dict() and aged_ledger.steps == ledger.steps == 4
    assert aged.gradient_noise_multiplier > aged.noise_multiplier  # read from both names, not collapsed
