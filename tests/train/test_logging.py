import json
import shutil

import pytest

from dpclip.accounting import Ledger
from dpclip.errors import DpclipError
from dpclip.planning import plan
from dpclip.train.tensorboard import NOT_COVERED_PREFIX, TensorBoardLog, check_logging, record_scalars
from dpclip.train.workflow import train

STEP = {"step": 3, "epsilon": 1.5, "lr": 0.1, "seconds": 0.2, "thresholds": [1.0, 0.5], "noise_std": [0.01, 0.02],
        "policy": {"noisy_unclipped_fraction": [0.4, 0.6]},
        "diagnostics": {"train_loss": 2.5, "batch_size": 60, "clip_fraction": [0.1, 0.2], "norm_median": [0.9, 1.1],
                        "nonfinite": [0, 0]},
        "not_covered_by_epsilon": ["diagnostics"]}
EVAL = {"step": 3, "eval": {"loss": 2.0, "accuracy": 0.4}, "not_covered_by_epsilon": ["eval"]}


def test_diagnostics_and_held_out_metrics_are_tagged_not_covered_and_releases_by_group():
    tags = dict(record_scalars(STEP, ["fc1", "fc2"]))
    assert tags["privacy/epsilon"] == 1.5 and tags["train/lr"] == 0.1
    assert tags["thresholds/fc1"] == 1.0 and tags["thresholds/fc2"] == 0.5
    assert tags["noise_std/fc2"] == 0.02 and tags["policy/noisy_unclipped_fraction/fc1"] == 0.4
    assert tags[f"{NOT_COVERED_PREFIX}train_loss"] == 2.5 and tags[f"{NOT_COVERED_PREFIX}clip_fraction/fc2"] == 0.2
    diagnostics = {"train_loss", "batch_size", "clip_fraction", "norm_median", "nonfinite"}
    for tag in tags:  # nothing computed without noise escapes the prefix
        assert tag.startswith(NOT_COVERED_PREFIX) or tag.split("/")[0] not in diagnostics
    assert dict(record_scalars(EVAL, ["fc1", "fc2"])) == {f"{NOT_COVERED_PREFIX}eval_loss": 2.0,
                                                          f"{NOT_COVERED_PREFIX}eval_accuracy": 0.4}
    assert "privacy/epsilon" not in dict(record_scalars({**STEP, "epsilon": None}, ["fc1", "fc2"]))


def test_tensorboard_asked_for_but_not_installed_is_an_error_with_a_hint(quickstart, cli, monkeypatch, tmp_path):
    monkeypatch.setattr(plan, "tensorboard_installed", lambda: False)
    with pytest.raises(DpclipError) as info:
        check_logging(quickstart("logging.tensorboard=true"))
    assert "tensorboard" in info.value.message and "dpclip[tensorboard]" in info.value.hint
    check_logging(quickstart())  # not asked for: fine
    recipe = tmp_path / "recipe.yaml"
    from dpclip.recipe import recipe_to_yaml

    recipe.write_text(recipe_to_yaml(quickstart("logging.tensorboard=true")))
    result = cli("validate", recipe)
    assert result.code == 2 and "error:" in result.err and "hint:" in result.err and "Traceback" not in result.err
    with pytest.raises(DpclipError):
        train(quickstart("logging.tensorboard=true", "training.epochs=null", "training.steps=2"))
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir()), "no run directory is left"


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.slow
def test_tensorboard_event_files_hold_metrics_jsonl_and_a_resume_writes_no_step_twice(small_recipe, tmp_path):
    pytest.importorskip("tensorboard")
    run = train(small_recipe("logging.tensorboard=true", "clipping.threshold={kind: quantile, target: 0.5}")).run_dir
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    groups = json.loads((run / "meta.json").read_text())["groups"]
    scalars = _scalars(run / "tensorboard")
    steps = [r for r in records if "eval" not in r]
    assert [s for s, _ in scalars[f"{NOT_COVERED_PREFIX}train_loss"]] == list(range(1, 13))
    assert [v for _, v in scalars[f"{NOT_COVERED_PREFIX}train_loss"]] == \
        pytest.approx([r["diagnostics"]["train_loss"] for r in steps], rel=1e-6)
    assert [v for _, v in scalars[f"thresholds/{groups[-1]}"]] == pytest.approx([r["thresholds"][-1] for r in steps])
    assert [s for s, _ in scalars["privacy/epsilon"]] == [r["step"] for r in steps if r["epsilon"] is not None]
    assert scalars["privacy/epsilon"][-1][1] == pytest.approx(steps[-1]["epsilon"], rel=1e-6)
    assert [s for s, _ in scalars[f"{NOT_COVERED_PREFIX}eval_accuracy"]] == [6, 12]
    assert "train/lr" in scalars and f"noise_std/{groups[0]}" in scalars
    assert not [t for t in scalars if "loss" in t or "accuracy" in t if not t.startswith(NOT_COVERED_PREFIX)]

    # The run as if killed right after step 10 (checkpoint 8 the latest); the event files
    # hold what the killed process wrote: steps 1 to 10 and the eval at 6.
    cut = tmp_path / "cut"
    shutil.copytree(run, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000012")
    (cut / "checkpoints" / "LATEST").write_text("step_000008\n")
    ledger = Ledger.from_dict(json.loads((cut / "checkpoints" / "step_000008" / "state.json").read_text())["ledger"])
    ledger.record(ledger.entries[-1].event, count=2, metadata=ledger.entries[-1].metadata)
    (cut / "ledger.json").write_text(json.dumps(ledger.to_dict()))
    kept = [r for r in records if r["step"] <= 10]
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    shutil.rmtree(cut / "tensorboard")
    log = TensorBoardLog(cut, groups)
    for record in kept:
        log.write(record)
    log.close()
    assert train(resume=cut).steps_done == 12
    resumed = _scalars(cut / "tensorboard")
    assert [s for s, _ in resumed[f"{NOT_COVERED_PREFIX}train_loss"]] == list(range(1, 13))
    assert [s for s, _ in resumed[f"thresholds/{groups[0]}"]] == list(range(1, 13))
    assert [s for s, _ in resumed[f"{NOT_COVERED_PREFIX}eval_accuracy"]] == [6, 12]


def test_a_resume_says_which_released_steps_metrics_jsonl_lost(small_recipe, tmp_path, caplog):
    """Steps after the checkpoint are redone and compared with the releases metrics.jsonl recorded;
    lines lost from the file (cut or edited) leave nothing to compare with, and the resume says so."""
    run = train(small_recipe()).run_dir
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    cut = tmp_path / "cut"
    shutil.copytree(run, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000012")
    (cut / "checkpoints" / "LATEST").write_text("step_000008\n")
    ledger = Ledger.from_dict(json.loads((cut / "checkpoints" / "step_000008" / "state.json").read_text())["ledger"])
    ledger.record(ledger.entries[-1].event, count=3, metadata=ledger.entries[-1].metadata)   # released to step 11
    (cut / "ledger.json").write_text(json.dumps(ledger.to_dict()))
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if r["step"] <= 8))
    with caplog.at_level("WARNING"):
        assert train(resume=cut).steps_done == 12
    said = [r.getMessage() for r in caplog.records if "metrics.jsonl holds no record" in r.getMessage()]
    assert len(said) == 1 and "steps 9-10" in said[0]   # step 11 may lack its line: the ledger is written first
