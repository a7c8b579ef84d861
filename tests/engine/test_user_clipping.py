"""Per-user clipping (engine.backward(row_weights=...), docs/users.md): a person's records are
each clipped and weighted 1/(their records in the batch), so that removing all of one
person's records moves each group's clipped sum by at most its threshold. Checked against a
per-record autograd loop, never the engine's own norms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpclip.data.user_sampler import user_weights
from dpclip.engine import DPEngine

THRESHOLDS = [0.3, 0.2, 0.5, 0.1]   # per parameter (grouping: param), small enough to clip most rows


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (10,), generator=g)
    users = torch.tensor([0, 1, 0, 2, 3, 3, 3, 1, 0, 2])
    return x, y, users


def _engine_sum(rows: torch.Tensor, micro: int = 4, norm_method: str = "auto", grouping="param") -> list[torch.Tensor]:
    model = _model()
    thresholds = THRESHOLDS if grouping == "param" else 0.3
    engine = DPEngine(model, {"grouping": grouping, "threshold": {"kind": "fixed", "value": thresholds},
                              "norm_method": norm_method},
                      gradient_noise_multiplier=0.0, expected_batch_size=1)
    x, y, users = _data()
    weights = user_weights(users[rows])
    for start in range(0, len(rows), micro):   # a person's records fall into different micro-batches
        part = rows[start:start + micro]
        losses = nn.functional.cross_entropy(model(x[part]), y[part], reduction="none")
        engine.backward(losses, row_weights=weights[start:start + micro])
    engine.privatize()
    grads = [p.grad.clone() for p in model.parameters()]
    engine.detach()
    return grads


def _reference_sum(rows: torch.Tensor) -> list[torch.Tensor]:
    """Σ over people of the mean of their records' clipped gradients, one record at a time."""
    model = _model()
    x, y, users = _data()
    total = [torch.zeros_like(p) for p in model.parameters()]
    for person in torch.unique(users[rows]):
        mine = rows[users[rows] == person]
        for i in mine:
            model.zero_grad()
            nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
            for t, p, c in zip(total, model.parameters(), THRESHOLDS):
                t += p.grad * min(1.0, c / float(p.grad.norm())) / len(mine)
    return total


@pytest.mark.parametrize("norm_method", ["auto", "ghost", "instantiate"])
def test_the_clipped_sum_is_the_per_user_loops(norm_method):
    rows = torch.arange(10)
    for a, b in zip(_engine_sum(rows, norm_method=norm_method), _reference_sum(rows)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm_method", ["ghost", "instantiate"])
def test_one_group_clips_the_whole_gradient_of_each_record_before_weighting(norm_method):
    """all-layer grouping: each record's whole gradient is clipped (the streamed, one-group path)."""
    model = _model()
    x, y, users = _data()
    rows = torch.arange(10)
    total = [torch.zeros_like(p) for p in model.parameters()]
    for person in torch.unique(users):
        mine = rows[users == person]
        for i in mine:
            model.zero_grad()
            nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
            norm = float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm())
            for t, p in zip(total, model.parameters()):
                t += p.grad * min(1.0, 0.3 / norm) / len(mine)
    for a, b in zip(_engine_sum(rows, norm_method=norm_method, grouping="all-layer"), total):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("person", [0, 1, 2, 3])
def test_removing_all_of_a_persons_records_moves_each_group_by_at_most_its_threshold(person):
    _, _, users = _data()
    rows = torch.arange(10)
    without = rows[users != person]
    moved = [float((a - b).norm()) for a, b in zip(_engine_sum(rows), _engine_sum(without))]
    assert all(m <= c * (1 + 1e-9) for m, c in zip(moved, THRESHOLDS))
    assert max(m / c for m, c in zip(moved, THRESHOLDS)) > 0.5   # and the bound is nearly reached


def test_without_weights_a_person_with_three_records_moves_the_sum_by_more():
    """What per-user weighting prevents: example-level clipping lets person 3 (three records)
    move a group by up to three thresholds."""
    model = _model()
    engine = DPEngine(model, {"grouping": "param", "threshold": {"kind": "fixed", "value": THRESHOLDS}},
                      gradient_noise_multiplier=0.0, expected_batch_size=1)
    x, y, users = _data()
    mine = (users == 3).nonzero().squeeze(1)
    engine.backward(nn.functional.cross_entropy(model(x[mine]), y[mine], reduction="none"))
    engine.privatize()
    moved = [float(p.grad.norm()) for p in model.parameters()]
    engine.detach()
    assert any(m > 1.5 * c for m, c in zip(moved, THRESHOLDS))


def test_row_weights_of_the_wrong_shape_or_range_are_refused():
    from dpclip.errors import EngineError

    model = _model()
    engine = DPEngine(model, {"threshold": {"kind": "fixed", "value": 1.0}}, gradient_noise_multiplier=0.0,
                      expected_batch_size=1)
    x, y, _ = _data()
    losses = nn.functional.cross_entropy(model(x[:3]), y[:3], reduction="none")
    with pytest.raises(EngineError, match="row_weights"):
        engine.backward(losses, row_weights=torch.tensor([0.5, 2.0, 0.5]))
    engine.detach()


@pytest.mark.parametrize("threshold, bound", [
    ({"kind": "quantile", "target": 0.5, "lr": 0.3, "initial": 0.3, "sigma": 1.0}, 0.5),
    ({"kind": "dcsgd-p", "percentile": 0.5, "bins": 5, "sigma_hist": 1.0, "initial": 0.3, "range": 1.0}, 1.0),
])
def test_a_persons_rows_move_the_threshold_statistic_by_at_most_one_records_sensitivity(threshold, bound):
    """Quantile counts (shifted by ½: sensitivity ½) and DC-SGD's histogram (L2 sensitivity 1):
    with the rows weighted per person, removing all of a person's rows moves the statistic by no
    more than one record moves it without weights; without weights, person 3 moves it 3x."""
    _, _, users = _data()
    rows = torch.arange(10)

    def statistic(chosen, weighted=True):
        model = _model()
        engine = DPEngine(model, {"grouping": "all-layer", "threshold": threshold}, gradient_noise_multiplier=1.0,
                          expected_batch_size=1)
        x, y, _ = _data()
        losses = nn.functional.cross_entropy(model(x[chosen]), y[chosen], reduction="none")
        engine.backward(losses, row_weights=user_weights(users[chosen]) if weighted else None)
        value = engine.policy.pending_statistic().clone()
        engine.detach()
        return value

    full = statistic(rows)
    for person in range(4):
        moved = float((full - statistic(rows[users != person])).norm())
        assert moved <= bound * (1 + 1e-9)
    unweighted = float((statistic(rows, False) - statistic(rows[users != 3], False)).norm())
    assert unweighted > 1.5 * bound


def test_discriminative_per_record_thresholds_keep_a_person_within_the_large_threshold():
    """tail_rule threshold: each record clipped at small or large by its own norm, then weighted:
    removing a person moves the sum by at most large (the policy's sensitivity)."""
    _, _, users = _data()
    rows = torch.arange(10)
    clipping = {"grouping": "all-layer", "threshold": {"kind": "discriminative", "small": 0.05, "large": 0.3,
                                                       "tail_rule": "threshold", "tail_threshold": 0.5}}

    def clipped_sum(chosen):
        model = _model()
        engine = DPEngine(model, clipping, gradient_noise_multiplier=0.0, expected_batch_size=1)
        x, y, _ = _data()
        losses = nn.functional.cross_entropy(model(x[chosen]), y[chosen], reduction="none")
        engine.backward(losses, row_weights=user_weights(users[chosen]))
        engine.privatize()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        engine.detach()
        return flat

    full = clipped_sum(rows)
    moved = [float((full - clipped_sum(rows[users != person])).norm()) for person in range(4)]
    assert all(m <= 0.3 * (1 + 1e-9) for m in moved) and max(moved) > 0.05


def test_a_persons_float64_weights_are_never_rounded_up_in_a_float32_step():
    """user_weights gives 1/3 in float64; the engine's float32 step rounded it to nearest, up to
    0.33333334, and three rows of one person then moved the quantile counts by 0.5000000149: past
    the ½ the noise is calibrated to. Cast toward zero, they move them by at most ½ exactly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))   # float32
    x, y, _ = _data()
    x = x.float()
    users = torch.tensor([0, 1, 0, 2, 0])                                   # person 0: three rows, spread
    threshold = {"kind": "quantile", "target": 0.5, "lr": 0.3, "initial": 1e3, "sigma": 1.0}

    def counts(rows):
        engine = DPEngine(model, {"grouping": "all-layer", "threshold": threshold}, gradient_noise_multiplier=1.0,
                          expected_batch_size=1)
        losses = nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="none")
        engine.backward(losses, row_weights=user_weights(users[rows]))
        value = engine.policy.pending_statistic().clone()
        engine.detach()
        return value

    moved = float((counts(torch.arange(5)) - counts(torch.tensor([1, 3]))).abs().max())
    assert moved <= 0.5          # exactly: every row of person 0 is unclipped (threshold 1e3)
    assert moved == pytest.approx(0.5, abs=1e-6)
