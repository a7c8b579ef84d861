"""scripts/supported_models.py: docs/zoo.md's table is the script's
rendering of the committed results (render only: fast), and the rendering itself."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script(load_script):
    yield load_script("supported_models")
    sys.modules.pop("supported_models", None)


def test_docs_block_is_the_rendering_of_the_committed_results(script):
    results = json.loads(script.RESULTS.read_text())
    assert script.docs_block() == script.render(results), (
        "docs/zoo.md's table is stale: run "
        "`python scripts/supported_models.py --render-only --write-docs`")


def test_readmes_count_of_exact_transformers_architectures_is_the_committed_results(script):
    """README.md's "N of the zoo's M tiny transformers architectures" is the script's count, not
    a number typed by hand that a rerun of the zoo leaves behind."""
    import re

    results = json.loads(script.RESULTS.read_text())
    by_case: dict = {}
    for run in results["runs"]:
        by_case.setdefault(run["case"], []).append(run)
    exact, total = script._families(results, by_case)["hf"]
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    shown = re.search(r"(\d+) of the zoo's (\d+) tiny transformers architectures", readme)
    assert shown and (int(shown.group(1)), int(shown.group(2))) == (exact, total), \
        f"README.md: write '{exact} of the zoo's {total} tiny transformers architectures'"


def test_committed_results_are_a_full_run_of_the_current_zoo(script):
    from tests.engine.zoo import CASES, GROUPINGS, METHODS, PRECISIONS, SHAPES
    results = json.loads(script.RESULTS.read_text())
    assert not results["meta"]["quick"]
    assert list(results["cases"]) == list(CASES), "zoo cases changed: rerun scripts/supported_models.py"
    keys = {(r["case"], r["shape"], r["grouping"], r["method"], r["precision"]) for r in results["runs"]}
    assert len(keys) == len(results["runs"]) == len(CASES) * len(SHAPES) * len(GROUPINGS) * len(METHODS) * len(PRECISIONS)


def _results(runs):
    meta = {"torch": "2", "transformers": "5", "shapes": {"generic": [3, 5], "B==T": [4, 4], "B==T+1": [5, 4],
                                                         "B==1": [1, 5]},
            "groupings": ["all-layer"], "methods": ["ghost", "auto"], "precisions": ["fp32", "bf16"],
            "tolerance": {"fp32": 1e-4, "bf16": 0.0156}, "quick": False}
    return {"meta": meta, "cases": {"m": {"family": "hf", "what": "a model"}}, "runs": runs}


def _run(shape, method, precision, verdict, **extra):
    return {"case": "m", "shape": shape, "grouping": "all-layer", "method": method, "precision": precision,
            "verdict": verdict, **extra}


def test_a_cell_names_the_shapes_and_precision_of_each_fault(script):
    runs = [_run(s, m, p, "exact") for s in ("generic", "B==T", "B==T+1", "B==1") for m in ("ghost", "auto")
            for p in ("fp32", "bf16")]
    runs[2] = _run("B==T", "ghost", "fp32", "wrong", max_rel_err=0.3, norm_rel_err=1.0, params=["w"])
    runs[4] = _run("B==T+1", "ghost", "fp32", "refused", message="EngineError: no | pipes")
    text = script.render(_results(runs))
    row = next(line for line in text.splitlines() if line.startswith("| `m`"))
    cells = [c.strip() for c in row.split(" | ")]
    assert cells[2] == "**wrong** (B==T; fp32); refused (B==T+1; fp32); exact otherwise"
    assert cells[3] == "exact"
    assert "max rel. error 0.3" in cells[4] and "`w`" in cells[4] and "no \\| pipes" in cells[4]
    assert "16 runs: 14 exact, 1 refused, 1 wrong, 0 crashed." in text


def test_a_broken_reference_is_named_in_the_cell_the_notes_and_the_counts(script):
    """A run whose float64 per-example reference is itself NaN is neither "exact otherwise" nor "wrong"."""
    runs = [_run(s, "auto", "fp32", "exact") for s in ("generic", "B==T", "B==T+1", "B==1")]
    runs[0] = _run("generic", "auto", "fp32", "broken-reference", message="the float64 reference is not finite")
    text = script.render(_results(runs))
    row = next(line for line in text.splitlines() if line.startswith("| `m`"))
    assert "**broken-reference** (generic; fp32)" in row and "broken-reference: the float64 reference" in row
    assert "4 runs: 3 exact, 0 refused, 0 wrong, 0 crashed, 1 broken-reference." in text


def test_write_docs_replaces_only_the_marked_block(script, tmp_path):
    page = tmp_path / "supported-models.md"
    page.write_text(f"before\n{script.START}\nold\n{script.END}\nafter\n")
    results = _results([_run("generic", "ghost", "fp32", "exact")])
    script.write_docs(results, page)
    text = page.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert script.docs_block(page) == script.render(results)


def test_fault_table_covers_each_case_by_few_patterns(script):
    runs = [_run(s, m, p, "wrong" if s == "B==T" else "exact", max_rel_err=0.2, params=["w"])
            for s in ("generic", "B==T", "B==T+1", "B==1") for m in ("ghost", "auto") for p in ("fp32", "bf16")]
    table = script.fault_table(_results(runs))
    assert table.count("issue 25") == 1 and '("m", "B==T", "*", "*", "*")' in table


def test_merge_replaces_the_rerun_cases_and_keeps_the_others_in_zoo_order(script):
    from tests.engine.zoo import CASES
    first, second = list(CASES)[:2]

    def results(cases, verdict, seconds):
        out = _results([{"case": c, "shape": "generic", "grouping": "all-layer", "method": "auto",
                         "precision": "fp32", "verdict": verdict} for c in cases])
        out["cases"] = {c: {"family": "hf", "what": c} for c in cases}
        out["meta"]["seconds"] = seconds
        return out

    saved, fresh = results([first, second], "exact", 10), results([first], "refused", 3)
    out = script.merged(saved, fresh)
    assert list(out["cases"]) == [first, second] and out["meta"]["seconds"] == 13
    assert [(r["case"], r["verdict"]) for r in out["runs"]] == [(first, "refused"), (second, "exact")]
    fresh["meta"]["torch"] = "3"
    with pytest.raises(SystemExit, match="other versions"):
        script.merged(saved, fresh)
