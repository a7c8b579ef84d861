"""How large is the float32 ghost norm's error, against the atoms it is made of?

The engine flags a sample whose float32 norm² N̂ it cannot vouch for (dpclip/engine/
cancellation.py): flagged when N̂·ρ < u·λ·D, with D = Σ_t ||L_t||²||R_t||² (the atoms'
squared sizes), u = 2^-24 and λ = sqrt(m + n + T). That rests on the measured error
|N̂ − N| staying below λ·u·D by a margin. This script measures

    ratio = |N̂ − N| / (u·D) / sqrt(m + n + T)

on factors built to cancel (two positions L_1 = L_2, R_{1,2} = ±K·u + w, plus T − 2 random
ones), for several layer shapes and cancellation strengths K, with N the float64 value.
docs/formulas.md ("Cancellation") quotes the largest ratio printed here.

    python benchmarks/cancellation.py           # GPT-2-like shapes, 8 draws per cell
    python benchmarks/cancellation.py --smoke   # small shapes, 2 draws (tests)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dpclip.engine.factors import ghost_norm_sq  # noqa: E402

SHAPES = [(16, 16, 8), (64, 256, 64), (768, 768, 256), (768, 3072, 256), (3072, 768, 64),
          (8192, 768, 32)]
SMOKE_SHAPES = [(16, 16, 8), (64, 48, 16)]
SCALES = [1.0, 10.0, 1e3, 1e5]


def error_ratio(m: int, n: int, t: int, scale: float, generator: torch.Generator) -> float:
    """|N̂ − N| / (u·D·sqrt(m + n + T)) for one cancelling draw."""
    lead = torch.randn(m, generator=generator)
    u, w = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    left = torch.cat([torch.stack([lead, lead]), torch.randn(t - 2, m, generator=generator)])
    right = torch.cat([torch.stack([scale * u + w, -scale * u + w]),
                       torch.randn(t - 2, n, generator=generator)])
    got = float(ghost_norm_sq(left[None, None], right[None, None])[0])
    exact = float((left.double().T @ right.double()).pow(2).sum())
    atoms = float((left.double().pow(2).sum(1) * right.double().pow(2).sum(1)).sum())
    return abs(got - exact) / (2.0 ** -24 * atoms * math.sqrt(m + n + t))


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small shapes, 2 draws")
    args = parser.parse_args(argv)
    shapes, draws = (SMOKE_SHAPES, 2) if args.smoke else (SHAPES, 8)
    generator = torch.Generator().manual_seed(0)
    print(f"{'m':>6} {'n':>6} {'T':>5} " + " ".join(f"{'K=' + format(k, 'g'):>9}" for k in SCALES))
    worst = 0.0
    for m, n, t in shapes:
        row = [max(error_ratio(m, n, t, k, generator) for _ in range(draws)) for k in SCALES]
        worst = max(worst, *row)
        print(f"{m:>6} {n:>6} {t:>5} " + " ".join(f"{r:>9.3f}" for r in row))
    print(f"largest |N̂ − N| / (u·D·sqrt(m + n + T)): {worst:.3f}")
    return worst


if __name__ == "__main__":
    main()
