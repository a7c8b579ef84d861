"""benchmarks/graph_breaks.py on the tiny GPT-2: the measure behind issue 54 still traces a whole
eager private step (a failure inside the engine under torch._dynamo would stop it), its counts are
consistent (one graph more than breaks, each listed reason with a source line), and the compiled
micro-batch is one graph without a break."""

from __future__ import annotations

import pytest

from tests.benchmarks.loader import load_benchmark


@pytest.mark.slow
def test_graph_breaks_of_the_private_step_are_counted_and_located():
    script = load_benchmark("graph_breaks")
    result = script.explain_step("gpt2", batch=4)
    assert result["graphs"] == result["breaks"] + 1
    listed = sum(count for count, _, _ in result["reasons"])
    assert 0 <= listed <= result["breaks"]
    assert all(where.endswith(tuple("0123456789")) for _, _, where in result["reasons"])
    assert (result["compiled"]["graphs"], result["compiled"]["breaks"]) == (1, 0), result["compiled"]["reasons"]
    assert "| gpt2 | " in script.render([result], top=3)
