import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def short(tmp_path, *extra):
    return [QUICKSTART, f"output_dir={tmp_path / 'runs'}", "training.epochs=null", "training.steps=6",
            "checkpoint.every_steps=3", *extra]


def test_train_json_summary_and_account_run_dir_agree(cli, tmp_path):
    result = cli("train", *short(tmp_path), "--json")
    assert result.code == 0, result.err
    summary = json.loads(result.out)
    assert summary["steps_done"] == 6 and summary["stopped"] == "completed"
    assert "accuracy" in summary["final_eval"]
    spent = cli("account", summary["run_dir"], "--json")
    assert spent.code == 0, spent.err
    ledger = json.loads(spent.out)["ledger"]
    assert ledger["steps"] == 6 and ledger["epsilon"] == pytest.approx(summary["epsilon"])
    text = cli("account", summary["run_dir"])
    assert "6 steps recorded" in text.out and "example-level" in text.out


def test_train_shows_progress_and_a_summary(cli, tmp_path):
    result = cli("train", *short(tmp_path))
    assert result.code == 0, result.err
    for fragment in ("planned ε", "summary", "ε spent", "test accuracy", "statement"):
        assert fragment in result.out


def test_a_budget_cap_that_stops_before_the_first_step_says_so(cli, tmp_path):
    result = cli("train", *short(tmp_path, "privacy.noise_multiplier=0.3", "privacy.epsilon=0.5"))
    assert result.code == 0, result.err
    assert "budget" in result.out and "0 / 6" in result.out
    assert "warning:" in result.out and "no step was taken" in result.out


def test_dry_run_prints_the_plan_and_creates_no_run(cli, tmp_path):
    result = cli("train", *short(tmp_path), "--dry-run")
    assert result.code == 0, result.err
    assert "planned ε" in result.out and not (tmp_path / "runs").exists()


def test_resume_continues_a_finished_run_without_new_steps(cli, tmp_path):
    summary = json.loads(cli("train", *short(tmp_path), "--json").out)
    again = cli("train", "--resume", summary["run_dir"], "--json")
    assert again.code == 0, again.err
    assert json.loads(again.out)["steps_done"] == 6


def test_shuffle_sampling_run_carries_the_caveat(cli, tmp_path):
    summary = json.loads(cli("train", *short(tmp_path, "training.sampling=shuffle"), "--json").out)
    assert any("assumes poisson" in line.lower() for line in summary["statement"])


def test_checkpoints_hold_no_pickles(cli, tmp_path):
    summary = json.loads(cli("train", *short(tmp_path), "--json").out)
    files = {p.suffix for p in Path(summary["run_dir"]).rglob("*") if p.is_file()}
    assert files <= {".yaml", ".json", ".jsonl", ".safetensors", ".png", ""}, files


@pytest.mark.parametrize("args, fragment", [
    (["train", "missing.yaml"], "not found"),
    (["train", QUICKSTART, "data.name=mnist"], "data.name"),
    (["train", QUICKSTART, "data={source: files, format: csv, train: /nope/train.csv}"], "not found"),
    (["train", QUICKSTART, "training.batch_size=100000"], "exceeds"),
    (["train", QUICKSTART, "privacy.delta=0.01"], "1/N"),
    (["train", "--resume", "/nope/run"], "run directory not found"),
    (["train"], "nothing to train"),
    (["train", QUICKSTART, "clipping.grouping=block"], "block"),
])
def test_bad_training_input_gives_error_and_hint_without_traceback(cli, tmp_path, args, fragment):
    if len(args) > 1 and args[1] == QUICKSTART:
        args = [*args, f"output_dir={tmp_path / 'runs'}"]
    result = cli(*args)
    assert result.code == 2, (result.out, result.err)
    assert result.err.startswith("error: ") and "\nhint: " in result.err
    assert fragment.lower() in result.err.lower() and "Traceback" not in result.err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # an end-to-end resume (5 s); tests/privacy/test_crash_and_resume.py stays in the default run
def test_resume_with_overrides_applies_non_privacy_fields_and_says_which(cli, tmp_path):
    summary = json.loads(cli("train", *short(tmp_path), "--json").out)
    run_dir = Path(summary["run_dir"])
    again = cli("train", "--resume", run_dir, "training.optimizer.lr=0.1", "eval.batch_size=32")
    assert again.code == 0, again.err
    assert "changed fields" in again.out and "training.optimizer.lr 0.5 -> 0.1" in again.out
    assert "eval.batch_size 256 -> 32" in again.out
    from dpclip.recipe import load_recipe

    assert load_recipe(run_dir / "recipe.yaml").training.optimizer.lr == 0.1
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["resumes"] == [{"step": 6, "changes": {"eval.batch_size": [256, 32],
                                                       "training.optimizer.lr": [0.5, 0.1]}}]
    assert cli("account", run_dir, "--json").code == 0, "the privacy fingerprint did not move"


@pytest.mark.parametrize("override, fragment", [
    ("privacy.epsilon=4", "privacy.epsilon"), ("training.steps=12", "training.steps"),
    pytest.param("model.hidden=[8]", "model", marks=pytest.mark.slow),  # each case a run: two in the default
    pytest.param("training.optimizer.lr=-1", "training.optimizer.lr", marks=pytest.mark.slow)])
def test_resume_refuses_overrides_of_privacy_fields_and_the_model_with_a_hint(cli, tmp_path, override, fragment):
    summary = json.loads(cli("train", *short(tmp_path), "--json").out)
    before = (Path(summary["run_dir"]) / "recipe.yaml").read_text()
    result = cli("train", "--resume", summary["run_dir"], override)
    assert result.code == 2, (result.out, result.err)
    assert result.err.startswith("error: ") and "\nhint: " in result.err and "Traceback" not in result.err
    assert fragment in result.err
    assert (Path(summary["run_dir"]) / "recipe.yaml").read_text() == before


def test_overriding_the_epochs_says_how_sigma_moved_at_fixed_epsilon(cli, tmp_path):
    result = cli("train", QUICKSTART, f"output_dir={tmp_path / 'runs'}", "training.epochs=3", "--dry-run")
    assert result.code == 0, result.err
    # the recipe's target, not the calibrated ε (7.96 here: calibration lands within 1% below it)
    assert "training.epochs 30 -> 3: σ" in result.out and "for ε = 8 (ε stays fixed" in result.out
    summary = json.loads(cli("train", QUICKSTART, f"output_dir={tmp_path / 'runs'}", "training.epochs=1",
                             "privacy.exact_diagnostics=false", "--dry-run", "--json").out)
    change = summary["sigma_change"]   # a privacy field that does not move σ is not named as its cause
    assert change["changed"] == {"training.epochs": [30.0, 1.0]} and change["calibrated"]
    assert change["sigma"] < change["sigma_file"]  # fewer steps at the same ε: less noise per step
    plain = json.loads(cli("train", QUICKSTART, f"output_dir={tmp_path / 'runs'}", "training.optimizer.lr=0.1",
                           "--dry-run", "--json").out)
    assert plain["sigma_change"] is None


def test_switching_the_mechanism_names_a_field_dp_sgd_lacks_as_unset(cli, tmp_path):
    result = cli("train", QUICKSTART, f"output_dir={tmp_path / 'runs'}", "privacy.mechanism.kind=banded-mf",
                 "privacy.mechanism.bands=4", "training.epochs=10", "--dry-run")
    assert result.code == 0, result.err
    assert "privacy.mechanism.bands unset -> 4" in result.out and "None" not in result.out


def test_overriding_the_steps_at_a_given_sigma_says_how_epsilon_moved(cli, tmp_path):
    result = cli("train", QUICKSTART, f"output_dir={tmp_path / 'runs'}", "privacy.epsilon=null",
                 "privacy.noise_multiplier=1.0", "training.batch_size=32", "--dry-run", "--json")
    assert result.code == 0, result.err
    change = json.loads(result.out)["sigma_change"]
    assert not change["calibrated"] and change["changed"]["training.batch_size"] == [64, 32]
    assert change["epsilon"] != change["epsilon_file"]


def test_threads_option_sets_torch_threads(cli, tmp_path):
    import torch

    before = torch.get_num_threads()
    try:
        result = cli("train", *short(tmp_path), "--threads", "1", "--dry-run")
        assert result.code == 0, result.err
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    for bad_count in ("0", "many"):
        bad = cli("train", *short(tmp_path), "--threads", bad_count, "--dry-run")
        assert bad.code != 0 and "error:" in bad.err and "hint:" in bad.err and "Traceback" not in bad.err


def test_resume_without_threads_reuses_the_count_the_run_started_with(cli, tmp_path, monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        result = cli("train", *short(tmp_path), "--threads", "1", "--json")
        assert result.code == 0, result.err
        run_dir = json.loads(result.out)["run_dir"]
        assert json.loads((Path(run_dir) / "meta.json").read_text())["plan"]["threads"] == 1
        torch.set_num_threads(2)
        monkeypatch.setattr("dpclip.threads.auto_threads", lambda: 2)  # what a bare run would take
        resumed = cli("train", "--resume", run_dir, "--json")
        assert resumed.code == 0, resumed.err
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_thread_count_above_the_machines_cpus_is_refused_before_any_thread_starts(monkeypatch):
    # `--threads 100000` exhausted the process's memory: a Python traceback (MemoryError), exit 1
    import os

    from dpclip.cli.train import thread_count
    from dpclip.errors import DpclipError

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(DpclipError) as info:
        thread_count("100000")
    assert "2 logical CPUs" in info.value.message and "--threads 2" in info.value.hint
    assert thread_count("2") == 2 and thread_count(16) == 16   # a resume's recorded count is kept
