"""Noise calibration: the smallest noise multiplier that meets a target (ε, δ).

ε(σ) of T Poisson-subsampled Gaussian steps is continuous and decreasing in σ, so the
σ with ε(σ) = ε_target is found by a bracketed root search. dpclip returns a σ whose
ε is **at most** the target (privacy is never over-spent) and **within rtol (1%)** of it
(noise is not wasted): ε(σ) ∈ [(1 − rtol)·ε_target, ε_target].
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence

from dpclip.accounting.accountants import PLD_MIN_DELTA, RDP_ORDERS, check_accountant, check_delta_value, account
from dpclip.accounting.events import check_sample_rate, is_number, training_event
from dpclip.accounting.split import check_aux_fits
from dpclip.errors import AccountingError

__all__ = [
    "SIGMA_MIN",
    "SIGMA_MAX",
    "calibrate_noise_multiplier",
    "epsilon_for_noise",
]

#: Below this noise multiplier a "private" release is meaningless; a target that σ = SIGMA_MIN
#: already meets is refused as unreachable rather than answered with a near-zero σ.
SIGMA_MIN = 0.01
#: Above this the requested ε is too small to reach with any practical amount of noise.
SIGMA_MAX = 1e4


class UnreachableTarget(AccountingError):
    """Even σ = SIGMA_MAX leaves ε above the target (under the accountant that searched)."""


@contextlib.contextmanager
def quiet_dp_accounting() -> Iterator[None]:
    """Silence warnings about the search's trial σ values, which the user never asked for.

    Very small trial σ make dp_accounting's RDP series skip some orders (logged through
    absl), which only loosens those trial ε values; PLD fallbacks at trial σ are likewise
    irrelevant (the fallback at the answer is reported by whoever computes its ε).
    """
    loggers = [logging.getLogger("absl"), logging.getLogger("dpclip.accounting.accountants")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def check_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise AccountingError(
            f"steps must be an integer >= 1, got {steps!r}",
            "steps = ceil(epochs / sample rate); see dpclip.accounting.steps_for_epochs",
        )


def check_target(target_epsilon: float) -> None:
    if not is_number(target_epsilon) or not 0 < target_epsilon < math.inf:
        raise AccountingError(
            f"target ε must be a finite number > 0, got {target_epsilon!r}",
            "give ε itself (a bool is not a number): typical targets are 1 to 10, e.g. --eps 8",
        )


def epsilon_for_noise(
    noise_multiplier: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
) -> float:
    """ε after ``steps`` Poisson-sampled Gaussian steps with this noise multiplier."""
    check_steps(steps)
    return account(training_event(sample_rate, noise_multiplier, steps), delta, accountant).epsilon


def _search(
    eps_of: Callable[[float], float],
    target: float,
    rtol: float,
    lo: float,
    hi: float,
    eps_lo: float,
    eps_hi: float,
) -> float:
    """Shrink the bracket [lo, hi] (ε(lo) > target >= ε(hi)) until ε(hi) >= (1 − rtol)·target.

    Probes interpolate linearly in (log σ, log ε), where ε(σ) is close to a power law,
    aiming at the middle of the accepted band; a probe stays at least 10% of the bracket
    away from its ends, and a probe that did not halve the bracket is followed by a
    plain bisection, so the bracket always shrinks geometrically (a safeguarded regula
    falsi). Returns ``hi``: the invariant ε(hi) <= target is never broken.

    dp_accounting's RDP ε is not continuous everywhere: where its KL bound applies
    (tiny sampling rates, large δ) ε drops straight to 0. If the band falls inside such
    a jump, no σ is within rtol of the target and the search returns the σ just above
    the jump (ε below the target, so still safe).
    """
    aim = math.log(target * (1 - rtol / 2))
    bisect_next = False
    while eps_hi < (1 - rtol) * target:
        a, b = math.log(lo), math.log(hi)
        if b - a < 1e-10:  # at a jump of ε(σ): no σ in the band exists
            break
        t = 0.5
        if not bisect_next and math.isfinite(eps_lo) and eps_hi > 0 and eps_lo != eps_hi:
            fa, fb = math.log(eps_lo), math.log(eps_hi)
            t = min(0.9, max(0.1, (fa - aim) / (fa - fb)))
        mid = math.exp(a + t * (b - a))
        eps_mid = eps_of(mid)
        if eps_mid > target:
            lo, eps_lo = mid, eps_mid
        else:
            hi, eps_hi = mid, eps_mid
        bisect_next = t != 0.5 and math.log(hi) - math.log(lo) > 0.5 * (b - a)
    return hi


def sigma_for_epsilon(
    eps_of: Callable[[float], float],
    target: float,
    rtol: float,
    guess: float,
    hint_inputs: str,
) -> float:
    """Bracket the solution by doubling/halving from ``guess``, then :func:`_search`."""
    sigma, eps = guess, eps_of(guess)
    if eps > target:
        # Too little noise: double until ε <= target.
        lo, eps_lo = sigma, eps
        while True:
            hi = min(lo * 2, SIGMA_MAX)
            eps_hi = eps_of(hi)
            if eps_hi <= target:
                break
            if hi >= SIGMA_MAX:
                raise UnreachableTarget(
                    f"target ε = {target:g} is unreachable: even noise multiplier "
                    f"{SIGMA_MAX:g} gives ε = {eps_hi:.4g} ({hint_inputs})",
                    "raise ε or δ, train for fewer steps, or use a smaller sample rate",
                )
            lo, eps_lo = hi, eps_hi
    else:
        # Enough noise already: halve until ε > target.
        hi, eps_hi = sigma, eps
        while True:
            lo = max(hi / 2, SIGMA_MIN)
            eps_lo = eps_of(lo)
            if eps_lo > target:
                break
            if lo <= SIGMA_MIN:
                raise AccountingError(
                    f"target ε = {target:g} is so large that a noise multiplier of "
                    f"{SIGMA_MIN:g} or less would meet it ({hint_inputs}); that is no "
                    "meaningful privacy",
                    "choose a smaller ε (typically 1 to 10), or set the noise multiplier directly",
                )
            hi, eps_hi = lo, eps_lo
    return _search(eps_of, target, rtol, lo, hi, eps_lo, eps_hi)


def rdp_floor(delta: float) -> float:
    """The least ε the RDP conversion gives at ``delta`` for any curve with rdp(α) > 0: the
    conversion term log((α−1)/α) − (log δ + log α)/(α − 1), minimised over :data:`RDP_ORDERS`
    (its largest order, 1024, sets it at small δ: 0.0193 at δ = 1e-12). Only dp_accounting's
    KL shortcut (ε = 0 outright, at tiny q) goes below it."""
    return max(0.0, min(math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1) for a in RDP_ORDERS))


def below_rdp_floor(target: float, delta: float, accountant: str) -> UnreachableTarget | None:
    """The true reason a target is unreachable when no noise could reach it under RDP, which answers it."""
    floor = rdp_floor(delta)
    if target >= floor or (accountant == "pld" and delta >= PLD_MIN_DELTA):
        return None
    why = "--accountant rdp" if accountant != "pld" else f"PLD is not used below δ = {PLD_MIN_DELTA:g}"
    return UnreachableTarget(
        f"target ε = {target:g} is unreachable at δ = {delta:g}: no noise multiplier up to {SIGMA_MAX:g} meets it, "
        f"and the RDP conversion gives no ε between 0 and {floor:.4g} at this δ, whatever the noise ({why}; its "
        "largest order, 1024, sets this floor)",
        f"raise ε to at least {floor:.4g}, or δ to {PLD_MIN_DELTA:g} or more with the PLD accountant (the "
        "default), whose ε has no such floor")


def rdp_then(
    eps_of: Callable[[str], Callable[[float], float]],
    accountant: str,
    target: float,
    rtol: float,
    guess: float,
    hint_inputs: str,
    delta: float | None = None,
) -> float:
    """:func:`sigma_for_epsilon` under RDP (cheap, whatever the steps), then, for
    ``accountant="pld"``, again under PLD from the RDP answer (whose PLD ε is lower).

    A target between PLD's floor and RDP's (ε at σ = SIGMA_MAX) is one only PLD reaches:
    when RDP finds it unreachable, the PLD search starts from SIGMA_MAX itself, and says
    unreachable with PLD's own ε if PLD cannot reach it either.
    """
    try:
        sigma = sigma_for_epsilon(eps_of("rdp"), target, rtol, guess, hint_inputs)
    except UnreachableTarget as unreachable:
        floor = None if delta is None else below_rdp_floor(target, delta, accountant)
        if floor is not None:
            raise floor from unreachable
        if accountant != "pld":
            raise
        return sigma_for_epsilon(eps_of("pld"), target, rtol, SIGMA_MAX, hint_inputs)
    if accountant == "pld":
        sigma = sigma_for_epsilon(eps_of("pld"), target, rtol, sigma, hint_inputs)
    return sigma


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    aux: Sequence[tuple[float, float]] | None = None,
    *,
    rtol: float = 0.01,
) -> float:
    """The total noise multiplier σ_eff meeting ``target_epsilon`` at ``delta``.

    Returns σ_eff with ε(σ_eff) <= target_epsilon and ε(σ_eff) >= (1 − rtol)·target_epsilon,
    where ε is computed for ``steps`` steps of ``PoissonSampled(q, Gaussian(σ_eff))``
    with ``accountant``.

    σ_eff is the *joint* multiplier of everything a step releases (docs/accounting.md, joint release): without
    auxiliary statistics it is the gradient's noise multiplier; with them, split it with
    :func:`dpclip.accounting.split_noise`. ``aux`` — pairs (Δ_a, σ_a) of auxiliary
    statistics whose noise std is fixed — does not change σ_eff, but is checked: a
    joint release needs σ_eff⁻² > Σ (Δ_a/σ_a)², otherwise no gradient noise could
    complete it and an AccountingError says the smallest σ_a that would work.

    Method: RDP, whose cost does not depend on ``steps``, brackets the answer; with
    ``accountant="pld"`` the RDP answer (whose PLD ε is lower) is the upper end of the
    bracket and the search continues with PLD (from SIGMA_MAX where only PLD reaches the
    target: :func:`rdp_then`). Each ε evaluation is one call to
    dp_accounting (see :mod:`dpclip.accounting.accountants`).
    """
    check_target(target_epsilon)
    check_delta_value(delta)
    check_sample_rate(sample_rate)
    check_steps(steps)
    check_accountant(accountant)
    if not 0 < rtol < 1:
        raise AccountingError(f"rtol must be in (0, 1), got {rtol!r}", "the default 0.01 means within 1%")

    inputs = f"δ = {delta:g}, sample rate {sample_rate:g}, {steps} steps"

    def eps_of(method: str) -> Callable[[float], float]:
        def eps(sigma: float) -> float:
            value = account(training_event(sample_rate, sigma, steps), delta, method).epsilon
            return math.inf if math.isnan(value) else value  # NaN must never pass as "within target"

        return eps

    with quiet_dp_accounting():
        sigma = rdp_then(eps_of, accountant, target_epsilon, rtol, 1.0, inputs, delta)

    if aux:
        check_aux_fits(sigma, aux)
    return sigma
