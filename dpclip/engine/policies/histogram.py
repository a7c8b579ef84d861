"""Dynamic clipping from a private histogram of per-sample norms: DC-SGD-P and DC-SGD-E.

Wei et al., "DC-SGD: Differentially private SGD with dynamic clipping through gradient
norm distribution estimation" (papers/dc-sgd-dynamic-clipping.txt, Algorithms 1–4;
docs/methods.md). Every logical batch, per group k:

    bin(i)   = min(b − 1, floor(b · n_{i,k} / R_k))       (overflow goes to the last bin;
                                                          the paper prints max: a typo)
    H~_k     = H_k + N(0, σ_H² I_b)                        (Algorithm 2)
    H+_k     = max(H~_k, 0),  S'_k = Σ_j H+_k[j]           (noisy counts can be negative)

then a rule turns the released H~_k into the next step's threshold C_k (post-processing
only; the new C applies from the next step because the engine calls ``release`` after it
has noised this step's gradient):

- **percentile** (DC-SGD-P, Algorithm 3): C_k = (j + ½) R_k / b for the first bin j whose
  cumulative count reaches p · S'_k, and R_k ← 2 C_k;
- **error** (DC-SGD-E, Algorithm 4): C_k = argmin over candidates C·i/10, i = 1..20, of

      E(C) = σ_T² C² D / B² + (1/S'_k) Σ_j H+_k[j] · max(m_j − C, 0)²,  m_j = (j + ½) R_k / b

  re-centred on an end candidate (0.1C or 2C) when it wins, at most ``MAX_RECENTRE``
  times; R_k doubles when the last bin holds at least S'_k/2 and halves when the upper
  half of the bins holds at most S'_k/b.

If S'_k ≤ 0 the histogram says nothing: C_k and R_k stay. C_k is kept within
[min_threshold, max_threshold], R_k within [min_threshold, 2·max_threshold] (not in the paper:
unbounded, R_k reached 0 or inf and the bins divided 0 by 0).

Privacy: one example adds 1 to one bin of each of the K histograms, so the K·b vector has
L2 sensitivity √K whatever b (:func:`histogram_sensitivity`); ``release`` reports
``AuxRelease(√K, σ_H)``, which the engine composes with the gradient
(σ_eff⁻² = σ_T⁻² + K/σ_H²), and the plan charges the same function's value.

σ_T · C with K groups (DC-SGD-E's variance term): under the engine's *global* noise
allocation every group's summed gradient gets noise of std σ_T · ‖C‖ per coordinate
(‖C‖ = sqrt(Σ_k C_k²), the step's sensitivity). The step's total noise energy is
σ_T² ‖C‖² D / B² with D = Σ_k d_k all trainable parameters, so as a function of one
group's C_k it is σ_T² C_k² D / B² + (terms without C_k). Minimising each group's
E_k is therefore a coordinate-wise minimisation of the whole step's expected squared
error, and the ``d`` of the formula is D, the TOTAL parameter count (= the paper's d when
K = 1). Other allocations scale the noise differently; the recipe schema refuses
``dcsgd-e`` with them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from dpclip.engine.policies import register_policy
from dpclip.engine.policies.base import (AuxRelease, BudgetShare, PolicyContext, PositiveFloat, Threshold, ThresholdPolicy,
                                         UnitOpen, initial_thresholds)
from dpclip.errors import EngineError

# DC-SGD-E re-centres its candidate grid on an end candidate; each round moves C by at
# most 10x down or 2x up, so 10 rounds cover a factor 10^10 down / 1024 up.
MAX_RECENTRE = 10
CANDIDATE_STEPS = torch.arange(1, 21, dtype=torch.float64) / 10   # 0.1, 0.2, ..., 2.0


# ------------------------------------------------------------------ the math (pure functions)

def histogram_sensitivity(groups: int) -> float:
    """L2 sensitivity of K histograms: √K (one example adds 1 to one bin of each)."""
    return math.sqrt(groups)


def histogram_counts(norms: Tensor, range_: float, bins: int, weights: Tensor | None = None) -> Tensor:
    """Counts H[j] of the norms in ``bins`` equal bins over [0, R); a norm ≥ R goes to the last bin.

    bin(i) = min(b − 1, floor(b · n_i / R))   (Wei et al. Algorithm 2; the paper's "max" is a typo:
    with max every norm would land in the last bin). A non-finite norm (the engine passes
    it as +inf; NaN too) is an overflow: one count in the last bin, sensitivity unchanged.
    ``weights``: each norm counts its weight (a person's rows weigh 1 together: the person's
    counts have L1 norm 1, so L2 at most 1, one record's sensitivity).
    """
    norms = torch.nan_to_num(norms.to(torch.float64), nan=math.inf)
    index = torch.floor(norms * bins / range_).clamp(min=0, max=bins - 1).long()
    if weights is not None:
        return torch.bincount(index, weights=weights.to(torch.float64), minlength=bins)
    return torch.bincount(index, minlength=bins).to(torch.float64)


def midpoints(range_: float, bins: int) -> Tensor:
    """m_j = (j + ½) R / b, the value each bin stands for."""
    return (torch.arange(bins, dtype=torch.float64) + 0.5) * range_ / bins


def percentile_threshold(noisy: Tensor, range_: float, percentile: float) -> float | None:
    """DC-SGD-P (Algorithm 3): midpoint of the first bin where the noisy CDF reaches p·S'.

    Negative noisy counts are clamped to 0 before cumulating; S' = Σ max(H~, 0). Returns
    None when S' ≤ 0 (nothing to learn: the caller keeps C).
    """
    cumulative = torch.cumsum(noisy.clamp(min=0), 0)
    total = cumulative[-1].item()   # S' as the cumulative sum has it: a pairwise sum can be an ulp above it
    if total <= 0:
        return None
    reached = cumulative >= percentile * total
    j = int(torch.nonzero(reached)[0].item())   # exists: the last cumulative value is S' ≥ p·S' (p ≤ 1)
    return (j + 0.5) * range_ / len(noisy)


def expected_error(candidates: Tensor, noisy: Tensor, range_: float, sigma: float, dim: int,
                   batch: int) -> Tensor:
    """DC-SGD-E's estimate (§IV-C): E(C) = σ_T² C² d / B² + (1/S') Σ_j H+[j] max(m_j − C, 0)².

    H+ = max(H~, 0), S' = Σ H+ (> 0, checked by the caller), B the EXPECTED batch size.
    """
    counts = noisy.clamp(min=0)
    total = counts.sum()
    m = midpoints(range_, len(noisy))
    c = candidates.to(torch.float64)
    variance = sigma ** 2 * c ** 2 * dim / batch ** 2
    bias = (counts * (m[None, :] - c[:, None]).clamp(min=0) ** 2).sum(dim=1) / total
    return variance + bias


def error_threshold(current: float, noisy: Tensor, range_: float, sigma: float, dim: int, batch: int,
                    low: float, high: float, max_rounds: int = MAX_RECENTRE) -> float | None:
    """DC-SGD-E (Algorithm 4): argmin of E over C·i/10, i = 1..20, re-centred while an end wins.

    Candidates are clamped to [low, high]; re-centring stops after ``max_rounds`` rounds
    or when the winning end cannot move (a bound). None when S' ≤ 0.
    """
    if noisy.clamp(min=0).sum().item() <= 0:
        return None
    centre = min(max(current, low), high)
    for _ in range(max_rounds):
        candidates = (centre * CANDIDATE_STEPS).clamp(low, high)
        best = int(torch.argmin(expected_error(candidates, noisy, range_, sigma, dim, batch)).item())
        chosen = float(candidates[best])
        at_end = best in (0, len(candidates) - 1)
        if not at_end or chosen == centre:
            return chosen
        centre = chosen
    return centre


def error_range(range_: float, noisy: Tensor) -> float:
    """DC-SGD-E's "cautious" range rule (Algorithm 4, last step).

    R ← 2R if H+[b−1] ≥ S'/2 (too many norms overflow); else R ← R/2 if the upper half of the
    bins (j ≥ b//2) holds at most S'/b; else R stays. S' ≤ 0: R stays.
    """
    counts = noisy.clamp(min=0)
    total = counts.sum().item()
    bins = len(noisy)
    if total <= 0:
        return range_
    if counts[-1].item() >= total / 2:
        return 2 * range_
    if counts[bins // 2:].sum().item() <= total / bins:
        return range_ / 2
    return range_


# ------------------------------------------------------------------ the policy

class HistogramThreshold(ThresholdPolicy):
    """One noisy norm histogram per group each step; ``rule`` is "percentile" or "error"."""

    def __init__(self, rule: str, initial: Tensor, range_: Tensor, bins: int, sigma_hist: float,
                 percentile: float, sigma_gradient: float, total_dim: int, expected_batch_size: int,
                 min_threshold: float, max_threshold: float):
        self.rule = rule
        self._values = initial
        self.min_threshold = min_threshold
        self.max_threshold = max_threshold
        self._ranges = [self._bounded_range(float(r)) for r in range_]
        self.bins = bins
        self.sigma_hist = sigma_hist
        self.percentile = percentile
        self.gradient_noise_multiplier = sigma_gradient
        self.total_dim = total_dim
        self.expected_batch_size = expected_batch_size
        self._counts = torch.zeros(len(initial), bins, dtype=torch.float64)
        self._last: dict = {}

    def thresholds(self) -> Tensor:
        return self._values

    def observe(self, norms: Tensor, weights: Tensor | None = None) -> None:
        # Bins use this step's R_k; micro-batches of one logical batch add up.
        norms = norms.detach().to("cpu", torch.float64)
        weights = None if weights is None else weights.detach().to("cpu", torch.float64)
        for k, r in enumerate(self._ranges):
            self._counts[k] += histogram_counts(norms[:, k], r, self.bins, weights)

    def pending_statistic(self) -> Tensor:
        return self._counts.flatten()

    def drop_observations(self) -> None:
        self._counts = torch.zeros_like(self._counts)

    def release(self, generator: torch.Generator) -> list[AuxRelease]:
        noisy = self.noised(self._counts, lambda: torch.randn(
            self._counts.shape, generator=generator, device=generator.device, dtype=torch.float64).cpu()
            * self.sigma_hist)
        values = self._values.detach().cpu().tolist()
        released_ranges = list(self._ranges)
        for k in range(len(values)):
            values[k], self._ranges[k] = self._update(values[k], self._ranges[k], noisy[k])
        self._values = torch.tensor(values, device=self._values.device, dtype=self._values.dtype)
        clamped = noisy.clamp(min=0)
        self._last = {
            "range": released_ranges,                       # R_t the histogram was built on
            "next_range": list(self._ranges),                # R_{t+1}
            "noisy_total": clamped.sum(dim=1).tolist(),      # S' per group
            "noisy_histogram": [[round(v, 3) for v in row] for row in noisy.tolist()],
        }
        self._counts = torch.zeros_like(self._counts)
        return [AuxRelease(histogram_sensitivity(len(self._ranges)), self.sigma_hist, HistogramFields.statistic_name)]

    def _update(self, c: float, r: float, noisy: Tensor) -> tuple[float, float]:
        if self.rule == "percentile":
            new = percentile_threshold(noisy, r, self.percentile)
            if new is None:
                return c, r
            new = min(max(new, self.min_threshold), self.max_threshold)
            return new, 2 * new
        new = error_threshold(c, noisy, r, self.gradient_noise_multiplier, self.total_dim, self.expected_batch_size,
                              self.min_threshold, self.max_threshold)
        return (c if new is None else new), self._bounded_range(error_range(r, noisy))

    def _bounded_range(self, r: float) -> float:
        """R kept in [C_min, 2·C_max]. Below C_min every midpoint is below every candidate C (the rule picks
        C_min whatever R); above 2·C_max R only coarsens the bins around the largest C allowed. Unbounded, R
        halved to 0 (norms all 0) or doubled to inf (all non-finite) within ~1,100 steps, and the bins then
        divided 0 by 0 or inf by inf."""
        return min(max(r, self.min_threshold), 2 * self.max_threshold)

    def summary(self) -> dict:
        return dict(self._last)

    def state_dict(self) -> dict:
        return {"thresholds": self._values.detach().cpu().tolist(), "ranges": list(self._ranges)}

    def load_state_dict(self, state: dict) -> None:
        self._values = torch.tensor(state["thresholds"], device=self._values.device, dtype=self._values.dtype)
        self._ranges = [float(r) for r in state["ranges"]]
        self._counts = torch.zeros_like(self._counts)


# ------------------------------------------------------------------ the recipe specs

def _groups_known_from(grouping: Any) -> int:
    """K where the grouping alone fixes it (all-layer, uniform, explicit groups); else 1, a lower bound."""
    if isinstance(grouping, dict) and "uniform" in grouping:
        return int(grouping["uniform"])
    if isinstance(grouping, dict) and "groups" in grouping:
        return len(grouping["groups"])
    return 1


class HistogramFields(BudgetShare):
    bins: Annotated[int, Field(ge=2, le=1000)] = 20
    sigma_hist: PositiveFloat | None = Field(None, description="histogram noise σ_H; default 5")
    budget_fraction: UnitOpen | None = None
    initial: Threshold = Field(1.0, description="initial threshold C0")
    min_threshold: Threshold = 1e-4
    max_threshold: Threshold = 1e4

    recipe_note = ("Give `sigma_hist` or `budget_fraction` (default σ_H = 5); "
                   "σ_H must exceed √K times the total σ (K groups).")
    statistic_alias = "histogram"
    statistic_name = "norm histogram"
    noise_field = "sigma_hist"
    rule: ClassVar[str] = "percentile"

    @classmethod
    def statistic_sensitivity(cls, groups: int) -> float:
        return histogram_sensitivity(groups)

    @classmethod
    def check_engine_dict(cls, spec: dict[str, Any]) -> None:
        sigma = spec.get("sigma_hist")
        if sigma is None or not isinstance(sigma, (int, float)) or not sigma > 0:
            kind = cls.kind_name()
            raise EngineError(f"the {kind} policy needs the histogram noise std 'sigma_hist'",
                              "the training workflow derives it from the budget split; when using DPEngine "
                              f"directly, pass threshold: {{kind: {kind}, sigma_hist: 5.0}} (the paper's default)")

    @model_validator(mode="after")
    def _noise(self) -> HistogramFields:
        self._one_noise_field("sigma_hist", 5.0)
        if self.min_threshold >= self.max_threshold:
            raise ValueError("min_threshold must be below max_threshold")
        return self

    def check_recipe(self, recipe: Any) -> None:
        sigma = recipe.privacy.noise_multiplier
        groups = _groups_known_from(recipe.clipping.grouping)   # at least; a layer count needs the model
        if sigma is not None and self.sigma_hist is not None and self.sigma_hist <= math.sqrt(groups) * sigma:
            raise ValueError(
                f"clipping.threshold.sigma_hist ({self.sigma_hist:g}) must exceed √K = {math.sqrt(groups):g} "
                f"times the total noise multiplier privacy.noise_multiplier ({sigma:g}) with K = {groups} "
                "groups: the gradient gets σ_T = (σ⁻² − K·σ_H⁻²)^(−1/2), which needs σ_H > √K·σ")

    def build(self, ctx: PolicyContext) -> HistogramThreshold:
        low, high = float(self.min_threshold), float(self.max_threshold)
        if self.rule == "error" and ctx.gradient_noise_multiplier <= 0:
            raise EngineError("dcsgd-e's error rule needs a positive gradient noise multiplier σ_T",
                              "without noise the variance term vanishes and E(C) is minimised by C → ∞")
        # A float initial/range is the total over groups, as for fixed thresholds: C0/√K each.
        scale = 1 / math.sqrt(ctx.num_groups)
        initial = initial_thresholds(float(self.initial), ctx, "threshold.initial").clamp(low, high)
        ranges = torch.full((ctx.num_groups,), float(self.range) * scale, dtype=torch.float64)
        percentile = float(getattr(self, "percentile", 0.5))
        return HistogramThreshold(self.rule, initial, ranges, self.bins, float(self.sigma_hist), percentile,
                                  ctx.gradient_noise_multiplier, int(sum(ctx.group_sizes)), ctx.expected_batch_size,
                                  low, high)


@register_policy
class DCSGDPercentile(HistogramFields):
    """DC-SGD-P (Wei et al.): C = the noisy histogram's p-th percentile."""

    kind: Literal["dcsgd-p"]
    percentile: Annotated[float, Field(gt=0, le=1)] = Field(
        0.5, description="p: C is the noisy histogram's p-quantile; p near 1 needs (1-p)·B above the "
                         "clamped noise mass of the upper bins (docs/methods.md)")
    range: Threshold = Field(1.0, description="initial histogram range R0")

    example = {"kind": "dcsgd-p", "sigma_hist": 3.0, "bins": 8, "range": 4.0, "percentile": 0.7}


@register_policy
class DCSGDError(HistogramFields):
    """DC-SGD-E (Wei et al.): C minimises the estimated expected squared error."""

    kind: Literal["dcsgd-e"]
    range: Threshold = Field(20.0, description="initial histogram range R0")

    example = {"kind": "dcsgd-e", "sigma_hist": 3.0, "bins": 6, "range": 4.0}
    rule: ClassVar[str] = "error"

    def check_clipping(self, clipping: Any) -> None:
        if clipping.fn == "auto":
            raise ValueError("threshold kind dcsgd-e needs fn: abadi: its error rule's bias term "
                             "max(m - C, 0)^2 models min(1, C/||g||) clipping, while auto rescales "
                             "every sample (use dcsgd-p or a fixed threshold with auto)")
        if clipping.noise_allocation != "global":
            raise ValueError("threshold kind dcsgd-e needs noise_allocation: global: its variance "
                             "term sigma_T^2 C^2 d / B^2 assumes every group's noise scales with the "
                             "step's total sensitivity (docs/methods.md)")
