"""A damaged checkpoint is refused, naming the file and the run's other checkpoints, before
anything is written; so are weights that do not fit the model the recipe rebuilds (docs/export.md)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dpclip.export import load_exported


@pytest.fixture
def run_copy(mlp_run, tmp_path):
    run = tmp_path / mlp_run.name
    shutil.copytree(mlp_run, run)
    return run


def _latest(run):
    return run / "checkpoints" / (run / "checkpoints" / "LATEST").read_text().strip()


def _truncate(path):
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


def _empty(path):
    path.write_bytes(b"")


def _corrupt_json(path):
    path.write_text("{not json")


def _wrong_shape(path):
    tensors = load_file(path)
    name = next(n for n, t in tensors.items() if t.dim() == 1)
    tensors[name] = torch.zeros(tensors[name].numel() + 1)
    save_file(tensors, str(path), metadata={"format": "pt", "dpclip_tied": "{}"})


@pytest.mark.parametrize("damage, file, says", [(_truncate, "model.safetensors", "damaged or incomplete"),
                                                (_empty, "model.safetensors", "damaged or incomplete"),
                                                (_corrupt_json, "model.json", "damaged or incomplete"),
                                                (_wrong_shape, "model.safetensors", "does not fit the mlp")])
def test_a_damaged_checkpoint_is_refused_with_the_other_checkpoints_and_nothing_written(cli, run_copy, tmp_path,
                                                                                       damage, file, says):
    latest = _latest(run_copy)
    others = sorted(p.name for p in latest.parent.glob("step_*") if p != latest)
    assert others
    damage(latest / file)
    out = tmp_path / "out"
    result = cli("export", run_copy, out)
    assert result.code == 2, result.err
    assert f"{latest.name}/{file}" in result.err and says in result.err
    assert f"--checkpoint {others[-1]}" in result.err
    assert "unexpected" not in result.err and "Traceback" not in result.err
    assert not out.exists() and not [p for p in tmp_path.glob(".*staging")]
    # the hint's checkpoint exports, and loads
    assert cli("export", run_copy, out, "--checkpoint", others[-1]).code == 0
    assert load_exported(out) is not None
    assert json.loads((out / "privacy.json").read_text())["checkpoint"] == others[-1]


def test_a_lora_alpha_edited_since_training_is_refused_rather_than_exported_as_another_model(lora_run, tmp_path):
    """A LoRA run's recipe.yaml whose adapter settings no longer match the checkpoint's model.json:
    alpha scales every adapter and the weights still load, so the export would write the
    adapter_config.json of a model that was not trained. Refused with the setting named, nothing
    written."""
    from dpclip.errors import DpclipError
    from dpclip.export import export_run
    from dpclip.recipe import load_recipe, recipe_to_yaml

    run = tmp_path / lora_run.name
    shutil.copytree(lora_run, run)
    (run / "recipe.yaml").write_text(recipe_to_yaml(load_recipe(run / "recipe.yaml", ["model.lora.alpha=64"])))
    with pytest.raises(DpclipError) as info:
        export_run(run, tmp_path / "out")
    assert "lora_alpha" in info.value.message and "model.json" in info.value.message and info.value.hint
    assert not (tmp_path / "out").exists()
