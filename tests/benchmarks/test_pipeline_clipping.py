"""benchmarks/pipeline_clipping.py at smoke size: the table docs/distributed.md shows cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "pipeline_clipping.py"
SMOKE = {"batch": 16, "micro": 8, "rounds": 2}   # the script's SMOKE sizes


@pytest.mark.slow  # two spawned processes: about 20 s on an idle machine
def test_the_pipeline_clipping_benchmark_measures_bytes_and_times_at_smoke_size(tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(BENCH), "--smoke", "--json", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert {k: result["sizes"][k] for k in SMOKE} == SMOKE
    assert all(len(t) == SMOKE["rounds"] and min(t) > 0 for t in result["times"].values())
    # equal-budget sends nothing; global gathers one float32 threshold per step; flat all-reduces
    # each micro-batch's per-sample norms² (float32)
    assert result["engine_bytes"] == {"per-device, equal-budget": 0, "per-device, global": 4,
                                      "flat (one C)": (SMOKE["batch"] // SMOKE["micro"]) * SMOKE["micro"] * 4}
    assert "| flat (one C) |" in done.stdout
