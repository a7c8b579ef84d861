"""2 gloo ranks give what 1 process gives (docs/distributed.md, "Equivalence").

With the same sampled examples (seeded mode: the ranks' draws union to the one-process
batch) and the noise drawn once, by rank 0, from the one-process stream, a 2-rank run must
reach the same parameters (float tolerance: the sum over ranks adds in another order) and
write the same ledger, for all-layer, layer-wise and adaptive (quantile) clipping, for
shuffled batches (rank 0's permutation, interrupted and resumed) and for discriminative
clipping's top-fraction rule (the norms of the whole batch gathered over the ranks).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dpclip import release
from dpclip.train.workflow import train
from tests.distributed import workers
from tests.distributed.engine_case import CLIPPING, grads_for, step_grads
from tests.distributed.ranks import run_ranks

# every test reads the two-rank runs of one module fixture (two process launches): slow
pytestmark = pytest.mark.slow

POLICIES = list(workers.POLICIES)


def _weights(run_dir):
    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    return load_file(run_dir / "checkpoints" / latest / "model.safetensors")


def _statement(run_dir):
    return json.loads((run_dir / "summary.json").read_text())["statement"]


def _ledger_entries(run_dir):
    return json.loads((run_dir / "ledger.json").read_text())["entries"]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """One spawn of 2 ranks trains the three recipes and runs the engine case."""
    out = tmp_path_factory.mktemp("ranks")
    assert run_ranks(workers.train_policies, str(out), POLICIES) == []
    return out


def test_engine_sums_over_ranks_at_noise_zero_as_one_process(two_rank_runs):
    split = torch.load(two_rank_runs / "engine.pt")
    for name in CLIPPING:
        whole = grads_for(name)
        for step in whole:
            for a, b in zip(whole[step]["grads"], split[name][step]["grads"]):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(whole[step]["thresholds"], split[name][step]["thresholds"])
            torch.testing.assert_close(whole[step]["clip_fraction"], split[name][step]["clip_fraction"])
            assert whole[step]["samples"] == split[name][step]["samples"] == 24


def test_top_fraction_ranks_the_whole_batch_across_ranks(two_rank_runs):
    """The rule's cut falls inside the batch (some samples clipped at large, others at small),
    and a rank with an empty part still joins the norm exchange: the gradient is the one
    process's, whose top set differs from each rank's own top set."""
    split = torch.load(two_rank_runs / "engine.pt")
    whole = grads_for("top-fraction", steps=1)[0]
    separately = [grads_for("top-fraction", rank, 2, steps=1)[0]["grads"] for rank in (0, 1)]
    summed = [a + b for a, b in zip(*separately)]  # each rank ranking only its own half
    assert any(not torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(whole["grads"], summed))
    for a, b in zip(step_grads(), split["empty-part"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_shuffled_run_was_interrupted_and_resumed(two_rank_runs):
    assert (two_rank_runs / "shuffle-first.txt").read_text() == f"interrupted {workers.SHUFFLE_STOP}"


def test_a_resumed_rank_is_sent_its_own_state_and_none_of_rank_0s_generators(two_rank_runs):
    """On resume rank 0 broadcast the whole checkpoint: every rank's sampler state and rank 0's noise
    generators, from which rank 1 could regenerate rank 0's draws and the noise of the redone steps."""
    assert json.loads((two_rank_runs / "resume-received.json").read_text()) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_two_ranks_train_the_parameters_and_ledger_of_one_process(policy, two_rank_runs, tmp_path):
    torch.set_num_threads(1)
    one = tmp_path / policy
    train(workers.small_recipe(tmp_path / "runs", policy), run_dir=one)
    two = two_rank_runs / policy
    mine, theirs = _weights(one), _weights(two)
    assert mine.keys() == theirs.keys()
    for key in mine:
        torch.testing.assert_close(mine[key], theirs[key], rtol=1e-5, atol=1e-6)
    assert _ledger_entries(one) == _ledger_entries(two)
    # The statements differ only by the line that says how the run was distributed.
    statement_one, statement_two = _statement(one), _statement(two)
    assert [line for line in statement_two if not line.startswith("distribution:")] == statement_one
    assert not any(line.startswith("distribution:") for line in statement_one)
    steps_one = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    steps_two = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    # The realised batch (summed over ranks) and the thresholds match step by step.
    assert [r["diagnostics"]["batch_size"] for r in steps_one if "diagnostics" in r] == \
        [r["diagnostics"]["batch_size"] for r in steps_two if "diagnostics" in r]
    for a, b in zip(steps_one, steps_two):
        assert ("thresholds" in a) == ("thresholds" in b)
        if "thresholds" in a:
            assert a["thresholds"] == pytest.approx(b["thresholds"], rel=1e-5)


def test_a_two_rank_runs_statement_and_meta_name_its_two_processes(two_rank_runs):
    from dpclip.rundir.run import spent

    run = two_rank_runs / "layer"
    line = "distribution: data parallel over 2 processes (sharded Poisson sampling, noise drawn once by rank 0)"
    assert line in _statement(run)
    assert json.loads((run / "meta.json").read_text())["plan"]["world_size"] == 2
    _, statement = spent(run)  # what `dpclip account RUN_DIR` prints
    assert line in statement.lines() and statement.world_size == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_every_file_and_field_of_a_two_rank_run_is_in_the_release_manifest(policy, two_rank_runs):
    """Rank 0 alone writes: a distributed run's directory holds what the manifest classes
    (docs/accounting.md), and no rank adds a file or a field of its own."""
    run = two_rank_runs / policy
    assert release.unlisted(run) == []
    assert release.unlisted_fields(run) == []


def test_a_perturbed_rank_is_detected(two_rank_runs, tmp_path):
    """The comparison above can fail: another learning rate in one process moves the weights."""
    one = tmp_path / "lr"
    train(workers.small_recipe(tmp_path / "runs", "layer", "training.optimizer.lr=0.45"), run_dir=one)
    mine, theirs = _weights(one), _weights(two_rank_runs / "layer")
    assert any(not torch.allclose(mine[k], theirs[k], rtol=1e-5, atol=1e-6) for k in mine)


def test_a_two_rank_run_refuses_a_one_process_resume(two_rank_runs, capsys):
    from dpclip.cli.main import main

    code = main(["train", "--resume", str(two_rank_runs / "layer"), "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "trained by 2 ranks, and this resume has 1" in err
    assert "hint:" in err and "--nproc 2" in err
