import pytest


@pytest.fixture
def small_recipe(quickstart):
    """The quickstart recipe, shortened to a few seconds of training, writing under tmp_path."""

    def make(*overrides):
        return quickstart("training.epochs=null", "training.steps=12", "checkpoint.every_steps=4",
                          "eval.every_steps=6", *overrides)

    return make
