import json
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting import dp_event, rdp

from dpclip.accounting import Ledger
from dpclip.errors import DpclipError
from dpclip.recipe import apply_overrides, read_yaml, validate_recipe
from dpclip.tuning.cost import StepTimer, tune_cost
from dpclip.tuning.search import run_search


REPO = Path(__file__).resolve().parents[2]


def _search(output_dir, *overrides):
    base = apply_overrides(read_yaml(REPO / "recipes" / "quickstart.yaml"),
                           [f"output_dir={output_dir}", "training.epochs=null", "training.steps=2",
                            "model.hidden=[8]", "privacy.accountant=rdp", *overrides])
    recipe = validate_recipe(base)
    grid = ["training.optimizer.lr=0.1,0.5"]
    report = tune_cost(base, recipe, grid=grid, timer=StepTimer(fixed_seconds=0.01))
    return report, run_search(base, recipe, report, grid=grid)


@pytest.fixture(scope="module")
def public_search(tmp_path_factory, public_held_out):
    return _search(tmp_path_factory.mktemp("runs"), *public_held_out, "tuning.score=public")


def test_search_ledger_spends_exactly_what_was_promised(public_search):
    report, summary = public_search
    search_dir = Path(summary["search_dir"])
    ledger = Ledger.from_dict(json.loads((search_dir / "ledger.json").read_text()))
    promised = report.privacy.strategy("repeat-and-select")
    assert ledger.epsilon() == pytest.approx(promised.epsilon, rel=1e-12)
    # ... and it is dp_accounting's RDP ε of repeat-and-select over one run at the per-run σ
    run = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        report.privacy.sample_rate, dp_accounting.GaussianDpEvent(promised.noise_multiplier)), report.privacy.steps)
    direct = rdp.RdpAccountant().compose(dp_event.RepeatAndSelectDpEvent(run, 2.0, 1.0))
    assert ledger.epsilon() == pytest.approx(direct.get_epsilon(report.privacy.delta), rel=1e-12)


def test_the_selected_run_trained_at_the_searchs_sigma_and_is_the_only_one_kept(public_search):
    report, summary = public_search
    sigma = report.privacy.strategy("repeat-and-select").noise_multiplier
    search_dir = Path(summary["search_dir"])
    kept = list((search_dir / "runs").iterdir())
    assert summary["stopped"] == "completed"
    # K >= 1 for the truncated negative binomial, so a run is always selected.
    assert kept == [Path(summary["selected_run"])]
    assert summary["selected_run_dir"] == kept[0].relative_to(search_dir).as_posix()
    entries = json.loads((kept[0] / "ledger.json").read_text())["entries"]
    assert entries[0]["event"]["event"]["noise_multiplier"] == sigma
    assert summary["selected_configuration"] in ({"training.optimizer.lr": 0.1}, {"training.optimizer.lr": 0.5})
    assert 0 <= summary["selected_score"] <= 1  # a public score: the exact held-out accuracy
    marker = json.loads((kept[0] / "search.json").read_text())
    assert (kept[0] / marker["search_dir"]).resolve() == search_dir.resolve()
    assert marker["epsilon"] == summary["epsilon"]


def test_private_score_is_charged_to_every_run(public_search, tmp_path, public_held_out):
    _, public = public_search
    _, private = _search(tmp_path, *public_held_out, "tuning.score=private", "tuning.score_noise=20")
    assert private["sigma_per_run"] > public["sigma_per_run"]
    ledger = json.loads((Path(private["search_dir"]) / "ledger.json").read_text())
    run_event = ledger["entries"][0]["event"]["event"]
    assert run_event["type"] == "Composed"
    assert run_event["events"][1] == {"type": "Gaussian", "noise_multiplier": 20.0}


def test_a_shuffled_searchs_statement_does_not_call_its_steps_poisson_sampled(tmp_path, public_held_out):
    from dpclip.accounting.statement import SHUFFLE_CAVEAT
    from dpclip.rundir.searchdir import search_statement_lines

    _, summary = _search(tmp_path, *public_held_out, "tuning.score=public", "training.sampling=shuffle")
    lines = search_statement_lines(Path(summary["search_dir"]))
    release = next(line for line in lines if "repeat-and-select" in line)
    assert "2 Poisson-sampled steps" not in release
    assert "steps on fixed-size shuffled batches, accounted as if Poisson-sampled" in release
    assert f"CAVEAT: {SHUFFLE_CAVEAT}" in lines


def test_poisson_trials_cannot_be_recorded_yet(tiny, public_held_out):
    base, recipe = tiny("tuning.trials=poisson", *public_held_out, "tuning.score=public")
    report = tune_cost(base, recipe, grid=["training.optimizer.lr=0.1,0.5"], timer=StepTimer(fixed_seconds=0.01))
    with pytest.raises(DpclipError, match="Poisson"):
        run_search(base, recipe, report, grid=["training.optimizer.lr=0.1,0.5"])


def test_a_search_that_fails_releases_nothing(tiny, public_search, monkeypatch, public_held_out):
    import dpclip.accounting.tuning as tuning_math
    import dpclip.train.workflow as workflow

    base, recipe = tiny(*public_held_out, "tuning.score=public", "privacy.accountant=rdp")
    grid = ["training.optimizer.lr=0.1,0.5"]
    report, _ = public_search  # the same privacy section: the same per-run σ
    started = []

    def crashing_train(trial, *, data=None, run_dir=None, **kwargs):
        run_dir.mkdir(parents=True)
        (run_dir / "model.safetensors").write_text("trained weights")
        started.append(run_dir)
        raise RuntimeError("disk full")

    monkeypatch.setattr(tuning_math, "draw_trial_count", lambda mean, shape, rng: 3)
    monkeypatch.setattr(workflow, "train", crashing_train)
    with pytest.raises(RuntimeError, match="disk full"):
        run_search(base, recipe, report, grid=grid)
    search_dir = started[0].parent.parent
    assert list((search_dir / "runs").iterdir()) == []
    summary = json.loads((search_dir / "summary.json").read_text())
    assert summary["stopped"] == "failed" and summary["selected_run"] is None
    assert (search_dir / "ledger.json").exists()  # the runs happened: the charge stands


@pytest.mark.parametrize("mechanism", ["{kind: banded-mf, bands: 3}", "{kind: blt, buffers: 2}"])
def test_tune_cost_prices_correlated_noise_by_its_participations(tmp_path, mechanism):
    """Each run of the search is charged what its ledger will hold: banded MF's ⌈T/b⌉
    participations at q·b, BLT's per-participation Gaussians, not T DP-SGD steps at q."""
    from dpclip.accounting import solve

    base = apply_overrides(read_yaml(REPO / "recipes" / "quickstart.yaml"),
                           [f"output_dir={tmp_path}", "training.epochs=null", "training.steps=12", "model.hidden=[8]",
                            f"privacy.mechanism={mechanism}"])
    recipe = validate_recipe(base)
    report = tune_cost(base, recipe, grid=["training.optimizer.lr=0.1,0.5"], timer=StepTimer(fixed_seconds=0.01))
    solved = solve(report.plan)
    sigma = solved.split.noise_multiplier
    assert report.privacy.release.training(sigma) == solved.total_event
    plain = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(report.plan.sample_rate, dp_accounting.GaussianDpEvent(sigma)), 12)
    assert report.privacy.release.training(sigma) != plain


def test_a_user_level_search_scores_people_and_says_so(tmp_path):
    """At user level one person's held-out records would move a count of correct records by as many
    as they wrote: the private score sums each held-out person's accuracy (sensitivity 1), and the
    search's statement names the unit."""
    import random

    from dpclip.rundir.searchdir import search_statement_lines
    rng = random.Random(0)
    rows = ["person,x1,x2,label"]
    for person in range(60):
        for _ in range(1 + person % 7 * 3):   # 1 to 19 records each
            label = rng.randint(0, 1)
            rows.append(f"p{person},{rng.gauss(label, 1):.4f},{rng.gauss(-label, 1):.4f},{label}")
    (tmp_path / "data.csv").write_text("\n".join(rows) + "\n")
    base = {"name": "user-search", "output_dir": str(tmp_path / "runs"),
            "data": {"source": "files", "format": "csv", "train": str(tmp_path / "data.csv"), "label_field": "label",
                     "user_field": "person", "feature_fields": ["x1", "x2"], "max_examples_per_user": 4,
                     "test_fraction": 0.25},
            "model": {"kind": "mlp", "hidden": [8]},
            "training": {"steps": 2, "batch_size": 10, "optimizer": {"kind": "sgd", "lr": 0.5}},
            "privacy": {"unit": "user", "epsilon": 8.0, "delta": 1e-4, "accountant": "rdp"},
            "tuning": {"score": "private", "score_noise": 20.0}}
    recipe = validate_recipe(base)
    grid = ["training.optimizer.lr=0.1,0.5"]
    report = tune_cost(base, recipe, grid=grid, timer=StepTimer(fixed_seconds=0.01))
    summary = run_search(base, recipe, report, grid=grid)
    lines = "\n".join(search_statement_lines(Path(summary["search_dir"])))
    assert "user-level" in lines and "add/remove all records of one person" in lines
    assert "Σ over held-out people of each one's accuracy" in lines and "example-level" not in lines
    assert "held-out people" in summary["score_meaning"]


def test_the_user_level_score_sums_each_held_out_persons_accuracy(tmp_path):
    """Against a count of correct records, which one person with many held-out records moves by as many."""
    import random

    import numpy as np
    import torch

    from dpclip.data import load_data
    from dpclip.models import build_model
    from dpclip.tuning.search import held_out_people_accuracy
    rng = random.Random(1)
    rows = ["person,x1,x2,label"]
    for person in range(40):
        for _ in range(1 + (person % 5) * 6):   # 1 to 25 records each
            label = rng.randint(0, 1)
            rows.append(f"p{person},{rng.gauss(label, 1):.4f},{rng.gauss(-label, 1):.4f},{label}")
    (tmp_path / "data.csv").write_text("\n".join(rows) + "\n")
    recipe = validate_recipe({
        "name": "people", "data": {"source": "files", "format": "csv", "train": str(tmp_path / "data.csv"),
                                   "label_field": "label", "user_field": "person", "feature_fields": ["x1", "x2"],
                                   "max_examples_per_user": 4, "test_fraction": 0.5},
        "model": {"kind": "mlp", "hidden": [4]}, "training": {"steps": 1, "batch_size": 10,
                                                              "optimizer": {"kind": "sgd", "lr": 0.1}},
        "privacy": {"unit": "user", "epsilon": 8.0, "delta": 1e-4}})
    data = load_data(recipe.data, seed=0, split_key=7)
    model, loss_fn = build_model(recipe.model, data, seed=0)
    total, people = held_out_people_accuracy(model, loss_fn, data, batch_size=16)
    # the reference: each held-out record's prediction, averaged per person, summed
    with torch.no_grad():
        correct = (model(data.test["features"]).argmax(1) == data.test["labels"]).double().numpy()
    owners = data.test_users.numpy()
    reference = sum(correct[owners == p].mean() for p in np.unique(owners))
    assert people == len(np.unique(owners)) and total == pytest.approx(reference)
    assert correct.sum() != pytest.approx(reference)   # a record count would be another number here


def test_a_blt_search_is_refused_before_any_trial_trains(tiny, monkeypatch, public_held_out):
    """The search directory's reader (its ledger, statement and the selected run's headline ε) knows
    Poisson-sampled and banded-MF runs only: a BLT search used to train all K trials and then fail,
    leaving the selected run with a search.json but its own, smaller ε in its summary.json."""
    import dpclip.train.workflow as workflow

    base, recipe = tiny(*public_held_out, "tuning.score=public", "privacy.accountant=rdp", "training.steps=12",
                        "privacy.mechanism={kind: blt, buffers: 2}")
    grid = ["training.optimizer.lr=0.1,0.5"]
    report = tune_cost(base, recipe, grid=grid, timer=StepTimer(fixed_seconds=0.01))
    started = []

    def train(trial, *, data=None, run_dir=None, **kwargs):
        started.append(run_dir)
        raise AssertionError("a trial trained")

    monkeypatch.setattr(workflow, "train", train)
    with pytest.raises(DpclipError, match="BLT") as refused:
        run_search(base, recipe, report, grid=grid)
    assert "hint" not in refused.value.message and refused.value.hint
    assert started == [] and not Path(recipe.output_dir).exists()   # nothing trained, no search directory


@pytest.mark.slow   # a banded plan's RDP calibration, then one trial
def test_a_banded_searchs_statement_names_its_cyclic_groups_and_steps(tiny, monkeypatch, public_held_out):
    """A banded-MF run takes T steps over b cyclic groups at q·b; its search's statement said
    'sampling: Poisson' at rate q·b and counted ⌈T/b⌉ participations as its steps."""
    import dpclip.accounting.tuning as tuning_math
    from dpclip.rundir.searchdir import search_statement_lines

    monkeypatch.setattr(tuning_math, "draw_trial_count", lambda mean, shape, rng: 1)
    base, recipe = tiny(*public_held_out, "tuning.score=public", "privacy.accountant=pld", "privacy.epsilon=2",
                        "training.steps=6",
                        "privacy.mechanism={kind: banded-mf, bands: 3}")   # PLD and a small ε: quicker to calibrate
    grid = ["training.optimizer.lr=0.1,0.5"]
    report = tune_cost(base, recipe, grid=grid, timer=StepTimer(fixed_seconds=0.01))
    summary = run_search(base, recipe, report, grid=grid)
    lines = search_statement_lines(Path(summary["search_dir"]))
    q = report.plan.sample_rate
    sampling = next(line for line in lines if line.startswith("sampling:"))
    assert "cyclic Poisson over 3 groups" in sampling and f"{q:.6g}" in sampling
    assert "steps: 6" in lines
    assert any(line.startswith("mechanism: banded matrix factorization, 3 bands") and "accounted as 2 participations"
               in line for line in lines)
    assert not any("each run: 2 Poisson-sampled steps" in line for line in lines)

    # A search that failed has no selected run to read: its ledger's metadata says the same.
    import dpclip.train.workflow as workflow

    def crash(trial, *, data=None, run_dir=None, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(workflow, "train", crash)
    before = set(Path(recipe.output_dir).iterdir())
    with pytest.raises(RuntimeError, match="disk full"):
        run_search(base, recipe, report, grid=grid)
    failed, = set(Path(recipe.output_dir).iterdir()) - before
    def shape(found):
        return [line for line in found if line.startswith(("sampling:", "steps:", "mechanism:"))]

    assert shape(search_statement_lines(failed)) == shape(lines)


def test_a_search_of_one_configuration_is_refused_with_a_hint_to_give_it_a_space(tiny, public_held_out):
    """An empty space (no grid, no ranges) is one configuration: E[K] = 1 leaves repeat-and-select
    nothing to select, and 'search fewer configurations' was the hint."""
    base, recipe = tiny(*public_held_out, "tuning.score=public", "privacy.accountant=rdp")
    report = tune_cost(base, recipe, timer=StepTimer(fixed_seconds=0.01))
    assert report.configurations == 1
    with pytest.raises(DpclipError, match="1 configuration") as refused:
        run_search(base, recipe, report)
    assert "fewer configurations" not in refused.value.hint
    assert "tuning.grid" in refused.value.hint and "tuning.trials_mean" in refused.value.hint
    assert not Path(recipe.output_dir).exists()   # refused before any search directory


@pytest.mark.slow   # prices a search (about 5 s on 2 busy cores)
@pytest.mark.parametrize("mismatch", ["dataset_size", "recipe"])
def test_a_report_priced_for_other_runs_is_refused_before_the_search_charges_or_trains(tmp_path, mismatch, monkeypatch,
                                                                                        public_held_out):
    """run_search (Python API) took the report's σ and E[K] on trust: a report priced at another N or for
    another recipe wrote its charge, then trained a first trial whose steps it did not charge."""
    import dpclip.train.workflow as workflow

    def make(*overrides):
        base = apply_overrides(read_yaml(REPO / "recipes" / "quickstart.yaml"),
                               [f"output_dir={tmp_path}", "training.epochs=null", "model.hidden=[8]",
                                "privacy.accountant=rdp", *public_held_out, "tuning.score=public", *overrides])
        return base, validate_recipe(base)

    base, recipe = make("training.steps=2")
    priced_base, priced = make("training.steps=3") if mismatch == "recipe" else (base, recipe)
    grid = ["training.optimizer.lr=0.1,0.5"]
    report = tune_cost(priced_base, priced, grid=grid, timer=StepTimer(fixed_seconds=0.01),
                       dataset_size=5000 if mismatch == "dataset_size" else None)
    monkeypatch.setattr(workflow, "train", lambda *args, **kwargs: pytest.fail("a trial trained"))
    with pytest.raises(DpclipError, match="priced") as info:
        run_search(base, recipe, report, grid=grid)
    assert "tune_cost" in info.value.hint
    assert not list(tmp_path.glob("*-search-*"))   # no ledger written, nothing charged


def test_run_search_refuses_a_public_score_on_held_out_rows_cut_from_the_private_data(tiny, monkeypatch):
    """validate_recipe refuses tuning.score: public without a separate held-out set; a recipe
    changed past it (model_copy does not validate) was searched, its exact private held-out
    accuracy selected on and released uncharged."""
    import dpclip.train.workflow as workflow

    base, checked = tiny("privacy.accountant=rdp")
    recipe = checked.model_copy(update={"tuning": checked.tuning.model_copy(update={"score": "public"})})
    grid = ["training.optimizer.lr=0.1,0.5"]
    report = tune_cost(base, recipe, grid=grid, timer=StepTimer(fixed_seconds=0.01))
    assert report.privacy.score_noise is None   # priced as a public score
    monkeypatch.setattr(workflow, "train", lambda *args, **kwargs: pytest.fail("a trial trained"))
    with pytest.raises(DpclipError, match="held-out rows are private") as refused:
        run_search(base, recipe, report, grid=grid)
    assert "data.test" in refused.value.hint and "tuning.score: private" in refused.value.hint
    assert not Path(recipe.output_dir).exists()   # refused before the search directory: nothing charged
