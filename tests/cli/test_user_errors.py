"""Messages a new user meets in a fresh clone name their real cause (issue 50, items 6 and 9)."""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_recipe_named_with_the_other_yaml_extension_is_pointed_at(cli, tmp_path):
    shutil.copy(REPO / "recipes" / "quickstart.yaml", tmp_path / "mine.yaml")
    result = cli("validate", tmp_path / "mine.yml")
    assert result.code == 2 and "error: recipe file not found" in result.err
    assert f"did you mean {tmp_path / 'mine.yaml'}?" in result.err.replace("\n", "")
    assert "no recipes/ folder" not in result.err


def test_a_shipped_recipes_name_with_the_wrong_extension_in_the_repository_is_pointed_at(cli):
    result = cli("validate", REPO / "recipes" / "quickstart.yml")
    assert result.code == 2 and "did you mean" in result.err and "no recipes/ folder" not in result.err


def test_accounting_a_run_directory_that_does_not_exist_says_so(cli, tmp_path):
    result = cli("account", tmp_path / "runs" / "quickstart-20261121-101500")
    assert result.code == 2
    assert "error: no run directory or recipe file at" in result.err and "recipe file not found" not in result.err
    assert "hint: a run directory is a folder `dpclip train` created" in result.err


def test_a_typo_in_an_override_is_blamed_on_the_override_not_the_file(cli):
    result = cli("account", REPO / "recipes" / "quickstart.yaml", "privacy.epsilonn=3")
    assert result.code == 2
    err = result.err.replace("\n", "")
    assert err.startswith("error: privacy.epsilonn: unknown key (did you mean 'epsilon'?)")
    assert "(from your key=value override, not quickstart.yaml)" in err
    assert not err.startswith(f"error: {REPO / 'recipes' / 'quickstart.yaml'}")
    bad_value = cli("validate", REPO / "recipes" / "quickstart.yaml", "training.batch_size=abc")
    assert "training.batch_size" in bad_value.err and "(from your key=value override, not quickstart.yaml)" in \
        bad_value.err.replace("\n", "")


def test_an_error_in_the_file_itself_still_names_the_file(cli, tmp_path):
    text = (REPO / "recipes" / "quickstart.yaml").read_text().replace("privacy: {epsilon:", "privacy: {epsilonn: 3, epsilon:", 1)
    (tmp_path / "typo.yaml").write_text(text)
    result = cli("validate", tmp_path / "typo.yaml", "eval.every_steps=5")
    assert f"error: {tmp_path / 'typo.yaml'}: privacy.epsilonn: unknown key" in result.err.replace("\n", "")
