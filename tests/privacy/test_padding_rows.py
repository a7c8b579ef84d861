"""Padding rows are not examples (pipeline stages pad micro-batches to a fixed shape; docs/distributed.md).

An attacker holding the released thresholds, noise std and counts must learn nothing from how
many padding rows a step had (that number depends on the realised Poisson batch size): with
``DPEngine.capture(batch, samples=n)`` the clipped sums, the clip counts, the sample count and
the threshold policy's pending statistic are exactly those of the n examples alone.
"""

from __future__ import annotations

import torch
from torch import nn

from dpclip.engine import DPEngine

CLIPPING = {"grouping": "layer", "threshold": {"kind": "quantile", "initial": 0.3, "sigma": 1.0}}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def test_padded_rows_change_no_sum_count_or_statistic():
    x = torch.randn(6, 5, dtype=torch.float64) * 3
    y = torch.randint(0, 3, (6,))

    plain_model = _model()
    plain = DPEngine(plain_model, CLIPPING, gradient_noise_multiplier=0.0, expected_batch_size=8, seed=0)
    plain.backward(nn.functional.cross_entropy(plain_model(x), y, reduction="none"))

    padded_model = _model()
    padded = DPEngine(padded_model, CLIPPING, gradient_noise_multiplier=0.0, expected_batch_size=8, seed=0)
    rows = torch.cat([x, torch.zeros(4, 5, dtype=torch.float64)])
    labels = torch.cat([y, torch.zeros(4, dtype=torch.long)])
    weights = torch.tensor([1.0] * 6 + [0.0] * 4, dtype=torch.float64)
    losses = nn.functional.cross_entropy(padded_model(rows), labels, reduction="none") * weights
    with padded.capture(10, samples=6):
        losses.sum().backward()
    padded.finish_micro_batch()

    torch.testing.assert_close(padded.policy.pending_statistic(), plain.policy.pending_statistic(), rtol=0, atol=0)
    a, b = plain.privatize(), padded.privatize()
    assert a.samples_seen == b.samples_seen == 6
    torch.testing.assert_close(b.clip_fraction, a.clip_fraction, rtol=0, atol=0)
    torch.testing.assert_close(b.norm_quantiles["median"], a.norm_quantiles["median"])
    for p, q in zip(plain_model.parameters(), padded_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-15)


def _padded_statistic(samples):
    torch.manual_seed(1)
    x = torch.randn(6, 5, dtype=torch.float64) * 3
    model = _model()
    engine = DPEngine(model, CLIPPING, gradient_noise_multiplier=0.0, expected_batch_size=8, seed=0)
    rows = torch.cat([x, torch.zeros(4, 5, dtype=torch.float64)])
    weights = torch.tensor([1.0] * 6 + [0.0] * 4, dtype=torch.float64)
    losses = nn.functional.cross_entropy(model(rows), torch.zeros(10, dtype=torch.long), reduction="none") * weights
    with engine.capture(10, samples=samples):
        losses.sum().backward()
    engine.finish_micro_batch()
    return engine.policy.pending_statistic()


def test_without_the_sample_count_padding_would_move_the_released_count():
    # the same padded backward with the padding counted as examples: the statistic differs
    assert not torch.equal(_padded_statistic(None), _padded_statistic(6))


def test_training_fixed_shapes_releases_nothing_of_the_padding_row(small_recipe):
    """training.fixed_shapes pads with row 0 of the training data. Row 0 is private too: when it
    is not in the batch, the released step (weights, thresholds, clip counts) must not depend on
    what it holds. Two runs differ only in row 0's features; the steps must be equal bit for bit."""
    from dpclip.train.parts import assemble
    from dpclip.train.step import PrivateStep

    recipe = small_recipe("privacy.unsafe_seeded_randomness=true", "model.hidden=[16]",
                          "clipping.threshold={kind: quantile, initial: 1.0, sigma: 2.0}")
    outcomes, weights = [], []
    for shift in (0.0, 50.0):
        parts = assemble(recipe)
        parts.learner.schedule.apply(0)
        train = dict(parts.feed.data.train)
        train["features"] = train["features"].clone()
        train["features"][0] += shift
        learner = parts.learner
        step = PrivateStep(learner.model, learner.loss_fn, learner.engine, learner.optimizer, train,
                           micro_batch_size=4, fixed_rows=True)
        outcomes.append(step(torch.arange(1, 8)))   # 7 rows: the second micro-batch has one padding row
        weights.append([p.detach().clone() for p in learner.model.parameters()])
    for a, b in zip(*weights):
        assert torch.equal(a, b)
    first, second = (o.report for o in outcomes)
    assert torch.equal(first.thresholds, second.thresholds) and torch.equal(first.clip_fraction, second.clip_fraction)
    assert outcomes[0].loss_sum == outcomes[1].loss_sum
