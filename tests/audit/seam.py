"""A test-only seam: run the engine with LESS noise than the ledger believes.

    with scaled_noise(0.0):          # or 0.05: a run whose noise was cut by a "bug"
        result = train(recipe)       # ledger.json still states the recipe's σ and ε

This exists to prove that the audit works (tests/audit/test_claims.py) and for the non-DP
row of docs/auditing.md (scripts/audit_table.py): an under-noised run must be flagged by
the one-run audit (empirical ε lower bound above the ledger's ε). It lives under tests/, so
the installed package cannot reach it: no recipe key, CLI flag or environment variable,
nor any import of dpclip, turns it on.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from dpclip.engine.noise import NoiseSource


@contextmanager
def scaled_noise(factor: float) -> Iterator[None]:
    """Multiply the std of every gradient noise draw by ``factor`` while the block runs.

    Patches :meth:`NoiseSource.add_gaussians`, which draws the Gaussian noise on the
    summed clipped gradients; everything the engine reports (σ, noise std, DpEvent) and
    so the ledger stay as planned. The original method is restored on exit.
    """
    if factor < 0:
        raise ValueError("factor must be >= 0")
    original = NoiseSource.add_gaussians

    def scaled(self, targets, stds):
        return original(self, targets, [std * factor for std in stds])

    NoiseSource.add_gaussians = scaled
    try:
        yield
    finally:
        NoiseSource.add_gaussians = original
