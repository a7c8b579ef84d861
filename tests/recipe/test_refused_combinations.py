"""What training refuses on the recipe alone is refused by the recipe's validation, so that
`dpclip validate`, `account`, `tune-cost` and `train` refuse it alike (error: + hint:, no
traceback): `account` never prints a statement for a run that cannot exist."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
USER_TEXT = REPO / "recipes" / "user-text.yaml"
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
STAGES = "clipping.grouping={stages: ['^1$', '^3$']}"


@pytest.mark.parametrize("recipe, overrides, message", [
    (USER_TEXT, ["training.sampling=shuffle"], "training.sampling: shuffle"),
    (USER_TEXT, ["training.parallel=pipeline"], "pipeline stages"),
    (USER_TEXT, ["data.public_fraction=0.1", "public={source: builtin, name: synthetic-users}"],
     "public_fraction with users"),
    (QUICKSTART, ["training.parallel=pipeline", "training.precision=bf16", STAGES], "pipeline stages"),
    (QUICKSTART, ["training.parallel=fsdp", STAGES], "no stages"),
    (QUICKSTART, ["training.parallel=pipeline", "clipping.threshold={kind: dcsgd-p}", STAGES], "pipeline stages"),
])
@pytest.mark.parametrize("command", [["validate"], ["account"], ["tune-cost", "--no-measure", "--step-seconds", "1"],
                                     ["train"]])
def test_what_training_refuses_on_the_recipe_alone_every_command_refuses(cli, tmp_path, command, recipe, overrides,
                                                                        message):
    result = cli(*command[:1], recipe, *command[1:], f"output_dir={tmp_path / 'runs'}", *overrides)
    assert result.code != 0
    assert "error:" in result.err and message in result.err and "hint:" in result.err
    assert "Traceback" not in result.err and not (tmp_path / "runs").exists()
