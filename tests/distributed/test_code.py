"""What the ranks compare of their code (dpclip/distributed/code.py): an edit to any source file of
the package moves the fingerprint, though the version string stays."""

from __future__ import annotations

import dpclip
from dpclip.distributed import code


def test_an_edited_source_file_changes_the_fingerprint_and_the_version_is_named(tmp_path, monkeypatch):
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "clip.py").write_text("C = 1.0\n")
    monkeypatch.setattr(dpclip, "__file__", str(tmp_path / "__init__.py"))
    code.code_fingerprint.cache_clear()
    try:
        first = code.code_fingerprint()
        (tmp_path / "engine" / "clip.py").write_text("C = 9.0\n")
        code.code_fingerprint.cache_clear()
        edited = code.code_fingerprint()
    finally:
        code.code_fingerprint.cache_clear()
    assert first != edited
    assert first.startswith(f"dpclip {dpclip.__version__} (source ") and ", torch " in first
