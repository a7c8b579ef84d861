"""dpclip.diagnose.hessian against exact Hessians and hand-computed formulas."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from dpclip.diagnose import HessianDiagnostics, measure, typical_clip_factor
from dpclip.errors import EngineError


def _cross_entropy(model, rows):
    return F.cross_entropy(model(rows["features"]), rows["labels"], reduction="none")


@pytest.fixture
def small():
    """A 43-parameter MLP in float64 (exact second derivatives to ~1e-12) and 24 rows."""
    data = torch.Generator().manual_seed(3)  # synthetic test inputs, not private randomness
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=data, dtype=torch.float64))
    rows = {"features": torch.randn(24, 4, generator=data, dtype=torch.float64),
            "labels": torch.randint(0, 3, (24,), generator=data)}
    return model, rows


def _exact(model, rows):
    """(H, G, per-sample gradients) as matrices over the flattened parameters."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def unflatten(theta):
        out, at = {}, 0
        for name, shape in zip(names, shapes):
            size = math.prod(shape)
            out[name] = theta[at: at + size].reshape(shape)
            at += size
        return out

    def mean_loss(theta):
        return _cross_entropy(lambda x: functional_call(model, unflatten(theta), (x,)), rows).mean()

    hessian = torch.autograd.functional.hessian(mean_loss, flat)
    gradient = torch.autograd.functional.jacobian(mean_loss, flat)
    per_sample = torch.stack([torch.autograd.functional.jacobian(
        lambda theta, i=i: _cross_entropy(lambda x: functional_call(model, unflatten(theta), (x,)),
                                          {k: v[i: i + 1] for k, v in rows.items()}).sum(), flat)
        for i in range(len(rows["labels"]))])
    return hessian, gradient, per_sample


def test_hutchinson_trace_matches_the_exact_trace_within_four_standard_errors(small):
    model, rows = small
    hessian, _, _ = _exact(model, rows)
    probes = 200
    diag = measure(model, _cross_entropy, rows, probes=probes, per_sample=4,
                   generator=torch.Generator().manual_seed(11))
    exact = float(torch.trace(hessian))
    # Rademacher probes: Var(vᵀHv) = 2·Σ_{i≠j} H_ij², so the estimate's std is sqrt(that / k).
    off_diagonal = hessian - torch.diag(torch.diag(hessian))
    std = math.sqrt(2 * float((off_diagonal ** 2).sum()) / probes)
    assert abs(diag.trace_h - exact) <= 4 * std
    assert abs(diag.trace_h - exact) <= 4 * diag.trace_h_stderr
    # The reported standard error estimates that std (k = 200: within 30% with near certainty).
    assert diag.trace_h_stderr == pytest.approx(std, rel=0.3)
    assert diag.probes == probes and diag.batch_size == 24


def test_gthg_grad_norm_and_trace_of_h_sigma_match_the_matrix_computation(small):
    model, rows = small
    hessian, gradient, per_sample = _exact(model, rows)
    diag = measure(model, _cross_entropy, rows, probes=2, per_sample=24,  # the whole batch: no subsample
                   generator=torch.Generator().manual_seed(0))
    assert diag.gthg == pytest.approx(float(gradient @ hessian @ gradient), rel=1e-9)
    assert diag.grad_norm_sq == pytest.approx(float(gradient @ gradient), rel=1e-9)
    centred = per_sample - per_sample.mean(dim=0)
    covariance = centred.T @ centred / (len(per_sample) - 1)   # unbiased, as measure() documents
    assert diag.trace_h_sigma == pytest.approx(float(torch.trace(hessian @ covariance)), rel=1e-9)
    assert diag.mean_sample_grad_norm_sq == pytest.approx(float((per_sample ** 2).sum(dim=1).mean()), rel=1e-9)
    assert diag.per_sample == 24


def test_measure_leaves_no_gradients_and_keeps_the_mode(small):
    model, rows = small
    model.train()
    measure(model, _cross_entropy, rows, probes=2, per_sample=2)
    assert all(p.grad is None for p in model.parameters()) and model.training


def test_frozen_parameters_do_not_count(small):
    model, rows = small
    model[0].requires_grad_(False)
    hessian, gradient, _ = _exact(model, rows)
    last = slice(4 * 5 + 5, None)  # the second layer's weight and bias
    diag = measure(model, _cross_entropy, rows, probes=2, per_sample=2)
    g = gradient[last]
    assert diag.gthg == pytest.approx(float(g @ hessian[last, last] @ g), rel=1e-9)


def test_measure_refuses_what_it_cannot_estimate(small):
    model, rows = small
    with pytest.raises(EngineError, match="probes"):
        measure(model, _cross_entropy, rows, probes=1)
    with pytest.raises(EngineError, match="per_sample"):
        measure(model, _cross_entropy, rows, per_sample=1)
    with pytest.raises(EngineError, match="one loss per example"):
        measure(model, lambda m, r: _cross_entropy(m, r).mean(), rows, probes=2, per_sample=2)


# ------------------------------------------------------------------- the formulas

MADE_UP = HessianDiagnostics(trace_h=50.0, trace_h_stderr=1.0, gthg=2.0, trace_h_sigma=30.0, grad_norm_sq=4.0,
                             mean_sample_grad_norm_sq=4.0, batch_size=64, probes=20)


def test_decelerator_improvement_and_b_star_are_the_papers_formulas():
    sigma, c, batch = 1.2, 0.5, 64
    # σ²·tr(H)/(B·c²) = 1.44·50 / (64·0.25) = 4.5
    assert MADE_UP.decelerator(sigma, batch, c) == pytest.approx(4.5)
    # ½|G|⁴ / (B·GᵀHG + tr(HΣ) + decelerator) = 8 / (128 + 30 + 4.5)
    assert MADE_UP.improvement(batch, sigma, c) == pytest.approx(8 / 162.5)
    # eq. (7): σ = 0, c = 1 drops the decelerator
    assert MADE_UP.improvement(batch, 0.0, 1.0) == pytest.approx(8 / 158)
    # sqrt(σ²·tr(H) / (c²·GᵀHG)) = sqrt(72 / 0.5) = 12
    assert MADE_UP.b_star_dp(sigma, c) == pytest.approx(12.0)


def test_b_star_dp_maximises_the_improvement():
    # The denominator is f(B) = a·B + b + d/B with a = GᵀHG, d = σ²tr(H)/c²; f(B*·t) =
    # sqrt(ad)·(t + 1/t) + b, which is smallest at t = 1 and equal at t = ½ and t = 2.
    sigma, c = 1.2, 0.5
    best = MADE_UP.b_star_dp(sigma, c)
    at = {t: MADE_UP.improvement(best * t, sigma, c) for t in (0.5, 0.9, 1.0, 1.1, 2.0)}
    assert at[1.0] > at[0.9] and at[1.0] > at[1.1] and at[1.0] > at[0.5] and at[1.0] > at[2.0]
    assert at[0.5] == pytest.approx(at[2.0])
    # a = 2, d = 288: f(12) = 24 + 30 + 24 = 78, f(6) = f(24) = 90
    assert at[1.0] == pytest.approx(8 / 78) and at[2.0] == pytest.approx(8 / 90)


def test_alpha_star_is_equation_10():
    # ((1/c)·tr(HΣ)·(B₁/B₀) / (tr(HΣ) + σ²tr(H)/(B₁c²)) + 1)⁻¹ = (2·30·2 / 34.5 + 1)⁻¹
    assert MADE_UP.alpha_star(32, 64, 1.2, 0.5) == pytest.approx(1 / (120 / 34.5 + 1))
    # no noise and no clipping: (B₁/B₀ + 1)⁻¹, the public share of the examples
    assert MADE_UP.alpha_star(32, 64, 0.0, 1.0) == pytest.approx(1 / 3)


@pytest.mark.parametrize("sigma, c, b0, b1", [(1.2, 0.5, 32, 64), (4.0, 0.1, 8, 256), (0.5, 2.0, 128, 16)])
def test_alpha_star_maximises_the_mixed_steps_improvement(sigma, c, b0, b1):
    """Eq. (10) against its model, derived here on its own: g_α = α·(public mean of B₀) + (1 − α)·(Σ c·g_i
    + σN)/B₁ has mean m·G, m = α + (1 − α)c, and covariance α²Σ/B₀ + (1 − α)²(c²Σ/B₁ + σ²I/B₁²); the best
    learning rate gains (Gᵀ E g)² / (2 E[gᵀHg]). The best α on a fine grid must be α*."""
    d = MADE_UP

    def gain(alpha):
        m = alpha + (1 - alpha) * c
        curvature = (m ** 2 * d.gthg + alpha ** 2 * d.trace_h_sigma / b0
                     + (1 - alpha) ** 2 * (c ** 2 * d.trace_h_sigma / b1 + sigma ** 2 * d.trace_h / b1 ** 2))
        return (m * d.grad_norm_sq) ** 2 / (2 * curvature)

    grid = [i / 100_000 for i in range(100_001)]
    best = max(grid, key=gain)
    assert d.alpha_star(b0, b1, sigma, c) == pytest.approx(best, abs=2e-5)


def test_degenerate_curvature_gives_inf_or_nan_not_an_error():
    flat = HessianDiagnostics(50.0, 1.0, -1.0, 30.0, 4.0, 4.0, 64, 20)
    assert flat.b_star_dp(1.0, 1.0) == math.inf        # GᵀHG < 0: larger batches always help
    concave = HessianDiagnostics(-50.0, 1.0, 2.0, 30.0, 4.0, 4.0, 64, 20)
    assert math.isnan(concave.b_star_dp(1.0, 1.0))
    assert concave.improvement(1, 10.0, 1.0) == math.inf  # denominator ≤ 0: no best learning rate


def test_typical_clip_factor_per_clip_function():
    # E‖g_i‖² = 4, so the root mean square norm is 2
    assert typical_clip_factor(MADE_UP, "abadi", 1.0) == pytest.approx(0.5)    # min(1/1, 1/2)
    assert typical_clip_factor(MADE_UP, "abadi", 4.0) == pytest.approx(0.25)   # min(1/4, 1/2): no clipping
    assert typical_clip_factor(MADE_UP, "auto", 1.0, gamma=0.01) == pytest.approx(1 / 2.01)
    assert typical_clip_factor(MADE_UP, None, 1.0) == 1.0
    with pytest.raises(EngineError):
        typical_clip_factor(MADE_UP, "other", 1.0)


# ------------------------------------------------------------------- dpclip's models

@pytest.mark.parametrize("name", ["gpt2-tiny-text", "cnn-layer", "quickstart"])
def test_measure_works_on_the_shipped_models(name, one_thread):
    from pathlib import Path

    from dpclip.data import load_data, select
    from dpclip.models import build_model
    from dpclip.recipe import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / f"{name}.yaml")
    data = load_data(recipe.data, seed=recipe.seed)
    model, loss_fn = build_model(recipe.model, data, seed=recipe.seed)
    model.eval()
    diag = measure(model, loss_fn, select(data.train, torch.arange(8)), probes=3, per_sample=3,
                   generator=torch.Generator().manual_seed(0))
    values = [diag.trace_h, diag.trace_h_stderr, diag.gthg, diag.trace_h_sigma, diag.grad_norm_sq,
              diag.mean_sample_grad_norm_sq]
    assert all(math.isfinite(v) for v in values)
    assert diag.grad_norm_sq > 0 and diag.mean_sample_grad_norm_sq > 0 and diag.trace_h_stderr > 0
