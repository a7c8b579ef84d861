"""The continual: section and the public: block in a recipe (docs/continual.md)."""

from __future__ import annotations

import pytest

from dpclip.errors import DpclipError

PUBLIC = ("data.public_fraction=0.1", "public={source: builtin, name: digits}")


def test_a_public_block_alone_gets_the_switch_schedule(quickstart):
    recipe = quickstart(*PUBLIC)
    assert recipe.continual.schedule == "switch" and recipe.continual.switch.rule == "early-stopping"
    assert recipe.continual.at_switch.reset == ["m"]


@pytest.mark.parametrize("overrides, message", [
    (("continual={schedule: dpmd}",), "needs public data"),
    ((*PUBLIC, "continual={switch: {rule: step}}"), "needs at_step"),
    ((*PUBLIC, "continual={switch: {rule: step, at_step: 900}}"), "beyond the cap"),
    ((*PUBLIC, "continual={switch: {at_step: 9}}"), "at_step is for rule 'step'"),
    ((*PUBLIC, "continual={schedule: sample, at_switch: {reinit_head: true}}"), "applies to the switch schedule"),
    ((*PUBLIC, "continual={at_switch: {reset: [m, m]}}"), "reset lists a state twice"),
    ((*PUBLIC, "continual={at_switch: {reset: [w]}}"), "reset"),
    (("data.public_fraction=0.1",), "no public: block"),
])
def test_bad_continual_sections_are_refused_with_the_field(quickstart, overrides, message):
    with pytest.raises(DpclipError, match=message):
        quickstart(*overrides)


def test_cli_refuses_private_rows_declared_public_with_a_hint(cli, tmp_path):
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    result = cli("train", recipe, f"output_dir={tmp_path}", "public={source: builtin, name: digits}",
                 "training.epochs=null", "training.steps=2")
    assert result.code != 0
    assert "error:" in result.err and "private data's own source" in result.err
    assert "hint:" in result.err and "data.public_fraction" in result.err and "Traceback" not in result.err
