"""Fixed thresholds: the same C_k every step; nothing is released (docs/methods.md).

A float C is the total: each of K groups gets C/sqrt(K), so the clipped sum's sensitivity
is C (groupwise paper §2.3, eq. (4)); a list gives one C_k per group and the sensitivity
sqrt(Σ_k C_k²).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from dpclip.engine.policies import register_policy
from dpclip.engine.policies.base import PolicyContext, PolicySpec, Threshold, ThresholdPolicy, initial_thresholds


class FixedThreshold(ThresholdPolicy):
    """Constant thresholds; releases nothing."""

    def __init__(self, values: Tensor):
        self._values = values

    def thresholds(self) -> Tensor:
        return self._values

    def state_dict(self) -> dict:
        return {"thresholds": self._values.detach().cpu().tolist()}

    def load_state_dict(self, state: dict) -> None:
        self._values = torch.tensor(state["thresholds"], device=self._values.device,
                                    dtype=self._values.dtype)


@register_policy
class FixedSpec(PolicySpec):
    kind: Literal["fixed"]
    value: Threshold | list[Threshold] = Field(
        1.0, description="one C (each of K groups gets C/sqrt(K)) or a list of K per-group thresholds")

    example = {"kind": "fixed", "value": 1.5}

    def gradient_sensitivity(self) -> float:
        if isinstance(self.value, list):
            return math.sqrt(sum(v * v for v in self.value))
        return float(self.value)

    def check_clipping(self, clipping: Any) -> None:
        if not isinstance(self.value, list):
            return
        grouping = clipping.grouping
        if grouping == "all-layer" and len(self.value) != 1:
            raise ValueError("all-layer grouping has one group: threshold.value must be one number")
        if isinstance(grouping, dict) and "uniform" in grouping and len(self.value) != grouping["uniform"]:
            raise ValueError(f"threshold.value lists {len(self.value)} thresholds "
                             f"for {grouping['uniform']} uniform groups")
        if isinstance(grouping, dict) and "groups" in grouping and len(self.value) != len(grouping["groups"]):
            raise ValueError(f"threshold.value lists {len(self.value)} thresholds "
                             f"for {len(grouping['groups'])} explicit groups")

    def build(self, ctx: PolicyContext) -> FixedThreshold:
        return FixedThreshold(initial_thresholds(self.value, ctx))
