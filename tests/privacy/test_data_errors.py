"""An attacker reads the stderr of a `dpclip train` that refused its data.

A refusal of a malformed data file names what the operator must fix: a row's value, its number,
the count of rows failing the check. Each is read from the (private) data and no DpEvent accounts
for it, so such an error says so of itself, as an error raised on a private batch does."""

from __future__ import annotations

import json

import pytest

from dpclip.data.user_sampler import number_people
from dpclip.errors import DpclipError

SECRET = "Jane Roe, HIV positive"


def _recipe(tmp_path, rows, unit="example", **data) -> str:
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = {"name": "t", "seed": 0, "output_dir": str(tmp_path / "runs"),
              "data": {"source": "files", "train": "data.jsonl", "format": "jsonl", "text_field": "text",
                       "label_field": "label", "tokenizer": "byte", "max_length": 16, "test_fraction": 0.5, **data},
              "model": {"kind": "hf", "task": "sequence-classification",
                        "config": {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 8,
                                   "num_attention_heads": 2, "intermediate_size": 8, "max_position_embeddings": 16}},
              "training": {"steps": 1, "batch_size": 2, "optimizer": {"kind": "sgd", "lr": 0.1}}, "privacy": {"epsilon": 8.0, "delta": 1e-5, "unit": unit}}
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    return str(path)


def _refusal(cli, recipe) -> str:
    result = cli("train", recipe, "--dry-run")
    assert result.code == 2 and "Traceback" not in result.err, result.err
    return " ".join(result.err.split())


def test_a_rows_label_quoted_in_a_refusal_is_labelled_not_covered(cli, tmp_path):
    # a label that is neither a whole number nor a string among whole numbers: the refusal quotes it
    rows = [{"text": "a", "label": 1}, {"text": "b", "label": 0}, {"text": "c", "label": {"note": SECRET}}]
    err = _refusal(cli, _recipe(tmp_path, rows))
    assert SECRET in err and "not covered by ε" in err


def test_a_rows_text_quoted_in_a_refusal_is_labelled_not_covered(cli, tmp_path):
    rows = [{"text": "a", "label": 1}, {"text": "b", "label": 0}, {"text": {"name": SECRET}, "label": 1}]
    err = _refusal(cli, _recipe(tmp_path, rows))
    assert SECRET in err and "not covered by ε" in err


def test_the_count_and_row_of_records_without_a_person_are_labelled_not_covered(cli, tmp_path):
    rows = [{"text": "a", "label": 1, "who": "x"}, {"text": "b", "label": 0, "who": None},
            {"text": "c", "label": 1, "who": "y"}, {"text": "d", "label": 0, "who": "z"}]
    err = _refusal(cli, _recipe(tmp_path, rows, unit="user", user_field="who", max_examples_per_user=1))
    assert "1 rows have no 'who' (first: row 2)" in err and "not covered by ε" in err


def test_a_person_id_quoted_by_make_privates_users_is_labelled_not_covered():
    with pytest.raises(DpclipError, match="not covered by ε") as refused:
        number_people(["a", SECRET, " " + SECRET])
    assert SECRET in refused.value.message


def test_a_features_value_quoted_in_a_refusal_is_labelled_not_covered(tmp_path):
    """A salary of 1e39 is infinite as a 32-bit float: the refusal names its row and value."""
    from dpclip.data import load_data
    from dpclip.recipe.schema import FilesData

    (tmp_path / "data.csv").write_text("salary,label\n1.5,0\n2.5,1\n1e39,1\n")
    data = FilesData(source="files", format="csv", train=str(tmp_path / "data.csv"), label_field="label")
    with pytest.raises(DpclipError) as refused:
        load_data(data, seed=0)
    assert "row 3: 1e+39" in refused.value.message and "not covered by ε" in refused.value.message


def test_a_text_files_undecodable_byte_quoted_in_a_refusal_is_labelled_not_covered(tmp_path):
    """Python's decoding error names the byte and its offset in the file: both read from the data."""
    from dpclip.data.files import read_text_lines

    (tmp_path / "notes.txt").write_bytes("a note\ncaf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(DpclipError) as refused:
        read_text_lines(tmp_path / "notes.txt")
    assert "0xe9" in refused.value.message and "not covered by ε" in refused.value.message
