"""No file of an export names a folder of the exporting machine (docs/export.md, "The exported
recipe.yaml"): whoever holds the export would read the exporter's user name and layout in it.
The exported recipe cuts each local path to its last part; the other files an export writes must
too: a LoRA run's README.md and adapter_config.json (the pretrained base's folder), a custom
model's model_card.json (its module_dir) and the privacy.json of a run a search selected (the
search's folder)."""

import json
from pathlib import Path

import pytest
import transformers

from dpclip.errors import DpclipError
from dpclip.export import export_run
from dpclip.recipe import load_recipe
from dpclip.train.workflow import train
from tests.conftest import REPO
from tests.export.conftest import SHORT, TEXT
from tests.privacy.test_release_manifest import tiny_search

SECRET = "alice-private-folder"   # a folder name of the exporting machine


def _naming(out: Path, folder: Path) -> list[str]:
    """The files of ``out`` whose bytes hold the absolute path ``folder``."""
    return [str(p.relative_to(out)) for p in sorted(out.rglob("*"))
            if p.is_file() and str(folder).encode() in p.read_bytes()]


@pytest.mark.slow
def test_a_lora_export_over_a_pretrained_base_names_no_folder_of_the_exporting_machine(tmp_path):
    pretrained = tmp_path / SECRET / "gpt2"
    config = transformers.GPT2Config(vocab_size=259, n_layer=1, n_embd=16, n_head=2, n_positions=16)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(pretrained)
    recipe = load_recipe(REPO / "recipes" / "gpt2-tiny-lora.yaml", [
        f"output_dir={tmp_path / 'runs'}", "model.config=null", f"model.pretrained={pretrained}",
        "model.lora.target_modules=[c_attn]", *SHORT, *TEXT])
    out = tmp_path / "exported"
    export_run(train(recipe).run_dir, out)
    assert _naming(out, tmp_path / SECRET) == []
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "(local path)/gpt2"
    assert "(local path)/gpt2" in (out / "README.md").read_text()


def test_a_custom_models_card_names_no_folder_of_the_exporting_machine(tmp_path):
    module_dir = tmp_path / SECRET
    module_dir.mkdir()
    (module_dir / "dpclip_test_export_custom.py").write_text(
        "from torch import nn\n\ndef make(input_shape, num_classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n")
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"output_dir={tmp_path / 'runs'}", *SHORT,
        f"model={{kind: custom, target: 'dpclip_test_export_custom:make', module_dir: {module_dir}}}"])
    out = tmp_path / "exported"
    export_run(train(recipe).run_dir, out)
    assert _naming(out, module_dir) == []
    card = json.loads((out / "model_card.json").read_text())
    assert card["model"]["module_dir"] == f"(local path)/{SECRET}"


@pytest.mark.slow
def test_the_card_of_a_run_a_search_selected_names_no_folder_of_the_exporting_machine(tmp_path, monkeypatch):
    summary = tiny_search(tmp_path, monkeypatch, trials=1)
    search_dir = Path(summary["search_dir"])
    out = tmp_path / "exported"
    export_run(search_dir / summary["selected_run_dir"], out)
    assert _naming(out, tmp_path) == []
    card = json.loads((out / "privacy.json").read_text())
    assert card["selected_by_search"]["search_dir"] == f"(local path)/{search_dir.name}"
    # the search directory itself is no run: the hint names the run it selected (it said "a folder under runs/")
    with pytest.raises(DpclipError, match="is not a run directory") as refused:
        export_run(search_dir, tmp_path / "again")
    assert str(search_dir / summary["selected_run_dir"]) in refused.value.hint


def test_the_cards_statement_names_the_public_data_by_its_file_name_only(tmp_path):
    """The statement's "not covered by ε" line names the public data's file: in privacy.json,
    README.md and model_card.json it keeps the file's name, not its folders."""
    public = tmp_path / SECRET / "public.csv"
    public.parent.mkdir()
    rows = ["label," + ",".join(f"f{i}" for i in range(64))]
    rows += [f"{k % 10}," + ",".join(f"{(k * i) % 7 / 7:.3f}" for i in range(64)) for k in range(40)]
    public.write_text("\n".join(rows) + "\n")
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"output_dir={tmp_path / 'runs'}", *SHORT, "model.hidden=[8]", "continual={switch: {rule: step, at_step: 1}}",
        f"public={{source: files, format: csv, train: {public}, label_field: label}}"])
    out = tmp_path / "exported"
    export_run(train(recipe).run_dir, out)
    assert _naming(out, public.parent) == []
    card = json.loads((out / "privacy.json").read_text())
    assert any("files:(local path)/public.csv" in line for line in card["not_covered_by_epsilon"])
