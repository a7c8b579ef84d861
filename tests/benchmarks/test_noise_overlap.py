"""benchmarks/noise_overlap.py at smoke size: the overlapped draw is measured against the
backward of the same round, so the floor's noise share rests on a script that still runs."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.loader import load_benchmark


@pytest.mark.slow  # a benchmark smoke run: the slow set (README)
def test_noise_overlap_times_every_run_and_costs_each_draw_against_its_own_round(tmp_path, capsys):
    bench = load_benchmark("noise_overlap")
    result = bench.main(["--smoke", "--json", str(tmp_path / "r.json")])
    printed = capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text()) == result
    assert set(result["median_s"]) == set(bench.MODES)
    assert all(t > 0 for t in result["median_s"].values())
    assert set(result["overlapped_cost_s"]) == {"backward + draw", "backward + draw, nice 19"}
    # one round: the cost is exactly (backward with the draw) − (backward alone) of that round
    med = result["median_s"]
    for mode, cost in result["overlapped_cost_s"].items():
        assert abs(cost - (med[mode] - med["backward alone"])) < 1e-12
    dp_cost = load_benchmark("dp_cost")
    model = dp_cost.make_workload(*dp_cost.resolve("gpt2", smoke=True)).model
    assert result["parameters"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert "engine draw alone" in printed and ("does not hide" in printed or "hides" in printed)
