"""The docs stay short and their links stay true (issue 53): every page in docs/ is at most
400 lines (a longer one is split into task-first pages), CHANGELOG.md follows Keep a
Changelog and has a heading for the package's version, every relative link of docs/*.md
and README.md names a file that exists and, into a docs page, a heading of it, and every
repository file a page names (`dpclip/...py`, `tests/...py`, ...) exists."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
MAX_LINES = 400

PAGES = sorted(DOCS.glob("*.md"))
LINKED_PAGES = PAGES + [REPO / "README.md"]

#: [text](target) or [text](target "title"); an image's ![alt](target) matches too.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+).*?\1")
VERSION_HEADING = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$")


def _lines_outside_code(text: str, keep_inline: bool = False) -> list[str]:
    """The page's lines without fenced code blocks and (unless ``keep_inline``: a heading
    may hold code) inline code: a link or a heading shown as code is not one."""
    out, fence = [], None
    for line in text.splitlines():
        match = FENCE.match(line.lstrip())
        if fence is None and match:
            fence = match.group(1)[0] * 3
            continue
        if fence is not None:
            if line.lstrip().startswith(fence):
                fence = None
            continue
        out.append(line if keep_inline else INLINE_CODE.sub("", line))
    return out


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, every character but letters, digits, '_',
    '-' and spaces dropped (Markdown's backticks included), each space a '-'."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(page: Path) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2, ... for repeats."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _lines_outside_code(page.read_text(encoding="utf-8"), keep_inline=True):
        match = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        anchor = github_anchor(match.group(2))
        count = seen.get(anchor, 0)
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
        seen[anchor] = count + 1
    return anchors


def relative_links(page: Path) -> list[str]:
    """The page's link targets that are relative paths (no scheme, no mailto:, no bare #)."""
    targets = []
    for line in _lines_outside_code(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.IGNORECASE) or target.startswith("//"):
                continue
            targets.append(target)
    return targets


def _id(path: Path) -> str:
    return str(path.relative_to(REPO))


# ------------------------------------------------------------------ length


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_docs_page_is_at_most_400_lines(page):
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, (f"{_id(page)} has {lines} lines; cut repetition and history, or split it "
                                f"into two task-first pages (at most {MAX_LINES} lines each)")


# ------------------------------------------------------------------ the changelog


def test_changelog_is_short_and_keeps_a_changelog():
    text = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, f"CHANGELOG.md has {len(lines)} lines"
    assert lines[0] == "# Changelog"
    headings = [line for line in lines if line.startswith("## ")]
    assert headings and headings[0] == "## [Unreleased]", headings[:1]
    for heading in headings[1:]:
        assert VERSION_HEADING.match(heading), f"not '## [X.Y.Z] - YYYY-MM-DD': {heading!r}"
    dates = [VERSION_HEADING.match(h).group(2) for h in headings[1:]]
    assert dates == sorted(dates, reverse=True), "versions go newest first"


def test_changelog_has_a_heading_for_the_package_version():
    version = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    text = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    assert re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, flags=re.MULTILINE), \
        f"CHANGELOG.md has no '## [{version}] - YYYY-MM-DD' heading for pyproject.toml's version"


# ------------------------------------------------------------------ links


@pytest.mark.parametrize("page", LINKED_PAGES, ids=_id)
def test_relative_links_name_files_that_exist_and_headings_of_docs_pages(page):
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and linked.suffix == ".md" and linked.parent == DOCS:
            if unquote(anchor) not in anchors_of(linked):
                broken.append(f"{target}: no heading with that anchor in {_id(linked)}")
    assert not broken, f"{_id(page)}: " + "; ".join(broken)


def test_the_anchor_rule_is_githubs():
    assert github_anchor("Threat model") == "threat-model"
    assert github_anchor("Correlated noise: banded matrix factorization and BLT (`privacy.mechanism`)") == \
        "correlated-noise-banded-matrix-factorization-and-blt-privacymechanism"
    assert github_anchor("The certificate: every clip checked against the sample's own gradient") == \
        "the-certificate-every-clip-checked-against-the-samples-own-gradient"
    assert github_anchor("DC-SGD synthetic check (the paper's Figures 2–3)") == \
        "dc-sgd-synthetic-check-the-papers-figures-23"
    assert github_anchor("`dpclip account`") == "dpclip-account"


# ------------------------------------------------------------------ file paths in code

#: a repository path a page shows as code: a module, test, script, result or example file
REPO_PATH = re.compile(r"\b((?:dpclip|tests|scripts|benchmarks|examples)/[\w./-]*\w\.(?:py|json|jsonl|md|yaml))\b")


def shown_paths(text: str) -> list[str]:
    """The repository file paths a page writes (in code or prose)."""
    return sorted(set(REPO_PATH.findall(text)))


@pytest.mark.parametrize("page", LINKED_PAGES + [REPO / "benchmarks" / "README.md"], ids=_id)
def test_every_repository_file_a_page_names_exists(page):
    missing = [p for p in shown_paths(page.read_text(encoding="utf-8")) if not (REPO / p).exists()]
    assert not missing, f"{_id(page)} names files that do not exist (renamed or moved?): {missing}"


def test_the_path_check_sees_a_module_that_became_a_package():
    assert shown_paths("observation (`dpclip/engine/batch_axis.py`), see tests/x/test_y.py:3") == \
        ["dpclip/engine/batch_axis.py", "tests/x/test_y.py"]
