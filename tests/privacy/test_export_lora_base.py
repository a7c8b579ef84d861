"""Attack on a LoRA export's ``base/`` (docs/export.md, "A LoRA base"; issue 26, leak 5).

``base/`` is published as the public model the adapter was trained on. An attacker who
holds the recipe rebuilds the public starting weights (the config and seed are in it) and
compares them with ``base/``: any tensor that differs was trained under DP, and shipping
it as "no private information" hides it from whoever strips the adapter. The trained
classification head (peft's ``modules_to_save``) must travel with the adapter instead.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from dpclip.data import load_data
from dpclip.export import export_run
from dpclip.models import build_model
from dpclip.recipe import load_recipe
from dpclip.rundir.checkpoint import latest_checkpoint, load_weights
from dpclip.train.workflow import train
from tests.conftest import REPO
from tests.export.conftest import SHORT, TEXT

LORA_BERT = [*TEXT, "model.config.num_hidden_layers=1", "model.config.hidden_size=16",
             "model.config.num_attention_heads=2", "model.config.intermediate_size=32",
             "model.config.max_position_embeddings=16",
             "model.lora={r: 4, alpha: 8, target_modules: [query, value]}"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny BERT classifier trained with LoRA adapters and a DP-trained head: (recipe, run_dir)."""
    out = tmp_path_factory.mktemp("runs")
    recipe = load_recipe(REPO / "recipes" / "bert-tiny-classify.yaml", [f"output_dir={out}", *SHORT, *LORA_BERT])
    return recipe, train(recipe).run_dir


def _public_start(recipe):
    """The starting weights as the public source gives them: the recipe's model without its
    adapters, built from the config and seed before any training (the attacker's rebuild)."""
    data = load_data(recipe.data, seed=recipe.seed)
    model, _ = build_model(recipe.model.model_copy(update={"lora": None}), data, seed=recipe.seed)
    return data, model.state_dict()


def test_a_lora_export_base_equals_the_public_starting_weights_bit_for_bit(lora_run, tmp_path):
    recipe, run_dir = lora_run
    out = tmp_path / "exported"
    export_run(run_dir, out)

    data, public = _public_start(recipe)
    base = load_file(str(out / "base" / "model.safetensors"))
    assert set(base) <= set(public)
    assert {"classifier.weight", "classifier.bias"} <= set(base)
    differing = [name for name, tensor in base.items() if not torch.equal(tensor, public[name])]
    assert differing == [], f"base/ holds weights trained under DP: {differing}"

    # The head did train (else the test proves nothing): the trained model's head differs
    # from the public one, so it must be in the adapter.
    trained, _ = build_model(recipe.model, data, seed=recipe.seed)
    load_weights(latest_checkpoint(run_dir), trained)
    head = trained.base_model.model.classifier.modules_to_save["default"].weight
    assert not torch.equal(head, public["classifier.weight"])


def test_a_lora_export_base_plus_adapter_reproduces_the_trained_model(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    recipe, run_dir = lora_run
    out = tmp_path / "exported"
    export_run(run_dir, out)

    data, _ = _public_start(recipe)
    trained, _ = build_model(recipe.model, data, seed=recipe.seed)
    load_weights(latest_checkpoint(run_dir), trained)
    base = AutoModelForSequenceClassification.from_pretrained(str(out / "base"))
    loaded = PeftModel.from_pretrained(base, str(out)).eval()
    ids = data.train["input_ids"][:8]
    mask = data.train["attention_mask"][:8]
    with torch.no_grad():
        expected = trained.eval()(input_ids=ids, attention_mask=mask).logits
        got = loaded(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, expected)


def test_an_export_refuses_a_base_it_cannot_show_is_the_public_start(lora_run, tmp_path):
    """A frozen tensor of the checkpoint that is not the public start (here nudged by one
    ulp, as a training bug that updated it would) means base/ cannot be shown public."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dpclip.errors import DpclipError

    run_dir = tmp_path / "run"
    shutil.copytree(lora_run[1], run_dir)
    weights = latest_checkpoint(run_dir) / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    name = "base_model.model.classifier.original_module.weight"
    tensors[name] = torch.nextafter(tensors[name], torch.full_like(tensors[name], torch.inf))
    save_file(tensors, str(weights), metadata=metadata)
    with pytest.raises(DpclipError, match="cannot be shown to carry no private information") as error:
        export_run(run_dir, tmp_path / "exported")
    assert name in str(error.value) and error.value.hint
    assert not (tmp_path / "exported").exists()
