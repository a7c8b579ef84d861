"""The README tells a newcomer the truth: its test command is what CI runs."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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


def test_ci_runs_the_readme_test_command_verbatim():
    tests = readme_commands()[1]
    ci = (REPO / ".ci" / "run").read_text()
    assert tests in ci.splitlines()


def test_ci_treats_pytest_collecting_nothing_as_failure():
    ci = (REPO / ".ci" / "run").read_text()
    assert '"$status" -eq 5' in ci and "exit 1" in ci
