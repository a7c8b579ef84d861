"""Relative paths in a recipe are relative to the recipe file, not to the current directory."""

import sys
from pathlib import Path

import yaml

from dpclip.recipe import load_recipe, recipe_to_yaml


def _write(path: Path, recipe: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe))
    return path


def _files_recipe(**data) -> dict:
    return {"name": "paths", "data": {"source": "files", "format": "csv", "label_field": "y", **data},
            "model": {"kind": "mlp", "hidden": [8]},
            "training": {"steps": 2, "batch_size": 8, "optimizer": {"kind": "sgd", "lr": 0.1}},
            "privacy": {"epsilon": 8.0, "delta": 1e-5}}


def test_data_paths_in_a_recipe_file_resolve_against_its_directory(tmp_path, monkeypatch):
    recipe_file = _write(tmp_path / "project" / "recipe.yaml", _files_recipe(train="data/train.csv",
                                                                            test="../shared/test.csv"))
    monkeypatch.chdir(tmp_path)  # anywhere but the recipe's folder
    recipe = load_recipe(recipe_file)
    assert recipe.data.train == str(tmp_path / "project" / "data" / "train.csv")
    assert recipe.data.test == str(tmp_path / "shared" / "test.csv")
    # The resolved recipe (what a run saves) reloads to the same paths from anywhere.
    saved = _write(tmp_path / "elsewhere" / "recipe.yaml", yaml.safe_load(recipe_to_yaml(recipe)))
    assert load_recipe(saved).data.train == recipe.data.train


def test_path_overrides_resolve_against_the_current_directory(tmp_path, monkeypatch):
    recipe_file = _write(tmp_path / "project" / "recipe.yaml", _files_recipe(train="train.csv"))
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(recipe_file, ["data.train=mine.csv"])
    assert recipe.data.train == str(tmp_path / "mine.csv")


def test_names_that_may_be_in_the_hub_cache_stay_names_unless_a_local_folder_exists(tmp_path, monkeypatch):
    (tmp_path / "project" / "tok").mkdir(parents=True)
    recipe = _files_recipe(train="train.csv", tokenizer="tok")
    recipe_file = _write(tmp_path / "project" / "recipe.yaml", recipe)
    monkeypatch.chdir(tmp_path)
    assert load_recipe(recipe_file).data.tokenizer == str(tmp_path / "project" / "tok")
    recipe["data"]["tokenizer"] = "gpt2"
    assert load_recipe(_write(recipe_file, recipe)).data.tokenizer == "gpt2"
    recipe["data"]["tokenizer"] = "./gpt2"  # explicitly relative: a path even if missing
    assert load_recipe(_write(recipe_file, recipe)).data.tokenizer == str(tmp_path / "project" / "gpt2")


def test_a_local_datasets_folder_given_to_source_hf_resolves_like_a_path(tmp_path, monkeypatch):
    (tmp_path / "project" / "my_data").mkdir(parents=True)
    recipe = _files_recipe(train="x")
    recipe["data"] = {"source": "hf", "name": "my_data", "text_field": "text"}
    recipe_file = _write(tmp_path / "project" / "recipe.yaml", recipe)
    monkeypatch.chdir(tmp_path)
    assert load_recipe(recipe_file).data.name == str(tmp_path / "project" / "my_data")
    recipe["data"]["name"] = "user/some-dataset"
    assert load_recipe(_write(recipe_file, recipe)).data.name == "user/some-dataset"


def test_pretrained_model_directory_resolves_against_the_recipe(tmp_path, monkeypatch):
    (tmp_path / "project" / "models" / "tiny").mkdir(parents=True)
    recipe = _files_recipe(train="train.csv")
    recipe["model"] = {"kind": "hf", "task": "sequence-classification", "pretrained": "models/tiny"}
    recipe_file = _write(tmp_path / "project" / "recipe.yaml", recipe)
    monkeypatch.chdir(tmp_path)
    assert load_recipe(recipe_file).model.pretrained == str(tmp_path / "project" / "models" / "tiny")


def test_a_custom_model_beside_the_recipe_loads_without_pythonpath(tmp_path, monkeypatch):
    from dpclip.data import load_data
    from dpclip.models import build_model

    project = tmp_path / "project"
    project.mkdir()
    (project / "beside_recipe_net.py").write_text(
        "import torch.nn as nn\n"
        "def build(input_shape, num_classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n")
    recipe = _files_recipe(train="x")
    recipe["data"] = {"source": "builtin", "name": "digits"}
    recipe["model"] = {"kind": "custom", "target": "beside_recipe_net:build"}
    recipe_file = _write(project / "recipe.yaml", recipe)
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    loaded = load_recipe(recipe_file)
    assert loaded.model.module_dir == str(project)
    model, _ = build_model(loaded.model, load_data(loaded.data, seed=0))
    assert model[1].out_features == 10
    assert sys.path == path_before, "the recipe's folder is on sys.path only while the module is imported"
    sys.modules.pop("beside_recipe_net", None)
