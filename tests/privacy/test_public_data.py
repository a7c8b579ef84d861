"""Public data must never hold private rows, and is never counted as a member (docs/continual.md)."""

from __future__ import annotations

import numpy as np
import pytest

from dpclip.data import load_data
from dpclip.data.public import load_public
from dpclip.data.size import training_set_size
from dpclip.errors import DpclipError
from dpclip.train.workflow import train


def _table(path, rows):
    path.write_text("a,b,label\n" + "".join(f"{a},{b},{y}\n" for a, b, y in rows))
    return path


def test_carved_public_rows_are_disjoint_from_every_private_row(quickstart):
    recipe = quickstart("data.public_fraction=0.1", "public={source: builtin, name: digits}")
    private, public = load_data(recipe.data, seed=recipe.seed), None
    public = load_public(recipe, private)
    public_rows = set(public.train_indices) | set(public.test_indices)
    private_rows = set(private.train_indices) | set(private.test_indices)
    assert not public_rows & private_rows
    assert len(public_rows) == 180 and len(public_rows | private_rows) == 1797
    # `dpclip account RECIPE` counts the same N without loading tensors
    assert training_set_size(recipe.data) == private.num_train


def test_the_carve_depends_on_the_seed_not_on_the_split(quickstart):
    a = quickstart("data.public_fraction=0.1", "public={source: builtin, name: digits}")
    b = quickstart("data.public_fraction=0.1", "public={source: builtin, name: digits}", "data.test_fraction=0.3")
    assert np.array_equal(load_public(a).train_indices, load_public(b).train_indices)


def test_public_block_naming_the_private_source_is_refused(quickstart):
    recipe = quickstart("public={source: builtin, name: digits}")
    with pytest.raises(DpclipError, match="private data's own source") as refused:
        load_public(recipe, load_data(recipe.data, seed=0))
    assert "data.public_fraction" in refused.value.hint


def test_public_block_naming_the_same_file_is_refused(quickstart, tmp_path):
    data = _table(tmp_path / "d.csv", [(i, i % 3, i % 2) for i in range(40)])
    recipe = quickstart(f"data={{source: files, format: csv, train: {data}, label_field: label}}",
                        f"public={{source: files, format: csv, train: {data}, label_field: label}}",
                        "training.batch_size=8")
    with pytest.raises(DpclipError, match="own source"):
        load_public(recipe, load_data(recipe.data, seed=0))


def test_public_rows_identical_to_private_rows_are_refused(quickstart, tmp_path):
    data = _table(tmp_path / "d.csv", [(i, i % 3, i % 2) for i in range(40)])
    copy = _table(tmp_path / "p.csv", [(i, i % 3, i % 2) for i in range(35, 60)])  # rows 35..39 are private
    recipe = quickstart(f"data={{source: files, format: csv, train: {data}, label_field: label}}",
                        f"public={{source: files, format: csv, train: {copy}, label_field: label}}",
                        "training.batch_size=8")
    with pytest.raises(DpclipError, match="5 of the 25 public rows") as refused:
        load_public(recipe, load_data(recipe.data, seed=0))
    assert "disjoint" in refused.value.hint
    disjoint = _table(tmp_path / "q.csv", [(i, i % 3, i % 2) for i in range(100, 125)])
    recipe = recipe.model_copy(update={"public": recipe.public.model_copy(update={"train": str(disjoint)})})
    assert load_public(recipe, load_data(recipe.data, seed=0)).num_train == 20


def _labelled(path, rows, header="a,b,label"):
    path.write_text(header + "\n" + "".join(",".join(str(v) for v in row) + "\n" for row in rows))
    return path


def _blocks(private, public, fields="label_field: label", public_fields=None):
    return (f"data={{source: files, format: csv, train: {private}, {fields}}}",
            f"public={{source: files, format: csv, train: {public}, {public_fields or fields}}}")


def test_private_rows_in_a_public_file_are_refused_when_a_new_class_renumbers_the_labels(quickstart, tmp_path):
    """String classes are numbered per data set in sorted order: a public class "a" shifts the
    ids of "b" and "c", so rows compared by class id would all differ."""
    private_rows = [(i / 7, -i, "bc"[i % 2]) for i in range(40)]
    private = _labelled(tmp_path / "d.csv", private_rows)
    public = _labelled(tmp_path / "p.csv", private_rows + [(100 + i, i, "a") for i in range(10)])
    recipe = quickstart(*_blocks(private, public), "training.batch_size=8")
    with pytest.raises(DpclipError, match="40 of the 50 public rows"):
        load_public(recipe, load_data(recipe.data, seed=0))


@pytest.mark.parametrize("relabel", [lambda y: {"b": "c", "c": "b"}[y], lambda y: "d" + y],
                         ids=["labels swapped", "labels respelled"])
def test_private_rows_in_a_public_file_are_refused_whatever_their_labels(quickstart, tmp_path, relabel):
    """The inputs are the secret: every private row, its label changed or respelled ("d3" for
    3), must not pass as public."""
    private_rows = [(i / 7, -i, "bc"[i % 2]) for i in range(40)]
    private = _labelled(tmp_path / "d.csv", private_rows)
    relabelled = _labelled(tmp_path / "q.csv", [(a, b, relabel(y)) for a, b, y in private_rows])
    recipe = quickstart(*_blocks(private, relabelled), "training.batch_size=8")
    with pytest.raises(DpclipError, match="40 of the 40 public rows .* whatever the label"):
        load_public(recipe, load_data(recipe.data, seed=0))
    moved = _labelled(tmp_path / "m.csv", [(a + 1000, b, relabel(y)) for a, b, y in private_rows])
    recipe = quickstart(*_blocks(private, moved), "training.batch_size=8")
    assert load_public(recipe, load_data(recipe.data, seed=0)).num_train == 32   # other features: not refused


def test_private_sentences_in_a_public_file_are_refused_whatever_the_class_ids_and_max_length(quickstart, tmp_path):
    private_rows = [(f"patient {i} secret diagnosis {i * 7919 % 10007}", "bc"[i % 2]) for i in range(30)]
    private = _labelled(tmp_path / "d.csv", private_rows, "text,label")
    public = _labelled(tmp_path / "p.csv", private_rows + [(f"public sentence {i}", "a") for i in range(10)],
                       "text,label")
    fields = "text_field: text, label_field: label, tokenizer: byte, max_length: 16"
    for public_fields in (fields, fields.replace("16", "48")):   # every sentence is cut at 16 tokens in the private data
        recipe = quickstart(*_blocks(private, public, fields, public_fields), "training.batch_size=8")
        with pytest.raises(DpclipError, match="30 of the 40 public rows"):
            load_public(recipe, load_data(recipe.data, seed=0))
    disjoint = _labelled(tmp_path / "q.csv", [(f"public sentence {i}", "abc"[i % 3]) for i in range(20)], "text,label")
    recipe = quickstart(*_blocks(private, disjoint, fields), "training.batch_size=8")
    assert load_public(recipe, load_data(recipe.data, seed=0)).num_train == 16


def test_private_rows_in_a_public_file_with_its_columns_reordered_are_refused(quickstart, tmp_path):
    """A table's inputs are its named columns: the private rows written with two columns swapped are
    the same rows (and in another order the public features would feed the model's wrong inputs)."""
    private_rows = [(i / 7, -i, "bc"[i % 2]) for i in range(1, 41)]
    private = _labelled(tmp_path / "d.csv", private_rows)
    swapped = _labelled(tmp_path / "s.csv", [(b, a, y) for a, b, y in private_rows], header="b,a,label")
    recipe = quickstart(*_blocks(private, swapped), "training.batch_size=8")
    with pytest.raises(DpclipError, match=r"feature columns \['b', 'a'\] where the private data has \['a', 'b'\]") \
            as refused:
        load_public(recipe, load_data(recipe.data, seed=0))
    assert "public.feature_fields: [a, b]" in refused.value.hint
    ordered = quickstart(*_blocks(private, swapped, public_fields="label_field: label, feature_fields: [a, b]"),
                         "training.batch_size=8")
    with pytest.raises(DpclipError, match="40 of the 40 public rows"):   # in the private order: the same rows
        load_public(ordered, load_data(ordered.data, seed=0))
    other = _labelled(tmp_path / "o.csv", [(a + 1000, b, y) for a, b, y in private_rows], header="a,c,label")
    recipe = quickstart(*_blocks(private, other), "training.batch_size=8")
    with pytest.raises(DpclipError, match=r"feature columns \['a', 'c'\]"):   # not the private data's columns
        load_public(recipe, load_data(recipe.data, seed=0))


def test_public_text_with_another_tokenizer_is_refused(quickstart, tmp_path):
    """Token ids of two tokenizers cannot be compared (nor mean the same to the model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.train_from_iterator(["public sentence one"], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="</s>").save_pretrained(tmp_path / "tok")
    private = _labelled(tmp_path / "d.csv", [(f"private {i}", "bc"[i % 2]) for i in range(20)], "text,label")
    public = _labelled(tmp_path / "p.csv", [(f"public sentence {i}", "bc"[i % 2]) for i in range(20)], "text,label")
    fields = "text_field: text, label_field: label, max_length: 8, tokenizer: "
    recipe = quickstart(*_blocks(private, public, fields + "byte", fields + str(tmp_path / "tok")),
                        "training.batch_size=8")
    with pytest.raises(DpclipError, match="tokenized with") as refused:
        load_public(recipe, load_data(recipe.data, seed=0))
    assert "tokenizer" in refused.value.hint


def test_a_bad_public_block_is_named_in_the_error_and_its_fields_in_the_hint(quickstart, tmp_path):
    """Errors loading public: must not send the user to the private block's data.train."""
    private = _table(tmp_path / "d.csv", [(i, i % 3, i % 2) for i in range(40)])
    recipe = quickstart(f"data={{source: files, format: csv, train: {private}, label_field: label}}",
                        f"public={{source: files, format: csv, train: {tmp_path / 'missing.csv'}, label_field: label}}")
    with pytest.raises(DpclipError, match="^public data: data file not found") as refused:
        load_public(recipe, load_data(recipe.data, seed=0))
    assert "public.train" in refused.value.hint and "data.train" not in refused.value.hint


def test_carve_needs_a_public_block_of_the_same_source(quickstart):
    with pytest.raises(Exception, match="no public: block"):
        quickstart("data.public_fraction=0.1")
    recipe = quickstart("data.public_fraction=0.1", "public={source: builtin, name: synthetic-text}")
    with pytest.raises(DpclipError, match="but public: names builtin:synthetic-text"):
        load_public(recipe)


def test_membership_pool_of_a_continual_run_excludes_public_rows(quickstart, one_thread):
    """The audit's members and non-members (meta.json, rebuilt by build_pool) never name a public row."""
    from dpclip.audit.report import build_pool

    recipe = quickstart("data.public_fraction=0.1", "public={source: builtin, name: digits}", "training.epochs=null",
                        "training.steps=2", "continual={switch: {rule: step, at_step: 2}}")
    run_dir = train(recipe).run_dir
    public = load_public(recipe)
    public_rows = set(public.train_indices) | set(public.test_indices)
    pool = build_pool(run_dir, recipe)
    pool_rows = set(pool.data.train_indices) | set(pool.data.test_indices)
    assert pool.size == len(pool_rows) == 1797 - 180 and not pool_rows & public_rows


def test_hessian_diagnostics_on_carved_public_data_never_measure_a_private_row(quickstart):
    """Loading `public:` as plain data would read the whole digits set, private rows included,
    when the public rows are carved out of it: the diagnostics must get the carved rows."""

    import torch

    from dpclip.train.diagnostics import public_rows_of

    recipe = quickstart("data.public_fraction=0.1", "public={source: builtin, name: digits}")
    private = load_data(recipe.data, seed=recipe.seed)
    measured = public_rows_of(recipe, private)["features"]  # e.g. `dpclip diagnose`: no continual schedule
    assert len(measured) == load_public(recipe).num_train < 180
    carved = load_public(recipe)
    assert torch.equal(measured, carved.train["features"])
    assert not set(carved.train_indices) & (set(private.train_indices) | set(private.test_indices))


def test_the_statement_names_and_counts_every_public_file_the_run_reads(quickstart, tmp_path):
    """The switch rules read the public test file: ε does not cover it, so the statement (and
    the export card, which copies it) must name it and count its rows."""
    from dpclip.planning.plan import not_covered

    private = _table(tmp_path / "d.csv", [(i, i % 3, i % 2) for i in range(40)])
    train_file = _table(tmp_path / "p.csv", [(i, i % 3, i % 2) for i in range(100, 130)])
    test_file = _table(tmp_path / "v.csv", [(i, i % 3, i % 2) for i in range(200, 212)])
    recipe = quickstart(f"data={{source: files, format: csv, train: {private}, label_field: label}}",
                        f"public={{source: files, format: csv, train: {train_file}, test: {test_file}, "
                        "label_field: label}", "training.batch_size=8")
    [line] = [line for line in not_covered(recipe) if line.startswith("public data:")]
    assert f"files:{train_file}, 30 examples" in line and f"files:{test_file}, 12 examples" in line


def test_the_statement_names_a_hub_public_data_sets_config_and_splits():
    from dpclip.data.size import public_summary
    from dpclip.recipe.schema import BuiltinData, HFData

    public = HFData(source="hf", name="org/set", config="en", split="train[:500]", test_split="validation")
    summary = public_summary(BuiltinData(source="builtin", name="digits"), public)
    assert summary == "hf:org/set/en, split train[:500] and test split validation"


def test_only_private_leaves_the_public_data_it_never_uses_out_of_the_statement(quickstart):
    from dpclip.planning.plan import not_covered

    def public_lines(*overrides):
        recipe = quickstart("data.public_fraction=0.1", "public={source: builtin, name: digits}", *overrides)
        return [line for line in not_covered(recipe) if line.startswith("public data:")]

    assert public_lines("continual={schedule: only-private}") == []
    assert len(public_lines("continual={schedule: switch}")) == 1
    # Hessian diagnostics measured on the public rows are released: the public data is used
    assert len(public_lines("continual={schedule: only-private}", "diagnostics={every_steps: 5, data: public}")) == 1
