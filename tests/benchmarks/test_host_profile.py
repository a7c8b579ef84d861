"""benchmarks/host_profile.py at smoke size: the reads from the device and the tensor
operations of a step are counted where they happen, so the GPU diagnosis cannot rot."""

from __future__ import annotations

import json

from tests.benchmarks.loader import load_benchmark


def test_host_profile_counts_the_reads_and_operations_of_each_step(tmp_path, monkeypatch, capsys):
    from dpclip.engine import microbatch

    bench = load_benchmark("host_profile")
    one_by_one = bench.main(["--smoke", "--json", str(tmp_path / "one.json"), "--out", str(tmp_path / "one.txt")])
    monkeypatch.setitem(microbatch.FINALIZE_BATCH, "cpu", 4)   # the GPU's finalization
    four = bench.main(["--smoke"])
    capsys.readouterr()
    assert json.loads((tmp_path / "one.json").read_text()) == one_by_one
    report = (tmp_path / "one.txt").read_text()
    assert "_certify" in report and "cProfile, dpclip layer" in report
    reads, ops = one_by_one["reads"], one_by_one["ops"]
    assert reads["non-private"] == 1   # one inside transformers' GPT-2 forward
    assert reads["non-private"] < reads["dpclip all-layer"] < reads["dpclip layer"]
    assert ops["non-private"] < ops["dpclip all-layer"] < ops["dpclip layer"]
    # finalizing the layer-wise groups four at a time reads the device less and launches less
    assert four["reads"]["dpclip layer"] < reads["dpclip layer"]
    assert four["ops"]["dpclip layer"] < ops["dpclip layer"]
    assert four["reads"]["dpclip all-layer"] == reads["dpclip all-layer"]
