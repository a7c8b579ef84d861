"""`dpclip train` with training.parallel: fsdp on 2 gloo ranks (docs/distributed.md, "Sharded
training"): the ledger is the one-process run's, the checkpoints hold the whole model, and a
run stopped and resumed ends with the weights, bit for bit, of the run that never stopped
(seeded: each rank's noise stream is restored from the checkpoint with its shards and the
optimizer's sharded state)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from dpclip.errors import DpclipError
from dpclip.files import read_jsonl
from dpclip.layout import MODEL_WEIGHTS
from dpclip.rundir.checkpoint import latest_checkpoint
from dpclip.train.workflow import train
from tests.distributed.fsdp_train_case import STOP, train_sharded
from tests.distributed.ranks import run_ranks
from tests.distributed.workers import small_recipe


def _weights(run_dir: Path) -> dict:
    return load_file(str(latest_checkpoint(run_dir) / MODEL_WEIGHTS))


# SGD without momentum keeps no state per parameter; AdamW keeps two sharded moments and a step count.
# (threshold policy, overrides). banded MF and BLT (fixed threshold): each rank correlates its
# own shard's noise, and its history or buffers must come back on resume.
OPTIMIZERS = {"sgd": ("quantile", []), "adamw": ("quantile", ["training.optimizer={kind: adamw, lr: 0.01}"]),
              "banded": ("layer", ["privacy.mechanism={kind: banded-mf, bands: 3}"]),
              "blt": ("layer", ["privacy.mechanism={kind: blt, buffers: 2}"])}


@pytest.fixture(scope="module", params=[pytest.param("sgd", marks=pytest.mark.slow),
                                        pytest.param("adamw", marks=pytest.mark.slow),
                                        pytest.param("banded", marks=pytest.mark.slow),
                                        pytest.param("blt", marks=pytest.mark.slow)])
def sharded_runs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    policy, overrides = OPTIMIZERS[request.param]
    errors = run_ranks(train_sharded, str(out), policy, *overrides)
    assert errors == [], errors
    out.joinpath("optimizer.txt").write_text(request.param)
    return out


def _reference(sharded_runs: Path, tmp_path: Path):
    policy, overrides = OPTIMIZERS[sharded_runs.joinpath("optimizer.txt").read_text()]
    return train(small_recipe(tmp_path / "runs", policy, *overrides), run_dir=tmp_path / "one")


def test_a_sharded_run_charges_the_ledger_of_one_process(sharded_runs, tmp_path):
    reference = _reference(sharded_runs, tmp_path)
    ours = json.loads((sharded_runs / "whole" / "ledger.json").read_text())
    assert ours == json.loads((reference.run_dir / "ledger.json").read_text())
    assert sum(entry["count"] for entry in ours["entries"]) == 6


def test_a_sharded_run_is_certified_whole_before_the_cut_and_says_so(sharded_runs):
    steps = [r for r in read_jsonl(sharded_runs / "whole" / "metrics.jsonl") if "diagnostics" in r]
    assert steps[0]["diagnostics"]["certificate"]["before"] == "sharding"
    assert all("certificate" not in r["diagnostics"] for r in steps[1:])


def test_a_sharded_checkpoint_holds_the_whole_model_as_one_process_writes_it(sharded_runs, tmp_path):
    reference = _reference(sharded_runs, tmp_path)
    ours, theirs = _weights(sharded_runs / "whole"), _weights(reference.run_dir)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    summary = json.loads((sharded_runs / "whole" / "summary.json").read_text())
    assert summary["steps_done"] == 6 and "accuracy" in summary["final_eval"]


def test_a_stopped_sharded_run_resumes_to_the_weights_of_the_run_that_never_stopped(sharded_runs):
    assert (sharded_runs / "split-first.txt").read_text() == f"interrupted {STOP}"
    whole, split = _weights(sharded_runs / "whole"), _weights(sharded_runs / "split")
    assert whole.keys() == split.keys()
    for name in whole:
        assert bool((whole[name] == split[name]).all()), name
    assert (json.loads((sharded_runs / "split" / "ledger.json").read_text())
            == json.loads((sharded_runs / "whole" / "ledger.json").read_text()))


def test_fsdp_in_one_process_is_refused_with_a_hint(tmp_path):
    with pytest.raises(DpclipError) as caught:
        train(small_recipe(tmp_path / "runs", "layer", "training.parallel=fsdp"), run_dir=tmp_path / "run")
    assert "one process" in caught.value.message and "--nproc" in caught.value.hint
    assert not (tmp_path / "run").exists()


def test_fsdp_with_pipeline_stages_is_refused_with_a_hint(tmp_path):
    with pytest.raises(DpclipError) as caught:
        train(small_recipe(tmp_path / "runs", "layer", "training.parallel=fsdp",
                           "clipping.grouping={stages: ['^1$', '^3$']}"), run_dir=tmp_path / "run")
    assert "one process" in caught.value.message or "stages" in caught.value.message
