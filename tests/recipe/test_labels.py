"""data.labels: the classes declared in the recipe (public), checked before any row is read."""

from pathlib import Path

import pytest

from dpclip.errors import RecipeError
from dpclip.planning.plan import LABEL_SET, not_covered
from dpclip.recipe import load_recipe

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
FILES = "data={source: files, format: csv, train: data.csv, label_field: label}"


def error_of(*overrides) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(QUICKSTART, [FILES, *overrides])
    assert info.value.hint
    return info.value.message


def test_declared_labels_take_the_label_set_off_the_statement():
    assert LABEL_SET in not_covered(load_recipe(QUICKSTART, [FILES]))
    declared = load_recipe(QUICKSTART, [FILES, "data.labels=[cat, dog]"])
    assert declared.data.labels == ["cat", "dog"] and LABEL_SET not in not_covered(declared)


@pytest.mark.parametrize("labels, shown", [
    ("[1, 1]", "names 1 twice"),
    ("[cat]", "a classifier needs at least 2"),
    ("[true, false]", "not the boolean true"),
    ("[1, cat]", "mixes types"),
])
def test_declared_labels_that_cannot_be_classes_are_refused(labels, shown):
    assert shown in error_of(f"data.labels={labels}")


def test_declared_labels_need_the_column_they_label():
    message = error_of("data.label_field=null", "data.text_field=text", "data.labels=[0, 1]")
    assert "set data.label_field" in message
