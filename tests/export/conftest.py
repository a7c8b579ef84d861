"""Tiny trained runs to export: a causal GPT-2, a LoRA BERT classifier, the quickstart MLP."""

import pytest

from dpclip.recipe import load_recipe
from dpclip.train.workflow import train
from tests.conftest import REPO

SHORT = ["training.epochs=null", "training.steps=2", "training.batch_size=16", "training.micro_batch_size=16",
         "checkpoint.every_steps=null", "eval.every_steps=null"]
TEXT = ["data.num_examples=60", "data.max_length=16"]


def _train(tmp_path_factory, recipe_name, *overrides):
    out = tmp_path_factory.mktemp("runs")
    recipe = load_recipe(REPO / "recipes" / recipe_name, [f"output_dir={out}", *SHORT, *overrides])
    return train(recipe).run_dir


@pytest.fixture(scope="session")
def gpt2_run(tmp_path_factory):
    return _train(tmp_path_factory, "gpt2-tiny-text.yaml", *TEXT, "model.config.n_layer=1", "clipping.grouping=all-layer",
                  "model.config.n_embd=16", "model.config.n_head=2", "model.config.n_positions=16")


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory):
    return _train(tmp_path_factory, "bert-tiny-classify.yaml", *TEXT, "model.config.num_hidden_layers=1",
                  "model.lora={r: 4, alpha: 8, target_modules: [query, value, dense]}",
                  "model.config.hidden_size=16", "model.config.num_attention_heads=2",
                  "model.config.intermediate_size=32", "model.config.max_position_embeddings=16")


@pytest.fixture(scope="session")
def mlp_run(tmp_path_factory):
    return _train(tmp_path_factory, "quickstart.yaml", "model.hidden=[8]")
