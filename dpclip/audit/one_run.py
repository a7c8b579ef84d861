"""The one-run audit (Steinke, Nasr, Jagielski 2023, "Privacy Auditing with One (1)
Training Run"; docs/auditing.md).

m canaries are each trained on independently with probability ½. After training, the
auditor scores every canary, guesses "in" for the k highest scores and "out" for the k
lowest (abstaining on the rest), and counts v correct guesses out of r = 2k. If training
were (ε, δ)-DP, the number of correct guesses could not exceed what randomized response
with accuracy p = e^ε / (1 + e^ε) gives, up to the δ term (the paper's Theorem 3.1):

    P[V ≥ v] ≤ P[Binomial(r, p) ≥ v] + 2·m·δ · max_{i=1..v} P[v − i ≤ Binomial(r, p) < v] / i.

The ε lower bound at confidence 1 − α is the largest ε for which this p-value is still
below α: any smaller ε is rejected by the observed v.

:func:`one_run_audit` also reports, from the same guesses, the f-DP bound of
:mod:`dpclip.audit.fdp_one_run` (a Gaussian trade-off curve; under ``"fdp"``).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import binom

from dpclip.audit.fdp_one_run import gdp_epsilon, mu_lower_bound
from dpclip.errors import DpclipError


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[at least v of r guesses correct] under (ε, δ)-DP (module doc)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    p = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(binom.sf(v - 1, r, p))           # P[Binomial(r, p) ≥ v]
    if v == 0:
        return min(1.0, tail)
    # max over i = 1..v of P[v − i ≤ Binomial < v] / i, the windows as cumulative sums of
    # the pmf below v (one vectorised call, not v scalar ones: r = 1000 took ~0.5 s a bound)
    i = np.arange(1, v + 1)
    windows = np.cumsum(binom.pmf(v - i, r, p))
    worst = float(np.max(windows / i))
    return min(1.0, tail + 2.0 * m * delta * worst)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, alpha: float = 0.05) -> float:
    """Largest ε with p_value(m, r, v, ε, δ) ≤ α (0 when even ε = 0 is not rejected).

    The p-value grows with ε, so a bisection finds the crossing; 1e-4 accuracy is far
    below the statistical uncertainty of the audit.
    """
    if r == 0 or p_value(m, r, v, 0.0, delta) > alpha:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) <= alpha:
        low, high = high, 2.0 * high
        if high > 100:  # v = r with a huge r: the bound is beyond anything meaningful
            return low
    while high - low > 1e-4:
        mid = (low + high) / 2.0
        if p_value(m, r, v, mid, delta) <= alpha:
            low = mid
        else:
            high = mid
    return low


def guess_counts(m: int) -> list[int]:
    """The k's tried (k "in" guesses and k "out" guesses each): a few fixed fractions of m."""
    return sorted({k for k in (m // 20, m // 10, m // 4, m // 2) if k >= 1})


#: What the f-DP ε lower bound assumes (printed beside it wherever it appears).
FDP_CONDITION = "a lower bound only if the trade-off curve is Gaussian; the Steinke bound assumes nothing"


def check_confidence(confidence) -> None:
    """A confidence level is a number strictly between 0 and 1 (1 − α of every bound)."""
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise DpclipError(f"the audit's confidence must be a number between 0 and 1 (exclusive), got {confidence!r}",
                          "e.g. confidence=0.95: each ε lower bound then holds with probability 95%")


def one_run_verdict(result: dict, epsilon: float) -> tuple[bool, str | None]:
    """(flagged, a note or None) for a :func:`one_run_audit` ``result`` beside the ledger's ``epsilon``.

    Flagged: the ε lower bound exceeds the ledger's ε. Not flagged is evidence of nothing when the
    canaries could not have flagged the run: when even every guess right (``epsilon_ceiling``)
    gives a bound no higher than the ledger's ε, the note says so."""
    confidence = result["confidence"]
    if result["epsilon_lower_bound"] > epsilon:
        return True, (f"the empirical ε lower bound exceeds the ledger's ε at {100 * confidence:g}% confidence: the "
                      "run leaks more than its accounting allows (a privacy bug, or a wrong ledger), unless this is "
                      f"the {100 * (1 - confidence):.2g}% of audits of a correct run that are flagged")
    ceiling = result.get("epsilon_ceiling")
    if ceiling is not None and ceiling <= epsilon:
        return False, (f"the one-run audit could not have flagged this run: with {result['canaries']} canaries even "
                       f"every guess right gives ε ≥ {ceiling:.3g} at most, not above the ledger's ε = {epsilon:.3g}; "
                       "'within the ledger's ε' is no evidence here (the most the audit can show grows slowly with "
                       "the canaries: ε ≥ 3.8 with 200, 5.4 with 1,000 at δ = 1e-5)")
    return False, None


def one_run_audit(scores: np.ndarray, included: np.ndarray, delta: float, confidence: float = 0.95) -> dict:
    """ε lower bound from canary ``scores`` (higher = "trained on") and the secret ``included``.

    Several guess counts k are tried; to keep the overall confidence, each is tested at
    level α / (number of k's) (Bonferroni), and the best bound is reported.

    ``"fdp"`` holds the f-DP bound (Mahloujifar, Melis, Chaudhuri 2024) of the same
    guesses at the same levels: the largest μ-GDP the counts reject and its ε at ``delta``
    (:mod:`dpclip.audit.fdp_one_run`), for the k whose μ is largest.
    """
    check_confidence(confidence)
    scores = np.asarray(scores, dtype=float)
    included = np.asarray(included, dtype=bool)
    m = len(scores)
    if included.shape != scores.shape:
        raise DpclipError(f"the canaries' answer key holds {included.size} inclusion bits for {m} canaries",
                          "audit/canaries.json belongs to another run or was damaged: audit the run it came with")
    ks = guess_counts(m)
    if not ks:
        raise DpclipError(f"{m} canaries are too few for the one-run audit: it guesses on m/20 to m/2 of them",
                          "train with audit.canaries.count of 100 or more (1,000 for a strong bound)")
    order = np.argsort(-scores, kind="stable")
    alpha = (1.0 - confidence) / max(len(ks), 1)
    tried = []
    for k in ks:
        top, bottom = order[:k], order[m - k:]
        correct = int(included[top].sum() + (~included[bottom]).sum())
        tried.append({"k": k, "guesses": 2 * k, "correct": correct,
                      "epsilon_lower_bound": epsilon_lower_bound(m, 2 * k, correct, delta, alpha)})
    best = max(tried, key=lambda t: t["epsilon_lower_bound"]) if tried else None
    # every guess right at the best k: more than m canaries, whatever the model, cannot show
    ceiling = max(epsilon_lower_bound(m, 2 * k, 2 * k, delta, alpha) for k in ks)
    fdp_tried = [{"k": t["k"], "guesses": t["guesses"], "correct": t["correct"],
                  "mu_lower_bound": mu_lower_bound(m, t["guesses"], t["correct"], alpha)} for t in tried]
    fdp_best = max(fdp_tried, key=lambda t: t["mu_lower_bound"]) if fdp_tried else None
    fdp_mu = fdp_best["mu_lower_bound"] if fdp_best else 0.0
    return {
        "canaries": m, "included": int(included.sum()), "confidence": confidence, "delta": delta,
        "epsilon_lower_bound": best["epsilon_lower_bound"] if best else 0.0,
        "guesses": best["guesses"] if best else 0, "correct": best["correct"] if best else 0,
        "tried": tried, "epsilon_ceiling": ceiling,
        "fdp": {
            "curve": "gaussian", "condition": FDP_CONDITION, "mu_lower_bound": fdp_mu, "epsilon_lower_bound": gdp_epsilon(fdp_mu, delta),
            "guesses": fdp_best["guesses"] if fdp_best else 0, "correct": fdp_best["correct"] if fdp_best else 0,
            "tried": fdp_tried,
        },
    }
