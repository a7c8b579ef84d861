"""benchmarks/moe_ssm_cost.py at smoke size: the script behind docs/performance.md's
"Mixture-of-experts and Mamba" table still runs every model and method (a refusal of the
engine would stop it)."""

from __future__ import annotations

from tests.benchmarks.loader import load_benchmark


def test_moe_ssm_cost_times_every_model_and_method(capsys):
    rows = load_benchmark("moe_ssm_cost").main(["--smoke"])
    assert list(rows) == ["mixtral", "mixtral-eager", "mamba"]
    for methods in rows.values():
        assert list(methods) == ["non-private", "dpclip all-layer", "dpclip layer"]
        assert all(row["median_s"] > 0 for row in methods.values())
        assert methods["non-private"]["ratio"] == (1.0, 1.0, 1.0)
    assert "| Mamba | dpclip layer |" in capsys.readouterr().out
