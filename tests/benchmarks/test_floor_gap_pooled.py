"""benchmarks/floor_gap_pooled.py: rounds pooled over processes, an interval as wide as they disagree."""

import statistics

import pytest

from tests.benchmarks.loader import load_benchmark

pooled = load_benchmark("floor_gap_pooled")


def test_interval_spans_processes_that_disagree_though_each_is_steady():
    # Three processes, each steady on its own level: resampling rounds alone would find the
    # pooled median (1.01) in nearly every draw and an interval of one point; resampling the
    # processes first reaches the levels of the others.
    processes = [[1.00] * 20, [1.01] * 20, [1.05] * 20]
    low, high = pooled.pooled_interval(processes)
    assert low == 1.00 and high == 1.05
    assert statistics.median(sum(processes, [])) == 1.01


def test_steady_agreeing_processes_give_a_point_interval():
    assert pooled.pooled_interval([[1.02] * 9, [1.02] * 9]) == (1.02, 1.02)


def test_interval_narrows_as_more_processes_agree():
    # Rounds spread 0.95..1.05 in every process: with 2 processes the interval is wider than
    # with 16 (the median's spread shrinks with the rounds pooled from processes that agree).
    rounds = [0.95 + 0.01 * k for k in range(11)]
    few = pooled.pooled_interval([rounds] * 2)
    many = pooled.pooled_interval([rounds] * 16)
    assert few[0] <= many[0] <= 1.0 <= many[1] <= few[1]
    assert many[1] - many[0] < few[1] - few[0]


@pytest.mark.parametrize("interval, expected", [((0.99, 1.03), "met"), ((1.0, 1.031), "undecided"),
                                                ((1.031, 1.05), "not met"), ((1.03, 1.04), "undecided")])
def test_verdict_needs_the_whole_interval_on_one_side_of_the_goal(interval, expected):
    assert pooled.verdict(interval, goal=1.03) == expected


def test_pool_takes_every_rounds_gap_and_each_process_median():
    def child(gaps, ratios):
        row = {"flop_floor": 1.05, "floor": (1.1, 1.1, 1.1), "gap_rounds": gaps, "measured_rounds": ratios}
        return {"shapes": [{"batch": 4, "seq": 256, "groupings": {"all-layer": row, "layer": row}}]}

    out = pooled.pool([child([1.0, 1.2, 1.1], [1.1, 1.3, 1.2]), child([0.9, 1.0], [1.0, 1.1])],
                      {"non-private": 100.0, "dpclip all-layer": 110.0, "dpclip layer": 120.0})
    row = out["groupings"]["layer"]
    assert out["processes"] == 2
    assert row["gap"][0] == 1.0                      # median of the five rounds pooled
    assert row["process_medians"] == [1.1, 0.95]
    assert row["measured"][0] == 1.1
    assert row["memory_ratio"] == pytest.approx(1.2)
    assert row["interval"][0] <= row["gap"][0] <= row["interval"][1]


@pytest.mark.slow  # a benchmark smoke run: the slow set (README)
def test_smoke_run_pools_two_processes(capsys):
    result = pooled.main(["--smoke"])
    assert result["processes"] == 2 and len(result["children"]) == 2
    for row in result["shape"]["groupings"].values():
        assert len(row["process_medians"]) == 2
        assert row["verdict"] in ("met", "not met", "undecided")
    assert "per process" in capsys.readouterr().out
