"""Every registered threshold policy keeps the contract of tests/engine/policies/contract.py."""

import pytest

from dpclip.engine.policies import policy_specs, validate_policy
from tests.engine.policies.contract import (check_engine_dict, check_neighbouring_batches,
                                            check_planner_agrees_with_engine, check_roll_back,
                                            check_state_round_trip)

KINDS = [spec.kind_name() for spec in policy_specs()]


def test_every_registered_policy_carries_a_valid_example():
    assert {"fixed", "quantile", "dcsgd-p", "dcsgd-e", "discriminative"} <= set(KINDS)
    for spec in policy_specs():
        assert spec.example.get("kind") == spec.kind_name(), spec
        assert isinstance(validate_policy(dict(spec.example)), spec)


@pytest.mark.parametrize("kind", KINDS)
def test_state_round_trip_continues_identically(kind):
    check_state_round_trip(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_neighbouring_batches_move_outputs_by_at_most_the_declared_sensitivity(kind):
    check_neighbouring_batches(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_planner_charges_the_sensitivity_the_engine_reports(kind):
    check_planner_agrees_with_engine(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_engine_dict_carries_the_budget_splits_noise(kind):
    check_engine_dict(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_a_rolled_back_release_leaves_the_policy_as_one_that_never_saw_the_step(kind):
    check_roll_back(kind)
