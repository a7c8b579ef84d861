import math

import pytest
import torch
from torch import nn

from dpclip.engine import DPEngine
from dpclip.engine.policies import PolicyContext, build_policy
from dpclip.engine.policies.discriminative import tail_mask_top
from dpclip.errors import EngineError

F64 = torch.float64


def context(groups=1, batch=10):
    return PolicyContext([f"g{k}" for k in range(groups)], [1] * groups, batch, 1.0, torch.device("cpu"), F64)


def policy(groups=1, batch=10, **spec):
    return build_policy({"kind": "discriminative", "small": 1.0, "large": 10.0, **spec}, context(groups, batch))


def clipped_sum(vectors: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    norms = vectors.norm(dim=1)
    return (vectors * torch.clamp(thresholds / norms, max=1.0)[:, None]).sum(0)


# ------------------------------------------------------------------ the rule

def test_threshold_rule_clips_tail_samples_at_large_and_the_body_at_small():
    rule = policy(tail_rule="threshold", tail_threshold=3.0)
    norms = torch.tensor([[0.5], [2.9], [3.1], [50.0]], dtype=F64)
    assert rule.per_sample_thresholds(norms).squeeze(1).tolist() == [1.0, 1.0, 10.0, 10.0]


def test_with_groups_a_sample_is_tail_in_every_group_by_its_total_norm():
    rule = policy(groups=2, tail_rule="threshold", tail_threshold=5.0)
    # sample 0: norm 5 (3, 4) is body; sample 1: norm sqrt(26) is tail
    norms = torch.tensor([[3.0, 4.0], [1.0, 5.0]], dtype=F64)
    per_sample = rule.per_sample_thresholds(norms)
    s, l = 1 / math.sqrt(2), 10 / math.sqrt(2)
    assert per_sample.tolist() == [[pytest.approx(s)] * 2, [pytest.approx(l)] * 2]


def test_top_fraction_counts_from_the_expected_batch_size_not_the_realised_one():
    # B = 10, fraction 0.2 -> the 2 largest of the 5 realised samples
    mask = tail_mask_top(torch.tensor([5.0, 1.0, 9.0, 3.0, 7.0]), 0.2, 10)
    assert mask.tolist() == [False, False, True, False, True]
    # fewer samples than the tail size: all are tail
    assert tail_mask_top(torch.tensor([5.0]), 0.2, 10).tolist() == [True]


def test_top_fraction_refuses_a_logical_batch_split_in_micro_batches():
    rule = policy(tail_rule="top_fraction", top_fraction=0.2)
    norms = torch.rand(4, 1, dtype=F64)
    rule.per_sample_thresholds(norms)
    with pytest.raises(EngineError) as info:
        rule.per_sample_thresholds(norms)
    assert "micro" in info.value.message and info.value.hint
    rule.release(torch.Generator())
    rule.per_sample_thresholds(norms)          # a new step ranks again


def test_engine_clips_each_sample_at_its_own_threshold_exactly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    engine = DPEngine(model, {"grouping": "layer", "threshold": {
        "kind": "discriminative", "small": 0.3, "large": 3.0, "tail_rule": "threshold", "tail_threshold": 1.0}},
        gradient_noise_multiplier=0.0, expected_batch_size=8)
    x = torch.randn(6, 3) * torch.tensor([0.1, 1, 5, 0.2, 3, 10])[:, None]
    y = torch.randn(6)
    engine.backward((model(x).squeeze(1) - y) ** 2)
    engine.privatize()
    got = [p.grad.clone() for p in model.parameters()]
    engine.detach()
    # per-example loop: a sample is tail if its whole-gradient norm > 1; each of the 2 groups then
    # clips at large/√2 (tail) or small/√2 (body)
    expected = [torch.zeros_like(p) for p in model.parameters()]
    groups = [[0, 1], [2, 3]]
    tails = 0
    for i in range(6):
        model.zero_grad()
        ((model(x[i:i + 1]).squeeze(1) - y[i]) ** 2).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        total = math.sqrt(sum((g ** 2).sum().item() for g in grads))
        c = (3.0 if total > 1.0 else 0.3) / math.sqrt(2)
        tails += total > 1.0
        for members in groups:
            norm = math.sqrt(sum((grads[j] ** 2).sum().item() for j in members))
            for j in members:
                expected[j] += grads[j] * min(1.0, c / norm)
    assert 0 < tails < 6                       # both kinds of samples occur
    for g, e in zip(got, expected):
        assert torch.allclose(g, e / 8, atol=1e-6)


# ------------------------------------------------------------------ privacy

def test_sensitivity_is_large_per_sample_and_two_large_minus_small_for_top_fraction():
    assert policy(tail_threshold=2.0).sensitivity_thresholds().tolist() == [10.0]
    assert policy(tail_rule="top_fraction").sensitivity_thresholds().tolist() == [19.0]
    grouped = policy(groups=4, tail_rule="top_fraction").sensitivity_thresholds()
    assert grouped.norm().item() == pytest.approx(19.0)


def test_top_fraction_neighbours_really_differ_by_two_large_minus_small():
    """Adding one example pushes another out of the top set: the bound 2L − S is attained,
    so noise calibrated to L (let alone S) would under-noise."""
    small, large = 1.0, 10.0
    rule = policy(batch=2, tail_rule="top_fraction", top_fraction=0.5)   # tail size ⌈0.5·2⌉ = 1
    d = torch.tensor([[0.0, 100.0]], dtype=F64)
    d_plus = torch.tensor([[0.0, 100.0], [0.0, -101.0]], dtype=F64)
    sums = []
    for batch in (d, d_plus):
        thresholds = rule.per_sample_thresholds(batch.norm(dim=1, keepdim=True)).squeeze(1)
        rule.release(torch.Generator())
        sums.append(clipped_sum(batch, thresholds))
    change = (sums[1] - sums[0]).norm().item()
    assert change == pytest.approx(2 * large - small)
    assert change > large


def test_gradient_noise_is_calibrated_to_large_not_small():
    """The published code noises for c_small; here a zero-gradient model's p.grad is pure noise
    whose std must be σ·c_large/B (10x what c_small calibration would give)."""
    sigma, small, large = 1.0, 0.5, 5.0
    model = nn.Linear(50, 1, bias=False)
    engine = DPEngine(model, {"threshold": {"kind": "discriminative", "small": small, "large": large,
                                            "tail_threshold": 1.0}},
                      gradient_noise_multiplier=sigma, expected_batch_size=1, seed=0)
    values = []
    for _ in range(40):
        engine.backward(model(torch.zeros(1, 50)).squeeze(1))   # gradient 0: p.grad is the noise
        report = engine.privatize()
        values.append(model.weight.grad.flatten())
    values = torch.cat(values)
    assert report.noise_std_sum.item() == pytest.approx(sigma * large)
    n = len(values)
    assert abs(values.std().item() - sigma * large) < 4 * sigma * large / math.sqrt(2 * n)


def test_top_fraction_noise_uses_two_large_minus_small():
    model = nn.Linear(3, 1)
    engine = DPEngine(model, {"threshold": {"kind": "discriminative", "small": 1.0, "large": 4.0,
                                            "tail_rule": "top_fraction", "top_fraction": 0.1}},
                      gradient_noise_multiplier=2.0, expected_batch_size=4)
    engine.backward(model(torch.randn(4, 3)).squeeze(1))
    report = engine.privatize()
    assert report.noise_std_sum.item() == pytest.approx(2.0 * 7.0)
    assert report.aux_releases == []                 # the tail split is never released


def test_bad_specs_are_refused_with_hints():
    with pytest.raises(EngineError):
        policy(tail_rule="threshold")                # no tail_threshold
    with pytest.raises(EngineError):
        policy(large=0.5, tail_threshold=1.0)        # large ≤ small
    with pytest.raises(EngineError) as info:
        policy(tail_threshold=1.0, trace_noise=1.0)
    assert info.value.hint


def test_top_fraction_at_the_user_level_noises_for_large_plus_k_times_the_gap():
    """A person of k rows (weighted 1/k) adds at most c_large and can push k rows of other
    people out of the top set, each changing by c_large − c_small (module doc). Worst case,
    k = 2, small 1, large 4, top set of 2 rows: two people of norm 10 sit in the top set; a
    person with two rows of norm 100, pointing the other way, takes both places. The sum moves
    by 4 (theirs) + 2·(4 − 1) (the two pushed out) = 10 = large + k·(large − small), more than
    the 2·large − small = 7 of one record. Computed here by per-row clipping, not by the engine."""
    def clipped_sum(rows: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
        ranked = sorted(range(len(rows)), key=lambda i: -float(rows[i][0].norm()))
        top = set(ranked[:2])
        total = torch.zeros(2, dtype=torch.float64)
        for i, (g, w) in enumerate(rows):
            c = 4.0 if i in top else 1.0
            total += w * g * min(1.0, c / float(g.norm()))
        return total

    e1 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    before = [(10 * e1, 1.0), (10 * e1, 1.0), (5 * e1, 1.0), (5 * e1, 1.0)]
    after = before + [(-100 * e1, 0.5), (-100 * e1, 0.5)]
    moved = float((clipped_sum(after) - clipped_sum(before)).norm())
    assert moved == pytest.approx(10.0) and moved > 2 * 4.0 - 1.0
    # the engine noises for exactly that bound at k = 2, and for 7 at k = 1
    for k, bound in ((2, 10.0), (1, 7.0)):
        model = nn.Linear(2, 1, bias=False)
        engine = DPEngine(model, {"threshold": {"kind": "discriminative", "small": 1.0, "large": 4.0,
                                                "tail_rule": "top_fraction", "top_fraction": 0.5}},
                          gradient_noise_multiplier=2.0, expected_batch_size=4, records_per_unit=k)
        engine.backward(model(torch.zeros(1, 2)).squeeze(1))
        report = engine.privatize()
        assert report.noise_std_sum.item() == pytest.approx(2.0 * bound)
        engine.detach()


def test_the_engine_clips_a_persons_rows_by_the_top_fraction_rule_as_the_reference():
    """The same worst case through the engine (σ = 0, B = 4): p.grad·B equals the per-row
    reference's sums, so the bound above is about what the engine computes."""
    e1 = torch.tensor([1.0, 0.0])
    rows = torch.stack([10 * e1, 10 * e1, 5 * e1, 5 * e1, -100 * e1, -100 * e1])
    weights = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5, 0.5])
    sums = []
    for x, w in ((rows[:4], weights[:4]), (rows, weights)):
        model = nn.Linear(2, 1, bias=False)
        engine = DPEngine(model, {"threshold": {"kind": "discriminative", "small": 1.0, "large": 4.0,
                                                "tail_rule": "top_fraction", "top_fraction": 0.5}},
                          gradient_noise_multiplier=0.0, expected_batch_size=4, records_per_unit=2)
        engine.backward(model(x).squeeze(1), row_weights=w)
        engine.privatize()
        sums.append(model.weight.grad.squeeze(0) * 4)
        engine.detach()
    torch.testing.assert_close(sums[0], torch.tensor([4.0 + 4.0 + 1.0 + 1.0, 0.0]))
    torch.testing.assert_close(sums[1], torch.tensor([1.0 + 1.0 + 1.0 + 1.0 - 4.0, 0.0]))
    assert float((sums[1] - sums[0]).norm()) == pytest.approx(10.0)


def test_records_per_unit_must_be_a_positive_integer():
    with pytest.raises(EngineError) as info:
        DPEngine(nn.Linear(2, 1), {}, gradient_noise_multiplier=1.0, expected_batch_size=4, records_per_unit=0)
    assert info.value.hint


def test_top_fraction_with_tied_scores_moves_at_most_one_other_sample_when_one_is_added():
    """The sensitivity 2·large − small holds when adding one example pushes at most one other sample
    across the cut; with many equal scores an unstable top-k picked other tied samples (up to 10)."""
    g = torch.Generator().manual_seed(0)
    worst = 0
    for trial in range(400):
        n = int(torch.randint(3, 60, (1,), generator=g))
        scores = torch.tensor([1.0, 2.0, 3.0])[torch.randint(0, 3, (n,), generator=g)]
        fraction = [0.1, 0.25, 0.5][trial % 3]
        before = tail_mask_top(scores, fraction, n)
        at = int(torch.randint(0, n + 1, (1,), generator=g))
        added = torch.tensor([[0.5, 1.0, 2.0, 3.0, 9.0][trial % 5]])
        after = tail_mask_top(torch.cat([scores[:at], added, scores[at:]]), fraction, n)
        others = torch.cat([after[:at], after[at + 1:]])
        worst = max(worst, int((before != others).sum()))
    assert worst == 1


def test_top_fraction_steps_after_a_certify_on_rows_of_its_own():
    """engine.certify (a sharded or staged model's check, before the first step) clips its own rows
    by the rule; that dry run is not the step's one ranking, so the first backward still ranks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    engine = DPEngine(model, {"threshold": {"kind": "discriminative", "small": 0.2, "large": 1.0,
                                            "tail_rule": "top_fraction", "top_fraction": 0.25}},
                      gradient_noise_multiplier=1.0, expected_batch_size=8, seed=0)
    loss = nn.CrossEntropyLoss(reduction="none")
    engine.certify(lambda: loss(model(x[:3]), y[:3]))
    engine.backward(loss(model(x), y))
    report = engine.privatize()
    assert report.noise_multiplier == 1.0 and all(p.grad is not None for p in model.parameters())
