"""Events: the step event, the joint release and JSON round-trips."""

from __future__ import annotations

import json
import math
import random

import dp_accounting
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st

from dpclip.accounting import (
    SERIALIZABLE_EVENT_TYPES,
    event_from_dict,
    event_to_dict,
    gradient_step_event,
    joint_noise_multiplier,
    training_event,
)
from dpclip.errors import AccountingError


def test_gradient_step_event_is_poisson_sampled_gaussian():
    assert gradient_step_event(0.01, 1.3) == dp_accounting.PoissonSampledDpEvent(
        0.01, dp_accounting.GaussianDpEvent(1.3)
    )


def test_gradient_step_event_without_sampling_is_plain_gaussian():
    assert gradient_step_event(1.0, 2.0) == dp_accounting.GaussianDpEvent(2.0)


def test_gradient_step_event_without_noise_is_non_private():
    assert gradient_step_event(0.1, 0.0) == dp_accounting.NonPrivateDpEvent()


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5, float("nan")])
def test_gradient_step_event_rejects_sample_rate_outside_unit_interval(q):
    with pytest.raises(AccountingError) as info:
        gradient_step_event(q, 1.0)
    assert info.value.hint


def test_training_event_self_composes_the_step_event():
    assert training_event(0.02, 1.1, 500) == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1)), 500
    )


@pytest.mark.parametrize("steps", [0, -3, 2.5, True])
def test_training_event_rejects_non_positive_or_non_integer_steps(steps):
    with pytest.raises(AccountingError):
        training_event(0.02, 1.1, steps)


def test_joint_noise_multiplier_without_aux_is_the_gradient_multiplier():
    assert joint_noise_multiplier(1.7, []) == pytest.approx(1.7, rel=1e-15)


def test_joint_noise_multiplier_matches_dc_sgd_example():
    # docs/accounting.md: σ = 1, σ_H = 10 -> σ_T = 1.00504; i.e. joint(1.00504, (1, 10)) = 1.
    sigma_t = (1.0 - 10.0**-2) ** -0.5
    assert sigma_t == pytest.approx(1.00504, abs=1e-5)
    assert joint_noise_multiplier(sigma_t, [(1.0, 10.0)]) == pytest.approx(1.0, rel=1e-12)


def test_joint_release_has_the_epsilon_of_the_hand_built_composed_event():
    """docs/accounting.md, joint release: PoissonSampled(q, Gaussian(σ_eff)) equals RDP's PoissonSampled(q, Composed(...))."""
    rng = random.Random(7)
    for _ in range(5):
        q = rng.uniform(0.001, 0.2)
        sigma_g = rng.uniform(0.6, 3.0)
        aux = [(rng.uniform(0.3, 2.0), rng.uniform(3.0, 30.0)) for _ in range(rng.randint(1, 3))]
        steps = rng.randint(10, 3000)
        # Hand-built: the gradient and each statistic as separate Gaussians of one sample.
        parts = [dp_accounting.GaussianDpEvent(sigma_g)] + [
            dp_accounting.GaussianDpEvent(sigma_a / sens) for sens, sigma_a in aux
        ]
        hand = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.ComposedDpEvent(parts)), steps
        )
        ours = training_event(q, joint_noise_multiplier(sigma_g, aux), steps)
        eps_hand = rdp_privacy_accountant.RdpAccountant().compose(hand).get_epsilon(1e-5)
        eps_ours = rdp_privacy_accountant.RdpAccountant().compose(ours).get_epsilon(1e-5)
        assert eps_ours == pytest.approx(eps_hand, rel=1e-9)


def test_joint_noise_multiplier_rejects_zero_aux_noise():
    with pytest.raises(AccountingError):
        joint_noise_multiplier(1.0, [(1.0, 0.0)])


# ---------------------------------------------------------------- serialisation


def _every_serializable_event():
    gauss = dp_accounting.GaussianDpEvent(1.25)
    step = dp_accounting.PoissonSampledDpEvent(0.004, gauss)
    return [
        dp_accounting.NoOpDpEvent(),
        dp_accounting.NonPrivateDpEvent(),
        gauss,
        step,
        dp_accounting.SampledWithoutReplacementDpEvent(60000, 256, gauss),
        dp_accounting.SelfComposedDpEvent(step, 2250),
        dp_accounting.ComposedDpEvent([step, dp_accounting.SelfComposedDpEvent(gauss, 3), dp_accounting.NoOpDpEvent()]),
        dp_event.RepeatAndSelectDpEvent(dp_accounting.SelfComposedDpEvent(step, 10), 4.0, 1.0),
    ]


def test_every_serializable_event_type_is_exercised():
    names = {event_to_dict(e)["type"] for e in _every_serializable_event()}
    assert names == set(SERIALIZABLE_EVENT_TYPES)


@pytest.mark.parametrize("event", _every_serializable_event(), ids=lambda e: type(e).__name__)
def test_event_round_trips_through_json(event):
    text = json.dumps(event_to_dict(event), allow_nan=False)
    assert event_from_dict(json.loads(text)) == event


_leaf = st.builds(
    lambda s, q: dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)),
    st.floats(0.1, 100.0),
    st.floats(1e-6, 1.0),
)
_events = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.builds(dp_accounting.SelfComposedDpEvent, inner, st.integers(1, 10**6)),
        st.builds(dp_accounting.ComposedDpEvent, st.lists(inner, min_size=1, max_size=3)),
    ),
    max_leaves=6,
)


@settings(max_examples=40, deadline=None)
@given(_events)
def test_random_nested_events_round_trip_through_json(event):
    assert event_from_dict(json.loads(json.dumps(event_to_dict(event), allow_nan=False))) == event


def test_unsupported_event_type_cannot_be_serialised():
    with pytest.raises(AccountingError) as info:
        event_to_dict(dp_accounting.LaplaceDpEvent(1.0))
    assert "Gaussian" in info.value.hint


def test_unknown_event_type_is_refused_when_loading():
    with pytest.raises(AccountingError):
        event_from_dict({"type": "os.system", "noise_multiplier": 1.0})


def test_event_with_unexpected_fields_is_refused_when_loading():
    with pytest.raises(AccountingError):
        event_from_dict({"type": "Gaussian", "noise_multiplier": 1.0, "extra": 2})


def test_round_tripped_event_is_accepted_by_both_accountants():
    event = event_from_dict(event_to_dict(training_event(0.01, 1.0, 100)))
    assert rdp_privacy_accountant.RdpAccountant().supports(event)
    assert pld_privacy_accountant.PLDAccountant().supports(event)
    assert math.isfinite(rdp_privacy_accountant.RdpAccountant().compose(event).get_epsilon(1e-5))
