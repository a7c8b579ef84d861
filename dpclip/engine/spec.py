"""The clipping settings as the engine reads them: one typed spec, one table of defaults.

A recipe's ``clipping:`` block (:class:`dpclip.recipe.schema.Clipping`) takes its defaults
from :data:`CLIPPING_DEFAULTS` and hands the engine a :class:`ClippingSpec`
(``Clipping.engine_spec``); a plain dict is accepted only at the engine's public edge
(``DPEngine(model, clipping={...})``) and turned into a spec there, by
:meth:`ClippingSpec.from_dict`. What each setting means: docs/methods.md and docs/engine.md.

Torch-free, so that the recipe, the planner and ``dpclip account`` read the same table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from dpclip.errors import EngineError

#: Per-sample norm methods of Linear-like layers (docs/layer-rules.md): ghost when 2T² < p·d.
NORM_METHODS = ("auto", "ghost", "instantiate")

#: The defaults of every clipping setting, for recipes and DPEngine alike.
CLIPPING_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "grouping": "all-layer",
    "fn": "abadi",
    "gamma": 0.01,
    "noise_allocation": "global",
    "threshold": MappingProxyType({"kind": "fixed"}),  # C = 1.0, the fixed policy's own default
    "strict": False,
    "norm_method": "auto",
})


def _default_threshold() -> dict[str, Any]:
    return dict(CLIPPING_DEFAULTS["threshold"])


@dataclass(frozen=True)
class ClippingSpec:
    """How the engine clips: grouping of the parameters, clip function (``abadi``:
    min(1, C/‖g‖); ``auto``: C/(‖g‖ + γ)), noise allocation across groups, the threshold
    policy (its recipe spec, or the dict of a kind registered for the engine only), whether
    the torch.func fallback is refused (``strict``), and the norm method of Linear-like layers."""

    grouping: str | dict[str, Any] = CLIPPING_DEFAULTS["grouping"]
    fn: str = CLIPPING_DEFAULTS["fn"]
    gamma: float = CLIPPING_DEFAULTS["gamma"]
    noise_allocation: str = CLIPPING_DEFAULTS["noise_allocation"]
    #: the threshold policy: a validated ``PolicySpec`` (from a recipe), or a dict the engine's
    #: registry validates (its public edge, or a kind registered for the engine only)
    threshold: Any = field(default_factory=_default_threshold)
    strict: bool = CLIPPING_DEFAULTS["strict"]
    norm_method: str = CLIPPING_DEFAULTS["norm_method"]

    @classmethod
    def from_dict(cls, clipping: Mapping[str, Any] | None) -> ClippingSpec:
        """The spec of a DPEngine ``clipping`` dict; missing keys and None values take
        :data:`CLIPPING_DEFAULTS`. Unknown keys and norm methods are refused (EngineError)."""
        if clipping is not None and not isinstance(clipping, Mapping):
            raise EngineError(f"clipping must be a dict of settings, not {type(clipping).__name__} {clipping!r}",
                              "e.g. clipping={'grouping': 'layer', 'threshold': {'kind': 'fixed', 'value': 1.0}} "
                              "(docs/engine.md)")
        given = dict(clipping or {})
        threshold = given.get("threshold")
        if threshold is not None and not isinstance(threshold, Mapping) and not hasattr(threshold, "build"):
            raise EngineError(f"clipping threshold must be a dict with a kind, not {type(threshold).__name__} "
                              f"{threshold!r}", "e.g. {'kind': 'fixed', 'value': 1.0}, or {'kind': 'quantile', ...} "
                              "(docs/methods.md)")
        unknown = set(given) - set(CLIPPING_DEFAULTS)
        if unknown:
            raise EngineError(f"unknown clipping keys {sorted(unknown)}", "allowed: " + ", ".join(CLIPPING_DEFAULTS))
        spec = cls(**{key: value for key, value in given.items() if value is not None})
        if spec.norm_method not in NORM_METHODS:
            raise EngineError(f"unknown norm_method {spec.norm_method!r}", "use one of: " + ", ".join(NORM_METHODS))
        return spec

    @classmethod
    def of(cls, clipping: ClippingSpec | Mapping[str, Any] | None) -> ClippingSpec:
        """``clipping`` itself when it is a spec, else :meth:`from_dict` of it (the public edge)."""
        return clipping if isinstance(clipping, ClippingSpec) else cls.from_dict(clipping)

    def threshold_dict(self) -> dict[str, Any]:
        """The threshold policy's settings as a dict (a spec object dumped)."""
        if isinstance(self.threshold, Mapping):
            return dict(self.threshold)
        return self.threshold.model_dump(mode="python")

    def as_dict(self) -> dict[str, Any]:
        """The settings as a plain dict (a threshold spec stays an object)."""
        return {name: getattr(self, name) for name in CLIPPING_DEFAULTS}

