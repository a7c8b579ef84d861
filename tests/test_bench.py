"""dpclip.bench timing helpers: ratios are taken round by round."""

from dpclip.bench import round_ratios, time_rounds


def test_round_ratios_cancel_a_slow_round_that_hits_both_sides():
    # round 3 ran 10x slower for everyone: per-round ratios stay 1.5, medians of times would not
    times = {"non-private": [1.0, 1.0, 10.0, 1.0], "dp": [1.5, 1.5, 15.0, 1.5]}
    median, q1, q3 = round_ratios(times, "non-private")["dp"]
    assert (median, q1, q3) == (1.5, 1.5, 1.5)
    assert round_ratios(times, "non-private")["non-private"] == (1.0, 1.0, 1.0)


def test_round_ratio_quartiles_show_the_spread():
    times = {"ref": [1.0] * 5, "m": [1.0, 1.1, 1.2, 1.3, 1.4]}
    median, q1, q3 = round_ratios(times, "ref")["m"]
    assert abs(median - 1.2) < 1e-12 and abs(q1 - 1.1) < 1e-12 and abs(q3 - 1.3) < 1e-12


def test_time_rounds_interleaves_and_counts_rounds():
    order = []
    steps = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    times = time_rounds(steps, repeats=3, warmup=1)
    assert order == ["a", "b"] * 4
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
