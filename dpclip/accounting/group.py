"""Group privacy: what an (ε, δ) guarantee for one record says about k records at once
(docs/users.md): shown beside an example-level run so that the cost of the unit is visible.

For (ε, δ)-DP and data sets that differ in k records, chaining the guarantee through k
neighbours gives (kε, k·e^{(k−1)ε}·δ) (Dwork & Roth, "The algorithmic foundations of
differential privacy", Lemma 2.2 for pure DP; the δ term by the same induction). It holds for
any mechanism; a run built for the group (user-level sampling and clipping) does far better.
"""

from __future__ import annotations

import math

from dpclip.errors import AccountingError


def group_privacy(epsilon: float, delta: float, group_size: int) -> tuple[float, float]:
    """(ε_k, δ_k) = (kε, k·e^{(k−1)ε}·δ) for a group of ``group_size`` records."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise AccountingError(f"group size must be a whole number >= 1, got {group_size!r}",
                              "k is the number of records one person may have, e.g. --group-size 8")
    k = group_size
    if math.isinf(epsilon):
        return math.inf, 1.0
    exponent = (k - 1) * epsilon
    group_delta = 1.0 if exponent > 700 else min(1.0, k * math.exp(exponent) * delta)
    return k * epsilon, group_delta
