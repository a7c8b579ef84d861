"""`dpclip bench RECIPE`: DP vs non-private step time and memory for the recipe's model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpclip import bench as bench_module

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SMALL = ["training.batch_size=16", "training.micro_batch_size=16"]


def test_bench_reports_each_grouping_against_non_private(cli):
    r = cli("bench", RECIPES / "quickstart.yaml", *SMALL, "--repeats", "1", "--warmup", "0",
            "--no-memory", "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    # and a step that runs the certificate each time (the first step of a run costs that)
    assert list(out["median_s"]) == ["non-private", "dp all-layer", "dp layer", "dp param", "dp all-layer, checked"]
    assert out["ratio"]["non-private"] == 1.0 and all(v > 0 for v in out["ratio"].values())
    assert out["batch_size"] == 16 and out["memory_mib"] == {}


@pytest.mark.slow  # torch.compile traces the step: about 15 s
def test_bench_lists_where_torch_compile_breaks_the_compiled_micro_batch(cli):
    r = cli("bench", RECIPES / "quickstart.yaml", *SMALL, "--repeats", "1", "--warmup", "0", "--no-memory",
            "--no-floor", "--graph-breaks", "--json")
    assert r.code == 0, r.err
    found = json.loads(r.out)["graph_breaks"]
    assert (found["graphs"], found["breaks"], found["reasons"]) == (1, 0, [])   # one graph (training.compile)
    plain = cli("bench", RECIPES / "quickstart.yaml", *SMALL, "--repeats", "1", "--warmup", "0", "--no-memory",
                "--no-floor", "--json")
    assert json.loads(plain.out)["graph_breaks"] == {}   # traced only when asked


def test_bench_reports_the_speed_settings_it_ran_with(cli, monkeypatch):
    import torch

    from dpclip.threads import configure

    before = torch.get_num_threads()
    try:
        r = cli("bench", RECIPES / "quickstart.yaml", *SMALL, "training.precision=bf16", "--repeats", "1",
                "--warmup", "0", "--no-memory", "--json", "--threads", "1")
        assert r.code == 0, r.err
        out = json.loads(r.out)
        # what dpclip.configure_speed sets (and `dpclip train`), plus the recipe's precision
        assert out["settings"] == {**configure(None), "precision": "bf16", "device": "cpu"}
        assert out["settings"]["threads"] == out["threads"] == 1
        table = cli("bench", RECIPES / "quickstart.yaml", *SMALL, "--repeats", "1", "--warmup", "0", "--no-memory",
                    "--threads", "1")
        assert "1 threads" in table.out and "fp32" in table.out
    finally:
        torch.set_num_threads(before)


def test_bench_refuses_a_thread_count_that_is_not_a_number(cli):
    r = cli("bench", RECIPES / "quickstart.yaml", "--threads", "many", "--no-memory")
    assert r.code != 0 and "hint:" in r.err


def test_bench_table_names_the_recipe(cli):
    r = cli("bench", RECIPES / "quickstart.yaml", *SMALL, "--repeats", "1", "--warmup", "0",
            "--no-memory")
    assert r.code == 0, r.err
    assert "quickstart" in r.out and "dp layer" in r.out


def test_bench_bad_recipe_is_an_error_line(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    r = cli("bench", bad, "--no-memory")
    assert r.code != 0


@pytest.mark.slow  # a benchmark smoke run: the slow set (README)
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_step_memory_sees_a_large_allocation():
    # in a fresh process, as step_memory_mib asks: this one's heap may hold freed memory of earlier
    # tests (and their allocator setting), which a new allocation would reuse without raising RSS
    code = ("import torch\nfrom dpclip.bench import step_memory_mib\n"
            "def step():\n    x = torch.ones(64, 1024, 1024)\n    x.add_(1)\n"  # 256 MiB, touched
            "print(step_memory_mib(step, steps=1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(bench_module.__file__).parents[1])})
    assert float(out.stdout.strip().splitlines()[-1]) > 200


def test_bench_sets_each_private_step_against_its_floor(cli):
    r = cli("bench", RECIPES / "quickstart.yaml", *SMALL, "--repeats", "1", "--warmup", "0",
            "--no-memory", "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    floor = out["floor"]
    assert floor["flop_ratio"] == (floor["nonprivate_flops"] + floor["extra_flops"]) / floor["nonprivate_flops"]
    assert floor["flop_ratio"] > 1 and floor["noise_share"] > 0
    assert floor["floor"] == floor["flop_ratio"] + floor["noise_share"]
    # one round: each gap is that round's ratio over the floor
    assert set(floor["gap"]) == {"dp all-layer", "dp layer", "dp param"}
    for name, gap in floor["gap"].items():
        assert gap == pytest.approx(out["ratio"][name] / floor["floor"])
    assert "noise draw" not in out["median_s"]          # the draws are the floor's, not methods
    table = cli("bench", RECIPES / "quickstart.yaml", *SMALL, "--repeats", "1", "--warmup", "0", "--no-memory")
    assert "x floor" in table.out and "Floor:" in table.out
    assert "Not covered by ε" in table.out and out["not_covered_by_epsilon"].startswith("not covered by ε")
    plain = cli("bench", RECIPES / "quickstart.yaml", *SMALL, "--repeats", "1", "--warmup", "0", "--no-memory",
                "--no-floor", "--json")
    assert json.loads(plain.out)["floor"] == {}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_bench_of_a_gpu_recipe_on_a_machine_without_one_is_an_error_with_a_hint(cli):
    r = cli("bench", RECIPES / "quickstart.yaml", *SMALL, "training.device=cuda", "--no-memory")
    assert r.code == 2 and "error: training.device is cuda, but torch sees no CUDA device" in r.err
    assert "hint:" in r.err and "Traceback" not in r.err
