import base64
import json
import shutil
from pathlib import Path

import pytest

from dpclip.accounting import bound_text
from dpclip.recipe import load_recipe
from dpclip.train.workflow import train

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("runs")
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"output_dir={output}", "training.epochs=null", "training.steps=6", "eval.every_steps=3",
        "checkpoint.every_steps=null"])
    return train(recipe).run_dir


@pytest.fixture
def finished_run(trained_run, tmp_path):
    """A copy of one short finished run (each test may change its copy)."""
    return Path(shutil.copytree(trained_run, tmp_path / "run"))


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(part.split('"', 1)[0]) for part in page.split('src="data:image/png;base64,')[1:]]


@pytest.mark.slow
def test_report_prints_the_summary_and_writes_one_self_contained_page(cli, finished_run, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # an absolute run path works from any directory
    (finished_run / "audit").mkdir()
    (finished_run / "audit" / "roc.png").write_bytes((finished_run / "thresholds.png").read_bytes())
    out = tmp_path / "page.html"
    result = cli("report", finished_run.resolve(), "--out", out)
    assert result.code == 0, result.err
    summary = json.loads((finished_run / "summary.json").read_text())
    assert "steps: 6 of 6" in result.out and "completed" in result.out
    assert "ε = " + bound_text(summary['epsilon']) in result.out
    assert "final held-out metrics (not covered by ε): loss" in result.out
    assert summary["statement"][0] in result.out
    page = out.read_text()
    images = _images(page)
    assert len(images) == 3 and all(image[:4] == b"\x89PNG" for image in images)
    assert images[0] == (finished_run / "training.png").read_bytes()
    assert "Privacy statement" in page and "not covered by ε" in page and "audit: roc" in page
    assert "http" not in page.replace("http-equiv", "")  # nothing to fetch: self-contained


@pytest.mark.slow
def test_report_without_out_writes_into_the_run_and_json_lists_it(cli, finished_run):
    (finished_run / "training.png").unlink()  # a run that stopped before drawing: drawn in memory
    result = cli("report", finished_run, "--json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert payload["report"] == str((finished_run / "report.html").resolve())
    assert payload["not_covered_by_epsilon"] == ["final_eval"] and payload["steps_done"] == 6
    assert len(_images((finished_run / "report.html").read_text())) == 2
    assert not (finished_run / "training.png").exists()


@pytest.mark.parametrize("name", ["ledger.json", "checkpoints/LATEST", "new.html"])
def test_an_out_inside_the_run_directory_is_refused_and_its_files_are_kept(cli, finished_run, name):
    # `dpclip report RUN --out RUN/ledger.json` replaced the run's ledger with the HTML page, exit 0
    before = (finished_run / "ledger.json").read_bytes()
    result = cli("report", finished_run, "--out", finished_run / name)
    assert result.code == 2 and "inside the run directory" in result.err and "hint:" in result.err
    assert (finished_run / "ledger.json").read_bytes() == before and not (finished_run / "new.html").exists()


def test_report_of_a_folder_that_is_not_a_run_is_an_error_with_a_hint(cli, tmp_path):
    result = cli("report", tmp_path)
    assert result.code == 2
    assert "error:" in result.err and "not a dpclip run directory" in result.err and "hint:" in result.err
    assert "Traceback" not in result.err
    missing = cli("report", tmp_path / "nope")
    assert missing.code == 2 and "hint:" in missing.err


def test_the_report_page_compares_every_attack_under_the_ledgers_bound_with_both_one_run_bounds():
    from dpclip.train.report import _audit_html

    audit = {"checkpoint": "step_000600", "step": 600, "ledger": {"epsilon": 1.0, "delta": 1e-5,
                                                                  "tpr_bound": {"fpr_0.1%": 0.0027, "fpr_1%": 0.0272}},
             "attacks": {name: {"auc": auc, "auc_ci95": [auc - 0.01, auc + 0.01], "tpr_at_0.1%_fpr": 0.001,
                                "tpr_at_1%_fpr": 0.012, "members": 899, "non_members": 898}
                         for name, auc in (("loss", 0.51), ("lira-online", 0.53), ("rmia-online", 0.54))},
             "one_run": {"canaries": 200, "correct": 61, "guesses": 100, "epsilon_lower_bound": 0.0,
                         "fdp": {"correct": 61, "guesses": 100, "mu_lower_bound": 0.12, "epsilon_lower_bound": 0.31}},
             "flagged": False,
             "exposure": {"max_exposure": 16.6, "chance": 1.4427, "planted": [{"repetitions": 16, "exposure": 2.5}],
                          "controls": {"count": 16, "mean_exposure": 1.3}}}
    page = "\n".join(_audit_html(audit))
    for name in ("loss", "lira-online", "rmia-online"):
        assert f"<td>{name}</td>" in page
    assert "≤ 0.0027" in page and "≤ 0.0272" in page          # the ledger's bound under the attacks
    assert "ε ≥ 0" in page and "μ ≥ 0.12, ε ≥ 0.31" in page and "within the ledger's ε" in page
    # the f-DP ε is a lower bound only under its condition, stated beside it as the CLI table does
    assert "ε ≥ 0.31 (a lower bound only if the trade-off curve is Gaussian" in page
    assert "2.5 bits (16x)" in page and "16 never-planted controls 1.3" in page
    assert "not covered by ε" in page


@pytest.mark.parametrize("written", ['{"ledger": 5}', '{"attacks": {"loss": 3}}', '{"attacks": [], "one_run": 5}',
                                     '{"one_run": {"fdp": {"epsilon_lower_bound": "x"}}}', '{"notes": [5]}', "[]",
                                     "{", "a folder",
                                     # a figure the page shows that is not a number (markup, not a damaged digit)
                                     '{"attacks": {"loss": {"auc": "<script>alert(1)</script>", "auc_ci95": []}}}',
                                     '{"attacks": {"loss": {"auc": 0.5, "auc_ci95": ["<b>", 1]}}}',
                                     '{"ledger": {"epsilon": 1, "tpr_bound": {"fpr_1%": "<img src=x>"}}}',
                                     '{"exposure": {"chance": "<i>"}}', '{"exposure": {"planted": [{"exposure": "<i>"}]}}',
                                     '{"one_run": {"canaries": "<i>"}}'])
def test_an_audit_report_of_the_wrong_shape_is_named_damaged_with_a_hint(cli, finished_run, written):
    report = finished_run / "audit" / "report.json"
    report.parent.mkdir()
    if written == "a folder":
        report.mkdir()
    else:
        report.write_text(written)
    result = cli("report", finished_run)
    assert result.code == 2, (result.code, result.err)
    assert "report.json is damaged" in result.err and "hint:" in result.err and "unexpected" not in result.err


def test_the_audit_section_escapes_every_figure_it_shows():
    """A report.json passed around with a run is data, not markup: whatever reaches the page
    (even past the shape check) is HTML-escaped."""
    from dpclip.train.report import _audit_html

    evil = "<script>alert(1)</script>"
    audit = {"checkpoint": evil, "step": 1, "ledger": {"epsilon": 1.0, "delta": evil, "tpr_bound": {"fpr_0.1%": evil,
                                                                                                    "fpr_1%": evil}},
             "attacks": {"loss": {"auc": evil, "auc_ci95": [evil, evil], "tpr_at_0.1%_fpr": evil,
                                  "tpr_at_1%_fpr": evil, "members": evil, "non_members": evil}},
             "one_run": {"canaries": evil, "correct": evil, "guesses": evil, "epsilon_lower_bound": 0.0,
                         "fdp": {"correct": evil, "guesses": evil, "mu_lower_bound": 0.0, "epsilon_lower_bound": 0.0}},
             "exposure": {"max_exposure": evil, "chance": evil, "planted": [{"repetitions": evil, "exposure": evil}],
                          "controls": {"count": evil, "mean_exposure": evil}}, "notes": [evil]}
    page = "\n".join(_audit_html(audit))
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_the_pages_verdict_follows_the_bound_it_shows_not_a_stored_flag():
    """A report without "flagged" (or with a false one) whose Steinke bound exceeds the ledger's ε
    was shown as "within the ledger's ε" under that very bound."""
    from dpclip.train.report import _audit_html

    one_run = {"canaries": 200, "correct": 98, "guesses": 100, "epsilon_lower_bound": 2.45, "confidence": 0.95}
    for stored in ({}, {"flagged": False}):
        page = "\n".join(_audit_html({"ledger": {"epsilon": 1.0, "delta": 1e-5}, "one_run": one_run, **stored}))
        assert "exceeds the ledger's ε" in page and "within the ledger's ε" not in page
    page = "\n".join(_audit_html({"ledger": {"epsilon": 8.0, "delta": 1e-5}, "one_run": one_run, "flagged": False}))
    assert "within the ledger's ε" in page
