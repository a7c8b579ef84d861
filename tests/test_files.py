"""dpclip/files.py: atomic writes and what a write killed before its rename leaves."""

from __future__ import annotations

import tempfile

from dpclip.files import remove_stale_temporaries, write_json_atomic


def test_a_write_killed_before_its_rename_leaves_a_temporary_that_a_resume_removes(tmp_path):
    write_json_atomic(tmp_path / "ledger.json", {"steps": 1})
    handle, _ = tempfile.mkstemp(dir=tmp_path, prefix=".ledger.json.", suffix=".tmp")   # as the writer names it
    (tmp_path / ".keep.tmp").write_text("not ours: no random part")
    (tmp_path / "notes.tmp").write_text("the user's")
    removed = remove_stale_temporaries(tmp_path)
    assert len(removed) == 1 and removed[0].startswith(".ledger.json.")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".keep.tmp", "ledger.json", "notes.tmp"]
    assert remove_stale_temporaries(tmp_path / "missing") == []
