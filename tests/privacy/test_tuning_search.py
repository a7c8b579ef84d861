"""An attacker reads what `dpclip tune-cost RECIPE --run` leaves behind.

The search's ledger charges Papernot–Steinke repeat-and-select: K ~ D trials, each a
uniformly drawn configuration trained with its own private randomness, and only the
best run with its noisy score released. Before the fix,

- every trial used the recipe's seed, so two trials shared noise and batches (the
  difference of their updates is noiseless);
- every trial's run directory (model, checkpoints, exact held-out accuracy) was kept;
- K, the configurations and the score noise came from a generator seeded by the recipe;
- `dpclip account` on the selected run reported that run's ε alone, and on the search
  directory failed.

Each search here trains 2-step runs of an 8-unit MLP; K is forced (the law of K is
tested in tests/accounting) by replacing ``draw_trial_count``, which also records the
generator the search passes it.
"""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import pytest
import torch

import dpclip.accounting.tuning as accounting_tuning
import dpclip.train.workflow as workflow
from dpclip.accounting import bound_text
from dpclip.cli.main import main
from dpclip.data import load_data
from dpclip.models import build_model, evaluate
from dpclip.recipe import apply_overrides, read_yaml, validate_recipe
from dpclip.rng import private_random
from dpclip.rundir.checkpoint import latest_checkpoint, load_checkpoint, unflatten_state
from dpclip.files import read_json
from dpclip.tuning.cost import StepTimer, tune_cost
from dpclip.tuning.search import run_search
from dpclip.tuning.space import search_space

REPO = Path(__file__).resolve().parents[2]
# Learning rates that no held-out accuracy k/360 can equal, so a float equal to an exact
# accuracy in a file can only be that accuracy.
GRID = ["training.optimizer.lr=0.13,0.57"]
TINY = ["training.epochs=null", "training.steps=2", "model.hidden=[8]", "privacy.accountant=rdp",
        "tuning.score=private", "tuning.score_noise=20"]
UNSAFE = "privacy.unsafe_seeded_randomness=true"


def _recipe(output_dir, *overrides):
    base = apply_overrides(read_yaml(REPO / "recipes" / "quickstart.yaml"),
                           [f"output_dir={output_dir}", *TINY, *overrides])
    return base, validate_recipe(base)


class Observed:
    """What one search did, seen from outside: each trial's generator states and exact
    held-out accuracy (read before the search can delete the trial), the generator the
    search drew K from, and every Gaussian draw of that generator."""

    def __init__(self):
        self.trials: list[dict] = []
        self.rng_states: list = []
        self.gauss: list[float] = []
        self.summary: dict = {}


def _spy_train(real_train, observed: Observed):
    def spy(recipe=None, **kwargs):
        result = real_train(recipe, **kwargs)
        run_dir = Path(result.run_dir)
        checkpoint = latest_checkpoint(run_dir)
        from safetensors.torch import load_file

        state = unflatten_state(read_json(checkpoint / "state.json"), load_file(str(checkpoint / "state.safetensors")))
        data = kwargs.get("data") or load_data(recipe.data, seed=recipe.seed)
        model, loss_fn = build_model(recipe.model, data, seed=recipe.seed)
        load_checkpoint(checkpoint, model)
        accuracy = evaluate(model, loss_fn, data.test, data.task)["accuracy"]
        observed.trials.append({
            "run_dir": run_dir, "accuracy": accuracy, "correct": round(accuracy * data.num_test),
            "num_test": data.num_test, "sampler": state["sampler"]["generator"].clone(),
            "noise": {k: v.clone() for k, v in state["engine"]["noise"]["states"].items()},
        })
        return result

    return spy


def _search(report, base, recipe, trials: int, *, train_for_real: bool = True) -> Observed:
    observed = Observed()

    def forced(mean, shape, rng):
        observed.rng_states.append(copy.deepcopy(rng.getstate()))
        real_gauss = rng.gauss

        def gauss(mu=0.0, sigma=1.0):
            value = real_gauss(mu, sigma)
            observed.gauss.append(value)
            return value

        rng.gauss = gauss
        return trials

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(accounting_tuning, "draw_trial_count", forced)
        if train_for_real:
            patch.setattr(workflow, "train", _spy_train(workflow.train, observed))
        observed.summary = run_search(base, recipe, report, grid=GRID)
    return observed


@pytest.fixture(scope="module")
def searches(tmp_path_factory):
    root = tmp_path_factory.mktemp("searches")
    base, recipe = _recipe(root / "default")
    # The per-run σ depends on the privacy section only; the randomness mode does not change it.
    report = tune_cost(base, recipe, grid=GRID, timer=StepTimer(fixed_seconds=0.01))
    unsafe_base, unsafe_recipe = _recipe(root / "unsafe", UNSAFE)
    return {
        "recipe": recipe,
        "default": _search(report, base, recipe, 2),
        "unsafe": _search(report, unsafe_base, unsafe_recipe, 2),
        # K = 0 trains nothing: enough to see which generator a search draws from.
        "default again": _search(report, *_recipe(root / "again"), 0),
        "unsafe again": _search(report, *_recipe(root / "unsafe-again", UNSAFE), 0),
    }


def _cli(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("mode", ["default", "unsafe"])
def test_two_trials_of_a_search_get_different_noise_and_batches(searches, mode):
    first, second = searches[mode].trials
    # Same number of draws in each trial, so equal initial states would give equal final ones.
    assert not torch.equal(first["sampler"], second["sampler"]), "the trials drew the same Poisson batches"
    assert first["noise"] and set(first["noise"]) == set(second["noise"])
    for device, state in first["noise"].items():
        assert not torch.equal(state, second["noise"][device]), "the trials drew the same gradient noise"


def test_only_the_selected_run_survives_and_no_exact_held_out_score_is_written(searches):
    observed = searches["default"]
    summary = observed.summary
    search_dir = Path(summary["search_dir"])
    trial_dirs = sorted(p for p in (search_dir / "runs").iterdir())
    assert len(observed.trials) == 2
    assert trial_dirs == [Path(summary["selected_run"])], "a non-selected trial's directory was kept"
    assert {t["run_dir"] for t in observed.trials} >= set(trial_dirs)

    exact = {t["accuracy"] for t in observed.trials}
    recipe_values = {v for v in _floats(searches["recipe"].model_dump(mode="json"))}
    for path in search_dir.rglob("*"):
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # safetensors, png
        for accuracy in exact:
            assert repr(accuracy) not in text, f"{path} holds an exact held-out accuracy"
        if path.suffix not in (".json", ".jsonl"):
            continue
        documents = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" \
            else [json.loads(text)]
        for document in documents:
            keys = set(_keys(document))
            assert not keys & {"accuracy", "eval", "train_loss", "diagnostics", "loss"}, (path, keys)
            assert not _find(document, "final_eval"), f"{path} holds exact held-out metrics"
            leaked = {x for x in _floats(document) if any(math.isclose(x, a, rel_tol=0, abs_tol=1e-12)
                                                            for a in exact)} - recipe_values
            assert not leaked, f"{path} holds an exact held-out accuracy: {leaked}"

    # The summary releases the selected run and its noisy score, not K nor the other trials.
    assert "runs" not in summary and "trials" not in summary
    selected = next(t for t in observed.trials if t["run_dir"] == Path(summary["selected_run"]))
    assert summary["selected_score"] != pytest.approx(selected["accuracy"], abs=1e-9)


def test_trial_count_configurations_and_score_noise_come_from_os_entropy(searches, tmp_path):
    recipe = searches["recipe"]
    default, again = searches["default"].rng_states[0], searches["default again"].rng_states[0]
    assert default != again, "two searches of the same recipe drew K from the same generator"
    # An attacker's reconstructions from the recipe: the old generator and the opt-in one.
    for guess in (random.Random(f"dpclip-search-{recipe.seed}"), private_random(recipe.seed, "tuning-search")):
        assert guess.getstate() not in (default, again)

    # The released score's noise is a draw of that generator: noisy score × n − exact count.
    observed = searches["default"]
    selected = next(t for t in observed.trials if t["run_dir"] == Path(observed.summary["selected_run"]))
    noise = observed.summary["selected_score"] * selected["num_test"] - selected["correct"]
    assert any(math.isclose(noise, g, abs_tol=1e-6) for g in observed.gauss)

    # Random-search configurations too (grid keys and ranges), unless the recipe opts in.
    ranges = "tuning.ranges={training.optimizer.lr: {low: 0.001, high: 1.0, log: true}}"
    for overrides, same in (((ranges,), False), ((ranges, UNSAFE), True)):
        base, drawn = _recipe(tmp_path, *overrides)
        first = [c.values for c in search_space(base, drawn, random_draws=3)]
        second = [c.values for c in search_space(base, drawn, random_draws=3)]
        assert (first == second) is same

    # With privacy.unsafe_seeded_randomness the search is reproducible from the recipe (and says so).
    assert searches["unsafe"].rng_states[0] == searches["unsafe again"].rng_states[0]


def test_account_reports_the_searchs_epsilon_for_the_search_and_its_selected_run(searches, capsys):
    summary = searches["default"].summary
    search_dir, selected = Path(summary["search_dir"]), Path(summary["selected_run"])
    code, out, err = _cli(capsys, "account", search_dir, "--json")
    assert code == 0, err
    payload = json.loads(out)
    assert payload["statement"]["epsilon"] == pytest.approx(summary["epsilon"], rel=1e-12)
    code, text, err = _cli(capsys, "account", search_dir)
    assert code == 0, err
    assert bound_text(summary['epsilon']) in text

    code, out, err = _cli(capsys, "account", selected, "--json")
    assert code == 0, err
    payload = json.loads(out)
    run_alone = payload["run_statement"]["epsilon"]
    assert run_alone < summary["epsilon"]
    assert payload["statement"]["epsilon"] == pytest.approx(summary["epsilon"], rel=1e-12)
    assert Path(payload["selected_by_search"]["search_dir"]).resolve() == search_dir.resolve()
    code, text, err = _cli(capsys, "account", selected)
    assert code == 0, err
    assert "selected by" in text and bound_text(summary['epsilon']) in text and "understates" in text
    run_summary = read_json(selected / "summary.json")
    assert run_summary["epsilon"] == pytest.approx(summary["epsilon"], rel=1e-12)
    assert run_summary["selected_by_search"]

    unsafe_dir = Path(searches["unsafe"].summary["search_dir"])
    code, text, err = _cli(capsys, "account", unsafe_dir)
    assert code == 0, err
    assert "WARNING" in text and "unsafe_seeded_randomness" in text


def test_audit_of_the_selected_run_sets_the_searchs_epsilon_beside_the_leakage(searches):
    from dpclip.audit.report import audit

    summary = searches["default"].summary
    report = audit(Path(summary["selected_run"]), ["loss"], bootstrap=0, write=False)
    assert report["ledger"]["epsilon"] == pytest.approx(summary["epsilon"], rel=1e-12)
    assert report["ledger"]["epsilon_this_run_alone"] < summary["epsilon"]
    assert any("selected by the tuning search" in note for note in report["notes"])


def test_the_selected_run_cannot_be_made_to_report_its_own_epsilon_alone(searches, tmp_path, capsys):
    import shutil

    summary = searches["default"].summary
    copy_dir = tmp_path / "search"
    shutil.copytree(summary["search_dir"], copy_dir)
    selected = copy_dir / summary["selected_run_dir"]
    (selected / "search.json").unlink()  # the marker is gone: the run's place in runs/ still tells
    code, out, err = _cli(capsys, "account", selected, "--json")
    assert code == 0, err
    assert json.loads(out)["statement"]["epsilon"] == pytest.approx(summary["epsilon"], rel=1e-12)

    moved = tmp_path / "moved"
    shutil.copytree(summary["search_dir"], copy_dir / "again")
    shutil.move(copy_dir / "again" / summary["selected_run_dir"], moved)
    (copy_dir / "again" / "ledger.json").unlink()
    code, out, err = _cli(capsys, "account", moved)
    assert code == 2 and "understates" in err and "hint:" in err


def _keys(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield key
            yield from _keys(value)
    elif isinstance(node, list):
        for value in node:
            yield from _keys(value)


def _find(node, name):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == name and value:
                return True
            if _find(value, name):
                return True
    elif isinstance(node, list):
        return any(_find(value, name) for value in node)
    return False


def _floats(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from _floats(value)
    elif isinstance(node, list):
        for value in node:
            yield from _floats(value)
    elif isinstance(node, float):
        yield node
