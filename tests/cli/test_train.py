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
