from pathlib import Path

import pytest

from dpclip.recipe import apply_overrides, read_yaml, validate_recipe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny(tmp_path):
    """The quickstart recipe made tiny (2 steps, 8 hidden units), as (plain mapping, validated recipe)."""

    def make(*overrides):
        data = apply_overrides(read_yaml(REPO / "recipes" / "quickstart.yaml"),
                               [f"output_dir={tmp_path / 'runs'}", "training.epochs=null", "training.steps=2",
                                "model.hidden=[8]", *overrides])
        return data, validate_recipe(data)

    return make
