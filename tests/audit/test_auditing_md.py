"""docs/auditing.md's opening commands run as written: the one-run audit and canary exposure
need a run trained with canaries or planted secrets, and no shipped recipe has them, so the
page trains one first (with the overrides it shows) and audits a checkpoint that run keeps."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from dpclip.recipe.load import load_recipe

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "auditing.md"


def opening_commands() -> list[list[str]]:
    block = re.search(r"```bash\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def trained_before(index: int, commands: list[list[str]]):
    """The recipe of the last `dpclip train` before command ``index``, overrides applied."""
    trains = [c for c in commands[:index] if c[:2] == ["dpclip", "train"]]
    assert trains, f"`{shlex.join(commands[index])}` audits a run the page does not train"
    recipe, *overrides = trains[-1][2:]
    return load_recipe(REPO / recipe, [o for o in overrides if not o.startswith("-")]), trains[-1]


@pytest.mark.parametrize("attack,needs", [("one-run", "canaries"), ("exposure", "exposure")])
def test_the_pages_audit_of_each_attack_follows_a_training_with_what_the_attack_needs(attack, needs):
    commands = opening_commands()
    index = next(i for i, c in enumerate(commands) if c[:2] == ["dpclip", "audit-mia"] and attack in c)
    recipe, train = trained_before(index, commands)
    assert getattr(recipe.audit, needs) is not None, f"{shlex.join(train)} trains without audit.{needs}"
    checkpoint = re.search(r"checkpoints/step_(\d+)", commands[index][2])
    if checkpoint:   # a checkpoint the run keeps: every_steps divides it
        step, every = int(checkpoint.group(1)), recipe.checkpoint.every_steps
        assert every and step % every == 0, f"{shlex.join(train)} keeps no checkpoint at step {step}"
