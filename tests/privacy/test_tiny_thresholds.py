"""Thresholds near float32's smallest normal number, as the engine meets them: a configured C that
the recipe accepts (anything from float32's smallest normal number up), and a quantile threshold
that its geometric update walks down (every norm below C, step after step: He et al.'s rule has no
floor of its own). A clip factor C/‖g‖ below the smallest normal number is subnormal: rounded to a
multiple of 2⁻¹⁴⁹, it can be nearly twice C/‖g‖, and the crafted sample's clipped gradient then
moves the sum by up to 2·C while the noise is for C."""

import math

import pytest
import torch
from torch import nn

from dpclip.engine import DPEngine
from dpclip.engine.clip import abadi, auto
from dpclip.engine.policies import PolicyContext, build_policy
from dpclip.engine.policies.quantile import MAX_THRESHOLD, MIN_THRESHOLD


def _clipped_sum_norm(threshold: dict, norm: float, width: int = 3, fn: str = "abadi") -> float:
    """The released sum (noise 1e-30 of C: nothing measurable) of one crafted row of gradient norm ``norm``."""
    torch.manual_seed(0)
    model = nn.Linear(width, 1, bias=False)
    engine = DPEngine(model, {"grouping": "all-layer", "fn": fn, "threshold": threshold},
                      gradient_noise_multiplier=1e-30, expected_batch_size=1, seed=0)
    engine.backward(model(torch.ones(1, width)).sum(dim=1) * (norm / math.sqrt(width)))
    engine.privatize()
    engine.detach()
    return model.weight.grad.double().norm().item()


@pytest.mark.parametrize("fn", ["abadi", "auto"])
def test_a_crafted_huge_gradient_moves_the_sum_by_at_most_a_tiny_configured_threshold(fn):
    # C = 1e-26 is accepted (above float32's 1.18e-38); C/‖g‖ = 1e-45 is 0.71 of 2^-149 and rounds up to it:
    # the engine before the fix released a sum of norm 1.40·C
    threshold = 1e-26
    moved = _clipped_sum_norm({"kind": "fixed", "value": threshold}, 1e19, fn=fn)
    assert moved <= threshold * (1 + 1e-5)


def test_clip_factors_below_the_smallest_normal_number_are_zero():
    tiny = torch.finfo(torch.float32).tiny
    norms = torch.tensor([[1e19], [1.0], [0.0], [math.inf]])
    thresholds = torch.tensor([1e-26])
    for factors in (abadi(norms, thresholds), auto(norms, thresholds)):
        assert factors[0].item() == 0.0                          # 1e-45: subnormal, not trusted
        assert factors[1].item() >= tiny and factors[3].item() == 0.0
    assert abadi(norms, thresholds)[2].item() == 1.0


def _quantile(initial: float):
    ctx = PolicyContext(["g"], [1], 10, 1.0, torch.device("cpu"), torch.float32)
    return build_policy({"kind": "quantile", "sigma": 1e-6, "lr": 2.0, "target": 0.5, "initial": initial}, ctx)


def test_the_quantile_threshold_stays_within_its_bounds_whatever_the_norms():
    generator = torch.Generator().manual_seed(0)
    low = _quantile(1e-10)
    high = _quantile(1e10)
    for _ in range(40):   # every norm 0 (all unclipped: C shrinks by e^-1 a step) / every norm inf (C grows)
        low.observe(torch.zeros(10, 1))
        low.release(generator)
        high.observe(torch.full((10, 1), math.inf))
        high.release(generator)
    assert low.thresholds().item() == pytest.approx(MIN_THRESHOLD)    # 1e-12, not e^-40·1e-10
    assert high.thresholds().item() == pytest.approx(MAX_THRESHOLD)   # 1e12, not e^40·1e10


def test_a_quantile_threshold_never_walks_to_where_clipping_is_inexact():
    # every norm 0, step after step: before the fix C went below 1.2e-38 and stuck at 2^-149 (e^-0.5 of it rounds
    # back up), where the clip factor of a row of norm √3 rounds from 0.58·2^-149 up to 2^-149: the row moved the
    # sum by 1.73·C (at η = 0.3 the walk took ~586 steps from 1.0 and stuck at 3·2^-149: 1.97·C with a norm of √35)
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "quantile", "sigma": 1e-6, "lr": 1.0,
                                                                     "initial": 2e-38}},
                      gradient_noise_multiplier=1e-30, expected_batch_size=1, seed=0)
    for _ in range(40):
        engine.backward(model(torch.ones(4, 3)).sum(dim=1) * 0.0)
        engine.privatize()
    threshold = engine.policy.thresholds().item()
    engine.backward(model(torch.ones(1, 3)).sum(dim=1))
    engine.privatize()
    engine.detach()
    assert model.weight.grad.double().norm().item() <= threshold * (1 + 1e-5)
