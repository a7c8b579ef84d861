"""User-level privacy in make_private (issue 51, item 4): people are sampled, at most k records of
a person go into a step, and every row weighs 1/k, so that one person moves a step by at most C
whichever rows the loop backwards together (docs/users.md, docs/python-api.md)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpclip
from dpclip.errors import DpclipError

PEOPLE, RECORDS, K = 40, 5, 2


def _private(dtype=torch.float32, **kwargs):
    g = torch.Generator().manual_seed(0)
    n = PEOPLE * RECORDS
    data = TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))
    users = [f"person-{i % PEOPLE}" for i in range(n)]          # records interleaved across people
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    options = {"criterion": nn.CrossEntropyLoss(), "delta": 1e-5, "noise_multiplier": 1.0, "steps": 15,
               "max_grad_norm": 1.0, "users": users, "max_records_per_user": K, **kwargs}
    return dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=8),
                               **options), users


def test_people_are_sampled_at_most_k_records_each_and_every_row_weighs_one_over_k(monkeypatch):
    private, users = _private()
    model, optimizer, criterion, loader = private
    seen = []
    real = private.engine.backward

    def spy(losses, **kwargs):
        seen.append(kwargs["row_weights"].clone())
        return real(losses, **kwargs)
    monkeypatch.setattr(private.engine, "backward", spy)
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
    assert private.plan.plan.unit == "user" and private.plan.plan.sample_rate == 8 / PEOPLE
    assert any(line.startswith("privacy unit: user-level") for line in private.statement())
    assert seen and all(bool((w == 1.0 / K).all()) for w in seen)


def test_the_sampler_takes_at_most_k_records_of_a_person_per_step():
    private, users = _private()
    sampler = private.data_loader.batch_sampler.draws
    for batch in sampler:
        counts = Counter(users[i] for i in batch.tolist())
        assert not counts or max(counts.values()) <= K


def test_one_persons_rows_weigh_at_most_one_together_whatever_the_loop_backwards():
    """The weight is 1/k on every row: k rows of one person (the most a step takes) weigh 1."""
    private, _ = _private()
    assert private.optimizer.tracker.row_weight * K == pytest.approx(1.0)


@pytest.mark.parametrize("options, message", [
    ({"max_records_per_user": None}, "needs both users= and max_records_per_user="),
    ({"users": ["a", "b"]}, "names 2 people's records"),
    ({"max_records_per_user": 0}, "whole number >= 1"),
    ({"poisson_sampling": False}, "samples people by Poisson sampling"),
])
def test_bad_user_level_arguments_are_refused_with_a_hint(options, message):
    with pytest.raises(DpclipError, match=message) as caught:
        _private(**options)
    assert caught.value.hint


MISSING = {"NaN (a pandas column with gaps)": float("nan"), "None": None, "an empty string": " ",
           "a list (not hashable)": [1, 2]}


@pytest.mark.parametrize("missing", MISSING.values(), ids=list(MISSING))
def test_a_missing_or_unusable_person_id_is_refused_not_made_a_person_of_its_own(missing):
    """Each NaN was a person of its own (NaN != NaN): the records of one owner in several privacy
    units, each clipped to C, and the count of people (so q) wrong; None pooled nobody's records."""
    users = [f"person-{i % PEOPLE}" for i in range(PEOPLE * RECORDS)]
    users[3] = users[7] = missing
    with pytest.raises(DpclipError, match="person id of example 3") as caught:
        _private(users=users)
    assert "hint" not in caught.value.message and caught.value.hint


def test_person_ids_differing_only_in_case_or_spaces_are_refused_naming_both():
    """'person-3' and 'Person-3 ' as two people: if one owner, their records in two privacy units
    (each clipped to C, the owner's ε only by group privacy); make_private refuses before any step."""
    users = [f"person-{i % PEOPLE}" for i in range(PEOPLE * RECORDS)]
    users[PEOPLE + 3] = "Person-3 "
    with pytest.raises(DpclipError, match="case or surrounding spaces") as caught:
        _private(users=users)
    assert "'person-3'" in caught.value.message and "'Person-3 '" in caught.value.message
    assert caught.value.hint


def test_a_bfloat16_models_rows_weigh_no_more_than_one_over_k(monkeypatch):
    """The weights were built in the losses' dtype: in bfloat16 1/3 is 0.333984375, and a person's
    three rows weighed 1.002 together, 0.2% past the C the noise is calibrated to."""
    private, _ = _private(torch.bfloat16, max_records_per_user=3)
    model, optimizer, criterion, loader = private
    seen = []
    real = private.engine.backward

    def spy(losses, **kwargs):
        seen.append((losses.dtype, kwargs["row_weights"].clone()))
        return real(losses, **kwargs)
    monkeypatch.setattr(private.engine, "backward", spy)
    for x, y in loader:
        optimizer.zero_grad()
        criterion(model(x.to(torch.bfloat16)), y).backward()
        optimizer.step()
    assert seen and all(dtype == torch.bfloat16 for dtype, _ in seen)
    assert all(bool((w.double() * 3 <= 1.0).all()) for _, w in seen)


def _steps_then_checkpoint(private, path, steps=3):
    model, optimizer, criterion, loader = private
    for i, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
        if i + 1 == steps:
            break
    private.save_checkpoint(path)


@pytest.mark.parametrize("saved, loaded", [
    ({"users": None, "max_records_per_user": None, "batch_size": 40}, {}),   # records, then people: q 0.2 both
    ({}, {"users": None, "max_records_per_user": None, "batch_size": 40}),   # people, then records
    ({}, {"users": [f"person-{i // RECORDS}" for i in range(PEOPLE * RECORDS)]}),   # records moved between people
])
def test_a_checkpoint_loads_only_under_the_privacy_unit_and_people_it_was_trained_with(tmp_path, saved, loaded):
    """The checkpoint's plan key held q, σ, steps and δ only: steps that protected one record each
    (a person's five records in a step) loaded into a user-level run and were stated per person."""
    def make(options):
        batch_size = options.pop("batch_size", 8)
        g = torch.Generator().manual_seed(0)
        n = PEOPLE * RECORDS
        data = TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 3))
        users = [f"person-{i % PEOPLE}" for i in range(n)]
        kwargs = {"users": users, "max_records_per_user": K, **options}
        return dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   DataLoader(data, batch_size=batch_size), criterion=nn.CrossEntropyLoss(),
                                   delta=1e-5, noise_multiplier=1.0, steps=10, max_grad_norm=1.0, **kwargs)
    _steps_then_checkpoint(make(dict(saved)), tmp_path / "ck.pt")
    with pytest.raises(DpclipError, match="planned as") as caught:
        make(dict(loaded)).load_checkpoint(tmp_path / "ck.pt")
    assert caught.value.hint
    make(dict(saved)).load_checkpoint(tmp_path / "ck.pt")   # the run's own arguments still load it
