"""The f-DP one-run audit (Mahloujifar, Melis, Chaudhuri 2024, "Auditing f-Differential
Privacy in One Run", arXiv:2410.22235; docs/auditing.md, docs/formulas.md).

Same game as :mod:`dpclip.audit.one_run`: m canaries, each trained on independently with
probability ½; the auditor makes r guesses ("in" / "out", abstaining on the rest) and v
of them are right. Instead of asking which (ε, δ) the count rejects, it asks which
trade-off curve f does, and fits a Gaussian curve (Dong, Roth, Su 2022, "Gaussian
Differential Privacy"):

    f_μ(α) = Φ(Φ⁻¹(1 − α) − μ)

the least type II error of any test of "canary out" against "canary in" whose type I
error is α; f_0(α) = 1 − α (no test beats a coin), f_∞ = 0.

**Tail bound.** Let V be the number of right guesses, and for i = 0..r

    a_i = E[V·1{V ≥ i}] / m          (right guesses in outcomes with at least i right)
    b_i = E[(r − V)·1{V ≥ i}] / m    (wrong guesses in the same outcomes).

Three facts tie them together:

1. a_0 + b_0 = r/m (every outcome has V ≥ 0).
2. a_i − a_{i+1} = i·P[V = i]/m and b_i − b_{i+1} = (r − i)·P[V = i]/m, so
   a_i − a_{i+1} = i/(r − i) · (b_i − b_{i+1}).
3. f-DP, canary by canary: flipping canary j's bit turns "guess on j right and at least
   i + 1 right" into "guess on j wrong and at least i right" without changing anything
   the mechanism or the auditor sees of the other canaries. An event of probability x
   under one neighbouring data set has probability at least f(1 − x) under the other, and
   x ↦ f(1 − x) is convex (Jensen over canaries and over the other bits), so

       b_i ≥ f(1 − a_{i+1}).

If P[V ≥ v] ≥ τ, moving all the mass above v down to v keeps 1–3 (it lowers every a and
raises every b), so the least a and b compatible with 1–3 follow from the recursion

    a_v = τ·v/m,   b_v = τ·(r − v)/m,
    for i = v−1, …, 0:   b_i = max(b_{i+1}, f(1 − a_{i+1})),
                         a_i = a_{i+1} + i/(r − i) · (b_i − b_{i+1}),

(any sequence obeying 2 and 3 stays above it, by induction and Abel summation: the
weights i/(r − i) grow with i). If a_0 + b_0 > r/m, fact 1 is violated and P[V ≥ v] < τ.
a_0 + b_0 grows with τ, so the tail bound is the largest τ that still satisfies
a_0 + b_0 ≤ r/m (bisection). For a Gaussian f it is tighter than converting f to (ε, δ)
and using the randomized-response bound of Steinke, Nasr, Jagielski, because the whole
curve constrains the recursion, not one tangent line of it.

**μ lower bound.** f_μ falls as μ grows, so the bound on P[V ≥ v] grows with μ; at
confidence 1 − α the audit rejects every μ whose bound is below α. The μ lower bound is
the largest such μ (bisection): the canaries are evidence that training is not μ-GDP for
any μ up to it.

**ε lower bound.** A μ-GDP mechanism is (ε, δ)-DP exactly when (Dong, Roth, Su, Corollary
2.13)

    δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2);

the ε lower bound is the ε that solves δ(ε) = δ at the run's δ for the μ lower bound. It
assumes the curve is Gaussian (DP-SGD's is close to one over many steps); the bound of
:mod:`dpclip.audit.one_run` assumes nothing about the curve's shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr, ndtr, ndtri


def gaussian_tradeoff(alpha, mu: float):
    """f_μ(α) = Φ(Φ⁻¹(1 − α) − μ): the trade-off curve of N(0, 1) against N(μ, 1) (GDP paper)."""
    return ndtr(ndtri(1.0 - np.asarray(alpha, dtype=float)) - mu)


def _check(m: int, r: int, v: int) -> None:
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")


def _mass_needed(m: int, r: int, v: int, tau: float, least_other: Callable[[float], float]) -> float:
    """a_0 + b_0 of the recursion (module doc) started from P[V ≥ v] = τ.

    ``least_other(x)`` is f(1 − x): the least probability, under the neighbouring data
    set, of an event of probability x.
    """
    a, b = tau * v / m, tau * (r - v) / m
    for i in range(v - 1, -1, -1):
        if a + b > r / m:          # a and b only grow: fact 1 is already violated
            break
        b_next = max(b, least_other(a))
        if b_next == b:            # a is unchanged too, so no later step moves either
            break
        a, b = a + i / (r - i) * (b_next - b), b_next
    return a + b


def _gaussian_least_other(mu: float) -> Callable[[float], float]:
    # f_μ(1 − x) = Φ(Φ⁻¹(x) − μ): written from x, not 1 − x, so small x keeps its digits.
    return lambda x: float(ndtr(ndtri(x) - mu))


def _tail_bound(m: int, r: int, v: int, least_other: Callable[[float], float]) -> float:
    _check(m, r, v)
    if v == 0 or r == 0:
        return 1.0
    low, high = 0.0, 1.0
    if _mass_needed(m, r, v, high, least_other) <= r / m:
        return 1.0
    for _ in range(60):
        mid = (low + high) / 2.0
        if _mass_needed(m, r, v, mid, least_other) > r / m:
            high = mid
        else:
            low = mid
    return high  # P[V ≥ v] < high: the upper end of the bracket is the sound side


def tail_bound(m: int, r: int, v: int, tradeoff: Callable[[float], float]) -> float:
    """Upper bound on P[at least v of r guesses right] when training is f-DP (module doc).

    ``tradeoff`` is f, a symmetric trade-off function (convex, decreasing, f(α) ≤ 1 − α),
    e.g. ``lambda a: gaussian_tradeoff(a, 1.0)``. Mahloujifar, Melis, Chaudhuri 2024.
    """
    return _tail_bound(m, r, v, lambda x: float(tradeoff(1.0 - x)))


def gaussian_tail_bound(m: int, r: int, v: int, mu: float) -> float:
    """:func:`tail_bound` for f = f_μ (with f_μ(1 − x) computed from x, for precision)."""
    return _tail_bound(m, r, v, _gaussian_least_other(mu))


def rejects_mu(m: int, r: int, v: int, mu: float, alpha: float) -> bool:
    """True when v of r right rejects μ-GDP at level α: the recursion started at τ = α
    needs more than r/m, so P[V ≥ v] < α (one recursion, no search over τ)."""
    _check(m, r, v)
    if v == 0 or r == 0:
        return False
    return _mass_needed(m, r, v, alpha, _gaussian_least_other(mu)) > r / m


def mu_lower_bound(m: int, r: int, v: int, alpha: float = 0.05) -> float:
    """Largest μ that v right guesses of r reject at level α (0 when μ = 0 is not rejected).

    Rejection is monotone in μ (f_μ falls as μ grows), so a bisection finds the crossing to
    1e-4, far below the audit's statistical uncertainty.
    """
    if not rejects_mu(m, r, v, 0.0, alpha):
        return 0.0
    low, high = 0.0, 1.0
    while rejects_mu(m, r, v, high, alpha):
        low, high = high, 2.0 * high
        if high > 100:  # beyond anything the canaries can show
            return low
    while high - low > 1e-4:
        mid = (low + high) / 2.0
        if rejects_mu(m, r, v, mid, alpha):
            low = mid
        else:
            high = mid
    return low


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2) of μ-GDP (Dong, Roth, Su, Corollary 2.13).

    Computed in logs: e^ε·Φ(·) overflows and cancels for large ε.
    """
    if mu <= 0:
        return 0.0
    first = log_ndtr(-epsilon / mu + mu / 2.0)
    second = epsilon + log_ndtr(-epsilon / mu - mu / 2.0)
    if second >= first:
        return 0.0
    return float(math.exp(first) * -math.expm1(second - first))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The ε at which μ-GDP is (ε, δ)-DP: the root of :func:`gdp_delta` (ε, μ) = δ.

    0 when μ = 0 or δ ≥ δ(0) = 2Φ(μ/2) − 1; ∞ when δ = 0 < μ (no finite ε has δ = 0).
    """
    if mu <= 0 or delta >= gdp_delta(0.0, mu):
        return 0.0
    if delta <= 0:
        return math.inf
    # The privacy loss of μ-GDP is N(μ²/2, μ²) and δ(ε) ≤ P[loss > ε], which brackets the root.
    high = mu * mu / 2.0 + mu * float(-ndtri(delta))
    log_delta = math.log(delta)
    return float(brentq(lambda eps: math.log(max(gdp_delta(eps, mu), 1e-320)) - log_delta,
                        0.0, high, xtol=1e-10, rtol=1e-12))
