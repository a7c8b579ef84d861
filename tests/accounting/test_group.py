"""Group privacy (dpclip/accounting/group.py): (ε, δ)-DP gives a group of k records
(kε, k·e^{(k−1)ε}·δ); checked on a mechanism where the k-step chain is exact."""

from __future__ import annotations

import math

import pytest

from dpclip.accounting.group import group_privacy
from dpclip.errors import AccountingError


def test_one_record_is_the_guarantee_itself_and_k_records_chain_it():
    assert group_privacy(1.5, 1e-6, 1) == (1.5, 1e-6)
    epsilon, delta = group_privacy(0.5, 1e-6, 4)
    assert epsilon == pytest.approx(2.0) and delta == pytest.approx(4 * math.exp(1.5) * 1e-6)


def test_the_bound_holds_for_randomised_response_on_k_bits():
    """k records each answered by ε-randomised response: the worst likelihood ratio of the k
    answers when all k records flip is exactly e^{kε}, which the bound must cover (δ = 0)."""
    epsilon, k = 0.7, 5
    p = math.exp(epsilon) / (1 + math.exp(epsilon))
    worst = (p / (1 - p)) ** k
    group_epsilon, group_delta = group_privacy(epsilon, 0.0, k)
    assert math.log(worst) <= group_epsilon + 1e-12 and group_delta == 0.0


def test_a_huge_exponent_gives_delta_one_not_an_overflow():
    assert group_privacy(10.0, 1e-5, 100) == (1000.0, 1.0)


@pytest.mark.parametrize("k", [0, -1, 2.5, True])
def test_a_group_size_below_one_is_refused_with_a_hint(k):
    with pytest.raises(AccountingError) as caught:
        group_privacy(1.0, 1e-5, k)
    assert caught.value.hint
