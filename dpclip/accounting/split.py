"""Splitting one privacy budget between the gradient and auxiliary statistics.

A step that releases the noisy gradient (noise multiplier σ_g, sensitivity 1 after
clipping) and a noisy statistic (sensitivity Δ, noise std σ_a) of the same Poisson
sample is one Gaussian mechanism with (docs/accounting.md, joint release)::

    σ⁻² = σ_g⁻² + (Δ/σ_a)²

Calibration finds the total σ for (ε, δ); this module works backwards from σ to
(σ_g, σ_a). The *budget fraction* of the statistic is r = (Δ/σ_a)²·σ²: the share of
σ⁻² (the "precision", which adds up across releases) spent on it. Then::

    σ_g = σ / sqrt(1 − r)          (r = 0.01 -> σ_g = 1.005σ; r = 0.1 -> 1.054σ)
    σ_a = Δ·σ / sqrt(r)

The sensitivity Δ of a statistic is declared by the threshold policy that releases it
(its spec's ``statistic(K)``, dpclip/engine/policies/; docs/accounting.md, joint release):
this module only needs the number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dpclip.errors import AccountingError

__all__ = ["NoiseSplit", "split_noise", "check_aux_fits", "FORMER_NAMES", "with_current_names"]


@dataclass(frozen=True)
class NoiseSplit:
    """How a total noise multiplier is shared between gradient and auxiliary statistic.

    Attributes:
        noise_multiplier: σ, the joint noise multiplier the accountant sees.
        gradient_noise_multiplier: σ_g, the noise multiplier to put on the clipped gradient.
        sigma_aux: σ_a, the noise std of the statistic (None without one).
        aux_sensitivity: Δ, its L2 sensitivity (0 without one).
        aux_fraction: r = (Δ/σ_a)²·σ², its share of the budget (0 without one).
        inflation: σ_g/σ = 1/sqrt(1 − r), the gradient-noise price of the statistic.
    """

    noise_multiplier: float
    gradient_noise_multiplier: float
    sigma_aux: float | None
    aux_sensitivity: float
    aux_fraction: float
    inflation: float

    @classmethod
    def gradient_only(cls, sigma_total: float) -> "NoiseSplit":
        """The trivial split: all of σ on the gradient, no auxiliary statistic."""
        return cls(sigma_total, sigma_total, None, 0.0, 0.0, 1.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Keys that run directories written before the names were unified (issue 27) hold, and
#: what they are called now: one name per meaning (docs/formulas.md, "Names").
FORMER_NAMES = {"sigma_total": "noise_multiplier", "sigma_gradient": "gradient_noise_multiplier"}


def with_current_names(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` (a ledger entry's metadata, meta.json's plan, ...) with its former σ keys
    renamed, so that old run directories stay readable; a current key wins over a former one."""
    out = {FORMER_NAMES.get(key, key): value for key, value in record.items() if key not in FORMER_NAMES}
    for former, current in FORMER_NAMES.items():
        if former in record and current not in out:
            out[current] = record[former]
    return out


def _smallest_aux_sigma_hint(sigma_total: float, sensitivity: float, name: str = "aux_sigma") -> str:
    floor = sensitivity * sigma_total
    ten_percent = floor / math.sqrt(0.1)
    return (
        f"{name} must be greater than Δ·σ = {sensitivity:g}·{sigma_total:g} = {floor:.6g} "
        f"(at that value the statistic alone uses the whole budget); "
        f"e.g. {name} = {ten_percent:.6g} spends 10% of it"
        + ("" if name == "aux_sigma" else ", or give budget_fraction in its place (its share of the budget)")
    )


def split_noise(
    sigma_total: float,
    aux_sensitivity: float,
    *,
    aux_sigma: float | None = None,
    aux_fraction: float | None = None,
    sigma_name: str = "aux_sigma",
) -> NoiseSplit:
    """Split σ between the gradient and one auxiliary statistic of sensitivity Δ.

    Give exactly one of:

    - ``aux_fraction`` r ∈ (0, 1): σ_a = Δ·σ/sqrt(r), σ_g = σ/sqrt(1 − r);
    - ``aux_sigma`` σ_a > Δ·σ: σ_g = (σ⁻² − (Δ/σ_a)²)^(−1/2)
      (DC-SGD: σ = 1, σ_H = 10, Δ = 1 -> σ_g = 1.00504).

    ``sigma_name``: how the caller gave σ_a, for messages (a recipe's ``clipping.threshold.sigma_hist``).

    Formulas: docs/accounting.md; they solve σ⁻² = σ_g⁻² + (Δ/σ_a)² (docs/accounting.md, joint release).
    """
    if isinstance(sigma_total, bool) or not isinstance(sigma_total, (int, float)) or not 0 < sigma_total < math.inf:
        raise AccountingError(
            f"total noise multiplier must be a finite number > 0, got {sigma_total!r}",
            "calibrate it with calibrate_noise_multiplier(ε, δ, q, steps)",
        )
    if not isinstance(aux_sensitivity, (int, float)) or not 0 < aux_sensitivity < math.inf:
        raise AccountingError(
            f"auxiliary sensitivity must be a finite number > 0, got {aux_sensitivity!r}",
            "use the sensitivity the threshold policy declares (AuxSpec.sensitivity); without a "
            "statistic, use NoiseSplit.gradient_only(σ)",
        )
    if (aux_sigma is None) == (aux_fraction is None):
        raise AccountingError(
            "give exactly one of aux_sigma and aux_fraction",
            "aux_fraction=0.05 spends 5% of the budget on the statistic; "
            "aux_sigma=S fixes its noise std and gives the gradient the rest",
        )
    sigma, delta_a = float(sigma_total), float(aux_sensitivity)

    if aux_fraction is not None:
        if not isinstance(aux_fraction, (int, float)) or not 0 < aux_fraction < 1:
            raise AccountingError(
                f"aux_fraction must be in (0, 1), got {aux_fraction!r}",
                "it is the share of the budget for the statistic; He et al. used 0.01 to 0.1",
            )
        r = float(aux_fraction)
        sigma_a = delta_a * sigma / math.sqrt(r)
        sigma_g = sigma / math.sqrt(1 - r)
    else:
        if not isinstance(aux_sigma, (int, float)) or not 0 < aux_sigma < math.inf:
            raise AccountingError(
                f"{sigma_name} must be a finite number > 0, got {aux_sigma!r}",
                _smallest_aux_sigma_hint(sigma, delta_a, sigma_name),
            )
        sigma_a = float(aux_sigma)
        ratio = delta_a * sigma / sigma_a   # sqrt(r); a product, not **: a tiny σ_a overflows to inf, not an error
        r = ratio * ratio
        if r >= 1:
            raise AccountingError(
                f"{sigma_name} = {sigma_a:g} is too small for total noise multiplier {sigma:g}: "
                f"the statistic alone would use {f'{100 * r:.4g}%' if math.isfinite(r) else 'far more than all'} "
                "of the budget",
                _smallest_aux_sigma_hint(sigma, delta_a, sigma_name),
            )
        sigma_g = (sigma**-2 - (delta_a / sigma_a) ** 2) ** -0.5
    return NoiseSplit(
        noise_multiplier=sigma,
        gradient_noise_multiplier=sigma_g,
        sigma_aux=sigma_a,
        aux_sensitivity=delta_a,
        aux_fraction=r,
        inflation=sigma_g / sigma,
    )


def check_aux_fits(sigma_total: float, aux: Sequence[tuple[float, float]]) -> None:
    """Raise unless statistics with fixed (Δ_a, σ_a) leave budget for the gradient.

    The gradient gets σ_g⁻² = σ⁻² − Σ (Δ_a/σ_a)², which must be > 0 (docs/accounting.md).
    """
    for delta_a, sigma_a in aux:
        if not delta_a >= 0 or not sigma_a > 0:
            raise AccountingError(
                f"auxiliary statistic needs sensitivity >= 0 and noise std > 0, got ({delta_a!r}, {sigma_a!r})",
                "pass (sensitivity, noise std) pairs, e.g. [(1.0, 10.0)] for one histogram",
            )
    used = sum((delta_a * sigma_total / sigma_a) * (delta_a * sigma_total / sigma_a) for delta_a, sigma_a in aux)
    if used >= 1:
        if len(aux) == 1:
            hint = _smallest_aux_sigma_hint(sigma_total, aux[0][0])
        else:
            hint = f"multiply every aux noise std by more than sqrt({used:.6g}) = {math.sqrt(used):.6g}"
        raise AccountingError(
            f"the auxiliary statistics alone would use {100 * used:.4g}% of the budget "
            f"of total noise multiplier {sigma_total:.6g}",
            hint,
        )
