"""A folder the command may not write is a user's error with a hint, not an internal crash
(issue 50, item 5). The tests run as whoever runs them (root ignores file modes), so the writes
are refused by patching dpclip's one writer, as a read-only folder refuses them."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

import dpclip.files
from dpclip.recipe import load_recipe
from dpclip.train.workflow import train

REPO = Path(__file__).resolve().parents[2]
TINY = ("training.epochs=null", "training.steps=2", "eval.every_steps=null", "checkpoint.every_steps=1",
        "model.hidden=[8]")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [f"output_dir={tmp_path_factory.mktemp('runs')}", *TINY])
    return train(recipe).run_dir


@pytest.fixture
def run_copy(trained_run, tmp_path):
    return Path(shutil.copytree(trained_run, tmp_path / "run"))


@pytest.fixture
def read_only(monkeypatch):
    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))
    monkeypatch.setattr(dpclip.files, "write_bytes_atomic", refuse)


def _refused(result, path_part: str):
    assert result.code == 2, result.err
    assert "error: cannot write" in result.err and path_part in result.err
    assert "hint:" in result.err and "writable" in result.err
    assert "please report it" not in result.err and "Traceback" not in result.err


def test_training_into_a_read_only_output_dir_says_so(cli, tmp_path, read_only):
    _refused(cli("train", REPO / "recipes" / "quickstart.yaml", f"output_dir={tmp_path / 'runs'}", *TINY),
             "recipe.yaml")


@pytest.mark.parametrize("command", [
    ("report", "{run}"),
    ("train", "--resume", "{run}"),
    ("audit-mia", "{run}", "--attack", "loss", "--bootstrap", "0"),
])
def test_a_read_only_run_directory_says_so(cli, run_copy, read_only, command):
    _refused(cli(*[part.format(run=run_copy) for part in command]), str(run_copy))


def test_a_full_disk_says_so(cli, tmp_path, monkeypatch):
    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(dpclip.files, "write_bytes_atomic", full)
    result = cli("train", REPO / "recipes" / "quickstart.yaml", f"output_dir={tmp_path / 'runs'}", *TINY)
    assert result.code == 2 and "error: no space left to write" in result.err and "hint: free some space" in result.err
    assert "--resume" in result.err      # "run it again" alone would start a new run: ε spent twice


@pytest.mark.parametrize("where", ["through a file", "a missing folder"])
def test_an_output_dir_that_cannot_be_a_folder_says_so(cli, tmp_path, where):
    (tmp_path / "a_file").write_text("not a folder")
    out = tmp_path / "a_file" if where == "through a file" else Path("/proc/no-such-folder")   # mkdir fails there
    result = cli("train", REPO / "recipes" / "quickstart.yaml", f"output_dir={out}", *TINY)
    assert result.code == 2 and "cannot use" in result.err and "hint:" in result.err, result.err
    assert "unexpected" not in result.err


def test_tune_cost_out_of_a_folder_or_into_a_missing_one_says_so(cli, tmp_path):
    for out in (tmp_path, tmp_path / "missing" / "x.json"):
        result = cli("tune-cost", REPO / "recipes" / "quickstart.yaml", "--grid", "training.optimizer.lr=0.1,0.2",
                     "--no-measure", "--step-seconds", "1", "--out", out)
        assert result.code == 2 and "cannot use" in result.err and "unexpected" not in result.err, result.err


@pytest.mark.parametrize("damaged", ["state.json", "model.safetensors"])
def test_a_checkpoint_cut_short_is_named_on_resume(cli, run_copy, damaged):
    checkpoint = sorted((run_copy / "checkpoints").glob("step_*"))[-1]
    data = (checkpoint / damaged).read_bytes()
    (checkpoint / damaged).write_bytes(data[:len(data) // 3])
    result = cli("train", "--resume", run_copy)
    assert result.code == 2 and "damaged or incomplete" in result.err and "LATEST" in result.err, result.err


def test_a_run_being_trained_cannot_be_resumed_by_a_second_process(cli, run_copy):
    """Two processes on one run overwrote each other's checkpoints and drew the same batches and noise."""
    from dpclip.rundir.lock import RunLock
    held = RunLock()
    held.take(run_copy)   # as the first process holds it while it trains
    try:
        before = sorted(p.name for p in (run_copy / "checkpoints").iterdir())
        result = cli("train", "--resume", run_copy)
        assert result.code == 2 and "being trained by another process" in result.err and "hint:" in result.err
        assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == before
    finally:
        held.release()
    assert cli("train", "--resume", run_copy).code == 0   # once it has ended
