"""The threshold-policy interface: registry, aux releases, per-sample thresholds."""

import copy
import math

import dp_accounting
import pytest
import torch

from dpclip.engine import AuxRelease, DPEngine, ThresholdPolicy, build_groups, register_threshold_policy
from dpclip.engine.policies import threshold_kinds, unregister_policy
from dpclip.errors import EngineError
from tests.engine.conftest import (DTYPE, classify_loss, group_norms, mlp, mlp_batch,
                                   per_example_grads)


def test_single_value_is_split_as_c_over_sqrt_k_and_lists_are_per_group():
    model = mlp()
    engine = DPEngine(model, {"grouping": "layer", "threshold": {"kind": "fixed", "value": 3.0}},
                      expected_batch_size=4)
    torch.testing.assert_close(engine.thresholds, torch.full((3,), 3.0 / math.sqrt(3), dtype=DTYPE))
    engine.detach()
    with pytest.raises(EngineError, match="2 thresholds but there are 3 groups"):
        DPEngine(mlp(), {"grouping": "layer", "threshold": {"kind": "fixed", "value": [1, 2]}},
                 expected_batch_size=4)


@pytest.fixture
def engine_only_kind():
    """Forget the engine-only kinds a test registers."""
    kinds = []
    yield kinds.append
    for kind in kinds:
        unregister_policy(kind)


def test_unknown_threshold_kind_names_the_registered_kinds():
    with pytest.raises(EngineError) as err:
        DPEngine(mlp(), {"threshold": {"kind": "magic"}}, expected_batch_size=4)
    assert "fixed" in err.value.hint


class NoisyCount(ThresholdPolicy):
    """Toy quantile-like policy: releases per-group clipped counts with noise σ_b."""

    def __init__(self, values, sigma_b):
        self.values, self.sigma_b = values, sigma_b
        self.observed, self.counts, self.releases = [], None, 0

    def thresholds(self):
        return self.values

    def observe(self, norms):
        self.observed.append(tuple(norms.shape))
        below = (norms <= self.values).to(norms.dtype).sum(0) - 0.5 * norms.shape[0]
        self.counts = below if self.counts is None else self.counts + below

    def release(self, generator):
        self.releases += 1
        k = self.values.numel()
        noise = torch.randn(k, generator=generator, dtype=self.values.dtype) * self.sigma_b
        self.noisy = (self.counts if self.counts is not None else 0) + noise
        self.counts = None
        return [AuxRelease(math.sqrt(k) / 2, self.sigma_b, "counts")]


def test_aux_release_enters_sigma_eff_and_the_poisson_event(engine_only_kind):
    made = []

    def factory(spec, ctx):
        made.append(NoisyCount(torch.ones(ctx.num_groups, dtype=ctx.dtype), spec["sigma_b"]))
        return made[-1]

    register_threshold_policy("test-noisy-count", factory)
    engine_only_kind("test-noisy-count")
    assert "test-noisy-count" not in threshold_kinds()        # no spec: recipes cannot name it
    model = mlp()
    engine = DPEngine(model, {"grouping": "layer", "threshold": {"kind": "test-noisy-count",
                                                                 "sigma_b": 5.0}},
                      gradient_noise_multiplier=1.2, expected_batch_size=4, sample_rate=0.02)
    batch = mlp_batch()
    engine.backward(classify_loss(model, {k: v[:2] for k, v in batch.items()}))
    engine.backward(classify_loss(model, {k: v[2:] for k, v in batch.items()}))
    report = engine.privatize()
    policy = made[0]
    assert policy.observed == [(2, 3), (3, 3)] and policy.releases == 1
    want = (1.2 ** -2 + (math.sqrt(3) / 2 / 5.0) ** 2) ** -0.5
    assert report.noise_multiplier == pytest.approx(want)
    assert report.gradient_noise_multiplier == 1.2 and report.aux_releases == [AuxRelease(math.sqrt(3) / 2, 5.0, "counts")]
    assert report.dp_event == dp_accounting.PoissonSampledDpEvent(
        0.02, dp_accounting.GaussianDpEvent(want))


class TwoLevel(ThresholdPolicy):
    """Per-sample thresholds: samples whose total norm exceeds `cut` get `large`."""

    per_sample = True

    def __init__(self, k, small, large, cut):
        self.small = torch.full((k,), small, dtype=DTYPE)
        self.large = torch.full((k,), large, dtype=DTYPE)
        self.cut = cut

    def thresholds(self):
        return self.small

    def sensitivity_thresholds(self):
        return self.large

    def per_sample_thresholds(self, norms):
        tail = norms.pow(2).sum(1, keepdim=True).sqrt() > self.cut
        return torch.where(tail, self.large, self.small)


def test_per_sample_thresholds_clip_each_sample_at_its_own_level_and_set_the_noise(engine_only_kind):
    register_threshold_policy("test-two-level",
                              lambda spec, ctx: TwoLevel(ctx.num_groups, 0.05, 0.5, spec["cut"]))
    engine_only_kind("test-two-level")
    model = mlp()
    ref_model = copy.deepcopy(model)
    batch = mlp_batch(n=6)
    groups = build_groups(ref_model, "layer")
    per = per_example_grads(ref_model, classify_loss, batch)
    norms = group_norms(per, groups)
    total = norms.pow(2).sum(1).sqrt()
    ordered = total.sort().values  # a cut between two samples: none sits on it, where rounding decides
    cut = float(ordered[2] + ordered[3]) / 2
    engine = DPEngine(model, {"grouping": "layer", "threshold": {"kind": "test-two-level", "cut": cut}},
                      gradient_noise_multiplier=0.0, expected_batch_size=8)
    engine.backward(classify_loss(model, {k: v[:4] for k, v in batch.items()}))
    engine.backward(classify_loss(model, {k: v[4:] for k, v in batch.items()}))
    engine.privatize()
    want = {info.name: torch.zeros_like(info.param) for info in groups.params}
    for i, g in enumerate(per):
        level = 0.5 if total[i] > cut else 0.05
        for k, members in enumerate(groups.members):
            c = min(1.0, level / float(norms[i, k]))
            for j in members:
                want[groups.params[j].name] += c * g[groups.params[j].name] / 8
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-9, atol=1e-12)
    assert (total > cut).any() and (total <= cut).any()
    # noise is calibrated to the large threshold, the true sensitivity
    engine2 = DPEngine(mlp(), {"grouping": "layer", "threshold": {"kind": "test-two-level", "cut": cut}},
                       gradient_noise_multiplier=1.0, expected_batch_size=8)
    torch.testing.assert_close(engine2.privatize().noise_std_sum,
                               torch.full((3,), 0.5 * math.sqrt(3), dtype=DTYPE))


def test_report_fields_for_abadi_and_auto():
    for fn in ("abadi", "auto"):
        model = mlp()
        engine = DPEngine(model, {"grouping": "layer", "fn": fn}, gradient_noise_multiplier=1.0,
                          expected_batch_size=8)
        engine.backward(classify_loss(model, mlp_batch()))
        report = engine.privatize()
        assert report.group_names == ["0", "2", "4"] and report.samples_seen == 5
        assert set(report.norm_quantiles) == {"min", "median", "p90", "max"}
        assert (report.clip_fraction is None) == (fn == "auto")
        d = report.to_dict()
        assert d["samples_seen"] == 5 and len(d["thresholds"]) == 3
