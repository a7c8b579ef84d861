"""benchmarks/engine_step_ratio.py --smoke runs and reports a ratio per grouping."""

import importlib.util
from pathlib import Path


def test_step_ratio_benchmark_smoke_runs(capsys):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_step_ratio.py"
    spec = importlib.util.spec_from_file_location("engine_step_ratio", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--smoke"])
    assert set(result["ratio"]) == {"non-DP", "DP all-layer", "DP layer"}
    assert result["ratio"]["non-DP"] == 1.0 and all(r > 0 for r in result["ratio"].values())
    assert "DP layer" in capsys.readouterr().out
