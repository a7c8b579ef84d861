import json

import numpy as np
import pytest

from dpclip.data.size import training_set_size
from dpclip.data.split import split_fingerprint, split_indices, split_sizes
from dpclip.errors import DpclipError
from dpclip.recipe.schema import BuiltinData, FilesData


@pytest.mark.parametrize("n, fraction", [(1797, 0.2), (10, 0.5), (3, 0.01), (3, 0.99), (1000, 0.1)])
def test_split_is_a_partition_with_at_least_one_on_each_side(n, fraction):
    train, test = split_indices(n, fraction, seed=3)
    assert len(train) >= 1 and len(test) >= 1
    assert np.array_equal(np.sort(np.concatenate([train, test])), np.arange(n))
    assert (len(train), len(test)) == split_sizes(n, fraction)


def test_split_is_deterministic_in_the_seed_and_changes_with_it():
    a = split_indices(500, 0.2, seed=0)
    b = split_indices(500, 0.2, seed=0)
    c = split_indices(500, 0.2, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert split_fingerprint(*a) == split_fingerprint(*b) != split_fingerprint(*c)


def test_split_of_one_example_is_refused():
    with pytest.raises(DpclipError):
        split_sizes(1, 0.5)


def test_digits_training_size_is_the_bundled_set_minus_the_test_share():
    from sklearn.datasets import load_digits

    total = len(load_digits().target)
    size = training_set_size(BuiltinData(source="builtin", name="digits", test_fraction=0.2))
    assert size == total - round(0.2 * total)


@pytest.mark.parametrize("fmt, content, rows", [
    ("csv", "a,b,label\n1,2,0\n3,4,1\n5,6,0\n", 3),
    ("jsonl", '{"a": 1}\n\n{"a": 2}\n', 2),
    ("json", json.dumps([{"a": 1}, {"a": 2}, {"a": 3}, {"a": 4}]), 4),
    ("json", json.dumps({"a": [1, 2], "b": [3, 4]}), 2),
    ("text", "one\ntwo\nthree\n", 3),
])
def test_local_file_rows_are_counted_without_loading_tensors(tmp_path, fmt, content, rows):
    path = tmp_path / f"train.{fmt}"
    path.write_text(content)
    data = FilesData(source="files", format=fmt, train=str(path), test=str(path))
    assert training_set_size(data) == rows


def test_missing_data_file_is_a_clear_error(tmp_path):
    data = FilesData(source="files", format="csv", train=str(tmp_path / "nope.csv"))
    with pytest.raises(DpclipError) as info:
        training_set_size(data)
    assert "not found" in info.value.message and info.value.hint
