"""scripts/compiled_zoo.py: the committed results are what docs/compiled.md counts, and one case is
judged as the script judges them all (a tiny GPT-2: equal within 1e-5)."""

import json
import sys

import pytest


@pytest.fixture(scope="module")
def script(load_script):
    yield load_script("compiled_zoo")
    sys.modules.pop("compiled_zoo", None)


def test_docs_cite_the_committed_counts(script):
    from pathlib import Path

    results = json.loads(script.RESULTS.read_text())
    summary = script.render(results).splitlines()[0].split(": ", 1)[1]
    page = (Path(script.REPO) / "docs" / "compiled.md").read_text()
    assert summary in page, f"docs/compiled.md does not cite {summary!r}: run python scripts/compiled_zoo.py --render"


@pytest.mark.slow   # one torch.compile trace
def test_a_tiny_gpt2_compiles_and_equals_the_engine(script):
    verdict, detail = script.judge("gpt2")
    assert verdict == "equal", detail
