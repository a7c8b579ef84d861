"""dpclip export (dpclip/export/): what the ecosystem loads gives the checkpoint's outputs,
and the card says what the run spent (docs/export.md)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from dpclip.data import load_data
from dpclip.errors import DpclipError
from dpclip.export import export_run
from dpclip.models import build_model
from dpclip.rundir.checkpoint import latest_checkpoint, load_weights
from dpclip.rundir.run import RunDir


def _checkpoint_model(run_dir):
    """The model as training built it, with the latest checkpoint's weights."""
    recipe = RunDir(run_dir).recipe()
    data = load_data(recipe.data, seed=recipe.seed)
    model, _ = build_model(recipe.model, data, seed=recipe.seed)
    load_weights(latest_checkpoint(run_dir), model)
    return model.eval(), data


def test_an_exported_gpt2_loads_with_from_pretrained_and_gives_the_checkpoints_logits(gpt2_run, tmp_path):
    from transformers import AutoModelForCausalLM

    result = export_run(gpt2_run, tmp_path / "out")
    assert result.kind == "transformers"
    for name in ("config.json", "model.safetensors", "README.md", "privacy.json", "recipe.yaml",
                 "dpclip_tokenizer.json"):
        assert (tmp_path / "out" / name).is_file(), name
    model, data = _checkpoint_model(gpt2_run)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    ids = data.train["input_ids"][:4]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    tokenizer = json.loads((tmp_path / "out" / "dpclip_tokenizer.json").read_text())
    assert tokenizer["kind"] == "byte" and tokenizer["max_length"] == 16


def test_a_lora_export_loads_with_peft_on_its_base_and_gives_the_checkpoints_logits(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    result = export_run(lora_run, tmp_path / "out")
    assert result.kind == "peft"
    assert {"adapter_config.json", "adapter_model.safetensors", "base/config.json"} <= set(result.files)
    model, data = _checkpoint_model(lora_run)
    base = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "base")
    loaded = PeftModel.from_pretrained(base, tmp_path / "out").eval()
    ids = data.train["input_ids"][:4]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        assert torch.equal(loaded(input_ids=ids).logits, expected)
        # the adapter matters: the bare base gives other outputs
        assert not torch.equal(AutoModelForSequenceClassification.from_pretrained(
            tmp_path / "out" / "base").eval()(input_ids=ids).logits, expected)
    config = json.loads((tmp_path / "out" / "base" / "config.json").read_text())
    assert list(config["id2label"].values()) == data.label_names


def test_load_exported_gives_back_the_module_of_a_plain_torch_export(mlp_run, gpt2_run, tmp_path):
    from dpclip.export import load_exported

    export_run(mlp_run, tmp_path / "out")
    loaded = load_exported(tmp_path / "out")   # from the card alone: no recipe, no data
    model, data = _checkpoint_model(mlp_run)
    x = data.train["features"][:4]
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert not loaded.training
    export_run(gpt2_run, tmp_path / "hf")
    with pytest.raises(DpclipError, match="model_card.json") as info:
        load_exported(tmp_path / "hf")
    assert "from_pretrained" in info.value.hint


def test_an_mlp_export_is_safetensors_and_a_model_card_that_rebuilds_it(mlp_run, tmp_path):
    result = export_run(mlp_run, tmp_path / "out")
    assert result.kind == "safetensors"
    card = json.loads((tmp_path / "out" / "model_card.json").read_text())
    assert card["model"] == {"kind": "mlp", "hidden": [8], "activation": card["model"]["activation"]} or \
        card["model"]["hidden"] == [8]
    assert card["input_shape"] == [64] and card["num_classes"] == 10
    model, data = _checkpoint_model(mlp_run)
    fresh, _ = build_model(RunDir(mlp_run).recipe().model, data, seed=123)
    fresh.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))
    x = data.train["features"][:4]
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_the_card_states_the_privacy_guarantee_and_no_exact_diagnostics(gpt2_run, tmp_path):
    export_run(gpt2_run, tmp_path / "out")
    card = json.loads((tmp_path / "out" / "privacy.json").read_text())
    for key in ("epsilon", "delta", "unit_of_privacy", "accountant", "sampling_assumption", "steps",
                "noise_multiplier", "not_covered_by_epsilon", "statement"):
        assert card[key] is not None, key
    assert card["steps"] == 2 and card["unit_of_privacy"] == "example-level"
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "## Privacy" in readme and "Not covered by ε" in readme
    # no exact diagnostic: neither a key for one nor any value of the run's losses or metrics
    everything = readme + json.dumps(card)
    assert not {"diagnostics", "final_eval", "eval", "train_loss", "loss", "metrics"} & set(card)
    records = [json.loads(line) for line in (gpt2_run / "metrics.jsonl").read_text().splitlines()]
    exact = [v for r in records for v in (r.get("diagnostics") or {}).values() if isinstance(v, float)]
    exact += [v for v in RunDir(gpt2_run).summary().get("final_eval", {}).values() if isinstance(v, float)]
    assert exact and not [v for v in exact if repr(v) in everything or f"{v:.4g}" in everything]


def test_an_existing_non_empty_folder_is_refused_unless_forced(gpt2_run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(DpclipError, match="not empty") as info:
        export_run(gpt2_run, out)
    assert "--force" in info.value.hint and (out / "keep.txt").exists()
    export_run(gpt2_run, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no staging left


def test_an_unknown_checkpoint_names_the_available_ones(gpt2_run, tmp_path):
    with pytest.raises(DpclipError, match="no checkpoint") as info:
        export_run(gpt2_run, tmp_path / "out", checkpoint="step_000099")
    assert "step_000002" in info.value.hint
    with pytest.raises(DpclipError):
        export_run(gpt2_run, tmp_path / "out", checkpoint="../../etc")
    assert export_run(gpt2_run, tmp_path / "out", checkpoint="step_000000").checkpoint == "step_000000"


def test_the_export_command_writes_the_folder_and_reports_epsilon(cli, gpt2_run, tmp_path):
    result = cli("export", gpt2_run, tmp_path / "out", "--json")
    assert result.code == 0, result.err
    payload = json.loads(result.out)
    assert payload["kind"] == "transformers" and payload["privacy"]["epsilon"] > 0
    again = cli("export", gpt2_run, tmp_path / "out")
    assert again.code != 0 and "error:" in again.err and "--force" in again.err


def test_a_lora_exports_base_folder_is_owner_only(lora_run, tmp_path):
    """Every folder of an export is 0700, the base model's that save_pretrained makes too."""
    import os
    import stat

    before = os.umask(0o022)
    try:
        export_run(lora_run, tmp_path / "out")
    finally:
        os.umask(before)
    assert stat.S_IMODE((tmp_path / "out" / "base").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o700
