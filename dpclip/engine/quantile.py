"""Adaptive per-group thresholds by private quantile estimation.

He et al., "Exploring the limits of DP deep learning with group-wise clipping"
(papers/adaptive-per-layer-per-device-clipping.txt, Algorithm 1), after Andrew et al.,
"Differentially private learning with adaptive clipping". Per group k, target quantile
q and learning rate η (docs/methods.md):

    count_k = Σ_i (1[n_{i,k} ≤ C_k] − ½)                     (shifted unclipped count)
    b_k     = clamp((count_k + N(0, σ_b²)) / B + ½, 0, 1)     (B = EXPECTED batch size)
    C_k    ← C_k · exp(−η (b_k − q))

Too many samples unclipped (b_k > q) shrinks C_k. Adding or removing one example moves
every count_k by ½, so the K-vector has L2 sensitivity √K / 2; it is released jointly
with the gradient of the same sample (σ_eff⁻² = σ_g⁻² + K / (4σ_b²)).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dpclip.engine.thresholds import AuxRelease, PolicyContext, ThresholdPolicy, register_threshold_policy
from dpclip.errors import EngineError


class QuantileThreshold(ThresholdPolicy):
    """Geometric update of each group's threshold toward the target quantile of its norms."""

    def __init__(self, initial: Tensor, target: float, lr: float, sigma: float, expected_batch_size: int):
        self._values = initial
        self.target = target
        self.lr = lr
        self.sigma = sigma
        self.expected_batch_size = expected_batch_size
        self._shifted_counts = torch.zeros_like(initial)
        self._last_fraction: list[float] | None = None

    def thresholds(self) -> Tensor:
        return self._values

    def observe(self, norms: Tensor) -> None:
        unclipped = (norms <= self._values).to(self._values.dtype)
        self._shifted_counts = self._shifted_counts + (unclipped - 0.5).sum(dim=0)

    def sensitivity(self) -> float:
        return math.sqrt(len(self._values)) / 2

    def release(self, generator: torch.Generator) -> list[AuxRelease]:
        noise = torch.randn(self._shifted_counts.shape, generator=generator, device=self._values.device,
                            dtype=self._values.dtype) * self.sigma
        unclipped_fraction = ((self._shifted_counts + noise) / self.expected_batch_size + 0.5).clamp(0.0, 1.0)
        self._values = self._values * torch.exp(-self.lr * (unclipped_fraction - self.target))
        self._last_fraction = unclipped_fraction.tolist()
        self._shifted_counts = torch.zeros_like(self._values)
        return [AuxRelease(self.sensitivity(), self.sigma, "quantile counts")]

    def summary(self) -> dict:
        return {"noisy_unclipped_fraction": self._last_fraction}

    def state_dict(self) -> dict:
        return {"thresholds": self._values.detach().cpu().tolist()}

    def load_state_dict(self, state: dict) -> None:
        self._values = torch.tensor(state["thresholds"], device=self._values.device, dtype=self._values.dtype)
        self._shifted_counts = torch.zeros_like(self._values)


def _quantile_factory(spec: dict, ctx: PolicyContext) -> ThresholdPolicy:
    known = {"kind", "target", "lr", "sigma", "budget_fraction", "initial"}
    unknown = set(spec) - known
    if unknown:
        raise EngineError(f"threshold kind 'quantile' does not take {sorted(unknown)}", f"allowed: {sorted(known)}")
    sigma = spec.get("sigma")
    if sigma is None or not sigma > 0:
        raise EngineError("the quantile policy needs the noise std 'sigma' of its counts",
                          "the training workflow derives it from budget_fraction; when using DPEngine "
                          "directly, pass threshold: {kind: quantile, sigma: ...}")
    target = float(spec.get("target", 0.5))
    if not 0 < target < 1:
        raise EngineError(f"quantile target must lie in (0, 1), got {target}", "e.g. 0.5")
    initial = torch.full((ctx.num_groups,), float(spec.get("initial", 1.0)), device=ctx.device, dtype=ctx.dtype)
    return QuantileThreshold(initial, target, float(spec.get("lr", 0.3)), float(sigma), ctx.expected_batch_size)


register_threshold_policy("quantile", _quantile_factory)
