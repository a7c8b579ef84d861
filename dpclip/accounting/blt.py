"""Accounting for the BLT mechanism (docs/formulas.md, "BLT"): one Gaussian mechanism.

A BLT run releases x + C⁻¹z over its T steps, x the clipped sums and z i.i.d. N(0, σ²S²):
equivalently Cx + z, a Gaussian mechanism whose sensitivity is S·s, s the norm of the
strategy's worst participation pattern (computed by the engine from the strategy:
:func:`dpclip.engine.blt.participation_sensitivities`, passed here as numbers so that this
package stays free of torch). Inputs may depend on earlier outputs (C is lower triangular),
which the Gaussian mechanism's guarantee allows (Denisov et al., "Improved differential
privacy for SGD via optimal private linear operators on adaptive streams", NeurIPS 2022).

No amplification by sampling is claimed: the whole run is GaussianDpEvent(σ/s). The ledger
charges it as it goes, at the first step of each cycle of G steps: participation j adds the
squared sensitivity its cycle adds, s_j² − s_{j−1}², as GaussianDpEvent(σ/√(s_j² − s_{j−1}²)).
Gaussian mechanisms compose exactly (1/σ² adds), so the first j + 1 charges are exactly the
mechanism of the run's first j + 1 cycles, and all K of them the whole run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import dp_accounting

from dpclip.accounting.accountants import account, check_accountant, check_delta_value
from dpclip.accounting.calibrate import (UnreachableTarget, below_rdp_floor, check_target, quiet_dp_accounting,
                                         rdp_then)
from dpclip.accounting.events import joint_noise_multiplier
from dpclip.errors import AccountingError


def blt_groups(sample_rate: float) -> int:
    """G = ⌊1/q⌋: the data cut into as many groups as an epoch has batches (each example in
    one step per epoch, G steps apart; q·G <= 1)."""
    return max(1, math.floor(1.0 / sample_rate + 1e-9))


def check_sensitivities(sensitivities: Sequence[float], participations: int) -> None:
    """One squared prefix sensitivity per participation, positive and increasing."""
    values = list(sensitivities)
    if len(values) != participations:
        raise AccountingError(f"BLT needs one sensitivity per participation ({participations}), got {len(values)}",
                              "compute them with dpclip.engine.blt.participation_sensitivities")
    if any(not math.isfinite(v) or v <= 0 for v in values) or any(b <= a for a, b in zip(values, values[1:])):
        raise AccountingError("BLT's squared prefix sensitivities must be finite, positive and increasing",
                              "compute them with dpclip.engine.blt.participation_sensitivities")


def increment_events(noise_multiplier: float, sensitivities: Sequence[float],
                     aux_ratio_sq: float = 0.0) -> tuple[dp_accounting.DpEvent, ...]:
    """Participation j's charge: GaussianDpEvent(σ/√(s_j² − s_{j−1}²)) (module doc).

    With a threshold statistic released at every step (noise σ_a, sensitivity Δ_a, the
    gradient's multiplier σ = σ_g), each participation also adds the statistic of its own
    step: the charge is the joint Gaussian with 1/μ_j² = (s_j² − s_{j−1}²)/σ_g² + (Δ_a/σ_a)²
    (``aux_ratio_sq`` = (Δ_a/σ_a)²; docs/accounting.md, joint release)."""
    if not 0 < noise_multiplier < math.inf:
        raise AccountingError(f"noise multiplier must be a finite number > 0, got {noise_multiplier!r}",
                              "without noise there is no privacy guarantee")
    previous, events = 0.0, []
    for squared in sensitivities:
        events.append(dp_accounting.GaussianDpEvent(
            1.0 / math.sqrt((squared - previous) / noise_multiplier ** 2 + aux_ratio_sq)))
        previous = squared
    return tuple(events)


def charged_sensitivity(charges: Sequence[tuple[dp_accounting.DpEvent, int]], gradient_noise_multiplier: float | None,
                        sigma_aux: float | None = None, aux_sensitivity: float | None = None,
                        planned: float | None = None) -> float | None:
    """The sensitivity s_K of the K participations a ledger charged, (event, count) each: the charges
    compose to one Gaussian, Σ 1/μ_j² = s_K²/σ_g² + K·(Δ_a/σ_a)² (:func:`increment_events`), so a run
    stopped early states its own mechanism, not its plan's. ``planned`` (the whole plan's s) where s_K
    equals it to rounding; ``planned`` also where σ_g is unknown or a charge is not a Gaussian."""
    if gradient_noise_multiplier is None or not all(isinstance(event, dp_accounting.GaussianDpEvent)
                                                    for event, _ in charges):
        return planned
    aux_ratio_sq = 0.0 if sigma_aux is None else (aux_sensitivity / sigma_aux) ** 2
    precision = sum(count / event.noise_multiplier ** 2 for event, count in charges)
    participations = sum(count for _, count in charges)
    charged = gradient_noise_multiplier * math.sqrt(max(0.0, precision - participations * aux_ratio_sq))
    return planned if planned is not None and math.isclose(charged, planned, rel_tol=1e-9) else charged


def split_ratios(split) -> tuple[float, float]:
    """(σ_g, (Δ_a/σ_a)²) of a :class:`~dpclip.accounting.split.NoiseSplit`: what each charge is built
    from (the plan and a search's run event alike, so that their events compare equal)."""
    aux_ratio_sq = 0.0 if split.sigma_aux is None else (split.aux_sensitivity / split.sigma_aux) ** 2
    return split.gradient_noise_multiplier, aux_ratio_sq


def blt_event(noise_multiplier: float, sensitivities: Sequence[float], aux_ratio_sq: float = 0.0
              ) -> dp_accounting.DpEvent:
    """The whole run exactly as a ledger of its charges composes it (each charge its own
    SelfComposed(·, 1), Composed when more than one), so that the two compare equal."""
    parts = [dp_accounting.SelfComposedDpEvent(event, 1)
             for event in increment_events(noise_multiplier, sensitivities, aux_ratio_sq)]
    return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)


def calibrate_blt(target_epsilon: float, delta: float, sensitivities: Sequence[float], accountant: str = "pld",
                  *, rtol: float = 0.01, split=None, fixed_aux: tuple[float, float] | None = None) -> float:
    """σ with ε(:func:`blt_event`) in [(1 − rtol)·target, target]: the search of
    :mod:`dpclip.accounting.calibrate` on the composed charges, started from s (the whole
    run's sensitivity). ``split``: σ_eff -> (σ_g, (Δ_a/σ_a)²) when a threshold statistic shares
    the budget (the search is then over σ_eff).

    ``fixed_aux``: (Δ_a, σ_a) of a statistic whose noise std σ_a is fixed (DC-SGD's
    ``sigma_hist``). Then only σ_eff < σ_a/Δ_a can be split, and a search over σ_eff would probe
    beyond it; the search is over σ_g instead (every σ_g > 0 is a split) and returns
    σ_eff = (σ_g⁻² + (Δ_a/σ_a)²)^(−1/2) (:func:`~dpclip.accounting.events.joint_noise_multiplier`),
    whose re-split by ``split`` is checked against the target."""
    check_target(target_epsilon)
    check_delta_value(delta)
    check_accountant(accountant)
    whole = math.sqrt(sensitivities[-1])
    inputs = f"δ = {delta:g}, BLT sensitivity {whole:.4g}"

    def eps_of(method: str, over_gradient: bool = False):
        def eps(sigma: float) -> float:
            if over_gradient:
                gradient, aux_ratio_sq = sigma, (fixed_aux[0] / fixed_aux[1]) ** 2
            else:
                gradient, aux_ratio_sq = (sigma, 0.0) if split is None else split(sigma)
            value = account(blt_event(gradient, sensitivities, aux_ratio_sq), delta, method).epsilon
            return math.inf if math.isnan(value) else value
        return eps

    over_gradient = fixed_aux is not None and split is not None
    with quiet_dp_accounting():
        try:
            sigma = rdp_then(lambda method: eps_of(method, over_gradient), accountant, target_epsilon, rtol, whole,
                             inputs, delta)
        except UnreachableTarget as error:
            if not over_gradient or below_rdp_floor(target_epsilon, delta, accountant) is not None:
                raise   # (below RDP's floor at a tiny δ no noise helps: its own hint)
            # however much gradient noise, the statistic's own fixed noise spends the target: say which knob
            raise UnreachableTarget(error.message, (
                f"the threshold statistic's fixed noise std σ_a = {fixed_aux[1]:g} (sensitivity {fixed_aux[0]:g}) "
                "alone costs about that ε: raise it (clipping.threshold's sigma_hist, or the quantile's sigma) or "
                "give budget_fraction instead of it to share the budget, or raise ε")) from None
        if not over_gradient:
            return sigma
        # σ_g -> σ_eff; the plan splits σ_eff again, which rounds σ_g by an ulp or so: never past the target
        for _ in range(8):
            total = joint_noise_multiplier(sigma, [fixed_aux])
            if eps_of(accountant)(total) <= target_epsilon:
                return total
            sigma *= 1 + 1e-12
    raise AccountingError(f"no noise multiplier meets ε = {target_epsilon:g} once split ({inputs})",
                          "raise the statistic's noise std or ε")
