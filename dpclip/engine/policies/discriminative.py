"""Discriminative clipping (DC-DPSGD): heavy-tail samples at ``large``, the body at ``small``.

After "Differentially private SGD under heavy-tailed gradients: discriminative clipping"
(papers/dc-dpsgd-heavy-tails.txt, Algorithm 1; docs/methods.md). Per step, every sample gets
a tail score s_i; tail samples are clipped at c_large, the others at c_small:

    tail_rule "threshold":     tail(i) = s_i > tail_threshold            (per sample)
    tail_rule "top_fraction":  tail(i) = i among the ⌈p·B⌉ largest s_i   (ranks the batch)

**Tail score: the per-sample gradient norm, not the paper's projected trace.** The paper
projects each *normalised* per-sample gradient on a fresh random k-dimensional subspace
(orthonormalised sub-Weibull vectors) and uses the squared projection ("trace"). dpclip's
engine computes per-sample norms by book-keeping and never materialises per-sample
gradient vectors, which the projection would need (k inner products of d-dimensional
vectors per sample). We use s_i = ‖g_i‖ (the sample's norm over all groups) instead: the
heavy tail the paper targets is a tail of gradient magnitudes, and the norm identifies it
exactly, with no subspace error. Note also that for a fresh, isotropic random subspace the
trace of a normalised gradient has the same law Beta(k/2, (d−k)/2) whatever the gradient,
so its information comes only from the subspace's anisotropy. ``subspace_dim`` is accepted
for recipe compatibility and recorded, but it is ignored: it does not change the result.

**Privacy (the published code under-noises by ~7x).** The score is computed from the
sample's own gradient and never released, so no extra budget is spent; what matters is the
gradient's sensitivity, :func:`gradient_sensitivity`, which the engine noises with (through
:meth:`DiscriminativeThreshold.sensitivity_thresholds`) and the spec declares:

- per-sample threshold rule: one example contributes at most c_large → sensitivity c_large;
- top-fraction rule: adding an example can also push ONE other sample out of (or into) the
  top set (the set size ⌈p·B⌉ uses the EXPECTED batch size B, so it does not move), changing
  that sample's contribution by at most c_large − c_small → sensitivity 2·c_large − c_small.
- top-fraction rule at the user level (docs/users.md): a person brings up to k rows, each
  weighted 1/(their rows in the step), so together at most c_large; they can push up to k
  rows of other people out of the top set, each weighted at most 1 → sensitivity
  c_large + k·(c_large − c_small) (k = 1 gives the line above). The rule still ranks rows.

Across ranks (docs/distributed.md) the rule still ranks the whole logical batch: every rank
gathers all ranks' scores (in rank order) through the engine's reducer, applies the same
rule to the same vector, and keeps its own part of the mask. The top set is then the one
process's, and adding an example moves no other sample's place in the rank-ordered vector,
so the bound above holds unchanged; the scores are never released. A rank with no samples
still joins the exchange (:meth:`DiscriminativeThreshold.empty_part`).

The authors' code adds noise for c_small although a sample can contribute c_large. With K
groups, a float small/large is the total and each group gets small/√K, large/√K (as fixed
thresholds); the whole sample is tail or body, in every group at once.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from dpclip.engine.policies import register_policy
from dpclip.engine.policies.base import (PolicyContext, PolicySpec, PositiveInt, Threshold, ThresholdPolicy,
                                         UnitOpen, initial_thresholds)
from dpclip.errors import EngineError


def tail_mask_threshold(scores: Tensor, tail_threshold: float) -> Tensor:
    """Per-sample rule: tail(i) = s_i > tail_threshold."""
    return scores > tail_threshold


def tail_mask_top(scores: Tensor, fraction: float, expected_batch_size: int) -> Tensor:
    """Top-fraction rule: the ⌈fraction · B⌉ samples with the largest scores (B expected, not realised),
    ties broken by position in the batch. The order (score descending, position) of the other
    samples is the same with or without one added example, so adding it changes at most one
    other sample's side: the sensitivity 2·c_large − c_small needs that. ``torch.topk`` does not
    promise it (among equal scores it may pick others once the batch changes)."""
    count = min(math.ceil(fraction * expected_batch_size), scores.shape[0])
    mask = torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    if count > 0:
        order = torch.sort(scores, descending=True, stable=True).indices
        mask[order[:count]] = True
    return mask


def gradient_sensitivity(small, large, tail_rule: str, records_per_unit: int = 1):
    """Sensitivity of the clipped sum: c_large (per-sample rule), c_large + k·(c_large − c_small)
    (top fraction, k = ``records_per_unit``: 2·c_large − c_small for one record; module doc).

    Floats give the total; per-group tensors give the per-group bound, whose L2 norm is the total.
    """
    return large if tail_rule == "threshold" else large + records_per_unit * (large - small)


class DiscriminativeThreshold(ThresholdPolicy):
    """Clip each sample at ``small`` or ``large`` by its norm (see module doc)."""

    per_sample = True

    def __init__(self, small: Tensor, large: Tensor, tail_rule: str, tail_threshold: float | None,
                 top_fraction: float, expected_batch_size: int, subspace_dim: int, records_per_unit: int = 1):
        self.small = small
        self.records_per_unit = records_per_unit
        self.large = large
        self.tail_rule = tail_rule
        self.tail_threshold = tail_threshold
        self.top_fraction = top_fraction
        self.expected_batch_size = expected_batch_size
        self.subspace_dim = subspace_dim
        self._ranked_this_step = False

    def thresholds(self) -> Tensor:
        return self.small

    def sensitivity_thresholds(self) -> Tensor:
        # Per group: large_k (or large_k + k·(large_k − small_k)); their L2 norm is the total sensitivity.
        return gradient_sensitivity(self.small, self.large, self.tail_rule, self.records_per_unit)

    def tail_mask(self, norms: Tensor, dry: bool = False) -> Tensor:
        """``dry``: the certificate's rows of their own (``engine.certify``, a check replayed in eval
        mode), ranked alone: neither the step's one ranking nor a wait for the other ranks (their
        sums are thrown away, and one rank may check while the others do not)."""
        scores = norms.norm(dim=1)        # the sample's gradient norm over all groups
        if self.tail_rule == "threshold":
            return tail_mask_threshold(scores, self.tail_threshold)
        if dry:
            return tail_mask_top(scores, self.top_fraction, self.expected_batch_size)
        if self._ranked_this_step:
            # Ranking inside each micro-batch would let one example move chunk boundaries and
            # re-rank many samples: the 2·large − small bound would no longer hold.
            raise EngineError("tail_rule 'top_fraction' ranks the whole logical batch and cannot be "
                              "split into micro-batches",
                              "in your own loop, pass each logical batch to one engine.backward (a recipe: "
                              "training.micro_batch_size=null), or use tail_rule: threshold")
        self._ranked_this_step = True
        if self.reducer is None:
            return tail_mask_top(scores, self.top_fraction, self.expected_batch_size)
        everyone, start = self.reducer.gather(scores)
        return tail_mask_top(everyone, self.top_fraction, self.expected_batch_size)[start: start + scores.shape[0]]

    def empty_part(self) -> None:
        if self.reducer is not None and self.tail_rule == "top_fraction":
            self.tail_mask(torch.zeros(0, self.small.shape[0], device=self.small.device, dtype=self.small.dtype))

    def per_sample_thresholds(self, norms: Tensor) -> Tensor:
        return torch.where(self.tail_mask(norms)[:, None], self.large[None, :], self.small[None, :])

    def dry_per_sample_thresholds(self, norms: Tensor) -> Tensor:
        return torch.where(self.tail_mask(norms, dry=True)[:, None], self.large[None, :], self.small[None, :])

    def drop_observations(self) -> None:
        self._ranked_this_step = False

    def release(self, generator: torch.Generator):
        self._ranked_this_step = False
        return None                       # nothing is released: the tail split stays private

    def summary(self) -> dict:
        return {"tail_score": "norm", "sensitivity": float(self.sensitivity_thresholds().norm())}

    def state_dict(self) -> dict:
        return {"small": self.small.tolist(), "large": self.large.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.small = torch.tensor(state["small"], device=self.small.device, dtype=self.small.dtype)
        self.large = torch.tensor(state["large"], device=self.large.device, dtype=self.large.dtype)
        self._ranked_this_step = False


@register_policy
class DiscriminativeSpec(PolicySpec):
    """DC-DPSGD: body clipped at `small`, heavy-tail samples at `large`."""

    kind: Literal["discriminative"]
    small: Threshold
    large: Threshold | None = Field(None, description="default 10 x small")
    subspace_dim: PositiveInt = Field(200, description="the paper's projection dimension; ignored (recorded only): "
                                      "dpclip scores samples by gradient norm (docs/methods.md)")
    tail_rule: Literal["threshold", "top_fraction"] = Field(
        "threshold", description="threshold: noise for `large`; top_fraction ranks the batch: noise for 2·large − small")
    tail_threshold: Threshold | None = Field(None, description="gradient norm above which a sample is tail")
    top_fraction: UnitOpen = Field(0.1, description="share of the expected batch clipped at `large` (top_fraction rule)")

    example = {"kind": "discriminative", "small": 0.5, "large": 3.0, "tail_rule": "top_fraction",
               "top_fraction": 0.25}

    @model_validator(mode="after")
    def _large(self) -> DiscriminativeSpec:
        if self.large is None:
            self.large = 10 * self.small
        if self.large <= self.small:
            raise ValueError("'large' must exceed 'small'")
        if self.tail_rule == "threshold" and self.tail_threshold is None:
            raise ValueError("tail_rule 'threshold' needs 'tail_threshold'")
        return self

    def gradient_sensitivity(self, records_per_unit: int = 1) -> float:
        return gradient_sensitivity(self.small, self.large, self.tail_rule, records_per_unit)

    def ranks_whole_batch(self) -> bool:
        return self.tail_rule == "top_fraction"

    def check_recipe(self, recipe: Any) -> None:
        if self.tail_rule == "top_fraction" and recipe.training.micro_batch_size is not None:
            raise ValueError("clipping.threshold.tail_rule 'top_fraction' ranks the whole logical batch, which is "
                             "processed in one backward: set training.micro_batch_size=null")

    def build(self, ctx: PolicyContext) -> DiscriminativeThreshold:
        return DiscriminativeThreshold(initial_thresholds(self.small, ctx, "threshold.small"),
                                       initial_thresholds(self.large, ctx, "threshold.large"), self.tail_rule,
                                       self.tail_threshold, self.top_fraction, ctx.expected_batch_size,
                                       self.subspace_dim, ctx.records_per_unit)
