import json
import math
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting import rdp

from dpclip.accounting import Ledger
from dpclip.accounting import solve as solve_plan
from dpclip.planning.plan import plan_for_recipe
from dpclip.recipe import apply_overrides, read_yaml, validate_recipe

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
TINY = ["training.epochs=null", "training.steps=3", "model.hidden=[8]", "privacy.accountant=rdp"]
NO_MEASURE = ["--no-measure", "--step-seconds", "0.05"]

# DC-SGD's MNIST setting (paper §VI, docs/tuning.md): N = 60000, B = 256, 10 epochs, ε = 2,
# 10 configurations, δ₂ = 1e-20, γ = 1/(2G). δ = 1/N is refused by dpclip (δ must be below
# 1/N), so δ is the largest 5-digit value below it.
MNIST_N, MNIST_B, MNIST_EPOCHS, MNIST_EPS, MNIST_DELTA = 60000, 256, 10, 2.0, 1.6666e-5
C_GRID = "clipping.threshold.value=0.1,0.2,0.5,0.8,1,2,4,6,8,10"


def run_json(cli, *args):
    result = cli("tune-cost", *args, "--json")
    assert result.code == 0, result.err
    return json.loads(result.out)


def test_liu_talwar_per_run_budget_and_sigma_for_dc_sgds_mnist_setting(cli, public_held_out):
    report = run_json(cli, QUICKSTART, f"training.batch_size={MNIST_B}", f"training.epochs={MNIST_EPOCHS}",
                      f"privacy.epsilon={MNIST_EPS}", f"privacy.delta={MNIST_DELTA}", "privacy.accountant=rdp",
                      *public_held_out, "tuning.score=public", "--grid", C_GRID, "-N", MNIST_N, *NO_MEASURE)
    lt = next(s for s in report["privacy"]["strategies"] if s["name"] == "liu-talwar")

    # Liu–Talwar (DC-SGD Theorem 1) solved by hand with the whole δ spent.
    configurations = 10
    gamma = 1 / (2 * configurations)
    max_runs = math.log(1 / 1e-20) / gamma
    root = (MNIST_DELTA - 1e-20) / (3 * max_runs)          # √(2δ₁)
    delta_run = root ** 2 / 2
    epsilon_run = (MNIST_EPS - 3 * root) / 3
    assert report["configurations"] == configurations
    assert lt["detail"]["max_runs"] == pytest.approx(max_runs, rel=1e-12)
    assert lt["detail"]["delta_run"] == pytest.approx(delta_run, rel=1e-9)
    assert lt["detail"]["epsilon_run"] == pytest.approx(epsilon_run, rel=1e-9)

    # The per-run σ, checked with dp_accounting called directly: ε₁ within 1% below target.
    q = MNIST_B / MNIST_N
    steps = math.ceil(MNIST_EPOCHS * MNIST_N / MNIST_B)
    assert report["privacy"]["steps"] == steps
    run = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(lt["noise_multiplier"])), steps)
    achieved = rdp.RdpAccountant().compose(run).get_epsilon(delta_run)
    assert 0.99 * epsilon_run <= achieved <= epsilon_run


def test_compute_is_runs_times_steps_times_step_seconds(cli):
    report = run_json(cli, QUICKSTART, *TINY, "--grid", "training.optimizer.lr=0.1,0.2,0.5", *NO_MEASURE)
    compute = report["compute"]
    assert compute["measured"] is False
    assert compute["search_hours"] == pytest.approx(3 * 3 * 0.05 / 3600)


@pytest.mark.slow   # 4-7 s: the default run keeps under 10 minutes
def test_compare_measures_steps_and_shows_what_dcsgd_e_saves_over_a_c_grid(cli, tmp_path, public_held_out):
    from dpclip.engine.policies import threshold_kinds

    out = tmp_path / "tune_cost.json"
    shown = cli("tune-cost", QUICKSTART, *TINY, *public_held_out, "tuning.score=public", "--compare",
                "--calibration-steps", "2", "--warmup-steps", "1", "--out", out)
    assert shown.code == 0, shown.err
    report = json.loads(out.read_text())
    rows = {row["method"]: row for row in report["comparison"]}
    assert report["compute"]["measured"] is True
    assert rows["fixed"]["runs"] == 10
    method = "dcsgd-e" if "dcsgd-e" in threshold_kinds() else "auto"
    assert rows[method]["runs"] == 1
    assert rows[method]["step_seconds"] > 0
    assert rows[method]["speedup_vs_fixed"] == pytest.approx(rows["fixed"]["search_hours"] /
                                                             rows[method]["search_hours"])
    assert method in shown.out and "speedup" in shown.out


def test_out_writes_the_json_report(cli, tmp_path):
    out = tmp_path / "tune_cost.json"
    result = cli("tune-cost", QUICKSTART, *TINY, *NO_MEASURE, "--out", out)
    assert result.code == 0, result.err
    assert "repeat-and-select" in result.out
    assert json.loads(out.read_text())["configurations"] == 1


def test_run_writes_a_search_whose_ledger_spends_what_was_promised(cli, tmp_path, public_held_out):
    report = run_json(cli, QUICKSTART, *TINY, f"output_dir={tmp_path}", *public_held_out, "tuning.score=public",
                      "--grid", "training.optimizer.lr=0.1,0.5", *NO_MEASURE, "--run")
    promised = next(s for s in report["privacy"]["strategies"] if s["name"] == "repeat-and-select")
    search = report["search"]
    ledger = Ledger.from_dict(json.loads((Path(search["search_dir"]) / "ledger.json").read_text()))
    assert ledger.epsilon() == pytest.approx(promised["epsilon"], rel=1e-12)
    assert ledger.epsilon() <= 8.0
    summary = json.loads((Path(search["search_dir"]) / "summary.json").read_text())
    assert summary["selected_run"] == search["selected_run"]


@pytest.mark.parametrize("args, message", [
    (["--grid", "training.optimizr.lr=0.1"], "training.optimizr"),
    (["--grid", "training.optimizer.lr=0.1,-1"], "lr"),
    (["--grid", "privacy.epsilon=1,2"], "cannot vary"),
    (["--grid", "training.optimizer.lr=0.1,0.1,0.2"], "more than once"),   # once trained 0.1 twice, charged 3 runs
    (["privacy.epsilon=1e-9"], "ε"),
    (["--no-measure"], "--step-seconds"),
    (["--step-seconds", "0.1"], "--no-measure"),
    # an infinite step or run time priced every search at "inf h" and exited 0
    (["--no-measure", "--step-seconds", "inf"], "--step-seconds"),
    (["--no-measure", "--step-seconds", "0.1", "--run-seconds", "inf"], "--run-seconds"),
])
def test_bad_input_is_an_error_with_a_hint_and_no_traceback(cli, args, message):
    extra = [] if "--no-measure" in args or "--step-seconds" in args else NO_MEASURE
    result = cli("tune-cost", QUICKSTART, *TINY, *args, *extra)
    assert result.code == 2
    assert "error:" in result.err and message in result.err and "hint:" in result.err
    assert "Traceback" not in result.err + result.out


def test_a_shuffled_search_is_priced_with_the_poisson_caveat(cli):
    """tune-cost accounts shuffled batches as if Poisson: its table and its JSON say so, as the run
    statements do (never a bare ε for a shuffled loader)."""
    from dpclip.accounting.statement import SHUFFLE_CAVEAT

    args = (QUICKSTART, *TINY, "training.sampling=shuffle", "--grid", "training.optimizer.lr=0.1,0.5", *NO_MEASURE)
    report = run_json(cli, *args)
    assert report["privacy"]["sampling"] == "shuffle"
    assert report["privacy"]["caveats"] == [SHUFFLE_CAVEAT]
    assert "as if Poisson" in report["privacy"]["sampling_assumption"]
    shown = cli("tune-cost", *args)
    assert shown.code == 0, shown.err
    text = " ".join(shown.out.split())
    assert f"CAVEAT: {SHUFFLE_CAVEAT}" in text and "accounted as if Poisson-subsampled" in text
    poisson = run_json(cli, QUICKSTART, *TINY, "--grid", "training.optimizer.lr=0.1,0.5", *NO_MEASURE)
    assert poisson["privacy"]["sampling"] == "poisson" and poisson["privacy"]["caveats"] == []


def test_a_user_level_search_says_its_private_score_sums_each_held_out_persons_accuracy(cli, tmp_path):
    """At user level the score is not a count of correct records: the console says what it is, as
    summary.json does."""
    from dpclip.rundir.searchdir import SCORE_MEANING

    rows = ["person,x1,label"] + [f"p{i % 30},{i / 10},{i % 2}" for i in range(90)]
    (tmp_path / "people.csv").write_text("\n".join(rows) + "\n")
    recipe = tmp_path / "users.yaml"
    recipe.write_text(
        f"name: users\noutput_dir: {tmp_path / 'runs'}\n"
        "data: {source: files, format: csv, train: people.csv, label_field: label, user_field: person, "
        "max_examples_per_user: 3}\nmodel: {kind: mlp, hidden: [4]}\n"
        "training: {epochs: 1, batch_size: 8, optimizer: {kind: sgd, lr: 0.1}}\n"
        "privacy: {epsilon: 8.0, delta: 1.0e-3, unit: user, accountant: rdp}\n")
    args = (recipe, "--grid", "training.optimizer.lr=0.1,0.2", *NO_MEASURE)
    shown = cli("tune-cost", *args)
    assert shown.code == 0, shown.err
    text = " ".join(shown.out.split())
    assert "noisy held-out count" not in text and SCORE_MEANING["user"] in text
    assert run_json(cli, *args)["privacy"]["score_meaning"] == SCORE_MEANING["user"]


def test_tune_cost_run_searches_a_hugging_face_data_set_it_counts_by_loading(cli, tmp_path, monkeypatch):
    """A hub data set's size is known once loaded: --run loads it (it trains on it anyway) rather than
    asking for --dataset-size, which it refuses."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(f'{{"x1": {i / 10}, "x2": {-i / 10}, "label": {i % 2}}}\n'
                                                for i in range(80)))
    (folder / "test.jsonl").write_text("".join(f'{{"x1": {i / 10}, "x2": {i / 10}, "label": {i % 2}}}\n'
                                               for i in range(20)))   # the public held-out split
    recipe = tmp_path / "hf.yaml"
    recipe.write_text(
        f"name: hf\noutput_dir: {tmp_path / 'runs'}\n"
        f"data: {{source: hf, name: {folder}, split: train, test_split: test, label_field: label}}\n"
        "model: {kind: mlp, hidden: [4]}\n"
        "training: {epochs: null, steps: 2, batch_size: 8, optimizer: {kind: sgd, lr: 0.1}}\n"
        "privacy: {epsilon: 8.0, delta: 1.0e-3, accountant: rdp}\n"
        "tuning: {score: public, trials_mean: 2}\n")
    report = run_json(cli, recipe, "--grid", "training.optimizer.lr=0.1,0.2", "--run", *NO_MEASURE)
    assert report["dataset_size"] == 80 and report["search"]["stopped"] == "completed"
    refused = cli("tune-cost", recipe, "--grid", "training.optimizer.lr=0.1,0.2", *NO_MEASURE)
    assert refused.code == 2 and "tune-cost --run" in refused.err


@pytest.mark.parametrize("mechanism, sampling", [("{kind: banded-mf, bands: 2}", "cyclic-poisson"),
                                                 ("{kind: blt, buffers: 2}", "cyclic")])
def test_a_correlated_noise_search_names_its_cyclic_sampling(cli, mechanism, sampling):
    """tune-cost --json's `sampling` says what the runs do (groups in turn), as its assumption does,
    not the loader's `training.sampling: poisson`."""
    report = run_json(cli, QUICKSTART, *TINY, f"privacy.mechanism={mechanism}", "--grid",
                      "training.optimizer.lr=0.1,0.5", *NO_MEASURE)
    assert report["privacy"]["sampling"] == sampling
    assert report["privacy"]["sampling_assumption"].startswith("cyclic")


@pytest.mark.parametrize("name", ["ledger.json", "new.json", "checkpoints/x.json"])
def test_an_out_inside_a_run_directory_is_refused_before_pricing_and_the_runs_files_are_kept(cli, tmp_path, name):
    # `tune-cost RECIPE --out RUN/ledger.json` replaced the run's ledger with the JSON result, exit 0
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for file, text in (("recipe.yaml", QUICKSTART.read_text()), ("meta.json", "{}"), ("ledger.json", '{"steps": 0}')):
        (run / file).write_text(text)
    result = cli("tune-cost", QUICKSTART, "--no-measure", "--step-seconds", "0.01", "--out", run / name)
    assert result.code == 2 and "inside the run directory" in result.err and "hint:" in result.err
    assert (run / "ledger.json").read_text() == '{"steps": 0}' and not (run / "new.json").exists()


def test_an_out_that_is_the_recipe_being_priced_is_refused(cli, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(QUICKSTART.read_text())
    result = cli("tune-cost", recipe, "--no-measure", "--step-seconds", "0.01", "--out", recipe)
    assert result.code == 2 and "the recipe being priced" in result.err and "hint:" in result.err
    assert recipe.read_text() == QUICKSTART.read_text()


def test_the_recipes_sigma_rows_name_the_gradients_share_of_it_beside_a_threshold_statistic(cli,
                                                                                           public_held_out):
    # DC-SGD-P's histogram (σ_a fixed) takes part of the recipe's σ_eff: the "σ gradient" column of
    # the two "recipe's σ" rows was empty, as if the gradient had all of it.
    recipe_path = REPO / "recipes" / "dcsgd-p-digits.yaml"
    overrides = [*public_held_out, "tuning.score=public", "training.epochs=null", "training.steps=20", "privacy.accountant=rdp"]
    result = cli("tune-cost", recipe_path, *overrides, *NO_MEASURE, "--grid", "training.optimizer.lr=0.1,0.5")
    assert result.code == 0, result.err
    split = solve_plan(plan_for_recipe(validate_recipe(apply_overrides(read_yaml(recipe_path), overrides)))).split
    assert split.gradient_noise_multiplier > split.noise_multiplier
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in result.out.splitlines()
            if "recipe's σ" in line]
    assert len(rows) == 2
    for row in rows:
        assert row[1:3] == [f"{split.noise_multiplier:.4g}", f"{split.gradient_noise_multiplier:.4g}"]
