"""What every threshold policy is made of (docs/engine.md, "Threshold policies").

A threshold policy says where the per-group clipping thresholds C_k come from. It lives in
one file of :mod:`dpclip.engine.policies` and defines, registered together:

1. its **spec**, a :class:`PolicySpec` (pydantic): the recipe's ``clipping.threshold`` block,
   with its defaults and rules, and what the planner charges (:meth:`PolicySpec.statistic`,
   pure Python, so the accounting layer stays torch-free);
2. its **engine policy**, a :class:`ThresholdPolicy`, built by :meth:`PolicySpec.build`.

The engine asks its policy, every logical batch:

``thresholds()``                 -> tensor [K], the C_k used to clip this step;
``observe(norms)``               per micro-batch, the per-sample group norms [b, K]
                                 (private: a policy may only *release* them with noise);
                                 a non-finite norm arrives as +inf (that sample
                                 contributes zero to the gradient);
``per_sample_thresholds(norms)`` -> [b, K] or None, only when ``per_sample = True``
                                 (discriminative clipping clips each sample at small or
                                 large); the engine then finalizes groups at the end of the
                                 backward, when all K norms of a sample are known;
``dry_per_sample_thresholds(norms)`` the same for the certificate's dry micro-batches (sums
                                 thrown away): no change to the step's state, no collective;
``sensitivity_thresholds()``     -> [K], the largest threshold any sample can get (the
                                 gradient's sensitivity is sqrt(Σ_k of their squares));
``empty_part()``                 across ranks, instead of the step's backward when this
                                 rank's part of the logical batch is empty: a policy that
                                 exchanges norms with the other ranks in the backward
                                 (discriminative top-fraction) takes part here;
``release(generator)``           once per step, after the gradient noise: the noisy
                                 statistics it used, as ``AuxRelease(sensitivity, sigma)``
                                 (or None). Its update applies from the next step;
``pending_statistic()``          the statistic accumulated since the last release, WITHOUT
                                 noise (private: for the contract tests, never logged);
``summary()``                    -> dict of released values for the run's metrics;
``state_dict() / load_state_dict()`` for checkpoints;
``held()`` / ``roll_back(held)``  around each release: a ``privatize`` that raised (an
                                 out-of-memory in a noise draw, a Ctrl-C, a refusal) puts
                                 the policy back as it was before the step, its observations
                                 dropped (``drop_observations()``), so that the next release
                                 carries the next batch alone and no threshold moves by a
                                 statistic that was never charged. The defaults copy every
                                 attribute (tensors by ``clone()``: no host synchronisation);
                                 a policy that observes overrides ``drop_observations``.

A release with L2 sensitivity Δ_a and noise std σ_a taken on the same sample as the
gradient composes with it into one Gaussian mechanism with
σ_eff⁻² = σ_g⁻² + Σ_a (Δ_a/σ_a)² (docs/accounting.md, "Joint release"; see
:func:`dpclip.engine.noise.effective_noise_multiplier`).
"""

from __future__ import annotations

import copy
import math
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, NamedTuple

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from torch import Tensor

from dpclip.errors import AccountingError, EngineError

if TYPE_CHECKING:
    from dpclip.accounting import AuxSpec

# Field types shared by the policy specs and the rest of the recipe schema.
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
#: the largest clipping threshold: thresholds are float32 tensors, in which a larger C is inf (no clipping)
THRESHOLD_MAX = float(torch.finfo(torch.float32).max)


#: the smallest: below float32's smallest normal number a threshold and its noise lose their precision
THRESHOLD_MIN = float(torch.finfo(torch.float32).tiny)


def _within_float32(value: float) -> float:
    if value < THRESHOLD_MIN:
        raise ValueError(f"{value:g} is below float32's smallest normal number ({THRESHOLD_MIN:.4g}): the threshold, "
                         "the clipped gradients and the noise would lose their precision (or be 0); a useful C is "
                         "near the gradients' norms (e.g. 0.1 to 10)")
    if value > THRESHOLD_MAX:
        raise ValueError(f"{value:g} is beyond float32's range (at most {THRESHOLD_MAX:.4g}): the engine would hold "
                         "the threshold as inf, clip nothing and add noise of infinite std; a useful C is near the "
                         "gradients' norms (e.g. 0.1 to 10)")
    return value


#: a clipping threshold (or a bound on one): positive, finite, and finite in float32
Threshold = Annotated[float, Field(gt=0, allow_inf_nan=False), AfterValidator(_within_float32)]
PositiveInt = Annotated[int, Field(gt=0)]
UnitOpen = Annotated[float, Field(gt=0, lt=1)]


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
    gradient_noise_multiplier: float  # σ_g
    device: torch.device
    dtype: torch.dtype
    records_per_unit: int = 1         # the most rows one privacy unit has in a step: k at the user level

    @property
    def num_groups(self) -> int:
        return len(self.group_names)


class ThresholdPolicy:
    """Base class with the do-nothing defaults of every hook (see module doc)."""

    per_sample: bool = False
    #: set by the engine when ranks share the logical batch (:mod:`dpclip.engine.reducer`).
    reducer = None

    def noised(self, statistic: Tensor, draw_noise) -> Tensor:
        """``statistic + draw_noise()``; across ranks, Σ_r statistic_r plus noise drawn once, by the
        one rank that draws (docs/distributed.md): every rank then updates from the same value."""
        if self.reducer is None:
            return statistic + draw_noise()
        return self.reducer.sum(statistic + draw_noise() if self.reducer.draws_noise else statistic.clone())

    def thresholds(self) -> Tensor:
        raise NotImplementedError

    def sensitivity_thresholds(self) -> Tensor:
        return self.thresholds()

    def observe(self, norms: Tensor, weights: Tensor | None = None) -> None:
        """See a micro-batch's per-sample norms [b, K]; ``weights`` [b] (user-level privacy:
        a person's rows weigh 1 together, docs/users.md) scale each row's contribution to a
        statistic, which keeps its sensitivity per person what it is per record."""

    def per_sample_thresholds(self, norms: Tensor) -> Tensor | None:
        return None

    def dry_per_sample_thresholds(self, norms: Tensor) -> Tensor | None:
        """:meth:`per_sample_thresholds` for the certificate's dry micro-batches, whose sums are thrown
        away: it must leave the policy's step as it was and talk to no other rank."""
        return self.per_sample_thresholds(norms)

    def empty_part(self) -> None:
        pass

    def release(self, generator: torch.Generator) -> list[AuxRelease] | None:
        return None

    def pending_statistic(self) -> Tensor | None:
        return None

    def summary(self) -> dict:
        """Released (noisy) quantities worth logging after ``release``, as plain JSON values
        (e.g. a histogram range R_t or noisy counts). Never raw private statistics."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def held(self) -> dict:
        """What a release may move, taken by the engine before it: every attribute, tensors cloned on
        their own device (``clone()`` is queued there: no host synchronisation, issue 54), lists and
        dicts copied. A policy holding other mutable objects overrides it and :meth:`roll_back`."""
        return {name: _held_copy(value) for name, value in vars(self).items()}

    def roll_back(self, held: dict) -> None:
        """The step was not released (``privatize`` refused or raised): the policy as :meth:`held` found
        it, then the step's observations dropped. Runs on the way out of a failure (often an out-of-memory),
        so it copies nothing: ``held`` is taken over, and used once."""
        for name, value in held.items():
            setattr(self, name, value)
        self.drop_observations()

    def drop_observations(self) -> None:
        """Forget what :meth:`observe` and :meth:`per_sample_thresholds` saw since the last release
        (the default: a policy that keeps nothing of them)."""


def _held_copy(value: Any) -> Any:
    """``value`` as :meth:`ThresholdPolicy.held` keeps it: a tensor cloned (on its device), a list, dict or
    set copied (their items are replaced, never changed in place, by the policies), anything else as is."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, (list, dict, set)):
        return copy.copy(value)
    return value


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
    thresholds = torch.tensor(values, device=ctx.device, dtype=ctx.dtype)
    finfo = torch.finfo(ctx.dtype)   # (a complex dtype's real part's; complex parameters are refused by name later)
    # 1e39 is inf in float32 (no clipping, noise of std σ·inf); below the smallest normal number the
    # threshold, the clipped gradients and the noise lose their precision (1e-46 is 0)
    if not all(finfo.tiny <= v <= finfo.max for v in values):
        raise EngineError(f"{what} {value!r} is outside the range of {ctx.dtype} ({finfo.tiny:.4g} to {finfo.max:.4g}"
                          " per group)", "a useful C is near the gradients' norms (e.g. 0.1 to 10)")
    return thresholds


class PolicySpec(BaseModel):
    """Base of every threshold policy's spec: the recipe's ``clipping.threshold`` block.

    A subclass declares ``kind: Literal["<kind>"]`` and its fields, sets ``example`` (an
    engine-ready spec the contract suite runs, tests/engine/policies) and overrides the hooks
    that apply to it; the defaults fit a policy that releases nothing.
    """

    model_config = ConfigDict(extra="forbid", validate_default=True)

    #: an engine-ready ``threshold`` dict (noise stds explicit) for the contract tests.
    example: ClassVar[dict[str, Any]] = {}
    #: shown under the policy's section of docs/recipes.md.
    recipe_note: ClassVar[str] = ""
    #: the name ``dpclip account --aux`` knows its statistic by (None: releases nothing).
    statistic_alias: ClassVar[str | None] = None

    @classmethod
    def kind_name(cls) -> str:
        return typing.get_args(cls.model_fields["kind"].annotation)[0]

    # ------------------------------------------------------------ what the planner charges

    def statistic(self, groups: int) -> AuxSpec | None:
        """The statistic released with every gradient over ``groups`` groups, or None."""
        return None

    def releases_statistic(self) -> bool:
        return self.statistic(1) is not None

    def gradient_sensitivity(self) -> float | None:
        """The clipped sum's L2 sensitivity when it is a fixed number (None: ‖C_t‖ of the step)."""
        return None

    @property
    def aux_sigma(self) -> float | None:
        """The statistic's noise std when the recipe fixes it (None: from the budget split)."""
        return None

    # ------------------------------------------------------------ recipe rules (hooks)

    def check_clipping(self, clipping: Any) -> None:
        """Rules across ``clipping`` (grouping, fn, allocation); raise ValueError to refuse."""

    def check_recipe(self, recipe: Any) -> None:
        """Rules across the whole recipe; raise ValueError to refuse."""

    # ------------------------------------------------------------ the engine

    def ranks_whole_batch(self) -> bool:
        """True when the policy compares the samples of a logical batch with each other, so
        the whole batch must reach the engine in one backward (no micro-batches)."""
        return False

    def engine_dict(self, sigma_aux: float | None = None) -> dict[str, Any]:
        """The ``threshold`` dict for DPEngine, with the statistic's noise std ``sigma_aux``
        from the budget split filled in (ignored by a policy that releases nothing)."""
        return self.model_dump(mode="python")

    def for_engine(self, sigma_aux: float | None = None) -> PolicySpec:
        """This spec as the engine takes it: :meth:`engine_dict` checked as DPEngine checks a
        dict (:meth:`check_engine_dict`) and validated once, here, so that the engine builds
        its policy from a typed spec (docs/design.md, the clipping settings)."""
        settings = self.engine_dict(sigma_aux)
        type(self).check_engine_dict(settings)
        return type(self).model_validate(settings)

    @classmethod
    def check_engine_dict(cls, spec: dict[str, Any]) -> None:
        """Refuse what DPEngine cannot fill in itself (it does no budget split)."""

    def build(self, ctx: PolicyContext) -> ThresholdPolicy:
        raise NotImplementedError


class BudgetShare(PolicySpec):
    """A policy that releases a statistic with noise: its own σ or a share r of the budget (docs/methods.md)."""

    #: the field holding the statistic's noise std.
    noise_field: ClassVar[str] = "sigma"
    #: how the privacy statement names the statistic.
    statistic_name: ClassVar[str] = ""
    #: EngineError text when DPEngine gets no noise std.
    missing_noise: ClassVar[tuple[str, str]] = ("", "")

    budget_fraction: UnitOpen | None = None

    @classmethod
    def statistic_sensitivity(cls, groups: int) -> float:
        """L2 sensitivity of the statistic over ``groups`` groups (one example added or removed)."""
        raise NotImplementedError

    @classmethod
    def aux_spec(cls, groups: int, sigma: float | None, fraction: float | None) -> AuxSpec:
        """What the planner charges for this statistic (also `dpclip account --aux`)."""
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise AccountingError(f"groups must be an integer >= 1, got {groups!r}",
                              "groups is the number of clipping groups K (1 for flat clipping)")
        # Lazy: dp_accounting takes a second to import, and loading a recipe does not need it.
        from dpclip.accounting import AuxSpec

        return AuxSpec(name=cls.statistic_name, sensitivity=cls.statistic_sensitivity(groups), groups=groups,
                       sigma=sigma, fraction=fraction)

    def statistic(self, groups: int) -> AuxSpec:
        from dataclasses import replace

        spec = self.aux_spec(groups, self.aux_sigma, self.budget_fraction)
        return replace(spec, sigma_name=f"clipping.threshold.{self.noise_field}")

    @property
    def aux_sigma(self) -> float | None:
        return getattr(self, self.noise_field)

    def engine_dict(self, sigma_aux: float | None = None) -> dict[str, Any]:
        spec = self.model_dump(mode="python")
        spec[self.noise_field] = sigma_aux
        spec["budget_fraction"] = None
        return spec

    @classmethod
    def check_engine_dict(cls, spec: dict[str, Any]) -> None:
        sigma = spec.get(cls.noise_field)
        if sigma is None or not isinstance(sigma, (int, float)) or not sigma > 0:
            raise EngineError(*cls.missing_noise)

    def _one_noise_field(self, sigma_field: str, default: float | None) -> None:
        sigma = getattr(self, sigma_field)
        if sigma is not None and self.budget_fraction is not None:
            raise ValueError(f"give at most one of '{sigma_field}' or 'budget_fraction'")
        if sigma is None and self.budget_fraction is None:
            if default is None:
                raise ValueError(f"give one of '{sigma_field}' or 'budget_fraction'")
            setattr(self, sigma_field, default)
