"""Every shipped recipe builds its data, model and engine and takes real private steps."""

from pathlib import Path

import pytest

from dpclip.recipe import load_recipe
from dpclip.train.workflow import train

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


#: the slowest on the CPU (10 s, its selective scan; 3-6 s the other transformers but one) run with the slow
#: tests: gpt2-tiny-text keeps a transformers recipe in the default run
SLOW = {"mamba-tiny-text", "continual-gpt2-text", "gpt2-tiny-lora", "user-text", "bert-tiny-classify",
        "mixtral-tiny-text"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW else p for p in RECIPES],
                         ids=[p.stem for p in RECIPES])
def test_shipped_recipe_takes_two_private_steps(path, tmp_path):
    # a continual recipe's public phase is cut to a few public steps (they are not what is tested here)
    public = ["continual.switch.max_public_steps=3"] if "\ncontinual:" in path.read_text() else []
    # banded MF needs at least b steps (one cycle): it takes that many
    steps = max(2, load_recipe(path).privacy.mechanism.bands)
    recipe = load_recipe(path, [f"output_dir={tmp_path}", "training.epochs=null", f"training.steps={steps}",
                                "eval.every_steps=null", "eval.batch_size=512", *public])
    result = train(recipe)
    assert result.stopped == "completed" and result.steps_done == steps
    assert 0 < result.epsilon <= recipe.privacy.epsilon
    assert result.final_eval and all(value == value for value in result.final_eval.values())  # no NaN
