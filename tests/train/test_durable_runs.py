"""No lost work: SIGTERM stops at a step boundary with a checkpoint, checkpoints come by
the clock too, and a run directory works from any current directory."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dpclip.errors import DpclipError
from dpclip.recipe import recipe_to_yaml
from dpclip.train import state as state_module
from dpclip.train.workflow import train
from tests.conftest import FIXED_SIGMA


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model.safetensors"))


def _dpclip(*args, **kwargs):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return [sys.executable, "-m", "dpclip", *map(str, args)], env


@pytest.mark.slow
def test_sigterm_checkpoints_at_a_step_boundary_and_resume_ends_where_an_uninterrupted_run_does(
        small_recipe, tmp_path, signal_after_first_step):
    recipe = small_recipe("training.steps=400", "checkpoint.every_steps=null", "eval.every_steps=null",
                          "model.hidden=[16]", "privacy.unsafe_seeded_randomness=true", *FIXED_SIGMA)
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(recipe_to_yaml(recipe))
    command, env = _dpclip("train", recipe_file, "--threads", "1")
    returncode, out, err, run_dir = signal_after_first_step(command, env, tmp_path / "runs", signal.SIGTERM)
    assert not (run_dir / "summary.json").exists() or "interrupted" in (run_dir / "summary.json").read_text(), \
        "the run ended before SIGTERM: nothing was tested"
    assert returncode != 0, err
    assert f"dpclip train --resume {run_dir}" in " ".join(err.split()) and "Traceback" not in err
    ledger = json.loads((run_dir / "ledger.json").read_text())
    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    assert latest == f"step_{ledger['steps']:06d}" and 1 <= ledger["steps"] < 400, "checkpoint at the boundary"

    command, env = _dpclip("train", "--resume", run_dir, "--json", "--threads", "1")
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["steps_done"] == 400

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full = train(recipe.model_copy(update={"output_dir": str(tmp_path / "full")})).run_dir
    finally:
        torch.set_num_threads(threads)
    a, b = _weights(full), _weights(run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((full / "ledger.json").read_text()) == json.loads((run_dir / "ledger.json").read_text())


@pytest.mark.slow  # an end-to-end run: the slow set (README)
def test_a_checkpoint_is_made_when_every_minutes_have_passed(small_recipe, monkeypatch, saved_checkpoint_steps):
    clock = {"now": 0.0}

    def fake_monotonic():
        clock["now"] += 25.0  # every reading is 25 s later: a checkpoint is due every few steps
        return clock["now"]

    monkeypatch.setattr(state_module.time, "monotonic", fake_monotonic)
    saved = saved_checkpoint_steps
    short = ("training.steps=6", "model.hidden=[16]", "checkpoint.every_steps=null", "eval.every_steps=null")
    train(small_recipe(*short, "checkpoint.every_minutes=1"))
    assert saved[0] == 0 and saved[-1] == 6 and len(saved) > 2, saved
    saved.clear()
    train(small_recipe(*short, "checkpoint.every_minutes=null"))
    assert saved == [0, 6]


def test_checkpoints_by_the_clock_are_on_by_default(quickstart):
    assert quickstart().checkpoint.every_minutes == 10 and quickstart().checkpoint.every_steps is None


@pytest.mark.slow  # an end-to-end run: the slow set (README)
def test_a_run_directory_resumes_and_accounts_from_another_directory(tmp_path, monkeypatch, cli):
    import numpy as np

    project = tmp_path / "project"
    project.mkdir()
    rng = np.random.default_rng(0)
    rows = ["a,b,y"] + [f"{x:.3f},{z:.3f},{int(x > z)}" for x, z in rng.random((80, 2))]
    (project / "train.csv").write_text("\n".join(rows) + "\n")
    (project / "recipe.yaml").write_text(
        "name: files\ndata: {source: files, format: csv, train: train.csv, label_field: y}\n"
        "model: {kind: mlp, hidden: [8]}\n"
        "training: {steps: 4, batch_size: 16, optimizer: {kind: sgd, lr: 0.1}}\n"
        "privacy: {epsilon: 8.0, delta: 1.0e-3}\ncheckpoint: {every_steps: 2}\n")
    monkeypatch.chdir(project)
    summary = json.loads(cli("train", "recipe.yaml", f"output_dir={tmp_path / 'runs'}", "--json").out)
    run_dir = Path(summary["run_dir"])
    assert str(project / "train.csv") in (run_dir / "recipe.yaml").read_text()
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["data"]["content_fingerprint"]
    monkeypatch.chdir(tmp_path)
    assert cli("account", run_dir, "--json").code == 0
    cut_short = [run_dir / ".ledger.json.k1ll3d00.tmp", run_dir / "checkpoints" / ".LATEST.k1ll3d00.tmp"]
    for path in cut_short:   # what writes killed before their rename leave
        path.write_text("{")
    again = cli("train", "--resume", run_dir, "--json")
    assert again.code == 0, again.err
    assert not any(path.exists() for path in cut_short)
    # The data changed since the run started: resuming would train on other people's data.
    (project / "train.csv").write_text("\n".join(rows[:1] + [r.replace("0.", "0.9", 1) for r in rows[1:]]) + "\n")
    with pytest.raises(DpclipError) as info:
        train(resume=run_dir)
    assert "changed since the run started" in info.value.message
