"""Noise allocation over groups, the joint noise multiplier, and the noise generator.

Allocation (REFERENCE §A; adaptive-per-layer paper's noise allocation): scale group k by
1/w_k, so the concatenated clipped sum has L2 sensitivity S = sqrt(Σ_k C_k²/w_k²); add
N(0, (σ_g·S)²) to every coordinate of it; scale back. Group k therefore gets

    N(0, (σ_g · S · w_k)² I)  on its summed clipped gradient,

    global        w_k = 1            (S = sqrt(Σ C_k²): the same std everywhere)
    equal-budget  w_k = C_k          (S = sqrt(K): group k's noise depends on C_k only, so a
                                      pipeline stage can noise its own groups alone)
    weighted      w_k = C_k/sqrt(d_k) (equal signal-to-noise per coordinate; d_k = size)

Each is one Gaussian mechanism of multiplier σ_g on sensitivity S, so the privacy cost
does not depend on the allocation.
"""

from __future__ import annotations

import math
import secrets
from typing import Iterable

import torch
from torch import Tensor

from dpclip.errors import EngineError

ALLOCATIONS = ("global", "equal-budget", "weighted")


def allocation_weights(kind: str, thresholds: Tensor, sizes: Tensor) -> Tensor:
    """w_k of the allocation ``kind`` (module doc)."""
    if kind == "global":
        return torch.ones_like(thresholds)
    if kind == "equal-budget":
        return thresholds
    if kind == "weighted":
        return thresholds / sizes.to(thresholds.dtype).sqrt()
    raise EngineError(f"unknown noise_allocation {kind!r}", "use one of: " + ", ".join(ALLOCATIONS))


def noise_stds(sigma: float, thresholds: Tensor, weights: Tensor) -> Tensor:
    """σ_g · S · w_k with S = sqrt(Σ_k C_k²/w_k²): std of the noise on group k's summed
    clipped gradient (before dividing by the expected batch size)."""
    s = (thresholds.pow(2) / weights.pow(2)).sum().sqrt()
    return sigma * s * weights


def effective_noise_multiplier(sigma_gradient: float, aux: Iterable[tuple[float, float]] = ()) -> float:
    """σ_eff of the joint release of the gradient and auxiliary statistics (DESIGN §4).

    σ_eff⁻² = σ_g⁻² + Σ_a (Δ_a/σ_a)², computed by the accounting package so the engine and
    the ledger share one formula. A zero σ_g (no noise) gives σ_eff = 0: no privacy.
    """
    from dpclip.accounting import joint_noise_multiplier
    from dpclip.errors import AccountingError

    if sigma_gradient < 0:
        raise EngineError(f"noise_multiplier must be ≥ 0, got {sigma_gradient}", None)
    if sigma_gradient == 0:
        return 0.0
    releases = [(float(r[0]), float(r[1])) for r in aux]
    if any(sensitivity > 0 and sigma == 0 for sensitivity, sigma in releases):
        return 0.0
    try:
        return joint_noise_multiplier(sigma_gradient, [r for r in releases if r[0] > 0])
    except AccountingError as exc:
        raise EngineError(exc.message, exc.hint) from None


class NoiseSource:
    """One torch.Generator per device: seeded from ``seed``, or from OS entropy when
    ``secure`` (the user seed is then ignored, and states are never checkpointed).

    ``secure`` draws the seed with :mod:`secrets`; the stream itself is torch's PRNG
    (Mersenne Twister on CPU, Philox on CUDA), not a cryptographic generator.
    """

    def __init__(self, seed: int, secure: bool):
        self.seed = int(seed)
        self.secure = bool(secure)
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(secrets.randbits(63) if self.secure else self.seed)
            self._generators[key] = gen
        return gen

    def gaussian_like(self, p: Tensor, std: float) -> Tensor:
        """N(0, std²) with the shape, dtype and device of ``p``, drawn and scaled in one pass."""
        out = torch.empty(p.shape, device=p.device, dtype=p.dtype)
        return out.normal_(0.0, float(std), generator=self.generator(p.device))

    def state_dict(self) -> dict:
        if self.secure:
            return {"secure": True}
        return {"secure": False, "seed": self.seed,
                "states": {k: g.get_state() for k, g in self._generators.items()}}

    def load_state_dict(self, state: dict) -> None:
        if self.secure or state.get("secure"):
            return  # secure streams are re-seeded from OS entropy, never restored
        for key, st in state.get("states", {}).items():
            self.generator(torch.device(key)).set_state(st)
