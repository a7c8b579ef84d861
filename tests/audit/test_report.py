"""The audit report's (ε, δ): what it sets the measured leakage beside (dpclip/audit/report.py)."""

import dataclasses

import numpy as np
import pytest

from dpclip.audit import audit
from dpclip.audit import report as audit_report
from dpclip.audit.metrics import dp_tpr_bound
from dpclip.rundir.searchdir import Headline, headline
from dpclip.train.workflow import train


@pytest.mark.slow   # 8 s: trains a 2-step run with canaries and audits it
def test_a_search_selected_runs_audit_takes_epsilon_and_delta_from_the_search_statement(tiny_recipe, monkeypatch,
                                                                                         tmp_path):
    """An ε holds at its own δ: pairing the search's ε with the run's δ (equal today, not by
    contract) would compare the one-run bound, computed at the run's δ, with an ε stated at another."""
    run = train(tiny_recipe("audit.canaries.count=40", "training.steps=2")).run_dir
    own = headline(run)
    search = dataclasses.replace(own.statement, epsilon=3 * own.epsilon, delta=own.delta / 10)
    monkeypatch.setattr(audit_report, "headline",
                        lambda run_dir: Headline(search, own.ledger, own.statement, own.run_ledger, tmp_path / "search"))
    report = audit(run, ["one-run"], write=False)
    ledger = report["ledger"]
    assert (ledger["epsilon"], ledger["delta"]) == (search.epsilon, search.delta)
    assert ledger["epsilon_this_run_alone"] == pytest.approx(own.epsilon)
    assert ledger["delta_this_run_alone"] == own.delta
    assert report["one_run"]["delta"] == search.delta   # the bound is computed at the δ it is compared at
    allowed = dp_tpr_bound(np.array([0.01]), search.epsilon, search.delta)[0]
    assert ledger["tpr_bound"]["fpr_1%"] == pytest.approx(allowed)
    assert any(f"δ = {search.delta:g}" in note for note in report["notes"])
