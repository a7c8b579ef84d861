"""The attacker holding the model and model.json of a run on your own CSV: the output layer has
one row per class, and the number of classes is the largest whole-number label + 1, read from the
private labels. One record with a rare label (57 among 0-9) shows in the released model's shape,
so the statement lists the label set as not covered by ε; a builtin data set's classes are public."""

from __future__ import annotations

import json
import random

import pytest
import yaml


def _csv(path, rare: int | None) -> None:
    rng = random.Random(0)
    rows = ["x1,x2,label"] + [f"{rng.gauss(0, 1):.3f},{rng.gauss(0, 1):.3f},{i % 10}" for i in range(199)]
    rows.append(f"0.1,0.2,{rare if rare is not None else 3}")
    path.write_text("\n".join(rows) + "\n")


def _train(cli, tmp_path, source: str, **data):
    recipe = {"name": "labels", "output_dir": str(tmp_path / "runs"),
              "data": {"source": "files", "format": "csv", "train": str(tmp_path / "data.csv"),
                       "label_field": "label", "feature_fields": ["x1", "x2"], **data} if source == "files"
              else {"source": "builtin", "name": "digits"},
              "model": {"kind": "mlp", "hidden": [4]},
              "training": {"steps": 2, "batch_size": 20, "optimizer": {"kind": "sgd", "lr": 0.1}},
              "privacy": {"epsilon": 8.0, "delta": 1e-4, "accountant": "rdp"}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = cli("train", tmp_path / "recipe.yaml", "--json")
    assert result.code == 0, result.err
    run = next((tmp_path / "runs").iterdir())
    return run, cli("account", run).out


def test_a_rare_label_shows_in_the_released_model_and_the_statement_says_so(cli, tmp_path):
    _csv(tmp_path / "data.csv", rare=57)
    run, statement = _train(cli, tmp_path, "files")
    model_json = next(run.glob("checkpoints/step_*/model.json"))
    assert json.loads(model_json.read_text())["num_classes"] == 58   # what the attacker reads
    assert "the label set, read from the private data's labels" in " ".join(statement.split())


def test_builtin_classes_are_public(cli, tmp_path):
    run, statement = _train(cli, tmp_path, "builtin")
    assert "label set" not in statement


def test_a_causal_language_model_on_your_own_text_has_no_label_set_to_state(tmp_path):
    """Its targets are the text's next tokens (the vocabulary is the tokenizer's): no class read
    from the private data fixes its output size. A classifier on the same text has one."""
    from pathlib import Path

    from dpclip.planning.plan import LABEL_SET, not_covered
    from dpclip.recipe import load_recipe

    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": f"note {i}", "label": i % 2}) + "\n"
                                                 for i in range(40)))
    recipes = Path(__file__).resolve().parents[2] / "recipes"
    data = f"data={{source: files, format: jsonl, train: {tmp_path / 'text.jsonl'}, text_field: text, max_length: 16}}"
    causal = load_recipe(recipes / "gpt2-tiny-text.yaml", [data])
    assert LABEL_SET not in not_covered(causal)
    classifier = load_recipe(recipes / "bert-tiny-classify.yaml",
                             [data.replace("text_field: text", "text_field: text, label_field: label")])
    assert LABEL_SET in not_covered(classifier)


@pytest.mark.slow
def test_declared_labels_give_neighbouring_data_sets_one_model_shape_and_leave_the_statement(cli, tmp_path):
    """With data.labels the classes are the recipe's: the data set with the rare record (57) and its
    neighbour without it (a 3 in its place) release the same output size, and the label set is public."""
    declared = [*range(10), 57]
    shapes = []
    for rare in (57, None):
        case = tmp_path / str(rare)
        case.mkdir()
        _csv(case / "data.csv", rare=rare)
        run, statement = _train(cli, case, "files", labels=declared)
        shapes.append(json.loads(next(run.glob("checkpoints/step_*/model.json")).read_text())["num_classes"])
        assert "label set" not in statement
    assert shapes == [11, 11]
    exported = cli("export", run, tmp_path / "export")
    assert exported.code == 0, exported.err
    card = json.loads((tmp_path / "export" / "privacy.json").read_text())
    assert not any("label" in line for line in card["not_covered_by_epsilon"])


def test_a_record_whose_label_is_not_declared_is_refused_before_a_run_is_written(cli, tmp_path):
    _csv(tmp_path / "data.csv", rare=57)
    recipe = {"name": "labels", "output_dir": str(tmp_path / "runs"),
              "data": {"source": "files", "format": "csv", "train": "data.csv", "label_field": "label",
                       "labels": list(range(10))},
              "model": {"kind": "mlp", "hidden": [4]},
              "training": {"steps": 2, "batch_size": 20, "optimizer": {"kind": "sgd", "lr": 0.1}},
              "privacy": {"epsilon": 8.0, "delta": 1e-4, "accountant": "rdp"}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = cli("train", tmp_path / "recipe.yaml")
    assert result.code != 0 and "Traceback" not in result.err
    err = " ".join(result.err.split())
    assert "row 200 has the label 57" in err and "not one of the declared classes" in err and "hint:" in err
    assert "[quotes the data's rows: not covered by ε]" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
