"""`dpclip diagnose RECIPE|RUN_DIR`."""

import json
from pathlib import Path

import pytest

from dpclip.recipe import load_recipe
from dpclip.train.workflow import train

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
FAST = ("--probes", "3", "--per-sample", "3", "--batch-size", "16", "--threads", "1")
PRIVATE = ("--data", "private", "--allow-private-not-covered-by-epsilon")
PLOTS = ("hessian_over_training.png", "improvement_vs_batch.png")


def _pngs(folder: Path) -> bool:
    return all((folder / name).read_bytes()[:4] == b"\x89PNG" for name in PLOTS)


def test_diagnose_a_recipe_prints_the_table_and_writes_both_plots(cli, tmp_path):
    result = cli("diagnose", QUICKSTART, "training.batch_size=32", *FAST, *PRIVATE, "--out", tmp_path / "plots")
    assert result.code == 0, result.err
    out = " ".join(result.out.split())  # rich wraps long lines
    assert "Hessian diagnostics at initial weights, private data, not covered by ε" in out
    for row in ("tr(H)", "GᵀHG", "tr(HΣ)", "|G|²", "E‖g_i‖²", "σ (gradient noise multiplier)", "decelerator",
                "B*_DP", "ΔL*(B = 32)", "c (typical clip factor)"):
        assert row in out
    assert "α*" not in out  # no public data
    assert _pngs(tmp_path / "plots")
    assert "improvement_vs_batch.png (not covered by ε)" in out


def test_diagnose_json_reports_the_formulas_at_the_recipes_sigma(cli, tmp_path):
    result = cli("diagnose", QUICKSTART, *FAST, *PRIVATE, "--out", tmp_path, "--json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert payload["covered_by_epsilon"] is False and payload["data"] == "private"
    assert payload["step"] == 0 and payload["batch_size"] == 16 and payload["batch_size_dp"] == 64
    sigma, c, b = payload["gradient_noise_multiplier"], payload["clip_factor"], payload["batch_size_dp"]
    assert payload["decelerator"] == pytest.approx(sigma ** 2 * payload["trace_h"] / (b * c ** 2))
    account = cli("account", QUICKSTART, "--json")   # the same σ the trainer calibrates
    noise = json.loads(account.out)["noise"]
    assert sigma == pytest.approx(noise["gradient_noise_multiplier"], rel=1e-9)
    assert payload["noise_multiplier"] == pytest.approx(noise["noise_multiplier"], rel=1e-9)  # the total


@pytest.mark.parametrize("args, expected", [
    (("--data", "private"), "not covered by ε"),
    ((), "no public data"),
])
def test_diagnose_refuses_without_consent_or_public_data(cli, tmp_path, args, expected):
    result = cli("diagnose", QUICKSTART, *FAST, *args, "--out", tmp_path)
    assert result.code != 0
    assert "error: " in result.err and expected in " ".join(result.err.split())
    assert "hint:" in result.err and "Traceback" not in result.err + result.out
    assert not (tmp_path / PLOTS[0]).exists()


@pytest.fixture(scope="module")
def run_with_diagnostics(tmp_path_factory):
    output = tmp_path_factory.mktemp("runs")
    recipe = load_recipe(QUICKSTART, [
        f"output_dir={output}", "training.epochs=null", "training.steps=6", "checkpoint.every_steps=null",
        "diagnostics.every_steps=3", "diagnostics.probes=2", "diagnostics.per_sample=2",
        "diagnostics.data=private", "diagnostics.private_not_covered=true"])
    return train(recipe).run_dir


def test_diagnose_a_run_on_private_data_plots_its_history_outside_the_run(cli, run_with_diagnostics, one_thread,
                                                                             tmp_path, monkeypatch):
    """Private measurements never go into the run directory: the run's files are released
    beside its statement, which lists what the run released outside ε, not later measurements."""
    monkeypatch.chdir(tmp_path)
    before = {p.name: p.read_bytes() for p in run_with_diagnostics.iterdir() if p.is_file()}
    result = cli("diagnose", run_with_diagnostics, *FAST)   # the run's recipe gave the consent
    assert result.code == 0, result.err
    out = " ".join(result.out.split())
    assert "at checkpoint step 6, private data, not covered by ε" in out
    assert "1 earlier measurements from diagnostics.jsonl" in out   # step 3; step 6 is measured anew
    assert _pngs(tmp_path / "diagnose-quickstart")
    assert {p.name: p.read_bytes() for p in run_with_diagnostics.iterdir() if p.is_file()} == before


def test_diagnose_refuses_to_write_private_plots_into_a_run_directory(cli, run_with_diagnostics):
    for out in (run_with_diagnostics, run_with_diagnostics / "plots"):
        result = cli("diagnose", run_with_diagnostics, *FAST, "--out", out)
        assert result.code != 0 and "error: " in result.err and "inside the run directory" in result.err
        assert "hint:" in result.err and "Traceback" not in result.err + result.out
    assert not (run_with_diagnostics / "plots").exists() and not (run_with_diagnostics / PLOTS[1]).exists()


def test_diagnose_run_from_inside_a_run_directory_does_not_write_private_plots_there(cli, run_with_diagnostics,
                                                                                      monkeypatch):
    monkeypatch.chdir(run_with_diagnostics)          # the default ./diagnose-NAME/ is then inside the run
    result = cli("diagnose", ".", *FAST)
    assert result.code != 0 and "inside the run directory" in result.err and "hint:" in result.err
    assert not (run_with_diagnostics / "diagnose-quickstart").exists()


def test_diagnose_a_run_refuses_overrides(cli, run_with_diagnostics):
    result = cli("diagnose", run_with_diagnostics, "training.batch_size=8")
    assert result.code != 0 and "overrides" in result.err and "Traceback" not in result.err


def test_diagnose_refuses_more_threads_than_the_machine_has_cpus(cli, monkeypatch):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    result = cli("diagnose", REPO / "recipes" / "quickstart.yaml", "--threads", "3", "--probes", "2",
                 "--per-sample", "2", "--batch-size", "4", "--json")
    assert result.code == 2 and "logical CPUs" in result.err and "hint:" in result.err


def _another_run(folder: Path) -> Path:
    """A folder that is a run directory by its files (recipe.yaml and meta.json), with a ledger."""
    folder.mkdir()
    for name, text in (("recipe.yaml", QUICKSTART.read_text()), ("meta.json", "{}"), ("ledger.json", '{"steps": 0}')):
        (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize("where", ["the run", "a folder in it", "a file in it"])
def test_diagnose_refuses_an_out_inside_another_run_directory_and_keeps_its_files(cli, tmp_path, where):
    # public-data plots of a recipe went into another run's directory, replacing that run's own
    # hessian_over_training.png; --out RUN/meta.json was "unexpected FileExistsError"
    run = _another_run(tmp_path / "run")
    (run / "checkpoints").mkdir()
    out = {"the run": run, "a folder in it": run / "checkpoints", "a file in it": run / "meta.json"}[where]
    result = cli("diagnose", REPO / "recipes" / "continual-cnn-digits.yaml", *FAST, "--out", out)
    assert result.code == 2 and "hint:" in result.err and "unexpected" not in result.err, result.err
    assert sorted(p.name for p in run.rglob("*")) == ["checkpoints", "ledger.json", "meta.json", "recipe.yaml"]
    assert (run / "meta.json").read_text() == "{}"
