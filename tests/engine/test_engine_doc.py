"""The engine's pages (docs/engine.md, supported-models.md, certificate.md, layer-rules.md): the
own-loop example of engine.md runs as written and prints what the page says, its API block shows
DPEngine's and backward's real parameters and defaults, and every
``page.md, "Section"`` citation of them in the repository names a section they have (links and
page lengths: tests/test_docs.py)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "engine.md"
ENGINE_PAGES = ("engine", "supported-models", "certificate", "layer-rules")
_PAGE = "(?:" + "|".join(re.escape(p) for p in ENGINE_PAGES) + r")\.md"


def _loop_example() -> str:
    section = DOC.read_text(encoding="utf-8").split("## Using it in your own training loop", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_own_training_loop_example_of_engine_md_runs_and_charges_every_step(capsys):
    import torch

    namespace: dict = {}
    threads = torch.get_num_threads()
    try:
        exec(compile(_loop_example(), str(DOC), "exec"), namespace)
    finally:
        torch.set_num_threads(threads)   # the example sets the process's threads (configure_speed)
    ledger, engine, model = namespace["ledger"], namespace["engine"], namespace["model"]
    assert ledger.steps == namespace["steps"] and ledger.epsilon() > 0
    assert all(p.grad is None for p in model.parameters())
    printed = capsys.readouterr().out.strip()
    assert f"It prints `{printed}`" in DOC.read_text(encoding="utf-8"), "engine.md says the example prints another ε"
    del engine


def _sections(page: str) -> list[str]:
    """A page's headings and the bold leads of its paragraphs ("**Aliased parameters** (…)")."""
    text = (REPO / "docs" / f"{page}.md").read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    leads = re.findall(r"^(?:- )?\*\*([^*]+?)\.?\*\*", text, flags=re.M)
    return [s.replace("`", "").strip() for s in headings + leads]


def _citing_files():
    for folder, patterns in (("dpclip", ("*.py", "*.yaml")), ("tests", ("*.py",)), ("scripts", ("*.py",)),
                             ("benchmarks", ("*.py", "*.sh", "*.md"))):
        for pattern in patterns:
            yield from (REPO / folder).rglob(pattern)
    yield from (REPO / "docs").glob("*.md")
    yield REPO / "README.md"


def test_every_citation_of_an_engine_page_names_one_of_its_sections():
    sections = {p: _sections(p) for p in ENGINE_PAGES}
    cite = re.compile(rf"\b({_PAGE}),\s*\\?[\"']([^\"'\\]+)[\"'\\]")
    stale = []
    for path in _citing_files():
        # a citation may wrap onto the next line of a comment or docstring
        text = re.sub(r"\s*\n\s*(?:#+ )?", " ", path.read_text(encoding="utf-8"))
        for page, title in cite.findall(text):
            title = title.strip()
            if title and not any(s.startswith(title) for s in sections[page[:-3]]):
                stale.append(f"{path.relative_to(REPO)}: {page}, \"{title}\"")
    assert not stale, "citations of sections the page does not have:\n" + "\n".join(stale)



def _api_block() -> str:
    section = DOC.read_text(encoding="utf-8").split("### API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _shown_signature(call: str) -> dict[str, object]:
    """The parameters of ``DPEngine(...)``/``engine.backward(...)`` as the API block shows them,
    with the defaults it shows (``inspect.Parameter.empty`` for none)."""
    import ast
    import inspect

    match = re.search(re.escape(call) + r"\((.*?)\)(?:\s*->[^#\n]*)?\s*(?:#|\n)", _api_block(), re.S)
    args = re.sub(r":\s*Tensor\[b\]", "", match.group(1))
    params = ast.parse(f"def f({args}): pass").body[0].args
    positional = params.args[len(params.args) - len(params.defaults):]
    shown = {a.arg: inspect.Parameter.empty for a in params.args + params.kwonlyargs}
    shown |= {a.arg: ast.literal_eval(d) for a, d in zip(positional, params.defaults)}
    shown |= {a.arg: ast.literal_eval(d) for a, d in zip(params.kwonlyargs, params.kw_defaults) if d is not None}
    return shown


def _real_signature(function) -> dict[str, object]:
    import inspect

    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if name != "self" and not name.startswith("_")}


def test_engine_md_shows_dpengine_and_backward_with_their_real_parameters_and_defaults():
    from dpclip.engine import DPEngine

    assert _shown_signature("DPEngine") == _real_signature(DPEngine.__init__)
    shown, real = _shown_signature("engine.backward"), _real_signature(DPEngine.backward)
    assert list(shown.values())[1:] == list(real.values())[1:] and list(shown)[1:] == list(real)[1:], \
        "the losses argument aside, engine.md's backward is not DPEngine.backward"
