"""docs/cli.md names every option of every command, and no option a command does not have:
each `## \\`dpclip COMMAND ...\\`` section against the command's own parameters (its --help)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from dpclip.cli.main import app

REPO = Path(__file__).resolve().parents[2]
CLI_MD = REPO / "docs" / "cli.md"
OPTION = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
#: another command's option named in a section, as a cross-reference (not this command's)
CROSS_REFERENCES = re.compile(r"tune-cost --run|\(tuning\.md#--run\)")


def sections(text: str) -> dict[str, str]:
    """Each `dpclip COMMAND` section's text, by command."""
    found = {}
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        match = re.match(r"`dpclip ([\w-]+)", section)
        if match:
            found[match.group(1)] = section
    return found


def named_options(section: str) -> set[str]:
    return set(OPTION.findall(CROSS_REFERENCES.sub("", section)))


def command_options(name: str) -> list[tuple[str, ...]]:
    """The command's options, each as its names (``--measure``/``--no-measure`` are one)."""
    command = typer.main.get_command(app).commands[name]
    leaves = command.commands.values() if isinstance(command, typer.core.TyperGroup) else [command]
    return [tuple(o for o in param.opts + param.secondary_opts if o.startswith("--"))
            for leaf in leaves for param in leaf.params if param.param_type_name == "option"]


COMMANDS = sorted(typer.main.get_command(app).commands)


def test_cli_md_has_a_section_for_every_command():
    assert sorted(sections(CLI_MD.read_text(encoding="utf-8"))) == COMMANDS


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_cli_md_names_exists_and_every_option_is_named(name):
    section = sections(CLI_MD.read_text(encoding="utf-8"))[name]
    options = command_options(name)
    known = {o for names in options for o in names}
    unknown = named_options(section) - known
    assert not unknown, f"docs/cli.md names options `dpclip {name}` does not have: {sorted(unknown)}"
    unnamed = [names[0] for names in options if names and not set(names) & named_options(section)]
    assert not unnamed, f"docs/cli.md's `dpclip {name}` section does not name {unnamed}"


def test_the_check_sees_a_renamed_option_and_an_undocumented_one():
    section = "`dpclip bench RECIPE.yaml`\n--repeats, --warmup, --thread, --json"
    assert named_options(section) - {o for names in command_options("bench") for o in names} == {"--thread"}
    missing = [names[0] for names in command_options("bench") if not set(names) & named_options(section)]
    assert "--threads" in missing and "--repeats" not in missing


PAGES = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
INVOCATION = re.compile(r"\bdpclip (?:--debug )?([a-z][\w-]*)((?: +[^\s#|`]+)*)")


def shown_commands(text: str) -> list[str]:
    """The code a page shows: its inline code spans and the lines of its code blocks."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return [line for block in blocks for line in block.splitlines()] + re.findall(r"`([^`\n]+)`", prose)


def unknown_options(text: str) -> list[str]:
    """`dpclip COMMAND ... --option` in the page's code whose option the command does not have."""
    commands = {name: {o for names in command_options(name) for o in names} | {"--help"} for name in COMMANDS}
    bad = []
    for code in shown_commands(text):
        for name, rest in INVOCATION.findall(code):
            if name in commands:
                bad += [f"dpclip {name} {o}" for o in OPTION.findall(rest) if o not in commands[name]]
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_dpclip_command_a_page_shows_uses_options_the_command_has(page):
    assert not unknown_options(page.read_text(encoding="utf-8")), unknown_options(page.read_text(encoding="utf-8"))


def test_the_page_check_sees_a_renamed_option_in_a_code_block_and_in_inline_code():
    page = "```bash\ndpclip account --eps 8 --dataset 60000   # --nothing here\n```\nThen `dpclip bench R.yaml --no-flor`."
    assert unknown_options(page) == ["dpclip account --dataset", "dpclip bench --no-flor"]
