"""An attacker reads the run a hyperparameter search selected (``tune-cost --run``).

Publishing that run costs the whole search's ε (repeat-and-select over every trial and the
selection), which its own ledger understates. Before the fix, ``dpclip report`` (summary,
page and console) showed the run's own ε, and its TensorBoard log plotted that ε as
``privacy/epsilon``; ``dpclip account`` and the export's model card already showed the
search's. Here every place that shows the run's headline ε must show the search's total.

A tiny search: 2-step runs of an 8-unit MLP, K forced to 2 (the law of K is tested in
tests/accounting)."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest

import dpclip.accounting.tuning as accounting_tuning
from dpclip.accounting import bound_text
from dpclip.cli.main import main
from dpclip.files import read_json
from dpclip.recipe import apply_overrides, read_yaml, validate_recipe
from dpclip.tuning.cost import StepTimer, tune_cost
from dpclip.tuning.search import run_search

REPO = Path(__file__).resolve().parents[2]
TINY = ["training.epochs=null", "training.steps=2", "model.hidden=[8]", "privacy.accountant=rdp",
        "tuning.score=private", "tuning.score_noise=20", "logging.tensorboard=true"]
GRID = ["training.optimizer.lr=0.13,0.57"]
# The tags docs/training.md documents: the headline ε, and a search trial's own ε alone.
EPSILON_TAG, RUN_ALONE_EPSILON_TAG = "privacy/epsilon", "privacy/epsilon_this_run_alone"


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    root = tmp_path_factory.mktemp("search")
    base = apply_overrides(read_yaml(REPO / "recipes" / "quickstart.yaml"), [f"output_dir={root}", *TINY])
    recipe = validate_recipe(base)
    report = tune_cost(base, recipe, grid=GRID, timer=StepTimer(fixed_seconds=0.01))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(accounting_tuning, "draw_trial_count", lambda mean, shape, rng: 2)
        summary = run_search(base, recipe, report, grid=GRID)
    selected = Path(summary["selected_run"])
    own = read_json(selected / "ledger.json")
    return {"summary": summary, "selected": selected, "epsilon": summary["epsilon"], "root": root, "own": own}


def _cli(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def _run_alone(search, capsys) -> float:
    payload = json.loads(_cli(capsys, "account", search["selected"], "--json"))
    alone = payload["run_statement"]["epsilon"]
    assert alone < search["epsilon"] and bound_text(alone) != bound_text(search['epsilon'])
    return alone


def test_report_summary_page_and_console_show_the_searchs_epsilon(search, capsys, tmp_path):
    total, alone = search["epsilon"], _run_alone(search, capsys)
    payload = json.loads(_cli(capsys, "report", search["selected"], "--json", "--out", tmp_path / "r.html"))
    assert payload["epsilon"] == pytest.approx(total, rel=1e-12)
    assert payload["selected_by_search"]["run_epsilon_alone"] == pytest.approx(alone, rel=1e-12)
    page = html.unescape((tmp_path / "r.html").read_text())
    spent_row = next(line for line in page.split("<tr>") if "ε spent" in line)
    assert bound_text(total) in spent_row and bound_text(alone) not in spent_row
    text = _cli(capsys, "report", search["selected"], "--out", tmp_path / "r2.html")
    headline = next(line for line in text.splitlines() if line.startswith("ε = "))
    assert bound_text(total) in headline


def test_account_and_export_show_the_searchs_epsilon(search, capsys, tmp_path):
    total = search["epsilon"]
    payload = json.loads(_cli(capsys, "account", search["selected"], "--json"))
    assert payload["statement"]["epsilon"] == pytest.approx(total, rel=1e-12)
    _cli(capsys, "export", search["selected"], tmp_path / "export")
    card = read_json(tmp_path / "export" / "privacy.json")
    assert card["epsilon"] == pytest.approx(total, rel=1e-12)
    assert "ε = " + bound_text(total) in (tmp_path / "export" / "README.md").read_text()


def test_tensorboard_headline_is_the_searchs_epsilon(search, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    total, alone = search["epsilon"], _run_alone(search, capsys)
    events = EventAccumulator(str(search["selected"] / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    headline = [event.value for event in events.Scalars(EPSILON_TAG)]
    assert headline and all(value == pytest.approx(total, rel=1e-6) for value in headline), (headline, total)
    own = [event.value for event in events.Scalars(RUN_ALONE_EPSILON_TAG)]
    assert own and own[-1] == pytest.approx(alone, rel=1e-6)


def test_the_selected_runs_tensorboard_log_tells_neither_when_it_ran_nor_how_many_trials_ran(search):
    """TensorBoard names its files events.out.tfevents.<start time>.<host>.<pid>.<how many event files
    the process opened before>, and stamps the first event with the clock: the selected trial's
    start, its index among the trials and, from the file the search added, the search's end; with the
    search's start (its directory's name) that is K, which repeat-and-select keeps secret."""
    import os
    import re

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    files = sorted((search["selected"] / "tensorboard").iterdir())
    assert files
    for file in files:
        assert not re.search(r"\d{10}", file.name) and f".{os.getpid()}." not in file.name, file.name
        times = [event.wall_time for event in EventFileLoader(str(file)).Load()]
        assert times and max(times) <= search["own"]["steps"], (file.name, times)


@pytest.mark.parametrize("stopped", ["running", "interrupted"])
def test_a_trial_of_a_search_killed_mid_way_is_refused_as_unfinished_not_as_modified(search, stopped, tmp_path,
                                                                                     capsys):
    """kill -9 leaves the search's summary at `stopped: running` and the best trial so far on disk."""
    import shutil

    search_dir = Path(search["summary"]["search_dir"])
    killed = tmp_path / search_dir.name
    shutil.copytree(search_dir, killed)
    summary = read_json(killed / "summary.json")
    summary.update(stopped=stopped, selected_run=None, selected_run_dir=None, selected_configuration=None,
                   selected_score=None)
    (killed / "summary.json").write_text(json.dumps(summary))
    trial = killed / "runs" / search["selected"].name
    (trial / "search.json").unlink()   # a trial not yet selected has no marker
    assert main(["account", str(trial)]) != 0
    err = capsys.readouterr().err
    assert f"did not finish (stopped: {stopped}" in err and "releases nothing" in err and "Traceback" not in err
