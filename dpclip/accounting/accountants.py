"""ε (and δ) of a ``DpEvent`` with dp_accounting's RDP or PLD accountant.

dpclip never re-derives an accountant: every number comes from
``dp_accounting.rdp.RdpAccountant`` or ``dp_accounting.pld.PLDAccountant``. What this
module decides is *how* they are called, and it pins those choices so results are
reproducible:

RDP (Rényi DP; Mironov 2017, subsampled Gaussian of Mironov, Talwar & Zhang 2019)
    Orders: :data:`RDP_ORDERS` = 1.1, 1.2, ..., 10.9, 11, 12, ..., 63, 128, 256, 512,
    1024, written out here so an upgrade of dp_accounting cannot silently move ε. It is
    dp_accounting 0.6's default set and a superset of Opacus' orders
    ([1 + x/10 for x in 1..99] + 12..63): the minimum over more orders can only be lower,
    so dpclip's ε is never above Opacus' for the same RDP curve.
    Conversion to (ε, δ): the improved bound of Balle, Barthe, Gaboardi, Hsu & Sato
    2020 ("Hypothesis testing interpretations and Rényi DP", Prop. 12 of
    arXiv:2004.00010 v4), as implemented by ``rdp_privacy_accountant.compute_epsilon``::

        ε = min_α [ rdp(α) + log((α − 1)/α) − (log δ + log α)/(α − 1) ]

    (the older ε = rdp(α) + log(1/δ)/(α − 1) is ~15% larger; docs/accounting.md).

PLD (privacy loss distributions; Koskela et al. 2020, Doroshenko et al. 2022)
    Tightest: ε is read off the composed privacy-loss distribution, no conversion. The
    pessimistic "connect the dots" discretisation (dp_accounting's default) makes every
    value an upper bound; its only knob is the discretisation interval, chosen by
    :func:`pld_discretization` so the relative error stays ~1e-3 or less and the cost
    stays roughly constant (a fraction of a second for 10⁴–10⁵ steps).

PLD can fail where RDP does not (a pitfall seen in peer libraries: peers' PRV accountant crashes at large ε
or small δ; dp_accounting's PLD returns ε = inf when δ is below its truncated tail
mass, e.g. δ = 1e-15). dpclip therefore always computes RDP alongside PLD and falls
back to RDP — saying why in ``AccountingResult.fallback_reason`` — whenever PLD raises,
is unsupported for the event, returns a non-finite ε while RDP is finite, or returns a
*looser* ε than RDP, for δ below :data:`PLD_MIN_DELTA` (where PLD's own floating-point
error in δ is not small against δ), and over more than :data:`PLD_MAX_COMPOSITIONS` steps (where one
PLD ε takes minutes). Both are valid upper bounds, so reporting RDP is always safe.

Length: over 400 lines because every PLD->RDP fallback and its reason is decided here, in one place.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import dp_accounting
from dp_accounting import privacy_accountant
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpclip.errors import AccountingError

__all__ = [
    "ACCOUNTANTS",
    "RDP_ORDERS",
    "RDP_CONVERSION",
    "PLD_METHOD",
    "PLD_MIN_DELTA",
    "AccountingResult",
    "account",
    "epsilon",
    "delta_for_epsilon",
    "pld_discretization",
    "mechanism_count",
    "rdp_curve",
]

log = logging.getLogger(__name__)

ACCOUNTANTS = ("pld", "rdp")

#: RDP orders dpclip uses (pinned; equal to dp_accounting 0.6's DEFAULT_RDP_ORDERS).
RDP_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
)

RDP_CONVERSION = (
    "RDP -> (ε, δ) by the improved conversion of Balle et al. 2020 "
    "(arXiv:2004.00010 Prop. 12) in dp_accounting; orders 1.1-10.9 step 0.1, 11-63, "
    "128, 256, 512, 1024"
)
PLD_METHOD = (
    "privacy loss distribution (dp_accounting PLDAccountant, pessimistic connect-the-dots "
    "discretisation); ε read off the distribution, no RDP conversion"
)

#: Below this δ, RDP: dp_accounting's PLD computes δ with a floating-point error of about 1e-12
#: (its FFT convolutions), which at δ = 1e-12 put ε 0.1% below a rigorous lower bound of the true
#: one, and returned δ(ε) < 0 at q = 1e-4 over 1e5 steps.
PLD_MIN_DELTA = 1e-9

# PLD grid (see pld_discretization): interval = ε · c with c <= _PLD_RELATIVE_STEP and
# c <= _PLD_STEP_BUDGET / sqrt(compositions), never below _PLD_MIN_INTERVAL.
_PLD_RELATIVE_STEP = 1e-3
_PLD_STEP_BUDGET = 1e-2
_PLD_MIN_INTERVAL = 1e-7


@dataclass(frozen=True)
class AccountingResult:
    """ε of an event at δ, with the accountant that produced it.

    Attributes:
        epsilon: the reported ε (from ``accountant``).
        delta: the δ it holds at.
        accountant: the accountant that produced ``epsilon`` ("pld" or "rdp").
        requested: the accountant that was asked for.
        epsilon_rdp: ε from the RDP accountant (always computed; equals ``epsilon``
            when ``accountant == "rdp"``).
        fallback_reason: why PLD was not used although requested, else None.
        pld_interval: the PLD discretisation interval used, if PLD ran.
    """

    epsilon: float
    delta: float
    accountant: str
    requested: str
    epsilon_rdp: float
    fallback_reason: str | None = None
    pld_interval: float | None = None

    @property
    def conversion(self) -> str:
        """How ε was obtained, in words (for the privacy statement)."""
        return PLD_METHOD if self.accountant == "pld" else RDP_CONVERSION


def check_accountant(accountant: str) -> None:
    if accountant not in ACCOUNTANTS:
        raise AccountingError(
            f"unknown accountant {accountant!r}",
            "use 'pld' (tightest, default) or 'rdp'",
        )


def check_delta_value(delta: float) -> None:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0.0 < delta < 1.0:
        raise AccountingError(
            f"δ must be in (0, 1), got {delta!r}",
            "a common choice is δ < 1/N for a data set of N examples, e.g. 1e-5",
        )


def _check_event(event: dp_accounting.DpEvent) -> None:
    if not isinstance(event, dp_accounting.DpEvent):
        raise AccountingError(
            f"expected a dp_accounting DpEvent, got {type(event).__name__}",
            "build events with dpclip.accounting.gradient_step_event / training_event",
        )


def mechanism_count(event: dp_accounting.DpEvent) -> int:
    """How many basic mechanisms ``event`` composes (sampling wrappers count as one).

    Used to size the PLD discretisation: its rounding error grows with the number of
    compositions.
    """
    if isinstance(event, (dp_accounting.NoOpDpEvent, dp_accounting.NonPrivateDpEvent)):
        return 0
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return event.count * mechanism_count(event.event)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return sum(mechanism_count(e) for e in event.events)
    inner = getattr(event, "event", None)
    if isinstance(inner, dp_accounting.DpEvent):
        return max(1, mechanism_count(inner))
    return 1


def pld_discretization(epsilon_scale: float, compositions: int) -> float:
    """PLD ``value_discretization_interval`` for an ε of about ``epsilon_scale``.

    interval = epsilon_scale · min(1e-3, 1e-2 / sqrt(compositions)), at least 1e-7.

    Why: the pessimistic discretisation rounds each privacy-loss value up to the grid,
    and the resulting ε error measured against a 50x finer grid grows like
    compositions · (interval / ε)²: about 2·T·c² relative error for T compositions and
    c = interval/ε (measured on dp_accounting 0.6, q ∈ [5e-4, 0.1], σ ∈ [0.5, 8],
    T from 10³ to 10⁵). c = 1e-2/sqrt(T) keeps that near 2e-4 (≤ 1e-3 where RDP's ε, used as
    the scale, overshoots PLD's by 3x). Making the interval proportional to ε also
    keeps the number of grid points — hence the run time — roughly constant.
    """
    relative = min(_PLD_RELATIVE_STEP, _PLD_STEP_BUDGET / math.sqrt(max(compositions, 1)))
    return float(max(_PLD_MIN_INTERVAL, epsilon_scale * relative))


#: Above this many charged steps, a PLD answer can take minutes: dp_accounting's composed
#: distribution grows with the step count (calibrating ε = 8 at q = 0.01 on this project's
#: 2-core machine: 9 s at 10⁶ steps, 41–53 s at 3·10⁶, 145–263 s and 1–2 GB at 10⁷).
PLD_SLOW_STEPS = 1_000_000
#: Above this many composed mechanisms, PLD is not tried: RDP answers, and ``fallback_reason`` says why. One PLD
#: ε of 10⁷ steps (q = 0.01, σ = 20.3) took 106 s, and of 10⁸ or 10⁹ steps more than a minute each, where a
#: calibration asks for about ten; the fallback answers within seconds.
PLD_MAX_COMPOSITIONS = 3_000_000
_warned_slow: set[int] = set()


def note_slow_pld(steps: int, accountant: str) -> None:
    """Say, once per step count, that PLD over this many steps will take a while (a
    mistyped epochs or steps otherwise looks like a hang) and what answers at once."""
    if accountant != "pld" or not PLD_SLOW_STEPS < steps <= PLD_MAX_COMPOSITIONS or steps in _warned_slow:
        return
    _warned_slow.add(steps)
    log.warning("PLD accounting of %s steps can take minutes and gigabytes of memory (its distribution grows with "
                "the step count); privacy.accountant: rdp (or --accountant rdp) answers at once, with a looser ε",
                f"{steps:,}")


# Composed RDP accountants of recent events, by the event's repr (its every field, floats
# to the last bit; a ComposedDpEvent holds a list, so the event itself is not hashable). A
# run asks about the same ledger many times (the plan, the ledger's checks, the summary):
# the fractional orders' RDP of a Poisson-sampled Gaussian took about 0.16 s each time.
# Read only: callers ask an accountant for ε or δ and never compose onto it.
_RDP_CACHE: OrderedDict[str, rdp_privacy_accountant.RdpAccountant | None] = OrderedDict()
_RDP_CACHE_SIZE = 256


def _kept(cache: OrderedDict, size: int, key, compose):
    """``cache[key]``, composed by ``compose()`` on a miss (an exception caches nothing);
    the least recently used entry beyond ``size`` is dropped."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    cache[key] = value = compose()
    if len(cache) > size:
        cache.popitem(last=False)
    return value


def _rdp_accountant(event: dp_accounting.DpEvent) -> rdp_privacy_accountant.RdpAccountant | None:
    def compose():
        accountant = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS))
        try:
            return accountant.compose(event) if accountant.supports(event) else None
        except (ZeroDivisionError, OverflowError) as exc:   # σ² underflows to 0 (σ = 1e-300), overflows (1e300)
            small, large = isinstance(exc, ZeroDivisionError), "this large is beyond what the accountants compute"
            raise AccountingError(f"the RDP accountant cannot compute this event ({type(exc).__name__}): a noise "
                                  f"multiplier {'this small gives no privacy to speak of' if small else large}",
                                  "use a noise multiplier from about 0.3 to 1e100 (σ of 1 to 10 is usual)") from None
    return _kept(_RDP_CACHE, _RDP_CACHE_SIZE, repr(event), compose)


def rdp_curve(
    event: dp_accounting.DpEvent, orders: Sequence[float] = RDP_ORDERS
) -> list[tuple[float, float]]:
    """(order α, RDP ε(α)) of ``event`` from dp_accounting's RDP accountant.

    Useful to see which order sets ε (the minimiser of the conversion above) and to
    check dpclip against published RDP values.
    """
    _check_event(event)
    accountant = rdp_privacy_accountant.RdpAccountant(list(orders))
    if not accountant.supports(event):
        raise _unsupported(event)
    accountant.compose(event)
    return [(float(a), float(r)) for a, r in zip(accountant.orders, accountant.rdp)]


# The same for PLD accountants, by (event, grid interval); fewer, as a composed privacy
# loss distribution can hold many grid points.
_PLD_CACHE: OrderedDict[tuple[str, float], pld_privacy_accountant.PLDAccountant] = OrderedDict()
_PLD_CACHE_SIZE = 16


def _pld_accountant(event: dp_accounting.DpEvent, interval: float) -> pld_privacy_accountant.PLDAccountant:
    return _kept(_PLD_CACHE, _PLD_CACHE_SIZE, (repr(event), interval),   # what PLD cannot compose raises
                 lambda: pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval).compose(event))


def _unsupported(event: dp_accounting.DpEvent) -> AccountingError:
    return AccountingError(
        f"no accountant supports this event under add/remove-one neighbours: {event}",
        "dpclip accounts Poisson-sampled Gaussian steps (gradient_step_event); "
        "sampling without replacement needs the replace-one relation, which dpclip does not use",
    )


def account(event: dp_accounting.DpEvent, delta: float, accountant: str = "pld") -> AccountingResult:
    """ε of ``event`` at ``delta`` with the requested accountant (PLD falls back to RDP).

    Neighbouring relation: add/remove one example (dp_accounting's ADD_OR_REMOVE_ONE).
    RDP is always computed; with ``accountant="pld"`` the result is the PLD ε unless one
    of the fallback conditions in the module docstring holds, in which case it is the
    RDP ε and ``fallback_reason`` says why.
    """
    check_accountant(accountant)
    check_delta_value(delta)
    _check_event(event)

    rdp = _rdp_accountant(event)
    eps_rdp = float(rdp.get_epsilon(delta)) if rdp is not None else math.inf

    if accountant == "rdp":
        if rdp is None:
            raise _unsupported(event)
        return AccountingResult(eps_rdp, delta, "rdp", "rdp", eps_rdp)

    # No PLD needed when the event composes nothing (an empty ledger) or when RDP already
    # says "no privacy" (a NonPrivate step): PLD would give the same 0 or inf.
    if rdp is not None and (math.isinf(eps_rdp) or mechanism_count(event) == 0):
        return AccountingResult(eps_rdp, delta, "pld", "pld", eps_rdp)
    # Nor when RDP already certifies ε = 0 (its KL bound: the total variation distance is
    # below δ). PLD cannot do better, and its grid, scaled by ε, would degenerate.
    if rdp is not None and eps_rdp == 0.0:
        return AccountingResult(
            0.0, delta, "rdp", "pld", 0.0, "RDP already certifies ε = 0 at this δ; PLD cannot be tighter"
        )

    if rdp is not None and delta < PLD_MIN_DELTA:
        reason = (f"δ = {delta:g} is below {PLD_MIN_DELTA:g}, where the PLD's floating-point error (about 1e-12 "
                  "in δ) is not small against δ: its ε can come out below the true one")
        log.info("PLD accounting fell back to RDP: %s", reason)
        return AccountingResult(eps_rdp, delta, "rdp", "pld", eps_rdp, reason)

    if rdp is not None and mechanism_count(event) > PLD_MAX_COMPOSITIONS:
        reason = too_many_for_pld(mechanism_count(event))
        log.warning("PLD accounting fell back to RDP: %s", reason)
        return AccountingResult(eps_rdp, delta, "rdp", "pld", eps_rdp, reason)

    interval = pld_discretization(eps_rdp if rdp is not None else 1.0, mechanism_count(event))
    eps_pld, failure = _try_pld(event, delta, interval)
    if rdp is None and (failure is None or math.isinf(eps_pld)):   # inf: an overflow, still PLD's answer
        return AccountingResult(eps_pld, delta, "pld", "pld", eps_rdp, None, interval)
    if failure is None and math.isfinite(eps_pld) and eps_pld <= eps_rdp:
        return AccountingResult(eps_pld, delta, "pld", "pld", eps_rdp, None, interval)
    if rdp is None:
        raise _unsupported(event)

    if failure is not None:
        reason, level = failure, logging.WARNING
    elif not math.isfinite(eps_pld):
        reason, level = (
            f"the PLD accountant returned ε = {eps_pld} at δ = {delta:g} "
            "(δ is below the probability mass it truncates; typical for very small δ)",
            logging.WARNING,
        )
    else:
        # Routine for tiny ε or coarse grids, hence only logged at INFO.
        reason, level = (
            f"the PLD bound (ε = {eps_pld:.6g}) is looser than the RDP bound "
            f"(ε = {eps_rdp:.6g}) here; both are valid, the smaller is reported",
            logging.INFO,
        )
    log.log(level, "PLD accounting fell back to RDP: %s", reason)
    return AccountingResult(eps_rdp, delta, "rdp", "pld", eps_rdp, reason, interval)


def too_many_for_pld(compositions: int) -> str:
    """Why PLD was not tried over ``compositions`` mechanisms (:data:`PLD_MAX_COMPOSITIONS`)."""
    return (f"{compositions:,} composed steps are more than the {PLD_MAX_COMPOSITIONS:,} PLD accounts in reasonable "
            "time (its distribution grows with the step count: minutes and gigabytes per ε); RDP's ε, a valid "
            "but looser bound, is reported")


def _try_pld(event: dp_accounting.DpEvent, delta: float, interval: float) -> tuple[float, str | None]:
    """(PLD ε, None) or (nan, why PLD could not be used). Never raises: training must not crash."""
    try:
        with warnings.catch_warnings(record=True) as caught:   # numpy's, said in the reason instead
            warnings.simplefilter("always", RuntimeWarning)
            value = float(_pld_accountant(event, interval).get_epsilon(delta))
        numeric = sorted({str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)})
        if numeric and not math.isfinite(value):
            return value, f"the PLD accountant's ε for δ = {delta:g} failed in floating point ({'; '.join(numeric)})"
        return value, None
    except privacy_accountant.UnsupportedEventError:
        return math.nan, f"the PLD accountant does not support this event (it contains {_type_names(event)})"
    except Exception as exc:  # noqa: BLE001 - any numerical failure (MemoryError included)
        return math.nan, f"the PLD accountant failed ({type(exc).__name__}: {exc})"


def _type_names(event: dp_accounting.DpEvent) -> str:
    """Comma-separated class names of the events nested in ``event`` (for messages)."""
    names: set[str] = set()
    stack = [event]
    while stack:
        current = stack.pop()
        names.add(type(current).__name__)
        if isinstance(current, dp_accounting.ComposedDpEvent):
            stack.extend(current.events)
        elif isinstance(getattr(current, "event", None), dp_accounting.DpEvent):
            stack.append(current.event)
    return ", ".join(sorted(names))


def epsilon(event: dp_accounting.DpEvent, delta: float, accountant: str = "pld") -> float:
    """ε of ``event`` at ``delta`` (see :func:`account` for the details and fallback)."""
    return account(event, delta, accountant).epsilon


def delta_for_epsilon(event: dp_accounting.DpEvent, epsilon: float, accountant: str = "pld") -> float:
    """Smallest δ the accountant certifies for ``event`` at ``epsilon``.

    With "pld", the PLD δ is used unless PLD fails (then RDP's δ); when both are
    available the smaller is returned, since both are valid upper bounds.
    """
    check_accountant(accountant)
    _check_event(event)
    if not isinstance(epsilon, (int, float)) or not epsilon >= 0 or math.isinf(epsilon):
        raise AccountingError(
            f"ε must be a finite number >= 0, got {epsilon!r}",
            "pass the ε at which you want δ, e.g. 1.0",
        )
    rdp = _rdp_accountant(event)
    delta_rdp = float(rdp.get_delta(epsilon)) if rdp is not None else 1.0
    if accountant == "rdp":
        if rdp is None:
            raise _unsupported(event)
        return delta_rdp

    if rdp is not None and mechanism_count(event) > PLD_MAX_COMPOSITIONS:
        log.warning("PLD δ computation fell back to RDP: %s", too_many_for_pld(mechanism_count(event)))
        return delta_rdp
    # ε here is the target, so it sets the PLD grid scale (floored so ε -> 0 stays cheap).
    interval = pld_discretization(max(epsilon, 0.1), mechanism_count(event))
    try:
        delta_pld = float(_pld_accountant(event, interval).get_delta(epsilon))
    except Exception as exc:  # noqa: BLE001 - unsupported event or numerical failure
        if rdp is None:
            raise _unsupported(event) from exc
        log.warning("PLD δ computation fell back to RDP: %s: %s", type(exc).__name__, exc)
        return delta_rdp
    if delta_pld < PLD_MIN_DELTA:   # within the PLD's floating-point error (it can even be negative)
        return delta_rdp
    return min(delta_pld, delta_rdp)
