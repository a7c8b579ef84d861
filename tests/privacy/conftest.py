from pathlib import Path

import pytest

from dpclip.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_recipe(tmp_path):
    """The quickstart recipe cut to a few steps, writing under tmp_path."""

    def make(*overrides):
        return load_recipe(REPO / "recipes" / "quickstart.yaml",
                           [f"output_dir={tmp_path / 'runs'}", "training.epochs=null", "training.steps=4",
                            "model.hidden=[16]", "checkpoint.every_steps=2", "eval.every_steps=null", *overrides])

    return make
