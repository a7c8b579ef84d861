"""Print the f-DP one-run numbers of docs/auditing.md on simulated μ-GDP canaries.

    python scripts/fdp_simulation.py

Canary scores are N(μ, 1) if the canary went in and N(0, 1) if not (exactly μ-GDP per
canary), δ = 1e-5, seeds 0-4. Prints the table of both one-run ε lower bounds (Steinke et
al. and the f-DP bound) at 1000 canaries, the 200-canary row, and the tightness check of
tests/audit/test_fdp_one_run.py (the bound on P[all 20 guesses right] at μ = 2 against a
20,000-run simulation). Seeded: the output is the same on every run; about 15 s on one thread.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from dpclip.audit.fdp_one_run import gaussian_tail_bound, gdp_epsilon
from dpclip.audit.one_run import one_run_audit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the simulated auditor is the test's own
from tests.audit.test_fdp_one_run import gaussian_guesses  # noqa: E402

DELTA = 1e-5
SEEDS = range(5)


def bounds(m: int, mu: float, seed: int) -> tuple[float, float, float]:
    """Steinke et al. ε ≥, f-DP ε ≥ and μ ≥ for one simulated run of m canaries."""
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    result = one_run_audit(rng.normal(size=m) + mu * included, included, delta=DELTA)
    fdp = result["fdp"]
    return result["epsilon_lower_bound"], fdp["epsilon_lower_bound"], fdp["mu_lower_bound"]


def span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}–{high:.2f}"


def main() -> None:
    print(f"1000 canaries, δ = {DELTA:g}, seeds {SEEDS.start}–{SEEDS.stop - 1}:\n")
    print("| μ (true ε at δ = 1e-5) | Steinke et al. ε ≥ | f-DP ε ≥ (μ ≥) |\n|---|---|---|")
    gains = []
    for mu in (1.0, 2.0, 4.0):
        rows = [bounds(1000, mu, seed) for seed in SEEDS]
        steinke, fdp, mus = ([row[i] for row in rows] for i in range(3))
        gains += [f - s for s, f in zip(steinke, fdp)]
        print(f"| {mu:g} ({gdp_epsilon(mu, DELTA):#.3g}) | {span(steinke)} | {span(fdp)} ({span(mus)}) |")
    rows = [bounds(200, 1.0, seed) for seed in SEEDS]
    gains += [row[1] - row[0] for row in rows]
    print(f"\n200 canaries, μ = 1: Steinke et al. {span([r[0] for r in rows])}, f-DP {span([r[1] for r in rows])}")
    print(f"f-DP bound minus Steinke et al., seed by seed, all rows: {span(gains)}")

    m, mu, k, trials = 200, 2.0, 10, 20_000
    frequency = float(np.mean(gaussian_guesses(m, mu, k, trials, seed=0) == 2 * k))
    tolerance = 3 * math.sqrt(frequency * (1 - frequency) / trials)
    print(f"\nP[all {2 * k} guesses right], {m} canaries, μ = {mu:g}: bound {gaussian_tail_bound(m, 2 * k, 2 * k, mu):.3f},"
          f" simulated {frequency:.3f} ({trials:,} runs, test tolerance {tolerance:.4f})")
    for percent in range(1, 11):
        if gaussian_tail_bound(m, 2 * k, 2 * k, mu * (1 - percent / 100)) + tolerance < frequency:
            print(f"smallest μ understatement the test rejects: {percent}% (μ = {mu * (1 - percent / 100):g})")
            break


if __name__ == "__main__":
    main()
