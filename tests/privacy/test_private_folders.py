"""Every folder dpclip makes in a run, search or export directory is owner-only (0700).

Before, ``checkpoints/``, ``audit/``, a search's folder and its ``runs/`` were made with the
umask's mode (0755 under umask 022) while the files in them were owner-only: anyone on the
machine could list the checkpoints (their step names are not covered by ε with
checkpoint.every_minutes) and enter a search whose run directory had been shared.
"""

import os
import stat
from pathlib import Path

import pytest

from dpclip.files import private_dir
from dpclip.train.workflow import train


@pytest.fixture(autouse=True)
def ordinary_umask():
    """The usual umask 022, whatever the test process was started with."""
    before = os.umask(0o022)
    yield
    os.umask(before)


def _open_folders(root: Path) -> list[str]:
    folders = [root, *(p for p in root.rglob("*") if p.is_dir())]
    return [f"{p.relative_to(root)} {stat.filemode(p.stat().st_mode)}" for p in folders if p.stat().st_mode & 0o077]


def test_a_new_private_folder_and_the_parents_it_makes_are_owner_only(tmp_path):
    private_dir(tmp_path / "made" / "deeper")
    assert _open_folders(tmp_path / "made") == []


def test_an_existing_private_folder_is_narrowed_but_not_its_existing_parent(tmp_path):
    folder = tmp_path / "shared" / "own"
    folder.mkdir(parents=True, mode=0o755)
    os.chmod(folder, 0o755)
    private_dir(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o755 & ~0o022


def test_every_folder_of_a_run_with_checkpoints_canaries_and_its_audit_is_owner_only(tiny_recipe, cli):
    run_dir = train(tiny_recipe("audit.canaries.count=20", "audit.canaries.kind=ood",
                                "logging.tensorboard=true")).run_dir
    assert cli("audit-mia", run_dir, "--attack", "loss", "--bootstrap", "0").code == 0
    assert (run_dir / "checkpoints").is_dir() and (run_dir / "audit").is_dir()
    assert _open_folders(run_dir) == []


@pytest.mark.slow  # an end-to-end search: the slow set (README)
def test_every_folder_of_a_search_is_owner_only(tmp_path, monkeypatch):
    from tests.privacy.test_release_manifest import tiny_search

    assert _open_folders(Path(tiny_search(tmp_path, monkeypatch, trials=1)["search_dir"])) == []


def test_an_atomic_write_makes_its_missing_folders_owner_only(tmp_path):
    from dpclip.files import write_json_atomic

    write_json_atomic(tmp_path / "made" / "deeper" / "privacy.json", {})
    assert _open_folders(tmp_path / "made") == []


def test_diagnose_out_folders_it_makes_are_owner_only_and_an_existing_one_keeps_its_mode(cli, tmp_path):
    quickstart = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    fast = ("--probes", "2", "--per-sample", "2", "--batch-size", "8", "--threads", "1", "--data", "private",
            "--allow-private-not-covered-by-epsilon")
    assert cli("diagnose", quickstart, *fast, "--out", tmp_path / "made" / "plots").code == 0
    assert _open_folders(tmp_path / "made") == []
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    assert cli("diagnose", quickstart, *fast, "--out", shared).code == 0
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755   # the user's own folder: not narrowed


def test_make_privates_save_and_checkpoint_folders_are_owner_only(tmp_path):
    from tests.integrations.test_private_releases import _private, _steps

    run = _private()
    _steps(run, 1)
    run.save_checkpoint(tmp_path / "made" / "ckpt" / "c.pt")
    run.save(tmp_path / "made" / "out" / "privacy")
    assert _open_folders(tmp_path / "made") == []


def test_an_exports_missing_parent_folders_are_owner_only(tiny_recipe, cli, tmp_path):
    run_dir = train(tiny_recipe()).run_dir
    assert cli("export", run_dir, tmp_path / "made" / "deeper" / "model").code == 0
    assert _open_folders(tmp_path / "made") == []


def test_a_dp_trainers_output_and_checkpoint_folders_are_owner_only(tmp_path):
    from tests.integrations.test_transformers import _trainer

    trainer = _trainer(tmp_path / "made", max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train()
    assert (tmp_path / "made" / "out" / "checkpoint-1").is_dir()
    assert _open_folders(tmp_path / "made") == []
