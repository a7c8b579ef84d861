"""benchmarks/norm_rounding.py at smoke size: the script behind docs/formulas.md's "Rounding
of a norm" numbers still runs, and the blocked sums it measures stay within their bound."""

from __future__ import annotations

import torch

from dpclip.engine.sums import relative_bound
from tests.benchmarks.loader import load_benchmark


def test_norm_rounding_reports_every_shape_and_the_blocked_sum_within_its_bound(capsys):
    bench = load_benchmark("norm_rounding")
    rows = bench.main(["--smoke"])
    assert [(r["m"], r["n"], r["T"]) for r in rows] == bench.SMOKE_SHAPES
    for row in rows:
        assert row["blocked"] <= relative_bound(torch.float32)
        assert row["ghost"] <= 2e-5
    assert "blocked bound" in capsys.readouterr().out
