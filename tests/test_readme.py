"""The README tells a newcomer the truth: its test command is what CI runs, then the slow tests."""

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLOW_RUN = "python -m pytest -m slow"
#: CI's slow run, in two parts: the model zoo on two pytest-xdist workers, then the rest
ZOO = "tests/engine/test_hf_zoo.py"
CI_SLOW_RUNS = [f"{SLOW_RUN} -n 2 {ZOO}", f"{SLOW_RUN} --ignore={ZOO}"]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_readme_opens_with_a_main_job_and_a_test_command_both_pinning_torch():
    main_job, tests = readme_commands()[:2]
    for command in (main_job, tests):
        assert "\n" not in command, "each setup is one command"
        assert "pip install torch==2.13.0" in command
    assert "dpclip " in main_job
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command_verbatim_then_the_slow_tests_the_readme_names():
    tests = readme_commands()[1]
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    readme = (REPO / "README.md").read_text()
    assert tests in lines and all(run in lines for run in CI_SLOW_RUNS)
    assert lines.index(tests) < lines.index(CI_SLOW_RUNS[0]) < lines.index(CI_SLOW_RUNS[1])
    assert f"`{SLOW_RUN}`" in readme and all(f"`{run}`" in readme for run in CI_SLOW_RUNS)


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _ci_with(tmp_path: Path, default_code: int, slow_code: int, zoo_code: int = 0) -> tuple[int, list[str]]:
    """.ci/run in a copy of the repo whose python3, pip and python are stubs: pytest's default
    run exits ``default_code``, its slow zoo run ``zoo_code``, its other slow run ``slow_code``;
    returns CI's exit code and the pytest runs it made, in order."""
    repo, stubs = tmp_path / "repo", tmp_path / "stubs"
    (repo / ".ci").mkdir(parents=True)
    stubs.mkdir()
    shutil.copy(REPO / ".ci" / "run", repo / ".ci" / "run")
    _executable(stubs / "python3", f'#!/bin/sh\nmkdir -p .venv/bin\necho \'export PATH="{stubs / "venv"}:$PATH"\' '
                                   '> .venv/bin/activate\n')
    (stubs / "venv").mkdir()
    _executable(stubs / "venv" / "pip", "#!/bin/sh\nexit 0\n")
    _executable(stubs / "venv" / "python", f'#!/bin/sh\necho "$*" >> {tmp_path / "runs.log"}\n'
                                           f'case "$*" in *"-n 2 {ZOO}"*) exit {zoo_code};; *"-m slow"*) exit {slow_code};; esac\n'
                                           f'exit {default_code}\n')
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}")
    done = subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    runs = (tmp_path / "runs.log").read_text().splitlines() if (tmp_path / "runs.log").exists() else []
    return done.returncode, runs


def test_ci_passes_when_every_run_passes_and_runs_the_default_run_first(tmp_path):
    code, runs = _ci_with(tmp_path, 0, 0)
    default_run = readme_commands()[1].split("&& python ")[-1]
    assert code == 0 and runs == [default_run] + [run.removeprefix("python ") for run in CI_SLOW_RUNS]


@pytest.mark.parametrize("default_code,slow_code,zoo_code",
                         [(1, 0, 0), (0, 1, 0), (0, 0, 1), (5, 0, 0), (0, 5, 0), (0, 0, 5), (2, 0, 0)])
def test_ci_fails_when_any_run_fails_or_collects_no_tests(tmp_path, default_code, slow_code, zoo_code):
    code, runs = _ci_with(tmp_path, default_code, slow_code, zoo_code)
    assert code != 0 and len(runs) == 3


class _Marked:
    def __init__(self, nodeid: str, slow: bool):
        self.nodeid, self.slow = nodeid, slow

    def get_closest_marker(self, name):
        return object() if name == "slow" and self.slow else None


class _Config:
    def __init__(self, markexpr: str, args: list[str]):
        self.option = type("Option", (), {"markexpr": markexpr})()
        self.args, self.deselected = args, []
        self.hook = type("Hook", (), {"pytest_deselected": lambda _, items: self.deselected.extend(items)})()


@pytest.mark.parametrize("markexpr,args,kept", [
    ("", ["tests"], ["t.py::fast"]),                                     # the README's command
    ("slow", ["tests"], ["t.py::fast", "t.py::slow", "t.py::slow_case[a]"]),  # -m: pytest's own selection
    ("", ["t.py::slow_case"], ["t.py::fast", "t.py::slow_case[a]"]),     # a slow test named by its node id
])
def test_the_default_run_leaves_out_slow_tests_unless_selected(markexpr, args, kept):
    from tests.conftest import pytest_collection_modifyitems

    items = [_Marked("t.py::fast", False), _Marked("t.py::slow", True), _Marked("t.py::slow_case[a]", True)]
    config = _Config(markexpr, args)
    pytest_collection_modifyitems(config, items)
    assert [i.nodeid for i in items] == kept
    assert [i.nodeid for i in config.deselected] == [n for n in ("t.py::slow", "t.py::slow_case[a]") if n not in kept]


def test_readme_example_commands_say_what_to_substitute_instead_of_real_looking_run_paths():
    for block in readme_commands():
        assert not re.search(r"runs/[\w.-]+-\d{8}-\d{6}", block), block
    assert "`RUN_NAME` stands for" in (REPO / "README.md").read_text()


def test_readme_opening_is_short_sentences():
    """The install-and-test part a newcomer reads first: no sentence over 40 words."""
    text = (REPO / "README.md").read_text().split("## What works today")[0]
    prose = re.sub(r"```.*?```", "\n\n", text, flags=re.S)
    items = re.split(r"\n\s*-\s+|\n\s*\n", prose)            # paragraphs and bullets
    sentences = [s for item in items for s in re.split(r"(?<=[.;])\s+", " ".join(item.split())) if s]
    long = [s for s in sentences if len(s.split()) > 40]
    assert len(sentences) > 10 and long == [], long
