"""Planted secrets for canary exposure (dpclip/data/exposure.py): drawn from OS entropy, put
into the training text as often as the recipe says, never the controls."""

from __future__ import annotations

import pytest

from dpclip.data import load_data
from dpclip.data.exposure import ExposureSet, draw_exposure, stored_exposure, with_exposure, write_exposure_secret
from dpclip.errors import DpclipError
from dpclip.recipe import load_recipe
from dpclip.recipe.audit import Exposure
from tests.conftest import REPO

TEXT = ["data.num_examples=60", "training.epochs=null", "training.steps=2"]


def _text_data(*overrides):
    recipe = load_recipe(REPO / "recipes" / "gpt2-tiny-text.yaml", [*TEXT, *overrides])
    return recipe, load_data(recipe.data, recipe.seed)


def test_secrets_come_from_os_entropy_not_the_recipe_and_replay_from_the_stored_entropy():
    config = Exposure(length=8, repetitions=[1, 4], controls=3)
    first, second = draw_exposure(config), draw_exposure(config)
    assert first.secrets != second.secrets           # the same recipe, other secrets
    assert draw_exposure(config, first.entropy).secrets == first.secrets
    assert len(set(first.secrets)) == 5 and all(len(s) == 8 and set(s) <= set("0123456789") for s in first.secrets)
    assert first.repetitions == [1, 4, 0, 0, 0]


def test_the_planted_rows_hold_each_secret_as_often_as_asked_and_never_a_control():
    recipe, data = _text_data("audit.exposure={length: 4, repetitions: [1, 3], controls: 2}")
    exposure = draw_exposure(recipe.audit.exposure)
    planted = with_exposure(data, exposure)
    assert planted.num_train == data.num_train + 4
    texts = [data.tokenizer.decode(row) for row in planted.train["input_ids"][data.num_train:]]
    assert texts == [exposure.text(exposure.secrets[0])] + [exposure.text(exposure.secrets[1])] * 3
    every = [data.tokenizer.decode(row) for row in planted.train["input_ids"]]
    for control in exposure.secrets[2:]:
        assert not any(control in text for text in every)
    assert (planted.train["labels"][data.num_train:] == planted.train["input_ids"][data.num_train:]).logical_or(
        planted.train["attention_mask"][data.num_train:] == 0).all()   # next-token targets, padding ignored


def test_a_planted_text_longer_than_the_data_is_refused_with_a_hint():
    recipe, data = _text_data("data.max_length=16", "audit.exposure={template: 'the secret of the castle is "
                              "{secret}', length: 6}")
    with pytest.raises(DpclipError, match="max_length") as caught:
        with_exposure(data, draw_exposure(recipe.audit.exposure))
    assert caught.value.hint


def test_at_the_user_level_each_planted_secret_is_one_new_person():
    recipe = load_recipe(REPO / "recipes" / "user-text.yaml", ["data.num_examples=80", "data.num_users=20",
                                                               "audit.exposure={length: 3, repetitions: [2, 5]}"])
    data = load_data(recipe.data, recipe.seed)
    planted = with_exposure(data, draw_exposure(recipe.audit.exposure))
    new = planted.train_users[data.num_train:].tolist()
    assert new == [data.num_users] * 2 + [data.num_users + 1] * 5
    assert planted.num_users == data.num_users + 2


def test_a_resume_reads_the_secrets_back_and_refuses_a_changed_audit_block(tmp_path):
    config = Exposure(length=5, repetitions=[2])
    exposure = draw_exposure(config)
    write_exposure_secret(tmp_path, exposure)
    assert stored_exposure(tmp_path, config).secrets == exposure.secrets
    with pytest.raises(DpclipError, match="does not match") as caught:
        stored_exposure(tmp_path, Exposure(length=5, repetitions=[3]))
    assert caught.value.hint
    with pytest.raises(DpclipError, match="no audit"):
        stored_exposure(tmp_path / "elsewhere", config)


@pytest.mark.parametrize("block, message", [
    ("{template: 'no slot here'}", "exactly once"),
    ("{template: '{secret} and {secret}'}", "exactly once"),
    ("{alphabet: 'aa'}", "repeats"),
    ("{repetitions: []}", "at least 1"),
    ("{length: 1, alphabet: '01', repetitions: [1, 1], controls: 1}", None),
])
def test_bad_exposure_blocks_are_refused(block, message):
    from dpclip.errors import RecipeError
    if message is None:   # 3 secrets in a space of 2: refused when drawn
        recipe = load_recipe(REPO / "recipes" / "gpt2-tiny-text.yaml", [f"audit.exposure={block}"])
        with pytest.raises(DpclipError, match="distinct secrets"):
            draw_exposure(recipe.audit.exposure)
        return
    with pytest.raises(RecipeError, match=message):
        load_recipe(REPO / "recipes" / "gpt2-tiny-text.yaml", [f"audit.exposure={block}"])


def test_exposure_needs_a_language_model():
    from dpclip.errors import RecipeError
    with pytest.raises(RecipeError, match="causal-lm"):
        load_recipe(REPO / "recipes" / "quickstart.yaml", ["audit.exposure={}"])


@pytest.mark.parametrize("repetitions", [[1, 1], [1, 0]])
def test_a_secret_that_would_be_cut_off_is_refused_whichever_secret_it_is(repetitions):
    # The first secret fits; a later one (planted, or a control the audit ranks) takes more tokens:
    # 'é' is two bytes. Checking the first alone planted a truncated text, and measured that.
    recipe, data = _text_data("data.max_length=8")
    exposure = ExposureSet("{secret}", "aé", 4, ["aaaa", "éééé"], repetitions, entropy=0)
    with pytest.raises(DpclipError, match="max_length") as caught:
        with_exposure(data, exposure)
    assert "10 tokens" in caught.value.message and caught.value.hint
    assert "éééé" not in caught.value.message   # the answer key is never shown
