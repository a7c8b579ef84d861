"""benchmarks/cancellation.py: the error model the cancellation flag rests on still holds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "cancellation.py"


def test_float32_ghost_error_stays_below_the_flags_error_model(capsys):
    """The flag assumes |N̂ − N| ≤ u·D·sqrt(m + n + T) with room to spare (0.52 measured at
    full size, docs/formulas.md): a ghost norm computed less accurately fails here."""
    spec = importlib.util.spec_from_file_location("cancellation_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    worst = module.main(["--smoke"])
    assert 0 < worst < 1, worst
    assert "largest" in capsys.readouterr().out
