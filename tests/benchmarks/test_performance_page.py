"""benchmarks/performance_page.py: the goals are computed from the measurements, and the
generated blocks of the page and of the lab notes are replaced in place."""

import json

import pytest

from tests.benchmarks.loader import BENCHMARKS as BENCH, load_benchmark


def load():
    return load_benchmark("performance_page")


def _result(all_layer, layer, hooks=1.7, mem=(100.0, 108.0, 104.0), stash=(40.0, 12.0)):
    methods = ["non-private", "dpclip all-layer", "dpclip layer"]
    ratio = dict(zip(methods, [1.0, all_layer, layer]))
    return {"workloads": {"gpt2": {
        "ratio": ratio, "ratio_quartiles": {m: [r - 0.01, r + 0.01] for m, r in ratio.items()},
        "ratio_to_opacus_hooks": {m: r / hooks for m, r in ratio.items()},
        "memory_mib": dict(zip(methods, mem)),
        "stash_peak_mib": {"dpclip all-layer": stash[0], "dpclip layer": stash[1]}}}}


def test_goals_are_met_or_not_by_the_numbers():
    module = load()
    good = module.goals(_result(1.15, 1.10, hooks=2.0))
    assert good.count("**not met**") == 0 and good.count("**met**") == 5
    bad = module.goals(_result(1.25, 1.10, hooks=1.7, mem=(100.0, 108.0, 112.0), stash=(40.0, 50.0)))
    lines = {line.split("|")[1].strip(): line for line in bad.splitlines()[2:]}
    assert "**not met**" in lines["DP step ≤ 1.2x non-private"]        # all-layer 1.25
    assert "**not met**" in lines["DP step ≤ 0.6x Opacus hooks"]       # 1.10 / 1.7 = 0.65
    assert "**not met**" in lines["peak step memory ≤ 1.1x non-private"]  # layer-wise 1.12x
    assert "**not met**" in lines["layer-wise peak below all-layer peak"]


def _pages(module, tmp_path):
    """A page and a lab page, each with its generated block between prose."""
    page, lab = tmp_path / "performance.md", tmp_path / "README.md"
    page.write_text(f"# title\n\nprose before\n\n{module.START}\nold tables\n{module.END}\n\nprose after\n")
    lab.write_text(f"# lab\n\nnotes before\n\n{module.LAB_START}\nold profiles\n{module.LAB_END}\n\nnotes after\n")
    return page, lab


def test_rendering_the_saved_numbers_rewrites_only_the_generated_blocks(tmp_path):
    module = load()
    page, lab = _pages(module, tmp_path)
    saved = str(BENCH / "results" / "performance_page.json")
    module.main(["--render", saved, "--page", str(page), "--lab-page", str(lab)])
    text, notes = page.read_text(), lab.read_text()
    assert text.startswith("# title\n\nprose before") and text.endswith("prose after\n")
    assert "old tables" not in text and "### Goals" in text and "| dpclip layer |" in text
    assert text.count(module.START) == 1 and text.count(module.END) == 1
    assert notes.startswith("# lab\n\nnotes before") and notes.endswith("notes after\n")
    assert "old profiles" not in notes and "| forward |" in notes and "### GPT-2 scaling" in notes
    assert "### Goals" not in notes and "| forward |" not in text and "### GPT-2 scaling" not in text
    assert "### digits CNN" in notes and "### digits CNN" not in text   # the page keeps the GPT-2 tables
    module.main(["--render", saved, "--page", str(page), "--lab-page", str(lab)])
    assert page.read_text() == text and lab.read_text() == notes


@pytest.mark.slow  # an end-to-end smoke run of the benchmark: about a minute on 2 cores
def test_smoke_run_rewrites_only_the_generated_blocks(tmp_path):
    module = load()
    page, lab = _pages(module, tmp_path)
    raw = tmp_path / "raw.json"
    module.main(["--smoke", "--page", str(page), "--lab-page", str(lab), "--json", str(raw)])
    text, notes = page.read_text(), lab.read_text()
    assert text.startswith("# title\n\nprose before") and text.endswith("prose after\n")
    assert "old tables" not in text and "### Goals" in text and "### Goals (issue 16), GPT-2 small" in text
    assert "old profiles" not in notes and "| forward |" in notes
    assert "### Where the time goes: GPT-2 small" in notes
    # re-rendering the saved numbers gives the same pages
    module.main(["--render", str(raw), "--page", str(page), "--lab-page", str(lab)])
    assert page.read_text() == text and lab.read_text() == notes
    assert "phases" in json.loads(raw.read_text())


def _small(b, t, all_layer, layer, mem=(1000.0, 1100.0, 1050.0), hooks=2.0, ghost=2.5):
    methods = ["non-private", "dpclip all-layer", "dpclip layer"]
    ratio = dict(zip(methods, [1.0, all_layer, layer]))
    return {"workload": "gpt2-small", "sizes": {"batch": b, "seq": t}, "ratio": ratio,
            "ratio_quartiles": {m: [r - 0.01, r + 0.01] for m, r in ratio.items()},
            "ratio_to_opacus_hooks": {m: r / hooks for m, r in ratio.items()},
            "ratio_to_opacus_ghost": {m: r / ghost for m, r in ratio.items()},
            "memory_mib": dict(zip(methods, mem))}


def test_gpt2_small_goals_are_checked_per_shape_and_against_both_opacus_modes():
    module = load()
    result = _result(1.15, 1.10)
    result["workloads"]["gpt2-small 4x256"] = _small(4, 256, 1.09, 1.08)
    result["workloads"]["gpt2-small 2x1024"] = _small(2, 1024, 1.06, 1.04, mem=(1000.0, 1160.0, 1020.0))
    table = module.small_goals(result)
    rows = [line for line in table.splitlines()[2:]]
    time_rows = [r for r in rows if r.startswith("| DP step ≤")]
    assert "**met**" in time_rows[0] and "B 4, T 256" in time_rows[0]           # 1.09 ≤ 1.10
    assert "**not met**" in time_rows[1] and "B 2, T 1024" in time_rows[1]      # 1.06 > 1.05
    memory = [r for r in rows if r.startswith("| step memory")]
    assert "**met**" in memory[0] and "**not met**" in memory[1]                 # 1.16x > 1.15x
    opacus = [r for r in rows if "Opacus" in r]
    assert len(opacus) == 1 and "**met**" in opacus[0]
    result["workloads"]["gpt2-small 2x1024"] = _small(2, 1024, 1.06, 1.04, hooks=1.05)
    opacus = [r for r in module.small_goals(result).splitlines() if "Opacus" in r][0]
    assert "**not met**" in opacus and "all-layer vs hooks on gpt2-small 2x1024 (1.01x)" in opacus


def test_page_without_gpt2_small_rows_has_no_issue_16_goals():
    assert load().small_goals(_result(1.15, 1.10)) is None


def test_extra_time_splits_the_difference_into_phases_that_add_up():
    module = load()
    base = {"forward": 100.0, "backward": 200.0, "noise and p.grad": 0.0, "optimizer step": 5.0,
            "total": 305.0}
    dp = {"forward": 110.0, "backward": 260.0, "  per-sample norms": 25.0, "noise and p.grad": 30.0,
          "optimizer step": 5.0, "total": 405.0}
    line = module.extra_time({"non-private": base, "dpclip layer": dp}, "dpclip layer")
    # forward +10, norms +25, the rest of the backward 260 - 25 - 200 = +35, noise +30, optimizer 0
    assert line.startswith("dpclip layer: +100 ms per step over non-private")
    assert "forward +10 ms" in line and "per-sample norms +25 ms" in line
    assert "rest of the backward +35 ms" in line and "noise and p.grad +30 ms" in line
