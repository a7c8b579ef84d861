"""benchmarks/performance_page.py: the goals are computed from the measurements, and the
generated block of the page is replaced in place."""

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("performance_page", BENCH / "performance_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_smoke_run_rewrites_only_the_generated_block(tmp_path):
    module = load()
    page = tmp_path / "performance.md"
    page.write_text(f"# title\n\nprose before\n\n{module.START}\nold tables\n{module.END}\n\nprose after\n")
    raw = tmp_path / "raw.json"
    module.main(["--smoke", "--page", str(page), "--json", str(raw)])
    text = page.read_text()
    assert text.startswith("# title\n\nprose before") and text.endswith("prose after\n")
    assert "old tables" not in text and "### Goals" in text and "| forward |" in text
    # re-rendering the saved numbers gives the same page
    module.main(["--render", str(raw), "--page", str(page)])
    assert page.read_text() == text
    assert "phases" in json.loads(raw.read_text())
