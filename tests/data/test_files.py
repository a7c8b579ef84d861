import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dpclip.data import load_data
from dpclip.data.columns import examples_from_columns
from dpclip.data.size import training_set_size
from dpclip.errors import DpclipError
from dpclip.recipe.schema import FilesData


def files(path, fmt, **fields):
    return FilesData(source="files", format=fmt, train=str(path), **fields)


def write(path, content):
    path.write_text(content, encoding="utf-8")
    return path


CSV_WITH_STRING_LABELS = "x1,x2,kind\n0.5,1,dog\n1.5,2,cat\n2.5,3,dog\n3.5,4,bird\n4.5,5,cat\n"


def test_csv_with_string_labels_is_classification_with_sorted_class_ids(tmp_path):
    path = write(tmp_path / "train.csv", CSV_WITH_STRING_LABELS)
    data = load_data(files(path, "csv", label_field="kind", test=str(path)), seed=0)
    assert data.task == "classification" and data.num_classes == 3
    assert data.label_names == ["bird", "cat", "dog"]
    assert data.train["labels"].tolist() == [2, 1, 2, 0, 1]
    assert data.train["features"].dtype == torch.float32
    assert data.train["features"][:, 0].tolist() == [0.5, 1.5, 2.5, 3.5, 4.5]
    assert data.input_shape == (2,)


def test_a_separate_test_file_keeps_every_training_row_and_shares_the_class_ids(tmp_path):
    train = write(tmp_path / "train.csv", CSV_WITH_STRING_LABELS)
    test = write(tmp_path / "test.csv", "x1,x2,kind\n9,9,emu\n8,8,cat\n")
    data = load_data(files(train, "csv", label_field="kind", test=str(test)), seed=0)
    assert data.num_train == 5 and data.num_test == 2
    assert data.train_indices.tolist() == list(range(5)) and data.test_indices.tolist() == [0, 1]
    # Classes come from both files, so test labels unseen in training still get an id.
    assert data.label_names == ["bird", "cat", "dog", "emu"]
    assert data.test["labels"].tolist() == [3, 1]


def test_jsonl_with_float_labels_is_regression_on_the_chosen_feature_fields(tmp_path):
    rows = [{"a": i, "b": 2 * i, "ignored": "x", "y": i / 10} for i in range(10)]
    path = write(tmp_path / "train.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    data = load_data(files(path, "jsonl", label_field="y", feature_fields=["b", "a"], test_fraction=0.3), seed=1)
    assert data.task == "regression" and data.num_classes is None
    assert data.train["labels"].dtype == torch.float32
    features = torch.cat([data.train["features"], data.test["features"]])
    labels = torch.cat([data.train["labels"], data.test["labels"]])
    assert torch.allclose(features[:, 1] / 10, labels)  # column order follows feature_fields
    assert torch.equal(features[:, 0], 2 * features[:, 1])


def test_parquet_with_integer_labels_and_list_features_is_classification(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"pixels": [[float(i), float(i + 1), 0.0] for i in range(6)],
                             "label": [0, 1, 2, 0, 1, 2]}), path)
    data = load_data(files(path, "parquet", label_field="label", test=str(path)), seed=0)
    assert data.task == "classification" and data.num_classes == 3 and data.label_names is None
    assert data.input_shape == (3,) and data.train["features"][2].tolist() == [2.0, 3.0, 0.0]


def test_json_list_of_records_loads_like_jsonl(tmp_path):
    rows = [{"f": i * 1.0, "label": i % 2} for i in range(8)]
    path = write(tmp_path / "train.json", json.dumps(rows))
    data = load_data(files(path, "json", label_field="label", test=str(path)), seed=0)
    assert data.train["labels"].tolist() == [i % 2 for i in range(8)]
    assert data.train["features"].squeeze(1).tolist() == [i * 1.0 for i in range(8)]


def test_text_file_is_one_causal_lm_example_per_non_blank_line(tmp_path):
    path = write(tmp_path / "train.txt", "first line\n\nsecond, with ü\n   \nthird\n")
    data = load_data(files(path, "text", test=str(path), max_length=20), seed=0)
    assert data.task == "causal-lm" and data.num_train == 3
    assert [data.tokenizer.decode(row) for row in data.train["input_ids"]] == ["first line", "second, with ü", "third"]


def test_csv_text_column_with_a_label_is_text_classification(tmp_path):
    path = write(tmp_path / "train.csv", 'text,label\n"good, really",pos\nbad,neg\nfine,pos\n')
    data = load_data(files(path, "csv", text_field="text", label_field="label", test=str(path), max_length=16),
                     seed=0)
    assert data.task == "classification" and data.label_names == ["neg", "pos"]
    assert set(data.train) == {"input_ids", "attention_mask", "labels"}
    assert data.train["labels"].tolist() == [1, 0, 1]
    assert data.tokenizer.decode(data.train["input_ids"][0]) == "good, really"


BLANK_LINE_FILES = {
    "csv": "a,label\n1,0\n\n2,1\n   \n3,0\n4,1\n\n",
    "jsonl": '{"a": 1, "label": 0}\n\n{"a": 2, "label": 1}\n{"a": 3, "label": 0}\n{"a": 4, "label": 1}\n',
    "json": json.dumps({"a": [1, 2, 3, 4], "label": [0, 1, 0, 1]}),
    "text": "one\n\ntwo\nthree\n  \nfour\n",
}


@pytest.mark.parametrize("fmt", sorted(BLANK_LINE_FILES))
@pytest.mark.parametrize("separate_test", [False, True])
def test_loaded_training_set_has_the_size_accounting_counts_before_loading(tmp_path, fmt, separate_test):
    path = write(tmp_path / f"train.{fmt}", BLANK_LINE_FILES[fmt])
    label = None if fmt == "text" else "label"
    config = files(path, fmt, label_field=label, test=str(path) if separate_test else None, test_fraction=0.25)
    assert load_data(config, seed=0).num_train == training_set_size(config) == (4 if separate_test else 3)


def test_a_table_without_label_field_is_an_error_listing_its_columns(tmp_path):
    path = write(tmp_path / "train.csv", CSV_WITH_STRING_LABELS)
    with pytest.raises(DpclipError) as info:
        load_data(files(path, "csv"), seed=0)
    assert "label_field" in info.value.message and "x1, x2, kind" in info.value.hint


@pytest.mark.parametrize("fields", [{"label_field": "label"}, {"label_field": "kind", "feature_fields": ["x1", "x9"]}])
def test_an_unknown_column_is_an_error_listing_the_columns(tmp_path, fields):
    path = write(tmp_path / "train.csv", CSV_WITH_STRING_LABELS)
    with pytest.raises(DpclipError) as info:
        load_data(files(path, "csv", **fields), seed=0)
    missing = fields.get("feature_fields", ["label"])[-1]
    assert repr(missing) in info.value.message and "x1, x2, kind" in info.value.hint


def test_a_test_file_without_a_training_column_is_an_error(tmp_path):
    train = write(tmp_path / "train.csv", CSV_WITH_STRING_LABELS)
    test = write(tmp_path / "test.csv", "x1,kind\n1,dog\n")
    with pytest.raises(DpclipError) as info:
        load_data(files(train, "csv", label_field="kind", test=str(test)), seed=0)
    assert "'x2'" in info.value.message and "test" in info.value.message


def test_a_missing_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(DpclipError) as info:
        load_data(files(tmp_path / "absent.parquet", "parquet", label_field="y"), seed=0)
    assert "not found" in info.value.message and "absent.parquet" in info.value.message


def test_a_text_feature_column_is_refused_with_a_hint(tmp_path):
    path = write(tmp_path / "train.csv", "name,size,label\nrex,1,0\nfido,2,1\nmax,3,0\n")
    with pytest.raises(DpclipError) as info:
        load_data(files(path, "csv", label_field="label"), seed=0)
    assert "'name'" in info.value.message and "feature_fields" in info.value.hint


@pytest.mark.parametrize("labels", [[1, "cat", 2], [0, None, 1], [[0], [1], [0]]])
def test_labels_that_are_not_whole_numbers_or_strings_are_refused_for_classification(tmp_path, labels):
    rows = [{"x": float(i), "label": label} for i, label in enumerate(labels)]
    path = write(tmp_path / "train.jsonl", "\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DpclipError) as info:
        load_data(files(path, "jsonl", label_field="label"), seed=0)
    assert "label" in info.value.message and info.value.hint


def test_a_float_label_column_with_missing_values_is_refused(tmp_path):
    path = write(tmp_path / "train.csv", "x,y\n1,0.5\n2,\n3,1.5\n")
    with pytest.raises(DpclipError) as info:
        load_data(files(path, "csv", label_field="y"), seed=0)
    assert "missing" in info.value.message


def test_a_malformed_file_is_an_error_not_a_traceback(tmp_path):
    path = write(tmp_path / "train.jsonl", '{"x": 1, "label": 0}\n{"x": 2, "label"\n')
    with pytest.raises(DpclipError) as info:
        load_data(files(path, "jsonl", label_field="label"), seed=0)
    assert "cannot read" in info.value.message


def test_an_image_column_becomes_channels_first_images_scaled_to_the_unit_interval():
    pixels = np.random.default_rng(0).integers(0, 256, size=(5, 6, 7, 3), dtype=np.uint8)
    columns = {"image": pixels, "label": np.arange(5) % 2}
    examples = examples_from_columns([columns], label_field="label", text_field=None, feature_fields=None,
                                     tokenizer="byte", max_length=8, origin="test")
    features = examples.parts[0]["features"]
    assert examples.input_shape == (3, 6, 7)
    assert torch.allclose(features, torch.as_tensor(pixels.transpose(0, 3, 1, 2) / 255.0, dtype=torch.float32))
    grey = examples_from_columns([{"image": pixels[..., 0], "label": np.arange(5)}], label_field="label",
                                 text_field=None, feature_fields=None, tokenizer="byte", max_length=8, origin="test")
    assert grey.input_shape == (1, 6, 7)


def test_a_corrupt_parquet_file_is_a_clear_error_when_counted_before_loading(tmp_path):
    path = write(tmp_path / "bad.parquet", "this is not parquet\n")
    with pytest.raises(DpclipError, match="cannot read") as info:
        training_set_size(files(path, "parquet", label_field="label"))
    assert "bad.parquet" in info.value.message and info.value.hint


@pytest.mark.parametrize("value", ["inf", "-inf", "1e300"])
def test_a_feature_infinite_as_float32_is_refused_like_a_missing_one(tmp_path, value):
    path = write(tmp_path / "d.csv", f"x1,x2,label\n0.5,1,0\n1.5,2,1\n{value},3,0\n3.5,4,1\n")
    with pytest.raises(DpclipError, match="'x1' holds a value that is infinite as a 32-bit float") as info:
        load_data(files(path, "csv", label_field="label"), seed=0)
    assert "row 3" in info.value.message and "float32" in info.value.hint


def test_a_bad_jsonl_line_is_named_by_its_line_in_the_file(tmp_path):
    good = '{"x": 1, "label": 0}\n'
    path = write(tmp_path / "d.jsonl", good * 4 + "\n" + "{'x': 2, 'label': 1}\n" + good)
    with pytest.raises(DpclipError, match=r"d\.jsonl as jsonl: line 6 is not valid JSON") as info:
        load_data(files(path, "jsonl", label_field="label"), seed=0)
    assert "line 1" not in info.value.message and info.value.hint


def test_a_boolean_among_integer_labels_is_the_value_the_error_shows(tmp_path):
    path = write(tmp_path / "d.jsonl", "".join(f'{{"x": {i}, "label": {v}}}\n'
                                               for i, v in enumerate(["0", "1", "2", "true", "1"])))
    with pytest.raises(DpclipError, match=r"e\.g\. True\)"):
        load_data(files(path, "jsonl", label_field="label"), seed=0)



# Lines the csv module and pandas read differently: a quoted blank text, a whitespace that
# str.strip() knows and pandas does not (form feed, no-break space, U+2028, NEL), and a lone
# carriage return before a row of empty fields (pandas drops that row). Accounting (q = B/N,
# δ < 1/N) must count the rows training draws from, whatever the file holds.
@pytest.mark.parametrize("header, line", [("text", '" "'), ("text", "\x0c"), ("text", "\u00a0"),
                                          ("text", "\u2028"), ("text", "\x85"), ("text", "\r,"),
                                          ("text,label", "\r,"), ("a,label", "\r,")])
def test_a_csv_with_odd_lines_trains_on_as_many_rows_as_accounting_counts(tmp_path, header, line):
    rows = {"text": ["hello", "there", "bye", "now"], "text,label": ["hello,0", "there,1", "bye,0", "now,1"],
            "a,label": ["1,0", "2,1", "3,0", "4,1"]}[header]
    path = tmp_path / "train.csv"
    path.write_bytes("\n".join([header, *rows[:2], line, *rows[2:]]).encode() + b"\n")
    fields = {"text_field": "text"} if header.startswith("text") else {}
    config = files(path, "csv", label_field="label" if "label" in header else None, test=str(path), **fields)
    assert training_set_size(config) == load_data(config, seed=0).num_train


@pytest.mark.parametrize("content, fields, word", [
    ("text,label\ngood,pos\nNA,neg\nfine,pos\n", {"text_field": "text", "label_field": "label"}, "NA"),
    ("patient,age,label\np1,1,0\nnull,2,1\np2,3,0\np1,4,1\n", {"user_field": "patient", "label_field": "label"},
     "null"),
    ("x,kind\n1,dog\n2,None\n3,cat\n", {"label_field": "kind"}, "None"),
])
def test_a_csv_word_that_pandas_reads_as_missing_is_named_in_the_refusal(tmp_path, content, fields, word):
    """pandas reads NA, null, None (and more) as missing: the refusal said only "missing" (or showed
    nan) for a cell that visibly holds a word. It now names the row, the word and what to do."""
    path = write(tmp_path / "train.csv", content)
    with pytest.raises(DpclipError) as info:
        load_data(files(path, "csv", **fields), seed=0)
    column = next(iter(fields.values()))   # the column the word is in comes first
    assert f"row 2: {column!r} is written {word!r}" in info.value.message
    assert "pandas reads as missing" in info.value.message and "jsonl" in info.value.hint


def test_a_truly_empty_csv_cell_is_refused_as_missing_without_the_pandas_note(tmp_path):
    path = write(tmp_path / "train.csv", "patient,age,label\np1,1,0\n,2,1\np2,3,0\n")
    with pytest.raises(DpclipError) as info:
        load_data(files(path, "csv", label_field="label", user_field="patient"), seed=0)
    assert "rows have no 'patient'" in info.value.message and "pandas" not in info.value.message


NEIGHBOURS = "x,label\n" + "".join(f"{i},{i % 3}\n" for i in range(30))


@pytest.mark.parametrize("rare", ["", "0.5,57\n"])
def test_declared_labels_fix_the_classes_whatever_the_rows(tmp_path, rare):
    """Neighbouring data sets (with and without a record of the rare class 57) have the recipe's
    classes: output i is labels[i], and nothing about the label set is read from the rows."""
    path = write(tmp_path / "train.csv", NEIGHBOURS + rare)
    data = load_data(files(path, "csv", label_field="label", labels=[2, 0, 1, 57], test=str(path)), seed=0)
    assert data.num_classes == 4 and data.label_names == ["2", "0", "1", "57"]
    assert data.train["labels"][:4].tolist() == [1, 2, 0, 1]


def test_declared_string_labels_match_as_written(tmp_path):
    """A csv's "007" is the class "007" (pandas alone would read the number 7)."""
    path = write(tmp_path / "train.csv", "x,kind\n1,007\n2,dog\n3,007\n")
    data = load_data(files(path, "csv", label_field="kind", labels=["dog", "007"], test=str(path)), seed=0)
    assert data.train["labels"].tolist() == [1, 0, 1] and data.label_names == ["dog", "007"]


@pytest.mark.parametrize("fmt, content, shown", [
    ("csv", "x,label\n1,0\n2,1\n3,2\n", "row 3 has the label 2"),
    ("jsonl", '{"x": 1, "label": 0}\n{"x": 2, "label": "1"}\n', "row 2 has the label '1'"),
    ("jsonl", '{"x": 1, "label": 0}\n{"x": 2, "label": true}\n', "row 2 has the label True"),
])
def test_a_label_the_recipe_does_not_declare_is_refused_naming_its_row(tmp_path, fmt, content, shown):
    path = write(tmp_path / f"train.{fmt}", content)
    with pytest.raises(DpclipError) as refused:
        load_data(files(path, fmt, label_field="label", labels=[0, 1]), seed=0)
    assert shown in refused.value.message and "not one of the declared classes" in refused.value.message
    assert "[quotes the data's rows" in refused.value.message and "data.labels" in refused.value.hint


def test_a_test_file_label_the_recipe_does_not_declare_is_refused(tmp_path):
    train = write(tmp_path / "train.csv", "x,label\n1,0\n2,1\n")
    test = write(tmp_path / "test.csv", "x,label\n1,0\n2,5\n")
    with pytest.raises(DpclipError, match="row 2 of the test data has the label 5"):
        load_data(files(train, "csv", label_field="label", labels=[0, 1], test=str(test)), seed=0)


@pytest.mark.parametrize("label, shown", [(10**12, "the largest label in column 'label' is 1000000000000"),
                                          (10**30, "beyond a 64-bit integer")])
def test_a_whole_number_label_no_model_can_have_as_many_outputs_is_refused_with_a_hint(tmp_path, label, shown):
    """The class id is the label, so 10**12 asked for a 10**12-output layer (a memory error blaming the
    model), and 10**30 for an internal error; both are refused, pointing at data.labels."""
    rows = "".join(json.dumps({"x": i, "label": i % 2}) + "\n" for i in range(20))
    path = write(tmp_path / "train.jsonl", rows + json.dumps({"x": 1, "label": label}) + "\n")
    with pytest.raises(DpclipError) as refused:
        load_data(files(path, "jsonl", label_field="label"), seed=0)
    assert shown in refused.value.message and "data.labels" in refused.value.hint


@pytest.mark.parametrize("fmt, content", [
    ("text", "first note\nsecond note\n"),
    ("jsonl", '{"text": "first note"}\n{"text": "second note"}\n'),
    ("json", '[{"text": "first note"}, {"text": "second note"}]'),
    ("csv", "text\nfirst note\nsecond note\n"),
])
def test_a_byte_order_mark_is_read_as_the_encoding_not_as_the_first_rows_text(tmp_path, fmt, content):
    """Windows editors save UTF-8 with a byte order mark: it was trained on as the first text's first
    three bytes (format: text), or refused as invalid JSON with a hint that did not name it."""
    path = tmp_path / f"notes.{fmt}"
    path.write_bytes("\ufeff".encode() + content.encode())
    fields = {} if fmt == "text" else {"text_field": "text"}
    data = load_data(files(path, fmt, test=str(path), **fields), seed=0)
    assert data.tokenizer.decode(data.train["input_ids"][0]) == "first note"


def test_records_that_order_their_keys_differently_are_refused_when_the_order_makes_the_features(tmp_path):
    """The columns come in order of first appearance: a first record {income, age} before records
    {age, income} made income the model's first input, and its neighbour without that record age."""
    rows = [json.dumps({"age": 30 + i, "income": 10.0 * i, "label": i % 2}) for i in range(6)]
    path = write(tmp_path / "train.jsonl", "\n".join([json.dumps({"income": 5.0, "age": 99, "label": 1}), *rows]))
    with pytest.raises(DpclipError) as refused:
        load_data(files(path, "jsonl", label_field="label"), seed=0)
    assert "line 2: its keys come in another order" in refused.value.message
    assert "data.feature_fields" in refused.value.hint
    data = load_data(files(path, "jsonl", label_field="label", feature_fields=["age", "income"], test=str(path)), seed=0)
    assert data.train["features"][0].tolist() == [99.0, 5.0]
    shuffled = write(tmp_path / "text.jsonl", '{"text": "a", "label": 0}\n{"label": 1, "text": "b"}\n')
    assert load_data(files(shuffled, "jsonl", text_field="text", label_field="label", test=str(shuffled)), seed=0)
