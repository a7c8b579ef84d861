from pathlib import Path

import pytest

from dpclip.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_recipe(tmp_path):
    """The quickstart recipe, shortened to a few seconds of training, writing under tmp_path."""

    def make(*overrides):
        return load_recipe(REPO / "recipes" / "quickstart.yaml",
                           [f"output_dir={tmp_path / 'runs'}", "training.epochs=null", "training.steps=12",
                            "checkpoint.every_steps=4", "eval.every_steps=6", *overrides])

    return make
