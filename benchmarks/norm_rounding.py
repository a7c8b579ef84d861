"""How far below the exact value can a per-sample norm² come out, on entries of one size?

A per-sample gradient whose entries all have the same size is the worst case of a
reduction that runs a few accumulators down a long row: every rounding goes the same way
(docs/formulas.md, "Rounding of a norm"). For each (m, n, T) and random constants a, v
(activations all a, output gradients all v, so G = T·v aᵀ), this prints the largest
shortfall 1 − N̂/N of the norm² N̂ against the float64 value N, for

- ``whole row``: ``torch.linalg.vector_norm`` of the instantiated G_i, squared (the engine
  before the blocked sums);
- ``blocked``: :func:`dpclip.engine.sums.sum_of_squares` (the engine's instantiated norms),
  next to its stated bound;
- ``ghost``: :func:`dpclip.engine.factors.param_norm_sq` with the ghost norm (Gram
  matrices; covered by the measured error model of docs/formulas.md, "Cancellation"), as
  the engine computes it: a factor wider than ``grams.GHOST_ROUNDING_MAX_WIDTH`` read in
  panels;
- ``ghost, one product``: the same with every Gram one product over the whole width (the
  engine before the panels for rounding).

    python benchmarks/norm_rounding.py                  # 12 draws per shape, about a minute
    python benchmarks/norm_rounding.py --smoke          # small shapes, 2 draws (tests)
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dpclip.engine import grams  # noqa: E402
from dpclip.engine.factors import Bilinear, param_norm_sq  # noqa: E402
from dpclip.engine.sums import relative_bound, sum_of_squares  # noqa: E402

SHAPES = [(768, 3072, 4), (3072, 768, 16), (768, 768, 256), (16384, 768, 4), (768, 16384, 4), (32768, 768, 4),
          (256, 65536, 2),
          (768, 50257, 4)]
SMOKE_SHAPES = [(64, 96, 4)]


def shortfalls(m: int, n: int, t: int, a: float, v: float) -> dict[str, float]:
    """1 − N̂/N of each way, for constant factors a (T x m) and v (T x n)."""
    left = torch.full((1, 1, t, m), a)
    right = torch.full((1, 1, t, n), v)
    grad = (left[0, 0].T @ right[0, 0])[None]                   # G = Lᵀ R, [1, m, n]
    exact = float((left[0, 0].double().T @ right[0, 0].double()).square().sum())
    whole = float(torch.linalg.vector_norm(grad.flatten(1), dim=1).square()[0])
    # against the float64 norm of the stored G (what the clipped sum adds), not of Lᵀ R
    stored = float(grad.double().square().sum())
    blocked = float(sum_of_squares(grad)[0])
    ghost = float(param_norm_sq([Bilinear(left, right)], torch.Size([m, n]), "ghost")[0][0])
    cap, grams.GHOST_ROUNDING_MAX_WIDTH = grams.GHOST_ROUNDING_MAX_WIDTH, 1 << 62
    try:
        plain = float(param_norm_sq([Bilinear(left, right)], torch.Size([m, n]), "ghost")[0][0])
    finally:
        grams.GHOST_ROUNDING_MAX_WIDTH = cap
    return {"whole row": 1 - whole / stored, "blocked": 1 - blocked / stored, "ghost": 1 - ghost / exact,
            "ghost, one product": 1 - plain / exact}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=12)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    shapes, draws = (SMOKE_SHAPES, 2) if args.smoke else (SHAPES, args.draws)
    rng = random.Random(0)
    print(f"largest shortfall 1 - N̂/N over {draws} draws of constants a, v in [0.05, 2]; "
          f"blocked bound {relative_bound(torch.float32):.2e}")
    print(f"{'m':>6} {'n':>6} {'T':>4} {'whole row':>10} {'blocked':>10} {'ghost':>10} {'one product':>12}")
    rows = []
    for m, n, t in shapes:
        worst = {"whole row": 0.0, "blocked": 0.0, "ghost": 0.0, "ghost, one product": 0.0}
        for _ in range(draws):
            got = shortfalls(m, n, t, rng.uniform(0.05, 2.0), rng.uniform(0.05, 2.0))
            worst = {k: max(worst[k], got[k]) for k in worst}
        print(f"{m:>6} {n:>6} {t:>4} {worst['whole row']:>10.2e} {worst['blocked']:>10.2e} {worst['ghost']:>10.2e}"
              f" {worst['ghost, one product']:>12.2e}", flush=True)
        rows.append({"m": m, "n": n, "T": t, **worst})
    return rows


if __name__ == "__main__":
    main()
