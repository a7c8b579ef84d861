import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dpclip.accounting import Ledger
from dpclip.errors import DpclipError
from dpclip.planning.plan import plan_for_recipe, solve_plan
from dpclip.rundir.run import spent
from dpclip.train.optim import lr_factor
from dpclip.train.workflow import train
from tests.conftest import FIXED_SIGMA

REPO = Path(__file__).resolve().parents[2]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model.safetensors"))


def test_run_directory_is_complete_and_its_ledger_is_the_plan(small_recipe):
    recipe = small_recipe()
    result = train(recipe)
    run = result.run_dir
    for name in ("recipe.yaml", "meta.json", "ledger.json", "metrics.jsonl", "summary.json", "checkpoints/LATEST"):
        assert (run / name).exists(), name
    assert (run / "checkpoints" / "step_000012" / "model.safetensors").exists()
    assert result.stopped == "completed" and result.steps_done == 12
    meta = json.loads((run / "meta.json").read_text())
    assert len(meta["members"]) == meta["data"]["num_train"] and meta["data"]["split_fingerprint"]
    assert not set(meta["members"]) & set(meta["non_members"])
    # the ledger holds 12 copies of the plan's step event, and its ε is the plan's
    ledger, statement = spent(run)
    planned = solve_plan(plan_for_recipe(recipe))
    assert ledger.steps == 12
    assert all(entry.event == planned.step_event for entry in ledger.entries)
    assert ledger.epsilon() == pytest.approx(planned.epsilon, rel=1e-6)
    assert result.epsilon <= recipe.privacy.epsilon
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "eval" not in r]
    assert steps == list(range(1, 13))
    evals = [r for r in records if "eval" in r]
    assert [r["step"] for r in evals] == [6, 12] and "accuracy" in evals[-1]["eval"]


def test_resolved_recipe_in_the_run_reloads_to_the_same_recipe(small_recipe):
    from dpclip.recipe import load_recipe

    recipe = small_recipe("training.optimizer.lr=0.3")
    run = train(recipe).run_dir
    assert load_recipe(run / "recipe.yaml") == recipe


def _without_timing(path: Path) -> list[dict]:
    """The records without what a resume changes by design: wall time, and the certificate's
    record (a resumed run is checked again at its first step: docs/certificate.md)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        record.pop("seconds", None)
        if isinstance(record.get("diagnostics"), dict):
            record["diagnostics"].pop("certificate", None)
    return records


@pytest.mark.slow  # an end-to-end resume (5 s); tests/privacy/test_crash_and_resume.py stays in the default run
def test_resume_from_a_checkpoint_matches_an_uninterrupted_run(small_recipe, tmp_path):
    import shutil

    # seeded: past the redone steps an OS-entropy run draws fresh streams (tests/privacy/test_forked_resumes.py)
    full = train(small_recipe("privacy.unsafe_seeded_randomness=true")).run_dir
    # The same run as if killed right after step 10: checkpoint 8 is the latest, the
    # ledger (written before each step's record) counts 10 steps, metrics end at step 10.
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000012")
    (cut / "checkpoints" / "LATEST").write_text("step_000008\n")
    ledger = Ledger.from_dict(json.loads((cut / "checkpoints" / "step_000008" / "state.json").read_text())["ledger"])
    entry = ledger.entries[-1]
    ledger.record(entry.event, count=2, metadata=entry.metadata)
    (cut / "ledger.json").write_text(json.dumps(ledger.to_dict()))
    lines = (cut / "metrics.jsonl").read_text().splitlines()
    (cut / "metrics.jsonl").write_text("".join(l + "\n" for l in lines if json.loads(l)["step"] <= 10))
    resumed = train(resume=cut)
    assert resumed.steps_done == 12
    assert Ledger.from_dict(json.loads((cut / "ledger.json").read_text())) == \
        Ledger.from_dict(json.loads((full / "ledger.json").read_text()))
    a, b = weights(full), weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _without_timing(cut / "metrics.jsonl") == _without_timing(full / "metrics.jsonl")


@pytest.mark.slow
def test_kill_minus_nine_then_resume_replays_what_left_and_ends_with_the_planned_ledger(small_recipe, tmp_path):
    """Default (OS-entropy) randomness: the resumed run redoes the steps after its last
    checkpoint with the checkpoint's generator states, so they release exactly what the
    killed process had already released (a mismatch would stop the resume with an error),
    and the ledger on disk was never behind what had left the process."""
    # Long enough that the poller below always kills the child well before its end, even on a loaded machine.
    # Every checkpoint kept: with the default 2, a fast run could prune step 10 before the poll saw it.
    recipe = small_recipe("training.steps=300", "checkpoint.every_steps=5", "checkpoint.keep=100",
                          "eval.every_steps=null", *FIXED_SIGMA)
    recipe_file = tmp_path / "recipe.yaml"
    from dpclip.recipe import recipe_to_yaml

    recipe_file.write_text(recipe_to_yaml(recipe))
    process = subprocess.Popen([sys.executable, "-m", "dpclip", "train", str(recipe_file), "--json"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    run_dir = None
    while time.time() < deadline:
        found = list((tmp_path / "runs").glob("*/checkpoints/step_000010"))
        if found:
            run_dir = found[0].parents[1]
            break
        time.sleep(0.05)
    assert run_dir is not None, "the run never reached step 10"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (run_dir / "summary.json").exists(), "killed too late to test anything"
    before = [r for r in _without_timing(run_dir / "metrics.jsonl")]
    charged = json.loads((run_dir / "ledger.json").read_text())["steps"]
    assert charged >= max(r["step"] for r in before), "a step's record left before its charge"
    done = subprocess.run([sys.executable, "-m", "dpclip", "train", "--resume", str(run_dir), "--json"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["steps_done"] == 300
    ledger = Ledger.from_dict(json.loads((run_dir / "ledger.json").read_text()))
    assert ledger.steps == 300 and len({json.dumps(e.to_dict()["event"]) for e in ledger.entries}) == 1
    after = _without_timing(run_dir / "metrics.jsonl")
    steps = [r["step"] for r in after if "eval" not in r]
    assert steps == list(range(1, 301))
    assert after[:len(before)] == before


def test_resume_refuses_a_recipe_whose_privacy_fields_changed(small_recipe):
    run = train(small_recipe()).run_dir
    with pytest.raises(DpclipError) as info:
        train(small_recipe("privacy.epsilon=4"), resume=run)
    assert "privacy.epsilon" not in info.value.message or "privacy" in info.value.message
    text = (run / "recipe.yaml").read_text()
    (run / "recipe.yaml").write_text(text.replace("delta: 1.0e-05", "delta: 1.0e-06"))
    with pytest.raises(DpclipError) as edited:
        train(resume=run)
    assert "edited" in edited.value.message


def test_budget_cap_stops_before_a_step_that_would_exceed_epsilon(small_recipe):
    recipe = small_recipe("privacy.noise_multiplier=0.8", "privacy.epsilon=2.0", "training.steps=2000",
                          "checkpoint.every_steps=null", "eval.every_steps=null")
    result = train(recipe)
    assert result.stopped == "budget"
    assert result.epsilon <= 2.0
    ledger, _ = spent(result.run_dir)
    one_more = ledger.epsilon_if(ledger.entries[-1].event)
    assert one_more > 2.0, "the run stopped although one more step fitted"


def test_dry_run_builds_everything_and_writes_nothing(small_recipe, tmp_path):
    result = train(small_recipe(), dry_run=True)
    assert result.stopped == "dry-run" and result.steps_done == 0
    assert not (tmp_path / "runs").exists()


def test_quantile_thresholds_move_and_their_counts_are_charged(small_recipe):
    recipe = small_recipe("clipping.threshold={kind: quantile, target: 0.5, budget_fraction: 0.1, initial: 1.0}",
                          "checkpoint.every_steps=null", "eval.every_steps=null")
    result = train(recipe)
    records = [json.loads(l) for l in (result.run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' not in l]
    assert records[0]["thresholds"] != records[-1]["thresholds"]
    assert all(0 <= f <= 1 for f in records[-1]["policy"]["noisy_unclipped_fraction"])
    assert (result.run_dir / "thresholds.png").stat().st_size > 0
    ledger, statement = spent(result.run_dir)
    meta = ledger.entries[0].metadata
    assert meta["aux_fraction"] == pytest.approx(0.1)
    assert meta["gradient_noise_multiplier"] == pytest.approx(meta["noise_multiplier"] / math.sqrt(0.9))
    assert any("quantile" in release for release in statement.releases)


@pytest.mark.parametrize("kind, step, total, expected", [
    ("constant", 5, 10, 1.0), ("linear", 0, 10, 1.0), ("linear", 10, 10, 0.0), ("cosine", 5, 10, 0.5)])
def test_schedules(kind, step, total, expected):
    from dpclip.recipe.schema import Schedule

    assert lr_factor(Schedule(kind=kind), step, total) == pytest.approx(expected)
    assert lr_factor(Schedule(kind=kind, warmup_steps=4), 1, total) == pytest.approx(0.5)


def test_batchnorm_model_is_refused_with_a_hint(small_recipe, tmp_path, monkeypatch):
    (tmp_path / "bnmodel.py").write_text(
        "import torch.nn as nn\n"
        "def make(input_shape, num_classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.Linear(16, num_classes))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DpclipError) as info:
        train(small_recipe("model={kind: custom, target: 'bnmodel:make'}"))
    assert "BatchNorm" in info.value.message and "GroupNorm" in info.value.hint


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(small_recipe, tmp_path, signal_after_first_step):
    from dpclip.recipe import recipe_to_yaml

    recipe = small_recipe("training.steps=100000", "checkpoint.every_steps=null", "eval.every_steps=null",
                          "privacy.epsilon=null", "privacy.noise_multiplier=5.0")
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(recipe_to_yaml(recipe))
    returncode, out, err, run_dir = signal_after_first_step(
        [sys.executable, "-m", "dpclip", "train", str(recipe_file)], None, tmp_path / "runs", signal.SIGINT)
    assert returncode == 130, err
    assert "error: interrupted at step" in err and "--resume" in err and "Traceback" not in err
    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert latest == f"step_{ledger['steps']:06d}" and ledger["steps"] >= 1


def test_engine_event_is_exactly_the_planned_event(small_recipe):
    """account RECIPE and the training ledger cannot disagree: same builder, same event."""
    from dpclip.data import load_data, select
    from dpclip.engine import DPEngine
    from dpclip.models import build_model

    recipe = small_recipe("clipping.threshold={kind: quantile, budget_fraction: 0.05}")
    data = load_data(recipe.data, seed=0)
    model, loss_fn = build_model(recipe.model, data)
    plan = plan_for_recipe(recipe, groups=3)
    solved = solve_plan(plan)
    clipping = recipe.clipping.model_dump()
    clipping["threshold"].update(sigma=solved.split.sigma_aux, budget_fraction=None)
    engine = DPEngine(model, clipping, gradient_noise_multiplier=solved.split.gradient_noise_multiplier, expected_batch_size=64,
                      sample_rate=plan.sample_rate)
    engine.backward(loss_fn(model, select(data.train, torch.arange(10))))
    report = engine.privatize()
    assert report.dp_event.sampling_probability == solved.step_event.sampling_probability
    assert report.dp_event.event.noise_multiplier == pytest.approx(solved.step_event.event.noise_multiplier,
                                                                   rel=1e-12)
