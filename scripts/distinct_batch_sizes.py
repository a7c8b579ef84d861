"""Print how many distinct batch sizes Poisson sampling draws in a run (docs/certificate.md).

    python scripts/distinct_batch_sizes.py

The certificate checks one row at each new batch size of a shape family, so a run has about
that many one-row checks. Draws B_t ~ Binomial(60,000, B/60,000) for T steps (seed 0: the
output is the same on every run) and prints the count and its ratio to √B.
"""

from __future__ import annotations

import numpy as np


def distinct_sizes(expected: int, steps: int, records: int = 60_000, seed: int = 0) -> int:
    """How many distinct values ``steps`` Poisson-sampled batch sizes take."""
    rng = np.random.default_rng(seed)
    return len(set(rng.binomial(records, expected / records, steps).tolist()))


def main() -> None:
    print("| expected B | steps | distinct sizes | / √B |")
    print("|---:|---:|---:|---:|")
    for expected in (16, 64, 256, 1024):
        for steps in (100, 1_000, 10_000):
            n = distinct_sizes(expected, steps)
            print(f"| {expected} | {steps:,} | {n} | {n / expected ** 0.5:.1f} |")


if __name__ == "__main__":
    main()
