"""dpclip/files.py: atomic writes and what a write killed before its rename leaves."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from dpclip.files import exchange_paths, remove_stale_temporaries, replace_dir_atomic, write_json_atomic


def test_a_write_killed_before_its_rename_leaves_a_temporary_that_a_resume_removes(tmp_path):
    write_json_atomic(tmp_path / "ledger.json", {"steps": 1})
    handle, _ = tempfile.mkstemp(dir=tmp_path, prefix=".ledger.json.", suffix=".tmp")   # as the writer names it
    (tmp_path / ".keep.tmp").write_text("not ours: no random part")
    (tmp_path / "notes.tmp").write_text("the user's")
    removed = remove_stale_temporaries(tmp_path)
    assert len(removed) == 1 and removed[0].startswith(".ledger.json.")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".keep.tmp", "ledger.json", "notes.tmp"]
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_a_folder_replaced_in_place_is_there_at_every_moment_where_the_system_can_swap(tmp_path, monkeypatch):
    """--force re-exports through replace_dir_atomic: the old OUT_DIR used to be renamed away (to
    .NAME.old) before the new one came in, leaving a moment with no OUT_DIR at all."""
    probe_a, probe_b = tmp_path / "probe_a", tmp_path / "probe_b"
    probe_a.mkdir()
    probe_b.mkdir()
    if not exchange_paths(probe_a, probe_b):
        pytest.skip("this system or file system has no atomic swap of two paths (renameat2 RENAME_EXCHANGE)")
    final, staging = tmp_path / "out", tmp_path / ".out.staging"
    final.mkdir()
    (final / "old.txt").write_text("old")
    staging.mkdir()
    (staging / "new.txt").write_text("new")
    seen = []
    replace, rmtree = os.replace, shutil.rmtree
    monkeypatch.setattr(os, "replace", lambda *a, **k: (seen.append(final.is_dir()), replace(*a, **k))[1])
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: (seen.append(final.is_dir()), rmtree(*a, **k))[1])
    replace_dir_atomic(staging, final)
    assert all(seen) and (final / "new.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "probe_a", "probe_b"]   # nothing parked left
