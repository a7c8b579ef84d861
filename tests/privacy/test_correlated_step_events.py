"""A DPEngine with correlated noise (``noise_correlation``) reports no per-step DpEvent: its steps
are not independent mechanisms, and composing one event per step (docs/engine.md's loop,
``ledger.record(report.dp_event)``) would be DP-SGD's accounting. Measured here: at q = 1 with
banded MF (b = 4, T = 20) every example is in every step, the mechanism is one Gaussian of
multiplier σ/‖C·1‖ with ‖C·1‖ ≈ 7.9 > √T ≈ 4.5, and the per-step composition charged about half its
ε. The ledger refuses the missing event with a hint; the step's release as one participation stays
in the report (``participation_event``) for the plan's check."""

from __future__ import annotations

import dp_accounting
import pytest
import torch
from torch import nn

from dpclip.accounting import Ledger
from dpclip.engine import DPEngine
from dpclip.engine.correlated import banded_strategy, toeplitz_strategy
from dpclip.errors import DpclipError

STEPS, SIGMA = 20, 4.0


def _reports(correlation, sample_rate: float) -> list:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=SIGMA,
                      expected_batch_size=8, sample_rate=sample_rate, noise_correlation=correlation)
    x, reports = torch.randn(8, 4), []
    for _ in range(STEPS):
        engine.backward(model(x).pow(2).sum(1))
        reports.append(engine.privatize())
    engine.detach()
    return reports


def test_a_correlated_step_has_no_event_of_its_own_and_the_ledger_refuses_to_compose_it():
    strategy = banded_strategy(4, STEPS)
    dense = toeplitz_strategy(strategy, STEPS)
    whole = float((dense @ torch.ones(STEPS, dtype=dense.dtype)).norm())   # every example in every step
    mechanism = dp_accounting.pld.PLDAccountant().compose(dp_accounting.GaussianDpEvent(SIGMA / whole)).get_epsilon(1e-5)
    per_step = Ledger(delta=1e-5)
    per_step.record(dp_accounting.GaussianDpEvent(SIGMA), count=STEPS)   # what the report used to say, each step
    assert per_step.epsilon() < 0.6 * mechanism   # why no per-step event may be reported

    reports = _reports(strategy, 1.0)
    assert all(r.dp_event is None for r in reports)
    assert reports[0].participation_event == dp_accounting.GaussianDpEvent(SIGMA)
    with pytest.raises(DpclipError) as refused:
        Ledger(delta=1e-5).record(reports[0].dp_event)
    assert "correlated" in str(refused.value) and "event_at" in refused.value.hint


def test_an_uncorrelated_steps_event_is_its_participation():
    report = _reports(None, 0.5)[0]
    expected = dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(SIGMA))
    assert report.dp_event == expected == report.participation_event
