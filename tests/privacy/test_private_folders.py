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
