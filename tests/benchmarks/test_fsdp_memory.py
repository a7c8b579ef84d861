"""benchmarks/fsdp_memory.py at smoke size: each rank of a sharded run holds its 1/N of the
parameters, gradients and optimizer state, and the table docs/performance.md shows cannot rot."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "fsdp_memory.py"


def load():
    spec = importlib.util.spec_from_file_location("fsdp_memory_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # six spawned processes (the whole, 2 ranks, 3 ranks): about 30 s beside other jobs
def test_each_rank_holds_its_even_cut_of_parameters_gradients_and_optimizer_state(tmp_path):
    bench = load()
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(BENCH), "--smoke", "--json", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["sizes"] == bench.SMOKE
    whole = result["whole"]
    params = list(bench.build_model(bench.SMOKE).parameters())  # the tied lm_head counted once
    whole_bytes = sum(p.numel() * p.element_size() for p in params)
    assert whole["parameters"] == whole["gradients"] == whole_bytes
    # AdamW: two moments the shape of each parameter, and one float32 0-dim step count each
    assert whole["optimizer"] == 2 * whole_bytes + 4 * len(params) and whole["optimizer_scalars"] == 4 * len(params)
    assert sorted(result["sharded"]) == ["2", "3"]
    for size, ranks in result["sharded"].items():
        n = int(size)
        assert len(ranks) == n
        # torch.chunk's cut (FSDP2's Shard(0)): a rank holds at most ceil(rows/N) rows of each
        # parameter, its gradient and AdamW's two moments each have the local shard's shape, and
        # the step counts are 0-dim, whole on every rank. So a rank's bytes are at most
        # 4·cut + the step counts, cut = Σ ceil(rows/N)·(row bytes): 1/N of the whole plus at
        # most one row of each parameter times 4 (the padding the last rank goes without).
        cut = sum(math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0]) * p.element_size() for p in params)
        row_bytes = sum(p.numel() // p.shape[0] * p.element_size() for p in params)
        bound = (4 * cut + 4 * len(params)) / bench.held(whole)
        assert 1 / n < bound < 1 / n + 4 * sum(p.numel() // p.shape[0] * p.element_size() for p in params) \
            / bench.held(whole)
        for rank in ranks:
            assert rank["sharded_parameters"] == rank["count"] == len(params)  # every parameter is a DTensor
            assert rank["parameters"] == rank["gradients"] <= cut
            assert rank["optimizer"] - rank["optimizer_scalars"] == 2 * rank["parameters"]
            assert bench.held(rank) / bench.held(whole) <= bound
            # the transient the docs state: the clipped sums are whole-size on every rank; the
            # bucketed reduce-scatter holds at most them, one bucket (the larger of the bucket
            # size and the largest parameter, each rank's part padded by at most a row of each
            # parameter) and the shards received (at most the cut). Without the buckets it held
            # (2 + 2/N)·whole, above this bound at these sizes.
            assert rank["sums_peak"] == whole_bytes
            bucket = max(bench.SMOKE["bucket_elements"] * 4, max(p.numel() * 4 for p in params)) + n * row_bytes
            assert whole_bytes < rank["reduce_scatter_peak"] <= whole_bytes + bucket + cut
            assert (2 + 2 / n) * whole_bytes > whole_bytes + bucket + cut   # the bound can fail the old way
        # the shards partition the whole: nothing is held twice or left out
        assert sum(r["parameters"] for r in ranks) == whole_bytes
        assert sum(r["optimizer"] - r["optimizer_scalars"] for r in ranks) == 2 * whole_bytes
        if n == 3:  # the odd row counts make the last rank's shards short: the cut is uneven
            assert ranks[-1]["parameters"] < ranks[0]["parameters"]
    assert "| 3 ranks | 2 |" in done.stdout
