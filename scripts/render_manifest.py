"""Rewrite the release manifest's tables in docs/accounting.md from dpclip/release/.

    python scripts/render_manifest.py

tests/privacy/test_release_manifest.py fails while the docs and the table differ.
"""

from pathlib import Path

from dpclip import release

DOC = Path(__file__).resolve().parents[1] / "docs" / "accounting.md"


def main() -> None:
    text = DOC.read_text(encoding="utf-8")
    start, end = text.index(release.BEGIN), text.index(release.END) + len(release.END)
    DOC.write_text(text[:start] + release.render_markdown() + text[end:], encoding="utf-8")


if __name__ == "__main__":
    main()
