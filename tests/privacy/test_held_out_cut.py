"""The attacker comparing the runs on your data file with and without one record: dpclip cuts the
held-out rows from the private data by a fixed-size draw (data.test_fraction), so where the record
adds one held-out row, the training split keeps its size and, when the record trains, another row
is moved out of it: the two training splits differ by a swap, not by one record. ε is for the
training split with the cut given; the statement says so, and a separate test file has no cut."""

from __future__ import annotations

import json
from pathlib import Path


from dpclip.data.split import split_indices
from dpclip.planning.plan import HELD_OUT_CUT, not_covered
from dpclip.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_one_record_added_to_the_data_can_swap_another_out_of_the_training_split():
    n, fraction = 12, 0.2            # 2 held out of 12, 3 of 13: the training split stays at 10 rows
    swaps = 0
    for key in range(200):
        train, _ = split_indices(n, fraction, key)
        added, _ = split_indices(n + 1, fraction, key + 10_000)
        assert len(added) == len(train)
        if n in added:               # the new record (row n) trains: one row of the data left the split
            swaps += 1
    # P(the record trains) = 10/13; 200 draws: 154 expected, sd 6; far from 0 either way
    assert swaps > 100


def _rows(path: Path) -> None:
    path.write_text("".join(json.dumps({"text": f"note {i}", "label": i % 2}) + "\n" for i in range(40)))


def test_the_statement_names_the_cut_of_the_held_out_rows_and_a_test_file_has_none(tmp_path):
    _rows(tmp_path / "train.jsonl")
    _rows(tmp_path / "test.jsonl")
    data = f"data={{source: files, format: jsonl, train: {tmp_path / 'train.jsonl'}, text_field: text, " \
           "label_field: label, max_length: 16}"
    cut = load_recipe(RECIPES / "bert-tiny-classify.yaml", [data])
    assert HELD_OUT_CUT in not_covered(cut)
    separate = load_recipe(RECIPES / "bert-tiny-classify.yaml",
                           [data.replace("label_field", f"test: {tmp_path / 'test.jsonl'}, label_field")])
    assert HELD_OUT_CUT not in not_covered(separate)
    assert HELD_OUT_CUT in not_covered(load_recipe(RECIPES / "quickstart.yaml", []))   # a builtin set is cut too
