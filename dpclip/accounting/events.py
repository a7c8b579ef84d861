"""Building and serialising the ``DpEvent`` objects that describe dpclip's releases.

A ``DpEvent`` (from Google's ``dp_accounting``) is a *description* of a private
mechanism: enough to compute its privacy cost, nothing more. dpclip builds every
event it records through the functions here, so the CLI (``dpclip account``) and the
training loop describe a step in exactly the same way.

docs/accounting.md, "Joint release and budget split": one step releases the noisy clipped gradient and, for
adaptive-threshold policies, a noisy statistic of the *same* Poisson sample. Both are
Gaussian mechanisms on the same data, so together they are a single Gaussian mechanism
(see :func:`joint_noise_multiplier`) and one step is ``PoissonSampled(q, Gaussian(σ_eff))``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attr
import dp_accounting
from dp_accounting import dp_event

from dpclip.errors import AccountingError

__all__ = [
    "gradient_step_event",
    "joint_noise_multiplier",
    "training_event",
    "event_to_dict",
    "event_from_dict",
    "SERIALIZABLE_EVENT_TYPES",
]


def check_sample_rate(sample_rate: float) -> None:
    if not (isinstance(sample_rate, (int, float)) and 0.0 < sample_rate <= 1.0):
        raise AccountingError(
            f"sample rate must be in (0, 1], got {sample_rate!r}",
            "the sample rate is q = expected batch size / dataset size, e.g. 256/60000",
        )


def is_number(value: Any) -> bool:
    """An int or float and not a bool: ``True`` is a bool, not σ = 1 (nor ε, δ or C = 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_noise_multiplier(noise_multiplier: float, name: str = "noise multiplier") -> None:
    if not is_number(noise_multiplier) or not noise_multiplier >= 0.0:
        raise AccountingError(
            f"{name} must be a number >= 0, got {noise_multiplier!r}",
            "the noise multiplier is the Gaussian noise std divided by the sensitivity",
        )
    if math.isinf(noise_multiplier):
        raise AccountingError(
            f"{name} must be finite, got {noise_multiplier!r}",
            "an infinite noise multiplier releases nothing; leave the release out instead",
        )


def gradient_step_event(sample_rate: float, noise_multiplier: float) -> dp_accounting.DpEvent:
    """The event of one DP-SGD step: a Poisson-subsampled Gaussian mechanism.

    ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``, or just ``GaussianDpEvent(σ)`` when
    q = 1 (every example is in every batch, no amplification by sampling).

    ``σ`` is the noise multiplier for sensitivity 1 (noise std / sensitivity). When the
    step also releases auxiliary statistics, pass the joint multiplier from
    :func:`joint_noise_multiplier` (docs/accounting.md, joint release).

    A noise multiplier of 0 releases the exact clipped sum: that is not private at all,
    so the step is a ``NonPrivateDpEvent`` (its ε is infinite).
    """
    check_sample_rate(sample_rate)
    _check_noise_multiplier(noise_multiplier)
    if noise_multiplier == 0:
        return dp_accounting.NonPrivateDpEvent()
    gaussian = dp_accounting.GaussianDpEvent(float(noise_multiplier))
    if sample_rate == 1.0:
        return gaussian
    return dp_accounting.PoissonSampledDpEvent(float(sample_rate), gaussian)


def joint_noise_multiplier(
    gradient_sigma: float, aux: Sequence[tuple[float, float]] = ()
) -> float:
    """Noise multiplier of the gradient and auxiliary statistics released together.

    Formula (docs/accounting.md, joint release)::

        σ_eff⁻² = σ_g⁻² + Σ_a (Δ_a / σ_a)²

    where σ_g is the gradient's noise multiplier (sensitivity normalised to 1) and each
    auxiliary statistic a has L2 sensitivity Δ_a and Gaussian noise std σ_a.

    Why: releasing (f_1(D) + N(0, σ_1²), ..., f_m(D) + N(0, σ_m²)) of one data set is a
    Gaussian mechanism on the stacked vector (f_i / σ_i)_i with unit noise, whose
    sensitivity² is Σ_i (Δ_i/σ_i)²; its noise multiplier is therefore
    (Σ_i (Δ_i/σ_i)²)^(-1/2). This is the standard composition of Gaussian mechanisms
    (e.g. Dong, Roth & Su 2019, "Gaussian Differential Privacy", Cor. 3.3).

    Args:
        gradient_sigma: σ_g, the gradient noise multiplier (> 0).
        aux: pairs (Δ_a, σ_a) of sensitivity (>= 0) and noise std (> 0).
    """
    if not isinstance(gradient_sigma, (int, float)) or not gradient_sigma > 0:
        raise AccountingError(
            f"gradient noise multiplier must be > 0, got {gradient_sigma!r}",
            "a joint release needs noise on the gradient; use a positive noise multiplier",
        )
    inverse_square = gradient_sigma ** -2.0
    for pair in aux:
        sensitivity, sigma = pair
        if not sensitivity >= 0:
            raise AccountingError(
                f"auxiliary sensitivity must be >= 0, got {sensitivity!r}",
                "use the sensitivity the threshold policy declares (its spec's statistic(K).sensitivity)",
            )
        if not sigma > 0:
            raise AccountingError(
                f"auxiliary noise std must be > 0, got {sigma!r}",
                "a statistic released without noise is not private; give it a positive noise std",
            )
        inverse_square += (sensitivity / sigma) ** 2
    return inverse_square ** -0.5


def training_event(sample_rate: float, noise_multiplier: float, steps: int) -> dp_accounting.DpEvent:
    """``steps`` identical DP-SGD steps: ``SelfComposedDpEvent(step event, steps)``."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise AccountingError(
            f"steps must be an integer >= 1, got {steps!r}",
            "steps = ceil(epochs / sample rate); see dpclip.accounting.steps_for_epochs",
        )
    return dp_accounting.SelfComposedDpEvent(gradient_step_event(sample_rate, noise_multiplier), steps)


# --------------------------------------------------------------------------------------
# JSON serialisation
#
# dp_accounting offers to_named_tuple/from_named_tuple, but from_named_tuple imports a
# module named *in the data*: loading a ledger.json must never do that. We therefore
# keep an explicit allow-list of event classes and write plain JSON objects of the form
# {"type": "PoissonSampled", "sampling_probability": 0.01, "event": {...}}.
# --------------------------------------------------------------------------------------

def _event_types() -> dict[str, type]:
    classes = [
        dp_accounting.NoOpDpEvent,
        dp_accounting.NonPrivateDpEvent,
        dp_accounting.GaussianDpEvent,
        dp_accounting.PoissonSampledDpEvent,
        dp_accounting.SampledWithoutReplacementDpEvent,
        dp_accounting.SelfComposedDpEvent,
        dp_accounting.ComposedDpEvent,
        # In dp_accounting 0.6 this one is not re-exported at the package top level.
        dp_event.RepeatAndSelectDpEvent,
    ]
    return {cls.__name__.removesuffix("DpEvent"): cls for cls in classes}


#: Event type names (class name without the "DpEvent" suffix) -> dp_accounting class.
SERIALIZABLE_EVENT_TYPES: dict[str, type] = _event_types()
_TYPE_OF_CLASS = {cls: name for name, cls in SERIALIZABLE_EVENT_TYPES.items()}


def _unsupported_type_error(what: str) -> AccountingError:
    return AccountingError(
        f"cannot serialise event type {what}",
        "dpclip stores only these event types: " + ", ".join(sorted(SERIALIZABLE_EVENT_TYPES)),
    )


def _value_to_json(value: Any) -> Any:
    if isinstance(value, dp_accounting.DpEvent):
        return event_to_dict(value)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise AccountingError(
                f"event field is not a finite number: {value!r}",
                "events must have finite parameters to be stored in a ledger",
            )
        return float(value)
    if isinstance(value, Sequence):
        return [_value_to_json(v) for v in value]
    raise _unsupported_type_error(f"with a field of type {type(value).__name__}")


def event_to_dict(event: dp_accounting.DpEvent) -> dict[str, Any]:
    """JSON-safe dict of ``event`` (nested events become nested dicts).

    Only the event types in :data:`SERIALIZABLE_EVENT_TYPES` are accepted; anything else
    raises :class:`~dpclip.errors.AccountingError` rather than being stored half-way.
    """
    name = _TYPE_OF_CLASS.get(type(event))
    if name is None:
        raise _unsupported_type_error(type(event).__name__)
    out: dict[str, Any] = {"type": name}
    for field in attr.fields(type(event)):
        out[field.name] = _value_to_json(getattr(event, field.name))
    return out


def _value_from_json(value: Any) -> Any:
    if isinstance(value, Mapping):
        return event_from_dict(value)
    if isinstance(value, list):
        return [_value_from_json(v) for v in value]
    return value


def event_from_dict(d: Mapping[str, Any]) -> dp_accounting.DpEvent:
    """Inverse of :func:`event_to_dict`; ``event_from_dict(event_to_dict(e)) == e``."""
    if not isinstance(d, Mapping) or "type" not in d:
        raise AccountingError(
            f"not a serialised event: {d!r}",
            'a serialised event is a JSON object with a "type" key, as written by event_to_dict',
        )
    cls = SERIALIZABLE_EVENT_TYPES.get(d["type"])
    if cls is None:
        raise AccountingError(
            f"unknown event type {d['type']!r}",
            "the file was written by another dpclip version or edited by hand; known types: "
            + ", ".join(sorted(SERIALIZABLE_EVENT_TYPES)),
        )
    names = {field.name for field in attr.fields(cls)}
    given = set(d) - {"type"}
    if given != names:
        raise AccountingError(
            f"event {d['type']!r} has fields {sorted(given)}, expected {sorted(names)}",
            "the file was written by another dpclip version or edited by hand",
        )
    kwargs = {name: _value_from_json(d[name]) for name in names}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise AccountingError(
            f"invalid event {d['type']!r}: {exc}",
            "the file was written by another dpclip version or edited by hand",
        ) from exc


# ----------------------------------------------------------------------------- the engine against the plan

def _rate_and_sigma(event) -> tuple[float, float]:
    inner = getattr(event, "event", None)
    if inner is not None:
        return float(event.sampling_probability), float(inner.noise_multiplier)
    return 1.0, float(event.noise_multiplier)


def same_event(event, planned_event) -> bool:
    """Same kind, same q, same σ_eff (up to float rounding); two no-ops are the same."""
    if isinstance(event, dp_accounting.NoOpDpEvent) or isinstance(planned_event, dp_accounting.NoOpDpEvent):
        return type(event) is type(planned_event)
    if type(event) is not type(planned_event) or \
            type(getattr(event, "event", None)) is not type(getattr(planned_event, "event", None)):
        return False
    engine_q, engine_sigma = _rate_and_sigma(event)
    plan_q, plan_sigma = _rate_and_sigma(planned_event)
    return math.isclose(engine_q, plan_q, rel_tol=1e-12) and math.isclose(engine_sigma, plan_sigma, rel_tol=1e-9)


def check_same_release(engine_event, planned_event) -> None:
    """The engine's DpEvent must be the plan's (same q, same σ_eff up to rounding)."""
    if not same_event(engine_event, planned_event):
        raise RuntimeError(f"engine released {engine_event} but the plan accounts {planned_event}: "
                           "this is a dpclip bug, the run stops before the ledger could be wrong")
