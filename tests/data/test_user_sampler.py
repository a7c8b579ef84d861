"""User-level Poisson sampling (dpclip/data/user_sampler.py): people are included at rate q,
at most k records of each, chosen uniformly; the weights of a person's rows sum to 1."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpclip.data.user_sampler import UserPoissonSampler, number_people, user_weights
from dpclip.errors import DpclipError

# 6 people with 1, 2, 3, 5, 8 and 13 records (32 records), in an interleaved order.
COUNTS = [1, 2, 3, 5, 8, 13]
USERS = torch.tensor([u for u, n in enumerate(COUNTS) for _ in range(n)])[
    torch.randperm(sum(COUNTS), generator=torch.Generator().manual_seed(0))]


def _batches(rate=0.3, steps=4000, k=4, seed=1):
    return list(UserPoissonSampler(USERS, rate, steps, k, seed=seed))


def test_people_are_included_at_the_rate_and_never_above_k_records():
    rate, steps, k = 0.3, 4000, 4
    included = torch.zeros(len(COUNTS))
    for batch in _batches(rate, steps, k):
        people, taken = torch.unique(USERS[batch], return_counts=True)
        assert bool((taken <= torch.tensor(COUNTS)[people].clamp(max=k)).all())
        assert bool((taken == torch.tensor(COUNTS)[people].clamp(max=k)).all())   # all k when they have k
        included[people] += 1
    # Binomial(4000, 0.3) per person: std sqrt(4000·0.3·0.7) ≈ 29; 5 std ≈ 145.
    assert bool(((included - steps * rate).abs() < 5 * math.sqrt(steps * rate * (1 - rate))).all())


def test_the_records_of_a_person_with_more_than_k_are_taken_uniformly():
    rate, steps, k = 0.3, 4000, 4
    person = 5   # 13 records: each taken with probability q·k/13 per step
    records = (USERS == person).nonzero().squeeze(1)
    hits = torch.zeros(len(records))
    for batch in _batches(rate, steps, k):
        hits += torch.isin(records, batch).to(hits.dtype)
    p = rate * k / len(records)
    assert bool(((hits - steps * p).abs() < 5 * math.sqrt(steps * p * (1 - p))).all())


def test_a_persons_rows_weigh_one_together():
    for batch in _batches(steps=50):
        weights = user_weights(USERS[batch])
        for person in torch.unique(USERS[batch]):
            assert float(weights[USERS[batch] == person].sum()) == pytest.approx(1.0)


def test_sampling_is_a_function_of_the_seed_and_resumes_where_it_stopped():
    straight = _batches(steps=20, seed=7)
    sampler = UserPoissonSampler(USERS, 0.3, 20, 4, seed=7)
    first = [b for _, b in zip(range(8), sampler)]
    resumed = UserPoissonSampler(USERS, 0.3, 20, 4, seed=7)
    resumed.load_state_dict(sampler.state_dict())
    rest = list(resumed)
    assert all(torch.equal(a, b) for a, b in zip(straight, first + rest)) and len(first + rest) == 20


@pytest.mark.parametrize("users, k", [(torch.tensor([0, 0, 2]), 2), (torch.tensor([0, 1]), 0), (torch.tensor([], dtype=torch.int64), 2)])
def test_bad_users_or_k_are_refused_with_a_hint(users, k):
    with pytest.raises(DpclipError) as caught:
        UserPoissonSampler(users, 0.5, 3, k)
    assert caught.value.hint


SPELLINGS = {"the string '7' and the number 7": ["7", 7], "the number 7 and 7.0": [7, 7.0],
             "True and 1": [True, 1], "the string '7' and numpy's 7": ["7", np.int64(7)]}


@pytest.mark.parametrize("pair", SPELLINGS.values(), ids=list(SPELLINGS))
def test_one_id_in_two_types_is_refused_not_counted_as_one_person_or_two(pair):
    """make_private numbered '7' and 7 as two people (one owner's records in two privacy units, each
    clipped to C: the owner's ε only by group privacy), where a recipe's user column, written out
    as text, made them one and split 7 from 7.0: which is meant cannot be told, so it is refused."""
    ids = ["a", pair[0], "b", pair[1], "a"]
    with pytest.raises(DpclipError, match="example 3") as caught:
        number_people(ids)
    assert caught.value.hint and "one type" in caught.value.hint


def test_ids_of_one_type_each_spelled_one_way_are_numbered_by_first_appearance():
    assert number_people([np.int64(3), 3, 5, torch.tensor(3), 5]).tolist() == [0, 0, 1, 0, 1]
    assert number_people(["x", "7", "x"]).tolist() == [0, 1, 0]


LOOKALIKES = {"a leading space": [" 7", "7"], "a trailing space": ["7 ", "7"], "case": ["Alice", "alice"],
              "a padded string and a number": [" 7", 7], "case folding (ß, SS)": ["straße", "STRASSE"]}


@pytest.mark.parametrize("pair", LOOKALIKES.values(), ids=list(LOOKALIKES))
def test_ids_differing_only_in_case_or_surrounding_spaces_are_refused_naming_both(pair):
    """Counted as two people (exact comparison), one person typed two ways would hold two privacy
    units; merged, two people would share one: which is meant cannot be told, so it is refused."""
    ids = ["a", pair[0], "b", pair[1], "a"]
    with pytest.raises(DpclipError, match="example 3") as caught:
        number_people(ids)
    message = caught.value.message
    assert repr(pair[0]) in message and repr(pair[1]) in message and "case or surrounding spaces" in message
    assert "lower-cased" in caught.value.hint and "two people" in caught.value.hint


def test_ids_that_differ_in_more_than_case_and_spaces_are_still_people_of_their_own():
    assert number_people(["007", "7", "Al ice", "Alice", "a-1", "a1", "007"]).tolist() == [0, 1, 2, 3, 4, 5, 0]
