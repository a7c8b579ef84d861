"""The ledger: run-length storage, ε equal to dp_accounting's, what-if, budget cap, JSON."""

from __future__ import annotations

import json
import math
import time

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpclip.accounting import RDP_ORDERS, Ledger, gradient_step_event
from dpclip.errors import AccountingError

STEP = gradient_step_event(0.01, 1.1)
OTHER = gradient_step_event(0.01, 2.0)


def _direct(event, delta, accountant, interval=None):
    if accountant == "rdp":
        return rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS)).compose(event).get_epsilon(delta)
    return pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval).compose(event).get_epsilon(delta)


def test_identical_steps_are_stored_once_with_a_count():
    ledger = Ledger(1e-5)
    for _ in range(1000):
        ledger.record(STEP)
    ledger.record(STEP, count=99_000)
    assert ledger.steps == 100_000
    assert len(ledger.entries) == 1 and ledger.entries[0].count == 100_000
    assert len(json.dumps(ledger.to_dict())) < 2000


def test_different_events_or_metadata_start_new_entries():
    ledger = Ledger(1e-5)
    ledger.record(STEP, 10)
    ledger.record(OTHER, 5)
    ledger.record(OTHER, 5, metadata={"phase": "b"})
    ledger.record(STEP, 1)
    assert [e.count for e in ledger.entries] == [10, 5, 5, 1]
    assert ledger.steps == 21


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_equals_dp_accounting_on_the_composed_event(accountant):
    ledger = Ledger(1e-5, accountant)
    ledger.record(STEP, 300)
    ledger.record(OTHER, 200, metadata={"phase": "b"})
    ledger.record(OTHER, 100)  # same event, other metadata: the same accounting run
    ledger.record(STEP, 50)
    hand_built = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(STEP, 300),
            dp_accounting.SelfComposedDpEvent(OTHER, 300),
            dp_accounting.SelfComposedDpEvent(STEP, 50),
        ]
    )
    assert ledger.composed_event() == hand_built
    result = ledger.result()
    assert result.accountant == accountant
    assert ledger.epsilon() == _direct(hand_built, 1e-5, accountant, result.pld_interval)


def test_epsilon_of_many_identical_steps_is_fast_and_cached():
    ledger = Ledger(1e-5, "pld")
    ledger.record(STEP, 10_000)
    start = time.perf_counter()
    first = ledger.epsilon()
    elapsed = time.perf_counter() - start
    start = time.perf_counter()
    assert ledger.epsilon() == first
    assert time.perf_counter() - start < 0.01
    assert elapsed < 5.0  # typically ~0.1 s; generous because the machine is shared


def test_epsilon_if_predicts_epsilon_after_recording_without_recording():
    ledger = Ledger(1e-5, "pld")
    ledger.record(STEP, 500)
    before = ledger.epsilon()
    predicted = ledger.epsilon_if(STEP, 10)
    predicted_other = ledger.epsilon_if(OTHER)
    assert ledger.steps == 500 and ledger.epsilon() == before
    assert predicted > before and predicted_other > before
    ledger.record(STEP, 10, metadata={"any": "metadata"})
    assert ledger.epsilon() == predicted


def test_empty_ledger_has_zero_epsilon():
    assert Ledger(1e-5).epsilon() == 0.0


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_budget_cap_allows_exactly_the_steps_within_the_cap(accountant):
    n = 400
    reference = Ledger(1e-5, accountant)
    reference.record(OTHER, 100)
    reference.record(STEP, n)
    cap = reference.epsilon()  # the cap is reached exactly after n steps of STEP

    ledger = Ledger(1e-5, accountant)
    ledger.record(OTHER, 100)
    ledger.record(STEP, n - 1)
    assert ledger.allows(STEP, cap)
    assert not ledger.allows(STEP, cap, count=2)
    ledger.record(STEP)
    assert not ledger.allows(STEP, cap)
    assert ledger.allows(STEP, cap * 1.5)
    # Agrees with the exact what-if test.
    assert ledger.allows(STEP, cap) == (ledger.epsilon_if(STEP) <= cap)


def test_ledger_round_trips_through_json():
    ledger = Ledger(1e-6, "pld")
    ledger.record(STEP, 1234, metadata={"gradient_noise_multiplier": 1.1, "releases": ["gradient"]})
    ledger.record(OTHER, 7)
    ledger.record(STEP, 3, metadata={"gradient_noise_multiplier": 1.1, "releases": ["gradient"]})
    d = json.loads(json.dumps(ledger.to_dict(), allow_nan=False))
    assert d["delta"] == 1e-6 and d["accountant"] == "pld" and d["steps"] == 1244
    assert d["epsilon"] == pytest.approx(ledger.epsilon())
    again = Ledger.from_dict(d)
    assert again == ledger
    assert again.epsilon() == ledger.epsilon()
    # Recording after a reload continues the last entry exactly like the original.
    again.record(STEP, 1, metadata={"gradient_noise_multiplier": 1.1, "releases": ["gradient"]})
    ledger.record(STEP, 1, metadata={"gradient_noise_multiplier": 1.1, "releases": ["gradient"]})
    assert again == ledger


def test_stored_epsilon_is_not_trusted_when_loading():
    ledger = Ledger(1e-5)
    ledger.record(STEP, 100)
    d = ledger.to_dict()
    d["epsilon"] = 0.001
    assert Ledger.from_dict(d).epsilon() == ledger.epsilon()


def test_non_private_step_is_stored_as_json_null_epsilon():
    ledger = Ledger(1e-5)
    ledger.record(gradient_step_event(0.01, 0.0))
    d = ledger.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["epsilon"] is None and math.isinf(Ledger.from_dict(d).epsilon())


@pytest.mark.parametrize(
    "broken",
    [
        {},
        {"format": "something else"},
        {"format": "dpclip.ledger/1", "delta": 1e-5, "accountant": "pld"},
        {"format": "dpclip.ledger/1", "delta": 1e-5, "accountant": "pld", "entries": [{"count": 1}]},
        {"format": "dpclip.ledger/1", "delta": 2.0, "accountant": "pld", "entries": []},
    ],
)
def test_malformed_ledger_is_refused_with_an_accounting_error(broken):
    with pytest.raises(AccountingError):
        Ledger.from_dict(broken)


def test_metadata_must_be_json_serialisable():
    with pytest.raises(AccountingError):
        Ledger(1e-5).record(STEP, metadata={"x": object()})
    with pytest.raises(AccountingError):
        Ledger(1e-5).record(STEP, count=0)
