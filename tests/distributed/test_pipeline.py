"""Per-device clipping on 2 pipeline stages gives the one-process ``stages`` grouping (docs/distributed.md).

Two gloo ranks, one stage each (torch.distributed.pipelining), against one process with the
whole model and ``clipping.grouping: {stages: ...}``: the same clipped, summed gradients (at noise
0), the same per-stage thresholds (adaptive: quantile), the same noise std per group and the
same σ_eff (so the same ledger entry), with the last micro-batch padded on the pipeline.
"""

from __future__ import annotations

import json

import pytest
import torch

from safetensors.torch import load_file

from dpclip import release
from dpclip.files import read_jsonl
from dpclip.train.workflow import train
from tests.distributed.pipeline_case import CASES, one_process, pipeline_recipe, pipeline_worker
from tests.distributed.ranks import run_ranks


# every test reads the module fixture's pipeline launches (or launches its own): slow
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    assert run_ranks(pipeline_worker, str(out), list(CASES)) == []
    return [torch.load(out / f"pipeline-{rank}.pt") for rank in range(2)] + [out / "run"]


def _merged_grads(stages, name, step):
    grads = {}
    for rank in range(2):
        grads.update(stages[rank][name][step]["grads"])
    return grads


@pytest.mark.parametrize("name", ["fixed", "fixed-list", "quantile", "flat", "fixed-rounds", "flat-rounds"])
def test_two_stages_clip_and_sum_as_the_one_process_stages_grouping(stages, name):
    whole = one_process(name.removesuffix("-rounds"))   # how the batch is chunked changes no sum
    for step in range(2):
        piped = _merged_grads(stages, name, step)
        assert sorted(piped) == sorted(whole[step]["grads"])   # every parameter, each on one stage
        for key, grad in whole[step]["grads"].items():
            torch.testing.assert_close(piped[key], grad, rtol=1e-10, atol=1e-12)
        report = stages[0][name][step]
        assert report["samples"] == whole[step]["samples"] == 24   # padding rows are not examples
        torch.testing.assert_close(report["thresholds"], whole[step]["thresholds"])
        torch.testing.assert_close(report["clip_fraction"], whole[step]["clip_fraction"])
        assert report["groups"] == whole[step]["groups"]


def test_adaptive_stage_thresholds_move_apart(stages):
    # step 2's thresholds come from step 1's per-stage counts: a test of the per-stage update
    first, second = stages[0]["quantile"][0]["thresholds"], stages[0]["quantile"][1]["thresholds"]
    assert not torch.allclose(first, second)


@pytest.mark.parametrize("name", ["noise-global", "noise-equal-budget"])
def test_stages_draw_the_noise_std_and_sigma_eff_of_one_process(stages, name):
    # step 1 only for the stds: a noisy quantile count moves step 2's thresholds differently in each run
    whole = one_process(name)
    for rank in range(2):
        torch.testing.assert_close(stages[rank][name][0]["noise_std_sum"], whole[0]["noise_std_sum"])
        for step in range(2):  # σ_eff joins the per-stage counts' releases: as one process's K-vector
            assert stages[rank][name][step]["noise_multiplier"] == pytest.approx(whole[step]["noise_multiplier"], rel=1e-12)


def test_per_device_clipping_sends_no_per_sample_norms(stages):
    # equal-budget with fixed thresholds: nothing at all besides the pipeline's own activations
    assert stages[0]["noise-equal-budget"][-1]["sent_bytes"] == 0
    # flat clipping all-reduces B float64 norms² per micro-batch: 3 micro-batches of 10, 2 steps
    assert stages[0]["flat"][-1]["sent_bytes"] == 2 * 3 * 10 * 8


def test_per_device_clipping_frees_each_micro_batch_where_flat_clipping_holds_the_round(stages):
    # the last stage clips each chunk at its own backward; flat waits for the other stage's norms
    assert stages[1]["fixed"][-1]["stash_peak"] < stages[1]["flat"][-1]["stash_peak"]


def _weights(run_dir):
    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    return load_file(run_dir / "checkpoints" / latest / "model.safetensors")


def test_a_pipeline_run_trains_the_weights_ledger_and_thresholds_of_one_process(stages, tmp_path):
    torch.set_num_threads(1)
    piped = stages[2]
    whole = train(pipeline_recipe(tmp_path / "runs"), run_dir=tmp_path / "one").run_dir
    mine, theirs = _weights(piped), _weights(whole)
    assert sorted(mine) == sorted(theirs)
    for key in theirs:  # noise std 1e-6·C/B per step: far below the tolerance
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=1e-6)
    assert (piped / "ledger.json").read_text() == (whole / "ledger.json").read_text()
    statement = json.loads((piped / "summary.json").read_text())["statement"]
    assert any(line.startswith("distribution: pipeline of 2 stages") for line in statement)
    assert release.unlisted(piped) == [] and release.unlisted_fields(piped) == []   # docs/accounting.md
    ours = [r for r in read_jsonl(piped / "metrics.jsonl") if "diagnostics" in r]
    reference = [r for r in read_jsonl(whole / "metrics.jsonl") if "diagnostics" in r]
    assert len(ours) == len(reference) == 6
    # the whole model checked before the cut, on training rows (docs/certificate.md)
    assert ours[0]["diagnostics"]["certificate"]["before"] == "the pipeline cut"
    assert all("certificate" not in r["diagnostics"] for r in ours[1:])
    for a, b in zip(ours, reference):  # the same batches, per-stage thresholds and groups
        assert a["diagnostics"]["batch_size"] == b["diagnostics"]["batch_size"]
        assert a["thresholds"] == pytest.approx(b["thresholds"], rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", ["banded", "blt"])
def test_pipeline_stages_correlate_their_own_noise_and_charge_the_ledger_of_one_process(mechanism, tmp_path):
    """Banded MF and BLT on 2 stages: each stage keeps the history (or buffers) of its own
    parameters only, the run charges exactly the one-process ledger, and trains its weights
    (noise 1e-6 per step)."""
    from dpclip.files import read_json
    from dpclip.rundir.checkpoint import latest_checkpoint, unflatten_state
    from tests.distributed.pipeline_case import correlated_pipeline_worker, correlated_recipe

    torch.set_num_threads(1)
    assert run_ranks(correlated_pipeline_worker, str(tmp_path), mechanism) == []
    piped = tmp_path / "run"
    whole = train(correlated_recipe(tmp_path / "runs", mechanism), run_dir=tmp_path / "one").run_dir
    assert (piped / "ledger.json").read_text() == (whole / "ledger.json").read_text()
    mine, theirs = _weights(piped), _weights(whole)
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=1e-5)
    checkpoint = latest_checkpoint(piped)
    tree = unflatten_state(read_json(checkpoint / "state.json"), load_file(str(checkpoint / "state.safetensors")))
    kept = []
    for rank in range(2):
        correlation = tree["ranks"][rank]["engine"]["correlation"]
        assert correlation["step"] == 30
        store = correlation["history"] if mechanism == "banded" else correlation["buffers"]
        kept.append(len(store))
    assert sum(kept) == len(mine) and all(kept)   # every parameter once, split over the stages


def test_a_buffer_the_second_stages_forward_writes_is_named_in_every_statement(tmp_path):
    """Only rank 0 writes plan.json and the statement, and rank 1's stage holds the counter: its
    name is gathered, as the checkpoint (the whole model) spells it (docs/distributed.md)."""
    from dpclip.rundir.run import spent
    from tests.distributed.pipeline_case import counting_pipeline_worker

    assert run_ranks(counting_pipeline_worker, str(tmp_path)) == []
    run_dir = tmp_path / "run"
    assert int(_weights(run_dir)["4.calls"]) > 0   # rank 1's count, in rank 0's checkpoint
    assert json.loads((run_dir / "plan.json").read_text())["forward_written_state"] == ["4.calls"]
    summary = json.loads((run_dir / "summary.json").read_text())["statement"]
    for lines in (summary, spent(run_dir)[1].lines()):
        assert sum("model state written by each training forward (buffers 4.calls)" in line for line in lines) == 1
