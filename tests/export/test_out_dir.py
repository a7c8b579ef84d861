"""Where an export may go: never over the run it exports, nor over a folder holding it
(`--force` replaces OUT_DIR as a whole; docs/export.md)."""

import os
import shutil
from pathlib import Path

import pytest

from dpclip.rundir.run import RunDir


@pytest.fixture
def run_copy(mlp_run, tmp_path):
    """A copy of the session's trained run, under tmp_path/runs (the test may try to destroy it)."""
    run = tmp_path / "runs" / mlp_run.name
    shutil.copytree(mlp_run, run)
    return run


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("where", ["the run", "inside the run", "the runs folder", "a symlink to the run", "."])
def test_an_out_dir_that_is_inside_or_contains_the_run_is_refused_and_the_run_kept(cli, run_copy, tmp_path,
                                                                                  monkeypatch, where):
    (tmp_path / "runs" / "sibling").mkdir()
    (tmp_path / "runs" / "sibling" / "ledger.json").write_text("{}")
    (tmp_path / "link").symlink_to(run_copy)
    out = {"the run": run_copy, "inside the run": run_copy / "exported", "the runs folder": tmp_path / "runs",
           "a symlink to the run": tmp_path / "link", ".": "."}[where]
    if where == ".":
        monkeypatch.chdir(tmp_path / "runs")
    before = _files(tmp_path / "runs")
    result = cli("export", run_copy, out, "--force")
    assert result.code == 2, result.err
    assert "error:" in result.err and "the run directory" in result.err and "hint:" in result.err
    assert "Traceback" not in result.err and "unexpected" not in result.err
    assert _files(tmp_path / "runs") == before   # the run, its ledger and checkpoints, and its siblings
    assert not [p for p in tmp_path.rglob(".*export-staging*")]


def test_a_forced_export_next_to_the_run_still_replaces_its_out_dir(cli, run_copy, tmp_path, monkeypatch):
    out = tmp_path / "exported"
    out.mkdir()
    (out / "old.txt").write_text("old")
    monkeypatch.chdir(tmp_path)
    result = cli("export", run_copy, "exported", "--force")
    assert result.code == 0, result.err
    assert not (out / "old.txt").exists() and (out / "privacy.json").is_file()
    assert (run_copy / "ledger.json").is_file()


def test_the_current_directory_is_refused_as_out_dir_rather_than_replaced(cli, run_copy, tmp_path, monkeypatch):
    """`dpclip export RUN . --force` used to stop on "PosixPath('.') has an empty name"; replacing the
    folder the shell is in would leave it in a deleted directory."""
    here = tmp_path / "elsewhere" / "here"
    here.mkdir(parents=True)
    (here / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    for out in (".", ".."):
        result = cli("export", run_copy, out, "--force")
        assert result.code == 2 and "current directory" in result.err and "hint:" in result.err, result.err
        assert "unexpected" not in result.err
    assert (here / "notes.txt").read_text() == "mine" and (run_copy / "ledger.json").is_file()


def test_an_export_leaves_the_staging_folder_of_another_export_to_the_same_out_dir_alone(cli, run_copy, tmp_path):
    """Two exports to one OUT_DIR at once shared one staging name: the second removed the first's
    half-written folder under it."""
    other = tmp_path / ".exported.export-staging"   # the name every export used
    other.mkdir()
    (other / "model.safetensors").write_text("another export, half written")
    result = cli("export", run_copy, tmp_path / "exported")
    assert result.code == 0, result.err
    assert (other / "model.safetensors").read_text() == "another export, half written"
    assert not [p for p in tmp_path.glob(".exported.export-staging-*")]   # its own staging is gone


def test_a_killed_exports_staging_folder_is_removed_and_a_live_ones_kept(cli, run_copy, tmp_path):
    """Each export stages under its own name (process id, random part); one killed mid-way left its
    folder for ever. The next export removes those whose process is gone, not a live one's."""
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".exported.export-staging-{int(gone.stdout)}-0badcafe"
    live = tmp_path / f".exported.export-staging-{os.getppid()}-0badcafe"   # the test runner's parent: alive
    for folder in (dead, live):
        folder.mkdir()
        (folder / "model.safetensors").write_text("half written")
    result = cli("export", run_copy, tmp_path / "exported")
    assert result.code == 0, result.err
    assert not dead.exists() and (live / "model.safetensors").read_text() == "half written"


def test_the_exported_recipe_names_no_folder_of_the_exporting_machine(cli, run_copy, tmp_path):
    result = cli("export", run_copy, tmp_path / "exported")
    assert result.code == 0, result.err
    text = (tmp_path / "exported" / "recipe.yaml").read_text()
    trained_in = str(RunDir(run_copy).recipe().output_dir)   # the exporter's folders, its user name with them
    assert trained_in.startswith("/") and trained_in not in text
    assert f"output_dir: (local path)/{Path(trained_in).name}" in text
