"""benchmarks/gpu_rows.py --smoke runs on the CPU (its rows are measured where a GPU is lent)."""

import pytest

from tests.benchmarks.loader import load_benchmark


def load():
    return load_benchmark("gpu_rows")


@pytest.mark.slow
def test_smoke_times_and_profiles_the_private_step_against_the_non_private_one(capsys, tmp_path):
    result = load().main(["--smoke", "--methods", "non-private", "dpclip all-layer", "--profile", "2x16",
                          "--json", str(tmp_path / "rows.json")])
    row = result["shapes"]["2x16"]
    assert set(row["ratio"]) == {"non-private", "dpclip all-layer"} and row["ratio"]["non-private"] == 1.0
    assert row["median_s"]["dpclip all-layer"] > 0
    out = capsys.readouterr().out
    assert "| 2x16 | dpclip all-layer |" in out and "== 2x16 dpclip all-layer: GPU" in out
    assert (tmp_path / "rows.json").exists()
