"""Threshold policies: where the per-group clipping thresholds C_k come from (docs/accounting.md, joint release).

A policy is asked, every logical batch:

``thresholds()``                 -> tensor [K], the C_k used to clip this step;
``observe(norms)``               per micro-batch, the per-sample group norms [b, K]
                                 (private: a policy may only *release* them with noise);
                                 a non-finite norm arrives as +inf (that sample
                                 contributes zero to the gradient);
``per_sample_thresholds(norms)`` -> [b, K] or None, only when ``per_sample = True``
                                 (discriminative clipping clips each sample at small or
                                 large); the engine then finalizes groups at the end of the
                                 backward, when all K norms of a sample are known;
``sensitivity_thresholds()``     -> [K], the largest threshold any sample can get (the
                                 gradient's sensitivity is sqrt(Σ_k of their squares));
``release(generator)``           once per step, after the gradient noise: the noisy
                                 statistics it used, as ``AuxRelease(sensitivity, sigma)``
                                 (or None). Its update applies from the next step;
``summary()``                    -> dict of released values for the run's metrics;
``state_dict() / load_state_dict()`` for checkpoints.

A release with L2 sensitivity Δ_a and noise std σ_a taken on the same sample as the
gradient composes with it into one Gaussian mechanism with
σ_eff⁻² = σ_g⁻² + Σ_a (Δ_a/σ_a)² (docs/accounting.md, joint release, "Joint release"; see
:func:`dpclip.engine.noise.effective_noise_multiplier`).

New kinds plug in with :func:`register_threshold_policy`, without touching the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from dpclip.errors import EngineError


class AuxRelease(NamedTuple):
    """A noisy statistic released by a policy: L2 sensitivity Δ_a and Gaussian noise std σ_a."""

    sensitivity: float
    sigma: float
    name: str = ""


@dataclass
class PolicyContext:
    """What a policy factory may need to know about the engine it serves."""

    group_names: list[str]
    group_sizes: list[int]           # d_k
    expected_batch_size: int
    noise_multiplier: float          # σ_g
    device: torch.device
    dtype: torch.dtype

    @property
    def num_groups(self) -> int:
        return len(self.group_names)


class ThresholdPolicy:
    """Base class with the do-nothing defaults of every hook (see module doc)."""

    per_sample: bool = False

    def thresholds(self) -> Tensor:
        raise NotImplementedError

    def sensitivity_thresholds(self) -> Tensor:
        return self.thresholds()

    def observe(self, norms: Tensor) -> None:
        pass

    def per_sample_thresholds(self, norms: Tensor) -> Tensor | None:
        return None

    def release(self, generator: torch.Generator) -> list[AuxRelease] | None:
        return None

    def summary(self) -> dict:
        """Released (noisy) quantities worth logging after ``release``, as plain JSON values
        (e.g. a histogram range R_t or noisy counts). Never raw private statistics."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def initial_thresholds(value, ctx: PolicyContext, what: str = "threshold.value") -> Tensor:
    """C_k from a recipe value: a float C gives C/sqrt(K) each (groupwise paper §2.3,
    eq. (4): total sensitivity C), a list gives one per group."""
    k = ctx.num_groups
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        values = [float(value) / math.sqrt(k)] * k
    elif isinstance(value, (list, tuple)):
        if len(value) != k:
            raise EngineError(f"{what} lists {len(value)} thresholds but there are {k} groups "
                              f"({', '.join(ctx.group_names)})",
                              "give one threshold per group, or a single float")
        values = [float(v) for v in value]
    else:
        raise EngineError(f"{what} must be a float or a list of floats, got {value!r}", None)
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise EngineError(f"{what} must be positive and finite, got {value!r}", None)
    return torch.tensor(values, device=ctx.device, dtype=ctx.dtype)


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


PolicyFactory = Callable[[dict, PolicyContext], ThresholdPolicy]
_POLICIES: dict[str, PolicyFactory] = {}


def register_threshold_policy(kind: str, factory: PolicyFactory) -> None:
    """Make ``threshold: {kind: <kind>, ...}`` build ``factory(spec, context)``."""
    _POLICIES[kind] = factory


def threshold_kinds() -> list[str]:
    return sorted(_POLICIES)


def build_policy(spec: dict | None, ctx: PolicyContext) -> ThresholdPolicy:
    """The policy described by a recipe's ``clipping.threshold`` block."""
    spec = {"kind": "fixed", "value": 1.0} if spec is None else dict(spec)
    kind = spec.get("kind", "fixed")
    factory = _POLICIES.get(kind)
    if factory is None:
        raise EngineError(f"unknown threshold kind {kind!r}",
                          "use one of: " + ", ".join(threshold_kinds()))
    return factory(spec, ctx)


def _fixed_factory(spec: dict, ctx: PolicyContext) -> ThresholdPolicy:
    unknown = set(spec) - {"kind", "value"}
    if unknown:
        raise EngineError(f"threshold kind 'fixed' takes only 'value', got {sorted(unknown)}", None)
    return FixedThreshold(initial_thresholds(spec.get("value", 1.0), ctx))


register_threshold_policy("fixed", _fixed_factory)
