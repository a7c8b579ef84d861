"""dpclip/rundir/checkpoint.py: weights that reload exactly, tied ones included, and the
model description an export needs (docs/export.md)."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_model

from dpclip.data import load_data
from dpclip.errors import DpclipError
from dpclip.models import build_model
from dpclip.recipe.schema import BuiltinData, HFModel
from dpclip.rundir.checkpoint import load_weights, save_checkpoint

TINY_GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 32}
TINY_BERT = {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
             "intermediate_size": 32, "max_position_embeddings": 32}


@pytest.fixture(scope="module")
def text():
    return load_data(BuiltinData(source="builtin", name="synthetic-text", num_examples=20, max_length=24), seed=0)


@pytest.fixture(scope="module")
def cuisine():
    return load_data(BuiltinData(source="builtin", name="synthetic-cuisine", num_examples=20, max_length=24), seed=0)


def _gpt2(text, seed):
    model, _ = build_model(HFModel(kind="hf", task="causal-lm", config=TINY_GPT2), text, seed=seed)
    return model.eval()


def _logits(model, data):
    with torch.no_grad():
        return model(input_ids=data.train["input_ids"][:4]).logits


def test_a_tied_gpt2_checkpoint_reloads_to_identical_logits(text, tmp_path):
    model = _gpt2(text, seed=0)
    with torch.no_grad():
        model.transformer.wte.weight.add_(1.0)   # the tied weight differs from a fresh model's
    path = save_checkpoint(tmp_path, 3, model, {"step": 3}, keep=2)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    # stored once, under the name transformers saves it by
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    assert json.loads((path / "model.json").read_text())["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    fresh = _gpt2(text, seed=1)
    assert not torch.equal(_logits(fresh, text), _logits(model, text))
    load_weights(path, fresh)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(_logits(fresh, text), _logits(model, text))


def test_model_json_holds_the_transformers_config_and_the_label_names(cuisine, tmp_path):
    model, _ = build_model(HFModel(kind="hf", task="sequence-classification", config=TINY_BERT), cuisine)
    path = save_checkpoint(tmp_path, 0, model, {"step": 0}, keep=1)
    info = json.loads((path / "model.json").read_text())
    assert cuisine.label_names and info["label_names"] == cuisine.label_names
    assert info["hf_config"]["model_type"] == "bert" and info["hf_class"] == "BertForSequenceClassification"
    assert info["hf_config"]["id2label"] == {str(i): n for i, n in enumerate(cuisine.label_names)}
    assert info["model"]["kind"] == "hf" and info["input_shape"] == [24]


def test_a_checkpoint_written_by_safetensors_save_model_still_loads(text, tmp_path):
    model = _gpt2(text, seed=0)
    (tmp_path / "old").mkdir()
    save_model(model, str(tmp_path / "old" / "model.safetensors"))   # how checkpoints were written before
    fresh = _gpt2(text, seed=1)
    load_weights(tmp_path / "old", fresh)
    assert torch.equal(_logits(fresh, text), _logits(model, text))


def test_weights_of_another_model_are_a_clear_error(text, tmp_path):
    path = save_checkpoint(tmp_path, 0, _gpt2(text, seed=0), {"step": 0}, keep=1)
    other, _ = build_model(HFModel(kind="hf", task="causal-lm", config={**TINY_GPT2, "n_layer": 2}), text)
    with pytest.raises(DpclipError, match="does not match the model"):
        load_weights(path, other)


def test_a_run_without_checkpoints_is_told_apart_from_one_whose_checkpoints_were_removed(tmp_path):
    from dpclip import layout
    from dpclip.audit.report import resolve_target
    from dpclip.rundir.checkpoint import missing_checkpoint_hint

    run = tmp_path / "run"
    run.mkdir()
    (run / layout.RECIPE).write_text("name: x\n")
    with pytest.raises(DpclipError, match="no checkpoint") as fresh:
        resolve_target(run)
    assert "train the run first" in fresh.value.hint
    import json

    import dp_accounting

    from dpclip.accounting.ledger import Ledger
    trained = Ledger(1e-5)
    trained.record(dp_accounting.GaussianDpEvent(1.0))
    (run / layout.LEDGER).write_text(json.dumps(trained.to_dict()))   # it trained; then someone deleted checkpoints/
    with pytest.raises(DpclipError, match="no checkpoint") as removed:
        resolve_target(run)
    assert "the run trained" in removed.value.hint and "restore" in removed.value.hint
    assert "train the run first" not in removed.value.hint
    assert missing_checkpoint_hint(run) == removed.value.hint


def test_checkpoints_past_step_999999_keep_the_newest(tmp_path):
    """The folders' names grow a seventh digit; sorted as text, the newest was deleted at once."""
    from dpclip.rundir.checkpoint import latest_checkpoint, save_checkpoint

    model = torch.nn.Linear(2, 1)
    for step in (999_980, 999_990, 1_000_000, 1_000_010):
        save_checkpoint(tmp_path, step, model, {"step": step}, keep=2)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept == ["step_1000000", "step_1000010"]
    assert latest_checkpoint(tmp_path).name == "step_1000010"


def test_a_checkpoint_renamed_away_mid_rewrite_is_named_with_how_to_restore_it(tmp_path):
    from dpclip.rundir.checkpoint import latest_checkpoint, save_checkpoint

    final = save_checkpoint(tmp_path, 5, torch.nn.Linear(2, 1), {"step": 5}, keep=2)
    final.rename(final.with_name(".step_000005.old"))     # as replace_dir_atomic leaves it between its renames
    with pytest.raises(DpclipError) as info:
        latest_checkpoint(tmp_path)
    assert "rewritten" in info.value.message and "mv " in info.value.hint and ".step_000005.old" in info.value.hint


def test_a_run_killed_before_its_first_checkpoint_is_told_it_released_nothing(tmp_path):
    """Killed before step 0's checkpoint: its ledger.json holds no step. Told to restore a backup
    it never had, the user would be stuck; the run spent nothing and can be started again."""
    import json

    from dpclip import layout
    from dpclip.accounting.ledger import Ledger
    from dpclip.rundir.checkpoint import missing_checkpoint_hint

    run = tmp_path / "run"
    run.mkdir()
    (run / layout.LEDGER).write_text(json.dumps(Ledger(1e-5).to_dict()))
    hint = missing_checkpoint_hint(run)
    assert "released nothing" in hint and "backup" not in hint and str(run) in hint
    (run / layout.SUMMARY).write_text("{}")   # a summary: it did train
    assert "backup" in missing_checkpoint_hint(run)


def test_a_checkpoint_is_synced_to_disk_before_latest_names_it(tmp_path, monkeypatch):
    """safetensors writes without fsync and a rename is an entry of its folder: after a power loss LATEST (and
    the ledger written before it) could name a checkpoint whose weights never reached the disk. Each file and
    folder is synced before the rename that makes it current, and the folder after it."""
    import os

    import dpclip.files

    synced, renamed, fsync = [], [], os.fsync

    def recorded_fsync(handle):
        synced.append(os.readlink(f"/proc/self/fd/{handle}"))
        return fsync(handle)

    real_replace = os.replace

    def recorded_replace(source, target):
        renamed.append((str(target), len(synced)))
        return real_replace(source, target)

    monkeypatch.setattr(dpclip.files.os, "fsync", recorded_fsync)
    monkeypatch.setattr(dpclip.files.os, "replace", recorded_replace)
    folder = save_checkpoint(tmp_path, 3, torch.nn.Linear(2, 2), {"step": 3, "x": torch.ones(2)}, keep=2)
    root = folder.parent
    made_current = next(count for target, count in renamed if target == str(folder))
    before = synced[:made_current]
    for name in ("model.safetensors", "state.safetensors"):   # (the JSON files: synced as their temporaries)
        assert any(path.endswith(f".step_000003.staging/{name}") for path in before), (name, before)
    assert any(path.endswith(".step_000003.staging") for path in before)
    latest_renamed = next(count for target, count in renamed if target == str(root / "LATEST"))
    assert str(root) in synced[latest_renamed:]   # the folder holding both renames, synced after them
