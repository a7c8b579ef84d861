import pytest


@pytest.fixture
def tiny_recipe(quickstart):
    """The quickstart recipe cut to a few steps of a 16-unit MLP, writing under tmp_path."""

    def make(*overrides):
        return quickstart("training.epochs=null", "training.steps=4", "model.hidden=[16]",
                          "checkpoint.every_steps=2", "eval.every_steps=null", *overrides)

    return make


def counted_releases(private) -> list:
    """A list that gets one entry per noisy step the engine of ``private`` (make_private's) releases."""
    released = []
    real = private.engine.privatize

    def counted():
        released.append(1)
        return real()
    private.engine.privatize = counted
    return released
