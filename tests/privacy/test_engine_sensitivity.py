"""The released quantities' sensitivities, measured through the engine as an attacker would:
neighbouring batches (one row removed: a huge, overflowing, NaN, zero or ordinary gradient) go
through ``DPEngine.backward`` and ``privatize`` with (almost) no noise, and the change of each
group's clipped sum, of the whole clipped sum and of the policy's statistic before noise
(``pending_statistic``) stays within what the engine noises for (``sensitivity_thresholds``)
and what it charges (the releases' Δ). Every registered threshold policy (its spec's example),
grouped and flat, abadi and auto, in one backward and in micro-batches; and at the user level
(docs/users.md), one person's rows removed, weighted 1/n_u as the user sampler's batches are."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpclip.data.user_sampler import user_weights
from dpclip.engine import DPEngine
from dpclip.engine.policies import policy_spec, policy_specs

BATCH = 8
SIGMA = 1e-20     # dcsgd-e needs a positive σ_T; noise of this std moves nothing measurable
ATTACKS = {"ordinary": 1.0, "huge": 1e6, "overflow": 3e38, "nan": math.nan, "zero": 0.0}


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 3))


def _released(clipping, x, y, scale, micro, users=None, records_per_unit=1):
    """(clipped sum per group, the statistic before noise, the noise's per-group sensitivity, Δ of the releases)."""
    model = _model()
    engine = DPEngine(model, clipping, gradient_noise_multiplier=SIGMA, expected_batch_size=BATCH, seed=0,
                      records_per_unit=records_per_unit)
    weights = None if users is None else user_weights(users)
    for lo in range(0, len(x), micro or len(x)):
        rows = slice(lo, lo + (micro or len(x)))
        engine.backward(F.cross_entropy(model(x[rows]), y[rows], reduction="none") * scale[rows],
                        **({} if weights is None else {"row_weights": weights[rows]}))
    statistic = engine.policy.pending_statistic()
    statistic = None if statistic is None else statistic.clone().double()
    sensitivity = engine.policy.sensitivity_thresholds().clone().double()
    report = engine.privatize()
    grads = {name: p.grad.double() * BATCH for name, p in model.named_parameters()}
    sums = [torch.cat([grads[info.names[0]].flatten() for i, info in enumerate(engine.groups.params)
                       if engine.groups.group_of[i] == k]) for k in range(len(engine.group_names))]
    engine.detach()
    return sums, statistic, sensitivity, math.sqrt(sum(r.sensitivity ** 2 for r in report.aux_releases))


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(s.kind_name() for s in policy_specs() if s.example))
def test_removing_any_crafted_row_moves_each_release_by_at_most_its_declared_sensitivity(kind):
    spec = copy.deepcopy(policy_spec(kind).example)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 5, generator=g), torch.randint(0, 3, (12,), generator=g)
    micros = (None,) if policy_spec(kind).model_validate(spec).ranks_whole_batch() else (None, 5)
    worst = 0.0
    for grouping in ("all-layer", "param"):
        for fn in ("abadi", "auto"):
            clipping = {"grouping": grouping, "fn": fn, "threshold": spec}
            if kind == "dcsgd-e" and fn == "auto":
                continue
            for value in ATTACKS.values():
                for micro in micros:
                    scale = torch.ones(12)
                    scale[3] = value
                    keep = [i for i in range(12) if i != 3]
                    with_row = _released(clipping, x, y, scale, micro)
                    without = _released(clipping, x[keep], y[keep], scale[keep], micro)
                    sums, statistic, sensitivity, aux = with_row
                    change = torch.stack([(a - b).norm() for a, b in zip(sums, without[0])])
                    assert bool((change <= sensitivity * (1 + 1e-5)).all()), (grouping, fn, value, micro, change)
                    assert float(change.norm()) <= float(sensitivity.norm()) * (1 + 1e-5)
                    worst = max(worst, float(change.norm() / sensitivity.norm()))
                    if statistic is not None:
                        assert float((statistic - without[1]).norm()) <= aux * (1 + 1e-9), (grouping, fn, value)
    assert worst > 0.3    # the crafted rows did reach the bound's order


@pytest.mark.slow   # 5-10 s each on a shared CPU
@pytest.mark.parametrize("kind", ["quantile", "dcsgd-p", "discriminative"])
def test_removing_one_persons_rows_moves_each_release_by_at_most_its_declared_sensitivity(kind):
    """User level, k = 3: removing person 0 (three rows) or person 1 (one row), their rows ordinary or
    huge, moves the clipped sums and the statistic within what is noised and charged."""
    spec = copy.deepcopy(policy_spec(kind).example)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 5, generator=g), torch.randint(0, 3, (12,), generator=g)
    users = torch.tensor([0, 0, 0, 1, 2, 2, 3, 4, 4, 4, 5, 6])
    clipping = {"grouping": "param", "fn": "abadi", "threshold": spec}
    worst = 0.0
    for person in (0, 1):
        for value in (ATTACKS["ordinary"], ATTACKS["huge"]):
            scale = torch.ones(12)
            scale[users == person] = value
            keep = users != person
            sums, statistic, sensitivity, aux = _released(clipping, x, y, scale, None, users, records_per_unit=3)
            without = _released(clipping, x[keep], y[keep], scale[keep], None, users[keep], records_per_unit=3)
            change = torch.stack([(a - b).norm() for a, b in zip(sums, without[0])])
            assert float(change.norm()) <= float(sensitivity.norm()) * (1 + 1e-5), (person, value, change)
            worst = max(worst, float(change.norm() / sensitivity.norm()))
            if statistic is not None:
                assert float((statistic - without[1]).norm()) <= aux * (1 + 1e-9), (person, value)
    assert worst > 0.3    # the removed person did reach the bound's order
