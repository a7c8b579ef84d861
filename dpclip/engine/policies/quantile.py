"""Adaptive per-group thresholds by private quantile estimation.

He et al., "Exploring the limits of DP deep learning with group-wise clipping"
(papers/adaptive-per-layer-per-device-clipping.txt, Algorithm 1), after Andrew et al.,
"Differentially private learning with adaptive clipping". Per group k, target quantile
q and learning rate η (docs/methods.md):

    count_k = Σ_i (1[n_{i,k} ≤ C_k] − ½)                     (shifted unclipped count)
    b_k     = clamp((count_k + N(0, σ_b²)) / B + ½, 0, 1)     (B = EXPECTED batch size)
    C_k    ← clamp(C_k · exp(−η (b_k − q)), C_min, C_max)

Too many samples unclipped (b_k > q) shrinks C_k. The papers' rule has no bounds: a group whose
norms all stay below C_k (a layer with no gradient) walked C_k down by e^(−η/2) a step, below
float32's smallest normal number after ~600 steps at η = 0.3 (then subnormal, where clipping is
inexact: tests/privacy/test_tiny_thresholds.py), and one whose norms are all non-finite up to inf
(every step refused). dpclip keeps C_k, the initial value too, in [:data:`MIN_THRESHOLD`,
:data:`MAX_THRESHOLD`] = [1e-12, 1e12], a post-processing of released values. They are
constants, not recipe fields: a recipe's dump, and so a run's privacy fingerprint, stays what
it was, and an earlier run resumes.

Adding or removing one example moves every count_k by ½, so the K-vector has L2 sensitivity
√K / 2 (:func:`count_sensitivity`, what both the planner charges and the engine reports); it
is released jointly with the gradient of the same sample (σ_eff⁻² = σ_g⁻² + K / (4σ_b²),
docs/accounting.md). The counts
add up in float64: weighted (user-level) counts summed in float32 over micro-batches round to
ulps of the running count, and one person's removal then moved them by more than ½.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from dpclip.engine.policies import register_policy
from dpclip.engine.policies.base import (AuxRelease, BudgetShare, PolicyContext, PositiveFloat, Threshold, ThresholdPolicy,
                                         UnitOpen)


#: the bounds of every C_k (module doc): far from float32's limits, far beyond any useful threshold
MIN_THRESHOLD, MAX_THRESHOLD = 1e-12, 1e12


def count_sensitivity(groups: int) -> float:
    """L2 sensitivity of the K shifted counts: √K / 2 (each moves by ½ per example)."""
    return math.sqrt(groups) / 2


class QuantileThreshold(ThresholdPolicy):
    """Geometric update of each group's threshold toward the target quantile of its norms."""

    def __init__(self, initial: Tensor, target: float, lr: float, sigma: float, expected_batch_size: int,
                 min_threshold: float = MIN_THRESHOLD, max_threshold: float = MAX_THRESHOLD):
        self.min_threshold, self.max_threshold = min_threshold, max_threshold
        self._values = initial.clamp(min_threshold, max_threshold)
        self.target = target
        self.lr = lr
        self.sigma = sigma
        self.expected_batch_size = expected_batch_size
        self._shifted_counts = self._zero_counts()
        self._last_fraction: list[float] | None = None

    def _zero_counts(self) -> Tensor:
        return torch.zeros(self._values.shape, device=self._values.device, dtype=torch.float64)

    def thresholds(self) -> Tensor:
        return self._values

    def observe(self, norms: Tensor, weights: Tensor | None = None) -> None:
        shifted = (norms <= self._values).to(torch.float64) - 0.5
        if weights is not None:   # a person's rows weigh 1 together: |Σ w_i (u_i − ½)| <= ½
            shifted = shifted * weights.to(shifted)[:, None]
        self._shifted_counts = self._shifted_counts + shifted.sum(dim=0)

    def pending_statistic(self) -> Tensor:
        return self._shifted_counts

    def drop_observations(self) -> None:
        self._shifted_counts = self._zero_counts()

    def release(self, generator: torch.Generator) -> list[AuxRelease]:
        # drawn in the thresholds' dtype (the draws of a seeded run as before), added in float64
        noisy = self.noised(self._shifted_counts, lambda: (torch.randn(
            self._shifted_counts.shape, generator=generator, device=self._values.device,
            dtype=self._values.dtype) * self.sigma).to(torch.float64))
        unclipped_fraction = (noisy / self.expected_batch_size + 0.5).clamp(0.0, 1.0)
        step = torch.exp(-self.lr * (unclipped_fraction.to(self._values.dtype) - self.target))
        self._values = (self._values * step).clamp(self.min_threshold, self.max_threshold)
        self._last_fraction = unclipped_fraction.tolist()
        self._shifted_counts = self._zero_counts()
        return [AuxRelease(count_sensitivity(len(self._values)), self.sigma, QuantileSpec.statistic_name)]

    def summary(self) -> dict:
        return {"noisy_unclipped_fraction": self._last_fraction}

    def state_dict(self) -> dict:
        return {"thresholds": self._values.detach().cpu().tolist()}

    def load_state_dict(self, state: dict) -> None:
        self._values = torch.tensor(state["thresholds"], device=self._values.device, dtype=self._values.dtype)
        self._shifted_counts = self._zero_counts()


@register_policy
class QuantileSpec(BudgetShare):
    """He et al. adaptive per-group thresholds by private quantile estimation (Andrew et al.)."""

    kind: Literal["quantile"]
    target: UnitOpen = Field(0.5, description="target quantile of unclipped norms")
    lr: PositiveFloat = Field(0.3, description="geometric update rate η")
    sigma: PositiveFloat | None = Field(None, description="noise std σ_b of the counts")
    budget_fraction: UnitOpen | None = Field(None, description="share r of the budget; default 0.01")
    initial: Threshold = Field(1.0, description="initial threshold per group")

    example = {"kind": "quantile", "sigma": 2.0, "target": 0.6, "lr": 0.5, "initial": 0.8}
    recipe_note = "Give `sigma` or `budget_fraction` (default 0.01). The counts are released jointly with the gradient."
    statistic_alias = "quantile"
    statistic_name = "quantile counts"
    noise_field = "sigma"
    missing_noise = ("the quantile policy needs the noise std 'sigma' of its counts",
                     "the training workflow derives it from budget_fraction; when using DPEngine "
                     "directly, pass threshold: {kind: quantile, sigma: ...}")

    @classmethod
    def statistic_sensitivity(cls, groups: int) -> float:
        return count_sensitivity(groups)

    @model_validator(mode="after")
    def _noise(self) -> QuantileSpec:
        if self.sigma is None and self.budget_fraction is None:
            self.budget_fraction = 0.01
        self._one_noise_field("sigma", None)
        return self

    def build(self, ctx: PolicyContext) -> QuantileThreshold:
        initial = torch.full((ctx.num_groups,), float(self.initial), device=ctx.device, dtype=ctx.dtype)
        return QuantileThreshold(initial, self.target, self.lr, float(self.sigma), ctx.expected_batch_size)
