"""Threshold policies, one file each, and their registry (docs/engine.md, "Threshold policies").

A policy file defines its recipe spec (a :class:`PolicySpec`: fields, defaults, rules, what
the planner charges) and its engine policy (a :class:`ThresholdPolicy`), and registers the
spec with :func:`register_policy`. The recipe schema builds ``clipping.threshold`` from what
is registered, the planner asks the spec what it charges, and the engine builds the policy
from the spec: adding a policy touches no other file. The contract suite
(tests/engine/policies/test_contract.py) runs over every registered policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from dpclip.engine.policies.base import (AuxRelease, BudgetShare, PolicyContext, PolicySpec, ThresholdPolicy,
                                         initial_thresholds)
from dpclip.engine.spec import CLIPPING_DEFAULTS
from dpclip.errors import EngineError

__all__ = [
    "AuxRelease", "BudgetShare", "PolicyContext", "PolicySpec", "ThresholdPolicy", "initial_thresholds",
    "register_policy", "unregister_policy", "register_threshold_policy", "policy_specs", "policy_spec",
    "threshold_kinds", "statistic_aliases", "statistic_spec", "validate_policy", "build_policy",
    "on_registry_change",
]

PolicyFactory = Callable[[dict, PolicyContext], ThresholdPolicy]

_SPECS: dict[str, type[PolicySpec]] = {}          # registration order is the recipe union's order
_FACTORIES: dict[str, PolicyFactory] = {}          # engine-only kinds (register_threshold_policy)
_LISTENERS: list[Callable[[], None]] = []


def on_registry_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` after every (un)registration (the recipe schema rebuilds its union)."""
    _LISTENERS.append(listener)


def _changed() -> None:
    for listener in _LISTENERS:
        listener()


def register_policy(spec: type[PolicySpec]) -> type[PolicySpec]:
    """Register a policy by its spec class (usable as a class decorator); its ``kind`` is the key."""
    if not (isinstance(spec, type) and issubclass(spec, PolicySpec)):
        raise EngineError(f"register_policy needs a PolicySpec subclass, got {spec!r}",
                          "see dpclip/engine/policies/fixed.py for the smallest policy")
    kind = spec.kind_name()
    _FACTORIES.pop(kind, None)
    _SPECS[kind] = spec
    _changed()
    return spec


def unregister_policy(kind: str) -> None:
    """Forget ``kind`` (tests that register a toy policy clean up with this)."""
    known = _SPECS.pop(kind, None) is not None
    _FACTORIES.pop(kind, None)
    if known:
        _changed()


def register_threshold_policy(kind: str, factory: PolicyFactory) -> None:
    """Make ``DPEngine(clipping={"threshold": {"kind": kind, ...}})`` build ``factory(spec_dict, ctx)``.

    For direct DPEngine users: such a kind has no recipe spec, so recipes cannot name it
    (use :func:`register_policy` for that).
    """
    _SPECS.pop(kind, None)
    _FACTORIES[kind] = factory


def policy_specs() -> list[type[PolicySpec]]:
    """The registered spec classes, in registration order."""
    return list(_SPECS.values())


def policy_spec(kind: str) -> type[PolicySpec] | None:
    return _SPECS.get(kind)


def threshold_kinds() -> list[str]:
    """The kinds a recipe may name."""
    return sorted(_SPECS)


def statistic_aliases() -> list[str]:
    """The statistics `dpclip account --aux` knows, by name."""
    return sorted({s.statistic_alias for s in _SPECS.values() if s.statistic_alias})


def statistic_spec(alias: str) -> type[BudgetShare] | None:
    """The first registered policy releasing the statistic ``alias`` (they share its sensitivity)."""
    return next((s for s in _SPECS.values() if s.statistic_alias == alias), None)


def validate_policy(spec: dict[str, Any]) -> PolicySpec:
    """The spec object of an engine ``threshold`` dict; refusals are EngineErrors.

    None values mean "the default" (as everywhere in DPEngine's clipping dict). The engine
    does no budget split, so a statistic's noise std must be given.
    """
    spec = {k: v for k, v in spec.items() if v is not None}
    kind = spec.setdefault("kind", CLIPPING_DEFAULTS["threshold"]["kind"])
    model = _SPECS.get(kind)
    if model is None:
        raise EngineError(f"unknown threshold kind {kind!r}", "use one of: " + ", ".join(_all_kinds()))
    model.check_engine_dict(spec)
    try:
        return model.model_validate(spec)
    except ValidationError as err:
        problems = "; ".join(_explain(e) for e in err.errors())
        raise EngineError(f"threshold kind {kind!r}: {problems}",
                          "allowed keys: " + ", ".join(model.model_fields)) from None


def _explain(error: dict) -> str:
    where = ".".join(str(p) for p in error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return f"does not take {where!r}"
    return f"{where}: {message}" if where else message


def _all_kinds() -> list[str]:
    return sorted({*_SPECS, *_FACTORIES})


def build_policy(spec: dict | PolicySpec | None, ctx: PolicyContext) -> ThresholdPolicy:
    """The engine policy of a ``clipping.threshold`` block (a dict, a spec, or None for fixed 1.0)."""
    if spec is None:
        spec = dict(CLIPPING_DEFAULTS["threshold"])
    if isinstance(spec, dict):
        factory = _FACTORIES.get(spec.get("kind", CLIPPING_DEFAULTS["threshold"]["kind"]))
        if factory is not None:
            return factory(dict(spec), ctx)
        spec = validate_policy(spec)
    return spec.build(ctx)


# The built-in policies register themselves; this order is the recipe union's order.
from dpclip.engine.policies import fixed as _fixed  # noqa: E402,F401
from dpclip.engine.policies import quantile as _quantile  # noqa: E402,F401
from dpclip.engine.policies import histogram as _histogram  # noqa: E402,F401
from dpclip.engine.policies import discriminative as _discriminative  # noqa: E402,F401
